"""A small NNX language model written in the shape of the Flax team's Gemma example
(`examples/gemma` in the flax repository: `modules.py`, `layers.py`, `transformer.py`):
an `Embedder` without `__call__` whose `encode` embeds tokens and whose `decode` is the
tied output projection, an `Attention` of its own (a fused `qkv_einsum`, or `q_einsum`
and `kv_einsum` for grouped queries; rotary positions; its own softmax; a decode
cache), a gated `FeedForward` calling `nnx.gelu`, blocks that `sow` their residual
stream when asked, and a `Transformer` that loops over a list of blocks. Written for
the tests (not copied): what matters is that the doors are those real models use.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

K_MASK = -2.3819763e38


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 11
    width: int = 8
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 4
    hidden: int = 16
    layers: int = 2
    sow: bool = False


class Einsum(nnx.Module):
    def __init__(self, einsum_str: str, shape: tuple[int, ...], *, rngs: nnx.Rngs):
        self.einsum_str = einsum_str
        self.w = nnx.Param(nnx.initializers.normal()(rngs.params(), shape))

    def __call__(self, x):
        return jnp.einsum(self.einsum_str, x, self.w[...])

    @property
    def shape(self):
        return self.w[...].shape


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(nnx.initializers.normal(0.1)(rngs.params(), (dim,)))

    def __call__(self, x):
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-06) * (1 + self.scale[...])


class Embedder(nnx.Module):
    def __init__(self, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        self.input_embedding = nnx.Param(nnx.initializers.normal()(rngs.params(), (vocab_size, embed_dim)))

    def encode(self, x):
        x = self.input_embedding[(x,)]
        return x * jnp.sqrt(x.shape[-1]).astype(x.dtype)

    def decode(self, x):
        return jnp.dot(x, self.input_embedding[...].T)


def apply_rope(inputs, positions, max_wavelength: int = 10_000):
    """Rotary positions, as Gemma applies them: `inputs` (B, T, N, H)."""
    head_dim = inputs.shape[-1]
    fraction = 2 * jnp.arange(0, head_dim // 2) / head_dim
    timescale = max_wavelength**fraction
    sinusoid = positions[..., jnp.newaxis] / timescale[jnp.newaxis, jnp.newaxis, :]
    sin, cos = jnp.sin(sinusoid)[..., jnp.newaxis, :], jnp.cos(sinusoid)[..., jnp.newaxis, :]
    first, second = jnp.split(inputs, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class Attention(nnx.Module):
    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        self.query_pre_attn_scalar = config.head_dim**-0.5
        self.attn_vec_einsum = Einsum("BTNH,NHD->BTD", (config.heads, config.head_dim, config.width), rngs=rngs)
        if config.heads == config.kv_heads:
            self.qkv_einsum = Einsum("BTD,SNDH->SBTNH", (3, config.heads, config.width, config.head_dim), rngs=rngs)
        else:
            self.q_einsum = Einsum("BTD,NDH->BTNH", (config.heads, config.width, config.head_dim), rngs=rngs)
            self.kv_einsum = Einsum("BSD,CKDH->CBSKH", (2, config.kv_heads, config.width, config.head_dim), rngs=rngs)

    @property
    def use_qkv_einsum(self):
        return hasattr(self, "qkv_einsum")

    def __call__(self, x, segment_pos, cache, attn_mask):
        seq_len = x.shape[1]
        if self.use_qkv_einsum:
            query_proj, key_proj, value_proj = self.qkv_einsum(x)
        else:
            query_proj = self.q_einsum(x)
            key_proj, value_proj = self.kv_einsum(x)
        query_proj = apply_rope(query_proj, segment_pos)
        query_scaled = query_proj * self.query_pre_attn_scalar
        key_proj = apply_rope(key_proj, segment_pos)
        if cache is not None:
            end_index = cache["end_index"][0]
            slice_indices = (0, end_index % cache["v"].shape[1], 0, 0)
            value_proj = jax.lax.dynamic_update_slice(cache["v"], value_proj, slice_indices)
            key_proj = jax.lax.dynamic_update_slice(cache["k"], key_proj, slice_indices)
        groups = query_scaled.shape[2] // key_proj.shape[2]
        keys, values = jnp.repeat(key_proj, groups, axis=2), jnp.repeat(value_proj, groups, axis=2)
        logits = jnp.einsum("BTNH,BSNH->BTNS", query_scaled, keys)
        padded_logits = jnp.where(jnp.expand_dims(attn_mask, -2), logits, K_MASK)
        probs = jax.nn.softmax(padded_logits, axis=-1).astype(key_proj.dtype)
        encoded = jnp.einsum("BTNS,BSNH->BTNH", probs, values)
        attn_output = self.attn_vec_einsum(encoded)
        new_cache = None
        if cache is not None:
            new_cache = {"v": value_proj, "k": key_proj, "end_index": cache["end_index"] + seq_len}
        return new_cache, attn_output

    def init_cache(self, cache_size: int, batch_size: int, dtype=jnp.float32):
        kv_heads, head_dim = self.attn_vec_einsum.shape[0], self.attn_vec_einsum.shape[1]
        if not self.use_qkv_einsum:
            kv_heads = self.kv_einsum.shape[1]
        shape = (batch_size, cache_size, kv_heads, head_dim)
        zeros = jnp.zeros(shape, dtype)
        return {"v": zeros, "k": zeros, "end_index": jnp.zeros((batch_size,), jnp.int32)}


class FeedForward(nnx.Module):
    def __init__(self, features: int, hidden_dim: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal()
        self.gate_proj = nnx.Linear(features, hidden_dim, use_bias=False, kernel_init=init, rngs=rngs)
        self.up_proj = nnx.Linear(features, hidden_dim, use_bias=False, kernel_init=init, rngs=rngs)
        self.down_proj = nnx.Linear(hidden_dim, features, use_bias=False, kernel_init=init, rngs=rngs)

    def __call__(self, x):
        activations = nnx.gelu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(activations)


class Block(nnx.Module):
    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        self.pre_attention_norm = RMSNorm(config.width, rngs=rngs)
        self.attn = Attention(config, rngs=rngs)
        self.pre_ffw_norm = RMSNorm(config.width, rngs=rngs)
        self.mlp = FeedForward(config.width, config.hidden, rngs=rngs)
        self.sow_residuals = config.sow

    def __call__(self, x, segment_pos, cache, attn_mask):
        cache, attn_output = self.attn(self.pre_attention_norm(x), segment_pos, cache, attn_mask)
        x = x + attn_output
        if self.sow_residuals:
            self.sow(nnx.Intermediate, "rs_after_attention", x)
        x = x + self.mlp(self.pre_ffw_norm(x))
        if self.sow_residuals:
            self.sow(nnx.Intermediate, "rs_after_ffw", x)
        return cache, x

    def init_cache(self, cache_size: int, batch_size: int, dtype=jnp.float32):
        return self.attn.init_cache(cache_size, batch_size, dtype)


class Transformer(nnx.Module):
    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        self.embedder = Embedder(config.vocab, config.width, rngs=rngs)
        self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.layers)])
        self.final_norm = RMSNorm(config.width, rngs=rngs)

    def __call__(self, last_tokens, positions, cache, attention_mask):
        x = self.embedder.encode(last_tokens)
        new_cache = {}
        for i, layer in enumerate(self.layers):
            layer_cache = cache[f"layer_{i}"] if cache is not None else None
            layer_cache, x = layer(x, positions, layer_cache, attention_mask)
            new_cache[f"layer_{i}"] = layer_cache
        logits = self.embedder.decode(self.final_norm(x))
        return logits, new_cache if cache is not None else None

    def init_cache(self, cache_size: int, batch_size: int, dtype=jnp.float32):
        return {f"layer_{i}": layer.init_cache(cache_size, batch_size, dtype) for i, layer in enumerate(self.layers)}


def causal_mask(length: int, batch: int = 1):
    return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))
