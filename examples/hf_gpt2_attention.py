"""Attention patterns of Hugging Face's Flax GPT-2, as written by Hugging Face: its own
attention module (`FlaxGPT2Attention`), its tied LM head (`self.lm_head.apply(...)` with
the token embedding), its activation from a table of partials (`ACT2FN`).

A tiny random GPT-2 (no download): every block's attention weights through the
`.weights` site equal the model's own `output_attentions`; the logits are the
`lm_head` site; the `.scores` (what the softmax receives, TransformerLens's
`hook_attn_scores`) come in the same pass; one head is ablated through its weights; and
the MLP's `gelu` is a site named with `px.function_sites`, though the model reaches it
through a partial.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np

import peex_interop as px

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)  # transformers 4.x: Flax classes are deprecated
    from transformers import FlaxGPT2LMHeadModel, GPT2Config


def main():
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=4)
    hf_model = FlaxGPT2LMHeadModel(config, seed=0)
    ids = jnp.array([[5, 17, 3, 42, 8, 11]])
    mask, positions = jnp.ones_like(ids), jnp.arange(ids.shape[1])[None]
    reference = hf_model(ids, output_attentions=True)

    # The linen module as Hugging Face wrote it, with its params.
    model = px.from_linen(hf_model.module, {"params": hf_model.params})
    where = ["**.weights", "**.scores", "lm_head"]
    logits, log = px.ForwardHook(model, log_fn=px.IdentityLog(), where=where)(ids, mask, positions)
    for block in range(config.n_layer):
        pattern = log[f"transformer.h.{block}.attn.weights"]  # (batch, head, query, key)
        np.testing.assert_array_equal(pattern, reference.attentions[block])
        scores = log[f"transformer.h.{block}.attn.scores"]  # the causal mask added: finfo.min above it
        np.testing.assert_allclose(jax.nn.softmax(scores, axis=-1), pattern, atol=1e-6)
        print(f"block {block}: heads attend to the previous token with weight", np.round(
            np.diagonal(pattern[0], offset=-1, axis1=-2, axis2=-1).mean(-1), 3).tolist())
    np.testing.assert_array_equal(log["lm_head"], reference.logits)
    print("lm_head (the tied embedding applied with its own variables):", log["lm_head"].shape)

    # Head 2 of block 1 ablated through its weights: what attends nowhere adds nothing.
    ablated, _ = px.ForwardHook(model, hook_fn=lambda w: w.at[:, 2].set(0.0), where="transformer.h.1.attn.weights")(
        ids, mask, positions
    )
    print("ablating head 2 of block 1 moves the logits by", float(jnp.abs(ablated.logits - logits.logits).max()))

    # The MLP's activation is `ACT2FN["gelu_new"]`, a partial of `jax.nn.gelu`.
    _, log = px.ForwardHook(px.function_sites(model, jax.nn.gelu), log_fn=px.MeanLog(), where="**.gelu")(
        ids, mask, positions
    )
    print("mean gelu output per block:", [round(float(log[f"transformer.h.{b}.mlp.gelu"]), 4) for b in range(3)])


if __name__ == "__main__":
    main()
