"""The transform matrix, around and inside hooked models, under `jax.checking_leaks()`."""

import re
from types import SimpleNamespace

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peex_interop as px
from models import Deep, close, tokens, transformer


def hooked_call(hooked, x):
    return hooked(x)


# jax.jit/checkpoint/cond take JAX types only: the hooked model (it holds functions,
# e.g. eqx.nn.Lambda) is closed over there, and passed as an argument to filter_jit.
AROUND = {
    "eager": lambda h, x: h(x),
    "jit": lambda h, x: jax.jit(lambda x: h(x))(x),
    "filter_jit": lambda h, x: eqx.filter_jit(hooked_call)(h, x),
    "remat": lambda h, x: jax.checkpoint(lambda x: h(x))(x),
    "cond": lambda h, x: jax.lax.cond(
        True, lambda x: h(x), lambda x: jax.tree.map(jnp.zeros_like, h(x)), x
    ),
}


@pytest.fixture(scope="module", params=["deep", "transformer"])
def case(request):
    """A model, an input, a batch of inputs, the model hooked to log every layer, and
    the eager hooked output and log every transform must reproduce (computed once)."""
    if request.param == "deep":
        model, xs = Deep(key=jax.random.key(0)), jax.random.normal(jax.random.key(1), (4, 3))
    else:
        model, xs = transformer(), jnp.stack([tokens(k) for k in range(4)])
    hooked = px.ForwardHook(model, log_fn=px.IdentityLog())
    out, log = hooked(xs[0])
    close(out, model(xs[0]))
    return SimpleNamespace(model=model, x=xs[0], xs=xs, hooked=hooked, out=out, log=log)


@pytest.mark.parametrize("transform", sorted(AROUND))
def test_around_gives_eager_values(transform, case):
    with jax.checking_leaks():
        out, log = AROUND[transform](case.hooked, case.x)
    close(out, case.out)
    assert set(log) == set(case.log)
    jax.tree.map(close, log, case.log)


def test_vmap_around_stacks_per_example(case):
    with jax.checking_leaks():
        out, log = jax.vmap(case.hooked)(case.xs)
        out_f, log_f = eqx.filter_vmap(case.hooked)(case.xs)
    # Per example, the jitted hooked call (equal to the eager one, above) as reference.
    reference = eqx.filter_jit(hooked_call)
    out, log, out_f, log_f = jax.tree.map(np.asarray, (out, log, out_f, log_f))
    for i in range(len(case.xs)):
        ref_out, ref_log = reference(case.hooked, case.xs[i])
        close(out[i], ref_out)
        jax.tree.map(lambda a, b, i=i: close(a[i], b), log, ref_log)
        jax.tree.map(lambda a, b, i=i: close(a[i], b), log_f, ref_log)


def test_scan_around_stacks_per_step():
    model = Deep(key=jax.random.key(0))
    hooked = px.ForwardHook(model, log_fn=px.MeanLog())
    xs = jax.random.normal(jax.random.key(1), (5, 3))
    with jax.checking_leaks():
        _, (outs, logs) = jax.lax.scan(lambda c, x: (c, hooked(x)), None, xs)
    for i in range(5):
        ref_out, ref_log = hooked(xs[i])
        close(outs[i], ref_out)
        jax.tree.map(lambda a, b: close(a[i], b), logs, ref_log)


def test_grad_around_with_logs_as_aux():
    model = transformer()
    t = tokens()
    hooked = px.ForwardHook(model, log_fn=px.MeanStdLog())

    def loss(h):
        out, log = h(t)
        return jnp.sum(out**2), log

    with jax.checking_leaks():
        grads, log = eqx.filter_jit(eqx.filter_grad(loss, has_aux=True))(hooked)
    ref = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(t) ** 2)))(model)
    jax.tree.map(close, eqx.filter(grads.model, eqx.is_array), eqx.filter(ref, eqx.is_array))
    jax.tree.map(close, log, hooked(t)[1])


class Inside(eqx.Module):
    """Layers under transforms applied inside the model's own code."""

    a: eqx.nn.Linear
    b: eqx.nn.Linear
    c: eqx.nn.Linear
    stack: eqx.nn.Linear  # weights with a leading axis of 3

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.a = eqx.nn.Linear(3, 3, key=keys[0])
        self.b = eqx.nn.Linear(3, 3, key=keys[1])
        self.c = eqx.nn.Linear(3, 3, key=keys[2])
        self.stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 3, key=k))(jax.random.split(keys[3], 3))

    def __call__(self, x):
        # Layers are passed in as operands: under jax.checking_leaks, JAX itself
        # (without hooks) rejects `eqx.filter_checkpoint(module)` and a module used as
        # a cond branch (measured on jax 0.12 / equinox 0.13.8).
        x = jax.checkpoint(lambda a, x: jnp.tanh(a(x)))(self.a, x)
        x = eqx.filter_checkpoint(lambda b, x: b(x))(self.b, x)
        x = jax.lax.cond(jnp.sum(x) > 0, lambda c, x: c(x), lambda c, x: -x, self.c, x)
        # A stack of layers run in parallel on one input with eqx.filter_vmap.
        ys = eqx.filter_vmap(lambda layer, x: layer(x), in_axes=(eqx.if_array(0), None))(self.stack, x)
        return jnp.sum(ys, axis=0)


def test_transforms_inside_the_model():
    model = Inside(jax.random.key(0))
    x = jnp.array([0.5, 0.2, -0.1])
    with jax.checking_leaks():
        eqx.filter_jit(hooked_call)(model, x)  # the model alone is leak-free
        out, log = eqx.filter_jit(hooked_call)(px.ForwardHook(model, log_fn=px.IdentityLog()), x)
        eager_out, eager_log = px.ForwardHook(model, log_fn=px.IdentityLog())(x)
    close(out, model(x))
    close(eager_out, model(x))
    assert set(log) == {"a", "b", "c", "stack"}
    ha = model.a(x)
    hb = model.b(jnp.tanh(ha))
    close(log["a"], ha)
    close(log["b"], hb)
    taken = bool(jnp.sum(hb) > 0)
    close(log["c"], model.c(hb) if taken else jnp.zeros(3))
    hc = model.c(hb) if taken else -hb
    stack_ref = jnp.stack([(model.stack.weight[i] @ hc + model.stack.bias[i]) for i in range(3)])
    close(log["stack"], stack_ref)
    jax.tree.map(close, eager_log, log)


def test_backward_through_transforms_inside_the_model():
    model = Inside(jax.random.key(0))
    x = jnp.array([0.5, 0.2, -0.1])
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog()).init(x)
    with jax.checking_leaks():
        grads = eqx.filter_jit(eqx.filter_grad(lambda h, x: jnp.sum(h(x) ** 2)))(hooked, x)
    assert grads.log["stack"].shape == (3, 3)
    hb = model.b(jnp.tanh(model.a(x)))
    hc = model.c(hb) if bool(jnp.sum(hb) > 0) else -hb
    ys = jnp.stack([(model.stack.weight[i] @ hc + model.stack.bias[i]) for i in range(3)])
    close(grads.log["stack"], jax.grad(lambda ys: jnp.sum(jnp.sum(ys, 0) ** 2))(ys))


class Untreaded(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, xs):
        # A while_loop cannot return stacked per-step values: logs are refused.
        return jax.lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, self.lin(c[1])), (0, xs))[1]


def test_a_vmap_given_a_keyword_argument_its_in_axes_cannot_map_raises_as_jax_does():
    # Keyword arguments of a vmapped call are mapped along axis 0 whatever in_axes says:
    # a scalar one is JAX's to refuse, with the same message hooked as unhooked.
    class Scaled(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, xs, scale):
            return jax.vmap(lambda x, scale: self.lin(x) * scale, in_axes=(0, None))(xs, scale=scale)

    model, xs = Scaled(eqx.nn.Linear(3, 2, key=jax.random.key(0))), jnp.ones((4, 3))
    with pytest.raises(ValueError) as unhooked:
        model(xs, jnp.float32(2))
    # JAX's words (0.12.1: "keyword arguments are always mapped along their leading
    # axis"; up to 0.12.0 it refuses the in_axes instead), the same hooked.
    words = str(unhooked.value).splitlines()[0]
    with pytest.raises(ValueError, match=re.escape(words)):
        px.ForwardHook(model, log_fn=px.IdentityLog())(xs, jnp.float32(2))


def test_untreaded_transform_raises_naming_the_layer():
    model = Untreaded(eqx.nn.Linear(3, 3, key=jax.random.key(0)))
    xs = jnp.ones(3)
    with pytest.raises(px.TransformError, match=r"\['lin'\].*jax.lax.while_loop"):
        px.ForwardHook(model, log_fn=px.IdentityLog())(xs)
    # Edits are refused too (a trace under an unthreaded transform may be replayed).
    with pytest.raises(px.TransformError, match=r"\['lin'\]"):
        px.ForwardHook(model, hook_fn=lambda y: 2 * y)(xs)
    # A selection that leaves the layer out runs.
    close(px.ForwardHook(model, hook_fn=lambda y: 2 * y, where=lambda path, module: False)(xs)[0], model(xs))


class BoundedLoop(eqx.Module):
    lin: eqx.nn.Linear
    kind: str = eqx.field(static=True)

    def __call__(self, x):
        body = lambda c: (c[0] + 1, jnp.tanh(self.lin(c[1])))
        return eqxi.while_loop(lambda c: c[0] < 3, body, (0, x), max_steps=5, kind=self.kind)[1]


def test_equinox_bounded_while_loops_log_each_step_padded_and_other_kinds_are_refused():
    # Nested scans of a cond: a row per step of the scans, zeros where no step ran.
    model, x = BoundedLoop(eqx.nn.Linear(3, 3, key=jax.random.key(0)), "bounded"), jnp.linspace(-1.0, 1.0, 3)
    out, log = px.ForwardHook(model, log_fn=px.IdentityLog())(x)
    steps, h = [], x
    for _ in range(3):
        steps.append(model.lin(h))
        h = jnp.tanh(steps[-1])
    assert jnp.array_equal(out, model(x))
    assert log["lin"].shape == (16, 3)
    assert jnp.allclose(log["lin"][:3], jnp.stack(steps)) and not jnp.any(log["lin"][3:])
    with pytest.raises(px.TransformError, match=r"\['lin'\].*while_loop"):
        px.ForwardHook(BoundedLoop(model.lin, "checkpointed"), log_fn=px.IdentityLog())(x)
