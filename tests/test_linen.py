"""Flax linen models converted with `px.from_linen`: outputs, names, logs against linen's
own `capture_intermediates` and against submodules called by hand, stacked logs through
linen's lifted transforms (where `capture_intermediates` returns nothing), backward logs
against gradients of the sub-computation, edits, collections, rngs, kinds and summaries,
training, patch scoping and threads."""


import pytest

pytest.importorskip("flax")  # skipped where the [flax] extra is not installed

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.core import axes_scan

import peex_interop as px
from models import close, slot_gradient_of_init_inside_the_vmap, while_hooked_elsewhere
from peex_interop._adapters import LinenModule, from_linen
from peex_interop._engine import _patching


# -- models ------------------------------------------------------------------------------
class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(5)(x))
        return nn.Dense(2)(h)


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.Dropout(0.5, deterministic=not train)(nn.relu(x))
        x = nn.ConvTranspose(3, (2, 2), strides=(2, 2))(x)
        return nn.Dense(2)(x.mean(axis=(1, 2)))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(h, h)
        return x + nn.Sequential([nn.Dense(8), nn.gelu, nn.Dense(4)], name="mlp")(nn.RMSNorm()(x))


class Transformer(nn.Module):
    def setup(self):
        self.embed = nn.Embed(11, 4)
        self.blocks = [Block() for _ in range(2)]
        self.head = nn.DenseGeneral((2, 3))

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Step(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + jnp.tanh(nn.Dense(4, name="lin")(nn.LayerNorm(name="norm")(x))), None


def scanned_steps(**options):
    return nn.scan(Step, variable_axes={"params": 0}, split_rngs={"params": True}, length=3, **options)


class Lifted(nn.Module):
    """nn.scan (a layer stack), nn.remat, nn.vmap (an ensemble) and nn.jit."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, name="inp")(x)
        x, _ = scanned_steps()(name="blocks")(x, None)
        x = nn.remat(nn.Dense)(4, name="rem")(x)
        x = nn.jit(nn.Dense)(4, name="jitted")(x)
        ensemble = nn.vmap(
            nn.Dense, variable_axes={"params": 0}, split_rngs={"params": True},
            in_axes=None, out_axes=0, axis_size=2,
        )
        return ensemble(2, name="ens")(x).mean(0)


class Recurrent(nn.Module):
    @nn.compact
    def __call__(self, xs):
        return nn.RNN(nn.LSTMCell(4), name="lstm")(xs) + nn.RNN(nn.GRUCell(4), name="gru")(xs)


def key(i):
    return jax.random.key(i)


MODELS = {
    "mlp": (MLP, lambda: jax.random.normal(key(1), (2, 3)), {}),
    "cnn": (CNN, lambda: jax.random.normal(key(1), (2, 5, 5, 2)), {}),
    "cnn_train": (CNN, lambda: jax.random.normal(key(1), (2, 5, 5, 2)), {"train": True}),
    "transformer": (Transformer, lambda: jax.random.randint(key(1), (2, 5), 0, 11), {}),
    "lifted": (Lifted, lambda: jax.random.normal(key(1), (2, 3)), {}),
    "recurrent": (Recurrent, lambda: jax.random.normal(key(1), (2, 5, 3)), {}),
}
RNGS = {"dropout": key(7)}


class _Built(dict):
    """name -> (module, variables, x, kwargs), each initialised once, when first used."""

    def __missing__(self, name):
        cls, x, kwargs = MODELS[name]
        module, x = cls(), x()
        init = jax.jit(lambda x: module.init({"params": key(0), "dropout": key(1)}, x, **kwargs))
        self[name] = (module, jax.device_get(init(x)), x, kwargs)
        return self[name]


@pytest.fixture(scope="module")
def built():
    return _Built()


def convert(module, variables, kwargs):
    mutable = ["batch_stats"] if kwargs.get("train") else False
    return from_linen(module, variables, rngs=RNGS, mutable=mutable)


def reference(module, variables, x, kwargs, **options):
    mutable = ["batch_stats"] if kwargs.get("train") else False
    return module.apply(variables, x, rngs=RNGS, mutable=options.pop("mutable", mutable), **options, **kwargs)


def captured(module, variables, x, kwargs):
    """linen's own record of every `__call__` output, keyed like the package's logs."""
    mutable = ["intermediates", "batch_stats"] if kwargs.get("train") else ["intermediates"]
    _, state = module.apply(variables, x, rngs=RNGS, mutable=mutable, capture_intermediates=True, **kwargs)

    def flatten(tree, prefix):
        for name, value in tree.items():
            if name == "__call__":
                if prefix:
                    for count, v in enumerate(value):
                        yield (prefix if count == 0 else f"{prefix}@{count}"), v
            else:
                yield from flatten(value, f"{prefix}.{name}" if prefix else name)

    return dict(flatten(state["intermediates"], ""))


class Twin(eqx.Module):
    """The linen MLP written in Equinox, with linen's layer names."""

    Dense_0: eqx.nn.Linear
    Dense_1: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(lambda r: self.Dense_1(jax.nn.relu(self.Dense_0(r))))(x)


# -- outputs and forward logs ------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODELS))
def test_converted_and_identity_hooked_outputs_equal_apply(built, name):
    module, variables, x, kwargs = built[name]
    converted = convert(module, variables, kwargs)
    expected = reference(module, variables, x, kwargs)
    jax.tree.map(close, converted(x, **kwargs), expected)
    output, log = px.ForwardHook(converted, hook_fn=px.IdentityHook())(x, **kwargs)
    jax.tree.map(close, output, expected)
    assert log == {}


@pytest.mark.parametrize("name", ["mlp", "cnn", "cnn_train", "transformer"])
def test_logs_equal_capture_intermediates(built, name):
    module, variables, x, kwargs = built[name]
    _, log = px.ForwardHook(convert(module, variables, kwargs), log_fn=px.IdentityLog())(x, **kwargs)
    expected = captured(module, variables, x, kwargs)
    assert set(log) == set(expected)
    jax.tree.map(close, log, expected)


def test_paths_are_linen_scope_paths(built):
    module, variables, x, _ = built["transformer"]
    converted = from_linen(module, variables)
    _, log = px.ForwardHook(converted, log_fn=px.MeanLog())(x)
    assert {"embed", "blocks_0", "blocks_0.attn", "blocks_0.attn.query", "blocks_0.attn.out",
            "blocks_1.mlp", "blocks_1.Dense_1", "head"} <= set(log)
    _, log = px.ForwardHook(converted, log_fn=px.MeanLog(), where="blocks_*.attn.*")(x)
    assert set(log) == {f"blocks_{i}.attn.{p}" for i in range(2) for p in ("query", "key", "value", "out")}
    _, log = px.ForwardHook(converted, log_fn=px.MeanLog(), where=nn.RMSNorm)(x)
    assert set(log) == {"blocks_0.RMSNorm_0", "blocks_1.RMSNorm_0"}
    # Modules without variables of their own are layers too.
    _, log = px.ForwardHook(converted, log_fn=px.MeanLog(), layer_names=["blocks_1.mlp"])(x)
    assert set(log) == {"blocks_1.mlp"}


class DenseLoRA(nn.Module):
    """Flax's own `nn.share_scope` example: the wrapper takes its base's scope."""

    base: nn.Dense
    rank: int

    def setup(self):
        nn.share_scope(self, self.base)

    @nn.compact
    def __call__(self, x):
        a = self.param("A", nn.initializers.normal(1.0), (x.shape[-1], self.rank))
        b = self.param("B", nn.initializers.normal(1.0), (self.rank, self.base.features))
        return self.base(x) + x @ a @ b


class LoRANet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="head")(DenseLoRA(nn.Dense(3), rank=2)(x))


class SharedAtTheRoot(nn.Module):
    def setup(self):
        self.inner = nn.Dense(3)
        nn.share_scope(self, self.inner)  # the child takes the root's scope

    def __call__(self, x):
        return 2 * self.inner(x)


def test_modules_sharing_a_scope_are_layers_of_their_own():
    # Both calls have the scope path Dense_0 (the root's: ()); the one called inside is
    # named under the other by its own name, and logged, edited and differentiated as a layer.
    x = jnp.linspace(-1, 1, 10).reshape(2, 5)
    net = LoRANet()
    variables = net.init(jax.random.key(0), x)
    model, p, head = from_linen(net, variables), variables["params"]["Dense_0"], variables["params"]["head"]
    base = x @ p["kernel"] + p["bias"]
    lora = base + x @ p["A"] @ p["B"]
    out, log = px.ForwardHook(model, log_fn=px.IdentityLog())(x)
    close(out, net.apply(variables, x))
    assert set(log) == {"Dense_0.Dense_0", "Dense_0", "head"}
    close(log["Dense_0.Dense_0"], base)
    close(log["Dense_0"], lora)
    edited, _ = px.ForwardHook(model, hook_fn=lambda y: y + 1, where="Dense_0.Dense_0")(x)
    close(edited, (lora + 1) @ head["kernel"] + head["bias"])
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where="Dense_0.Dense_0").init(x)
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(hooked)
    _, pullback = jax.vjp(lambda y: jnp.sum(((y + x @ p["A"] @ p["B"]) @ head["kernel"] + head["bias"]) ** 2), base)
    close(grads.log["Dense_0.Dense_0"], pullback(jnp.ones(()))[0])

    # A transfer of the shared scope into a plain Dense would drop A and B (was done silently).
    plain = nn.Sequential([nn.Dense(3), nn.Dense(2)])
    dst = from_linen(plain, plain.init(jax.random.key(2), x))
    # Without a call, the scope reads as a Dense by its kernel; with one, as the LoRA
    # class of no known layout it is: refused either way, naming A and B.
    for inputs, refusal in (({}, r"cannot map layer 'Dense_0': its parameters \['A', 'B'\] are not part"), (
        {"inputs": x},
        r"cannot map layer 'layers_0': the source 'Dense_0' is a layer of no known parameter layout, holding "
        r"A \(5, 2\), B \(2, 3\)",
    )):
        with pytest.raises(px.HookError, match=refusal):
            px.transfer_params(model, dst, {"Dense_0": "layers_0", "head": "layers_1"}, **inputs)

    root = SharedAtTheRoot()
    variables = root.init(jax.random.key(1), x)
    out, log = px.ForwardHook(from_linen(root, variables), log_fn=px.IdentityLog())(x)
    assert set(log) == {"inner"}  # was an empty log: the child's scope path is the root's
    close(log["inner"], x @ variables["params"]["kernel"] + variables["params"]["bias"])
    close(out, 2 * log["inner"])


class Reparametrised(nn.Module):
    wrapper: type

    @nn.compact
    def __call__(self, x):
        layer = nn.Dense(3, name="lin")
        if self.wrapper is nn.SpectralNorm:
            return nn.SpectralNorm(layer, name="norm")(x, update_stats=False)
        return nn.WeightNorm(layer, name="norm")(x)


@pytest.mark.parametrize("wrapper", [nn.WeightNorm, nn.SpectralNorm])
def test_a_layer_a_weight_or_spectral_norm_wraps_is_not_transferred(wrapper):
    # The wrapper keeps scales (sigma, u) named after the layer's kernel in its own scope and
    # calls the layer with other weights: copying the stored kernel alone (as before) was wrong.
    x = jnp.linspace(-1, 1, 10).reshape(2, 5)
    net = Reparametrised(wrapper)
    src = from_linen(net, net.init(jax.random.key(0), x), mutable=False)
    plain = nn.Sequential([nn.Dense(3)])
    dst = from_linen(plain, plain.init(jax.random.key(1), x))
    for a, b, mapping in ((src, dst, {"lin": "layers_0"}), (dst, src, {"layers_0": "lin"})):
        with pytest.raises(px.HookError, match=r"cannot map layer 'lin': its parameters are reparametrised .* 'norm'"):
            px.transfer_params(a, b, mapping)


def doubled(variables):
    return jax.tree.map(lambda a: 2 * a, variables)


class DenseBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="d")(x)


class Mapped(nn.Module):
    """Layers under `nn.map_variables` (their params doubled before use), a plain head."""

    @nn.compact
    def __call__(self, x):
        h = nn.map_variables(nn.Dense, "params", trans_in_fn=doubled, init=True)(3, name="scaled")(x)
        h = nn.map_variables(DenseBlock, "params", trans_in_fn=doubled, init=True)(name="blk")(h)
        return nn.Dense(2, name="head")(h)


class Unmapped(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="head")(DenseBlock(name="blk")(nn.Dense(3, name="scaled")(x)))


def test_a_layer_under_map_variables_is_logged_but_not_transferred():
    # Its stored params are not the ones it computes with: a transfer copied them as
    # stored (with verify=False, silently: max diff 0.04 here).
    x = jnp.linspace(-1, 1, 10).reshape(2, 5)
    mapped, plain = Mapped(), Unmapped()
    src = from_linen(mapped, mapped.init(jax.random.key(0), x))
    dst = from_linen(plain, plain.init(jax.random.key(1), x))
    _, log = px.ForwardHook(src, log_fn=px.IdentityLog(), where="scaled")(x)
    stored = src.variables["params"]["scaled"]
    close(log["scaled"], x @ (2 * stored["kernel"]) + 2 * stored["bias"])
    for layer in ("scaled", "blk.d"):
        for a, b in ((src, dst), (dst, src)):
            with pytest.raises(px.HookError, match=rf"cannot map layer '{layer}': it runs inside the nn.map_variables"):
                px.transfer_params(a, b, {layer: layer}, inputs=(x,), verify=False)
    moved = px.transfer_params(src, dst, {"head": "head"}, inputs=(x,), verify=False)
    close(moved.variables["params"]["head"]["kernel"], src.variables["params"]["head"]["kernel"])
    # Around the root, it maps every layer's.
    root = nn.map_variables(DenseBlock, "params", trans_in_fn=doubled, init=True)()
    src = from_linen(root, root.init(jax.random.key(2), x))
    dst = from_linen(DenseBlock(), DenseBlock().init(jax.random.key(3), x))
    with pytest.raises(px.HookError, match=r"cannot map layer 'd': it runs inside the nn.map_variables"):
        px.transfer_params(src, dst, {"d": "d"}, inputs=(x,), verify=False)


def test_scan_logs_are_stacked_where_linen_captures_nothing(built):
    module, variables, x, _ = built["lifted"]
    converted = from_linen(module, variables)
    with jax.checking_leaks():
        _, log = eqx.filter_jit(lambda m, x: px.ForwardHook(m, log_fn=px.IdentityLog())(x))(converted, x)
    # linen's own mechanism silently drops the scanned body's intermediates.
    expected = captured(module, variables, x, {})
    assert "inp" in expected and not any(path.startswith("blocks") for path in expected)
    assert log["blocks.lin"].shape == (3, 2, 4)
    # The reference: each step's submodules called by hand on that step's parameters.
    params = variables["params"]
    h = nn.Dense(4).apply({"params": params["inp"]}, x)
    for step in range(3):
        p = jax.tree.map(lambda a: a[step], params["blocks"])
        normed = nn.LayerNorm().apply({"params": p["norm"]}, h)
        close(log["blocks.norm"][step], normed)
        close(log["blocks.lin"][step], nn.Dense(4).apply({"params": p["lin"]}, normed))
        h = Step().apply({"params": p}, h, None)[0]
        close(log["blocks"][0][step], h)
    close(log["rem"], nn.Dense(4).apply({"params": params["rem"]}, h))
    close(log["jitted"], nn.Dense(4).apply({"params": params["jitted"]}, log["rem"]))
    for member in range(2):
        p = jax.tree.map(lambda a: a[member], params["ens"])
        close(log["ens"][member], nn.Dense(2).apply({"params": p}, log["jitted"]))


def test_scan_logs_equal_linen_capture_when_linen_is_told_to_stack(built):
    module, variables, x, _ = built["lifted"]

    class Told(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(4, name="inp")(x)
            stack = nn.scan(Step, variable_axes={"params": 0, "intermediates": 0},
                            split_rngs={"params": True}, length=3)
            return stack(name="blocks")(x, None)[0]

    told = Told()
    params = {"params": {k: variables["params"][k] for k in ("inp", "blocks")}}
    _, log = px.ForwardHook(from_linen(told, params), log_fn=px.IdentityLog(), where="blocks.*")(x)
    expected = captured(told, params, x, {})
    assert set(log) == {"blocks.norm", "blocks.lin"}
    for path in log:
        close(log[path], expected[path])


def test_recurrent_cells_log_per_time_step(built):
    module, variables, x, _ = built["recurrent"]
    _, log = px.ForwardHook(from_linen(module, variables), log_fn=px.IdentityLog(), where=px.kind("recurrent"))(x)
    # linen names a cell by the scope it is created in (here the parent's), not by
    # the nn.RNN that scans it.
    assert set(log) == {"lstm", "gru", "LSTMCell_0", "GRUCell_0"}
    (c, h), y = log["LSTMCell_0"]
    assert y.shape == (5, 2, 4)  # (time, batch, features): nn.RNN scans over time
    cell = nn.LSTMCell(4)
    carry = cell.initialize_carry(key(0), x[:, 0].shape)
    for t in range(5):
        carry, out = cell.apply({"params": variables["params"]["LSTMCell_0"]}, carry, x[:, t])
        close(y[t], out)
    close(log["lstm"], jnp.swapaxes(y, 0, 1))


# -- transforms around, backward logs, edits -----------------------------------------------
@pytest.mark.parametrize("name", ["cnn_train", "lifted"])
def test_under_filter_jit_grad_vmap_outside(built, name):
    module, variables, x, kwargs = built[name]
    converted = convert(module, variables, kwargs)
    hooked = px.ForwardHook(converted, log_fn=px.IdentityLog(), where=px.kind("linear", "conv"))
    # In training mode the call returns (output, updates).
    output = (lambda out: out[0]) if kwargs else (lambda out: out)

    def reference_loss(params):
        return jnp.sum(output(reference(module, {**variables, "params": params}, x, kwargs)) ** 2)

    with jax.checking_leaks():
        out, log = eqx.filter_jit(lambda h, x: h(x, **kwargs))(hooked, x)
        grads = eqx.filter_jit(eqx.filter_grad(lambda h, x: jnp.sum(output(h(x, **kwargs)[0]) ** 2)))(hooked, x)
    jax.tree.map(close, out, reference(module, variables, x, kwargs))
    expected = captured(module, variables, x, kwargs)
    for path in log:
        if path in expected:  # linen captures nothing inside nn.scan
            close(log[path], expected[path])
    jax.tree.map(close, grads.model.variables["params"], jax.jit(jax.grad(reference_loss))(variables["params"]))
    if name == "lifted":  # per example: BatchNorm in training mode would see a batch of 1
        with jax.checking_leaks():
            _, per_example = eqx.filter_vmap(lambda h, x: h(x[None]), in_axes=(None, 0))(hooked, x)
        # (example, *stack, 1, features) -> (*stack, example, features)
        jax.tree.map(lambda a, b: close(jnp.moveaxis(a, 0, -3)[..., 0, :], b), per_example, log)


def _delta_grads(module, variables, x, paths, **kwargs):
    """Gradients of `sum(out**2)` with respect to a zero added to each path's output,
    through linen's own interceptor: the cotangents of those outputs."""

    def loss(deltas):
        def add(next_f, args, kw, context):
            out = next_f(*args, **kw)
            path = ".".join(context.module.path)
            if context.method_name == "__call__" and path in deltas:
                out = out + deltas[path]
            return out

        with nn.intercept_methods(add):
            out = module.apply(variables, x, **kwargs)
        return jnp.sum(out**2)

    shapes = captured(module, variables, x, {})
    return jax.jit(jax.grad(loss))({p: jnp.zeros_like(shapes[p]) for p in paths})


def test_backward_logs_equal_gradients_of_the_sub_computation(built):
    module, variables, x, _ = built["transformer"]
    paths = ["embed", "blocks_0.attn.query", "blocks_1.mlp", "head"]
    hooked = px.BackwardHook(from_linen(module, variables), log_fn=px.IdentityLog(), layer_names=paths).init(x)
    with jax.checking_leaks():
        grads = eqx.filter_jit(eqx.filter_grad(lambda h, x: jnp.sum(h(x) ** 2)))(hooked, x)
    expected = _delta_grads(module, variables, x, paths)
    assert set(grads.log) == set(paths)
    jax.tree.map(close, grads.log, expected)


def test_backward_logs_in_a_scan_are_per_step(built):
    module, variables, x, _ = built["lifted"]
    hooked = px.BackwardHook(from_linen(module, variables), log_fn=px.IdentityLog(), where="blocks.lin").init(x)
    grads = eqx.filter_grad(lambda h, x: jnp.sum(h(x) ** 2))(hooked, x)
    assert grads.log["blocks.lin"].shape == (3, 2, 4)
    # The reference: d loss / d (step output) with a zero added to one step's `lin`.
    params = variables["params"]

    def loss(deltas):
        h = nn.Dense(4).apply({"params": params["inp"]}, x)
        for step in range(3):
            p = jax.tree.map(lambda a: a[step], params["blocks"])
            lin = nn.Dense(4).apply({"params": p["lin"]}, nn.LayerNorm().apply({"params": p["norm"]}, h))
            h = h + jnp.tanh(lin + deltas[step])
        h = nn.Dense(4).apply({"params": params["jitted"]}, nn.Dense(4).apply({"params": params["rem"]}, h))
        outs = [nn.Dense(2).apply({"params": jax.tree.map(lambda a: a[m], params["ens"])}, h) for m in range(2)]
        return jnp.sum(((outs[0] + outs[1]) / 2) ** 2)

    expected = jax.jit(jax.grad(loss))(jnp.zeros((3, 2, 4)))
    close(grads.log["blocks.lin"], expected)


def test_forward_edit_equals_hand_modified_model(built):
    module, variables, x, _ = built["mlp"]
    doubled = px.FunctionHook(lambda y: 2 * y)
    out, _ = px.ForwardHook(from_linen(module, variables), hook_fn=doubled, where="Dense_0")(x)
    # Dense is linear (and relu positively homogeneous): doubling its output is
    # doubling its kernel and bias.
    params = {**variables["params"], "Dense_0": jax.tree.map(lambda a: 2 * a, variables["params"]["Dense_0"])}
    close(out, module.apply({"params": params}, x))


def test_backward_edit_equals_hand_modified_gradient(built):
    module, variables, x, _ = built["mlp"]
    hooked = px.BackwardHook(from_linen(module, variables), hook_fn=px.FunctionHook(lambda g: 3 * g), where="Dense_0")
    grads = eqx.filter_grad(lambda h, x: jnp.sum(h(x) ** 2))(hooked, x)
    plain = jax.grad(lambda p: jnp.sum(module.apply({"params": p}, x) ** 2))(variables["params"])
    # Tripling the cotangent of the hidden layer's output triples its gradients only.
    jax.tree.map(lambda a, b: close(a, 3 * b), grads.model.variables["params"]["Dense_0"], plain["Dense_0"])
    jax.tree.map(close, grads.model.variables["params"]["Dense_1"], plain["Dense_1"])


# -- collections, rngs, modes --------------------------------------------------------------
def test_batch_stats_are_returned_and_carried_like_apply(built):
    module, variables, x, kwargs = built["cnn_train"]
    converted = convert(module, variables, kwargs)
    (out, updates), log = px.ForwardHook(converted, log_fn=px.MeanLog())(x, train=True)
    expected, expected_updates = reference(module, variables, x, kwargs)
    jax.tree.map(close, updates, expected_updates)
    carried = converted.with_variables(updates)
    jax.tree.map(close, carried.variables["batch_stats"], expected_updates["batch_stats"])
    assert px.total_params(converted) == (
        sum(a.size for a in jax.tree.leaves(variables["params"])),
        sum(a.size for a in jax.tree.leaves(variables["batch_stats"])),
    )
    # Eval mode: no collection is mutable, so the call returns the output alone.
    evaluation = from_linen(module, carried.variables)
    close(evaluation(x), module.apply(carried.variables, x))


def test_dropout_takes_the_rngs(built):
    module, variables, x, kwargs = built["cnn_train"]
    converted = convert(module, variables, kwargs)
    a, _ = converted(x, train=True)
    b, _ = converted.with_rngs({"dropout": key(8)})(x, train=True)
    assert not jnp.allclose(a, b)
    close(b, module.apply(variables, x, train=True, rngs={"dropout": key(8)}, mutable=["batch_stats"])[0])
    with pytest.raises(Exception, match="dropout"):
        from_linen(module, variables, mutable=["batch_stats"])(x, train=True)


# -- kinds, summary, stats, training ---------------------------------------------------------
def test_kinds_and_summary_cover_the_builtins(built):
    kinds = {}
    for name in ("cnn_train", "transformer", "recurrent"):
        module, variables, x, kwargs = built[name]
        summary = px.summary(convert(module, variables, kwargs), x, **kwargs)
        kinds.update({row.module_type: row.kind for row in summary.rows})
    assert kinds == {
        "Conv": "conv", "BatchNorm": "norm", "Dropout": "dropout", "ConvTranspose": "conv",
        "Dense": "linear", "Embed": "embedding", "LayerNorm": "norm", "RMSNorm": "norm",
        "MultiHeadDotProductAttention": "attention", "DenseGeneral": "linear",
        "Sequential": "container", "Block": "other", "RNN": "recurrent",
        "LSTMCell": "recurrent", "GRUCell": "recurrent",
    }
    module, variables, x, kwargs = built["cnn_train"]
    rows = {row.path: row for row in px.summary(convert(module, variables, kwargs), x, **kwargs).rows}
    assert (rows["BatchNorm_0"].trainable, rows["BatchNorm_0"].non_trainable) == (8, 8)
    assert rows["Conv_0"].trainable == 3 * 3 * 2 * 4 + 4


def test_stats_logs_the_recorder_and_the_same_keys_as_an_equinox_twin(built):
    module, variables, x, _ = built["mlp"]
    stats = eqx.filter_jit(lambda m, x: px.ForwardHook(m, log_fn=px.activation_stats())(x)[1])
    converted = from_linen(module, variables)
    dense = lambda x: nn.Dense(5).apply({"params": variables["params"]["Dense_0"]}, x)
    recorder = px.Recorder(every=2)
    for step in range(3):
        log = stats(converted, x * (step + 1))
        recorder.record(step, log)
        close(log["Dense_0"]["mean"], jnp.mean(dense(x * (step + 1))))
    # Steps 0 and 2 are kept.
    close(recorder.layer_stats("Dense_0")["mean"], [jnp.mean(dense(x)), jnp.mean(dense(3 * x))])

    twin = Twin(eqx.nn.Linear(3, 5, key=key(0)), eqx.nn.Linear(5, 2, key=key(1)))
    _, twin_log = px.ForwardHook(twin, log_fn=px.MeanLog(), where=px.kind("linear"))(x)
    assert set(twin_log) == set(log)


def test_training_with_optax_returns_linen_variables(built):
    module, variables, x, _ = built["mlp"]
    model = from_linen(module, variables)
    optim = optax.sgd(0.1)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    loss = lambda m: jnp.mean(m(x) ** 2)

    @eqx.filter_jit
    def step(model, opt_state):
        grads = eqx.filter_grad(loss)(model)
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state

    for _ in range(3):
        model, opt_state = step(model, opt_state)
    assert loss(model) < loss(from_linen(module, variables))
    close(module.apply(model.variables, x), model(x))


# -- migration: align, compare, transfer_params ---------------------------------------------
class NnxBlock(nnx.Module):
    """`Block`, ported to NNX."""

    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(4, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, 4, decode=False, rngs=rngs)
        self.mlp = nnx.Sequential(nnx.Linear(4, 8, rngs=rngs), jax.nn.gelu, nnx.Linear(8, 4, rngs=rngs))
        self.rms = nnx.RMSNorm(4, rngs=rngs)

    def __call__(self, x):
        h = self.norm(x)
        x = x + self.attn(h)
        return x + self.mlp(self.rms(x))


class NnxCNN(nnx.Module):
    """`CNN` in eval mode without its transposed conv, in NNX and in linen."""

    def __init__(self, rngs):
        self.conv = nnx.Conv(2, 4, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, use_running_average=True, rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.bn(self.conv(x))).mean(axis=(1, 2)))


class LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.BatchNorm(use_running_average=True)(nn.Conv(4, (3, 3))(x)))
        return nn.Dense(2)(x.mean(axis=(1, 2)))


class NnxRecurrent(nnx.Module):
    def __init__(self, rngs):
        self.rnn = nnx.RNN(nnx.LSTMCell(3, 4, rngs=rngs))

    def __call__(self, xs):
        return self.rnn(xs)


class LinenRecurrent(nn.Module):
    @nn.compact
    def __call__(self, xs):
        return nn.RNN(nn.LSTMCell(4))(xs)


class NnxDeconv(nnx.Module):
    def __init__(self, rngs):
        self.deconv = nnx.ConvTranspose(2, 3, (3, 3), strides=2, padding=[(1, 2), (1, 2)], rngs=rngs)

    def __call__(self, x):
        return self.deconv(x)


class LinenDeconv(nn.Module):
    @nn.compact
    def __call__(self, x):
        # Flipped and (out, in): the kernel is transposed relative to NNX's above.
        return nn.ConvTranspose(3, (3, 3), strides=(2, 2), padding=((1, 2), (1, 2)), transpose_kernel=True)(x)


def _linen(module, x):
    return from_linen(module, jax.jit(module.init)(key(3), x))


PORTS = {
    "block": (lambda x: _linen(Block(), x), lambda: px.from_nnx(NnxBlock(nnx.Rngs(5))), (2, 5, 4)),
    "cnn": (lambda x: _linen(LinenCNN(), x), lambda: px.from_nnx(NnxCNN(nnx.Rngs(5))), (2, 5, 5, 2)),
    "lstm": (lambda x: _linen(LinenRecurrent(), x), lambda: px.from_nnx(NnxRecurrent(nnx.Rngs(5))), (2, 5, 3)),
    "deconv": (lambda x: _linen(LinenDeconv(), x), lambda: px.from_nnx(NnxDeconv(nnx.Rngs(5))), (2, 4, 4, 2)),
}


@pytest.mark.parametrize("name", sorted(PORTS))
def test_transfer_between_linen_and_nnx_is_exact_both_ways(name):
    make_linen, make_nnx, shape = PORTS[name]
    x = jax.random.normal(key(1), shape)
    linen, port = make_linen(x), make_nnx()
    if name == "cnn":  # statistics that are not the initial ones
        linen = linen.with_variables({"batch_stats": jax.tree.map(lambda a: a + 0.5, linen.variables["batch_stats"])})
    alignment = px.align(linen, port, x)
    assert not alignment.unmatched and not alignment.ambiguous
    ported = px.transfer_params(linen, port, alignment.mapping, inputs=x)
    close(ported(x), linen(x))
    # Back (the modules learnt from an abstract run; no verification run needed, the
    # variables are compared exactly).
    reverse = {b: a for a, b in alignment.mapping.items()}
    back = px.transfer_params(ported, _linen(type(linen.module)(), x + 1), reverse, inputs=x, verify=False)
    jax.tree.map(close, back.variables, linen.variables)


@pytest.mark.parametrize("linen_first", [True, False])
def test_a_transfer_with_inputs_leaks_no_tracers_of_its_abstract_run(linen_first):
    # The deconv's stride and padding are learnt from bound linen modules of an abstract
    # run, whose scopes hold that run's tracers: they are kept unbound.
    make_linen, make_nnx, shape = PORTS["deconv"]
    x = jax.random.normal(key(1), shape)
    source, destination = (make_linen(x), make_nnx()) if linen_first else (make_nnx(), make_linen(x))
    with jax.checking_leaks():
        ported = px.transfer_params(source, destination, px.align(source, destination, x).mapping, inputs=x)
    close(ported(x), source(x))


def test_compare_pinpoints_a_porting_bug():
    x = jax.random.normal(key(1), (2, 5, 4))
    linen = _linen(Block(), x)
    alignment = px.align(linen, px.from_nnx(NnxBlock(nnx.Rngs(5))), x)
    # Without inputs the variables alone name every layer's layout here.
    ported = px.transfer_params(linen, px.from_nnx(NnxBlock(nnx.Rngs(5))), alignment.mapping)
    assert px.compare(linen, ported, x, alignment=alignment).first_divergence is None
    live = px.to_nnx(ported)
    live.attn.value.kernel.set_value(live.attn.value.kernel.get_value() * 1.01)
    first = px.compare(linen, px.from_nnx(live), x, alignment=alignment).first_divergence
    assert (first.path_a, first.path_b) == ("attn.value", "attn.value")


class Conv1D(nn.Module):
    kernel_size: int | tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        return nn.Conv(4, kernel_size=self.kernel_size)(x)


def test_an_int_kernel_size_transfers_as_a_1d_window():
    # flax reads `kernel_size=3` as (3,); the layout comes from the called module.
    x = jax.random.normal(key(1), (2, 8, 3))
    source = Conv1D(3)
    variables = source.init(key(0), x)
    ported = px.transfer_params(
        from_linen(source, variables), _linen(Conv1D((3,)), x), {"Conv_0": "Conv_0"}, inputs=x
    )
    close(ported(x), source.apply(variables, x))


def test_transfer_into_equinox_and_refusals(built):
    module, variables, x, _ = built["mlp"]

    twin = Twin(eqx.nn.Linear(3, 5, key=key(0)), eqx.nn.Linear(5, 2, key=key(1)))
    mapping = {"Dense_0": "Dense_0", "Dense_1": "Dense_1"}
    ported = px.transfer_params(from_linen(module, variables), twin, mapping, inputs=x)
    close(ported(x), module.apply(variables, x))
    wide = eqx.tree_at(lambda t: t.Dense_0, twin, eqx.nn.Linear(3, 6, key=key(0)))
    with pytest.raises(px.HookError, match="Dense_0"):
        px.transfer_params(from_linen(module, variables), wide, mapping)
    cnn, cnn_variables, cnn_x, _ = built["cnn"]
    converted = from_linen(cnn, cnn_variables)
    # Without a call a ConvTranspose's kernel reads like a Conv's, and its stride and
    # padding are unknown.
    with pytest.raises(px.HookError, match=r"ConvTranspose_0.*conv-transpose.*pass inputs="):
        px.transfer_params(converted, converted, {"ConvTranspose_0": "ConvTranspose_0"})
    px.transfer_params(converted, converted, {"ConvTranspose_0": "ConvTranspose_0"}, inputs=cnn_x)


def test_a_converted_model_inside_an_equinox_model_logs_under_its_field(built):
    module, variables, x, _ = built["mlp"]

    class Head(eqx.Module):
        backbone: LinenModule
        out: eqx.nn.Linear

        def __call__(self, x):
            return jax.vmap(self.out)(self.backbone(x))

    model = Head(from_linen(module, variables), eqx.nn.Linear(2, 1, key=key(0)))
    _, log = px.ForwardHook(model, log_fn=px.IdentityLog(), where="backbone.*")(x)
    assert set(log) == {"backbone.Dense_0", "backbone.Dense_1"}
    close(log["backbone.Dense_1"], module.apply(variables, x))


# -- methods, errors, scoping, threads --------------------------------------------------------
def test_other_methods_are_selectable():
    class Coder(nn.Module):
        def setup(self):
            self.down = nn.Dense(2)
            self.up = nn.Dense(3)

        def encode(self, x):
            return self.down(x)

        def __call__(self, x):
            return self.up(self.encode(x))

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Coder(name="coder")(x)

    outer = Outer()
    x = jnp.ones((1, 3))
    variables = outer.init(key(0), x)
    # Every method site by default (`coder.encode`: kind "method"); `methods=` restricts.
    _, log = px.ForwardHook(from_linen(outer, variables), log_fn=px.IdentityLog())(x)
    assert set(log) == {"coder", "coder.encode", "coder.down", "coder.up"}
    close(log["coder.encode"], log["coder.down"])
    kinds = {row.key: row.kind for row in px.sites(from_linen(outer, variables), x)}
    assert kinds["coder.encode"] == "method" and kinds["coder.down"] == "linear"
    only_calls = from_linen(outer, variables, methods=("__call__",))
    _, log = px.ForwardHook(only_calls, log_fn=px.MeanLog())(x)
    assert set(log) == {"coder", "coder.down", "coder.up"}


class Branch(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(3)(x)
        if train:  # layers run in training only: a Dense, and a Dropout holding no variables
            x = nn.Dropout(0.5, deterministic=False)(nn.Dense(3)(x))
        return x


def test_layers_the_model_has_that_did_not_run_are_no_error():
    branch = Branch()
    x = jnp.arange(8.0).reshape(2, 4)
    variables = branch.init({"params": key(0), "dropout": key(1)}, x, True)
    model = from_linen(branch, variables)
    training = model.with_rngs({"dropout": key(2)})
    hooked = lambda where: px.ForwardHook(model, log_fn=px.IdentityLog(), where=where)
    # `Dense_1` is named by the variables: known without a call.
    _, log = hooked(["Dense_0", "Dense_1"])(x, False)
    kernel, bias = variables["params"]["Dense_0"]["kernel"], variables["params"]["Dense_0"]["bias"]
    assert set(log) == {"Dense_0"}
    close(log["Dense_0"], x @ kernel + bias)
    # `Dropout_0` holds no variables: unknown (a typo?) until a call has run it.
    with pytest.raises(px.HookError, match=r"'Dropout_0' selected no call"):
        hooked(["Dense_0", "Dropout_0"])(x, False)
    _, log = px.ForwardHook(training, log_fn=px.IdentityLog(), where="Dropout_0")(x, True)
    assert set(log) == {"Dropout_0"}
    for call in (lambda h, x: h(x, False), eqx.filter_jit(lambda h, x: h(x, False))):
        _, log = call(hooked(["Dense_0", "Dropout_0"]), x)
        assert set(log) == {"Dense_0"}
        close(log["Dense_0"], x @ kernel + bias)
        _, log = call(px.ForwardHook(model, log_fn={"Dense_0": px.IdentityLog(), "Dense_1": px.MeanLog()}), x)
        assert set(log) == {"Dense_0"}
    for typo, args in (("Dropout_1", (x, False)), ("Dense_2", (x, False)), ("Dense_2", (x, True))):
        with pytest.raises(px.HookError, match=rf"'{typo}' selected no call"):
            px.ForwardHook(training, log_fn=px.IdentityLog(), where=["Dense_0", typo])(*args)


def test_untreaded_transform_inside_raises_naming_the_layer():
    class Loop(nn.Module):
        def setup(self):
            self.body = nn.Dense(3)

        def __call__(self, x):
            if self.is_initializing():
                self.body(x)  # linen's loops need the parameters to exist already
            return nn.while_loop(lambda m, c: jnp.sum(c) < 100.0, lambda m, c: m.body(c) + 1.0, self, x)

    loop = Loop()
    x = jnp.ones((1, 3))
    variables = loop.init(key(0), x)
    converted = from_linen(loop, variables)
    close(converted(x), loop.apply(variables, x))
    with pytest.raises(px.TransformError, match="'body'"):
        px.ForwardHook(converted, log_fn=px.MeanLog())(x)


def test_bad_inputs():
    with pytest.raises(TypeError, match=r"flax\.linen\.Module"):
        from_linen(eqx.nn.Linear(2, 2, key=key(0)), {})
    module = MLP()
    with pytest.raises(TypeError, match="variables"):
        from_linen(module, jnp.ones(3))


def test_patches_are_undone_on_every_path_and_threads_are_isolated(built):
    module, variables, x, _ = built["lifted"]
    converted = from_linen(module, variables)
    original = axes_scan.scan

    def failing(y):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        px.ForwardHook(converted, hook_fn=px.FunctionHook(failing), where="blocks.lin")(x)
    assert axes_scan.scan is original and not _patching.is_patched(axes_scan, "scan")

    # While the other thread is inside its hooked call (patches installed), a plain
    # call here is plain.
    _, (patched, plain) = while_hooked_elsewhere(
        lambda pause: px.ForwardHook(converted, hook_fn=pause, where="inp")(x),
        lambda: (_patching.is_patched(axes_scan, "scan"), converted(x)),
    )
    assert patched
    close(plain, module.apply(variables, x))
    assert not _patching.is_patched(axes_scan, "scan")


def test_init_of_a_model_with_a_collective_over_the_batch_runs_inside_its_vmap():
    class Normalised(nn.Module):  # per example; BatchNorm averages over the vmap's "batch"
        @nn.compact
        def __call__(self, x, delta=0.0):
            h = nn.Dense(4, name="lin")(x) + delta
            return nn.BatchNorm(use_running_average=False, axis_name="batch")(h)

    module, xs = Normalised(), jax.random.normal(jax.random.key(1), (5, 3))
    variables = jax.vmap(lambda x: module.init(jax.random.key(0), x), axis_name="batch", out_axes=None)(xs)
    converted = px.from_linen(module, variables, mutable=["batch_stats"])
    slot_gradient, loss = slot_gradient_of_init_inside_the_vmap(converted, xs)
    shifted = jax.jit(jax.grad(lambda d: loss(lambda x: module.apply(variables, x, d, mutable=["batch_stats"]))))
    close(slot_gradient, shifted(jnp.zeros(4)), tol=1e-4)
