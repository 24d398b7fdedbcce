"""Small Equinox models shared by the tests, examples and benchmarks, and the tests'
tolerance check."""

import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


def close(a, b, tol=1e-5):
    """Assert `a` and `b` agree elementwise within `tol`, relative and absolute."""
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


@eqx.filter_jit
def _called(model, *args):
    return model(*args)


def jitted(model, *args):
    """`model(*args)` under `eqx.filter_jit` and `jax.checking_leaks()`."""
    with jax.checking_leaks():
        return _called(model, *args)


def nnx_scanned_stack(block: Callable[[Any], Any], steps: int, rngs: Any) -> Any:
    """An NNX module of `steps` blocks (`block(rngs)` each, stacked by `nnx.vmap`) run
    in turn by `nnx.scan` over `blocks`, the stacked attribute: NNX's own layout for a
    stack of layers. (flax imported here: this module serves the Equinox-only tests.)"""
    from flax import nnx

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.vmap(lambda key: block(nnx.Rngs(key)))(jax.random.split(rngs.params(), steps))

        def __call__(self, x):
            return nnx.scan(lambda c, m: m(c), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)

    return Stack(rngs)


def run_on_8_cpu_devices(script: str) -> list[str]:
    """Run `script` in a fresh Python with 8 simulated CPU devices (XLA fixes the
    device count at start-up), in the tests folder; assert that it succeeded and return
    the lines it printed."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout.split("\n")[:-1]


def while_hooked_elsewhere(hooked_call: Callable[[Callable], Any], plain_call: Callable[[], Any]) -> tuple:
    """Run `hooked_call(pause)` in another thread, where `pause` is a hook (or log) that
    blocks inside that hooked call, patches installed, and `plain_call()` in this thread
    meanwhile. Returns both results; an error of the hooked thread is raised here."""
    inside, release = threading.Event(), threading.Event()
    result: dict[str, Any] = {}

    def pause(value):
        inside.set()
        release.wait(30)
        return value

    def hooked_thread():
        try:
            result["hooked"] = hooked_call(pause)
        except BaseException as error:  # raised in the calling thread below
            result["error"] = error
        finally:
            inside.set()

    thread = threading.Thread(target=hooked_thread)
    thread.start()
    try:
        assert inside.wait(30)
        plain = plain_call()
    finally:
        release.set()
        thread.join(30)
    if "error" in result:
        raise result["error"]
    return result["hooked"], plain


class MLP(eqx.Module):
    """The peex README model."""

    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, in_features, width, out_features, *, key):
        key1, key2 = jax.random.split(key, 2)
        self.linear1 = eqx.nn.Linear(in_features, width, key=key1)
        self.linear2 = eqx.nn.Linear(width, out_features, key=key2)

    def __call__(self, x):
        return self.linear2(jax.nn.relu(self.linear1(x)))


class Block(eqx.Module):
    """Pre-norm transformer block on a (seq, dim) input."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim, heads, *, key):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attn = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, 2 * dim, depth=1, key=k2)

    def __call__(self, x):
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class Transformer(eqx.Module):
    """Embedding, a scanned stack of blocks built with `eqx.filter_vmap`, and a head."""

    embed: eqx.nn.Embedding
    blocks: Block
    head: eqx.nn.Linear
    num_blocks: int = eqx.field(static=True)

    def __init__(self, vocab, dim, heads, num_blocks, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=k1)
        keys = jax.random.split(k2, num_blocks)
        self.blocks = eqx.filter_vmap(lambda k: Block(dim, heads, key=k))(keys)
        self.head = eqx.nn.Linear(dim, vocab, key=k3)
        self.num_blocks = num_blocks

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def step(x, block_arrays):
            block = eqx.combine(block_arrays, static)
            return block(x), None

        x, _ = jax.lax.scan(step, x, dynamic)
        return jax.vmap(self.head)(x)


class Deep(eqx.Module):
    """Layers in a list, a dict, a Sequential and behind a helper method."""

    layers: list
    by_name: dict
    seq: eqx.nn.Sequential
    out: eqx.nn.Linear

    def __init__(self, *, key):
        keys = jax.random.split(key, 6)
        self.layers = [eqx.nn.Linear(3, 3, key=keys[0]), eqx.nn.Linear(3, 3, key=keys[1])]
        self.by_name = {"a": eqx.nn.Linear(3, 3, key=keys[2])}
        self.seq = eqx.nn.Sequential(
            [eqx.nn.Linear(3, 4, key=keys[3]), eqx.nn.Lambda(jax.nn.tanh), eqx.nn.Linear(4, 3, key=keys[4])]
        )
        self.out = eqx.nn.Linear(3, 2, key=keys[5])

    def helper(self, x):
        return self.by_name["a"](x)

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        x = self.helper(x)
        x = self.seq(x)
        return self.out(x)


class Normalised(eqx.Module):
    """Equinox's per-example BatchNorm: a collective over the vmap's axis name."""

    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __call__(self, x, state):
        h, state = self.bn(self.lin(x), state)
        return self.head(jax.nn.relu(h)), state


class BatchedNormalised(eqx.Module):
    """The Equinox idiom for a BatchNorm model: the vmap inside, its state out unbatched."""

    model: Normalised

    def __call__(self, xs, state):
        return jax.vmap(self.model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(xs, state)


def normalised(seed: int) -> tuple[Normalised, eqx.nn.State]:
    """`(Normalised model, its eqx.nn.State)`: Linear 3 -> 4, BatchNorm over the vmap
    axis "batch", Linear 4 -> 2, drawn from `seed`."""
    keys = jax.random.split(jax.random.key(seed), 2)
    return eqx.nn.make_with_state(Normalised)(
        eqx.nn.Linear(3, 4, key=keys[0]), eqx.nn.BatchNorm(4, axis_name="batch", mode="batch"),
        eqx.nn.Linear(4, 2, key=keys[1]),
    )


def slot_gradient_of_init_inside_the_vmap(model: Any, xs: Any) -> tuple[Any, Callable]:
    """For a per-example `model` whose layer `lin` feeds a collective over the vmap axis
    "batch" (a BatchNorm): assert that `px.BackwardHook.init` outside that vmap raises
    saying where to call it, call it there, and return `(gradient of lin's slot, loss)`.
    `loss(call)` is the sum of squares of `call` mapped over `xs` (of its output, where
    it returns its state too); the slot, closed over by that vmap, is shared by the
    examples."""
    import peex_interop as px  # the examples and benchmarks import this module too

    hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where="lin")
    try:
        hooked.init(xs[0])
    except px.HookError as error:
        assert re.search(r"outside the vmap.*batch.*filter_vmap", str(error)), error
    else:
        raise AssertionError("init outside the vmap binding the axis name did not raise")
    hooked = eqx.filter_vmap(lambda x: hooked.init(x), axis_name="batch", out_axes=None)(xs)

    def loss(call: Callable) -> Any:
        out = jax.vmap(call, axis_name="batch")(xs)
        return jnp.sum((out[0] if isinstance(out, tuple) else out) ** 2)

    return eqx.filter_jit(eqx.filter_grad(loss))(hooked).log["lin"], loss


def random_like(shapes, seed=0):
    """`shapes` with every `jax.ShapeDtypeStruct` replaced by NumPy draws: normals scaled
    by about 1/sqrt(fan-in) for floats, zeros otherwise.

    For a model built under `eqx.filter_eval_shape`, `jax.eval_shape` or `nnx.eval_shape`:
    eager initialisers compile an XLA program per parameter shape (seconds for a small
    transformer), and the tests need values, not an initialisation scheme.
    """
    rng = np.random.default_rng(seed)

    def draw(leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        if not np.issubdtype(leaf.dtype, np.floating):
            return jnp.asarray(np.zeros(leaf.shape, leaf.dtype))
        shape = leaf.shape
        # Libraries put the output axis first (Equinox) or last (Haiku, Flax).
        fan_in = np.prod(shape) / min(shape[0], shape[-1]) if len(shape) > 1 else 100.0
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), leaf.dtype)

    return jax.tree.map(draw, shapes)


def transformer(key=0, num_blocks=3):
    shapes = eqx.filter_eval_shape(
        Transformer, vocab=11, dim=8, heads=2, num_blocks=num_blocks, key=jax.random.key(key)
    )
    return random_like(shapes, key)


def tokens(key=1, seq=5):
    return jnp.asarray(np.random.default_rng(key).integers(0, 11, seq, np.int32))
