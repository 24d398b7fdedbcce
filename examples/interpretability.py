"""Attention patterns, head ablation, pattern patching and attribution patching on the
tiny transformer of `activation_patching.py` (trained here), in Equinox and its Flax
NNX twin: every table computed by one compiled function, equal in both libraries.

The attention weights of every attention are the site `<attention>.weights`, shaped
`(heads, query, key)`: here `blocks.attn.weights`, stacked over the scanned blocks.
Attribution patching (gradient x activation, the linear approximation of activation
patching) scores every (block, head, query position) from one forward and one
backward pass; the exact sweep patches each of them in turn (one vmapped call)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import peex_interop as px
from activation_patching import HEADS, LAYERS, SEQ, NnxTransformer, Transformer, train

WEIGHTS = "blocks.attn.weights"


def logit_diff(logits, clean, corrupted):
    return logits[-1, clean[0]] - logits[-1, corrupted[0]]


@eqx.filter_jit
def tables(model, clean, corrupted):
    """(patterns, ablation, patching, attribution) for any library's model."""
    _, cache = px.cache(model, clean, where=WEIGHTS)
    patterns = cache[WEIGHTS]  # (block, head, query, key)
    clean_diff = logit_diff(model(clean), clean, corrupted)
    corrupted_diff = logit_diff(model(corrupted), clean, corrupted)

    def normalised(logits):
        return (logit_diff(logits, clean, corrupted) - corrupted_diff) / (clean_diff - corrupted_diff)

    def ablated(block, head):
        # That head's weights zeroed in the clean run: how much of the answer is left.
        def hook(weights, site):
            return jnp.where((site.step == block) & (jnp.arange(HEADS) == head)[:, None, None], 0.0, weights)

        return normalised(px.ForwardHook(model, hook_fn=hook, where=WEIGHTS)(clean)[0])

    def patched(block, head, query):
        # The clean pattern of one (block, head, query position) in the corrupted run.
        def fn(current, cached, site):
            at = (site.step == block) & (jnp.arange(HEADS) == head)[:, None] & (jnp.arange(SEQ) == query)
            return jnp.where(at[:, :, None], cached, current)

        return normalised(px.patch(model, cache, WEIGHTS, fn=fn)(corrupted))

    grid = jnp.meshgrid(jnp.arange(LAYERS), jnp.arange(HEADS), indexing="ij")
    ablation = jax.vmap(jax.vmap(ablated))(*grid)
    grid = jnp.meshgrid(jnp.arange(LAYERS), jnp.arange(HEADS), jnp.arange(SEQ), indexing="ij")
    patching = jax.vmap(jax.vmap(jax.vmap(patched)))(*grid)

    # Attribution patching: d(normalised diff)/d(weights) on the corrupted run, times
    # (clean - corrupted) weights, summed over the keys.
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where=WEIGHTS).init(corrupted)
    grads = eqx.filter_grad(lambda hooked: normalised(hooked(corrupted)))(hooked)
    _, corrupted_cache = px.cache(model, corrupted, where=WEIGHTS)
    attribution = jnp.sum(grads.log[WEIGHTS] * (patterns - corrupted_cache[WEIGHTS]), axis=-1)
    return patterns, ablation, patching, attribution


def show(name, table, rows, columns):
    print(name)
    print(" " * 14 + " ".join(f"{c:>7}" for c in columns))
    for label, row in zip(rows, np.round(np.asarray(table), 3) + 0.0):  # + 0.0: no "-0.000"
        print(f"{label:<14}" + " ".join(f"{v:7.3f}" for v in row))


def report(name, results):
    patterns, ablation, patching, attribution = results
    heads = [f"blocks.{b}.head{h}" for b in range(LAYERS) for h in range(HEADS)]
    print(f"== {name}")
    show("attention of the last position to each key:", patterns[:, :, -1].reshape(-1, SEQ), heads, range(SEQ))
    show("head ablated in the clean run (normalised logit difference):", ablation.reshape(-1, 1), heads, ["left"])
    show("clean pattern patched in, per query position (exact):", patching.reshape(-1, SEQ), heads, range(SEQ))
    show("attribution patching, per query position:", attribution.reshape(-1, SEQ), heads, range(SEQ))


def rank(values):
    return np.argsort(np.argsort(values))


def main():
    model = train(Transformer(jax.random.key(0)))
    clean = jnp.asarray([3, 5, 1, 6, 2, 7])
    corrupted = clean.at[0].set(4)
    results = tables(model, clean, corrupted)
    report("Equinox", results)

    # The NNX twin, every weight moved from the trained model (as in activation_patching.py).
    twin = px.from_nnx(nnx.eval_shape(lambda: NnxTransformer(nnx.Rngs(0))))
    twin = px.transfer_params(model, twin, px.align(model, twin, clean).mapping)
    twin_results = tables(twin, clean, corrupted)
    report("Flax NNX twin", twin_results)
    for ours, theirs in zip(results, twin_results):
        np.testing.assert_allclose(theirs, ours, atol=1e-4)
    print("Equinox and NNX tables agree to 1e-4")

    patching, attribution = np.ravel(results[2]), np.ravel(results[3])
    pearson = np.corrcoef(attribution, patching)[0, 1]
    spearman = np.corrcoef(rank(attribution), rank(patching))[0, 1]
    effect = np.abs(patching) > 1e-3
    signs = np.mean(np.sign(attribution[effect]) == np.sign(patching[effect]))
    print(
        f"attribution vs exact patching over {patching.size} (block, head, position): "
        f"Pearson {pearson:.3f}, Spearman {spearman:.3f}; same sign at all "
        f"{int(effect.sum())} entries with an effect above 1e-3: {bool(signs == 1)}"
    )


if __name__ == "__main__":
    main()
