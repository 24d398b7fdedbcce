"""Layers at every depth, with values checked against computations done by hand."""

from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import models
import peex_interop as px
from models import MLP, Deep, tokens, transformer

# Hand computations here repeat the model's own operations: a tighter tolerance.
close = partial(models.close, tol=1e-6)


def test_lists_dicts_sequential_and_helper_methods():
    model = Deep(key=jax.random.key(0))
    x = jnp.arange(3.0)
    out, log = px.ForwardHook(model, log_fn=px.IdentityLog())(x)
    assert set(log) == {
        "layers.0", "layers.1", "by_name.a", "seq", "seq.layers.0", "seq.layers.1",
        "seq.layers.2", "out", "helper",
    }  # `helper`: a method site of the root (as in peex, a bound method is a layer)
    h0 = model.layers[0](x)
    h1 = model.layers[1](jax.nn.relu(h0))
    ha = model.by_name["a"](jax.nn.relu(h1))
    s0 = model.seq.layers[0](ha)
    s2 = model.seq.layers[2](jnp.tanh(s0))
    close(log["layers.0"], h0)
    close(log["layers.1"], h1)
    close(log["by_name.a"], ha)
    close(log["helper"], ha)
    close(log["seq.layers.0"], s0)
    close(log["seq.layers.1"], jnp.tanh(s0))
    close(log["seq"], s2)
    close(log["out"], model.out(s2))
    close(out, model(x))


def test_scanned_stack_and_attention_internals_match_a_hand_loop():
    model = transformer()
    t = tokens()
    out, log = px.ForwardHook(model, log_fn=px.IdentityLog())(t)
    arrays, static = eqx.partition(model.blocks, eqx.is_array)

    @jax.jit
    def by_hand(t):
        # The scan unrolled, each block's internals stacked over the blocks (one compiled
        # reference instead of op-by-op dispatch and indexing in a Python loop).
        x = jax.vmap(model.embed)(t)
        embedded, steps = x, []
        for i in range(model.num_blocks):
            block = eqx.combine(jax.tree.map(lambda a, i=i: a[i], arrays), static)
            h = jax.vmap(block.norm1)(x)
            attn = block.attn(h, h, h)
            steps.append({
                "blocks.norm1": h,
                "blocks.attn.query_proj": jax.vmap(block.attn.query_proj)(h),
                "blocks.attn.value_proj": jax.vmap(block.attn.value_proj)(h),
                "blocks.attn": attn,
                "blocks.mlp.layers.0": jax.vmap(block.mlp.layers[0])(jax.vmap(block.norm2)(x + attn)),
            })
            x = block(x)
            steps[-1]["blocks"] = x
        head = jax.vmap(model.head)(x)
        return head, {"embed": embedded, "head": head, **jax.tree.map(lambda *s: jnp.stack(s), *steps)}

    expected_out, expected = by_hand(t)
    close(out, expected_out)
    for path, value in expected.items():
        close(log[path], value)


def test_edit_equals_hand_modified_model():
    model = MLP(3, 4, 2, key=jax.random.key(1))
    x = jnp.linspace(-1, 1, 3)
    hooked = px.ForwardHook(model, hook_fn=lambda y: 3.0 * y, where="linear1")
    edited = eqx.tree_at(
        lambda m: (m.linear1.weight, m.linear1.bias), model,
        (3.0 * model.linear1.weight, 3.0 * model.linear1.bias),
    )
    close(hooked(x)[0], edited(x))


class Twice(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x):
        return self.lin(jnp.tanh(self.lin(x)))


def test_repeated_calls_get_numbered_keys():
    model = Twice(eqx.nn.Linear(3, 3, key=jax.random.key(0)))
    x = jnp.ones(3)
    _, log = px.ForwardHook(model, log_fn=px.IdentityLog())(x)
    assert set(log) == {"lin", "lin@1"}
    close(log["lin"], model.lin(x))
    close(log["lin@1"], model(x))


class Scaled(eqx.nn.Linear):
    """Inherits `__call__` from Linear."""


class Shifted(eqx.nn.Linear):
    def __call__(self, x, *, key=None):
        return super().__call__(x) + 1.0


class Subclasses(eqx.Module):
    a: Scaled
    b: Shifted
    c: eqx.nn.Linear

    def __call__(self, x):
        return self.c(self.b(self.a(x)))


def test_inherited_call_and_super_call_are_hooked_once():
    keys = jax.random.split(jax.random.key(0), 3)
    model = Subclasses(Scaled(2, 2, key=keys[0]), Shifted(2, 2, key=keys[1]), eqx.nn.Linear(2, 2, key=keys[2]))
    x = jnp.ones(2)
    out, log = px.ForwardHook(model, log_fn=px.IdentityLog())(x)
    assert set(log) == {"a", "b", "c"}
    close(log["b"], model.b(model.a(x)))
    close(out, model(x))
    assert "__call__" not in vars(Scaled)  # the inherited method was restored by removal


def test_batchnorm_inside_sequential_with_state():
    keys = jax.random.split(jax.random.key(0), 2)
    model, state = eqx.nn.make_with_state(eqx.nn.Sequential)(
        [
            eqx.nn.Linear(3, 4, key=keys[0]),
            eqx.nn.BatchNorm(4, axis_name="batch", mode="batch"),
            eqx.nn.Linear(4, 2, key=keys[1]),
        ]
    )
    xs = jax.random.normal(jax.random.key(2), (5, 3))
    hooked = px.ForwardHook(model, log_fn=px.IdentityLog())
    batched = jax.vmap(lambda m, x, s: m(x, s), in_axes=(None, 0, None), out_axes=(0, None), axis_name="batch")
    (out, new_state), _ = jax.vmap(
        lambda x, s: hooked(x, s), in_axes=(0, None), out_axes=((0, None), 0), axis_name="batch"
    )(xs, state)
    ref_out, ref_state = batched(model, xs, state)
    close(out, ref_out)
    jax.tree.map(close, new_state, ref_state)


def test_pre_and_post_hooks_are_independent_and_pre_sees_kwargs():
    model = Deep(key=jax.random.key(0))
    x = jnp.ones(3)

    def pre(args_kwargs):
        args, kwargs = args_kwargs
        return (args[0] * 0.5,), kwargs

    hooked = px.ForwardHook(
        model, log_fn=px.IdentityLog(), pre_hook_fn=pre,
        pre_log_fn=lambda ak: {"x": ak[0][0], "kwargs": ak[1]}, where="out",
    )
    out, log = hooked(x)
    halfway = model.seq(model.by_name["a"](jax.nn.relu(model.layers[1](jax.nn.relu(model.layers[0](x))))))
    close(log["out:in"]["x"], 0.5 * halfway)
    assert log["out:in"]["kwargs"] == {}
    close(log["out"], model.out(0.5 * halfway))
    close(out, model.out(0.5 * halfway))


class Outer(eqx.Module):
    inner: px.ForwardHook
    head: eqx.nn.Linear

    def __call__(self, x):
        y, inner_log = self.inner(x)
        return self.head(y), inner_log


def test_hooked_model_inside_hooked_model():
    mlp = MLP(2, 3, 2, key=jax.random.key(0))
    outer = Outer(px.ForwardHook(mlp, log_fn=px.IdentityLog()), eqx.nn.Linear(2, 1, key=jax.random.key(1)))
    x = jnp.ones(2)
    (out, inner_log), outer_log = px.ForwardHook(outer, log_fn=px.MeanLog())(x)
    assert set(inner_log) == {"linear1", "linear2"}
    # The wrapper adds no path segment: its model is the layer `inner`.
    assert set(outer_log) == {"inner", "inner.linear1", "inner.linear2", "head"}
    close(outer_log["inner"], jnp.mean(mlp(x)))
    close(outer_log["inner.linear2"], jnp.mean(inner_log["linear2"]))
    close(out, outer.head(mlp(x)))


@pytest.mark.parametrize("where", ["**.query_proj", "blocks.attn.*_proj", eqx.nn.LayerNorm])
def test_where_selects_inside_library_layers(where):
    model = transformer()
    _, log = px.ForwardHook(model, log_fn=px.MeanLog(), where=where)(tokens())
    expected = {
        "**.query_proj": {"blocks.attn.query_proj"},
        "blocks.attn.*_proj": {f"blocks.attn.{n}_proj" for n in ("query", "key", "value", "output")},
        eqx.nn.LayerNorm: {"blocks.norm1", "blocks.norm2"},
    }
    assert set(log) == expected[where]
