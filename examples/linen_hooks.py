"""Hooks on a Flax linen model: convert, log every layer (inside nn.scan too, where
linen's own capture_intermediates sees nothing), log cotangents per scanned step, carry
BatchNorm statistics, train with optax, and get linen variables back."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import peex_interop as px


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        return x + nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(h, h), None


class Transformer(nn.Module):
    @nn.compact
    def __call__(self, tokens, train: bool = False):
        x = nn.Embed(16, 8)(tokens)
        blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
        x, _ = blocks(name="blocks")(x, None)
        x = nn.BatchNorm(use_running_average=not train, axis_name=None)(x)
        return nn.Dense(16, name="head")(x)


def main():
    module = Transformer()
    tokens = (jnp.arange(12) % 16).reshape(2, 6)
    variables = module.init(jax.random.key(0), tokens)
    net = px.from_linen(module, variables)

    output, log = eqx.filter_jit(lambda h, t: h(t))(px.ForwardHook(net, log_fn=px.IdentityLog()), tokens)
    _, captured = module.apply(variables, tokens, capture_intermediates=True, mutable=["intermediates"])
    print(f"{'layer':<22} {'shape':<16} linen's capture_intermediates")
    for path, value in sorted(log.items()):
        node = captured["intermediates"]
        for part in path.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        shape = tuple(jax.tree.leaves(value)[0].shape)  # a scanned Block returns (x, None)
        print(f"{path:<22} {shape!s:<16} {'yes' if '__call__' in node else 'nothing'}")

    hooked = px.BackwardHook(net, log_fn=px.IdentityLog(), where="blocks.attn").init(tokens)
    grads = eqx.filter_grad(lambda h, t: jnp.mean(h(t) ** 2))(hooked, tokens)
    print("cotangent norm of blocks.attn per block:", jnp.sqrt(jnp.sum(grads.log["blocks.attn"] ** 2, axis=(1, 2, 3))))

    training = px.from_linen(module, variables, mutable=["batch_stats"])
    optim = optax.adam(1e-2)
    opt_state = optim.init(eqx.filter(training, eqx.is_inexact_array))

    def loss(m, t):
        out, updates = m(t, train=True)
        return jnp.mean((out - jax.nn.one_hot(t, 16)) ** 2), updates

    @eqx.filter_jit
    def step(m, opt_state, t):
        (value, updates), grads = eqx.filter_value_and_grad(loss, has_aux=True)(m, t)
        changes, opt_state = optim.update(grads, opt_state, eqx.filter(m, eqx.is_inexact_array))
        # The statistics the call computed replace whatever the optimizer did to them.
        return eqx.apply_updates(m, changes).with_variables(updates), opt_state, value

    for i in range(3):
        training, opt_state, value = step(training, opt_state, tokens)
        print(f"step {i}: loss {value:.5f}")
    print(px.summary(training, tokens, train=True))
    trained = module.apply(training.variables, tokens)
    print("trained linen variables:", sorted(training.variables), "output", trained.shape)


if __name__ == "__main__":
    main()
