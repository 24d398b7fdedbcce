"""Issue 48: caches, patches and mean ablations of Hugging Face's Flax GPT-2 (tiny random
weights, `px.from_linen`), as a TransformerLens user takes them: `px.cache` without
`where=` caches every site `px.sites(inner=True)` lists; a cache is data (arrays only)
that `jax.jit` returns, `jax.vmap` stacks and orbax saves, and that `px.patch` puts
back; `px.MeanAblation(cache, axis=0)` ablates over the batch the model runs itself."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peex_interop as px
from models import close

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

T = 5
ATTN, WEIGHTS = "transformer.h.0.attn", "transformer.h.0.attn.weights"


@pytest.fixture(scope="module")
def gpt2():
    config = GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    hf = FlaxGPT2LMHeadModel(config, seed=0)
    return hf, px.from_linen(hf.module, {"params": hf.params})


def gpt2_args(ids):
    """A batch of token ids (batch, T) as GPT-2's arguments: no padding, positions 0.."""
    return ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)


CLEAN = jnp.array([[1, 7, 3, 9, 4], [2, 8, 8, 1, 5], [6, 0, 4, 4, 2]])
CORRUPTED = CLEAN.at[:, 1].set(11)


def test_a_cache_without_where_holds_every_site_that_px_sites_lists(gpt2):
    hf, model = gpt2
    model = px.function_sites(model, jax.nn.gelu)  # HF's ACT2FN["gelu_new"]: mlp.gelu
    args = gpt2_args(CLEAN)
    out, cache = px.cache(model, *args)
    assert set(cache) == {row.key for row in px.sites(model, *args, inner=True)}
    reference = hf.module.apply({"params": hf.params}, *args, output_attentions=True)
    close(out.logits, reference.logits, tol=1e-5)
    close(cache[WEIGHTS], reference.attentions[0], tol=1e-6)
    close(cache["transformer.h.1.mlp.gelu"], jax.nn.gelu(cache["transformer.h.1.mlp.c_fc"], approximate=True))
    close(cache["lm_head"], reference.logits, tol=1e-5)
    # Patching what the cache holds (every site, the weights and gelu too): the clean run.
    patched = px.patch(model, cache)(*gpt2_args(CORRUPTED))
    assert not np.allclose(model(*gpt2_args(CORRUPTED)).logits, reference.logits, atol=1e-3)
    close(patched.logits, reference.logits, tol=1e-5)


def weights_patched_by_hand(hf, model, clean_args, corrupted_args):
    """The corrupted run with block 0's attention weights those of HF's own clean run
    (`output_attentions=True`)."""
    clean = hf.module.apply({"params": hf.params}, *clean_args, output_attentions=True).attentions[0]
    return px.ForwardHook(model, hook_fn=lambda w: clean, where=WEIGHTS)(*corrupted_args)[0].logits


def test_a_cache_is_data_that_jit_returns_vmap_stacks_orbax_saves_and_patch_puts_back(gpt2, tmp_path):
    hf, model = gpt2
    clean_args, corrupted_args = gpt2_args(CLEAN), gpt2_args(CORRUPTED)
    # The inputs of a `.weights` site hold Flax's `dtype=jnp.float32`: not kept.
    _, cache = jax.jit(lambda *a: px.cache(model, *a, where=WEIGHTS, inputs=True))(*clean_args)
    leaves = jax.tree.leaves(cache, is_leaf=lambda x: x is None)
    assert all(leaf is None or isinstance(leaf, jax.Array) for leaf in leaves)
    assert cache[f"{WEIGHTS}:in"][1]["dtype"] is None
    expected = weights_patched_by_hand(hf, model, clean_args, corrupted_args)
    # Its inputs put back (the dtype taken from the call) give the clean weights.
    patched = px.patch(model, cache, WEIGHTS, inputs=True)
    close(patched(*corrupted_args).logits, expected, tol=1e-5)
    close(jax.jit(lambda *a: patched(*a).logits)(*corrupted_args), expected, tol=1e-5)

    # Under an outer vmap, one example at a time: the same values, stacked.
    _, stacked = jax.vmap(lambda ids: px.cache(model, *gpt2_args(ids[None]), where=WEIGHTS, inputs=True))(CLEAN)
    close(stacked[WEIGHTS][:, 0], cache[WEIGHTS], tol=1e-6)
    close(stacked[f"{WEIGHTS}:in"][1]["bias"][:, 0], cache[f"{WEIGHTS}:in"][1]["bias"])

    ocp = pytest.importorskip("orbax.checkpoint")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "cache", cache)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "cache", cache)
    jax.tree.map(np.testing.assert_array_equal, restored, cache)
    close(px.patch(model, restored, WEIGHTS, inputs=True)(*corrupted_args).logits, expected, tol=1e-5)


def batch_mean_by_hand(logged):
    """A hook putting in place the mean over axis 0 of an independently logged value."""
    def hook(value):
        return jax.tree.map(lambda v, a: jnp.broadcast_to(jnp.mean(a, 0, keepdims=True), v.shape), value, logged)

    return hook


def test_mean_ablation_over_the_batch_the_model_runs_itself(gpt2):
    _, model = gpt2
    args = gpt2_args(CLEAN)
    _, cache = px.cache(model, *args, where=ATTN)
    _, logged = px.ForwardHook(model, log_fn=px.IdentityLog(), where=ATTN)(*args)
    ablated, _ = px.ForwardHook(model, hook_fn=px.MeanAblation(cache, axis=0), where=ATTN)(*args)
    by_hand, _ = px.ForwardHook(model, hook_fn=batch_mean_by_hand(logged[ATTN]), where=ATTN)(*args)
    close(ablated.logits, by_hand.logits, tol=1e-6)
    assert not np.allclose(ablated.logits, model(*args).logits, atol=1e-3)
    # The mean of that batch, broadcast to a batch of another size (one example).
    one = gpt2_args(CORRUPTED[:1])
    ablated, _ = px.ForwardHook(model, hook_fn=px.MeanAblation(cache, axis=0), where=ATTN)(*one)
    by_hand, _ = px.ForwardHook(model, hook_fn=batch_mean_by_hand(logged[ATTN]), where=ATTN)(*one)
    close(ablated.logits, by_hand.logits, tol=1e-6)

    # The same means from a cache taken under an outer vmap (axis=None, the default).
    _, outer = jax.vmap(lambda ids: px.cache(model, *gpt2_args(ids[None]), where=ATTN))(CLEAN)
    from_outer, _ = px.ForwardHook(model, hook_fn=px.MeanAblation(outer), where=ATTN)(*one)
    close(from_outer.logits, by_hand.logits, tol=1e-6)

    # Shapes that cannot match raise, naming the layer and both shapes.
    with pytest.raises(px.HookError, match=r"axis=0\).*'transformer\.h\.0\.attn'.*\(3, 5, 16\).*\(1, 4, 16\)"):
        px.ForwardHook(model, hook_fn=px.MeanAblation(cache, axis=0), where=ATTN)(*gpt2_args(CLEAN[:1, :4]))
    with pytest.raises(px.HookError, match=r"'transformer\.h\.0\.attn'.*\(5, 16\).*\(3, 5, 16\).*axis=0"):
        px.ForwardHook(model, hook_fn=px.MeanAblation(cache), where=ATTN)(*args)
