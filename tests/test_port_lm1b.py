"""The acceptance test of issue 23: an lm1b-shaped decoder-only transformer, written in
linen and in NNX the way the Flax team wrote its lm1b example and that example's NNX
port (linen's default names on one side, the port's own names on the other; logical
partitioning on both; a decode cache in the attention and a position index in the
position embedding), ported linen -> NNX in one `px.transfer_params` call: through
partitioning boxes, into an NNX model built abstractly under a 2 x 4 mesh of 8
simulated CPU devices, in eval mode and over 3 decode steps carried on from a cache
two positions in; then NNX -> linen, into linen variables built abstractly, cache
included, for 2 more steps. The Flax team's test copied every variable by a
hand-written table and asserted each NNX parameter's sharding equals the linen logical
names mapped by the rules; here `px.align` finds the layers and the shardings are
checked the same way."""

import dataclasses
import textwrap

import pytest

pytest.importorskip("flax")  # skipped where the [flax] extra is not installed

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

import peex_interop as px
from models import random_like, run_on_8_cpu_devices


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 32
    emb_dim: int = 16
    # Attention kernels are sharded on their leading axis (the logical names are given
    # for the flat kernel, `(embed, kv)`): the out kernel's heads must divide by the
    # mesh's 4, as the Flax config's 8 heads do.
    heads: int = 4
    qkv_dim: int = 16
    mlp_dim: int = 32
    layers: int = 2
    max_len: int = 8
    decode: bool = False


# Logical axis -> mesh axis: the Flax port test's `MeshRules(embed='model', mlp='data',
# kv=None, vocab=None)`.
RULES = (("embed", "model"), ("mlp", "data"), ("kv", None), ("vocab", None))
BATCH = 2


def sinusoids(max_len: int, features: int) -> np.ndarray:
    """A fixed sinusoidal position table (1, max_len, features), as lm1b's default."""
    position = np.arange(max_len)[:, None]
    rates = np.exp(-np.log(10000.0) * np.arange(features // 2) / (features // 2 - 1))
    table = np.concatenate([np.sin(position * rates), np.cos(position * rates)], axis=-1)
    return table[None].astype(np.float32)


def shift_right(ids: jax.Array) -> jax.Array:
    return jnp.pad(ids, ((0, 0), (1, 0)))[:, :-1]


# -- linen, as the lm1b example writes it: default names, logical partitioning -------
def _logical(init, *names):
    return nn.with_logical_partitioning(init, names)


class LinenPositions(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x):
        table = jnp.asarray(sinusoids(self.config.max_len, x.shape[-1]))
        if not self.config.decode:
            return x + table[:, : x.shape[1]]
        initialised = self.has_variable("cache", "cache_index")
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.uint32))
        if not initialised:  # `init` only creates the index
            return x + table[:, : x.shape[1]]
        i = index.value
        index.value = i + 1
        return x + lax.dynamic_slice(table, jnp.array((0, i, 0)), (1, 1, x.shape[-1]))


class LinenMlp(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x):
        kernel = nn.initializers.xavier_uniform()
        h = nn.Dense(self.config.mlp_dim, kernel_init=_logical(kernel, "embed", "mlp"),
                     bias_init=_logical(nn.initializers.normal(1e-6), "mlp"))(x)
        return nn.Dense(x.shape[-1], kernel_init=_logical(kernel, "mlp", "embed"),
                        bias_init=_logical(nn.initializers.normal(1e-6), "embed"))(nn.relu(h))


class LinenBlock(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, inputs, mask):
        c = self.config
        norm = {"scale_init": _logical(nn.initializers.ones, "embed"),
                "bias_init": _logical(nn.initializers.zeros, "embed")}
        x = nn.LayerNorm(**norm)(inputs)
        x = nn.MultiHeadDotProductAttention(
            num_heads=c.heads, qkv_features=c.qkv_dim, use_bias=False, deterministic=True, decode=c.decode,
            kernel_init=_logical(nn.initializers.xavier_uniform(), "embed", "kv"),
        )(x, mask=mask)
        x = x + inputs
        return x + LinenMlp(c)(nn.LayerNorm(**norm)(x))


class LinenDecoder(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, ids, mask):
        c = self.config
        y = ids if c.decode else shift_right(ids)
        y = nn.Embed(c.vocab, c.emb_dim, embedding_init=_logical(nn.initializers.normal(1.0), "vocab", "embed"))(y)
        y = LinenPositions(c, name="posembed_output")(y)
        for i in range(c.layers):
            y = LinenBlock(c, name=f"encoderdecoderblock_{i}")(y, mask)
        y = nn.LayerNorm(name="encoderdecoder_norm", scale_init=_logical(nn.initializers.ones, "embed"),
                         bias_init=_logical(nn.initializers.zeros, "embed"))(y)
        return nn.Dense(c.vocab, name="logitdense", kernel_init=_logical(nn.initializers.xavier_uniform(), "embed",
                        "vocab"), bias_init=_logical(nn.initializers.normal(1e-6), "vocab"))(y)


class LinenLM(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, ids):
        mask = None if self.config.decode else nn.combine_masks(
            nn.make_attention_mask(ids > 0, ids > 0), nn.make_causal_mask(ids)
        )
        return LinenDecoder(self.config, name="decoder")(ids, mask)


# -- NNX, as the port writes it: its own names, sharding metadata on the variables, a
# `decode` attribute on every module that decodes (set with `.eval(decode=...)`) ----
def _named(init, *names):
    return nnx.with_partitioning(init, names)


class NnxPositions(nnx.Module):
    def __init__(self, config: Config):
        self.config = config
        self.decode = config.decode

    def __call__(self, x):
        table = jnp.asarray(sinusoids(self.config.max_len, x.shape[-1]))
        if not self.decode:
            return x + table[:, : x.shape[1]]
        i = self.cache_index[...]
        self.cache_index[...] = i + 1
        return x + lax.dynamic_slice(table, jnp.array((0, i, 0)), (1, 1, x.shape[-1]))

    def init_cache(self, input_shape, dtype=jnp.float32):
        self.cache_index = nnx.Cache(jnp.array(0, jnp.uint32))


class NnxMlp(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        kernel = nnx.initializers.xavier_uniform()
        self.linear1 = nnx.Linear(c.emb_dim, c.mlp_dim, kernel_init=_named(kernel, "embed", "mlp"),
                                  bias_init=_named(nnx.initializers.normal(1e-6), "mlp"), rngs=rngs)
        self.linear2 = nnx.Linear(c.mlp_dim, c.emb_dim, kernel_init=_named(kernel, "mlp", "embed"),
                                  bias_init=_named(nnx.initializers.normal(1e-6), "embed"), rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


def _norm(c: Config, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(c.emb_dim, scale_init=_named(nnx.initializers.ones_init(), "embed"),
                         bias_init=_named(nnx.initializers.zeros_init(), "embed"), rngs=rngs)


class NnxBlock(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.ln1 = _norm(c, rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=c.heads, in_features=c.emb_dim, qkv_features=c.qkv_dim, use_bias=False, decode=c.decode,
            kernel_init=_named(nnx.initializers.xavier_uniform(), "embed", "kv"), rngs=rngs,
        )
        self.ln2 = _norm(c, rngs)
        self.mlp = NnxMlp(c, rngs)

    def __call__(self, inputs, mask):
        x = self.attention(self.ln1(inputs), mask=mask) + inputs
        return x + self.mlp(self.ln2(x))


class NnxDecoder(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.decode = c.decode
        self.output_embed = nnx.Embed(c.vocab, c.emb_dim, rngs=rngs,
                                      embedding_init=_named(nnx.initializers.normal(1.0), "vocab", "embed"))
        self.posembed_output = NnxPositions(c)
        self.blocks = nnx.List([NnxBlock(c, rngs) for _ in range(c.layers)])
        self.encoderdecoder_norm = _norm(c, rngs)
        self.logitdense = nnx.Linear(c.emb_dim, c.vocab, rngs=rngs,
                                     kernel_init=_named(nnx.initializers.xavier_uniform(), "embed", "vocab"),
                                     bias_init=_named(nnx.initializers.normal(1e-6), "vocab"))

    def __call__(self, ids, mask):
        y = ids if self.decode else shift_right(ids)
        y = self.posembed_output(self.output_embed(y))
        for block in self.blocks:
            y = block(y, mask)
        return self.logitdense(self.encoderdecoder_norm(y))


class NnxLM(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.decode = c.decode
        self.decoder = NnxDecoder(c, rngs)

    def __call__(self, ids):
        mask = None if self.decode else nnx.combine_masks(
            nnx.make_attention_mask(ids > 0, ids > 0), nnx.make_causal_mask(ids)
        )
        return self.decoder(ids, mask)


def abstract_nnx(config: Config) -> NnxLM:
    """The destination, built abstractly (nothing initialised), its caches made as the
    Flax test makes them (`init_cache` on every module that has one)."""
    model = nnx.eval_shape(lambda: NnxLM(config, nnx.Rngs(0)))
    if config.decode:
        for _, module in nnx.iter_modules(model):
            if hasattr(module, "init_cache"):
                module.init_cache((BATCH, config.max_len, config.emb_dim))
    return model


def linen_variables(config: Config, seed: int = 0) -> dict:
    """linen variables with their partitioning boxes (drawn from the abstract init: no
    initialiser runs); in decode mode, a fresh cache, as `init` on the full length
    makes it."""
    ids = jnp.zeros((BATCH, config.max_len), jnp.int32)
    shapes = jax.eval_shape(LinenLM(config).init, jax.random.key(0), ids)
    variables = random_like({"params": shapes["params"]}, seed)
    if config.decode:
        variables["cache"] = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])
    return variables


LINEN_LAYERS = ["decoder.Embed_0"] + [
    f"decoder.encoderdecoderblock_{i}.{name}"
    for i in range(Config.layers)
    for name in ("LayerNorm_0", "MultiHeadDotProductAttention_0.query", "MultiHeadDotProductAttention_0.key",
                 "MultiHeadDotProductAttention_0.value", "MultiHeadDotProductAttention_0.out",
                 "MultiHeadDotProductAttention_0", "LayerNorm_1", "LinenMlp_0.Dense_0", "LinenMlp_0.Dense_1")
] + ["decoder.encoderdecoder_norm", "decoder.logitdense"]
NNX_LAYERS = ["decoder.output_embed"] + [
    f"decoder.blocks.{i}.{name}"
    for i in range(Config.layers)
    for name in ("ln1", "attention.query", "attention.key", "attention.value", "attention.out", "attention", "ln2",
                 "mlp.linear1", "mlp.linear2")
] + ["decoder.encoderdecoder_norm", "decoder.logitdense"]
# The position embedding has no parameters (align matches layers of the kinds it
# knows): its decode index is mapped by hand, as in the Flax team's cache table.
POSITIONS = {"decoder.posembed_output": "decoder.posembed_output"}


def decode_tokens(steps: int, seed: int = 1) -> list[jax.Array]:
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.integers(1, Config.vocab, (BATCH, 1)), jnp.int32) for _ in range(steps)]


# Compiled: an eager call compiles each operation of the model on its own.
@eqx.filter_jit
def call(model, *args):
    return model(*args)


@eqx.filter_jit
def step(model, token):
    """One decode step: `(output, model carrying its state on)`."""
    return model.carried(model(token))


def linen_decoding(config: Config, prefix: int) -> px.LinenModule:
    """A linen decoder `prefix` tokens into its cache, carried as linen carries it."""
    model = px.from_linen(LinenLM(config), linen_variables(config), mutable=["cache"])
    for token in decode_tokens(prefix, seed=2):
        model = step(model, token)[1]
    return model


# -- in process, on one device: the alignment and the refusals -----------------------
DECODE = Config(decode=True)


def mesh(shape):
    return jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.fixture(autouse=True)
def in_mesh():
    # NNX creates variables with sharding names only under a mesh (one device here).
    with jax.set_mesh(mesh((1, 1))), nn.logical_axis_rules(RULES):
        yield


def test_align_names_every_layer_of_both_models():
    src = px.from_linen(LinenLM(Config()), linen_variables(Config()))
    ids = jnp.asarray(np.random.default_rng(0).integers(1, Config.vocab, (BATCH, Config.max_len)), jnp.int32)
    alignment = px.align(src, px.from_nnx(abstract_nnx(Config())), ids)
    assert alignment.mapping == dict(zip(LINEN_LAYERS, NNX_LAYERS))
    assert not alignment.unmatched and not alignment.ambiguous and alignment.order_preserved


ATTENTION_0 = {
    f"decoder.encoderdecoderblock_0.MultiHeadDotProductAttention_0{part}": f"decoder.blocks.0.attention{part}"
    for part in ("", ".query", ".key", ".value", ".out")
}


def test_cache_the_destination_cannot_hold_is_refused():
    src = linen_decoding(DECODE, prefix=0)
    dst = px.from_nnx(abstract_nnx(Config()))  # not in decode mode: no cache
    with pytest.raises(px.HookError, match=r"'decoder\.blocks\.0\.attention'.*decode cache \(cache_index, "
                       r"cached_key, cached_value\) and the destination none"):
        px.transfer_params(src, dst, ATTENTION_0)


def test_cache_of_another_length_is_refused_not_reshaped():
    src = linen_decoding(DECODE, prefix=0)
    dst = nnx.eval_shape(lambda: NnxLM(DECODE, nnx.Rngs(0)))
    dst.decoder.blocks[0].attention.init_cache((BATCH, 16, DECODE.emb_dim))  # length 16, the source's 8
    with pytest.raises(px.HookError, match=r"cached_key of shape \(2, 8, 4, 4\).*axis 'length' has size 8 in the "
                       r"source, 16 in the destination"):
        px.transfer_params(src, px.from_nnx(dst), ATTENTION_0)


def test_abstract_caches_are_filled_and_a_position_left_out_is_named():
    def cached():  # caches made inside eval_shape too: every array abstract
        model = NnxLM(DECODE, nnx.Rngs(0))
        for _, module in nnx.iter_modules(model):
            if hasattr(module, "init_cache"):
                module.init_cache((BATCH, DECODE.max_len, DECODE.emb_dim))
        return model

    src = px.from_linen(LinenLM(DECODE), linen_variables(DECODE), mutable=["cache"])
    mapping = dict(zip(LINEN_LAYERS, NNX_LAYERS))  # px.align's: without the position embedding
    # Every key and value cache filled: the position index alone is left.
    with pytest.raises(px.HookError, match=r"leaves 1 of its arrays without a value: "
                       r"state\.decoder\.posembed_output\.cache_index\.value\..*map it by its path"):
        px.transfer_params(src, px.from_nnx(nnx.eval_shape(cached)), mapping)
    port = px.transfer_params(src, px.from_nnx(nnx.eval_shape(cached)), {**mapping, **POSITIONS})
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(port.state))


# -- 8 simulated CPU devices in a subprocess: the port as written, under a 2 x 4 mesh --
SHARDED = textwrap.dedent('''
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    import peex_interop as px
    from test_port_lm1b import (
        BATCH, DECODE, POSITIONS, RULES, Config, LinenLM, abstract_nnx, call, decode_tokens, linen_decoding,
        linen_variables, mesh, step,
    )

    assert jax.device_count() == 8
    MESH = mesh((2, 4))

    def is_box(x):
        return isinstance(x, nn.meta.AxisMetadata)

    def check_shardings(port, src):
        # As the Flax test: every NNX parameter sharded as the linen logical names of
        # the variable it came from, mapped by the rules.
        linen = nn.logical_to_mesh_sharding(nn.get_partition_spec(src.variables), MESH, RULES)["params"]
        live = px.to_nnx(port)
        checked = 0
        for path, v in nnx.graph.iter_graph(live):
            if isinstance(v, nnx.Param):
                want = NamedSharding(MESH, nnx.get_partition_spec(v).get_value())
                assert v.get_value().sharding.is_equivalent_to(want, v.ndim), (path, v.get_value().sharding)
                checked += 1
        mlp = live.decoder.blocks[1].mlp.linear1.kernel.get_value()
        assert mlp.sharding.is_equivalent_to(linen["decoder"]["encoderdecoderblock_1"]["LinenMlp_0"]["Dense_0"]
                                             ["kernel"], 2)
        embed = live.decoder.output_embed.embedding.get_value()
        assert embed.sharding.is_equivalent_to(linen["decoder"]["Embed_0"]["embedding"], 2)
        return checked

    with jax.set_mesh(MESH), nn.logical_axis_rules(RULES):
        # Decode: parameters and caches two positions in, into an abstract NNX model.
        src = linen_decoding(DECODE, prefix=2)
        assert int(src.variables["cache"]["decoder"]["posembed_output"]["cache_index"]) == 2
        tokens = decode_tokens(3)
        abstract = abstract_nnx(DECODE)
        metadata = {p: v.get_metadata() for p, v in nnx.graph.iter_graph(abstract) if isinstance(v, nnx.Variable)}
        dst = px.from_nnx(abstract, return_state=True)
        mapping = {**px.align(src, dst, tokens[0]).mapping, **POSITIONS}
        port = px.transfer_params(src, dst, mapping, inputs=tokens[0])
        live = px.to_nnx(port)
        assert {p: v.get_metadata() for p, v in nnx.graph.iter_graph(live) if isinstance(v, nnx.Variable)} == metadata
        attention = live.decoder.blocks[1].attention
        cache = src.variables["cache"]["decoder"]["encoderdecoderblock_1"]["MultiHeadDotProductAttention_0"]
        np.testing.assert_array_equal(attention.cached_value.get_value(), cache["cached_value"])
        assert int(attention.cache_index.get_value()) == 2
        # 3 steps, each library carrying its own state.
        a, b = src, port
        for token in tokens:
            (out_a, a), (out_b, b) = step(a, token), step(b, token)
            np.testing.assert_allclose(out_b, out_a, atol=1e-5)
        comparison = px.compare(src, port, steps=tokens)
        assert comparison.first_divergence is None, comparison
        layers = len(comparison.alignment.mapping)
        assert [row.step for row in comparison.rows] == [s for s in range(3) for _ in range(layers)]
        print("decode", check_shardings(port, src))

        # Eval mode on whole sequences, as the Flax test switches the port:
        # `set_attributes(deterministic=True, decode=False)`.
        ids = jnp.asarray(np.random.default_rng(0).integers(1, Config.vocab, (BATCH, Config.max_len)), jnp.int32)
        linen_eval = px.from_linen(LinenLM(Config()), {"params": src.variables["params"]})
        nnx_eval = port.eval(decode=False)
        np.testing.assert_allclose(call(nnx_eval, ids)[0], call(linen_eval, ids), atol=1e-5)
        print("eval", check_shardings(nnx_eval, src))

        # NNX -> linen: the port, 5 positions in, back into a linen model built
        # abstractly, its cache included; 2 more steps.
        ids = jnp.zeros((BATCH, DECODE.max_len), jnp.int32)
        abstract = jax.eval_shape(LinenLM(DECODE).init, jax.random.key(0), ids)
        reverse = {b_path: a_path for a_path, b_path in mapping.items()}
        back = px.transfer_params(b, px.from_linen(LinenLM(DECODE), abstract, mutable=["cache"]), reverse,
                                  inputs=tokens[0])
        assert int(back.variables["cache"]["decoder"]["posembed_output"]["cache_index"]) == 5
        more = decode_tokens(2, seed=3)
        assert px.compare(b, back, steps=more).first_divergence is None
        assert px.compare(a, back, steps=more).first_divergence is None  # linen carried on by itself
        boxes = 0
        for box in jax.tree.leaves(back.variables, is_leaf=is_box):
            if is_box(box):
                want = nn.logical_to_mesh_sharding(P(*box.names), MESH, RULES)
                assert box.value.sharding.is_equivalent_to(want, box.value.ndim), (box.names, box.value.sharding)
                boxes += 1
        assert jax.tree.structure(back.variables, is_leaf=is_box) == jax.tree.structure(abstract, is_leaf=is_box)
        print("nnx -> linen", boxes)

''')


def test_lm1b_port_under_a_2x4_mesh_of_8_cpu_devices():
    lines = run_on_8_cpu_devices(SHARDED)
    # The embedding, the final norm and logits (2 each); per block 2 norms and 2
    # Linears (2 each) and 4 attention kernels: every parameter checked.
    params = 1 + 2 + 2 + Config.layers * (4 + 4 + 4)
    assert lines == [f"decode {params}", f"eval {params}", f"nnx -> linen {params}"]
