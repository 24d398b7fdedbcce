"""`make demo`: hook an MLP and a small transformer (attention + a scanned layer stack),
print the logged paths and shapes, the attention patterns through the attention
weights site, and a backward log."""

import equinox as eqx
import jax
import jax.numpy as jnp
from rich.console import Console
from rich.table import Table

import peex_interop as px


class Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP

    def __init__(self, dim, heads, *, key):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(dim)
        self.attn = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.mlp = eqx.nn.MLP(dim, dim, 2 * dim, depth=1, key=k2)

    def __call__(self, x):
        h = jax.vmap(self.norm)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.mlp)(x)


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: Block  # one Block whose arrays have a leading "layer" axis
    head: eqx.nn.Linear

    def __init__(self, vocab, dim, heads, depth, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=k1)
        self.blocks = eqx.filter_vmap(lambda k: Block(dim, heads, key=k))(jax.random.split(k2, depth))
        self.head = eqx.nn.Linear(dim, vocab, key=k3)

    def __call__(self, tokens):
        arrays, static = eqx.partition(self.blocks, eqx.is_array)
        x, _ = jax.lax.scan(
            lambda x, a: (eqx.combine(a, static)(x), None), jax.vmap(self.embed)(tokens), arrays
        )
        return jax.vmap(self.head)(x)


def shapes(value):
    return ", ".join(str(tuple(leaf.shape)) for leaf in jax.tree.leaves(value))


def show(title, log):
    table = Table(title=title)
    table.add_column("path")
    table.add_column("logged shape(s)")
    for path, value in log.items():
        table.add_row(path, shapes(value))
    Console().print(table)


def show_pattern(weights):
    blocks, heads, queries, keys = weights.shape
    table = Table(title=f"blocks.attn.weights: block 0, head 0 of {blocks} blocks x {heads} heads (rows sum to 1)")
    table.add_column("query")
    for key in range(keys):
        table.add_column(f"key {key}", justify="right")
    for query in range(queries):
        table.add_row(str(query), *(f"{float(w):.2f}" for w in weights[0, 0, query]))
    Console().print(table)
    entropy = -(weights * jnp.log(weights)).sum(-1).mean(-1)
    for block, row in enumerate(entropy):
        values = "  ".join(f"{float(e):.3f}" for e in row)
        print(f"  attention entropy, blocks[{block}], heads 0-{heads - 1}: {values}")


@eqx.filter_jit
def run(hooked, x):
    return hooked(x)


def main():
    mlp = eqx.nn.MLP(4, 2, 16, depth=3, key=jax.random.key(0))
    x = jnp.linspace(-1.0, 1.0, 4)
    _, log = run(px.ForwardHook(mlp, log_fn=px.IdentityLog()), x)
    show("eqx.nn.MLP: forward log (IdentityLog)", log)

    model = Transformer(vocab=32, dim=16, heads=4, depth=3, key=jax.random.key(1))
    tokens = jnp.arange(6) % 32
    _, log = run(px.ForwardHook(model, log_fn=px.IdentityLog()), tokens)
    show("Transformer: forward log (scan axis and vmap axes leading)", log)
    # The same call sites, found without running the model: the scanned stack of 3
    # blocks is one row per layer, marked x3, and the top-level rows add up to the total.
    print(px.summary(model, tokens))

    # Attention patterns: the weights each attention layer forms, a site inside it,
    # selected by name (block of the scanned stack, head, query, key).
    _, log = run(px.ForwardHook(model, log_fn=px.IdentityLog(), where="blocks.attn.weights"), tokens)
    show_pattern(log["blocks.attn.weights"])

    hooked = px.BackwardHook(model, log_fn=px.MeanStdLog(), where=["blocks", "head"]).init(tokens)
    grads = eqx.filter_jit(eqx.filter_grad(lambda h, t: jnp.mean(h(t) ** 2)))(hooked, tokens)
    mean, std = grads.log["blocks"]
    print("backward log: mean/std of the cotangent of each block's output")
    for layer, (m, s) in enumerate(zip(mean, std)):
        print(f"  blocks[{layer}]  mean={float(m):+.3e}  std={float(s):.3e}")


if __name__ == "__main__":
    main()
