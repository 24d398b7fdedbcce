"""Hooks on a Flax NNX model: convert, log every layer (inside nnx.scan too), log
cotangents, train with optax, and get the trained NNX module back."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import peex_interop as px


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, 8, decode=False, rngs=rngs)

    def __call__(self, x):
        return x + self.attn(self.norm(x))


class Transformer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(16, 8, rngs=rngs)
        self.blocks = nnx.vmap(lambda k: Block(nnx.Rngs(k)))(jax.random.split(rngs.params(), 2))
        self.head = nnx.Linear(8, 16, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = nnx.scan(lambda x, b: b(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)
        return self.head(x)


def main():
    model = Transformer(nnx.Rngs(0))
    tokens = jnp.arange(6) % 16
    net = px.from_nnx(model)

    output, log = eqx.filter_jit(lambda h, t: h(t))(px.ForwardHook(net, log_fn=px.IdentityLog()), tokens)
    print(f"{'layer':<22} shape")
    for path, value in sorted(log.items()):
        print(f"{path:<22} {tuple(value.shape)}")

    hooked = px.BackwardHook(net, log_fn=px.IdentityLog(), where="blocks.attn").init(tokens)
    grads = eqx.filter_grad(lambda h, t: jnp.mean(h(t) ** 2))(hooked, tokens)
    print("cotangent norm of blocks.attn per block:", jnp.linalg.norm(grads.log["blocks.attn"], axis=(1, 2)))

    optim = optax.adam(1e-2)
    opt_state = optim.init(eqx.filter(net, eqx.is_inexact_array))
    loss = lambda m, t: jnp.mean((m(t) - jax.nn.one_hot(t, 16)) ** 2)

    @eqx.filter_jit
    def step(m, opt_state, t):
        value, grads = eqx.filter_value_and_grad(loss)(m, t)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(m, eqx.is_inexact_array))
        return eqx.apply_updates(m, updates), opt_state, value

    for i in range(3):
        net, opt_state, value = step(net, opt_state, tokens)
        print(f"step {i}: loss {value:.5f}")
    trained = px.to_nnx(net)
    print("trained NNX module:", type(trained).__name__, "loss", float(loss(trained, tokens)))


if __name__ == "__main__":
    main()
