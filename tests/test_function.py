"""Pure-function models (zephyr's nets and hand-written JAX) hooked with
`px.from_function` without changing their code: names from params paths, logs against
the layer functions called by hand, backward logs against `jax.vjp`, transforms inside
and around, kinds and summaries, transfer to Equinox, patch scoping and threads."""


import pytest

pytest.importorskip("zephyr")  # the test extra

import equinox as eqx
import jax
import jax.numpy as jnp
import zephyr._nets.mlp
from zephyr.building.tracing import trace
from zephyr.functools.partial import placeholder_hole as hole
from zephyr.nets import dropout, layer_norm, linear, mlp, multi_head_self_attention, sequential, token_embed

import peex_interop as px
from models import close, while_hooked_elsewhere
from peex_interop._adapters._function import from_function, layer_type


# -- the seed's autoencoder, as written ----------------------------------------------------
def encoder(params, x, embed_dim, latent_dim):
    x = mlp(params["mlp_1"], x, [embed_dim, embed_dim])
    x = mlp(params["mlp_2"], x, [embed_dim, latent_dim])
    return x


def decoder(params, x, embed_dim, original_dim):
    x = mlp(params, x, [embed_dim, embed_dim, original_dim])
    return x


def autoencoder(params, x, embed_dim, latent_dim):
    encoding = encoder(params["encoder"], x, embed_dim, latent_dim)  # noqa: F841 (the seed's)
    reconstruction = decoder(params["decoder"], x, embed_dim, x.shape[-1])
    return reconstruction


HYPER = (8, 5)


@pytest.fixture(scope="module")
def seed():
    x = jax.random.normal(jax.random.key(1), (4, 6))
    params = trace(autoencoder, jax.random.key(0), x, *HYPER)
    return from_function(autoencoder, params, layers=[mlp, linear]), params, x


def by_hand(params, x):
    """Every layer's output, each layer function called by hand."""
    logs = {}
    layers = (("encoder.mlp_1", params["encoder"]["mlp_1"], [8, 8]), ("decoder", params["decoder"], [8, 8, 6]))
    for name, sub, dims in layers:
        logs[name] = mlp(sub, x, dims)
        h = x
        for i, dim in enumerate(dims):
            logs[f"{name}.{i}"] = h = linear(sub[i], h, dim)
            h = jax.nn.relu(h) if i < len(dims) - 1 else h
        if name == "encoder.mlp_1":
            logs["encoder.mlp_2"] = mlp(params["encoder"]["mlp_2"], logs[name], [8, 5])
            logs["encoder.mlp_2.0"] = h = linear(params["encoder"]["mlp_2"][0], logs[name], 8)
            logs["encoder.mlp_2.1"] = linear(params["encoder"]["mlp_2"][1], jax.nn.relu(h), 5)
    return logs


def test_seed_autoencoder_logs_every_mlp_and_linear_under_its_params_path(seed):
    model, params, x = seed
    close(model(x, *HYPER), autoencoder(params, x, *HYPER))
    with jax.checking_leaks():
        out, log = eqx.filter_jit(lambda m, x: px.ForwardHook(m, log_fn=px.IdentityLog())(x, *HYPER))(model, x)
    close(out, autoencoder(params, x, *HYPER))
    expected = by_hand(params, x)
    assert set(log) == set(expected)
    jax.tree.map(close, log, expected)


def test_backward_logs_equal_vjp_of_the_sub_computation(seed):
    model, params, x = seed
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where="decoder.*").init(x, *HYPER)
    with jax.checking_leaks():
        grads = eqx.filter_jit(eqx.filter_grad(lambda h, x: jnp.sum(h(x, *HYPER) ** 2)))(hooked, x)
    logs = by_hand(params, x)
    d = params["decoder"]
    rest = {
        "decoder.0": lambda h: linear(d[2], jax.nn.relu(linear(d[1], jax.nn.relu(h), 8)), 6),
        "decoder.1": lambda h: linear(d[2], jax.nn.relu(h), 6),
        "decoder.2": lambda h: h,
    }
    for path, f in rest.items():
        out, vjp = jax.vjp(f, logs[path])
        close(grads.log[path], vjp(2 * out)[0])


def test_vmap_around_and_edits(seed):
    model, params, x = seed
    with jax.checking_leaks():
        _, log = jax.vmap(lambda x: px.ForwardHook(model, log_fn=px.IdentityLog(), where="decoder.0")(x, *HYPER))(x)
    for i in range(x.shape[0]):
        close(log["decoder.0"][i], linear(params["decoder"][0], x[i], 8))
    out, _ = px.ForwardHook(model, hook_fn=px.FunctionHook(lambda y: 2 * y), where="decoder.0")(x, *HYPER)
    # linear, then relu: doubling the output is doubling the weights and bias.
    doubled = {**params, "decoder": {**params["decoder"], 0: jax.tree.map(lambda a: 2 * a, params["decoder"][0])}}
    close(out, autoencoder(doubled, x, *HYPER))


def test_summary_kinds_stats_and_selection(seed):
    model, params, x = seed
    rows = {row.path: row for row in px.summary(model, x, *HYPER).rows}
    assert (rows["decoder"].module_type, rows["decoder"].kind) == ("mlp", "container")
    assert (rows["decoder.0"].module_type, rows["decoder.0"].kind) == ("linear", "linear")
    assert rows["decoder.0"].trainable == 6 * 8 + 8
    assert px.total_params(model) == (sum(a.size for a in jax.tree.leaves(params)), 0)
    stats = lambda m, x: px.ForwardHook(m, log_fn=px.activation_stats(), where=px.kind("linear"))(x, *HYPER)
    _, log = eqx.filter_jit(stats)(model, x)
    assert set(log) == {p for p in by_hand(params, x) if p.split(".")[-1].isdigit()}
    close(log["decoder.1"]["mean"], jnp.mean(by_hand(params, x)["decoder.1"]))
    _, log = px.ForwardHook(model, log_fn=px.MeanLog(), where=lambda path, layer: layer.calls(mlp))(x, *HYPER)
    assert set(log) == {"encoder.mlp_1", "encoder.mlp_2", "decoder"}
    _, log = px.ForwardHook(model, log_fn=px.MeanLog(), where=layer_type(mlp))(x, *HYPER)
    assert set(log) == {"encoder.mlp_1", "encoder.mlp_2", "decoder"}
    # Function models list only the layers given params: a pattern is checked after the call.
    with pytest.raises(px.HookError, match=r"'decodr\.\*' selected no call.*decoder"):
        px.ForwardHook(model, where="decodr.*")(x, *HYPER)


# -- hand-written models, transforms inside ---------------------------------------------------
def dense(params, x):
    return x @ params["w"] + params["b"]


def block(params, x):
    return x + jnp.tanh(dense(params["inner"], x))


def stacked(params, x):
    """A scanned stack of blocks and a vmapped ensemble of heads."""
    x = dense(params["inp"], x)
    x, _ = jax.lax.scan(lambda h, p: (block(p, h), None), x, params["blocks"])
    return jax.vmap(lambda p: dense(p, x))(params["heads"]).mean(0)


def stacked_params():
    k = iter(jax.random.split(jax.random.key(0), 8))

    def layer(*shape):
        return {"w": jax.random.normal(next(k), shape), "b": jax.random.normal(next(k), shape[:-2] + shape[-1:])}

    return {"inp": layer(3, 4), "blocks": {"inner": layer(3, 4, 4)}, "heads": layer(2, 4, 2)}


def test_hand_written_model_with_scan_and_vmap_inside():
    params = stacked_params()
    model = from_function(stacked, params, layers={dense: "linear", block: "container"})
    x = jax.random.normal(jax.random.key(1), (5, 3))
    with jax.checking_leaks():
        out, log = eqx.filter_jit(lambda m, x: px.ForwardHook(m, log_fn=px.IdentityLog())(x))(model, x)
    close(out, stacked(params, x))
    assert set(log) == {"inp", "blocks", "blocks.inner", "heads"}
    h = dense(params["inp"], x)
    for step in range(3):
        p = jax.tree.map(lambda a: a[step], params["blocks"])
        close(log["blocks.inner"][step], dense(p["inner"], h))
        h = block(p, h)
        close(log["blocks"][step], h)
    for member in range(2):
        close(log["heads"][member], dense(jax.tree.map(lambda a: a[member], params["heads"]), h))
    # Cotangents inside the scan are per step.
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where="blocks.inner").init(x)
    grads = eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2))(hooked, x)
    assert grads.log["blocks.inner"].shape == (3, 5, 4)


def zephyr_transformer(params, tokens, key):
    x = token_embed(params["embed"], tokens, 11, 8)
    h = layer_norm(params["norm"], x, -1)
    x = x + multi_head_self_attention(params["attn"], h, 2, implementation="xla")
    x = dropout(None, key, x, 0.5)
    return linear(params["head"], x, 3)


def test_zephyr_nets_kinds_and_layers_without_params():
    tokens = jax.random.randint(jax.random.key(1), (2, 5), 0, 11)
    key = jax.random.key(2)
    params = trace(zephyr_transformer, jax.random.key(0), tokens, key)
    model = from_function(
        zephyr_transformer, params, layers=[token_embed, layer_norm, multi_head_self_attention, linear, dropout]
    )
    rows = {row.path: row.kind for row in px.summary(model, tokens, key).rows}
    assert rows == {
        "embed": "embedding", "norm": "norm", "attn.q_proj": "linear", "attn.k_proj": "linear",
        "attn.v_proj": "linear", "attn.out_proj": "linear", "attn": "attention",
        "dropout": "dropout", "head": "linear",
    }
    out, log = px.ForwardHook(model, log_fn=px.IdentityLog())(tokens, key)
    close(out, zephyr_transformer(params, tokens, key))
    close(log["norm"], layer_norm(params["norm"], token_embed(params["embed"], tokens, 11, 8), -1))
    close(log["attn.q_proj"], linear(params["attn"]["q_proj"], log["norm"], 8))
    # A layer without params is selected by its path (no params path lists it ahead of the call).
    out, log = px.ForwardHook(model, log_fn=px.IdentityLog(), hook_fn=lambda y: 2 * y, where="dropout")(tokens, key)
    assert set(log) == {"dropout"}
    embedded = token_embed(params["embed"], tokens, 11, 8)
    h = layer_norm(params["norm"], embedded, -1)
    x = embedded + multi_head_self_attention(params["attn"], h, 2, implementation="xla")
    close(log["dropout"], 2 * dropout(None, key, x, 0.5))  # logged as edited
    close(out, linear(params["head"], log["dropout"], 3))


def test_params_passed_through_a_nested_jit_are_named_through_their_arrays(seed):
    model, params, x = seed

    def jitted(params, x):
        # jax.jit rebuilds the params subtree from its own tracers.
        return jax.jit(lambda p, x: decoder(p, x, 8, 6))(params["decoder"], x)

    _, log = px.ForwardHook(from_function(jitted, params, layers=[mlp, linear]), log_fn=px.IdentityLog())(x)
    expected = {k: v for k, v in by_hand(params, x).items() if k.startswith("decoder")}
    assert set(log) == set(expected)
    jax.tree.map(close, log, expected)


def test_the_kinds_of_zephyrs_nets_name_real_functions():
    import importlib

    from peex_interop._adapters._function import ZEPHYR_KINDS, default_kind

    for qualified, kind in ZEPHYR_KINDS.items():
        module, name = qualified.rsplit(".", 1)
        assert default_kind(getattr(importlib.import_module(module), name)) == kind
    assert default_kind(dense) == "other"


def test_a_function_model_inside_an_equinox_model_logs_under_its_field(seed):
    model, params, x = seed

    class Wrapper(eqx.Module):
        autoencoder: px.FunctionModule

        def __call__(self, x):
            return self.autoencoder(x, *HYPER)

    _, log = px.ForwardHook(Wrapper(model), log_fn=px.IdentityLog(), where="autoencoder.decoder.*")(x)
    assert set(log) == {"autoencoder.decoder.0", "autoencoder.decoder.1", "autoencoder.decoder.2"}
    close(log["autoencoder.decoder.2"], autoencoder(params, x, *HYPER))


# -- transfer --------------------------------------------------------------------------------
def test_transfer_between_a_zephyr_mlp_and_an_equinox_mlp():
    x = jax.random.normal(jax.random.key(1), (4, 3))
    params = trace(lambda p, x: mlp(p, x, [5, 2]), jax.random.key(0), x)
    model = from_function(lambda p, x: mlp(p, x, [5, 2]), params, layers=[mlp, linear])
    eqx_mlp = eqx.nn.MLP(3, 2, 5, 1, activation=jax.nn.relu, key=jax.random.key(3))
    ported = px.transfer_params(model, eqx_mlp, {"0": "layers.0", "1": "layers.1"})
    close(jax.vmap(ported)(x), model(x))
    zeros = from_function(lambda p, x: mlp(p, x, [5, 2]), jax.tree.map(jnp.zeros_like, params), layers=[mlp, linear])
    back = px.transfer_params(ported, zeros, {"layers.0": "0", "layers.1": "1"})
    jax.tree.map(close, back.params, params)
    with pytest.raises(px.HookError, match=r"layers\.0"):
        px.transfer_params(model, eqx.nn.MLP(3, 2, 6, 1, key=jax.random.key(3)), {"0": "layers.0"})


def test_transfer_between_zephyr_attention_and_nnx_attention_is_exact():
    nnx = pytest.importorskip("flax.nnx")

    def attention(params, x):
        return multi_head_self_attention(params, x, 2, implementation="xla")

    x = jax.random.normal(jax.random.key(1), (2, 5, 4))
    params = trace(attention, jax.random.key(0), x)
    model = from_function(attention, params, layers=[multi_head_self_attention, linear])
    port = px.from_nnx(nnx.MultiHeadAttention(2, 4, decode=False, rngs=nnx.Rngs(0)))
    alignment = px.align(model, port, x)
    assert alignment.mapping == {"q_proj": "query", "k_proj": "key", "v_proj": "value", "out_proj": "out"}
    ported = px.transfer_params(model, port, alignment.mapping, inputs=x)
    close(ported(x), model(x))
    # Back, from the variables alone: zephyr's projection names tell the layout.
    zeros = from_function(attention, jax.tree.map(jnp.zeros_like, params), layers=[linear])
    back = px.transfer_params(ported, zeros, {b: a for a, b in alignment.mapping.items()})
    jax.tree.map(close, back.params, params)


def test_one_network_in_five_styles_logs_the_same_keys_and_values():
    hk = pytest.importorskip("haiku")
    nn = pytest.importorskip("flax.linen")
    nnx = pytest.importorskip("flax.nnx")
    x = jax.random.normal(jax.random.key(1), (4, 3))

    def zephyr_mlp(params, x):
        return mlp(params, x, [5, 2])

    reference = from_function(zephyr_mlp, trace(zephyr_mlp, jax.random.key(0), x), layers=[mlp, linear])

    class EquinoxMLP(eqx.Module):
        mlp: eqx.nn.MLP

        def __call__(self, x):
            return jax.vmap(self.mlp)(x)

    class LinenMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(jax.nn.relu(nn.Dense(5)(x)))

    haiku = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([5, 2])(x)))
    linen = LinenMLP()
    ports = {
        "equinox": EquinoxMLP(eqx.nn.MLP(3, 2, 5, 1, activation=jax.nn.relu, key=jax.random.key(2))),
        "haiku": px.from_haiku(haiku, haiku.init(jax.random.key(2), x)),
        "nnx": px.from_nnx(
            nnx.Sequential(nnx.Linear(3, 5, rngs=nnx.Rngs(2)), jax.nn.relu, nnx.Linear(5, 2, rngs=nnx.Rngs(3)))
        ),
        "linen": px.from_linen(linen, linen.init(jax.random.key(2), x)),
    }
    # The same hook line everywhere.
    hook = lambda model: px.ForwardHook(model, log_fn=px.IdentityLog(), where=px.kind("linear"))(x)
    _, expected = hook(reference)
    assert set(expected) == {"0", "1"}
    for style, port in ports.items():
        mapping = px.align(reference, port, x).mapping
        port = px.transfer_params(reference, port, mapping)
        _, log = hook(port)
        canonical = px.rename(log, {b: a for a, b in mapping.items()})
        assert set(canonical) == set(expected), style
        jax.tree.map(close, canonical, expected)


# -- errors, scoping, threads ------------------------------------------------------------------
def test_foreign_params_are_an_error_naming_the_function(seed):
    model, params, x = seed

    def foreign(p, x):
        return linear({"weights": jnp.ones((6, 2)), "bias": jnp.zeros(2)}, x, 2)

    with pytest.raises(px.HookError, match="'linear'"):
        px.ForwardHook(from_function(foreign, params, layers=[linear]), log_fn=px.MeanLog())(x)


def test_patches_are_undone_on_every_path_and_threads_are_isolated(seed):
    model, params, x = seed
    originals = (zephyr._nets.mlp.linear, zephyr.nets.linear, globals()["mlp"])

    def failing(y):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        px.ForwardHook(model, hook_fn=px.FunctionHook(failing), where="decoder.1")(x, *HYPER)
    assert (zephyr._nets.mlp.linear, zephyr.nets.linear, globals()["mlp"]) == originals

    (_, log), (patched, plain) = while_hooked_elsewhere(
        lambda pause: px.ForwardHook(model, hook_fn=pause, log_fn=px.MeanLog(), where="decoder.0")(x, *HYPER),
        # The globals are patched now, and fall through to the originals here.
        lambda: (zephyr._nets.mlp.linear is not originals[0], autoencoder(params, x, *HYPER)),
    )
    assert patched and set(log) == {"decoder.0"}
    close(plain, autoencoder(params, x, *HYPER))
    assert (zephyr._nets.mlp.linear, zephyr.nets.linear, globals()["mlp"]) == originals


def _conv_transpose(params, x):
    return jax.lax.conv_transpose(x, params["w"], (2,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))


class _Upsampler(eqx.Module):
    up: eqx.nn.Conv1d

    def __call__(self, x):
        return jax.vmap(lambda v: self.up(v.T).T)(x)


def test_a_conv_transpose_function_is_refused_not_read_as_a_conv():
    # Its kind is "conv" (as zephyr's conv_transpose_* are), but its kernel is not a conv's.
    x = jnp.ones((1, 8, 3))
    model = from_function(lambda params, x: _conv_transpose(params["up"], x), {"up": {"w": jnp.ones((3, 3, 4))}},
                          layers={_conv_transpose: "conv"})
    conv = _Upsampler(eqx.nn.Conv1d(3, 4, 3, use_bias=False, key=jax.random.key(1)))
    with pytest.raises(px.HookError, match=r"'up'.*conv-transpose"):
        px.transfer_params(model, conv, {"up": "up"}, inputs=(x,))


# -- names that must not be read two ways -----------------------------------------------------
def _scanned_mlps(params, x):
    return jax.lax.scan(lambda h, p: (h + mlp(p, h, [3, 3]), None), x, params["blocks"])[0]


def test_an_integer_params_key_under_a_stack_is_not_also_read_as_a_step():
    # zephyr's mlp params have integer keys: `blocks.0` is linear 0 of the scanned mlp,
    # and would also read as step 0 of the stack `blocks`.
    k = jax.random.split(jax.random.key(0), 2)
    params = {"blocks": {i: {"weights": jax.random.normal(k[i], (2, 3, 3)), "bias": jnp.full((2, 3), 0.1 * i)}
                         for i in range(2)}}
    model = from_function(_scanned_mlps, params, layers=[mlp, linear])
    x = jax.random.normal(jax.random.key(1), (2, 3))
    jitted = eqx.filter_jit(lambda hooked, x: hooked(x))
    for call in (lambda hooked, x: hooked(x), jitted):
        for hooks in (dict(log_fn=px.IdentityLog()), dict(hook_fn=lambda y: 0 * y)):
            with pytest.raises(px.HookError, match=r"'blocks\.0' names two calls.*'blocks\.0'.*'blocks'"):
                call(px.ForwardHook(model, where="blocks.0", **hooks), x)
        with pytest.raises(px.HookError, match="names two calls"):
            px.BackwardHook(model, log_fn=px.IdentityLog(), where="blocks.0").init(x)
    # The layer alone, at every step, as the error says.
    linear_0 = lambda path, layer: path == "blocks.0"
    _, log = jitted(px.ForwardHook(model, log_fn=px.IdentityLog(), where=linear_0), x)
    h, expected = x, []
    for step in range(2):
        p = jax.tree.map(lambda a: a[step], params["blocks"])
        expected.append(linear(p[0], h, 3))
        h = h + mlp(p, h, [3, 3])
    close(log["blocks.0"], jnp.stack(expected))
    out, _ = px.ForwardHook(model, hook_fn=lambda y: 0 * y, where=linear_0)(x)
    zeroed = {"blocks": {**params["blocks"], 0: jax.tree.map(jnp.zeros_like, params["blocks"][0])}}
    close(out, _scanned_mlps(zeroed, x))


def _tied(params, x):
    return linear(params["dec"], jnp.tanh(linear(params["enc"], x, 3)), 3)


def test_one_params_subtree_at_two_paths_is_two_layers_eager_as_under_jit():
    shared = {"weights": jax.random.normal(jax.random.key(0), (3, 3)), "bias": jnp.full(3, 0.1)}
    model = from_function(_tied, {"enc": shared, "dec": shared}, layers=[linear])
    x = jax.random.normal(jax.random.key(1), (2, 3))
    enc = linear(shared, x, 3)
    for call in (lambda hooked, x: hooked(x), eqx.filter_jit(lambda hooked, x: hooked(x))):
        _, log = call(px.ForwardHook(model, log_fn=px.IdentityLog()), x)
        assert set(log) == {"enc", "dec"}
        close(log["enc"], enc)
        close(log["dec"], linear(shared, jnp.tanh(enc), 3))
        out, log = call(px.ForwardHook(model, hook_fn=lambda y: y + 1, log_fn=px.IdentityLog(), where="enc"), x)
        assert set(log) == {"enc"}
        close(out, linear(shared, jnp.tanh(enc + 1), 3))
        _, log = call(px.ForwardHook(model, log_fn=px.IdentityLog(), where="dec"), x)
        assert set(log) == {"dec"}


def _matmul(params, x):
    return x @ params["w"]


def _scanned_matmuls(params, x):
    return jax.lax.scan(lambda h, p: (_matmul(p["b"], _matmul(p["a"], h)), None), x, params["blocks"])[0]


def test_tied_arrays_that_nothing_tells_apart_are_an_error_not_one_name():
    w = jax.random.normal(jax.random.key(0), (2, 3, 3))
    model = from_function(_scanned_matmuls, {"blocks": {"a": {"w": w}, "b": {"w": w}}}, layers=[_matmul])
    x = jnp.ones((1, 3))
    # Under jit each path is its own tracer; eagerly, the scan's inputs are one array.
    _, log = eqx.filter_jit(lambda hooked, x: hooked(x))(px.ForwardHook(model, log_fn=px.IdentityLog()), x)
    assert set(log) == {"blocks.a", "blocks.b"}
    with pytest.raises(px.HookError, match=r"'_matmul'.*several paths.*'blocks\.a', 'blocks\.b'"):
        px.ForwardHook(model, log_fn=px.IdentityLog())(x)


# -- zephyr's placeholder partials -------------------------------------------------------------
def _sequential(params, x):
    return sequential(params["seq"], x, [linear(hole, hole, 6), layer_norm(hole, hole, -1), linear(hole, hole, 3)])


def test_a_placeholder_partial_is_hooked_where_it_gets_its_params():
    x = jax.random.normal(jax.random.key(1), (2, 4))
    params = trace(_sequential, jax.random.key(0), x)
    model = from_function(_sequential, params, layers=[linear, layer_norm, sequential])
    # zephyr's sequential threads the params as params[1], params[0][2], params[0][1].
    seq = params["seq"]
    expected = {"seq.1": linear(seq[1], x, 6)}
    expected["seq.0.2"] = layer_norm(seq[0][2], expected["seq.1"], -1)
    expected["seq.0.1"] = expected["seq"] = linear(seq[0][1], expected["seq.0.2"], 3)
    _, log = eqx.filter_jit(lambda hooked, x: hooked(x))(px.ForwardHook(model, log_fn=px.IdentityLog()), x)
    assert set(log) == set(expected)
    jax.tree.map(close, log, expected)
    assert set(px.ForwardHook(model, log_fn=px.MeanStdLog())(x)[1]) == set(expected)
    assert [row.path for row in px.summary(model, x).rows] == ["seq.1", "seq.0.2", "seq.0.1", "seq"]
    grads = eqx.filter_grad(lambda hooked: jnp.sum(hooked(x) ** 2))(
        px.BackwardHook(model, log_fn=px.IdentityLog(), where="seq.1").init(x)
    )
    rest = lambda h: linear(seq[0][1], layer_norm(seq[0][2], h, -1), 3)
    out, vjp = jax.vjp(rest, expected["seq.1"])
    close(grads.log["seq.1"], vjp(2 * out)[0])

    def partial_then_call(params, x):
        return jnp.tanh(linear(params["l"], hole, 3)(x))

    params = trace(partial_then_call, jax.random.key(0), x)
    model = from_function(partial_then_call, params, layers=[linear])
    out, log = px.ForwardHook(model, hook_fn=lambda y: y + 1, log_fn=px.IdentityLog(), where="l")(x)
    close(log["l"], linear(params["l"], x, 3) + 1)
    moved = {"l": {**params["l"], "bias": params["l"]["bias"] + 1}}
    close(out, partial_then_call(moved, x))


def _curried(params):
    return lambda x: x @ params["w"]


def test_a_layer_function_returning_a_function_is_refused_naming_the_layer():
    model = from_function(lambda params, x: _curried(params["a"])(x), {"a": {"w": jnp.ones((3, 2))}}, layers=[_curried])
    with pytest.raises(px.HookError, match=r"layer 'a'.*'_curried' returned a function"):
        px.ForwardHook(model, log_fn=px.IdentityLog())(jnp.ones((1, 3)))
