"""Hooks on a pure-function model without changing its code: zephyr's README
autoencoder (its decoder fed the encoding), initialised with zephyr's `trace`, then every `mlp` and every inner
`linear` call logged under its params path (forward statistics and cotangents), a
per-example log under `jax.vmap`, a summary, and its weights moved into Equinox."""

import equinox as eqx
import jax
import jax.numpy as jnp
import zephyr.nets
from zephyr.building.tracing import trace
from zephyr.nets import mlp

import peex_interop as px


def encoder(params, x, embed_dim, latent_dim):
    x = mlp(params["mlp_1"], x, [embed_dim, embed_dim])
    x = mlp(params["mlp_2"], x, [embed_dim, latent_dim])
    return x


def decoder(params, x, embed_dim, original_dim):
    x = mlp(params, x, [embed_dim, embed_dim, original_dim])
    return x


def autoencoder(params, x, embed_dim, latent_dim):
    encoding = encoder(params["encoder"], x, embed_dim, latent_dim)
    # zephyr's README passes `x` here (leaving the encoder unused); decode the encoding.
    reconstruction = decoder(params["decoder"], encoding, embed_dim, x.shape[-1])
    return reconstruction


def main():
    x = jax.random.normal(jax.random.key(1), (8, 16))
    params = trace(autoencoder, jax.random.key(0), x, 32, 4)
    model = px.from_function(autoencoder, params, layers=[zephyr.nets.mlp, zephyr.nets.linear])

    hooked = px.ForwardHook(model, log_fn=px.activation_stats())
    _, stats = eqx.filter_jit(lambda h, x: h(x, 32, 4))(hooked, x)
    print(f"{'layer':<18} {'mean':>8} {'std':>8} {'near 0':>7}")
    for path, s in sorted(stats.items()):
        print(f"{path:<18} {float(s['mean']):>8.4f} {float(s['std']):>8.4f} {float(s['near_zero']):>7.2f}")

    backward = px.BackwardHook(model, log_fn=px.IdentityLog(), where="encoder.*.*").init(x, 32, 4)
    grads = eqx.filter_grad(lambda h, x: jnp.mean((h(x, 32, 4) - x) ** 2))(backward, x)
    for path, cotangent in sorted(grads.log.items()):
        print(f"cotangent norm at {path}: {float(jnp.linalg.norm(cotangent)):.5f}")

    _, per_example = jax.vmap(lambda x: px.ForwardHook(model, log_fn=px.MeanLog(), where="encoder.mlp_2")(x, 32, 4))(x)
    print("mean latent activation per example:", per_example["encoder.mlp_2"])

    print(px.summary(model, x, 32, 4))

    # The decoder, ported to an Equinox MLP.
    decoder_only = px.from_function(lambda p, z: decoder(p, z, 32, 16), params["decoder"], layers=[zephyr.nets.linear])
    eqx_decoder = eqx.nn.MLP(4, 16, 32, 2, activation=jax.nn.relu, key=jax.random.key(2))
    mapping = {"0": "layers.0", "1": "layers.1", "2": "layers.2"}
    eqx_decoder = px.transfer_params(decoder_only, eqx_decoder, mapping)
    z = encoder(params["encoder"], x, 32, 4)
    difference = jnp.max(jnp.abs(jax.vmap(eqx_decoder)(z) - decoder_only(z)))
    print(f"zephyr decoder -> eqx.nn.MLP: max difference {float(difference):.2e}")


if __name__ == "__main__":
    main()
