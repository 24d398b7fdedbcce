"""Canonical paths and kinds across libraries, align / compare / rename / transfer."""

import pytest

pytest.importorskip("haiku")  # skipped where the [haiku] extra is not installed
pytest.importorskip("flax")  # skipped where the [flax] extra is not installed

import sys
from pathlib import Path

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import peex_interop as px
from models import random_like

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
import migrate


@pytest.fixture(scope="module")
def trio():
    # Built from their shapes with NumPy weights (`random_like`): the three libraries'
    # initialisers would compile an XLA program per parameter shape.
    images = jnp.asarray(np.random.default_rng(0).uniform(size=(3, 8, 8, 1)), jnp.float32)
    transformed = hk.without_apply_rng(hk.transform(migrate.haiku_net))
    haiku = px.from_haiku(transformed, random_like(jax.eval_shape(transformed.init, jax.random.key(1), images), 1))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: migrate.NnxNet(nnx.Rngs(2))))
    nnx_net = px.from_nnx(nnx.merge(graphdef, random_like(state, 2)))
    equinox_net = random_like(eqx.filter_eval_shape(migrate.EquinoxNet, jax.random.key(3)), 3)
    return images, {"haiku": haiku, "nnx": nnx_net, "equinox": equinox_net}


EXPECTED = {
    "haiku": ["conv1", "conv2", "fc1", "fc2"],
    "nnx": ["convs.0", "convs.1", "hidden", "out"],
    "equinox": ["conv1", "conv2", "mlp.layers.0", "mlp.layers.1"],
}


@pytest.mark.parametrize(
    "a, b",
    [(a, b) for a in ("equinox", "haiku", "nnx") for b in ("equinox", "haiku", "nnx") if a != b],
)
def test_alignment_in_every_direction_then_transfer_and_compare(trio, a, b):
    images, models = trio
    alignment = px.align(models[a], models[b], images)
    assert alignment.mapping == dict(zip(EXPECTED[a], EXPECTED[b]))
    assert not alignment.unmatched and not alignment.ambiguous and alignment.order_preserved
    # inputs=: the Haiku convs' custom names (conv1, conv2) do not tell conv from
    # conv-transpose; a call does.
    port = px.transfer_params(models[a], models[b], alignment.mapping, inputs=images)
    comparison = px.compare(models[a], port, images, cotangents=True, alignment=alignment)
    assert comparison.first_divergence is None
    assert [row.path_a for row in comparison.rows] == EXPECTED[a]
    assert all(row.max_rel < 1e-5 and row.cotangent_max_rel < 1e-5 for row in comparison.rows)
    np.testing.assert_allclose(port(images), models[a](images), rtol=1e-5, atol=1e-5)
    # Before the transfer the two models disagree everywhere: compare can fail.
    assert px.compare(models[a], models[b], images, alignment=alignment).first_divergence.path_a == EXPECTED[a][0]


def test_a_repeated_compare_compiles_nothing(trio):
    # px.compare compiles its program itself (on CPU at another optimisation level than
    # jax.jit's): the compiled program must still be reused, not rebuilt per call.
    images, models = trio
    alignment = px.align(models["haiku"], models["nnx"], images)
    compiles = []

    def listen(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    first = px.compare(models["haiku"], models["nnx"], images, alignment=alignment, cotangents=True)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        again = px.compare(models["haiku"], models["nnx"], images, alignment=alignment, cotangents=True)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []
    assert again.rows == first.rows


def test_wrong_port_is_pinpointed(trio):
    images, models = trio
    mapping = px.align(models["haiku"], models["equinox"], images).mapping
    forgetful = random_like(eqx.filter_eval_shape(migrate.EquinoxNet, jax.random.key(3), forget_relu=True))
    wrong = px.transfer_params(models["haiku"], forgetful, mapping, inputs=images, verify=False)
    first = px.compare(models["haiku"], wrong, images).first_divergence
    assert (first.path_a, first.path_b) == ("fc1", "mlp.layers.0")  # the layer after the missing relu

    # A transposed kernel (a classic Haiku -> Equinox slip) is caught at its own layer.
    port = px.transfer_params(models["haiku"], models["equinox"], mapping, inputs=images)
    transposed = eqx.tree_at(lambda m: m.conv2.weight, port, jnp.swapaxes(port.conv2.weight, 0, 1))
    # conv2 is square (8 -> 8 channels): the slip keeps every shape, only values show it.
    assert transposed.conv2.weight.shape == port.conv2.weight.shape
    assert not np.allclose(transposed.conv2.weight, port.conv2.weight)
    assert px.compare(models["haiku"], port, images).first_divergence is None
    assert px.compare(models["haiku"], transposed, images).first_divergence.path_a == "conv2"


def test_with_cotangents_the_first_divergence_is_the_first_wrong_output():
    # A wrong middle layer changes the cotangents of every layer before it, whose
    # outputs agree exactly: those are cotangent-only, not the first divergence.
    mlp = eqx.nn.MLP(4, 3, 8, 3, key=jax.random.key(0))
    wrong = eqx.tree_at(lambda m: m.layers[2].weight, mlp, mlp.layers[2].weight * 1.5)
    x = jnp.linspace(-1.0, 1.0, 4)
    comparison = px.compare(mlp, wrong, x, cotangents=True)
    assert comparison.first_divergence.path_a == "layers.2"
    assert px.compare(mlp, wrong, x).first_divergence.path_a == "layers.2"
    assert [row.path_a for row in comparison.cotangent_only_rows] == ["layers.0", "layers.1"]
    # Independently: their outputs are bit-equal, their cotangents are not.
    for i in (0, 1):
        row = comparison.rows[i]
        assert row.diverged and row.cotangent_only and row.max_abs == 0 and row.cotangent_max_abs > 1e-3
    assert not comparison.rows[3].cotangent_only and comparison.rows[3].diverged
    text = str(comparison)
    assert "layers.2 -> layers.2; 2 layers diverge in their cotangents only" in text
    assert text.count("diverged (cotangent only)") == 2


def test_a_wrong_backward_pass_alone_is_a_cotangent_only_first_divergence():
    # Every output agrees; the activation's VJP doubles the cotangent: the backward
    # pass first goes wrong after layers.1, the last layer whose cotangent diverges.
    @jax.custom_vjp
    def identity(x):
        return x

    identity.defvjp(lambda x: (x, None), lambda _, g: (2 * g,))
    mlp = eqx.nn.MLP(4, 3, 8, 2, activation=lambda x: x, key=jax.random.key(0))
    wrong = eqx.tree_at(lambda m: m.activation, mlp, identity)
    comparison = px.compare(mlp, wrong, jnp.linspace(-1.0, 1.0, 4), cotangents=True)
    first = comparison.first_divergence
    assert first.path_a == "layers.1" and first.cotangent_only
    assert [row.path_a for row in comparison.cotangent_only_rows] == ["layers.0", "layers.1"]
    assert "(cotangent only: every output agrees)" in str(comparison)


class Attention(eqx.Module):
    attn: eqx.nn.MultiheadAttention

    def __call__(self, x):
        return jax.vmap(lambda x: self.attn(x, x, x))(x)


class NnxAttention(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=rngs)

    def __call__(self, x):
        return self.attn(x)


def test_alignment_of_attention_across_libraries():
    x = jax.random.normal(jax.random.key(0), (2, 5, 8))
    def attend(x):
        return hk.MultiHeadAttention(2, 4, w_init=hk.initializers.VarianceScaling())(x, x, x)

    transformed = hk.without_apply_rng(hk.transform(attend))
    models = {
        "equinox": Attention(eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(1))),
        "haiku": px.from_haiku(transformed, transformed.init(jax.random.key(2), x)),
        "nnx": px.from_nnx(NnxAttention(nnx.Rngs(3))),
    }
    projections = {
        "equinox": ["attn.query_proj", "attn.key_proj", "attn.value_proj", "attn.output_proj", "attn"],
        "haiku": [f"multi_head_attention.{p}" for p in ("query", "key", "value", "linear")] + ["multi_head_attention"],
        "nnx": ["attn.query", "attn.key", "attn.value", "attn.out", "attn"],
    }
    for a, b in (("equinox", "haiku"), ("equinox", "nnx"), ("haiku", "nnx")):
        alignment = px.align(models[a], models[b], x)
        assert alignment.mapping == dict(zip(projections[a], projections[b])), (a, b)


class ThreeLayers(eqx.Module):
    layers: list

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def test_ambiguity_is_reported_not_guessed():
    keys = jax.random.split(jax.random.key(0), 4)
    three = ThreeLayers([eqx.nn.Linear(4, 4, key=k) for k in keys[:3]])
    two = ThreeLayers([eqx.nn.Linear(4, 4, key=k) for k in keys[:2]] + [eqx.nn.Linear(4, 2, key=keys[3])])
    alignment = px.align(three, two, jnp.ones(4))
    assert alignment.mapping == {}
    assert {path for side, path, _ in alignment.ambiguous if side == "a"} == {"layers.0", "layers.1", "layers.2"}
    assert {path for side, path, _ in alignment.ambiguous if side == "b"} == {"layers.0", "layers.1"}
    assert alignment.unmatched == (("b", "layers.2", "no linear layer with 2 output values in the other model"),)
    assert "ambiguous" in str(alignment)


@pytest.mark.parametrize(
    "where",
    [px.kind("conv"), px.kind("linear"), px.all_of(px.kind("conv", "linear"), px.not_(px.kind("conv")))],
)
def test_the_same_filter_selects_corresponding_layers(trio, where):
    images, models = trio
    keys = {name: set(px.ForwardHook(m, log_fn=px.MeanLog(), where=where)(images)[1]) for name, m in models.items()}
    mapping = px.align(models["haiku"], models["nnx"], images).mapping
    assert {mapping[k] for k in keys["haiku"]} == keys["nnx"]
    mapping = px.align(models["haiku"], models["equinox"], images).mapping
    assert {mapping[k] for k in keys["haiku"]} == keys["equinox"]
    assert keys["haiku"]


def test_rename_round_trips_and_wrapper_argument(trio):
    images, models = trio
    mapping = px.align(models["haiku"], models["nnx"], images).mapping
    inverse = {b: a for a, b in mapping.items()}
    _, log = migrate.with_logging(models["nnx"])(images)
    old_keys = px.rename(log, inverse)
    assert set(old_keys) == set(EXPECTED["haiku"])
    assert px.rename(old_keys, mapping) == log
    _, renamed_at_source = migrate.with_logging(models["nnx"], rename=inverse)(images)
    assert set(renamed_at_source) == set(old_keys)
    jax.tree.map(np.testing.assert_array_equal, renamed_at_source, old_keys)
    # Suffixes of repeated calls and pre-logs survive.
    renamed = px.rename({"hidden@1": 1, "hidden:in": 2, "other": 3}, {"hidden": "fc1"})
    assert set(renamed) == {"fc1@1", "fc1:in", "other"}
    with pytest.raises(ValueError, match="two keys"):
        px.rename({"a": 1, "b": 2}, {"a": "b"})


def test_backward_rename_keys_slots_and_gradients(trio):
    images, models = trio
    hooked = px.BackwardHook(
        models["nnx"], log_fn=px.MeanLog(), where=px.kind("linear"), rename={"hidden": "fc1", "out": "fc2"}
    ).init(images)
    assert set(hooked.log) == {"fc1", "fc2"}
    grads = eqx.filter_grad(lambda h: jnp.sum(h(images)))(hooked)
    assert set(grads.log) == {"fc1", "fc2"}


def test_transfer_errors_name_the_layer(trio):
    images, models = trio
    with pytest.raises(px.HookError, match=r"layer 'mlp.layers.0'.*does not fit"):
        px.transfer_params(models["haiku"], models["equinox"], {"fc2": "mlp.layers.0"})
    without_bias = eqx.nn.Linear(32, 10, use_bias=False, key=jax.random.key(0))
    no_bias = eqx.tree_at(lambda m: m.mlp.layers[1], models["equinox"], without_bias)
    with pytest.raises(px.HookError, match=r"layer 'mlp.layers.1'.*has a bias"):
        px.transfer_params(models["haiku"], no_bias, {"fc2": "mlp.layers.1"})
    with pytest.raises(px.HookError, match="no layer 'nope'"):
        px.transfer_params(models["haiku"], models["equinox"], {"fc2": "nope"})
    lam = eqx.nn.Sequential([eqx.nn.Lambda(jnp.tanh)])
    with pytest.raises(px.HookError, match=r"cannot map layer 'layers.0'.*Lambda"):
        px.transfer_params(lam, lam, {"layers.0": "layers.0"})


class EqxEmbedNorm(eqx.Module):
    embed: eqx.nn.Embedding
    norm: eqx.nn.LayerNorm

    def __call__(self, tokens):
        return jax.vmap(jax.vmap(lambda t: self.norm(self.embed(t))))(tokens)


class NnxEmbedNorm(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(11, 6, rngs=rngs)
        self.norm = nnx.LayerNorm(6, epsilon=1e-5, rngs=rngs)  # Haiku and Equinox use 1e-5

    def __call__(self, tokens):
        return self.norm(self.embed(tokens))


def test_transfer_of_embeddings_and_norms_in_every_direction():
    tokens = jax.random.randint(jax.random.key(0), (2, 5), 0, 11)

    def haiku_fn(tokens):
        x = hk.Embed(11, 6, name="embed")(tokens)
        return hk.LayerNorm(-1, True, True, name="norm")(x)

    transformed = hk.without_apply_rng(hk.transform(haiku_fn))
    params = transformed.init(jax.random.key(1), tokens)
    # Non-trivial norm parameters, so that a transfer that skipped them would show.
    params = {**params, "norm": {"scale": jnp.arange(6.0) + 0.5, "offset": -jnp.arange(6.0)}}
    models = {
        "haiku": px.from_haiku(transformed, params),
        "equinox": EqxEmbedNorm(eqx.nn.Embedding(11, 6, key=jax.random.key(2)), eqx.nn.LayerNorm(6)),
        "nnx": px.from_nnx(NnxEmbedNorm(nnx.Rngs(3))),
    }
    for a, b in (("haiku", "equinox"), ("haiku", "nnx"), ("equinox", "nnx")):
        if a == "haiku":
            source = models[a]
        else:
            mapping = px.align(models["haiku"], models[a], tokens).mapping
            source = px.transfer_params(models["haiku"], models[a], mapping)
        alignment = px.align(source, models[b], tokens)
        assert sorted(alignment.mapping) == ["embed", "norm"]
        port = px.transfer_params(source, models[b], alignment.mapping)
        np.testing.assert_allclose(port(tokens), transformed.apply(params, tokens), rtol=1e-5, atol=1e-5)


# -- state beyond parameters: a position index and batch statistics over decode steps --
POSITION_TABLE = np.random.default_rng(7).standard_normal((8, 6)).astype(np.float32)


class HaikuPositions(hk.Module):
    def __call__(self, x):
        index = hk.get_state("cache_index", (), jnp.int32, init=jnp.zeros)
        hk.set_state("cache_index", index + 1)
        return x + jnp.asarray(POSITION_TABLE)[index]


def haiku_step(token, training=False):
    x = HaikuPositions(name="positions")(hk.Embed(11, 6, name="embed")(token))
    x = hk.BatchNorm(True, True, 0.9, eps=1e-5, name="bn")(x, is_training=training)
    return hk.Linear(5, name="out")(x)


class NnxPositions(nnx.Module):
    def __init__(self):
        self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))

    def __call__(self, x):
        index = self.cache_index[...]
        self.cache_index[...] = index + 1
        return x + jnp.asarray(POSITION_TABLE)[index]


class NnxStep(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(11, 6, rngs=rngs)
        self.positions = NnxPositions()
        self.bn = nnx.BatchNorm(6, epsilon=1e-5, use_running_average=True, rngs=rngs)
        self.out = nnx.Linear(6, 5, rngs=rngs)

    def __call__(self, token):
        return self.out(self.bn(self.positions(self.embed(token))))


def test_state_is_ported_and_compared_over_decode_steps():
    transformed = hk.without_apply_rng(hk.transform_with_state(haiku_step))
    token = jnp.array([3, 7])
    params, state = jax.eval_shape(lambda key: transformed.init(key, token, True), jax.random.key(0))
    params, state = random_like(params, 4), random_like(state, 5)
    # Statistics a transfer that skipped them would show (a variance is positive).
    state["bn/~/var_ema"] = {**state["bn/~/var_ema"], "average": jnp.abs(state["bn/~/var_ema"]["average"]) + 0.5}
    src = px.from_haiku(transformed, params, state)
    for t in (1, 4):  # two positions in
        src = src.carried(src(jnp.array([t, t])))[1]
    dst = px.from_nnx(nnx.eval_shape(lambda: NnxStep(nnx.Rngs(0))), return_state=True)
    mapping = {**px.align(src, dst, token).mapping, "positions": "positions"}
    assert mapping == {"embed": "embed", "bn": "bn", "out": "out", "positions": "positions"}
    port = px.transfer_params(src, dst, mapping, inputs=token)
    assert int(px.to_nnx(port).positions.cache_index.get_value()) == 2
    tokens = [jnp.array([t, 10 - t]) for t in (2, 5, 9)]
    comparison = px.compare(src, port, steps=tokens, cotangents=True)
    assert comparison.first_divergence is None, comparison
    assert [row.step for row in comparison.rows] == [0] * 3 + [1] * 3 + [2] * 3
    assert all(row.cotangent_max_abs is not None for row in comparison.rows)
    # Compared with the source one position behind, the port diverges from step 0 on,
    # first after the position embedding.
    behind = px.from_haiku(transformed, params, {**src.state, "positions": {"cache_index": jnp.array(1, jnp.int32)}})
    first = px.compare(behind, port, steps=tokens, alignment=comparison.alignment).first_divergence
    assert (first.step, first.path_a) == (0, "bn")
    # And back into the Haiku model, built abstractly: its state filled too.
    back = px.transfer_params(port, px.from_haiku(transformed, params, jax.eval_shape(lambda: state)),
                              {b: a for a, b in mapping.items()}, inputs=token)
    assert int(back.state["positions"]["cache_index"]) == 2
    assert px.compare(port, back, steps=tokens).first_divergence is None


def test_state_without_a_known_layout_is_refused_by_name():
    def cached(x):
        class Cache(hk.Module):
            def __call__(self, x):
                keys = hk.get_state("cached_key", (2, 4, 3), x.dtype, init=jnp.zeros)
                hk.set_state("cached_key", keys)
                return x

        return hk.Linear(3, name="lin")(Cache(name="attention")(x))

    transformed = hk.without_apply_rng(hk.transform_with_state(cached))
    shapes = jax.eval_shape(transformed.init, jax.random.key(0), jnp.ones((2, 3)))
    src = px.from_haiku(transformed, *random_like(shapes))
    abstract = nnx.eval_shape(lambda: NnxStep(nnx.Rngs(0)))
    with pytest.raises(px.HookError, match=r"'attention'.*state 'cached_key' \(2, 4, 3\) has no known layout"):
        px.transfer_params(src, px.from_nnx(abstract), {"attention": "positions"})
    # Several steps need models that carry their state.
    stepping = hk.without_apply_rng(hk.transform_with_state(haiku_step))
    token = jnp.array([3, 7])
    stepping = px.from_haiku(stepping, *random_like(jax.eval_shape(lambda k: stepping.init(k, token, True),
                                                                   jax.random.key(0))))
    graphdef, variables = nnx.split(abstract)
    with pytest.raises(px.HookError, match=r"drop their state updates.*return_state=True"):
        px.compare(stepping, px.from_nnx(nnx.merge(graphdef, random_like(variables))), steps=[token])


class LinenCachedBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.MultiHeadDotProductAttention(num_heads=2, decode=True)(x), None


class LinenCachedStack(nn.Module):
    @nn.compact
    def __call__(self, token):
        scan = nn.scan(LinenCachedBlock, variable_axes={"params": 0, "cache": 0}, split_rngs={"params": True},
                       length=2)
        return nn.Dense(11)(scan(name="blocks")(nn.Embed(11, 8)(token), None)[0])


class NnxCachedBlock(nnx.Module):
    def __init__(self, rngs):
        self.attention = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=True, rngs=rngs)
        self.attention.init_cache((2, 6, 8))

    def __call__(self, x):
        return x + self.attention(x)


class NnxCachedStack(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(11, 8, rngs=rngs)
        self.blocks = nnx.vmap(lambda k: NnxCachedBlock(nnx.Rngs(k)))(jax.random.split(rngs.params(), 2))
        self.logits = nnx.Linear(8, 11, rngs=rngs)

    def __call__(self, token):
        scan = nnx.scan(lambda x, block: (block(x), None), in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        return self.logits(scan(self.embed(token), self.blocks)[0])


def test_scanned_decode_caches_are_ported_with_their_stack_axis():
    # linen's nn.scan and NNX's vmap-built stack keep every cache (index included)
    # stacked in front: (layers, batch, length, heads, head_dim) and (layers,).
    shapes = jax.eval_shape(LinenCachedStack().init, jax.random.key(0), jnp.zeros((2, 6), jnp.int32))
    assert shapes["cache"]["blocks"]["MultiHeadDotProductAttention_0"]["cache_index"].shape == (2,)
    variables = {"params": random_like(shapes["params"]), "cache": jax.tree.map(jnp.zeros_like, shapes["cache"])}
    src = px.from_linen(LinenCachedStack(), variables, mutable=["cache"])
    src = src.carried(src(jnp.full((2, 1), 3)))[1]  # one position in
    dst = px.from_nnx(nnx.eval_shape(lambda: NnxCachedStack(nnx.Rngs(0))), return_state=True)
    tokens = [jnp.full((2, 1), t) for t in (5, 7)]
    alignment = px.align(src, dst, tokens[0])
    port = px.transfer_params(src, dst, alignment.mapping, inputs=tokens[0])
    np.testing.assert_array_equal(px.to_nnx(port).blocks.attention.cache_index.get_value(), [1, 1])
    assert px.compare(src, port, steps=tokens, alignment=alignment).first_divergence is None
