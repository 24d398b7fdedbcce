"""A shape-only pass must not change what the real pass computes.

`BackwardHook` runs parts of the model abstractly before the model runs them (a threaded
vmap/scan body, to find its backward slots; a cond's branches; the whole model in
`.init`). The libraries keep Python state that each trace advances (Haiku's module name
counters and key sequences, linen's rng counts and submodule names), so an extra
abstract run used to rename modules (`edge_1`: missing parameters) or change dropout
masks. References here are the plain models (`apply`, `jax.grad`, `jax.vjp`, hand
computations), never the package.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peex_interop as px
from models import close


def loss(y):
    return jnp.sum(jnp.sin(y))


def hooked_grads(hooked, *args):
    return eqx.filter_grad(lambda h: loss(h(*args)))(hooked)


# -- linen ---------------------------------------------------------------------------
nn = pytest.importorskip("flax.linen")


class DropBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.Dropout(0.5, deterministic=False)(nn.Dense(4)(x)), None


class ScannedDropout(nn.Module):
    """The repro of issue 22, item 1: dropout inside nn.scan, a head after it."""

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(
            DropBlock, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True}, length=3
        )
        return nn.Dense(2, name="head")(scan()(x, None)[0])


class DenseInVmapBody(nn.Module):
    """A submodule created inside a raw `jax.vmap` body (linen names it with its parent's
    cursor, at trace time) with dropout after it."""

    @nn.compact
    def __call__(self, x):
        y = jax.vmap(lambda row: nn.Dropout(0.5, deterministic=False)(nn.Dense(3)(row)))(x)
        return nn.Dense(2, name="head")(y)


def linen_case(module):
    x = jax.random.normal(jax.random.key(3), (2, 4))
    rngs = {"dropout": jax.random.key(7)}
    variables = module.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    return module, variables, x, rngs


@pytest.mark.parametrize("module", [ScannedDropout(), DenseInVmapBody()], ids=["nn_scan", "vmap_body"])
@pytest.mark.parametrize("where", ["head", None])
def test_linen_backward_hook_runs_the_plain_forward_pass(module, where):
    module, variables, x, rngs = linen_case(module)
    converted = px.from_linen(module, variables, rngs=rngs)
    expected = module.apply(variables, x, rngs=rngs)
    hooked = px.BackwardHook(converted, log_fn=px.IdentityLog(), where=where).init(x)
    np.testing.assert_array_equal(hooked(x), expected)
    np.testing.assert_array_equal(eqx.filter_jit(lambda h, x: h(x))(hooked, x), expected)

    grads = hooked_grads(hooked, x)
    reference = jax.grad(lambda p: loss(module.apply({**variables, "params": p}, x, rngs=rngs)))(variables["params"])
    jax.tree.map(close, grads.model.variables["params"], reference)
    # The head's output is the model's: its cotangent is the vjp of the loss there.
    _, vjp = jax.vjp(loss, expected)
    close(grads.log["head"], vjp(jnp.ones(()))[0])


# -- Haiku ---------------------------------------------------------------------------
hk = pytest.importorskip("haiku")


def edge_model(edges):
    """Graph-network style: the edge MLP is created inside the vmapped body."""
    y = jax.vmap(lambda e: hk.nets.MLP([4, 3], name="edge")(e))(edges)
    return hk.Linear(2, name="head")(y)


class EdgeFunction(hk.Module):
    """The same inside a module's method: named by the module's own counter."""

    def __call__(self, edges):
        return jax.vmap(lambda e: hk.Linear(3)(e))(edges)


def edge_function_model(edges):
    return hk.Linear(2, name="head")(EdgeFunction()(edges))


def haiku_case(fn, shape=(5, 2)):
    transformed = hk.transform(fn)
    x = jax.random.normal(jax.random.key(3), shape)
    # Haiku cannot create parameters inside a raw jax.lax.scan/cond (their initial
    # values would leak the body's tracers): those models are initialised by a twin that
    # creates the same modules outside, and applied as they are.
    params = hk.transform(_INIT_TWINS.get(fn, fn)).init(jax.random.key(0), x)
    return transformed, params, x


def test_haiku_module_created_in_a_vmap_body_under_backward_hook():
    transformed, params, edges = haiku_case(edge_model)
    assert set(params) == {"edge/~/linear_0", "edge/~/linear_1", "head"}
    model = px.from_haiku(transformed, params)
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog()).init(edges)
    assert set(hooked.log) == {"edge", "edge.linear_0", "edge.linear_1", "head"}
    expected = transformed.apply(params, None, edges)
    np.testing.assert_array_equal(hooked(edges), expected)

    grads = hooked_grads(hooked, edges)
    jax.tree.map(close, grads.model.params, jax.grad(lambda p: loss(transformed.apply(p, None, edges)))(params))
    # By hand: the MLP's output and its first layer's, then vjps of the rest.
    w0, b0 = params["edge/~/linear_0"]["w"], params["edge/~/linear_0"]["b"]
    w1, b1 = params["edge/~/linear_1"]["w"], params["edge/~/linear_1"]["b"]
    wh, bh = params["head"]["w"], params["head"]["b"]
    h0 = edges @ w0 + b0
    _, from_edge = jax.vjp(lambda y: loss(y @ wh + bh), jax.nn.relu(h0) @ w1 + b1)
    _, from_h0 = jax.vjp(lambda h: loss((jax.nn.relu(h) @ w1 + b1) @ wh + bh), h0)
    close(grads.log["edge"], from_edge(jnp.ones(()))[0])
    close(grads.log["edge.linear_1"], from_edge(jnp.ones(()))[0])
    close(grads.log["edge.linear_0"], from_h0(jnp.ones(()))[0])


def test_haiku_module_created_in_a_vmap_body_inside_a_module_method():
    transformed, params, edges = haiku_case(edge_function_model)
    assert set(params) == {"edge_function/linear", "head"}
    model = px.from_haiku(transformed, params)
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog()).init(edges)
    assert set(hooked.log) == {"edge_function", "edge_function.linear", "head"}
    expected = transformed.apply(params, None, edges)
    np.testing.assert_array_equal(eqx.filter_jit(lambda h, x: h(x))(hooked, edges), expected)
    grads = hooked_grads(hooked, edges)
    jax.tree.map(close, grads.model.params, jax.grad(lambda p: loss(transformed.apply(p, None, edges)))(params))
    inner, head = params["edge_function/linear"], params["head"]
    _, vjp = jax.vjp(lambda y: loss(y @ head["w"] + head["b"]), edges @ inner["w"] + inner["b"])
    close(grads.log["edge_function.linear"], vjp(jnp.ones(()))[0])


def linear_in_scan_body(x):
    def step(carry, _):
        return jnp.tanh(hk.Linear(5, name="cell")(carry)), None

    return jax.lax.scan(step, x, None, length=3)[0]


def test_haiku_linear_created_in_a_scan_body_under_backward_hook():
    transformed, params, x = haiku_case(linear_in_scan_body, (2, 5))
    assert set(params) == {"cell"}
    model = px.from_haiku(transformed, params)
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog()).init(x)
    expected = transformed.apply(params, None, x)
    np.testing.assert_array_equal(hooked(x), expected)
    grads = hooked_grads(hooked, x)
    jax.tree.map(close, grads.model.params, jax.grad(lambda p: loss(transformed.apply(p, None, x)))(params))
    # Per step, by hand: the cotangent of step t's pre-activation.
    w, b = params["cell"]["w"], params["cell"]["b"]

    def from_step(t, h):
        for _ in range(t):
            h = jnp.tanh(h @ w + b)
        pre = h @ w + b

        def rest(pre):
            h = jnp.tanh(pre)
            for _ in range(t + 1, 3):
                h = jnp.tanh(h @ w + b)
            return loss(h)

        return jax.grad(rest)(pre)

    close(grads.log["cell"], jnp.stack([from_step(t, x) for t in range(3)]))


def dropout_in_layer_stack(x):
    def block(x):
        return hk.dropout(hk.next_rng_key(), 0.5, jnp.tanh(hk.Linear(5, name="lin")(x)))

    return hk.Linear(2, name="head")(hk.experimental.layer_stack(3)(block)(x))


def linears_in_cond_branches(x):
    # Each branch creates a default-named module: the real cond names them `linear`
    # and `linear_1` as it traces them in turn, and so must the branches' shape pass.
    return jax.lax.cond(x.sum() > 0, lambda x: hk.Linear(5)(x), lambda x: -hk.Linear(5)(x), x)


_INIT_TWINS = {
    linear_in_scan_body: lambda x: hk.Linear(5, name="cell")(x),
    linears_in_cond_branches: lambda x: (hk.Linear(5)(x), hk.Linear(5)(x)),
}


@pytest.mark.parametrize("fn", [dropout_in_layer_stack, linears_in_cond_branches, edge_model])
def test_haiku_backward_hook_outputs_equal_apply_with_rng(fn):
    transformed, params, x = haiku_case(fn, (2, 5))
    rng = jax.random.key(5)
    model = px.from_haiku(transformed, params, rng=rng)
    expected = transformed.apply(params, rng, x)
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog()).init(x)
    np.testing.assert_array_equal(hooked(x), expected)
    grads = hooked_grads(hooked, x)
    jax.tree.map(close, grads.model.params, jax.grad(lambda p: loss(transformed.apply(p, rng, x)))(params))


# -- NNX -----------------------------------------------------------------------------
nnx = pytest.importorskip("flax.nnx")


class NnxDropBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.lin(x))


class NnxScannedDropout(nnx.Module):
    def __init__(self, rngs):
        keys = jax.random.split(rngs.params(), 3)
        self.blocks = nnx.vmap(lambda k: NnxDropBlock(nnx.Rngs(params=k, dropout=k)))(keys)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        x = nnx.scan(lambda x, b: b(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)
        return self.head(x)


def test_nnx_dropout_in_nnx_scan_under_backward_hook():
    model = NnxScannedDropout(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (2, 4))
    expected = nnx.clone(model)(x)
    hooked = px.BackwardHook(px.from_nnx(model), log_fn=px.IdentityLog()).init(x)
    np.testing.assert_array_equal(hooked(x), expected)
    grads = hooked_grads(hooked, x)

    def plain_loss(params):
        copy = nnx.clone(model)
        nnx.update(copy, params)
        return loss(copy(x))

    reference = jax.grad(plain_loss)(nnx.state(model, nnx.Param))
    close(grads.log["head"], jnp.cos(expected))
    jax.tree.map(close, nnx.state(px.to_nnx(grads.model), nnx.Param), reference)


# -- BackwardHook.init inside the user's own hk.transform ----------------------------
def mlp_body(x):
    return hk.nets.MLP([4, 3])(x)


def test_init_of_a_haiku_function_inside_the_users_transform_leaves_haiku_as_it_was():
    def fn(x):
        hooked = px.BackwardHook(px.haiku_function(mlp_body), log_fn=px.IdentityLog()).init(x)
        return hooked(x), hooked.log

    transformed = hk.transform(fn)
    x = jax.random.normal(jax.random.key(3), (2, 5))
    # Without it, init's abstract run creates `mlp`'s parameters (tracers that leak) and
    # the real run names the MLP `mlp_1`.
    params = transformed.init(jax.random.key(0), x)
    assert set(params) == {"mlp/~/linear_0", "mlp/~/linear_1"}
    out, log = transformed.apply(params, None, x)
    np.testing.assert_array_equal(out, hk.transform(mlp_body).apply(params, None, x))
    assert set(log) == {"mlp", "mlp.linear_0", "mlp.linear_1"}
