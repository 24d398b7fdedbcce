"""Flax NNX models converted with `px.from_nnx`: outputs, names, logs against
`nnx.capture`, backward logs against `jax.vjp` and NNX's `perturb`, state, transforms,
training and the way back, patch scoping and threads."""

import pytest

pytest.importorskip("flax")  # skipped where the [flax] extra is not installed


import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import peex_interop as px
from models import close, slot_gradient_of_init_inside_the_vmap, while_hooked_elsewhere
from peex_interop._engine import _patching


# -- models ----------------------------------------------------------------------------
class MLP(nnx.Module):
    def __init__(self, rngs):
        self.linear1 = nnx.Linear(3, 5, rngs=rngs)
        self.linear2 = nnx.Linear(5, 2, rngs=rngs)

    def __call__(self, x):
        return self.linear2(jax.nn.relu(self.linear1(x)))


class CNN(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(2, 4, kernel_size=(3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        h = self.drop(jax.nn.relu(self.bn(self.conv(x))))
        return self.head(h.mean(axis=(1, 2)))


class TransformerBlock(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(11, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, 8, decode=False, rngs=rngs)
        self.mlp = nnx.Sequential(nnx.Linear(8, 16, rngs=rngs), jax.nn.gelu, nnx.Linear(16, 8, rngs=rngs))

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(4, rngs=rngs)
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.lin(self.norm(x)))


class Stack(nnx.Module):
    """nnx.remat, a stack built with nnx.vmap and run with nnx.scan, and an ensemble run
    with nnx.vmap, all inside the call."""

    def __init__(self, rngs):
        self.inp = nnx.Linear(3, 4, rngs=rngs)
        self.blocks = nnx.vmap(lambda k: Block(nnx.Rngs(k)))(jax.random.split(rngs.params(), 3))
        self.heads = nnx.vmap(lambda k: nnx.Linear(4, 2, rngs=nnx.Rngs(k)))(jax.random.split(rngs.params(), 2))

    def __call__(self, x):
        x = nnx.remat(lambda m, x: m(x))(self.inp, x)
        x = nnx.scan(lambda x, b: b(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)
        return nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(self.heads, x).mean(0)


class Containers(nnx.Module):
    """nnx.Sequential, nnx.List and a list held with nnx.data."""

    def __init__(self, rngs):
        self.seq = nnx.Sequential(nnx.Linear(3, 4, rngs=rngs), jax.nn.relu, nnx.Linear(4, 4, rngs=rngs))
        self.listed = nnx.List([nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs)])
        self.data = nnx.data([nnx.LayerNorm(4, rngs=rngs)])

    def __call__(self, x):
        x = self.seq(x)
        for layer in self.listed:
            x = layer(x)
        return self.data[0](x)


class Scaled(nnx.Linear):
    """Overrides __call__ and calls super().__call__."""

    def __call__(self, x):
        return 2.0 * super().__call__(x)


class Inherited(nnx.Linear):
    """Inherits __call__ from a class that is not otherwise in the model."""


class Family(nnx.Module):
    """A subclass calling super().__call__, one inheriting __call__, and a submodule
    shared by two parents."""

    def __init__(self, rngs):
        self.scaled = Scaled(3, 3, rngs=rngs)
        self.inherited = Inherited(3, 3, rngs=rngs)
        shared = nnx.Linear(3, 3, rngs=rngs)
        self.left = nnx.Sequential(shared)
        self.right = nnx.Sequential(shared)

    def __call__(self, x):
        return self.right(self.left(self.inherited(self.scaled(x))))


def rnn():
    return nnx.RNN(nnx.LSTMCell(3, 4, rngs=nnx.Rngs(0)))


def key(i):
    return jax.random.key(i)


MODELS = {
    "mlp": (lambda: MLP(nnx.Rngs(0)), lambda: jax.random.normal(key(1), (2, 3))),
    "cnn_train": (lambda: CNN(nnx.Rngs(0)), lambda: jax.random.normal(key(1), (2, 5, 5, 2))),
    "cnn_eval": (
        lambda: nnx.view(CNN(nnx.Rngs(0)), deterministic=True, use_running_average=True),
        lambda: jax.random.normal(key(1), (2, 5, 5, 2)),
    ),
    "transformer": (lambda: TransformerBlock(nnx.Rngs(0)), lambda: jax.random.randint(key(1), (2, 5), 0, 11)),
    "stack": (lambda: Stack(nnx.Rngs(0)), lambda: jax.random.normal(key(1), (2, 3))),
    "containers": (lambda: Containers(nnx.Rngs(0)), lambda: jax.random.normal(key(1), (2, 3))),
    "family": (lambda: Family(nnx.Rngs(0)), lambda: jax.random.normal(key(1), (2, 3))),
    "rnn": (rnn, lambda: jax.random.normal(key(1), (2, 5, 3))),
}


def make(name):
    model, x = MODELS[name]
    return model(), x()


def snapshot(module_or_state):
    state = module_or_state if isinstance(module_or_state, nnx.State) else nnx.state(module_or_state)
    return jax.tree.map(
        lambda a: np.asarray(jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a), state
    )


def assert_same_state(a, b):
    jax.tree.map(np.testing.assert_array_equal, snapshot(a), snapshot(b))


def captured(module, x):
    """`nnx.capture`'s record of every `__call__` output, keyed like the package's logs."""
    _, state = nnx.capture(module, nnx.Intermediate, method_outputs=nnx.Intermediate)(x)
    logs = {}
    for path, variable in nnx.to_flat_state(state):
        *where, method = path
        if method != "__call__" or not where:
            continue
        name = ".".join(map(str, where))
        for count, value in enumerate(variable.get_value()):
            logs[name if count == 0 else f"{name}@{count}"] = value
    return logs


# -- outputs, names, forward logs --------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODELS))
def test_converted_and_identity_hooked_outputs_equal_the_modules(name):
    model, x = make(name)
    converted = px.from_nnx(model)
    # Each call runs on the converted state, which the module's own call then advances.
    expected = nnx.clone(model)(x)
    close(converted(x), expected)
    output, log = px.ForwardHook(converted, hook_fn=px.IdentityHook())(x)
    close(output, expected)
    assert log == {}


@pytest.mark.parametrize("name", ["mlp", "cnn_train", "cnn_eval", "transformer", "stack", "containers", "family"])
def test_logs_equal_nnx_capture(name):
    model, x = make(name)
    _, log = px.ForwardHook(px.from_nnx(model), log_fn=px.IdentityLog())(x)
    expected = captured(nnx.clone(model), x)
    if name == "family":
        # capture also sows what super().__call__ returns, as a first call of `scaled`;
        # here a module's call is one call site.
        close(expected.pop("scaled"), log["scaled"] / 2)
        expected["scaled"] = expected.pop("scaled@1")
    assert set(log) == set(expected)
    jax.tree.map(close, log, expected)


def test_paths_of_library_internals_inheritance_and_shared_modules():
    _, log = px.ForwardHook(px.from_nnx(TransformerBlock(nnx.Rngs(0))), log_fn=px.MeanLog())(jnp.zeros((1, 3), int))
    assert {"attn.query", "attn.key", "attn.value", "attn.out", "mlp.layers.0", "mlp.layers.2", "embed"} <= set(log)
    _, log = px.ForwardHook(px.from_nnx(Family(nnx.Rngs(0))), log_fn=px.MeanLog())(jnp.ones(3))
    # super().__call__ is not a second call; the shared Linear is named by its first
    # path and its second call does not overwrite the first.
    assert set(log) == {"scaled", "inherited", "left", "left.layers.0", "right", "left.layers.0@1"}
    _, log = px.ForwardHook(px.from_nnx(Containers(nnx.Rngs(0))), log_fn=px.MeanLog())(jnp.ones(3))
    assert set(log) == {"seq", "seq.layers.0", "seq.layers.2", "listed.0", "listed.1", "data.0"}


def test_where_and_layer_names_use_nnx_paths_and_types():
    converted = px.from_nnx(Stack(nnx.Rngs(0)))
    x = jnp.ones((2, 3))
    _, log = px.ForwardHook(converted, log_fn=px.MeanLog(), where=nnx.LayerNorm)(x)
    assert set(log) == {"blocks.norm"}
    _, log = px.ForwardHook(converted, log_fn=px.MeanLog(), layer_names=["blocks.lin", "inp"])(x)
    assert set(log) == {"blocks.lin", "inp"}
    with pytest.raises(px.HookError, match=r"closest available paths: blocks\.lin"):
        px.ForwardHook(converted, where="block.lin")


def test_converted_module_inside_an_equinox_model_is_named_under_its_field():
    class Hybrid(eqx.Module):
        encoder: px.NnxModule
        head: eqx.nn.Linear

        def __call__(self, x):
            return self.head(self.encoder(x))

    mlp = MLP(nnx.Rngs(0))
    hybrid = Hybrid(px.from_nnx(mlp), eqx.nn.Linear(2, 1, key=key(0)))
    x = jnp.arange(3.0)
    _, log = eqx.filter_jit(hooked_call)(px.ForwardHook(hybrid, log_fn=px.IdentityLog()), x)
    assert set(log) == {"encoder", "encoder.linear1", "encoder.linear2", "head"}
    close(log["encoder.linear1"], mlp.linear1(x))
    close(log["encoder"], mlp(x))


def test_scanned_stack_logs_are_stacked_per_layer():
    model = Stack(nnx.Rngs(0))
    x = jax.random.normal(key(1), (2, 3))
    _, log = px.ForwardHook(px.from_nnx(model), log_fn=px.IdentityLog())(x)
    assert log["blocks.lin"].shape == (3, 2, 4) and log["heads"].shape == (2, 2, 2)
    graphdef, state = nnx.split(model.blocks)
    h = model.inp(x)
    for i in range(3):
        block = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
        close(log["blocks.lin"][i], block.lin(block.norm(h)))
        h = block(h)
        close(log["blocks"][i], h)


def test_rnn_cell_logs_per_time_step():
    model = rnn()
    x = jax.random.normal(key(1), (2, 5, 3))
    _, log = px.ForwardHook(px.from_nnx(model), log_fn=px.IdentityLog())(x)
    cell = model.cell
    carry = cell.initialize_carry((2, 3), nnx.Rngs(0))
    for t in range(5):
        carry, y = cell(carry, x[:, t])
        close(log["cell"][1][t], y)
        close(log["cell.ii"][t], cell.ii(x[:, t]))


def test_same_line_on_equinox_model_and_its_nnx_twin():
    eqx_mlp = eqx.nn.MLP(3, 2, 5, depth=1, key=key(0))
    twin = nnx.Sequential(nnx.Linear(3, 5, rngs=nnx.Rngs(0)), jax.nn.relu, nnx.Linear(5, 2, rngs=nnx.Rngs(0)))
    for i, index in enumerate((0, 2)):
        twin.layers[index].kernel.set_value(eqx_mlp.layers[i].weight.T)
        twin.layers[index].bias.set_value(eqx_mlp.layers[i].bias)
    x = jnp.arange(3.0)
    logs = {}
    for name, model in (("equinox", eqx_mlp), ("nnx", px.from_nnx(twin))):
        _, logs[name] = px.ForwardHook(model, log_fn=px.MeanStdLog())(x)
    assert set(logs["equinox"]) == {"layers.0", "layers.1"}
    assert set(logs["nnx"]) == {"layers.0", "layers.2"}
    close(logs["equinox"]["layers.0"], logs["nnx"]["layers.0"])
    close(logs["equinox"]["layers.1"], logs["nnx"]["layers.2"])


class Branch(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 3, rngs=rngs)
        self.extra = nnx.Linear(3, 3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x, extra=False):
        x = self.lin(x)
        return self.drop(self.extra(x)) if extra else x


def test_layers_the_model_has_that_did_not_run_are_no_error():
    model = px.from_nnx(Branch(nnx.Rngs(0)))
    x = jnp.arange(8.0).reshape(2, 4)
    for call in (lambda h, x: h(x), eqx.filter_jit(lambda h, x: h(x))):
        _, log = call(px.ForwardHook(model, log_fn=px.IdentityLog(), where=["lin", "extra", "dro*"]), x)
        assert set(log) == {"lin"}
        close(log["lin"], px.to_nnx(model).lin(x))
        _, log = call(px.ForwardHook(model, log_fn={"lin": px.IdentityLog(), "drop": px.MeanLog()}), x)
        assert set(log) == {"lin"}
    _, log = px.ForwardHook(model, log_fn=px.IdentityLog(), where=["lin", "extra", "drop"])(x, extra=True)
    assert set(log) == {"lin", "extra", "drop"}
    # A one-segment name that is no layer of the model may be a value the root model
    # sows, which only the call shows (`px.sites` lists such values by their names): it
    # raises at the call, naming the closest paths; a pattern that matches a layer that
    # ran but was not selected, after it too.
    hooked = px.ForwardHook(model, where=["lin", "extr"])
    with pytest.raises(px.HookError, match=r"'extr' selected no call.*Closest layers called: lin"):
        hooked(x)
    with pytest.raises(px.HookError, match=r"'extra' selected no call"):
        px.ForwardHook(model, log_fn={"extra": px.IdentityLog()}, where="lin")(x, extra=True)


class Sows(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 4, rngs=rngs)

    def __call__(self, x):
        h = self.lin(x)
        self.sow(nnx.Intermediate, "h", h)
        return h


class SowingModel(nnx.Module):
    def __init__(self, rngs):
        self.block = Sows(rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.block(x))


def test_counts_of_a_model_whose_layers_sow_count_its_params_only():
    module = SowingModel(nnx.Rngs(0))
    x = jnp.ones((2, 3))
    with pytest.warns(DeprecationWarning, match="sow"):  # flax 0.12 deprecates sow outside nnx.capture
        module(x)
    # The call left its sown values in the module, as a tuple in an nnx.Intermediate.
    assert isinstance(nnx.state(module, nnx.Intermediate)["block"]["h"].get_value(), tuple)
    model = px.from_nnx(module)
    by_hand = {"block": 3 * 4 + 4, "block.lin": 3 * 4 + 4, "head": 4 * 2 + 2}
    assert px.total_params(model) == (by_hand["block"] + by_hand["head"], 0)
    with pytest.warns(DeprecationWarning, match="sow"):
        rows = px.summary(model, x).rows
        sites = px.sites(model, x)
    # The sown value is a site of its own (`block.h`), holding no parameters.
    by_hand_with_sown = {**by_hand, "block.h": 0}
    assert {r.path: (r.trainable, r.non_trainable) for r in rows} == {p: (n, 0) for p, n in by_hand_with_sown.items()}
    assert {s.path: s.trainable for s in sites} == by_hand_with_sown
    assert {s.path: s.kind for s in sites}["block.h"] == "sown"


def test_parameter_counts_and_summary_rows_match_hand_counts():
    assert px.total_params(px.from_nnx(nnx.Linear(10, 32, rngs=nnx.Rngs(0)))) == (352, 0)
    # BatchNorm's running mean and variance are not trained; RNG state is not counted.
    assert px.total_params(px.from_nnx(CNN(nnx.Rngs(0)))) == (2 * 4 * 9 + 4 + 8 + 4 * 3 + 3, 8)
    rows = px.summary(px.from_nnx(Stack(nnx.Rngs(0))), jnp.ones((2, 3))).rows
    # Layers inside nnx.scan / nnx.vmap report one layer / one ensemble member.
    assert [(r.path, r.kind, r.trainable) for r in rows] == [
        ("inp", "linear", 3 * 4 + 4), ("blocks.norm", "norm", 8), ("blocks.lin", "linear", 20),
        ("blocks", "other", 28), ("heads", "linear", 4 * 2 + 2),
    ]


# -- backward --------------------------------------------------------------------------
def grad_logs(converted, x, **options):
    hooked = px.BackwardHook(converted, log_fn=px.IdentityLog(), **options).init(x)
    return eqx.filter_grad(lambda h, x: jnp.sum(h(x) ** 2))(hooked, x).log


def test_backward_logs_equal_vjp_of_the_rest_of_the_mlp():
    model = MLP(nnx.Rngs(0))
    x = jax.random.normal(key(1), (2, 3))
    log = grad_logs(px.from_nnx(model), x)
    h1 = model.linear1(x)
    _, vjp = jax.vjp(lambda h: model.linear2(jax.nn.relu(h)), h1)
    close(log["linear2"], 2 * model(x))
    close(log["linear1"], vjp(2 * model(x))[0])


def test_backward_logs_equal_nnx_perturb_and_grad():
    class Perturbed(MLP):
        def __call__(self, x):
            h = self.perturb("linear1", self.linear1(x))
            return self.linear2(jax.nn.relu(h))

    model = Perturbed(nnx.Rngs(0))
    x = jax.random.normal(key(1), (2, 3))
    _, perturbations = nnx.capture(model, nnx.Perturbation)(x)

    def loss(model, perturbations, x):
        return jnp.sum(nnx.capture(model, init=perturbations)(x) ** 2)

    expected = nnx.grad(loss, argnums=1)(model, perturbations, x)["linear1"].get_value()
    close(grad_logs(px.from_nnx(MLP(nnx.Rngs(0))), x)["linear1"], expected)


def test_backward_logs_inside_nnx_scan_are_per_layer():
    model = Stack(nnx.Rngs(0))
    x = jax.random.normal(key(1), (2, 3))
    log = grad_logs(px.from_nnx(model), x, where="blocks")
    graphdef, state = nnx.split(model.blocks)
    blocks = [nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state)) for i in range(3)]
    heads_graphdef, heads_state = nnx.split(model.heads)

    def heads(h):
        # NNX refuses a module from outside the trace in nnx.vmap: merge it inside.
        ensemble = nnx.merge(heads_graphdef, heads_state, copy=True)
        return nnx.vmap(lambda m, h: m(h), in_axes=(0, None))(ensemble, h).mean(0)

    def rest(i):
        def f(h):
            for block in blocks[i + 1 :]:
                h = block(h)
            return jnp.sum(heads(h) ** 2)

        return f

    h = model.inp(x)
    for i in range(3):
        h = blocks[i](h)
        close(log["blocks"][i], jax.grad(rest(i))(h))


def test_backward_logs_inside_the_rnn_scan_are_per_time_step():
    model = rnn()
    x = jax.random.normal(key(1), (2, 5, 3))
    log = grad_logs(px.from_nnx(model), x, where="cell.ii")
    cell = model.cell

    def loss(deltas):
        # The LSTM step written out, with `deltas[t]` added to the output of cell.ii.
        c, h = cell.initialize_carry((2, 3), nnx.Rngs(0))
        hs = []
        for t in range(5):
            xt = x[:, t]
            i = cell.gate_fn(cell.ii(xt) + deltas[t] + cell.hi(h))
            f = cell.gate_fn(cell.if_(xt) + cell.hf(h))
            g = cell.activation_fn(cell.ig(xt) + cell.hg(h))
            o = cell.gate_fn(cell.io(xt) + cell.ho(h))
            c = f * c + i * g
            h = o * cell.activation_fn(c)
            hs.append(h)
        return jnp.sum(jnp.stack(hs, 1) ** 2)

    close(log["cell.ii"], jax.grad(loss)(jnp.zeros((5, 2, 4))))


def test_backward_edit_reaches_the_parameters():
    model = MLP(nnx.Rngs(0))
    x = jax.random.normal(key(1), (2, 3))
    hooked = px.BackwardHook(px.from_nnx(model), hook_fn=lambda g: 0.5 * g, where="linear1").init(x)
    grads = eqx.filter_grad(lambda h, x: jnp.sum(h(x) ** 2))(hooked, x).model.state
    plain = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
    # The edit acts below linear2 only.
    jax.tree.map(close, grads["linear2"], plain["linear2"])
    jax.tree.map(lambda g, p: close(g, 0.5 * p), grads["linear1"], plain["linear1"])


# -- state -------------------------------------------------------------------------------
def test_original_state_is_bit_identical_after_hooked_calls_in_train_mode():
    model, x = make("cnn_train")
    before = nnx.clone(model)
    converted = px.from_nnx(model, return_state=True)
    converted_before = snapshot(converted.state)
    px.ForwardHook(converted, log_fn=px.IdentityLog())(x)
    eqx.filter_jit(lambda h, x: h(x))(px.ForwardHook(converted, log_fn=px.MeanLog()), x)
    hooked = px.BackwardHook(px.from_nnx(model), log_fn=px.IdentityLog()).init(x)
    eqx.filter_grad(lambda h, x: jnp.sum(h(x)))(hooked, x)
    converted.train()(x)
    assert_same_state(model, before)
    # The converted module is a value too: calls never change it.
    jax.tree.map(np.testing.assert_array_equal, snapshot(converted.state), converted_before)


def test_return_state_carries_batch_stats_and_rng_counts():
    model, x = make("cnn_train")
    converted = px.from_nnx(model, return_state=True)
    (output, updated), _ = px.ForwardHook(converted, log_fn=px.MeanLog())(x)
    reference = nnx.clone(model)
    close(output, reference(x))
    assert_same_state(px.to_nnx(updated), reference)
    assert not np.allclose(reference.bn.mean.get_value(), model.bn.mean.get_value())
    # A second call continues from the updated state: a fresh dropout mask.
    close(eqx.filter_jit(lambda c, x: c(x))(updated, x)[0], reference(x))


def test_train_and_eval_modes():
    model, x = make("cnn_train")
    evaluated = px.from_nnx(model).eval()
    reference = nnx.clone(model)
    reference.eval()
    close(evaluated(x), reference(x))
    # Eval mode by hand: batch norm on its running statistics, dropout off.
    bn = model.bn
    normed = (model.conv(x) - bn.mean.get_value()) / jnp.sqrt(bn.var.get_value() + bn.epsilon)
    h = jax.nn.relu(normed * bn.scale.get_value() + bn.bias.get_value())
    close(evaluated(x), model.head(h.mean(axis=(1, 2))))
    assert evaluated.train()(x).shape == (2, 3)
    assert not np.allclose(evaluated.train()(x), evaluated(x))


def test_rngs_passed_at_call_time():
    model = nnx.Dropout(0.5)
    x = jnp.ones((4, 4))
    out = px.from_nnx(model)(x, rngs=nnx.Rngs(dropout=3))
    np.testing.assert_array_equal(out, model(x, rngs=nnx.Rngs(dropout=3)))


# -- transforms ------------------------------------------------------------------------
def hooked_call(hooked, x):
    return hooked(x)


AROUND = {
    "eager": lambda h, x: h(x),
    "jit": lambda h, x: eqx.filter_jit(hooked_call)(h, x),
    "remat": lambda h, x: eqx.filter_checkpoint(hooked_call)(h, x),
    "grad": lambda h, x: eqx.filter_grad(lambda h, x: (jnp.sum(h(x)[0]), h(x)), has_aux=True)(h, x)[1],
}


@pytest.fixture(scope="module", params=["stack", "cnn_train", "rnn"])
def eager(request):
    """A converted model hooked to log every layer, its input, and the eager output and
    log every transform must reproduce (computed once per model)."""
    model, x = make(request.param)
    hooked = px.ForwardHook(px.from_nnx(model), log_fn=px.IdentityLog())
    return hooked, x, hooked(x)


@pytest.mark.parametrize("transform", sorted(AROUND))
def test_transforms_around_give_eager_values(transform, eager):
    hooked, x, (ref_out, ref_log) = eager
    with jax.checking_leaks():
        out, log = AROUND[transform](hooked, x)
    close(out, ref_out)
    assert set(log) == set(ref_log)
    jax.tree.map(close, log, ref_log)


@pytest.mark.parametrize("name", ["stack", "cnn_eval"])
def test_vmap_and_scan_around_stack_per_example(name):
    model, x = make(name)
    xs = jnp.stack([x, 2 * x, -x])
    hooked = px.ForwardHook(px.from_nnx(model), log_fn=px.MeanStdLog())
    with jax.checking_leaks():
        out, log = eqx.filter_vmap(hooked_call, in_axes=(None, 0))(hooked, xs)
        _, (outs, logs) = jax.lax.scan(lambda c, x: (c, hooked(x)), None, xs)
    # Per example, the jitted hooked call (equal to the eager one, above) as reference.
    reference = eqx.filter_jit(hooked_call)
    results = jax.tree.map(np.asarray, ((out, log), (outs, logs)))
    for i in range(3):
        ref_out, ref_log = reference(hooked, xs[i])
        for o, lg in results:
            close(o[i], ref_out)
            jax.tree.map(lambda a, b, i=i: close(a[i], b), lg, ref_log)


def test_backward_under_jit_and_checking_leaks():
    model, x = make("stack")
    hooked = px.BackwardHook(px.from_nnx(model), log_fn=px.IdentityLog()).init(x)
    grad = eqx.filter_grad(lambda h, x: jnp.sum(h(x) ** 2))
    with jax.checking_leaks():
        jitted = eqx.filter_jit(grad)(hooked, x)
    jax.tree.map(close, jitted.log, grad(hooked, x).log)


# -- naming inside NNX transforms applied in the call ------------------------------------
# Each transform hands its body fresh module objects: they are named by the path they
# carry, not by their arrays.
IN_CALL = {
    "vmap": lambda f: nnx.vmap(f, in_axes=(None, 0)),
    "jit": nnx.jit,
    "remat": nnx.remat,
}


class SameArrays(nnx.Module):
    """Two layers `a` and `b` holding the very same arrays, each called once through
    the transform, then `c`."""

    def __init__(self, transform, rngs):
        self.transform = transform
        self.a = nnx.Linear(3, 3, rngs=rngs)
        self.b = nnx.Linear(3, 3, rngs=rngs)
        self.b.kernel = nnx.Param(self.a.kernel.get_value())
        self.b.bias = nnx.Param(self.a.bias.get_value())
        self.c = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x):
        step = IN_CALL[self.transform](lambda layer, x: jnp.tanh(layer(x)))
        return self.c(step(self.b, step(self.a, x)))


@pytest.mark.parametrize("transform", sorted(IN_CALL))
def test_layers_holding_the_same_arrays_are_named_by_their_own_paths_in_transforms(transform):
    model = SameArrays(transform, nnx.Rngs(0))
    x = jax.random.normal(key(1), (4, 3))
    net = px.from_nnx(model)
    a = model.a(x)
    b = model.b(jnp.tanh(a))
    _, log = px.ForwardHook(net, log_fn=px.IdentityLog())(x)
    assert set(log) == {"a", "b", "c"}
    close(log["a"], a)
    close(log["b"], b)
    # The edit of `b` equals the model with b's output doubled by hand.
    out, _ = px.ForwardHook(net, hook_fn=lambda y: 2 * y, where="b")(x)
    close(out, model.c(jnp.tanh(2 * b)))
    weights = jnp.arange(12.0).reshape(4, 3)
    hooked = px.BackwardHook(net, log_fn=px.IdentityLog(), where=["a", "b"]).init(x)
    grads = eqx.filter_grad(lambda h: jnp.sum(h(x) * weights))(hooked)
    _, vjp_a = jax.vjp(lambda a: model.c(jnp.tanh(model.b(jnp.tanh(a)))), a)
    _, vjp_b = jax.vjp(lambda b: model.c(jnp.tanh(b)), b)
    close(grads.log["a"], vjp_a(weights)[0])
    close(grads.log["b"], vjp_b(weights)[0])


class Scale(nnx.Module):
    def __init__(self, factor):
        self.factor = factor

    def __call__(self, x):
        return x * self.factor


class Stateless(nnx.Module):
    """Modules without arrays (a deterministic Dropout, a module holding a float)
    called through the transform, then `lin`."""

    def __init__(self, transform, rngs):
        self.transform = transform
        self.drop = nnx.Dropout(0.1, deterministic=True)
        self.scale = Scale(3.0)
        self.lin = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x):
        step = IN_CALL[self.transform](lambda layer, x: jnp.tanh(layer(x)))
        return self.lin(step(self.scale, step(self.drop, x)))


@pytest.mark.parametrize("transform", sorted(IN_CALL))
def test_modules_without_arrays_are_named_in_transforms(transform):
    model = Stateless(transform, nnx.Rngs(0))
    x = jax.random.normal(key(1), (4, 3))
    net = px.from_nnx(model)
    scaled = 3.0 * jnp.tanh(x)
    out, log = px.ForwardHook(net, log_fn=px.IdentityLog())(x)
    np.testing.assert_array_equal(out, nnx.clone(model)(x))
    assert set(log) == {"drop", "scale", "lin"}
    close(log["drop"], x)
    close(log["scale"], scaled)
    _, log = px.ForwardHook(net, log_fn=px.IdentityLog(), where="lin")(x)
    assert set(log) == {"lin"}
    out, _ = px.ForwardHook(net, hook_fn=lambda y: 2 * y, where="scale")(x)
    close(out, model.lin(jnp.tanh(2 * scaled)))


THROUGH = {
    "jit": lambda self, x: nnx.jit(lambda lin, x: jnp.tanh(lin(x)))(self.lin, x),
    "remat": lambda self, x: nnx.remat(lambda lin, x: jnp.tanh(lin(x)))(self.lin, x),
    "cond": lambda self, x: nnx.cond(jnp.sum(x) > -1e9, lambda lin, x: jnp.tanh(lin(x)), lambda lin, x: x, self.lin, x),
}


class Twice(nnx.Module):
    """`lin` called through one NNX transform, then through another (NNX writes each
    transform's output Variables back into `lin`), then `other`."""

    def __init__(self, transforms, rngs):
        self.transforms = transforms
        self.lin = nnx.Linear(3, 3, rngs=rngs)
        self.other = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x):
        for transform in self.transforms:
            x = THROUGH[transform](self, x)
        return self.other(x)


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("transforms", ["jit,jit", "jit,remat", "jit,cond", "remat,remat", "remat,cond", "remat,jit"])
def test_a_layer_called_through_two_nnx_transforms(transforms, mode):
    model = Twice(transforms.split(","), nnx.Rngs(0))
    x = jax.random.normal(key(1), (2, 3))
    net = px.from_nnx(model)
    run = AROUND[mode]
    first = model.lin(x)
    second = model.lin(jnp.tanh(first))
    out, log = run(px.ForwardHook(net, log_fn=px.IdentityLog()), x)
    close(out, nnx.clone(model)(x))
    assert set(log) == {"lin", "lin@1", "other"}
    close(log["lin"], first)
    close(log["lin@1"], second)
    weights = jnp.arange(6.0).reshape(2, 3)
    hooked = px.BackwardHook(net, log_fn=px.IdentityLog(), where="lin").init(x)
    grads = eqx.filter_grad(lambda h, x: jnp.sum(run(h, x) * weights))(hooked, x)
    _, vjp_first = jax.vjp(lambda y: model.other(jnp.tanh(model.lin(jnp.tanh(y)))), first)
    _, vjp_second = jax.vjp(lambda y: model.other(jnp.tanh(y)), second)
    close(grads.log["lin"], vjp_first(weights)[0])
    close(grads.log["lin@1"], vjp_second(weights)[0])


class PerExampleDropout(nnx.Module):
    """NNX's per-example dropout: RNG keys split with `nnx.split_rngs`, mapped by
    `nnx.vmap` (a key per example) in the call."""

    def __init__(self, in_axes, rngs):
        self.in_axes = in_axes
        self.lin = nnx.Linear(3, 3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        @nnx.split_rngs(splits=x.shape[0])
        @nnx.vmap(in_axes=(self.in_axes, 0))
        def dropped(drop, h):
            return drop(h)

        return dropped(self.drop, self.lin(x))


@pytest.mark.parametrize("in_axes", [nnx.StateAxes({nnx.RngState: 0, ...: None}), 0], ids=["state_axes", "axis_0"])
def test_per_example_dropout_with_split_rngs_is_named(in_axes):
    model = PerExampleDropout(in_axes, nnx.Rngs(0))
    x = jax.random.normal(key(1), (4, 3))
    net = px.from_nnx(model)
    expected = nnx.clone(model)(x)
    out, log = px.ForwardHook(net, log_fn=px.IdentityLog())(x)
    np.testing.assert_array_equal(out, expected)
    assert set(log) == {"lin", "drop"}
    close(log["drop"], expected)
    out, _ = px.ForwardHook(net, hook_fn=lambda y: 2 * y, where="drop")(x)
    close(out, 2 * expected)


def test_a_module_built_in_the_call_from_arrays_two_layers_hold_raises_naming_both():
    class Rebuilds(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(3, 3, rngs=rngs)
            self.b = nnx.Linear(3, 3, rngs=rngs)
            self.b.kernel = nnx.Param(self.a.kernel.get_value())
            self.b.bias = nnx.Param(self.a.bias.get_value())

        def __call__(self, x):
            rebuilt = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
            rebuilt.kernel = nnx.Param(self.a.kernel.get_value())
            rebuilt.bias = nnx.Param(self.a.bias.get_value())
            return self.b(rebuilt(x))

    with pytest.raises(px.HookError, match=r"cannot name the Linear called from NNX path '': .*'a', 'b'"):
        px.ForwardHook(px.from_nnx(Rebuilds(nnx.Rngs(0))), log_fn=px.IdentityLog())(jnp.ones(3))


def test_the_path_a_module_carries_leaves_with_the_call():
    model = Twice(("jit", "remat"), nnx.Rngs(0))
    net = px.from_nnx(model, return_state=True)
    (_, updated), _ = px.ForwardHook(net, log_fn=px.IdentityLog())(jnp.ones(3))
    assert updated.graphdef is net.graphdef
    pairs = zip(nnx.iter_modules(px.to_nnx(updated)), nnx.iter_modules(model), strict=True)
    assert all(vars(module).keys() == vars(original).keys() for (_, module), (_, original) in pairs)


# -- training and the way back -----------------------------------------------------------
def test_training_with_optax_then_to_nnx_matches_nnx_training():
    x = jax.random.normal(key(1), (8, 3))
    y = jax.random.normal(key(2), (8, 2))
    optim = optax.sgd(0.1)

    converted = px.from_nnx(MLP(nnx.Rngs(0)))
    opt_state = optim.init(eqx.filter(converted, eqx.is_inexact_array))
    loss = lambda m, x, y: jnp.mean((m(x) - y) ** 2)
    for _ in range(3):
        grads = eqx.filter_grad(loss)(converted, x, y)
        updates, opt_state = optim.update(grads, opt_state)
        converted = eqx.apply_updates(converted, updates)
    trained = px.to_nnx(converted)

    native = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(native, optim, wrt=nnx.Param)
    for _ in range(3):
        optimizer.update(native, nnx.grad(loss)(native, x, y))

    assert isinstance(trained, MLP)
    jax.tree.map(close, nnx.state(trained), nnx.state(native))
    close(trained(x), native(x))


def test_hooks_inside_users_nnx_jit_step_on_a_live_module():
    model, x = make("cnn_train")
    reference = nnx.clone(model)
    optimizers = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in (model, reference)]

    def step(model, optimizer, x, hooked):
        def loss(model):
            if not hooked:
                return jnp.mean(model(x) ** 2), {}
            converted = px.from_nnx(model, return_state=True)
            (out, updated), log = px.ForwardHook(converted, log_fn=px.MeanLog())(x)
            nnx.update(model, updated.state)
            return jnp.mean(out ** 2), log

        grads, log = nnx.grad(loss, has_aux=True)(model)
        optimizer.update(model, grads)
        return log

    log = nnx.jit(step, static_argnums=3)(model, optimizers[0], x, True)
    nnx.jit(step, static_argnums=3)(reference, optimizers[1], x, False)
    assert set(log) == {"conv", "bn", "drop", "head"}
    jax.tree.map(close, snapshot(model), snapshot(reference))
    assert not np.allclose(model.head.kernel.get_value(), make("cnn_train")[0].head.kernel.get_value())


# -- patching: scoping, errors, threads ---------------------------------------------------
def test_class_patches_are_restored_after_an_exception():
    model = Family(nnx.Rngs(0))
    originals = {cls: vars(cls).get("__call__") for cls in (nnx.Linear, nnx.Sequential, Scaled, Inherited)}

    def boom(value):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as info:
        px.ForwardHook(px.from_nnx(model), hook_fn=boom, where="left.layers.0")(jnp.ones(3))
    assert "left.layers.0" in str(info.value.__notes__)
    for cls, original in originals.items():
        assert vars(cls).get("__call__") is original
        assert not _patching.is_patched(cls, "__call__")
    assert "__call__" not in vars(Inherited)


def test_an_unnameable_module_raises_naming_the_caller():
    class MakesLayers(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(2, 2, rngs=rngs)

        def __call__(self, x):
            return nnx.Linear(2, 2, rngs=nnx.Rngs(0))(self.lin(x))

    with pytest.raises(px.HookError, match="cannot name the Linear called from NNX path ''"):
        px.ForwardHook(px.from_nnx(MakesLayers(nnx.Rngs(0))), log_fn=px.MeanLog())(jnp.ones(2))


def test_threads_do_not_see_each_others_hooks():
    model = MLP(nnx.Rngs(0))
    x = jnp.ones(3)
    (_, hooked_log), (patched, plain, (other_out, other_log)) = while_hooked_elsewhere(
        lambda pause: px.ForwardHook(px.from_nnx(model), hook_fn=pause, log_fn=px.MeanLog())(x),
        # Classes are patched now, for the other thread only.
        lambda: (
            _patching.is_patched(nnx.Linear, "__call__"),
            model(x),
            px.ForwardHook(px.from_nnx(model), log_fn=px.MeanLog(), where="linear2")(x),
        ),
    )
    assert patched
    close(plain, nnx.clone(model)(x))
    close(other_out, plain)
    assert set(other_log) == {"linear2"}
    assert set(hooked_log) == {"linear1", "linear2"}
    assert not _patching.is_patched(nnx.Linear, "__call__")


class Normalised(nnx.Module):
    """NNX's BatchNorm averaging over the axis of the vmap around a per-example model."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, axis_name="batch", rngs=rngs)

    def __call__(self, x):
        return self.bn(self.lin(x))


def test_init_of_a_model_with_a_collective_over_the_batch_runs_inside_its_vmap():
    net = Normalised(nnx.Rngs(0))
    xs = jax.random.normal(jax.random.key(1), (5, 3))
    slot_gradient, _ = slot_gradient_of_init_inside_the_vmap(px.from_nnx(net), xs)

    def shifted(delta):  # the batch normalisation written out (scale 1, bias 0 at init)
        h = jax.vmap(net.lin)(xs) + delta
        return jnp.sum(((h - h.mean(0)) / jnp.sqrt(h.var(0) + net.bn.epsilon)) ** 2)

    close(slot_gradient, jax.grad(shifted)(jnp.zeros(4)), tol=1e-4)


def test_transfer_into_a_model_with_a_collective_over_the_batch_maps_it_over_a_batch():
    a, b = px.from_nnx(Normalised(nnx.Rngs(0))), px.from_nnx(Normalised(nnx.Rngs(1)))
    xs = jax.random.normal(jax.random.key(1), (5, 3))
    # On one example, the shape-only pass that reads the layers' types is refused.
    with pytest.raises(px.HookError, match=r"^transfer_params\(\.\.\., inputs=\) ran .*'batch'.*jax.vmap\(self"):
        px.transfer_params(a, b, {"lin": "lin", "bn": "bn"}, inputs=xs[0])

    class Batched(eqx.Module):  # the remedy the error gives
        model: px.NnxModule

        def __call__(self, xs):
            return jax.vmap(self.model, axis_name="batch")(xs)

    ported = px.transfer_params(Batched(a), Batched(b), {"model.lin": "model.lin", "model.bn": "model.bn"}, inputs=xs)
    # Against the source run by NNX itself over the batch.
    close(ported(xs), nnx.vmap(lambda m, x: m(x), in_axes=(None, 0), axis_name="batch")(px.to_nnx(a), xs))


class WithLoRA(nnx.Module):
    def __init__(self, lin):
        self.lin = lin

    def __call__(self, x):
        return self.lin(x)


def test_a_lora_linear_is_not_transferred_as_its_base_linear():
    # nnx.LoRALinear is an nnx.Linear whose `lora` adds to its output: copying kernel and
    # bias alone (as before) silently dropped it, in either direction.
    x = jnp.linspace(-1, 1, 10).reshape(2, 5)
    lora = WithLoRA(nnx.LoRALinear(5, 3, lora_rank=2, rngs=nnx.Rngs(0)))
    lora.lin.lora.lora_b.set_value(jnp.ones_like(lora.lin.lora.lora_b.get_value()))
    plain = WithLoRA(nnx.Linear(5, 3, rngs=nnx.Rngs(1)))
    base = x @ lora.lin.kernel.get_value() + lora.lin.bias.get_value()
    assert not np.allclose(lora(x), base)
    for src, dst in ((lora, plain), (plain, lora)):
        for inputs in ({}, {"inputs": x}):
            unread = r"cannot map layer 'lin': its parameters \['lora\.lora_a', 'lora\.lora_b'\]"
            with pytest.raises(px.HookError, match=unread):
                px.transfer_params(px.from_nnx(src), px.from_nnx(dst), {"lin": "lin"}, **inputs)


def test_a_layer_a_weight_or_spectral_norm_wraps_is_not_transferred():
    # nnx.WeightNorm and nnx.SpectralNorm call their layer with other weights than its stored
    # kernel: copying the kernel alone (as before) gave another function.
    x = jnp.linspace(-1, 1, 10).reshape(2, 5)
    plain = WithLoRA(nnx.Linear(5, 3, rngs=nnx.Rngs(1)))
    for wrapper in (nnx.WeightNorm, nnx.SpectralNorm):
        wrapped = WithLoRA(wrapper(nnx.Linear(5, 3, rngs=nnx.Rngs(2)), rngs=nnx.Rngs(3)))
        for src, dst, mapping in ((wrapped, plain, {"lin.layer_instance": "lin"}),
                                  (plain, wrapped, {"lin": "lin.layer_instance"})):
            with pytest.raises(px.HookError, match=f"reparametrised by the {wrapper.__name__} holding it"):
                px.transfer_params(px.from_nnx(src), px.from_nnx(dst), mapping)
    wrapped = WithLoRA(nnx.WeightNorm(nnx.Linear(5, 3, rngs=nnx.Rngs(2)), rngs=nnx.Rngs(3)))
    layer = wrapped.lin.layer_instance
    stored = x @ layer.kernel.get_value() + layer.bias.get_value()
    assert not np.allclose(wrapped(x), stored)


def test_a_bridged_linen_module_is_one_site_named_by_its_place():
    # `bridge.ToNNX` reads all its attributes as linen variables (the path attribute
    # the adapter sets on every module crashed it); its own call is the site, the
    # linen modules it applies are not (nnx.capture does not see them either).
    import flax.linen as nn
    from flax.nnx import bridge

    class LinenMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name="out")(jax.nn.relu(nn.Dense(4, name="hidden")(x)))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.pre = nnx.Linear(2, 2, rngs=rngs)
            self.bridged = bridge.ToNNX(LinenMLP(), rngs=rngs)
            bridge.lazy_init(self.bridged, jnp.ones((1, 2)))

        def __call__(self, x):
            return self.bridged(self.pre(x))

    model, x = Model(nnx.Rngs(0)), jnp.linspace(-1, 1, 4).reshape(2, 2)
    out, log = px.ForwardHook(px.from_nnx(model), log_fn=px.IdentityLog())(x)
    assert set(log) == {"pre", "bridged"}
    np.testing.assert_array_equal(out, model(x))
    np.testing.assert_array_equal(log["bridged"], model.bridged(model.pre(x)))
    # Checked after the call (NNX layers may sow values of any name under them).
    with pytest.raises(px.HookError, match=r"'bridged\.hidden' selected no call"):
        px.ForwardHook(px.from_nnx(model), log_fn=px.IdentityLog(), where="bridged.hidden")(x)
