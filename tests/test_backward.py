"""Cotangent logs and edits, checked against `jax.vjp` of the sub-computations."""

from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp

import peex_interop as px
from models import MLP, Deep, close, tokens, transformer


def loss_of(output):
    return jnp.sum(jnp.sin(output) ** 2)


@eqx.filter_grad
def grads_of(hooked, *args):
    return loss_of(hooked(*args))


def test_cotangent_logs_equal_vjp_at_every_depth():
    model = Deep(key=jax.random.key(0))
    x = jnp.linspace(-1.0, 1.0, 3)
    grads = grads_of(px.BackwardHook(model, log_fn=px.IdentityLog()).init(x), x)

    h0 = model.layers[0](x)
    h1 = model.layers[1](jax.nn.relu(h0))
    ha = model.by_name["a"](jax.nn.relu(h1))
    s0 = model.seq.layers[0](ha)

    def rest_after_s0(s0):
        return loss_of(model.out(model.seq.layers[2](jnp.tanh(s0))))

    def rest_after_h0(h0):
        h1 = model.layers[1](jax.nn.relu(h0))
        return loss_of(model.out(model.seq(model.by_name["a"](jax.nn.relu(h1)))))

    close(grads.log["seq.layers.0"], jax.grad(rest_after_s0)(s0))
    close(grads.log["layers.0"], jax.grad(rest_after_h0)(h0))
    close(grads.log["out"], jax.grad(loss_of)(model(x)))
    # The model's own gradients are untouched by identity hooks.
    expected = eqx.filter_grad(lambda m: loss_of(m(x)))(model)
    jax.tree.map(close, eqx.filter(grads.model, eqx.is_array), eqx.filter(expected, eqx.is_array))


def test_cotangent_edit_equals_hand_modified_backward():
    model = MLP(3, 4, 2, key=jax.random.key(1))
    x = jnp.linspace(-1.0, 1.0, 3)
    hooked = px.BackwardHook(model, hook_fn=lambda ct: 0.5 * ct, where="linear1").init(x)
    grads = grads_of(hooked, x)
    plain = eqx.filter_grad(lambda m: loss_of(m(x)))(model)
    close(grads.model.linear2.weight, plain.linear2.weight)  # the edit acts below linear2
    close(grads.model.linear1.weight, 0.5 * plain.linear1.weight)
    close(grads.model.linear1.bias, 0.5 * plain.linear1.bias)


def test_pre_hook_logs_input_cotangents():
    model = MLP(3, 4, 2, key=jax.random.key(1))
    x = jnp.linspace(-1.0, 1.0, 3)
    grads = grads_of(px.BackwardHook(model, log_fn=px.IdentityLog(), pre_hook=True).init(x), x)
    h = jax.nn.relu(model.linear1(x))
    (ct,) = grads.log["linear2"]
    close(ct, jax.grad(lambda h: loss_of(model.linear2(h)))(h))


def test_forward_and_backward_on_one_model():
    model = MLP(3, 4, 2, key=jax.random.key(1))
    x = jnp.linspace(-1.0, 1.0, 3)
    both = px.BackwardHook(px.ForwardHook(model, log_fn=px.IdentityLog()), log_fn=px.IdentityLog()).init(x)

    @eqx.filter_grad(has_aux=True)
    def step(hooked, x):
        output, forward_log = hooked(x)
        return loss_of(output), forward_log

    grads, forward_log = step(both, x)
    assert set(forward_log) == set(grads.log) == {"linear1", "linear2"}
    close(forward_log["linear1"], model.linear1(x))
    close(grads.log["linear2"], jax.grad(loss_of)(model(x)))


class PerExample(eqx.Module):
    lin: eqx.nn.Linear
    head: eqx.nn.Linear

    def __call__(self, xs):
        return jnp.sum(jax.vmap(self.head)(jnp.tanh(jax.vmap(self.lin)(xs))))


def test_backward_inside_vmap_is_per_example_not_summed():
    keys = jax.random.split(jax.random.key(0), 2)
    model = PerExample(eqx.nn.Linear(3, 4, key=keys[0]), eqx.nn.Linear(4, 1, key=keys[1]))
    xs = jax.random.normal(jax.random.key(3), (6, 3))
    grads = grads_of(px.BackwardHook(model, log_fn=px.IdentityLog()).init(xs), xs)
    assert grads.log["lin"].shape == (6, 4)
    hs = jax.vmap(model.lin)(xs)
    _, vjp = jax.vjp(lambda hs: loss_of(jnp.sum(jax.vmap(model.head)(jnp.tanh(hs)))), hs)
    close(grads.log["lin"], vjp(1.0)[0])


def test_backward_inside_scan_is_per_step():
    model = transformer(num_blocks=3)
    t = tokens()
    grads = grads_of(px.BackwardHook(model, log_fn=px.IdentityLog(), where=["blocks", "head"]).init(t), t)
    arrays, static = eqx.partition(model.blocks, eqx.is_array)

    @jax.jit
    def loss_with(deltas):
        # The model's scan unrolled by hand, `deltas` added to each selected layer's output:
        # the gradient at zero is every cotangent at once.
        x = jax.vmap(model.embed)(t)
        for i in range(3):
            x = eqx.combine(jax.tree.map(lambda a: a[i], arrays), static)(x) + deltas["blocks"][i]
        return loss_of(jax.vmap(model.head)(x) + deltas["head"])

    expected = jax.grad(loss_with)({"blocks": jnp.zeros((3, *t.shape, 8)), "head": jnp.zeros((*t.shape, 11))})
    assert set(grads.log) == set(expected)
    jax.tree.map(partial(close, tol=1e-4), grads.log, expected)


def test_statistic_logs_of_cotangents():
    model = MLP(3, 4, 2, key=jax.random.key(1))
    x = jnp.linspace(-1.0, 1.0, 3)
    ident = grads_of(px.BackwardHook(model, log_fn=px.IdentityLog()).init(x), x)
    stats = grads_of(px.BackwardHook(model, log_fn=px.MeanStdLog()).init(x), x)
    close(stats.log["linear1"][0], jnp.mean(ident.log["linear1"]))
    close(stats.log["linear1"][1], jnp.std(ident.log["linear1"]))
