"""Train the same small CNN on scikit-learn's digits in Equinox, Haiku and Flax NNX with
the activation recorder on; one training loop serves all three (converted models are
eqx.Modules). Saves each library's plots as PNG under the output folder."""

import argparse
from pathlib import Path

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import peex_interop as px


class EquinoxCNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 8, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(8, 16, 3, padding=1, key=k2)
        self.head = eqx.nn.Linear(16 * 8 * 8, 10, key=k3)

    def __call__(self, images):  # (batch, 8, 8, 1), like the other two
        def one(image):
            x = jax.nn.relu(self.conv1(jnp.transpose(image, (2, 0, 1))))
            x = jax.nn.relu(self.conv2(x))
            return self.head(jnp.ravel(jnp.transpose(x, (1, 2, 0))))

        # Per example: the statistics of the layers inside are pooled over this vmap.
        return jax.vmap(one)(images)


def haiku_cnn(images):
    x = jax.nn.relu(hk.Conv2D(8, 3, name="conv1")(images))
    x = jax.nn.relu(hk.Conv2D(16, 3, name="conv2")(x))
    return hk.Linear(10, name="head")(hk.Flatten()(x))


class NnxCNN(nnx.Module):
    def __init__(self, rngs):
        self.conv1 = nnx.Conv(1, 8, (3, 3), padding="SAME", rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, (3, 3), padding="SAME", rngs=rngs)
        self.head = nnx.Linear(16 * 8 * 8, 10, rngs=rngs)

    def __call__(self, images):  # (batch, 8, 8, 1)
        x = jax.nn.relu(self.conv1(images))
        x = jax.nn.relu(self.conv2(x))
        return self.head(x.reshape(x.shape[0], -1))


def equinox_model(images):
    return EquinoxCNN(jax.random.key(0))


def haiku_model(images):
    transformed = hk.without_apply_rng(hk.transform(haiku_cnn))
    return px.from_haiku(transformed, transformed.init(jax.random.key(0), images))


def nnx_model(images):
    return px.from_nnx(NnxCNN(nnx.Rngs(0)))


MODELS = {"equinox": equinox_model, "haiku": haiku_model, "nnx": nnx_model}


def data():
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    return jnp.asarray(images), jnp.asarray(digits.target)


def train(model, images, labels, steps: int, every: int, out: Path):
    """The training loop shared by all libraries: hooks and recorder included."""
    # Statistics of the conv and linear layers, reduced inside the compiled step, one
    # per layer (pooled over the examples, also where the layers run per example).
    stats = px.activation_stats()
    hooked = px.ForwardHook(model, log_fn=stats, where=lambda path, m: "conv" in path or "head" in path)
    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(eqx.filter(hooked, eqx.is_inexact_array))
    recorder = px.Recorder(every=every, tensorboard_dir=out / "tensorboard")

    @eqx.filter_jit
    def step(hooked, opt_state, x, y, i):
        def loss(hooked):
            logits, log = hooked(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), log

        # One compiled step: the statistics are computed on recorded steps only.
        with recorder.when_due(i):
            (value, log), grads = eqx.filter_value_and_grad(loss, has_aux=True)(hooked)
        updates, opt_state = optimizer.update(grads, opt_state)
        return eqx.apply_updates(hooked, updates), opt_state, value, log

    key = jax.random.key(1)
    for i in recorder.track(range(steps)):
        key, sub = jax.random.split(key)
        batch = jax.random.choice(sub, len(images), (128,), replace=False)
        hooked, opt_state, value, log = step(hooked, opt_state, images[batch], labels[batch], jnp.asarray(i))
        recorder.record(i, log)
    recorder.close()
    # Without the hooks, compiled: statistics of the whole set are not wanted here.
    logits = eqx.filter_jit(hooked.model)(images)
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == labels))
    return hooked.model, recorder, float(value), accuracy


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "diagnostics")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=5)
    args = parser.parse_args(argv)
    images, labels = data()
    for library, make in MODELS.items():
        out = args.out / library
        out.mkdir(parents=True, exist_ok=True)
        model = make(images[:1])
        print(px.summary(model, images[:1]))
        _, recorder, loss, accuracy = train(model, images, labels, args.steps, args.every, out)
        layer = next(path for path in recorder.records[0] if "conv1" in path)
        recorder.plot_layer_stats(layer, out / "layer_stats.png")
        recorder.color_dim(layer, out / "color_dim.png")
        print(f"{library}: {len(recorder.records)} records, final loss {loss:.3f}, "
              f"train accuracy {accuracy:.2%}, plots in {out}")


if __name__ == "__main__":
    main()
