"""One first call (trace + lower, XLA compile, run) of the scanned transformer, in this
fresh process: the compile rows of `benchmarks/bench.py`, which runs it as
`python benchmarks/first_call.py VARIANT DEPTH DIM HEADS BATCH SEQ`.

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

# How each variant wraps the model.
WRAPPERS = {
    "raw": lambda model: model,
    "identity": px.ForwardHook,
    "log": lambda model: px.ForwardHook(model, log_fn=px.IdentityLog()),
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


def first_call(variant, depth, dim, heads, batch, seq):
    """`[lower, compile, run]` seconds of the first call of `variant`."""
    jax.config.update("jax_enable_compilation_cache", False)
    model, tokens = scanned_transformer(depth, dim, heads, batch, seq)
    model = WRAPPERS[variant](model)
    jax.block_until_ready(jax.jit(jnp.negative)(jnp.ones(3)))  # backend start-up, not timed
    times = [time.perf_counter()]
    lowered = scanned_forward.lower(model, tokens)
    times.append(time.perf_counter())
    compiled = lowered.compile()
    times.append(time.perf_counter())
    jax.block_until_ready(compiled(model, tokens))
    times.append(time.perf_counter())
    return [end - start for start, end in itertools.pairwise(times)]


if __name__ == "__main__":
    print(*first_call(sys.argv[1], *map(int, sys.argv[2:])))
