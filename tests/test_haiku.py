"""Haiku models (from hk.nets and hk's own layers) converted with px.from_haiku."""

import functools

import pytest

pytest.importorskip("haiku")  # skipped where the [haiku] extra is not installed

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from haiku._src import module as hk_module

import peex_interop as px
from models import close, slot_gradient_of_init_inside_the_vmap


def mlp_fn(x):
    return hk.nets.MLP([8, 4])(x)


def mha_fn(x):
    return hk.MultiHeadAttention(num_heads=2, key_size=4, w_init=hk.initializers.VarianceScaling())(x, x, x)


def lstm_fn(xs):
    core = hk.LSTM(6)
    return hk.dynamic_unroll(core, xs, core.initial_state(xs.shape[1]))[0]


def stack_fn(x):
    def block(x):
        return jnp.tanh(hk.Linear(5, name="lin")(x))

    return hk.Linear(2, name="head")(hk.experimental.layer_stack(3)(block)(x))


def scan_fn(x):
    lin = hk.Linear(5, name="shared")
    return hk.scan(lambda c, _: (jnp.tanh(lin(c)), None), x, None, length=3)[0]


def vmap_remat_fn(x):
    x = hk.vmap(lambda r: hk.Linear(5, name="rows")(r), split_rng=False)(x)
    return hk.remat(lambda x: hk.Linear(3, name="out")(x))(x)


def dropout_fn(x):
    return hk.dropout(hk.next_rng_key(), 0.5, hk.Linear(6)(x))


MODELS = {
    "mlp": (mlp_fn, (3, 5)),
    "mha": (mha_fn, (4, 6)),
    "lstm": (lstm_fn, (4, 2, 3)),
    "layer_stack": (stack_fn, (2, 5)),
    "scan": (scan_fn, (2, 5)),
    "vmap_remat": (vmap_remat_fn, (2, 5)),
    "dropout": (dropout_fn, (2, 5)),
}


def convert(name):
    fn, shape = MODELS[name]
    transformed = hk.transform(fn)
    x = jax.random.normal(jax.random.key(1), shape)
    params = transformed.init(jax.random.key(0), x)
    return transformed, params, px.from_haiku(transformed, params, rng=jax.random.key(2)), x


@pytest.mark.parametrize("name", sorted(MODELS))
def test_identity_hooks_change_nothing_and_nothing_leaks(name):
    transformed, params, model, x = convert(name)
    expected = transformed.apply(params, jax.random.key(2), x)
    close(model(x), expected)
    hooked = px.ForwardHook(model, hook_fn=px.IdentityHook(), log_fn=px.IdentityLog())
    with jax.checking_leaks():
        out, log = eqx.filter_jit(lambda h, x: h(x))(hooked, x)
    close(out, expected)
    assert log and not hk_module.interceptor_stack  # the interceptor left with the call


def layer_outputs_by_hand(name, params, x):
    """Every layer's output, computed from the params without Haiku; outputs of layers
    run in a scan (layer_stack, hk.scan) are stacked per step."""

    def linear(key, h, i=None):
        w, b = params[key]["w"], params[key]["b"]
        return h @ w + b if i is None else h @ w[i] + b[i]

    if name == "mlp":
        h0 = linear("mlp/~/linear_0", x)
        h1 = linear("mlp/~/linear_1", jax.nn.relu(h0))
        return {"mlp.linear_0": h0, "mlp.linear_1": h1, "mlp": h1}
    key = {"layer_stack": "__layer_stack_no_per_layer/lin", "scan": "shared"}[name]
    h, steps = x, []
    for i in range(3):
        steps.append(linear(key, h, i if name == "layer_stack" else None))
        h = jnp.tanh(steps[-1])
    if name == "scan":
        return {"shared": jnp.stack(steps)}
    return {"lin": jnp.stack(steps), "head": linear("head", h)}


def test_mlp_logs_equal_hand_computation_and_native_names():
    transformed, params, model, x = convert("mlp")
    _, log = px.ForwardHook(model, log_fn=px.IdentityLog())(x)
    assert set(log) == {"mlp", "mlp.linear_0", "mlp.linear_1"}
    jax.tree.map(close, log, layer_outputs_by_hand("mlp", params, x))
    assert model.haiku_names(x)["mlp.linear_0"] == "mlp/~/linear_0"


def test_attention_projection_logs():
    transformed, params, model, x = convert("mha")
    _, log = px.ForwardHook(model, log_fn=px.IdentityLog(), where="multi_head_attention.*")(x)
    for proj in ("query", "key", "value"):
        # MHA names its projections with a name scope ("/"), not as submodules ("/~/").
        p = params[f"multi_head_attention/{proj}"]
        close(log[f"multi_head_attention.{proj}"], x @ p["w"] + p["b"])


def test_scan_and_layer_stack_logs_are_stacked_per_step():
    transformed, params, model, x = convert("layer_stack")
    _, log = px.ForwardHook(model, log_fn=px.IdentityLog())(x)
    assert set(log) == {"lin", "head"}  # layer_stack's internal module is not a layer
    assert log["lin"].shape == (3, 2, 5)
    jax.tree.map(close, log, layer_outputs_by_hand("layer_stack", params, x))
    transformed, params, model, x = convert("scan")
    _, log = px.ForwardHook(model, log_fn=px.IdentityLog())(x)
    assert log["shared"].shape == (3, 2, 5)
    jax.tree.map(close, log, layer_outputs_by_hand("scan", params, x))


def test_lstm_unrolled_logs_per_step():
    transformed, params, model, x = convert("lstm")
    _, log = px.ForwardHook(model, log_fn=px.IdentityLog(), where="lstm")(x)
    outputs, state = log["lstm"]
    close(outputs, transformed.apply(params, None, x))
    assert outputs.shape == (4, 2, 6) and state.cell.shape == (4, 2, 6)


TRANSFORMS = {
    "jit": lambda f: jax.jit(f),
    "vmap": lambda f: lambda xs: jax.vmap(f)(jnp.stack([xs, 2 * xs])),
    "scan": lambda f: lambda x: jax.lax.scan(lambda c, x: (c, f(x)), None, jnp.stack([x, 2 * x]))[1],
    "remat": lambda f: jax.checkpoint(f),
    "grad": lambda f: jax.grad(lambda x: jnp.sum(f(x)[0] ** 2) + sum(jnp.sum(v) for v in jax.tree.leaves(f(x)[1]))),
}


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("name", ["mlp", "layer_stack"])
def test_transforms_around_match_hand_computation(transform, name):
    transformed, params, model, x = convert(name)
    hooked = px.ForwardHook(model, log_fn=px.MeanLog())

    def by_hand(x):
        # MeanLog inside layer_stack's scan: one mean per step.
        means = {k: jnp.mean(v, axis=tuple(range(1, v.ndim)) if k == "lin" else None)
                 for k, v in layer_outputs_by_hand(name, params, x).items()}
        return transformed.apply(params, None, x), means

    with jax.checking_leaks():
        got = TRANSFORMS[transform](lambda x: hooked(x))(x)
    # Outputs and logs (for grad: the gradient through both) against the same transform
    # of a computation by hand.
    jax.tree.map(close, got, TRANSFORMS[transform](by_hand)(x))


def test_backward_logs_equal_vjp_including_layer_stack():
    transformed, params, model, x = convert("layer_stack")
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog()).init(x)
    with jax.checking_leaks():
        grads = eqx.filter_jit(eqx.filter_grad(lambda h, x: jnp.sum(h(x) ** 2)))(hooked, x)
    w, b = params["__layer_stack_no_per_layer/lin"]["w"], params["__layer_stack_no_per_layer/lin"]["b"]
    head = params["head"]

    def loss_from(i, pre):
        h = jnp.tanh(pre)
        for j in range(i + 1, 3):
            h = jnp.tanh(h @ w[j] + b[j])
        return jnp.sum((h @ head["w"] + head["b"]) ** 2)

    h = x
    for i in range(3):
        pre = h @ w[i] + b[i]
        close(grads.log["lin"][i], jax.grad(loss_from, argnums=1)(i, pre))
        h = jnp.tanh(pre)


def test_backward_edit_on_mlp_equals_hand_modified_gradient():
    transformed, params, model, x = convert("mlp")
    hooked = px.BackwardHook(model, hook_fn=lambda ct: 0.5 * ct, where="mlp.linear_0").init(x)
    grads = eqx.filter_grad(lambda h, x: jnp.sum(h(x) ** 2))(hooked, x).model.params
    plain = jax.grad(lambda p: jnp.sum(transformed.apply(p, None, x) ** 2))(params)
    # The edit acts below linear_1 only.
    jax.tree.map(close, grads["mlp/~/linear_1"], plain["mlp/~/linear_1"])
    jax.tree.map(lambda g, p: close(g, 0.5 * p), grads["mlp/~/linear_0"], plain["mlp/~/linear_0"])


def resnet_fn(x, is_training):
    # ResNet18's architecture (basic blocks, projections, batch norm) at tiny widths and
    # one block per group: the same module types and state, a fraction of the compile.
    return hk.nets.ResNet(
        blocks_per_group=(1, 1, 1, 1), num_classes=3, bottleneck=False,
        channels_per_group=(4, 8, 8, 8), use_projection=(False, True, True, True),
        initial_conv_config={"output_channels": 4},
    )(x, is_training)


def numpy_initialiser(next_creator, shape, dtype, init, context):
    """Fan-in scaled normal weights drawn by NumPy: Haiku's truncated-normal initialisers
    cost seconds of XLA compilation for a ResNet, and the test needs values, not a scheme."""
    rng = np.random.default_rng(len(context.full_name))
    scale = 1 / np.sqrt(np.prod(shape[:-1])) if len(shape) > 1 else 1.0
    return next_creator(shape, dtype, lambda shape, dtype: jnp.asarray(rng.standard_normal(shape) * scale, dtype))


def resnet_init_fn(x):
    with hk.custom_creator(numpy_initialiser):
        return resnet_fn(x, True)


@pytest.fixture(scope="module")
def resnet():
    transformed = hk.transform_with_state(resnet_fn)
    x = jax.random.normal(jax.random.key(1), (2, 16, 16, 3))
    # The same modules, so the same names: these params and state fit `transformed`.
    params, state = jax.jit(hk.transform_with_state(resnet_init_fn).init)(None, x)
    return transformed, params, state, x


@pytest.mark.parametrize("is_training", [True, False])
def test_resnet_with_batchnorm_state(resnet, is_training):
    transformed, params, state, x = resnet
    params_before = jax.tree.map(np.asarray, params)
    model = px.from_haiku(transformed, params, state)
    call = eqx.filter_jit(lambda h, x: h(x, is_training))
    # The EMAs update only in training: in evaluation the pattern naming them selects
    # no call, and is no error (the model has them: they are in its state).
    where = ["**.batchnorm_*", "**.mean_ema"]
    (out, new_state), log = call(px.ForwardHook(model, log_fn=px.MeanLog(), where=where), x)
    ref_out, ref_state = jax.jit(transformed.apply, static_argnums=4)(params, state, None, x, is_training)
    close(out, ref_out, 1e-4)
    jax.tree.map(lambda a, b: close(a, b, 1e-4), new_state, ref_state)
    assert any(k.endswith("mean_ema") for k in log) == is_training  # EMAs update only in training
    # Carrying the state into the next call is one line.
    model = model.with_state(new_state)
    jax.tree.map(np.testing.assert_array_equal, model.state, new_state)
    jax.tree.map(np.testing.assert_array_equal, params, params_before)  # never mutated


def _intercepted_outputs(transformed, params, state, x, is_training, suffix):
    """`{dotted path: output}` of the modules whose name ends with `suffix`, recorded by
    Haiku's own interceptor around the plain model's call."""
    outputs = {}

    def record(next_f, args, kwargs, context):
        out = next_f(*args, **kwargs)
        name = context.module.module_name
        if context.method_name == "__call__" and name.endswith(suffix):
            outputs[".".join(part for part in name.split("/") if part not in ("", "~"))] = out
        return out

    with hk.intercept_methods(record):
        transformed.apply(params, state, None, x, is_training)
    return outputs


@pytest.mark.parametrize("is_training", [True, False])
def test_a_pattern_naming_layers_that_did_not_run_is_no_error(resnet, is_training):
    # Evaluation mode reads BatchNorm's moving averages without calling `mean_ema`: the
    # model has them (in its state), so naming them is no error; its log lacks them.
    transformed, params, state, x = resnet
    model = px.from_haiku(transformed, params, state)
    call = eqx.filter_jit(lambda h, x: h(x, is_training))
    _, log = call(px.ForwardHook(model, log_fn=px.IdentityLog(), where=["**.conv_1", "**.mean_ema"]), x)
    expected = _intercepted_outputs(transformed, params, state, x, is_training, "/conv_1")
    assert len(expected) == 4 and {k for k in log if k.endswith("conv_1")} == set(expected)
    for key, value in expected.items():
        close(log[key], value, 1e-4)
    emas = {k for k in log if k.endswith("mean_ema")}
    in_state = {".".join(p for p in name.split("/") if p != "~") for name in state if name.endswith("mean_ema")}
    assert len(in_state) == 12 and emas == (in_state if is_training else set())  # every BatchNorm's
    assert set(log) == set(expected) | emas
    # A pattern that names nothing the model has still raises, in both modes.
    for typo in ("**.mean_emma", "**.conv_9"):
        with pytest.raises(px.HookError, match=rf"'{typo.replace('*', '[*]')}' selected no call"):
            call(px.ForwardHook(model, log_fn=px.IdentityLog(), where=["**.conv_1", typo]), x)


class Double(hk.Module):
    """A module without parameters: known from the calls that run it only."""

    def __call__(self, x):
        return 2 * x


def branch_fn(x, extra):
    x = hk.Linear(3)(x)
    return Double()(x) if extra else x


def test_a_layer_known_from_an_earlier_call_that_did_not_run_is_no_error():
    transformed = hk.transform(branch_fn)
    x = jnp.ones((2, 4))
    params = transformed.init(jax.random.key(0), x, True)
    model = px.from_haiku(transformed, params)
    hooked = px.ForwardHook(model, log_fn=px.IdentityLog(), where=["linear", "double"])
    # Nothing tells of `double` before a call runs it: it could be a typo.
    with pytest.raises(px.HookError, match=r"'double' selected no call"):
        hooked(x, False)
    _, log = hooked(x, True)
    assert set(log) == {"linear", "double"}
    # Known from that call, a later call that does not run it logs the others.
    _, log = eqx.filter_jit(lambda h, x: h(x, False))(hooked, x)
    assert set(log) == {"linear"}
    close(log["linear"], x @ params["linear"]["w"] + params["linear"]["b"])
    with pytest.raises(px.HookError, match=r"'doubel' selected no call"):
        px.ForwardHook(model, log_fn=px.IdentityLog(), where=["linear", "doubel"])(x, False)


def test_same_hook_line_on_equinox_model_and_haiku_twin():
    transformed, params, model, x = convert("mlp")
    eqx_mlp = eqx.nn.MLP(5, 4, 8, depth=1, key=jax.random.key(0))
    for i, name in enumerate(["mlp/~/linear_0", "mlp/~/linear_1"]):
        eqx_mlp = eqx.tree_at(
            lambda m: (m.layers[i].weight, m.layers[i].bias), eqx_mlp,
            (params[name]["w"].T, params[name]["b"]),
        )
    logs = {}
    for library, net in (("equinox", eqx_mlp), ("haiku", model)):
        hooked = px.ForwardHook(net, log_fn=px.MeanStdLog(), where=lambda path, m: "linear" in type(m).__name__.lower())
        logs[library] = hooked(x)[1] if library == "haiku" else jax.vmap(hooked)(x)[1]
    # Equinox's MLP is per example (vmapped): compare the statistics of the same activations.
    eqx_first = jax.vmap(eqx_mlp.layers[0])(x)
    close(logs["haiku"]["mlp.linear_0"][0], jnp.mean(eqx_first))
    close(logs["haiku"]["mlp.linear_0"][1], jnp.std(eqx_first))
    assert set(logs["equinox"]) == {"layers.0", "layers.1"}
    close(logs["equinox"]["layers.0"][0], jnp.mean(eqx_first, axis=1))


def test_training_with_optax_returns_haiku_params():
    transformed, params, model, x = convert("mlp")
    y = jnp.ones((3, 4))
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state):
        def loss(model):
            out, log = px.ForwardHook(model, log_fn=px.MeanLog())(x)
            return jnp.mean((out - y) ** 2), log

        (value, _), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
        updates, opt_state = optimizer.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, value

    losses = []
    for _ in range(20):
        model, opt_state, value = step(model, opt_state)
        losses.append(float(value))
    assert losses[-1] < 0.5 * losses[0]
    trained = model.params
    assert isinstance(trained, dict) and set(trained) == set(params)
    close(jnp.mean((transformed.apply(trained, None, x) - y) ** 2), losses[-1], 0.05)
    assert not np.allclose(trained["mlp/~/linear_0"]["w"], params["mlp/~/linear_0"]["w"])


def test_hooks_inside_users_own_transform():
    log_fn = px.MeanStdLog()

    def fn(x):
        out, log = px.ForwardHook(px.haiku_function(mlp_fn), log_fn=log_fn, where="mlp.*")(x)
        return out, log

    transformed = hk.transform(fn)
    x = jax.random.normal(jax.random.key(1), (3, 5))
    params = transformed.init(jax.random.key(0), x)
    out, log = jax.jit(transformed.apply)(params, None, x)
    converted = px.from_haiku(hk.transform(mlp_fn), params)
    ref_out, ref_log = px.ForwardHook(converted, log_fn=log_fn, where="mlp.*")(x)
    close(out, ref_out)
    assert set(log) == set(ref_log) == {"mlp.linear_0", "mlp.linear_1"}
    jax.tree.map(close, log, ref_log)


def test_rng_models_take_the_key_the_documented_way():
    transformed, params, model, x = convert("dropout")
    key = jax.random.key(7)
    close(model.with_rng(key)(x), transformed.apply(params, key, x))
    assert not np.allclose(model.with_rng(key)(x), model(x))


def test_bad_input():
    transformed, params, model, x = convert("mlp")
    with pytest.raises(TypeError, match=r"hk\.transform"):
        px.from_haiku(mlp_fn, params)
    # Haiku models list only their modules with parameters: a path is checked after the call.
    hooked = px.ForwardHook(model, where="mlp.linear0")
    with pytest.raises(px.HookError, match=r"'mlp.linear0' selected no call.*Closest layers called: mlp\.linear_0"):
        hooked(x)


def test_modules_without_parameters_are_selected_by_their_path():
    # hk.Sequential and hk.DeepRNN hold no parameters: px.module_paths cannot list them, the
    # call names them; a selection of one is not refused before the call.
    def sequential(x):
        return hk.Sequential([hk.Linear(4), jax.nn.relu, hk.Linear(3)])(x)

    def deep_rnn(x):
        core = hk.DeepRNN([hk.Linear(4), jax.nn.relu, hk.Linear(3)])
        return core(x, core.initial_state(x.shape[0]))  # (output, state)

    x = jnp.linspace(-1, 1, 10).reshape(2, 5)
    for fn, name in ((sequential, "sequential"), (deep_rnn, "deep_rnn")):
        transformed = hk.transform(fn)
        params = transformed.init(jax.random.key(0), x)
        model = px.from_haiku(transformed, params)
        assert name not in px.module_paths(model)
        expected = transformed.apply(params, None, x)
        out, log = px.ForwardHook(model, log_fn=px.IdentityLog(), where=name)(x)
        jax.tree.map(close, (out, log[name]), (expected, expected))
        double = functools.partial(jax.tree.map, lambda y: 2 * y)
        edited, _ = eqx.filter_jit(px.ForwardHook(model, hook_fn=double, where=name))(x)
        jax.tree.map(close, edited, double(expected))


class Coder(hk.Module):
    def __call__(self, x):
        return self.decode(self.encode(x))

    def encode(self, x):
        return jnp.tanh(hk.Linear(2, name="down")(x))

    def decode(self, z):
        return hk.Linear(5, name="up")(z)


def test_other_methods_are_selectable_and_init_is_never_hooked():
    transformed = hk.without_apply_rng(hk.transform(lambda x: Coder(name="coder")(x)))
    x = jnp.ones((3, 5))
    params = transformed.init(jax.random.key(0), x)
    # Every method site by default; modules created inside a method (Haiku's
    # `coder/~encode/down`) sit under it.
    default = px.from_haiku(transformed, params)
    _, log = px.ForwardHook(default, log_fn=px.IdentityLog())(x)
    assert set(log) == {"coder", "coder.encode", "coder.encode.down", "coder.decode", "coder.decode.up"}
    down = params["coder/~encode/down"]
    np.testing.assert_allclose(log["coder.encode"], jnp.tanh(x @ down["w"] + down["b"]), rtol=1e-6)
    assert {row.key: row.kind for row in px.sites(default, x)}["coder.encode"] == "method"
    only_calls = px.from_haiku(transformed, params, methods=("__call__",))
    _, log = px.ForwardHook(only_calls, log_fn=px.MeanLog())(x)
    assert set(log) == {"coder", "coder.encode.down", "coder.decode.up"}
    both = px.from_haiku(transformed, params, methods=("__call__", "encode", "__init__"))
    _, log = px.ForwardHook(both, log_fn=px.IdentityLog())(x)
    assert set(log) == {"coder", "coder.encode", "coder.encode.down", "coder.decode.up"}  # no __init__


def test_init_of_a_model_with_a_collective_over_the_batch_runs_inside_its_vmap():
    def normalised(x, delta=0.0):
        h = hk.Linear(4, name="lin")(x) + delta
        return hk.BatchNorm(True, True, 0.9, cross_replica_axis="batch")(h, is_training=True)

    transformed = hk.transform_with_state(normalised)
    xs = jax.random.normal(jax.random.key(1), (5, 3))
    params, state = jax.vmap(lambda x: transformed.init(jax.random.key(0), x), axis_name="batch", out_axes=None)(xs)
    slot_gradient, loss = slot_gradient_of_init_inside_the_vmap(px.from_haiku(transformed, params, state), xs)
    expected = jax.jit(jax.grad(lambda d: loss(lambda x: transformed.apply(params, state, None, x, d))))(jnp.zeros(4))
    close(slot_gradient, expected, tol=1e-4)


# -- modules of lifted inner transforms (hk.lift, layer_stack) --------------------------
inner_mlp = hk.transform(lambda x: hk.nets.MLP([3, 3], name="mlp")(x))


def lift_init(lifted, x):
    return lifted(hk.next_rng_key() if hk.running_init() else None, x)


def lifted_clash_fn(x):
    # The lifted MLP is `mlp` inside its own transform, as the model's own one is.
    inner = inner_mlp.apply(lift_init(hk.lift(inner_mlp.init, name="lifted"), x), None, x)
    return hk.nets.MLP([3, 2], name="mlp")(inner)


def lifted_by_hand(params, x, edits=None):
    """Every layer's output of `lifted_clash_fn` from its params; `edits` (path ->
    function) edits the output of those layers on the way."""
    edits = edits or {}
    outputs = {}

    def mlp(prefix, h):
        for i in range(2):
            p = params[f"{prefix}mlp/~/linear_{i}"]
            path = f"{prefix.replace('/', '.')}mlp.linear_{i}"
            h = outputs[path] = edits.get(path, lambda y: y)(h @ p["w"] + p["b"])
            if i == 0:
                h = jax.nn.relu(h)
        path = f"{prefix.replace('/', '.')}mlp"
        outputs[path] = edits.get(path, lambda y: y)(h)
        return outputs[path]

    return mlp("", mlp("lifted/", x)), outputs


@pytest.mark.parametrize("jit", [False, True])
def test_lifted_modules_are_named_by_their_params_path(jit):
    transformed = hk.transform(lifted_clash_fn)
    x = jax.random.normal(jax.random.key(1), (2, 3))
    params = transformed.init(jax.random.key(0), x)
    model = px.from_haiku(transformed, params)
    call = eqx.filter_jit(lambda h, x: h(x)) if jit else (lambda h, x: h(x))
    _, expected = lifted_by_hand(params, x)
    assert set(expected) <= set(px.module_paths(model))
    out, log = call(px.ForwardHook(model, log_fn=px.IdentityLog()), x)
    assert set(log) == set(expected)
    jax.tree.map(close, log, expected)
    for path in ("mlp.linear_0", "lifted.mlp.linear_0"):
        # An edit of one of the two `linear_0`s is that layer's alone.
        edited, _ = call(px.ForwardHook(model, hook_fn=lambda y: y + 1.0, where=path), x)
        close(edited, lifted_by_hand(params, x, {path: lambda y: y + 1.0})[0])
        # Its cotangent: the gradient of the loss at that layer's output.
        hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where=path).init(x)
        grads = eqx.filter_grad(lambda h, x: jnp.sum(call(h, x) ** 2))(hooked, x)
        delta = jnp.zeros_like(expected[path])
        cotangent = jax.grad(lambda d: jnp.sum(lifted_by_hand(params, x, {path: lambda y: y + d})[0] ** 2))(delta)
        assert set(grads.log) == {path}
        close(grads.log[path], cotangent)
    assert model.haiku_names(x)["lifted.mlp.linear_0"] == "mlp/~/linear_0"


def test_lifts_reused_transparent_and_vmapped_name_their_modules_by_params():
    x = jax.random.normal(jax.random.key(1), (2, 3))

    def reused(x):  # one lift called twice (allow_reuse): one set of params, two calls
        lifted = hk.experimental.lift(inner_mlp.init, name="lifted", allow_reuse=True)
        return inner_mlp.apply(lift_init(lifted, x), None, inner_mlp.apply(lift_init(lifted, x), None, x))

    def transparent(x):  # no name of its own: the inner names are the model's
        return inner_mlp.apply(lift_init(hk.transparent_lift(inner_mlp.init), x), None, x)

    def ensembles(x):  # two lifts giving out the same names, applied under vmap
        outs = []
        for name in ("a", "b"):
            init = hk.lift(jax.vmap(inner_mlp.init, in_axes=(0, None)), name=name)
            ensemble = init(hk.next_rng_keys(2) if hk.running_init() else None, x)
            outs.append(jax.vmap(inner_mlp.apply, in_axes=(0, None, None))(ensemble, None, x))
        return outs[0] - outs[1]

    for fn, layer, called in [
        (reused, "lifted/mlp/~/linear_0", ["lifted.mlp.linear_0", "lifted.mlp.linear_0@1"]),
        (transparent, "mlp/~/linear_0", ["mlp.linear_0"]),
        (ensembles, "b/mlp/~/linear_0", ["b.mlp.linear_0"]),
    ]:
        transformed = hk.transform(fn)
        params = transformed.init(jax.random.key(0), x)
        model = px.from_haiku(transformed, params)
        hooked = px.ForwardHook(model, log_fn=px.IdentityLog(), where=called[0])
        with jax.checking_leaks():
            out, log = eqx.filter_jit(lambda h, x: h(x))(hooked, x)
        np.testing.assert_array_equal(out, transformed.apply(params, None, x))
        assert sorted(log) == called
        w, b = params[layer]["w"], params[layer]["b"]
        close(log[called[0]], jnp.einsum("bi,...io->...bo", x, w) + b[..., None, :])


def test_an_inner_transform_on_params_no_lift_gave_out_is_refused():
    x = jnp.ones((2, 3))
    elsewhere = inner_mlp.init(jax.random.key(0), x)  # closed over: not the model's params
    transformed = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(3)(inner_mlp.apply(elsewhere, None, x))))
    model = px.from_haiku(transformed, transformed.init(jax.random.key(0), x))
    with pytest.raises(px.HookError, match=r"module 'mlp' runs in an inner hk.transform on params that no hk.lift"):
        px.ForwardHook(model, log_fn=px.IdentityLog(), where="linear")(x)
    close(model(x), transformed.apply(model.params, x))  # unhooked, it runs as ever


def test_lifted_modules_inside_users_own_transform():
    def fn(x):
        return px.ForwardHook(px.haiku_function(lifted_clash_fn), log_fn=px.IdentityLog(), where="**.linear_0")(x)

    transformed = hk.transform(fn)
    x = jax.random.normal(jax.random.key(1), (2, 3))
    params = transformed.init(jax.random.key(0), x)
    _, log = jax.jit(transformed.apply)(params, None, x)
    _, expected = lifted_by_hand(params, x)
    assert set(log) == {"mlp.linear_0", "lifted.mlp.linear_0"}
    jax.tree.map(close, log, {path: expected[path] for path in log})


def test_a_named_layer_stack_is_named_alike_in_users_own_transform_and_converted():
    def named_stack_fn(x):
        return hk.experimental.layer_stack(3, name="blocks")(lambda x: jnp.tanh(hk.Linear(5, name="lin")(x)))(x)

    def fn(x):  # `init` runs the stack's body inside its lift too: those calls make params
        return px.ForwardHook(px.haiku_function(named_stack_fn), log_fn=px.IdentityLog())(x)

    transformed = hk.transform(fn)
    x = jax.random.normal(jax.random.key(1), (2, 5))
    params = transformed.init(jax.random.key(0), x)
    _, log = transformed.apply(params, None, x)
    _, converted_log = px.ForwardHook(px.from_haiku(hk.transform(named_stack_fn), params), log_fn=px.IdentityLog())(x)
    assert set(log) == set(converted_log) == {"blocks.lin"}
    w, b = params["blocks/lin"]["w"], params["blocks/lin"]["b"]
    h, steps = x, []
    for i in range(3):
        steps.append(h @ w[i] + b[i])
        h = jnp.tanh(steps[-1])
    close(log["blocks.lin"], jnp.stack(steps))
    close(converted_log["blocks.lin"], jnp.stack(steps))
