"""Migrating Haiku models, and their logging, to Flax NNX and to Equinox.

A CNN+MLP: one logging setup (hooks + statistics) is used unchanged on all three; the
Haiku weights are copied into the ports with `px.transfer_params(..., inputs=...)`,
which verifies each port layer by layer; `px.compare` shows every layer equal; a
deliberately wrong port is pinpointed at the layer where it first diverges. Then a
transformer block with attention followed by an LSTM: the same workflow.
"""

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
from flax import nnx

import peex_interop as px

# -- the original, in Haiku -----------------------------------------------------------


def haiku_net(images):  # (batch, 8, 8, 1)
    x = jax.nn.relu(hk.Conv2D(8, 3, name="conv1")(images))
    x = jax.nn.relu(hk.Conv2D(8, 3, name="conv2")(x))
    x = hk.Flatten()(x)
    x = jax.nn.relu(hk.Linear(32, name="fc1")(x))
    return hk.Linear(10, name="fc2")(x)


# -- the NNX port -----------------------------------------------------------------------


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.convs = nnx.List([nnx.Conv(1, 8, (3, 3), rngs=rngs), nnx.Conv(8, 8, (3, 3), rngs=rngs)])
        self.hidden = nnx.Linear(8 * 8 * 8, 32, rngs=rngs)
        self.out = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, images):
        x = images
        for conv in self.convs:
            x = jax.nn.relu(conv(x))
        x = jax.nn.relu(self.hidden(x.reshape(x.shape[0], -1)))
        return self.out(x)


# -- the Equinox port (per example, channels first, vmapped over the batch) ---------------


class EquinoxNet(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    mlp: eqx.nn.MLP
    forget_relu: bool = eqx.field(static=True, default=False)

    def __init__(self, key, forget_relu=False):
        keys = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 8, 3, padding=1, key=keys[0])
        self.conv2 = eqx.nn.Conv2d(8, 8, 3, padding=1, key=keys[1])
        self.mlp = eqx.nn.MLP(8 * 8 * 8, 10, 32, depth=1, key=keys[2])
        self.forget_relu = forget_relu

    def __call__(self, images):
        def one(image):
            x = jax.nn.relu(self.conv1(jnp.transpose(image, (2, 0, 1))))
            x = self.conv2(x)
            if not self.forget_relu:  # the deliberate porting bug
                x = jax.nn.relu(x)
            return self.mlp(jnp.ravel(jnp.transpose(x, (1, 2, 0))))

        return jax.vmap(one)(images)


# -- one logging setup for all three ---------------------------------------------------------

LOG = px.StatsLog({"mean": px.MeanLog(), "std": px.StdLog(), "max": px.AbsMaxLog()})
WHERE = px.kind("conv", "linear")


def with_logging(model, rename=None):
    return px.ForwardHook(model, log_fn=LOG, where=WHERE, rename=rename)


# -- a transformer block and an LSTM, in Haiku ---------------------------------------------

WIDTH, HEADS, HIDDEN = 8, 2, 6


def haiku_sequence_model(tokens):  # (batch, time, WIDTH)
    h = hk.LayerNorm(-1, True, True, name="norm")(tokens)
    x = tokens + hk.MultiHeadAttention(HEADS, WIDTH // HEADS, w_init=hk.initializers.VarianceScaling(), name="attn")(
        h, h, h
    )
    x = x + hk.Linear(WIDTH, name="mlp_out")(jax.nn.gelu(hk.Linear(2 * WIDTH, name="mlp_in")(x)))
    lstm = hk.LSTM(HIDDEN, name="lstm")
    state = lstm.initial_state(x.shape[0])
    for t in range(x.shape[1]):
        out, state = lstm(x[:, t], state)
    return hk.Linear(3, name="head")(out)


class NnxSequenceModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(WIDTH, epsilon=1e-5, rngs=rngs)  # Haiku's epsilon
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=WIDTH, decode=False, rngs=rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs), jax.nn.gelu, nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs)
        )
        self.cell = nnx.LSTMCell(WIDTH, HIDDEN, rngs=rngs)
        self.head = nnx.Linear(HIDDEN, 3, rngs=rngs)

    def __call__(self, tokens):
        x = tokens + self.attn(self.norm(tokens))
        x = x + self.mlp(x)
        carry = (jnp.zeros((x.shape[0], HIDDEN)),) * 2  # (c, h)
        for t in range(x.shape[1]):
            carry, out = self.cell(carry, x[:, t])
        return self.head(out)


class EquinoxSequenceModel(eqx.Module):
    norm: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP
    cell: eqx.nn.LSTMCell
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        biases = dict(use_query_bias=True, use_key_bias=True, use_value_bias=True, use_output_bias=True)
        self.norm = eqx.nn.LayerNorm(WIDTH)
        self.attn = eqx.nn.MultiheadAttention(HEADS, WIDTH, key=keys[0], **biases)
        self.mlp = eqx.nn.MLP(WIDTH, WIDTH, 2 * WIDTH, depth=1, activation=jax.nn.gelu, key=keys[1])
        self.cell = eqx.nn.LSTMCell(WIDTH, HIDDEN, key=keys[2])
        self.head = eqx.nn.Linear(HIDDEN, 3, key=keys[3])

    def __call__(self, tokens):
        def block(x):  # one sequence
            h = jax.vmap(self.norm)(x)
            x = x + self.attn(h, h, h)
            return x + jax.vmap(self.mlp)(x)

        x = jax.vmap(block)(tokens)
        state = (jnp.zeros((x.shape[0], HIDDEN)),) * 2
        for t in range(x.shape[1]):
            state = jax.vmap(self.cell)(x[:, t], state)
        return jax.vmap(self.head)(state[0])


def migrate_sequence_model():
    tokens = jax.random.normal(jax.random.key(4), (2, 5, WIDTH))
    transformed = hk.without_apply_rng(hk.transform(haiku_sequence_model))
    original = px.from_haiku(transformed, transformed.init(jax.random.key(5), tokens))
    ports = {"nnx": px.from_nnx(NnxSequenceModel(nnx.Rngs(6))), "equinox": EquinoxSequenceModel(jax.random.key(7))}
    comparisons = {}
    for name, port in ports.items():
        alignment = px.align(original, port, tokens)
        # Verified: raises, naming the layer, if any aligned layer disagrees afterwards.
        port = px.transfer_params(original, port, alignment.mapping, inputs=tokens)
        comparisons[name] = px.compare(original, port, tokens, alignment=alignment)
        print(f"== transformer block + LSTM, Haiku -> {name}\n{comparisons[name]}")
    return comparisons


def main():
    images = jax.random.uniform(jax.random.key(0), (4, 8, 8, 1))
    transformed = hk.without_apply_rng(hk.transform(haiku_net))
    original = px.from_haiku(transformed, transformed.init(jax.random.key(1), images))
    ports = {
        "nnx": px.from_nnx(NnxNet(nnx.Rngs(2))),
        "equinox": EquinoxNet(jax.random.key(3)),
    }
    for name, port in ports.items():
        alignment = px.align(original, port, images)
        print(f"== Haiku -> {name}\n{alignment}")
        # inputs=: the convs' custom names (conv1, conv2) do not tell a conv from a
        # conv-transpose; a call does. The port is then verified layer by layer.
        port = px.transfer_params(original, port, alignment.mapping, inputs=images)
        comparison = px.compare(original, port, images, cotangents=True, alignment=alignment)
        print(comparison)
        # The port's logs carry the original's keys: dashboards keep working.
        _, log = with_logging(port, rename={b: a for a, b in alignment.mapping.items()})(images)
        _, original_log = with_logging(original)(images)
        print("same dashboard keys:", sorted(log) == sorted(original_log))
        ports[name] = port

    mapping = px.align(original, ports["equinox"], images).mapping
    # verify=False: verification would refuse this port, naming fc1; compare shows why.
    wrong = px.transfer_params(original, EquinoxNet(jax.random.key(3), forget_relu=True), mapping, inputs=images,
                               verify=False)
    comparison = px.compare(original, wrong, images)
    print("== a port that forgot an activation\n" + str(comparison))
    migrate_sequence_model()
    return comparison


if __name__ == "__main__":
    main()
