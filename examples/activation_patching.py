"""Activation patching on a tiny transformer trained here, in Equinox and its Flax NNX
twin: every layer x position of the residual stream patched in one compiled call.

The task needs attention: at the last position, predict the token at position 0. A
clean and a corrupted input differ at position 0 only; patching the clean residual
stream (the blocks' outputs) into the corrupted run shows where the answer lives:
at position 0 until a block has moved it, at the last position after."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import peex_interop as px

VOCAB, SEQ, DIM, HEADS, LAYERS = 8, 6, 32, 2, 2


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(DIM), eqx.nn.LayerNorm(DIM)
        self.attn = eqx.nn.MultiheadAttention(HEADS, DIM, key=k1)
        self.mlp = eqx.nn.MLP(DIM, DIM, 2 * DIM, depth=1, key=k2)

    def __call__(self, x):
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    position: eqx.nn.Embedding
    blocks: Block  # a stack: every array has a leading axis of LAYERS
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=k1)
        self.position = eqx.nn.Embedding(SEQ, DIM, key=k2)
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(k3, LAYERS))
        self.head = eqx.nn.Linear(DIM, VOCAB, key=k4)

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens) + jax.vmap(self.position)(jnp.arange(SEQ))
        arrays, static = eqx.partition(self.blocks, eqx.is_array)
        x, _ = jax.lax.scan(lambda x, block: (eqx.combine(block, static)(x), None), x, arrays)
        return jax.vmap(self.head)(x)


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        # Equinox's LayerNorm epsilon, and no attention biases, as in Equinox.
        self.norm1 = nnx.LayerNorm(DIM, epsilon=1e-5, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, DIM, use_bias=False, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(DIM, epsilon=1e-5, rngs=rngs)
        self.up = nnx.Linear(DIM, 2 * DIM, rngs=rngs)
        self.down = nnx.Linear(2 * DIM, DIM, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(jax.nn.relu(self.up(self.norm2(x))))


class NnxTransformer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.position = nnx.Embed(SEQ, DIM, rngs=rngs)
        self.blocks = nnx.vmap(lambda key: NnxBlock(nnx.Rngs(key)))(jax.random.split(rngs.params(), LAYERS))
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.position(jnp.arange(SEQ))
        x = nnx.scan(lambda x, block: block(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)
        return self.head(x)


def batch(key, size=64):
    tokens = jax.random.randint(key, (size, SEQ), 0, VOCAB)
    return tokens, tokens[:, 0]


def train(model, steps=200):
    optim = optax.adam(3e-3)

    def loss(model, tokens, answers):
        logits = jax.vmap(model)(tokens)[:, -1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, answers).mean()

    @eqx.filter_jit
    def fit(model):
        arrays, static = eqx.partition(model, eqx.is_inexact_array)

        def step(carry, key):
            arrays, state = carry
            value, grads = jax.value_and_grad(lambda a: loss(eqx.combine(a, static), *batch(key)))(arrays)
            updates, state = optim.update(grads, state)
            return (eqx.apply_updates(arrays, updates), state), value

        keys = jax.random.split(jax.random.key(1), steps)
        (arrays, _), values = jax.lax.scan(step, (arrays, optim.init(arrays)), keys)
        return eqx.combine(arrays, static), values[-1]

    model, value = fit(model)
    tokens, answers = batch(jax.random.key(2), 512)
    accuracy = jnp.mean(jnp.argmax(jax.vmap(model)(tokens)[:, -1], -1) == answers)
    print(f"trained: loss {value:.3f}, accuracy {accuracy:.3f}")
    return model


@eqx.filter_jit
def patching_table(model, clean, corrupted):
    """The normalised logit difference at the last position with the clean residual
    stream patched in at each layer x position of the corrupted run: 1 = the clean
    answer fully restored, 0 = no effect. One compiled call, any library's model."""
    clean_answer, corrupted_answer = clean[0], corrupted[0]

    def logit_diff(logits):
        return logits[-1, clean_answer] - logits[-1, corrupted_answer]

    _, cache = px.cache(model, clean, where="blocks")
    clean_diff, corrupted_diff = logit_diff(model(clean)), logit_diff(model(corrupted))

    def patched(layer, position):
        def fn(current, cached, site):
            return jnp.where((site.step == layer) & (jnp.arange(SEQ) == position)[:, None], cached, current)

        return logit_diff(px.patch(model, cache, "blocks", fn=fn)(corrupted))

    layers, positions = jnp.meshgrid(jnp.arange(LAYERS), jnp.arange(SEQ), indexing="ij")
    diffs = jax.vmap(jax.vmap(patched))(layers, positions)
    return (diffs - corrupted_diff) / (clean_diff - corrupted_diff)


def show(table):
    print("block \\ position " + " ".join(f"{p:>6}" for p in range(SEQ)))
    for layer, row in enumerate(np.round(np.asarray(table), 3) + 0.0):  # + 0.0: no "-0.000"
        print(f"blocks.{layer:<10}" + " ".join(f"{v:6.3f}" for v in row))


def main():
    model = train(Transformer(jax.random.key(0)))
    clean = jnp.asarray([3, 5, 1, 6, 2, 7])
    corrupted = clean.at[0].set(4)
    print(
        f"clean {clean.tolist()} -> {int(model(clean)[-1].argmax())}, "
        f"corrupted {corrupted.tolist()} -> {int(model(corrupted)[-1].argmax())}"
    )
    table = patching_table(model, clean, corrupted)
    print("Equinox: normalised logit difference, clean residual stream patched in")
    show(table)

    # The NNX twin: built abstractly (no initialisation spent), every weight moved from
    # the trained model by transfer_params; the tables agreeing below is the check.
    twin = px.from_nnx(nnx.eval_shape(lambda: NnxTransformer(nnx.Rngs(0))))
    twin = px.transfer_params(model, twin, px.align(model, twin, clean).mapping)
    nnx_table = patching_table(twin, clean, corrupted)
    print("Flax NNX twin:")
    show(nnx_table)
    np.testing.assert_allclose(nnx_table, table, atol=1e-4)
    print("Equinox and NNX tables agree to 1e-4")


if __name__ == "__main__":
    main()
