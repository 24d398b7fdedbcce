"""Issue 41: logging code carries over. peex code runs on `peex_interop.peex` with
peex 0.0.3's keys and numbers (checked against peex itself); Flax's own
`nnx.capture`/`sow`/`perturb` test cases give Flax's values through px, without
`nnx.capture`; a Haiku interceptor written for `hk.intercept_methods` gives its
native records on a Haiku model, and the corresponding records on the model's NNX and
Equinox ports, under `jax.jit` and inside a vmap; a linen interceptor likewise on
linen and NNX."""

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import peex
import pytest
from flax import nnx

import peex_interop as px
from models import MLP, close
from peex_interop import peex as peex_surface


# -- peex --------------------------------------------------------------------------------
class Twice(eqx.Module):
    """A layer called twice, a helper method calling it again, and a layer given its
    input by keyword."""

    lin: eqx.nn.Linear
    head: eqx.nn.Linear

    def body(self, x):
        return jnp.tanh(self.lin(x))

    def __call__(self, x):
        h = self.body(self.lin(self.lin(x)))
        return self.head(x=h)


class Scaled(eqx.Module):
    """A layer given a keyword-only float array (peex passes it through a pre-hook)."""

    lin: eqx.nn.Linear

    def __call__(self, x):
        return self.sub(x, scale=jnp.array(0.5))

    def sub(self, x, *, scale):
        return self.lin(x) * scale


def twice():
    k1, k2 = jax.random.split(jax.random.key(0))
    return Twice(eqx.nn.Linear(3, 3, key=k1), eqx.nn.Linear(3, 2, key=k2))


def same(ours, theirs):
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)


@pytest.mark.parametrize("pre_hook", [False, True])
def test_peex_code_gives_peex_keys_and_numbers(pre_hook):
    x = jnp.arange(3.0)
    for model in (twice(), Scaled(eqx.nn.Linear(3, 3, key=jax.random.key(2))), MLP(3, 4, 2, key=jax.random.key(3))):
        logs = []
        for lib in (peex, peex_surface):
            out, log = lib.ForwardHook(model, log_fn=lib.IdentityLog(), pre_hook=pre_hook)(x)
            hooked = lib.BackwardHook(model, log_fn=lib.IdentityLog(), pre_hook=pre_hook).init(x)
            grads = eqx.filter_grad(lambda h, x: jnp.sum(jnp.sin(h(x))))(hooked, x)
            logs.append((out, log, grads.log))
        same(logs[1], logs[0])
    # What the default API gives instead, on the same model: every call, at every depth.
    _, log = px.ForwardHook(twice(), log_fn=px.IdentityLog())(x)
    assert set(log) == {"lin", "lin@1", "lin@2", "body", "head"}


def test_peex_layer_called_twice_keeps_the_last_call_and_sums_its_cotangents():
    model, x = twice(), jnp.arange(3.0)
    _, log = peex_surface.ForwardHook(model, log_fn=peex_surface.IdentityLog())(x)
    first = model.lin(x)
    np.testing.assert_array_equal(log["lin"], model.lin(first))  # the last call
    hooked = peex_surface.BackwardHook(model, log_fn=peex_surface.IdentityLog(), layer_names=["lin"]).init(x)
    grads = eqx.filter_grad(lambda h, x: jnp.sum(h(x) ** 2))(hooked, x)

    def loss(d0, d1):
        h = model.lin(model.lin(x) + d0) + d1
        return jnp.sum(model.head(model.body(h)) ** 2)

    g0, g1 = jax.grad(loss, argnums=(0, 1))(jnp.zeros(3), jnp.zeros(3))
    close(grads.log["lin"], g0 + g1, tol=1e-6)


def test_peex_errors_and_helper_methods():
    model, x = twice(), jnp.arange(3.0)
    with pytest.raises(AssertionError, match="does not have an attribute `nope`"):
        peex_surface.ForwardHook(model, layer_names=["nope"])(x)
    with pytest.raises(px.HookError):
        peex_surface.ForwardHook(model, layer_names=["nope"])(x)
    # `body` is a layer, as a bound method is a module in peex; `lin` called inside it
    # is the helper's own call, not the model's.
    _, log = peex_surface.ForwardHook(model, log_fn=peex_surface.IdentityLog(), layer_names=["body"])(x)
    np.testing.assert_array_equal(log["body"], model.body(model.lin(model.lin(x))))
    scaled = Scaled(eqx.nn.Linear(3, 3, key=jax.random.key(2)))
    _, log = peex_surface.ForwardHook(scaled, log_fn=peex_surface.IdentityLog(), pre_hook=True)(x)
    assert len(log["sub"]) == 1  # the keyword-only scale passes through, as in peex


# -- NNX sow, perturb and capture ---------------------------------------------------------
class Foo(nnx.Module):
    def __call__(self, x):
        x = self.perturb("grad_of_x", x)
        y = 3 * x
        self.sow(nnx.Intermediate, "y", y)
        return y


class Bar(nnx.Module):
    def __init__(self):
        self.foos = nnx.data([Foo() for _ in range(3)])

    def __call__(self, x):
        for block in self.foos:
            x = block(x)
        return x


def test_flax_nested_sow_and_perturb_from_a_python_scalar():
    # Flax's TestCapture.test_nested_modules: x = 1.0, grad_of_x of block i is
    # 3 ** (3 - i), y is 3 ** (i + 1).
    model = px.from_nnx(Bar())
    out, log = px.ForwardHook(model, log_fn=px.IdentityLog(), where=px.kind("sown"))(1.0)
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where="**.grad_of_x").init(1.0)
    grads = eqx.filter_grad(lambda h, x: h(x))(hooked, 1.0)
    inputs = px.BackwardHook(model, log_fn=px.IdentityLog(), pre_hook=True, where="foos.*").init(1.0)
    input_grads = eqx.filter_grad(lambda h, x: h(x))(inputs, 1.0)
    for i in range(3):
        assert log[f"foos.{i}.y"] == 3 ** (i + 1)
        assert grads.log[f"foos.{i}.grad_of_x"] == 3 ** (3 - i)
        assert input_grads.log[f"foos.{i}"] == (3 ** (3 - i),)  # a Python float has a cotangent
    assert out == 27.0


def test_flax_fwd_bwd_through_a_jitted_method():
    class Jitted(nnx.Module):
        @nnx.jit
        def __call__(self, x):
            x = self.perturb("grad_of_x", x)
            y = 3 * x
            self.sow(nnx.Intermediate, "y", y)
            return y

    model = px.from_nnx(Jitted())
    # The model's own sown values: `**.y` (a one-segment name is checked as a layer's).
    _, log = px.ForwardHook(model, log_fn=px.IdentityLog(), where="**.y")(1.0)
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where="**.grad_of_x").init(1.0)
    grads = eqx.filter_grad(lambda h, x: h(x))(hooked, 1.0)
    assert log["y"] == 3 and grads.log["grad_of_x"] == 3


def test_flax_per_example_perturbation_gradients_under_vmap():
    class Dot(nnx.Module):
        def __init__(self, dim):
            self.w = nnx.Param(jax.random.normal(jax.random.key(0), dim))

        def __call__(self, x):
            x = self.perturb("grad_of_x", x)
            y = jnp.dot(x, self.w)
            self.sow(nnx.Intermediate, "y", y)
            return y

    module = Dot(4)
    model, x = px.from_nnx(module), jnp.ones((3, 4))
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where="**.grad_of_x").init(x[0])
    grads = jax.vmap(lambda x: eqx.filter_grad(lambda h: h(x))(hooked).log["grad_of_x"])(x)
    np.testing.assert_allclose(grads, jnp.broadcast_to(module.w[...][None, :], (3, 4)))
    _, log = jax.vmap(px.ForwardHook(model, log_fn=px.IdentityLog(), where="**.y"))(x)
    assert log["y"].shape == (3,)


def test_flax_method_outputs_and_sow_mixed():
    class Inner(nnx.Module):
        def __init__(self, dim, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (dim, dim)))

        def __call__(self, x):
            return x @ self.w

        def process(self, x):
            return jnp.sin(x)

    class Outer(nnx.Module):
        def __init__(self, rngs):
            self.inner1 = Inner(8, rngs)
            self.inner2 = Inner(8, rngs)

        def __call__(self, x):
            x = self.inner1(x)
            x = self.inner2.process(x)
            self.sow(nnx.Intermediate, "intermediate", x)
            return jnp.cos(x)

    module, x = Outer(nnx.Rngs(0)), jnp.ones((4, 8))
    y, captured = nnx.capture(module, nnx.Intermediate, method_outputs=nnx.Intermediate)(x)
    out, log = px.ForwardHook(px.from_nnx(module), log_fn=px.IdentityLog())(x)
    assert set(log) == {"inner1", "inner2.process", "intermediate"}
    np.testing.assert_array_equal(out, y)
    np.testing.assert_array_equal(log["inner1"], captured["inner1"]["__call__"][0])
    np.testing.assert_array_equal(log["inner2.process"], captured["inner2"]["process"][0])
    np.testing.assert_array_equal(log["intermediate"], captured["intermediate"][0])


def test_flax_sown_attention_weights_are_the_weights_site():
    class Model(nnx.Module):
        def __init__(self, rngs):
            kwargs = dict(in_features=8, num_heads=8, kernel_init=nnx.initializers.ones_init(), decode=False)
            self.attention_layers = nnx.data([nnx.MultiHeadAttention(**kwargs, rngs=rngs) for _ in range(3)])

        def __call__(self, x, sow_weights=False):
            x = self.attention_layers[0](x, sow_weights=sow_weights)
            x = self.attention_layers[1](x)
            return self.attention_layers[2](x, sow_weights=sow_weights)

    module, x = Model(nnx.Rngs(0)), jax.random.normal(jax.random.key(1), (4, 6, 8))
    _, captured = nnx.capture(module, nnx.Intermediate)(x, True)
    where = ["**.attention_weights", "**.weights"]
    _, log = px.ForwardHook(px.from_nnx(module), log_fn=px.IdentityLog(), where=where)(x, True)
    assert set(log) == {f"attention_layers.{i}.{name}" for i in (0, 2) for name in ("attention_weights", "weights")} | {
        "attention_layers.1.weights"
    }
    for i in (0, 2):
        sown = log[f"attention_layers.{i}.attention_weights"]
        np.testing.assert_array_equal(sown, captured["attention_layers"][i]["attention_weights"][0])
        np.testing.assert_array_equal(sown, log[f"attention_layers.{i}.weights"])


def test_flax_scan_over_a_vmap_built_stack_sows_per_step():
    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(3, 3, rngs=rngs)

        def __call__(self, x, a):
            x = nnx.gelu(self.linear(x + a))
            self.sow(nnx.Intermediate, "data", x)
            return x, None

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.split_rngs(splits=5)(nnx.vmap(Layer, in_axes=0))(rngs)

        def __call__(self, x, a):
            return nnx.scan(lambda layer, x, a: layer(x, a), in_axes=(0, nnx.Carry, 0))(self.layers, x, a)

    module, x, a = Stack(nnx.Rngs(0)), jnp.ones((1, 3)), jnp.ones((5, 1, 3))
    (y, _), captured = nnx.capture(module, nnx.Intermediate)(x, a)
    with jax.checking_leaks():
        (out, _), log = eqx.filter_jit(lambda m, x, a: m(x, a))(
            px.ForwardHook(px.from_nnx(module), log_fn=px.IdentityLog(), where="**.data"), x, a
        )
    assert log["layers.data"].shape == (5, 1, 3)
    close(log["layers.data"], captured["layers"]["data"][0], tol=1e-6)
    close(out, y, tol=1e-6)


# -- interceptors ----------------------------------------------------------------------------
def haiku_recorder(records):
    """A Haiku interceptor as its users write it: `module_name/method_name` -> output."""

    def record(next_f, args, kwargs, context):
        out = next_f(*args, **kwargs)
        if context.method_name == "__call__":
            records[f"{context.module.module_name}/{context.method_name}"] = out
        return out

    return record


def haiku_mlp(x):
    return hk.nets.MLP([8, 3], name="mlp")(x)


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(5, 8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)])

    def __call__(self, x):
        return self.layers[1](jax.nn.relu(self.layers[0](x)))


class EqxBatched(eqx.Module):
    mlp: eqx.nn.MLP

    def __call__(self, x):
        return jax.vmap(self.mlp)(x)


def ported_mlps():
    x = jax.random.normal(jax.random.key(1), (2, 5))
    transformed = hk.without_apply_rng(hk.transform(haiku_mlp))
    haiku = px.from_haiku(transformed, transformed.init(jax.random.key(0), x))
    nnx_port, _ = px.port(haiku, px.from_nnx(NnxMlp(nnx.Rngs(1))), x)
    eqx_port, _ = px.port(haiku, EqxBatched(eqx.nn.MLP(5, 3, 8, depth=1, key=jax.random.key(2))), x)
    return transformed, haiku, nnx_port, eqx_port, x


def native_records(transformed, params, x):
    records = {}
    with_interceptor = hk.without_apply_rng(hk.transform(lambda x: _intercepted(records, x)))
    with_interceptor.apply(params, x)
    return records


def _intercepted(records, x):
    with hk.intercept_methods(haiku_recorder(records)):
        return haiku_mlp(x)


def recorded(model, x, jit):
    def run(model, x):
        records = {}
        return px.intercepted(model, haiku_recorder(records), records=records)(x), records

    return (eqx.filter_jit(run) if jit else run)(model, x)[1]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_haiku_interceptor_records_the_same_on_haiku_and_its_nnx_and_equinox_ports(jit):
    transformed, haiku, nnx_port, eqx_port, x = ported_mlps()
    native = native_records(transformed, haiku.params, x)
    assert set(native) == {"mlp/__call__", "mlp/~/linear_0/__call__", "mlp/~/linear_1/__call__"}
    ours = recorded(haiku, x, jit)
    assert set(ours) == set(native)
    for name in native:
        close(ours[name], native[name], tol=1e-6)
    names = {path: f"{native_name}/__call__" for path, native_name in haiku.haiku_names(x).items()}
    for port in (nnx_port, eqx_port):
        mapping = px.align(haiku, port, x).mapping
        records = recorded(port, x, jit)
        for haiku_path, port_path in mapping.items():
            close(records[f"{port_path}/__call__"], native[names[haiku_path]], tol=1e-5)


def test_a_haiku_interceptor_inside_a_vmap_records_per_example_without_leaking():
    def vmapped(x):
        return hk.vmap(haiku_mlp, split_rng=False)(x)

    transformed = hk.without_apply_rng(hk.transform(vmapped))
    x = jax.random.normal(jax.random.key(1), (4, 5))
    params = transformed.init(jax.random.key(0), x)
    with jax.checking_leaks():
        records = recorded(px.from_haiku(transformed, params), x, jit=True)
    per_example = [native_records(hk.without_apply_rng(hk.transform(haiku_mlp)), params, e[None]) for e in x]
    for name, value in records.items():
        assert value.shape[0] == 4
        close(value, jnp.concatenate([example[name] for example in per_example]), tol=1e-6)
    # nnx.vmap in an NNX port of the same model: one record per example too.

    class VmappedNnx(nnx.Module):
        def __init__(self, rngs):
            self.mlp = NnxMlp(rngs)

        def __call__(self, x):
            return nnx.vmap(lambda mlp, e: mlp(e), in_axes=(None, 0))(self.mlp, x)

    module = VmappedNnx(nnx.Rngs(0))
    with jax.checking_leaks():
        records = recorded(px.from_nnx(module), x, jit=True)
    assert set(records) == {"mlp/__call__", "mlp.layers.0/__call__", "mlp.layers.1/__call__"}
    first = module.mlp.layers[0]
    close(records["mlp.layers.0/__call__"], x @ first.kernel[...] + first.bias[...], tol=1e-6)


def test_a_linen_interceptor_records_the_same_on_linen_and_its_nnx_port():
    class LinenMlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))

    def linen_recorder(records):
        def record(next_f, args, kwargs, context):
            out = next_f(*args, **kwargs)
            if context.method_name == "__call__" and context.module.name is not None:
                records[context.module.name] = out
            return out

        return record

    x = jax.random.normal(jax.random.key(1), (2, 5))
    variables = LinenMlp().init(jax.random.key(0), x)
    native = {}
    with nn.intercept_methods(linen_recorder(native)):
        LinenMlp().apply(variables, x)
    linen = px.from_linen(LinenMlp(), variables)
    ours = {}
    px.intercepted(linen, linen_recorder(ours), records=ours)(x)
    assert set(ours) == set(native) == {"Dense_0", "Dense_1"}
    jax.tree.map(np.testing.assert_array_equal, ours, native)
    port, _ = px.port(linen, px.from_nnx(NnxMlp(nnx.Rngs(1))), x)
    mapping = px.align(linen, port, x).mapping
    records = {}
    px.intercepted(port, linen_recorder(records), records=records)(x)
    # On NNX, `context.module.name` is the last segment of the layer's path.
    assert set(records) == {"0", "1"}
    for linen_path, port_path in mapping.items():
        close(records[port_path.rpartition(".")[2]], native[linen_path], tol=1e-5)
