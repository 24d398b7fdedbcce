"""One first call (trace + lower, XLA compile, run) of the scanned transformer, in this
fresh process: the compile rows of `benchmarks/bench.py`, whose `first_calls.py` runs it
as `python benchmarks/first_call.py VARIANT DEPTH DIM HEADS BATCH SEQ`.

Prints the three parts in seconds. It imports only what the call needs (no Haiku, no
Flax), so that each process starts quickly; the persistent compilation cache is off.
"""

import itertools
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import peex_interop as px

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from models import Transformer, random_like

# How each variant wraps the model; "by_hand" is the raw model run by a forward pass
# written out to return what "log" logs: the cost of returning those values at all.
WRAPPERS = {
    "raw": lambda model: model,
    "identity": px.ForwardHook,
    "log": lambda model: px.ForwardHook(model, log_fn=px.IdentityLog()),
    "by_hand": lambda model: model,
}


def scanned_transformer(depth, dim, heads, batch, seq):
    """`(model, tokens)`: `tests/models.py: Transformer` with `depth` blocks (built by
    `eqx.filter_vmap`, run by `lax.scan`), NumPy-drawn weights, `batch` x `seq` tokens."""
    shapes = eqx.filter_eval_shape(
        lambda: Transformer(vocab=100, dim=dim, heads=heads, num_blocks=depth, key=jax.random.key(0))
    )
    tokens = np.random.default_rng(0).integers(0, 100, (batch, seq), np.int32)
    return random_like(shapes), jnp.asarray(tokens)


@eqx.filter_jit
def scanned_forward(model, tokens):
    return jax.vmap(model)(tokens)


def _by_hand(model, tokens):
    """`model(tokens)` and the same values log-everything logs, written out: every
    layer's output (stacked over blocks, per position where the layer runs under a
    vmap), the attention weights (the input of the attention's dropout layer), and each
    value a layer and its container both return (a block's last layer and the block,
    the head and the model) twice, as the log holds it."""
    x = jax.vmap(model.embed)(tokens)
    arrays, static = eqx.partition(model.blocks, eqx.is_array)

    def step(x, arrays):
        block = eqx.combine(arrays, static)
        attn = block.attn
        normed = jax.vmap(block.norm1)(x)
        projections = [jax.vmap(p)(normed) for p in (attn.query_proj, attn.key_proj, attn.value_proj)]
        heads = [p.reshape(*p.shape[:-1], attn.num_heads, -1) for p in projections[:2]]
        weights = jax.vmap(eqx.nn._attention.dot_product_attention_weights, in_axes=1)(*heads)
        attended = attn(normed, normed, normed)
        x = x + attended
        normed2 = jax.vmap(block.norm2)(x)
        hidden = jax.vmap(block.mlp.layers[0])(normed2)
        mlp = jax.vmap(block.mlp)(normed2)
        x = x + mlp
        return x, (normed, *projections, weights, attended, attended, normed2, hidden, mlp, mlp, x)

    x, outputs = jax.lax.scan(step, x, arrays)
    embedded = jax.vmap(model.embed)(tokens)
    out = jax.vmap(model.head)(x)
    return out, (embedded, outputs, out)


@eqx.filter_jit
def by_hand_forward(model, tokens):
    return jax.vmap(_by_hand, in_axes=(None, 0))(model, tokens)


FORWARDS = {"by_hand": by_hand_forward}


def first_call(variant, depth, dim, heads, batch, seq):
    """`[lower, compile, run]` seconds of the first call of `variant`."""
    jax.config.update("jax_enable_compilation_cache", False)
    model, tokens = scanned_transformer(depth, dim, heads, batch, seq)
    model = WRAPPERS[variant](model)
    jax.block_until_ready(jax.jit(jnp.negative)(jnp.ones(3)))  # backend start-up, not timed
    times = [time.perf_counter()]
    lowered = FORWARDS.get(variant, scanned_forward).lower(model, tokens)
    times.append(time.perf_counter())
    compiled = lowered.compile()
    times.append(time.perf_counter())
    jax.block_until_ready(compiled(model, tokens))
    times.append(time.perf_counter())
    return [end - start for start, end in itertools.pairwise(times)]


if __name__ == "__main__":
    print(*first_call(sys.argv[1], *map(int, sys.argv[2:])))
