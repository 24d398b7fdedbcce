"""Logs, edits and cotangent slots cross transforms whatever Python reference reached
them: `from jax import vmap` bound before hooking, an alias module, `functools.partial`,
decorators applied at import, a jit compiled before the hooked call (issue 21)."""

import functools

import equinox as eqx
import jax
import jax.lax as L
import jax.numpy as jnp
import pytest
from jax import jit as bound_jit, vmap as bound_vmap
from jax.lax import cond as bound_cond, scan as bound_scan

import peex_interop as px
from models import close

LAYER = eqx.nn.Linear(3, 3, key=jax.random.key(0))
XS = jnp.array([[0.5, -0.2, 0.3], [1.0, 0.1, -0.4], [-0.3, 0.7, 0.2], [0.2, 0.2, -0.9]])


@functools.partial(jax.vmap, in_axes=(None, 0))
def _decorated_vmap(layer, x):
    return layer(x)


@jax.jit
def _decorated_jit(layer, x):
    return jax.vmap(layer)(x)


_compiled = jax.jit(lambda layer, x: jax.vmap(layer)(x))
_compiled(LAYER, XS)  # traced and compiled unhooked, before any hooked call


def _stacked(layer, xs):
    return jax.vmap(layer)(xs)


# style -> model(layer, xs): every one computes jnp.tanh(layer(x)) per row, the layer's log
# stacked per row; `cond` ones keep every row (the predicate holds).
STYLES = {
    "attribute_vmap": lambda m, xs: jax.vmap(m)(xs),
    "bound_vmap": lambda m, xs: bound_vmap(m)(xs),
    "partial_vmap": lambda m, xs: functools.partial(jax.vmap, in_axes=0)(m)(xs),
    "decorated_vmap": lambda m, xs: _decorated_vmap(m, xs),
    "bound_scan": lambda m, xs: bound_scan(lambda c, x: (c, m(x)), 0.0, xs)[1],
    "alias_map": lambda m, xs: L.map(m, xs),
    "bound_cond": lambda m, xs: bound_cond(jnp.all(xs < 10), lambda v: bound_vmap(m)(v), lambda v: v, xs),
    "bound_jit": lambda m, xs: bound_jit(lambda layer, v: jax.vmap(layer)(v))(m, xs),
    "decorated_jit": lambda m, xs: _decorated_jit(m, xs),
    "compiled_before_hooking": lambda m, xs: _compiled(m, xs),
}


class Host(eqx.Module):
    layer: eqx.nn.Linear
    style: str = eqx.field(static=True)

    def __call__(self, xs):
        return jnp.tanh(STYLES[self.style](self.layer, xs))


def _reference(delta):
    """(output, log) with `delta` added to the layer's per-row outputs, by hand."""
    pre = jax.vmap(LAYER)(XS)
    return jnp.tanh(pre + delta), pre


@pytest.mark.parametrize("mode", ["eager", "filter_jit"])
@pytest.mark.parametrize("style", sorted(STYLES))
def test_every_import_style_logs_edits_and_differentiates(style, mode):
    host = Host(LAYER, style)
    call = (lambda h, v: h(v)) if mode == "eager" else eqx.filter_jit(lambda h, v: h(v))
    ref_out, ref_log = _reference(jnp.zeros_like(XS))
    with jax.checking_leaks():
        out, log = call(px.ForwardHook(host, log_fn=px.IdentityLog(), where="layer"), XS)
        edited, _ = call(px.ForwardHook(host, hook_fn=lambda y: y + 1.0, where="layer"), XS)
        backward = px.BackwardHook(host, log_fn=px.IdentityLog(), where="layer").init(XS)
        grads = eqx.filter_grad(lambda h, v: jnp.sum(call(h, v) ** 2))(backward, XS)
    assert set(log) == {"layer"}
    close(out, ref_out)
    close(log["layer"], ref_log)
    close(edited, _reference(jnp.ones_like(XS))[0])
    close(grads.log["layer"], jax.grad(lambda d: jnp.sum(_reference(d)[0] ** 2))(jnp.zeros_like(XS)))


class Twice(eqx.Module):
    layer: eqx.nn.Linear

    def __call__(self, xs):
        # The same compiled function twice in one call (the second replays the first's
        # trace), around a direct call: numbered in call order.
        return _compiled(self.layer, xs) + self.layer(xs[0]) + _compiled(self.layer, 2 * xs)


def test_a_replayed_trace_is_renumbered_in_call_order():
    host = Twice(LAYER)
    with jax.checking_leaks():
        _, log = px.ForwardHook(host, log_fn=px.IdentityLog())(XS)
        hooked = px.BackwardHook(host, log_fn=px.IdentityLog()).init(XS)
        grads = eqx.filter_grad(lambda h, v: jnp.sum(h(v) ** 2))(hooked, XS)
    assert set(log) == {"layer", "layer@1", "layer@2"}
    close(log["layer"], jax.vmap(LAYER)(XS))
    close(log["layer@1"], LAYER(XS[0]))
    close(log["layer@2"], jax.vmap(LAYER)(2 * XS))
    total = jax.vmap(LAYER)(XS) + LAYER(XS[0]) + jax.vmap(LAYER)(2 * XS)
    close(grads.log["layer@1"], jnp.sum(2 * total, axis=0))
    close(grads.log["layer@2"], 2 * total)


class Unbatched(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x):
        return bound_vmap(lambda c: self.lin(x) * c)(jnp.arange(1.0, 4.0))


def test_a_layer_fed_an_unbatched_input_logs_per_example():
    x = jnp.ones(3)
    model = Unbatched(LAYER)
    _, log = px.ForwardHook(model, log_fn=px.IdentityLog())(x)
    close(log["lin"], jnp.broadcast_to(LAYER(x), (3, 3)))


def test_while_loop_is_refused_naming_the_transform():
    class Looped(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x):
            return L.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, self.lin(c[1])), (0, x))[1]

    with pytest.raises(px.TransformError, match=r"\['lin'\].*jax\.lax\.while_loop"):
        px.ForwardHook(Looped(LAYER), log_fn=px.IdentityLog())(XS[0])


@jax.custom_vjp
def _custom(layer_weight, x):
    return _CUSTOM_LAYER[0](x)


_custom.defvjp(lambda w, x: (_custom(w, x), None), lambda _, g: (None, g))
_CUSTOM_LAYER: list = []


class CustomVJP(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x):
        _CUSTOM_LAYER[:] = [self.lin]
        return _custom(self.lin.weight, x)


def test_a_layer_inside_a_custom_vjp_is_refused_naming_it_under_jit_and_autodiff():
    model = CustomVJP(LAYER)
    with pytest.raises(px.TransformError, match=r"\['lin'\].*jax\.custom_vjp"):
        eqx.filter_jit(lambda h, x: h(x))(px.ForwardHook(model, log_fn=px.IdentityLog()), XS[0])
    # Its slots are refused as soon as `.init` traces the model.
    with pytest.raises(px.TransformError, match=r"\['lin'\].*jax\.custom_vjp"):
        px.BackwardHook(model, log_fn=px.IdentityLog()).init(XS[0])
