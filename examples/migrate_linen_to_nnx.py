"""Porting a linen model to Flax NNX, checked layer by layer: a CNN and a transformer
block written in linen, their NNX ports, `px.align` to match the layers,
`px.transfer_params` to copy the weights (verified on an example input), `px.compare`
showing every layer agreeing, and an injected porting bug pinpointed to its layer."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import peex_interop as px


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, image, tokens):
        x = nn.relu(nn.BatchNorm(use_running_average=True)(nn.Conv(8, (3, 3))(image)))
        context = nn.Dense(16)(x.mean(axis=(1, 2)))[:, None, :]
        h = nn.Embed(32, 16)(tokens) + context
        y = nn.LayerNorm()(h)
        h = h + nn.MultiHeadDotProductAttention(num_heads=4, name="attn")(y, y)
        return nn.Dense(32, name="head")(nn.LayerNorm()(h))


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, *, epsilon: float = 1e-6):
        self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, use_running_average=True, rngs=rngs)
        self.proj = nnx.Linear(8, 16, rngs=rngs)
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.norm1 = nnx.LayerNorm(16, epsilon=epsilon, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(4, 16, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, 32, rngs=rngs)

    def __call__(self, image, tokens):
        x = jax.nn.relu(self.bn(self.conv(image)))
        context = self.proj(x.mean(axis=(1, 2)))[:, None, :]
        h = self.embed(tokens) + context
        h = h + self.attn(self.norm1(h))
        return self.head(self.norm2(h))


def main():
    image = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    tokens = jax.random.randint(jax.random.key(1), (2, 5), 0, 32)
    linen = LinenNet()
    original = px.from_linen(linen, linen.init(jax.random.key(2), image, tokens))

    alignment = px.align(original, px.from_nnx(NnxNet(nnx.Rngs(3))), image, tokens)
    print(alignment)
    port = px.transfer_params(original, px.from_nnx(NnxNet(nnx.Rngs(3))), alignment.mapping, inputs=(image, tokens))
    comparison = px.compare(original, port, image, tokens, alignment=alignment)
    print(comparison)
    assert comparison.first_divergence is None

    # A porting bug: the first LayerNorm's epsilon typed as 1e-1.
    buggy = px.from_nnx(NnxNet(nnx.Rngs(3), epsilon=1e-1))
    buggy = px.transfer_params(original, buggy, alignment.mapping, inputs=(image, tokens), verify=False)
    first = px.compare(original, buggy, image, tokens, alignment=alignment).first_divergence
    print(f"injected bug found at {first.path_a} (linen) -> {first.path_b} (NNX)")
    assert first.path_b == "norm1"
    print("outputs agree after the port:", bool(jnp.allclose(original(image, tokens), port(image, tokens), atol=1e-5)))


if __name__ == "__main__":
    main()
