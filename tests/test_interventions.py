"""Issue 12: hooks that know where they run (`px.CallSite`), `{pattern: hook}` maps,
and one step of a scanned stack of layers (`where="blocks.1.attn"`) in Equinox, NNX
and Haiku stacks — each compared with a hand-edited forward pass, under
`eqx.filter_jit` and `jax.checking_leaks()`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import peex_interop as px
from models import MLP, close, jitted, nnx_scanned_stack, tokens, transformer

W, STEPS = 3, 3


@pytest.fixture(scope="module")
def model():
    return transformer(num_blocks=STEPS)


def manual(model, x, edit_attn=lambda i, a: a):
    """The Transformer's forward pass written out, block by block; `edit_attn(i, out)`
    edits block i's attention output. Returns (output, attention outputs)."""
    h = jax.vmap(model.embed)(x)
    arrays, static = eqx.partition(model.blocks, eqx.is_array)
    attns = []
    for i in range(model.num_blocks):
        block = eqx.combine(jax.tree.map(lambda a: a[i], arrays), static)
        normed = jax.vmap(block.norm1)(h)
        attn = edit_attn(i, block.attn(normed, normed, normed))
        attns.append(attn)
        h = h + attn
        h = h + jax.vmap(block.mlp)(jax.vmap(block.norm2)(h))
    return jax.vmap(model.head)(h), jnp.stack(attns)


def test_site_describes_the_call():
    mlp = MLP(2, 4, 3, key=jax.random.key(0))
    seen = {}

    def hook(value, site):
        seen[site.key] = (site.path, site.kind, site.module_type, site.call_index, site.indices, site.step)
        return value

    class Twice(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x):
            return self.lin(self.lin(x))

    px.ForwardHook(mlp, hook_fn=hook)(jnp.ones(2))
    assert seen["linear1"] == ("linear1", "linear", eqx.nn.Linear, 0, (), None)
    twice = Twice(eqx.nn.Linear(2, 2, key=jax.random.key(1)))
    px.ForwardHook(twice, hook_fn=hook)(jnp.ones(2))
    assert seen["lin@1"][:4] == ("lin", "linear", eqx.nn.Linear, 1)


def test_site_aware_hook_edits_per_layer():
    # One hook, a different edit per layer (by path and by repeat index).
    mlp = MLP(2, 4, 3, key=jax.random.key(0))
    x = jnp.asarray([0.5, -1.0])
    scale = {"linear1": 2.0, "linear2": -1.0}
    out, log = jitted(px.ForwardHook(mlp, hook_fn=lambda v, site: v * scale[site.path], log_fn=px.IdentityLog()), x)
    first = mlp.linear1(x) * 2.0
    expected = mlp.linear2(jax.nn.relu(first)) * -1.0
    close(out, expected)
    close(log["linear1"], first)


def test_site_indices_inside_a_vmap():
    # The example index inside a vmap body: each example gets its own edit.
    class Batched(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, xs):
            return jax.vmap(self.lin)(xs)

    model = Batched(eqx.nn.Linear(W, W, key=jax.random.key(0)))
    xs = jnp.arange(12.0).reshape(4, W) / 10
    out, _ = jitted(px.ForwardHook(model, hook_fn=lambda v, site: v + site.indices[-1]), xs)
    close(out, jax.vmap(model.lin)(xs) + jnp.arange(4.0)[:, None])


def test_hook_and_log_subclasses_take_the_site():
    class Tag(px.AbstractLog):
        def __call__(self, value, site):
            return jnp.asarray(len(site.path))

    mlp = MLP(2, 4, 3, key=jax.random.key(0))
    _, log = px.ForwardHook(mlp, log_fn=Tag())(jnp.ones(2))
    assert int(log["linear1"]) == len("linear1")


@pytest.mark.parametrize("step", [0, 2])
def test_one_step_of_an_equinox_stack(model, step):
    x = tokens()
    hooked = px.ForwardHook(model, hook_fn=lambda a: a * 2, log_fn=px.IdentityLog(), where=f"blocks.{step}.attn")
    out, log = jitted(hooked, x)
    expected, attns = manual(model, x, lambda i, a: a * 2 if i == step else a)
    assert set(log) == {f"blocks.{step}.attn"}
    close(out, expected)
    close(log[f"blocks.{step}.attn"], attns[step])


def test_whole_stack_logs_every_step(model):
    x = tokens()
    _, log = jitted(px.ForwardHook(model, log_fn=px.IdentityLog(), where="blocks.attn"), x)
    _, attns = manual(model, x)
    close(log["blocks.attn"], attns)


def test_hook_map_first_match_wins(model):
    x = tokens()
    hooks = {"blocks.1.attn": lambda a: a * 0.0, "blocks.attn": lambda a: a * 3, "head": lambda y: -y}
    out, _ = jitted(px.ForwardHook(model, hook_fn=hooks), x)
    expected, _ = manual(model, x, lambda i, a: a * 0.0 if i == 1 else a * 3)
    close(out, -expected)


def test_log_map_logs_named_layers_only(model):
    _, log = jitted(px.ForwardHook(model, log_fn={"head": px.MeanLog(), "blocks.norm*": px.IdentityLog()}), tokens())
    assert set(log) == {"head", "blocks.norm1", "blocks.norm2"}
    assert log["head"].shape == (5,)  # one mean per position: the head runs under a vmap


def test_step_errors(model):
    x = tokens()
    with pytest.raises(px.HookError, match="step 7 of a stack of 3"):
        px.ForwardHook(model, where="blocks.7.attn")(x)
    with pytest.raises(px.HookError, match=r"'blocks\.attn\.9' selected no call"):
        px.ForwardHook(model, where="blocks.attn.9")(x)


def check_step_one(out, log, key, kernels, biases, x):
    """A stack of `tanh(h @ kernel + bias)` steps hooked at step 1 by `+1`, logged under
    `key`: the output and the log equal the loop written out."""
    h, logged = x, None
    for i in range(STEPS):
        y = h @ kernels[i] + biases[i]
        if i == 1:
            logged = y = y + 1
        h = jnp.tanh(y)
    assert set(log) == {key}
    close(out, h)
    close(log[key], logged)


def check_backward_step_one(model, x, key, kernels, biases):
    """A stack of `tanh(h @ kernel + bias)` steps with a BackwardHook at step 1 (`key`)
    that doubles and logs the cotangent of that step's output: the log and the input's
    gradient equal the loop's, written out (`2 y - stop_gradient(y)` doubles it)."""

    def loop(x, delta):
        h = x
        for i in range(STEPS):
            y = h @ kernels[i] + biases[i]
            if i == 1:
                y = y + delta
                y = 2 * y - jax.lax.stop_gradient(y)
            h = jnp.tanh(y)
        return h

    def loss(out):
        return jnp.sum(jnp.sin(3 * out))

    grad_x, cotangent = jax.grad(lambda x, d: loss(loop(x, d)), argnums=(0, 1))(x, jnp.zeros(W))
    hooked = px.BackwardHook(model, hook_fn=lambda c: 2 * c, log_fn=px.IdentityLog(), where=key).init(x)
    with jax.checking_leaks():
        grads, grads_x = eqx.filter_jit(eqx.filter_grad(lambda hx: loss(hx[0](hx[1]))))((hooked, x))
    assert set(grads.log) == {key} and grads.log[key].shape == (W,)
    close(grads.log[key], cotangent)
    close(grads_x, grad_x)


def test_one_step_of_an_nnx_stack():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(W, W, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.lin(x))

    module = nnx_scanned_stack(Block, STEPS, nnx.Rngs(0))
    x = jnp.asarray([0.3, -0.2, 0.9])
    out, log = jitted(px.ForwardHook(px.from_nnx(module), hook_fn=lambda v: v + 1, log_fn=px.IdentityLog(),
                                     where="blocks.1.lin"), x)
    check_step_one(out, log, "blocks.1.lin", module.blocks.lin.kernel[...], module.blocks.lin.bias[...], x)
    check_backward_step_one(px.from_nnx(module), x, "blocks.1.lin", module.blocks.lin.kernel[...],
                            module.blocks.lin.bias[...])


def test_one_step_of_a_haiku_layer_stack():
    hk = pytest.importorskip("haiku")

    def forward(x):
        return hk.experimental.layer_stack(STEPS, name="blocks")(lambda h: jnp.tanh(hk.Linear(W, name="lin")(h)))(x)

    transformed = hk.without_apply_rng(hk.transform(forward))
    x = jnp.asarray([0.3, -0.2, 0.9])
    params = transformed.init(jax.random.key(0), x)
    model = px.from_haiku(transformed, params)
    # The stack's body calls no module of its own: the step follows the linear.
    out, log = jitted(px.ForwardHook(model, hook_fn=lambda v: v + 1, log_fn=px.IdentityLog(), where="blocks.lin.1"), x)
    check_step_one(out, log, "blocks.lin.1", params["blocks/lin"]["w"], params["blocks/lin"]["b"], x)
    check_backward_step_one(model, x, "blocks.lin.1", params["blocks/lin"]["w"], params["blocks/lin"]["b"])
    # The whole stack is named by its parameters' path, as px.module_paths lists it.
    _, whole = px.ForwardHook(model, log_fn=px.IdentityLog(), where="blocks.lin")(x)
    assert "blocks.lin" in px.module_paths(model) and whole["blocks.lin"].shape == (STEPS, W)


def test_backward_hook_at_one_step_of_an_equinox_stack(model):
    # The cotangent of step 1's attention output (per position: the block's own vmap)
    # logged; then zeroed there, while the other steps' flow as they were.
    x = tokens()
    grad = eqx.filter_jit(eqx.filter_grad(lambda h, x: jnp.sum(jnp.sin(h(x)))))
    with jax.checking_leaks():
        logged = grad(px.BackwardHook(model, log_fn=px.IdentityLog(), where="blocks.1.attn").init(x), x)
        zeroed = grad(px.BackwardHook(model, hook_fn=lambda c: 0 * c, where="blocks.1.attn").init(x), x)
    deltas = jnp.zeros((STEPS, *x.shape, 8))
    cotangents = jax.grad(lambda d: jnp.sum(jnp.sin(manual(model, x, lambda i, a: a + d[i])[0])))(deltas)
    assert set(logged.log) == {"blocks.1.attn"}
    close(logged.log["blocks.1.attn"], cotangents[1])
    cut = eqx.filter_grad(
        lambda m: jnp.sum(jnp.sin(manual(m, x, lambda i, a: jax.lax.stop_gradient(a) if i == 1 else a)[0]))
    )(model)
    jax.tree.map(close, zeroed.model, cut)
    # The edit changed the gradients (of the layers before step 1's attention).
    assert not all(map(jnp.allclose, jax.tree.leaves(zeroed.model), jax.tree.leaves(logged.model)))


def test_backward_hooks_take_the_site(model):
    # Cotangents of each step's attention output, scaled by (1 + step) in the log.
    x = tokens()
    hooked = px.BackwardHook(model, log_fn=lambda c, site: c * (1.0 + site.step), where="blocks.attn").init(x)
    with jax.checking_leaks():
        grads = eqx.filter_jit(eqx.filter_grad(lambda h, x: jnp.sum(jnp.sin(h(x)))))(hooked, x)
    deltas = jnp.zeros((STEPS, *tokens().shape, 8))
    cotangents = jax.grad(lambda d: jnp.sum(jnp.sin(manual(model, x, lambda i, a: a + d[i])[0])))(deltas)
    close(grads.log["blocks.attn"], cotangents * (1.0 + jnp.arange(STEPS))[:, None, None])


def test_one_step_of_a_linen_scan():
    nn = pytest.importorskip("flax.linen")

    class Step(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return jnp.tanh(nn.Dense(W, name="lin")(h)), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(Step, variable_axes={"params": 0}, split_rngs={"params": True}, length=STEPS)
            return stack(name="blocks")(x, None)[0]

    x = jnp.asarray([0.3, -0.2, 0.9])
    variables = Stack().init(jax.random.key(0), x)
    model = px.from_linen(Stack(), variables)
    out, log = jitted(px.ForwardHook(model, hook_fn=lambda v: v + 1, log_fn=px.IdentityLog(), where="blocks.1.lin"), x)
    dense = variables["params"]["blocks"]["lin"]
    check_step_one(out, log, "blocks.1.lin", dense["kernel"], dense["bias"], x)
    check_backward_step_one(model, x, "blocks.1.lin", dense["kernel"], dense["bias"])
