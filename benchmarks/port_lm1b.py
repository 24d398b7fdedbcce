"""The lm1b port rows: a linen LM of the Flax lm1b example's size ported to its abstract
NNX twin, each stage timed on empty caches against raw first calls of both models."""

import dataclasses
import statistics
import sys
from functools import partial
from pathlib import Path

import flax.linen as nn
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
class PortSizes:
    """The ported language model: the Flax lm1b example's decoder (`--quick`: smaller)."""

    vocab: int
    dim: int
    heads: int
    mlp: int
    layers: int
    batch: int
    seq: int


PORT_FULL = PortSizes(vocab=30_000, dim=512, heads=8, mlp=2048, layers=6, batch=2, seq=64)
PORT_QUICK = PortSizes(vocab=500, dim=32, heads=2, mlp=64, layers=2, batch=2, seq=8)


class LinenPortBlock(nn.Module):
    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x, mask):
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=mask)
        h = nn.relu(nn.Dense(self.mlp)(nn.LayerNorm()(x)))
        return x + nn.Dense(x.shape[-1])(h)


class LinenPortLM(nn.Module):
    """A decoder-only LM with linen's default names (`Embed_0`, `LinenPortBlock_0`, ...)."""

    sizes: PortSizes

    @nn.compact
    def __call__(self, tokens):
        s = self.sizes
        x, mask = nn.Embed(s.vocab, s.dim)(tokens), nn.make_causal_mask(tokens)
        for _ in range(s.layers):
            x = LinenPortBlock(s.heads, s.mlp)(x, mask)
        return nn.Dense(s.vocab)(nn.LayerNorm()(x))


class NnxPortBlock(nnx.Module):
    def __init__(self, s, rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(s.dim, rngs=rngs), nnx.LayerNorm(s.dim, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(s.heads, s.dim, decode=False, rngs=rngs)
        self.hidden, self.out = nnx.Linear(s.dim, s.mlp, rngs=rngs), nnx.Linear(s.mlp, s.dim, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attention(self.norm1(x), mask=mask)
        return x + self.out(nnx.relu(self.hidden(self.norm2(x))))


class NnxPortLM(nnx.Module):
    """The NNX twin, with its own names."""

    def __init__(self, s, rngs):
        self.embed = nnx.Embed(s.vocab, s.dim, rngs=rngs)
        self.blocks = nnx.List([NnxPortBlock(s, rngs) for _ in range(s.layers)])
        self.norm, self.logits = nnx.LayerNorm(s.dim, rngs=rngs), nnx.Linear(s.dim, s.vocab, rngs=rngs)

    def __call__(self, tokens):
        x, mask = self.embed(tokens), nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.logits(self.norm(x))


PORT_TEXT = (
    "Port: a decoder-only LM in linen (default names; the Flax lm1b example's config in a "
    "full run: 6 layers, d 512, 8 heads, MLP 2048, vocab 30,000, 49.7M parameters; "
    "NumPy-drawn weights) ported to its NNX twin built by `nnx.eval_shape`, on 2 x 64 tokens "
    "(`--quick`: a small one). Each stage is timed on empty caches (`jax.clear_caches()`, "
    "then a full garbage collection), as a port runs once: `px.transfer_params(..., "
    "verify=False)` against 0.5 s per 50M "
    "parameters; `px.compare` with the alignment (what `px.port` verifies with), with and "
    "without cotangents, against one first call (trace, compile, run) of `jax.jit` of each "
    "model's forward (`module.apply`; the NNX twin's merge and call) and of its gradient "
    "of `0.5 * sum(logits**2)`; each `px.compare` and its reference timed one after the other "
    "in 5 rounds (which goes first alternating), the row the median of the rounds' ratios "
    "(`--quick`: one round). `px.compare` compiles the hooked passes of both models as one "
    "program (on CPU at XLA's backend optimisation level 0, a program run once); with "
    "cotangents, one gradient pass per model, its forward log the pass's auxiliary output.\n\n"
)


def port_rows(s, rounds=PORT_ROUNDS):
    """The `px.port` rows: a linen LM ported into its abstract NNX twin. Every stage is
    timed on empty compilation caches, as a port runs once: align, transfer (no
    verification), the verification with and without cotangents, the whole port, and
    one raw first-call forward and gradient of each model (`jax.jit` of `module.apply`,
    and of the NNX twin's merge and call); the verification against its reference over
    `rounds` alternated rounds (`median_ratio`)."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, s.vocab, (s.batch, s.seq)), jnp.int32)
    module = LinenPortLM(s)
    variables = random_like(jax.eval_shape(module.init, jax.random.key(0), tokens))
    source = px.from_linen(module, variables)
    abstract = px.from_nnx(nnx.eval_shape(lambda: NnxPortLM(s, nnx.Rngs(0))))
    params = sum(x.size for x in jax.tree.leaves(variables))

    graphdef, state = nnx.split(px.to_nnx(abstract))
    state = random_like(state)
    loss = lambda logits: 0.5 * jnp.sum(logits**2)
    raw_nnx = lambda state: nnx.merge(graphdef, state)(tokens)

    def forward():
        return jax.jit(module.apply)(variables, tokens), jax.jit(raw_nnx)(state)

    def forward_one_shot():
        # Compiled as px.compare compiles its program on CPU (`_compare._run_once`).
        options = {"xla_backend_optimization_level": 0}
        apply = jax.jit(module.apply).lower(variables, tokens).compile(options)
        return apply(variables, tokens), jax.jit(raw_nnx).lower(state).compile(options)(state)

    def gradient():
        return (jax.jit(jax.grad(lambda v: loss(module.apply(v, tokens))))(variables),
                jax.jit(jax.grad(lambda state: loss(raw_nnx(state))))(state))

    alignment, align_s = timed(px.align, source, abstract, tokens)
    ported, transfer_s = timed(px.transfer_params, source, abstract, alignment.mapping, inputs=tokens, verify=False)
    # The verification px.port runs: px.compare of the aligned layers (and the outputs).
    comparison, verify_s, forward_s, verify_ratio = median_ratio(
        partial(px.compare, source, ported, tokens, alignment=alignment), forward, rounds)
    _, compare_ct_s, gradient_s, compare_ct_ratio = median_ratio(
        partial(px.compare, source, ported, tokens, alignment=alignment, cotangents=True), gradient, rounds)
    (_, port_comparison), port_s = timed(px.port, source, abstract, tokens)
    forward_one_shot_s = statistics.median(timed(forward_one_shot)[1] for _ in range(3))
    assert comparison.first_divergence is None and port_comparison.first_divergence is None
    model = f"linen LM -> NNX, {params:,} params ({s.layers} layers, d {s.dim}, vocab {s.vocab})"
    per_50m = 0.5 * params / 50e6
    return [
        Row("port", "transfer without verification / 0.5 s per 50M params", model, fmt(transfer_s),
            fmt(per_50m), transfer_s / per_50m, 1.0,
            why=f"align {fmt(align_s)}; {len(alignment.mapping)} layers"),
        Row("port", "verification (px.compare) / raw first-call forward of both models", model, fmt(verify_s),
            fmt(forward_s), verify_ratio, 1.2,
            why=f"the whole px.port {fmt(port_s)}; {rounds_text(rounds)}; on CPU px.compare compiles its "
            f"program at XLA's backend optimisation level 0 (it runs once): the raw forward compiled so "
            f"takes {fmt(forward_one_shot_s)} (median of 3)"),
        Row("port", "px.compare with cotangents / raw first-call gradient of both models", model,
            fmt(compare_ct_s), fmt(gradient_s), compare_ct_ratio, 1.2, why=rounds_text(rounds)),
    ]
