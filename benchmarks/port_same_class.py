"""The same-class port rows: a port between two instances of an NNX LM of about 100M
parameters built from its own layer classes (`OwnLM`, Gemma-shaped), the transfer
against a plain copy of every parameter, the verification against raw first calls."""

import dataclasses
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import peex_interop as px

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import PORT_ROUNDS, median_ratio, rounds_text, timed
from models import random_like
from page import Row, fmt


@dataclasses.dataclass(frozen=True)
class OwnLMSizes:
    """The LM built from its own layer classes (`OwnLM`): about 100M parameters in a full
    run (`--quick`: a tiny one)."""

    vocab: int
    width: int
    heads: int
    head_dim: int
    hidden: int
    layers: int
    batch: int
    seq: int

    @property
    def params(self):
        """The parameter count, from the sizes: the tied embedding, each block's fused
        qkv and output einsums, its gated MLP and two norms, and the final norm."""
        attention = 4 * self.heads * self.head_dim * self.width
        block = attention + 3 * self.width * self.hidden + 2 * self.width
        return self.vocab * self.width + self.layers * block + self.width


# vocab 32,000 x 768 (24.6M, tied) + 8 blocks of 9.44M (qkv 1.77M, output 0.59M, MLP 7.08M).
OWN_FULL = OwnLMSizes(vocab=32_000, width=768, heads=12, head_dim=64, hidden=3072, layers=8, batch=2, seq=64)
OWN_QUICK = OwnLMSizes(vocab=500, width=32, heads=2, head_dim=16, hidden=64, layers=2, batch=2, seq=8)


class OwnEinsum(nnx.Module):
    """A layer of the model's own class (as Gemma's `Einsum`): one parameter `w`."""

    def __init__(self, einsum_str, shape, *, rngs):
        self.einsum_str = einsum_str
        self.w = nnx.Param(nnx.initializers.normal()(rngs.params(), shape))

    def __call__(self, x):
        return jnp.einsum(self.einsum_str, x, self.w[...])


class OwnRMSNorm(nnx.Module):
    def __init__(self, dim, *, rngs):
        self.scale = nnx.Param(jnp.zeros((dim,)))

    def __call__(self, x):
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-06) * (1 + self.scale[...])


class OwnEmbedder(nnx.Module):
    """No `__call__`: `encode` embeds tokens, `decode` is the tied output projection."""

    def __init__(self, vocab, width, *, rngs):
        self.input_embedding = nnx.Param(nnx.initializers.normal()(rngs.params(), (vocab, width)))

    def encode(self, tokens):
        x = self.input_embedding[(tokens,)]
        return x * jnp.sqrt(x.shape[-1]).astype(x.dtype)

    def decode(self, x):
        return jnp.dot(x, self.input_embedding[...].T)


def own_rope(inputs, positions, max_wavelength=10_000):
    """Rotary positions on `inputs` (B, T, N, H), as Gemma applies them."""
    head_dim = inputs.shape[-1]
    timescale = max_wavelength ** (2 * jnp.arange(0, head_dim // 2) / head_dim)
    sinusoid = positions[..., jnp.newaxis] / timescale[jnp.newaxis, jnp.newaxis, :]
    sin, cos = jnp.sin(sinusoid)[..., jnp.newaxis, :], jnp.cos(sinusoid)[..., jnp.newaxis, :]
    first, second = jnp.split(inputs, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class OwnAttention(nnx.Module):
    """Causal self-attention with a fused `qkv_einsum`, rotary positions, its own softmax."""

    def __init__(self, s, *, rngs):
        self.scale = s.head_dim**-0.5
        self.qkv_einsum = OwnEinsum("BTD,SNDH->SBTNH", (3, s.heads, s.width, s.head_dim), rngs=rngs)
        self.attn_vec_einsum = OwnEinsum("BTNH,NHD->BTD", (s.heads, s.head_dim, s.width), rngs=rngs)

    def __call__(self, x, positions, mask):
        query, key, value = self.qkv_einsum(x)
        query = own_rope(query, positions) * self.scale
        key = own_rope(key, positions)
        logits = jnp.einsum("BTNH,BSNH->BTNS", query, key)
        probs = jax.nn.softmax(jnp.where(mask[:, :, None, :], logits, -2.3819763e38), axis=-1)
        return self.attn_vec_einsum(jnp.einsum("BTNS,BSNH->BTNH", probs, value))


class OwnFeedForward(nnx.Module):
    def __init__(self, width, hidden, *, rngs):
        self.gate_proj = nnx.Linear(width, hidden, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(width, hidden, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(hidden, width, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(nnx.gelu(self.gate_proj(x)) * self.up_proj(x))


class OwnBlock(nnx.Module):
    def __init__(self, s, *, rngs):
        self.pre_attention_norm = OwnRMSNorm(s.width, rngs=rngs)
        self.attn = OwnAttention(s, rngs=rngs)
        self.pre_ffw_norm = OwnRMSNorm(s.width, rngs=rngs)
        self.mlp = OwnFeedForward(s.width, s.hidden, rngs=rngs)

    def __call__(self, x, positions, mask):
        x = x + self.attn(self.pre_attention_norm(x), positions, mask)
        return x + self.mlp(self.pre_ffw_norm(x))


class OwnLM(nnx.Module):
    """A decoder-only LM in the shape of the Flax Gemma example (`tests/gemma_like.py`),
    built from its own layer classes: `OwnEmbedder` (tied head), `OwnEinsum`,
    `OwnRMSNorm`, blocks in a list; causal positions and mask made from the tokens."""

    def __init__(self, s, *, rngs):
        self.embedder = OwnEmbedder(s.vocab, s.width, rngs=rngs)
        self.layers = nnx.List([OwnBlock(s, rngs=rngs) for _ in range(s.layers)])
        self.final_norm = OwnRMSNorm(s.width, rngs=rngs)

    def __call__(self, tokens):
        length = tokens.shape[-1]
        positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (tokens.shape[0], length, length))
        x = self.embedder.encode(tokens)
        for layer in self.layers:
            x = layer(x, positions, mask)
        return self.embedder.decode(self.final_norm(x))


def own_lm(s, seed):
    """An `OwnLM` built under `nnx.eval_shape` (nothing initialised eagerly) holding
    NumPy draws of seed `seed` (`random_like`)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: OwnLM(s, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, random_like(state, seed=seed))


OWN_TEXT = (
    "Port between two instances of one class: `OwnLM`, a decoder-only LM in the shape of "
    "the Flax Gemma example (`tests/gemma_like.py`) built from its own layer classes, which "
    "no library knows: an `OwnEmbedder` with `encode` (embedding, scaled by sqrt(d)) and "
    "`decode` (the tied output projection) and no `__call__`; per block two `OwnRMSNorm`s "
    "(parameter `scale`, `x * (1 + scale)`), an attention with a fused `OwnEinsum` "
    "`qkv_einsum` (`w` 3 x heads x d x head_dim), rotary positions, its own softmax and an "
    "`OwnEinsum` `attn_vec_einsum`, and a gated MLP of three `nnx.Linear`s without bias (gelu); "
    "the blocks in an `nnx.List`, a final `OwnRMSNorm`. A full run: {full}; `--quick`: "
    "{quick}. Two instances, built by `nnx.eval_shape` and filled with NumPy draws of two "
    "seeds, on {batch} x {seq} tokens. `px.align` matches their own layers by class and "
    "output size and the method sites `embedder.encode` / `embedder.decode` by class and "
    "method; its `layer_mapping` (the method sites replaced by `embedder`), computed once "
    "outside the timing, drives `px.transfer_params(px.from_nnx(a), px.from_nnx(b), "
    "mapping, verify=False)` (the conversions inside the timing), which carries the layers "
    "of no known layout over array by array (jax arrays are immutable: the why column counts "
    "the ported arrays that are a's own buffers, not copies). Its reference is a plain copy: `nnx.split(b)`, "
    "each of b's state leaves replaced by `jnp.array(x, copy=True)` of a's, `nnx.merge`. "
    "The verification, `px.compare(px.from_nnx(a), ported, tokens, alignment=alignment)`, "
    "against one first call (trace, compile, run) of `jax.jit` of each model's forward "
    "(its own split/merge function, so that the two compile separately, as in the lm1b "
    "row). Both rows timed like the port rows above ({rounds}).\n\n"
)


def own_lm_text(rounds):
    describe = lambda s: (f"{s.layers} blocks, d {s.width}, {s.heads} heads x {s.head_dim}, MLP {s.hidden}, "
                          f"vocab {s.vocab:,}, {s.params:,} parameters")
    return OWN_TEXT.format(full=describe(OWN_FULL), quick=describe(OWN_QUICK), batch=OWN_FULL.batch,
                           seq=OWN_FULL.seq, rounds=rounds_text(rounds))


def same_class_port_rows(s, rounds=PORT_ROUNDS):
    """The rows of a port between two instances of `OwnLM` (its own layer classes): the
    transfer against a plain copy of every parameter, and the verification against one
    raw first-call forward of both models, each over `rounds` alternated rounds
    (`median_ratio`) on empty caches."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, s.vocab, (s.batch, s.seq)), jnp.int32)
    a, b = own_lm(s, seed=1), own_lm(s, seed=2)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(a)))
    assert params == s.params, (params, s.params)
    alignment, align_s = timed(px.align, px.from_nnx(a), px.from_nnx(b), tokens)
    assert not (alignment.unmatched or alignment.ambiguous or alignment.unknown), alignment
    mapping = alignment.layer_mapping
    graphdef_a, state_a = nnx.split(a)
    graphdef_b, state_b = nnx.split(b)

    def transfer():
        return px.transfer_params(px.from_nnx(a), px.from_nnx(b), mapping, verify=False)

    def plain_copy():
        graphdef, state = nnx.split(b)
        copied = jax.tree.map(lambda _, x: jnp.array(x, copy=True), state, nnx.state(a))
        return nnx.merge(graphdef, copied), copied

    def forward():
        # One function per model (a jit of each model's own call), so each compiles once.
        return (jax.jit(lambda state: nnx.merge(graphdef_a, state)(tokens))(state_a),
                jax.jit(lambda state: nnx.merge(graphdef_b, state)(tokens))(state_b))

    ported, transfer_s, copy_s, transfer_ratio = median_ratio(transfer, plain_copy, rounds)
    comparison, verify_s, forward_s, verify_ratio = median_ratio(
        partial(px.compare, px.from_nnx(a), ported, tokens, alignment=alignment), forward, rounds)
    # Seeds 1 and 2 differ everywhere: agreement means every parameter was copied.
    assert comparison.first_divergence is None, comparison
    # Whether the ported arrays are a's own buffers (jax arrays are immutable: a transfer
    # may hand them over) or copies, as the reference makes.
    buffers = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(state_a)}
    ported_leaves = jax.tree.leaves(nnx.state(px.to_nnx(ported)))
    shared = sum(x.unsafe_buffer_pointer() in buffers for x in ported_leaves)
    model = (f"NNX own-class LM -> another instance, {params:,} params ({s.layers} layers, d {s.width}, "
             f"vocab {s.vocab})")
    return [
        Row("port", "same-class transfer without verification / a plain copy of every parameter", model,
            fmt(transfer_s), fmt(copy_s), transfer_ratio, 1.5,
            why=f"align {fmt(align_s)} (outside the timing); {len(mapping)} layers of "
            f"{len(alignment.mapping)} aligned sites; {shared} of the ported model's {len(ported_leaves)} "
            f"arrays are a's own buffers (not copied); {rounds_text(rounds)}"),
        Row("port", "same-class verification (px.compare) / raw first-call forward of both models", model,
            fmt(verify_s), fmt(forward_s), verify_ratio, 1.2, why=rounds_text(rounds)),
    ]
