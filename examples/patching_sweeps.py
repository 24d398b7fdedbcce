"""Patching sweeps and path patching on a Hugging Face Flax GPT-2 (tiny random weights):
TransformerLens's `get_act_patch_resid_pre` and `get_act_patch_attn_head_out_all_pos`
as one compiled call each, and a path patch from one head into a later head's values.

Run: `python examples/patching_sweeps.py`.
"""

import warnings

import jax.numpy as jnp
import numpy as np

import peex_interop as px

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

HEADS = 4
config = GPT2Config(vocab_size=32, n_positions=8, n_embd=32, n_layer=3, n_head=HEADS, initializer_range=0.1)
hf = FlaxGPT2LMHeadModel(config, seed=0)
model = px.from_linen(hf.module, {"params": hf.params})

clean = jnp.array([[1, 7, 3, 9, 4, 2, 5]])
corrupted = clean.at[0, 2].set(11)  # one token differs
rest = (jnp.ones_like(clean), jnp.arange(clean.shape[1])[None])  # attention mask, positions


def logit_difference(out):
    """The metric: how much the last position prefers token 3 over token 5."""
    return out.logits[0, -1, 3] - out.logits[0, -1, 5]


blocks, heads_in = "transformer.h.*", "transformer.h.*.attn.c_proj"
_, clean_cache = px.cache(model, clean, *rest, where=[blocks, heads_in, "transformer.h.*.mlp"], inputs=True)
print(f"metric: clean {logit_difference(model(clean, *rest)):.4f}, "
      f"corrupted {logit_difference(model(corrupted, *rest)):.4f}")

# Every block's input (the residual stream, resid_pre) patched one position at a time.
resid_pre = px.patch_sweep(model, clean_cache, corrupted, *rest, where=blocks, inputs=True,
                           cells=px.Along(1), metric=logit_difference)
print("resid_pre sweep (block x position):")
for name, row in zip(px.sweep_rows(model, corrupted, *rest, where=blocks, inputs=True), np.asarray(resid_pre)):
    print(f"  {name:16s}", " ".join(f"{value:+.4f}" for value in row))

# Every head's output at all positions: the heads entering each output projection.
heads = px.patch_sweep(model, clean_cache, corrupted, *rest, where=heads_in, inputs=True,
                       cells=px.Groups(-1, HEADS), metric=logit_difference)
print("head sweep (block x head):")
for block, row in enumerate(np.asarray(heads)):
    print(f"  block {block}", " ".join(f"{value:+.4f}" for value in row))

# Path patching: head 2 of block 0, clean, into the values of head 1 of block 2 only
# (c_attn's output is each head's queries, keys and values: 3 x HEADS groups); every
# head output and MLP held at its corrupted value in between.
head_outputs = lambda where: px.Component(where, px.Groups(-1, HEADS), inputs=True)
freeze = [head_outputs(heads_in), px.Component("transformer.h.*.mlp")]
out = px.path_patch(model, clean_cache, corrupted, *rest,
                    sender=head_outputs("transformer.h.0.attn.c_proj"), sender_cell=2,
                    receiver=px.Component("transformer.h.2.attn.c_attn", px.Groups(-1, 3 * HEADS)),
                    receiver_cell=2 * HEADS + 1, freeze=freeze)
print(f"path 0.2 -> values of 2.1: metric {logit_difference(out):+.4f}")
