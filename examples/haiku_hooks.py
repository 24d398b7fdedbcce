"""Hooking a Haiku ResNet-style model and an LSTM through px.from_haiku."""

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp

import peex_interop as px


def cnn(x, is_training):
    x = hk.Conv2D(8, 3)(x)
    x = hk.BatchNorm(True, True, 0.9)(x, is_training)
    x = jax.nn.relu(x)
    return hk.Linear(10)(hk.Flatten()(x))


def main():
    transformed = hk.transform_with_state(cnn)
    x = jax.random.normal(jax.random.key(0), (4, 8, 8, 1))
    params, state = transformed.init(jax.random.key(1), x, True)
    model = px.from_haiku(transformed, params, state)

    hooked = px.ForwardHook(model, log_fn=px.MeanStdLog())
    (out, new_state), log = eqx.filter_jit(lambda h, x: h(x, True))(hooked, x)
    print("forward log (mean, std):")
    for path, (mean, std) in log.items():
        print(f"  {path:24s} mean={float(mean):+.3f} std={float(std):.3f}")
    model = model.with_state(new_state)

    hooked = px.BackwardHook(model, log_fn=px.MeanStdLog(), where=["conv2_d", "linear"]).init(x, True)
    grads = eqx.filter_grad(lambda h, x: jnp.mean(h(x, True)[0] ** 2))(hooked, x)
    print("backward log (mean, std of each output cotangent):")
    for path, (mean, std) in grads.log.items():
        print(f"  {path:24s} mean={float(mean):+.2e} std={float(std):.2e}")

    def unroll(xs):
        core = hk.LSTM(5)
        return hk.dynamic_unroll(core, xs, core.initial_state(xs.shape[1]))[0]

    t = hk.transform(unroll)
    xs = jnp.ones((6, 2, 3))
    lstm = px.from_haiku(t, t.init(jax.random.key(0), xs))
    _, log = px.ForwardHook(lstm, log_fn=px.IdentityLog(), where="lstm.linear")(xs)
    print("LSTM gate pre-activations per step:", log["lstm.linear"].shape)


if __name__ == "__main__":
    main()
