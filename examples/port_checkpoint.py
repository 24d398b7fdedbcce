"""A trained linen checkpoint ported to NNX with `px.port`, through orbax-checkpoint.

A small decoder-only language model written in linen (the default names `Embed_0`,
`MultiHeadDotProductAttention_0`, `MlpBlock_0.Dense_0`, as the Flax lm1b example has
them) is trained for a few steps with optax and saved with orbax. The checkpoint is
restored, ported to the model's NNX twin (its own names; built abstractly, so never
initialised), verified layer by layer, saved as an NNX checkpoint, and restored into a
fresh abstract NNX model that computes the trained linen model's logits.

Needs the `checkpoint` extra (orbax-checkpoint) and optax.
"""

import tempfile
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

import peex_interop as px

VOCAB, D, HEADS, MLP, LAYERS, SEQ = 32, 16, 2, 32, 1, 8


class MlpBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        hidden = nn.Dense(MLP)(x)
        return nn.Dense(D)(nn.relu(hidden))


class DecoderBlock(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D)(nn.LayerNorm()(x), mask=mask)
        return x + MlpBlock()(nn.LayerNorm()(x))


class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D)(tokens)
        mask = nn.make_causal_mask(tokens)
        for _ in range(LAYERS):
            x = DecoderBlock()(x, mask)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.pre_attention = nnx.LayerNorm(D, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(HEADS, D, qkv_features=D, decode=False, rngs=rngs)
        self.pre_mlp = nnx.LayerNorm(D, rngs=rngs)
        self.hidden = nnx.Linear(D, MLP, rngs=rngs)
        self.out = nnx.Linear(MLP, D, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attention(self.pre_attention(x), mask=mask)
        return x + self.out(nnx.relu(self.hidden(self.pre_mlp(x))))


class NnxLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(LAYERS)])
        self.final_norm = nnx.LayerNorm(D, rngs=rngs)
        self.logits = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.logits(self.final_norm(x))


# Train the linen model a few steps on next-token prediction.
tokens = jax.random.randint(jax.random.key(0), (4, SEQ), 0, VOCAB)
linen_model = LinenLM()
# Jitted, as the calls below: run eagerly, an init compiles each of its operations apart.
variables = jax.jit(linen_model.init)(jax.random.key(1), tokens)
optimizer = optax.adam(1e-2)


@jax.jit
def train_step(params, opt_state):
    def loss(params):
        logits = linen_model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, value


params, opt_state = variables["params"], optimizer.init(variables["params"])
for step in range(3):
    params, opt_state, loss = train_step(params, opt_state)
    print(f"step {step}: loss {loss:.4f}")
trained_logits = jax.jit(linen_model.apply)({"params": params}, tokens)

with tempfile.TemporaryDirectory() as folder:
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(Path(folder) / "linen", {"params": params})
    checkpointer.wait_until_finished()

    # Restore into the shapes of an init that never runs, and port to the NNX twin,
    # itself built abstractly: the port fills it with the checkpoint's arrays.
    restored = checkpointer.restore(Path(folder) / "linen", jax.eval_shape(linen_model.init, jax.random.key(1), tokens))
    abstract_nnx = nnx.eval_shape(lambda: NnxLM(nnx.Rngs(0)))
    ported, comparison = px.port(px.from_linen(linen_model, restored), px.from_nnx(abstract_nnx), tokens)
    print(comparison)
    matched = {row.path_a: row.path_b for row in comparison.rows}
    assert matched["DecoderBlock_0.MultiHeadDotProductAttention_0"] == "blocks.0.attention"

    # The port, as an NNX checkpoint, restored into a fresh abstract NNX model.
    checkpointer.save(Path(folder) / "nnx", nnx.state(px.to_nnx(ported)))
    checkpointer.wait_until_finished()
    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: NnxLM(nnx.Rngs(1))))
    nnx_model = nnx.merge(graphdef, checkpointer.restore(Path(folder) / "nnx", abstract_state))

logits = nnx.jit(lambda model, tokens: model(tokens))(nnx_model, tokens)
np.testing.assert_allclose(logits, trained_logits, atol=1e-5)
print(f"NNX logits from the NNX checkpoint equal the trained linen model's (max abs difference "
      f"{float(jnp.max(jnp.abs(logits - trained_logits))):.2g})")
