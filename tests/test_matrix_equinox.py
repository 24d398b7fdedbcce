"""Issue 9's transform matrix for Equinox models: every layer call under a JAX transform
is hooked (logs equal an independent reference, edits land exactly where selected,
cotangent logs equal `jax.grad` of the reference) or refused with `px.TransformError`
naming the layer — eager and under `eqx.filter_jit`, around a layer and nested inside
another transform, all under `jax.checking_leaks()`.

Each case is a pair: `model(layer, x)` runs the layer under the transform; `reference(
layer, x, delta)` computes the same thing without it (Python loops, `jnp.where` for
branches), adding `delta` to the layer's outputs and returning `(output, layer
outputs)`: the log at `delta = 0`, the edited output at `delta = 1`, cotangents as the
gradient with respect to `delta`.
"""

import dataclasses
import textwrap
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import peex_interop as px
from models import close, run_on_8_cpu_devices

STEPS = 3


def batch(x):
    return jnp.stack([x, -2 * x, x + 1, 0.5 * x])


def branch_index(x):
    return jnp.where(jnp.sum(x) > 0, 2, 1)


# jax.jit created before hooking began: traced in a deferred scope, its logs carried out.
_PRECOMPILED = jax.jit(lambda layer, x: layer(x))


@dataclasses.dataclass(frozen=True)
class Case:
    model: Callable
    reference: Callable | None  # None: refused
    log_shape: tuple = ()  # of one example's log
    refused_under_jit: bool = False  # traced loop bounds are concrete when eager


def _scan_reference(layer, x, delta):
    ys, c = [], x
    for k in range(STEPS):
        y = layer(c) + delta[k]
        ys.append(y - delta[k])
        c = jnp.tanh(y)
    return c, jnp.stack(ys)


def _branch_reference(layer, x, delta, *, taken):
    y = layer(x) + delta
    return jnp.where(taken, y, -x), jnp.where(taken, y - delta, 0.0)


def _switch_reference(layer, x, delta):
    index = branch_index(x)
    y = jnp.where(index == 2, layer(2 * x), 0.0) + delta
    out = jnp.where(index == 2, y, 3 * x)
    return out, jnp.where(index == 2, y - delta, 0.0)


def _vmap_reference(layer, x, delta):
    y = jax.vmap(layer)(batch(x)) + delta
    return jnp.tanh(y), y - delta


def _fori(upper_of):
    def model(layer, x):
        return jax.lax.fori_loop(0, upper_of(x), lambda i, c: jnp.tanh(layer(c)), x)

    return model


def _while(layer, x):
    return jax.lax.while_loop(
        lambda carry: carry[0] < STEPS, lambda carry: (carry[0] + 1, jnp.tanh(layer(carry[1]))), (0, x)
    )[1]


CASES = {
    "vmap": Case(lambda lin, x: jnp.tanh(jax.vmap(lin)(batch(x))), _vmap_reference, (4, 3)),
    "vmap_operand": Case(
        lambda lin, x: jnp.tanh(jax.vmap(lambda m, v: m(v), in_axes=(None, 0))(lin, batch(x))),
        _vmap_reference,
        (4, 3),
    ),
    "scan": Case(
        lambda lin, x: jax.lax.scan(lambda c, _: (jnp.tanh(lin(c)), None), x, None, length=STEPS)[0],
        _scan_reference, (STEPS, 3)),
    "cond_positional": Case(
        lambda lin, x: jax.lax.cond(jnp.sum(x) > 0, lambda m, v: m(v), lambda m, v: -v, lin, x),
        lambda lin, x, d: _branch_reference(lin, x, d, taken=jnp.sum(x) > 0), (3,)),
    "cond_keyword": Case(
        lambda lin, x: jax.lax.cond(jnp.sum(x) > 0, true_fun=lambda v: lin(v), false_fun=lambda v: -v, operand=x),
        lambda lin, x, d: _branch_reference(lin, x, d, taken=jnp.sum(x) > 0), (3,)),
    "switch_operands": Case(
        lambda lin, x: jax.lax.switch(
            branch_index(x), [lambda m, v: m(v), lambda m, v: 3 * v, lambda m, v: m(2 * v)], lin, x
        ),
        _switch_reference, (3,)),
    "map": Case(lambda lin, x: jnp.tanh(jax.lax.map(lin, batch(x))), _vmap_reference, (4, 3)),
    "map_batch_size": Case(lambda lin, x: jax.lax.map(lin, batch(x), batch_size=2), None),
    "fori_static": Case(_fori(lambda x: STEPS), _scan_reference, (STEPS, 3)),
    "fori_traced_bounds": Case(
        _fori(lambda x: jnp.where(jnp.sum(x) > -1e9, STEPS, 0)), _scan_reference, (STEPS, 3), refused_under_jit=True
    ),
    "while_loop": Case(_while, None),
    "nested_jit": Case(
        lambda lin, x: jax.jit(lambda m, v: jnp.tanh(m(v)))(lin, x),
        lambda lin, x, d: (jnp.tanh(lin(x) + d), lin(x)), (3,)),
    "checkpoint_static_last": Case(
        lambda lin, x: jax.checkpoint(lambda m, v, n: n * m(v), static_argnums=(-1,))(lin, x, 2.0),
        lambda lin, x, d: (2.0 * (lin(x) + d), lin(x)), (3,)),
    "checkpoint_static_first": Case(
        lambda lin, x: jax.checkpoint(lambda n, m, v: n * m(v), static_argnums=(0,))(2.0, lin, x),
        lambda lin, x, d: (2.0 * (lin(x) + d), lin(x)), (3,)),
    "jit_created_before_hooking": Case(
        lambda lin, x: _PRECOMPILED(lin, x), lambda lin, x, d: (lin(x) + d, lin(x)), (3,)),
}


class Host(eqx.Module):
    layer: eqx.nn.Linear
    case: str = eqx.field(static=True)

    def __call__(self, x):
        return CASES[self.case].model(self.layer, x)


class JitHost(Host):
    """A submodule whose own method is `eqx.filter_jit`-compiled (created at class
    definition, before any hooking)."""

    @eqx.filter_jit
    def __call__(self, x):
        return CASES[self.case].model(self.layer, x)


class Outer(eqx.Module):
    host: Host
    nested: bool = eqx.field(static=True)

    def __call__(self, xs):
        if self.nested:
            return jax.vmap(self.host)(xs)
        return self.host(xs)


def reference(outer: Outer, x, delta):
    ref = CASES[outer.host.case].reference
    if outer.nested:
        return jax.vmap(lambda v, d: ref(outer.host.layer, v, d), )(x, delta)
    return ref(outer.host.layer, x, delta)


LAYER = eqx.nn.Linear(3, 3, key=jax.random.key(0))
X = jnp.array([0.5, -0.2, 0.3])
XS = batch(X) * jnp.array([[1.0], [1.0], [-1.0], [1.0]])  # both branches taken across the batch


def run_case(name, host_cls, mode, nested):
    outer = Outer(host_cls(LAYER, name), nested)
    x = XS if nested else X
    case = CASES[name]
    call = (lambda h, v: h(v)) if mode == "eager" else eqx.filter_jit(lambda h, v: h(v))
    refused = case.reference is None or (case.refused_under_jit and (mode == "filter_jit" or nested))
    forward = px.ForwardHook(outer, log_fn=px.IdentityLog(), where="host.layer")
    if refused:
        editing = px.ForwardHook(outer, hook_fn=lambda y: y + 1.0, where="host.layer")
        backward = px.BackwardHook(outer, log_fn=px.IdentityLog(), where="host.layer")
        for hooked in (forward, editing):
            with jax.checking_leaks(), pytest.raises(px.TransformError, match=r"host\.layer|Linear"):
                call(hooked, x)
        with pytest.raises(px.TransformError, match=r"host\.layer|Linear"):
            backward.init(x)
        return
    delta = jnp.zeros((len(XS), *case.log_shape) if nested else case.log_shape)
    ref_out, ref_log = reference(outer, x, delta)
    with jax.checking_leaks():
        out, log = call(forward, x)
        edited, _ = call(px.ForwardHook(outer, hook_fn=lambda y: y + 1.0, where="host.layer"), x)
    close(out, outer(x))
    close(out, ref_out)
    assert set(log) == {"host.layer"}
    close(log["host.layer"], ref_log)
    close(edited, reference(outer, x, jnp.ones_like(delta))[0])
    if case.refused_under_jit:
        return  # traced bounds make a while_loop, which JAX cannot differentiate
    with jax.checking_leaks():
        backward = px.BackwardHook(outer, log_fn=px.IdentityLog(), where="host.layer").init(x)
        grads = eqx.filter_grad(lambda h, v: jnp.sum(call(h, v) ** 2))(backward, x)
    cotangent = jax.grad(lambda d: jnp.sum(reference(outer, x, d)[0] ** 2))(delta)
    close(grads.log["host.layer"], cotangent)


@pytest.mark.parametrize("nested", [False, True], ids=["around", "nested_in_vmap"])
@pytest.mark.parametrize("mode", ["eager", "filter_jit"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_transform_matrix(name, mode, nested):
    run_case(name, Host, mode, nested)


@pytest.mark.parametrize("mode", ["eager", "filter_jit"])
@pytest.mark.parametrize("name", ["vmap", "scan", "cond_keyword", "switch_operands", "fori_static", "while_loop"])
def test_transform_matrix_in_a_jitted_submodule_method(name, mode):
    run_case(name, JitHost, mode, nested=False)


def test_threaded_transform_inside_an_unthreaded_one_is_refused():
    # Issue 9, defect 1: the vmap's logs must not be merged into the fori_loop's trace.
    class M(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, xs):
            bound = jnp.where(jnp.sum(xs) > -1e9, 1, 0)
            return jax.lax.fori_loop(0, bound, lambda i, y: jax.vmap(self.lin)(y), xs)

    hooked = px.ForwardHook(M(LAYER), log_fn=px.IdentityLog())
    with jax.checking_leaks(), pytest.raises(px.TransformError, match=r"\['lin'\].*fori_loop"):
        eqx.filter_jit(lambda h, v: h(v))(hooked, XS)
    backward = px.BackwardHook(M(LAYER), log_fn=px.IdentityLog())
    with pytest.raises(px.TransformError, match="lin"):
        eqx.filter_jit(lambda h, v: h.init(v))(backward, XS)


SHARD_MAP_SCRIPT = textwrap.dedent(
    """
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax import shard_map as bound_shard_map  # bound before peex_interop is imported
    import peex_interop as px
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

    class Sharded(eqx.Module):
        lin: eqx.nn.Linear
        nested: bool = eqx.field(static=True)
        bound: bool = eqx.field(static=True, default=False)

        def __call__(self, xs):
            def local(layer, x):
                ys = jax.vmap(layer)(x)
                if self.nested:  # a threaded transform inside the shard_map body
                    ys = jax.lax.scan(lambda c, y: (c, layer(y)), None, ys)[1]
                return jnp.tanh(ys)

            shard_map = bound_shard_map if self.bound else jax.shard_map
            return shard_map(local, mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d"))(self.lin, xs)

    lin = eqx.nn.Linear(3, 3, key=jax.random.key(0))
    xs = jax.device_put(jax.random.normal(jax.random.key(1), (16, 3)), NamedSharding(mesh, P("d")))
    for nested, bound in ((False, False), (True, False), (False, True), (True, True)):
        model = Sharded(lin, nested, bound)
        first = jax.vmap(lin)(xs)
        expected = jax.vmap(lin)(first) if nested else first
        for call in (lambda h, x: h(x), eqx.filter_jit(lambda h, x: h(x))):
            with jax.checking_leaks():
                out, log = call(px.ForwardHook(model, log_fn=px.IdentityLog()), xs)
            np.testing.assert_allclose(out, model(xs), rtol=1e-5, atol=1e-6)
            keys = ["lin", "lin@1"] if nested else ["lin"]
            assert sorted(log) == keys, sorted(log)
            assert log["lin"].shape == (8, 2, 3), log["lin"].shape
            np.testing.assert_allclose(log["lin"].reshape(16, 3), first, rtol=1e-5, atol=1e-6)
            if nested:
                np.testing.assert_allclose(log["lin@1"].reshape(16, 3), expected, rtol=1e-5, atol=1e-6)
        backward = px.BackwardHook(model, log_fn=px.IdentityLog()).init(xs)
        grads = eqx.filter_grad(lambda h: jnp.sum(h(xs) ** 2))(backward)
        cot = jax.grad(lambda y: jnp.sum(jnp.tanh(jax.vmap(lin)(y) if nested else y) ** 2))(first)
        np.testing.assert_allclose(grads.log["lin"].reshape(16, 3), cot, rtol=1e-5, atol=1e-5)
    print("shard_map ok")
    """
)


def test_shard_map_on_8_simulated_devices():
    assert "shard_map ok" in run_on_8_cpu_devices(SHARD_MAP_SCRIPT)


class Attending(eqx.Module):
    """eqx.nn.MultiheadAttention (which vmaps its projections itself) under nested jits:
    eqx.filter_jit of the layer itself, and jax.jit closing over it."""

    attn: eqx.nn.MultiheadAttention

    def __call__(self, x):
        y = eqx.filter_jit(self.attn)(x, x, x)
        return jax.jit(lambda y: self.attn(y, y, y))(y)


def test_builtin_attention_inside_nested_jits():
    model = Attending(eqx.nn.MultiheadAttention(2, 4, key=jax.random.key(3)))
    x = jax.random.normal(jax.random.key(4), (5, 4))
    hooked = px.ForwardHook(model, log_fn=px.IdentityLog(), where="attn.query_proj")
    for call in (lambda h, v: h(v), eqx.filter_jit(lambda h, v: h(v))):
        with jax.checking_leaks():
            out, log = call(hooked, x)
        close(out, model(x))
        assert sorted(log) == ["attn.query_proj", "attn.query_proj@1"]
        close(log["attn.query_proj"], jax.vmap(model.attn.query_proj)(x))
        close(log["attn.query_proj@1"], jax.vmap(model.attn.query_proj)(model.attn(x, x, x)))


# Compiled at import, with a threaded transform inside and no layer.
_SQUASH = jax.jit(lambda y: jax.lax.cond(jnp.sum(y) > 0, jnp.tanh, jnp.sin, y))


class Squashed(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x):
        return _SQUASH(self.lin(x))


def test_layer_free_transforms_under_an_unthreaded_one_do_not_refuse_backward_logs():
    # The cond inside the jit receives the backward slots but attaches none: nothing
    # needs to leave the jit, so nothing is refused.
    model = Squashed(LAYER)
    backward = px.BackwardHook(model, log_fn=px.IdentityLog()).init(X)
    with jax.checking_leaks():
        grads = eqx.filter_grad(lambda h: jnp.sum(h(X) ** 2))(backward)
    y, pullback = jax.vjp(lambda y: jnp.sum(_SQUASH(y) ** 2), LAYER(X))
    close(grads.log["lin"], pullback(jnp.ones_like(y))[0])
