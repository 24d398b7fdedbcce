"""Speed of peex_interop's hooks against each library's own tools, measured in one run.

Method:

- Two models in each library (Equinox, Haiku, Flax NNX, Flax linen): an MLP of 12
  Linear layers of width 512 with relu on a batch of 64, and 6 pre-LN transformer
  blocks with the library's built-in attention (d 128, 4 heads, MLP 4d with gelu) on
  8 sequences of 64 (`FULL_SIZES`; `--quick` shrinks them, `QUICK_SIZES`); plus a tiny
  model (one Linear 4 -> 4) where dispatch dominates; and the Equinox MLP at width
  256 (`NARROW`) for the statistics' training step. Parameters are NumPy draws
  (`tests/models.py: random_like`), so that outputs can be compared; nothing is
  initialised eagerly.
- Every variant is a zero-argument call of a jitted function. Variants of one group
  (a library's model, the training steps, ...) are timed round-robin, one call of each
  per repetition in a shuffled order (fixed seed), so drifts in machine load hit all of
  them alike; each group gets a time budget from which its repetitions follow. Tables
  report medians; ratios compare variants of the same group. Every call ends with
  `jax.block_until_ready`; every function is called (traced, compiled) before timing.
- First calls (trace + lower, XLA compile, run) of a scanned transformer stack at two
  depths are timed in fresh processes (`benchmarks/first_call.py`; imports,
  construction and backend start-up excluded, persistent compilation cache off),
  variants alternating.
- Port rows: a linen LM (the Flax lm1b example's size) ported to its abstract NNX
  twin, each stage (transfer, verification, with cotangents) timed once on empty
  caches against raw first-call forwards and gradients of both models; and a port
  between two instances of an NNX LM of about 100M parameters built from its own
  layer classes (`OwnLM`, Gemma-shaped): the transfer against a plain copy of every
  parameter, the verification against a raw first-call forward of both models.
- Each hooked variant's output is compared with its library's raw output (max abs
  diff); the statistics' memory comes from `jax.eval_shape` of the hooked forward.
- The findings are computed from this run's medians, jaxprs and memory rows.

Usage: `python benchmarks/bench.py [--quick] [--out docs/benchmarks.md]` (`make bench`:
about 8 minutes on 2 CPU cores; `--quick`, a smoke test: about 3 minutes); `--only port`
(or `lm1b`, `same-class`) runs the port rows alone (the same-class rows at full size:
about a minute).
"""

import argparse
import contextlib
import dataclasses
import datetime
import gc
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import equinox as eqx
import flax
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import peex
from flax import nnx

import peex_interop as px

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from first_call import FORWARDS, WRAPPERS, scanned_forward, scanned_transformer

from models import random_like


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The models' sizes: the MLP's width and batch; the transformer's width, heads,
    sequence length, batch and number of blocks (at most 6)."""

    width: int
    mlp_batch: int
    dim: int
    heads: int
    seq: int
    batch: int
    blocks: int


# The models; `--quick` shrinks them so that a smoke run takes seconds.
FULL_SIZES = Sizes(width=512, mlp_batch=64, dim=128, heads=4, seq=64, batch=8, blocks=6)
QUICK_SIZES = Sizes(width=64, mlp_batch=8, dim=32, heads=4, seq=16, batch=2, blocks=2)
S = FULL_SIZES  # set once by `main`
DEPTH = 12  # the MLP's Linear layers
LIBRARIES = ("Equinox", "Haiku", "NNX", "linen")
COMPILE_DEPTHS = (4, 64)


@dataclasses.dataclass
class Variant:
    """A zero-argument jitted call, and how to read the model's output from its result."""

    call: Callable[[], Any]
    output: Callable[[Any], Any] = lambda result: result


def hooked_output(result):
    return result[0]


def inputs(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


class BareModule(eqx.Module):
    """The cheapest `eqx.Module` around a raw call's arguments: one field, and Python's
    own attribute lookup (as converted models have it). Under `jax.jit` it costs what
    flattening one Equinox pytree node costs, a Python function where a dict flattens
    in C++: the floor of any converted model's dispatch."""

    args: Any
    __getattribute__ = object.__getattribute__


def jitted_raw(name, apply, args, x):
    """A library's raw variants: "raw", `jax.jit(apply)(args, x)`; "raw (A/A)", the same
    call as a second variant (the group's noise floor); "raw eqx.filter_jit", `apply`
    itself under `eqx.filter_jit` (what that jit costs with no conversion); on the tiny
    model "bare module", `apply` under `jax.jit` reading `args` from a `BareModule`."""
    raw = Variant(partial(jax.jit(apply), args, x))
    calls = {"raw": raw, "raw (A/A)": raw}
    calls["raw eqx.filter_jit"] = Variant(partial(eqx.filter_jit(apply), args, x))
    if name == "tiny":
        bare = jax.jit(lambda module, x: apply(module.args, x))
        calls["bare module"] = Variant(partial(bare, BareModule(args), x))
    return calls


# ---------------------------------------------------------------- Equinox models


class EqxMLP(eqx.Module):
    """Twelve Linear layers as depth-1 attributes (`l0` ... `l11`): peex 0.0.3 hooks only
    the model's own attributes, so this layout lets it log every layer."""

    l0: eqx.nn.Linear
    l1: eqx.nn.Linear
    l2: eqx.nn.Linear
    l3: eqx.nn.Linear
    l4: eqx.nn.Linear
    l5: eqx.nn.Linear
    l6: eqx.nn.Linear
    l7: eqx.nn.Linear
    l8: eqx.nn.Linear
    l9: eqx.nn.Linear
    l10: eqx.nn.Linear
    l11: eqx.nn.Linear

    def __init__(self, *, key):
        for i, k in enumerate(jax.random.split(key, DEPTH)):
            setattr(self, f"l{i}", eqx.nn.Linear(S.width, S.width, key=k))

    def __call__(self, x):
        for i in range(DEPTH):
            x = jax.nn.relu(getattr(self, f"l{i}")(x))
        return x


class EqxBlock(eqx.Module):
    """Pre-LN block on one (seq, dim) sequence: `eqx.nn.MultiheadAttention`, then a
    4x gelu MLP, each with a residual."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(S.dim), eqx.nn.LayerNorm(S.dim)
        self.attn = eqx.nn.MultiheadAttention(S.heads, S.dim, key=k1)
        self.fc1 = eqx.nn.Linear(S.dim, 4 * S.dim, key=k2)
        self.fc2 = eqx.nn.Linear(4 * S.dim, S.dim, key=k3)

    def __call__(self, x):
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(h)))


class EqxTransformer(eqx.Module):
    """`S.blocks` `EqxBlock`s as depth-1 attributes (what peex 0.0.3 can hook), run in
    turn; the attributes past `S.blocks` are `None`."""

    b0: EqxBlock | None
    b1: EqxBlock | None
    b2: EqxBlock | None
    b3: EqxBlock | None
    b4: EqxBlock | None
    b5: EqxBlock | None

    def __init__(self, *, key):
        for i, k in enumerate(jax.random.split(key, 6)):
            setattr(self, f"b{i}", EqxBlock(key=k) if i < S.blocks else None)

    def __call__(self, x):
        for i in range(S.blocks):
            x = getattr(self, f"b{i}")(x)
        return x


class EqxTiny(eqx.Module):
    lin: eqx.nn.Linear

    def __init__(self, *, key):
        self.lin = eqx.nn.Linear(4, 4, key=key)

    def __call__(self, x):
        return self.lin(x)


EQX_MODELS = {"MLP": EqxMLP, "transformer": EqxTransformer, "tiny": EqxTiny}


def input_shape(name, batch=None, seq=None):
    """The model's input shape, batch first (every library's); `batch` and `seq`
    override the transformer's."""
    return {
        "MLP": (S.mlp_batch, S.width),
        "transformer": (batch or S.batch, seq or S.seq, S.dim),
        "tiny": (1, 4),
    }[name]


def forward(batched, axis_name=None):
    """`m(x)`, under `jax.vmap` over the batch for per-example (Equinox) models."""
    if batched:
        return lambda m, x: jax.vmap(m, axis_name=axis_name)(x)
    return lambda m, x: m(x)


def equinox_variants(name, x):
    """`(model, batched, variants)`: the Equinox model (per-example, run under
    `jax.vmap`), its raw call and peex 0.0.3's log of every layer."""
    model = random_like(eqx.filter_eval_shape(lambda: EQX_MODELS[name](key=jax.random.key(0))))
    fwd = eqx.filter_jit(forward(True))
    return model, True, {
        "raw": Variant(partial(fwd, model, x)),
        "native log": Variant(
            partial(fwd, peex.ForwardHook(model, log_fn=peex.IdentityLog()), x), hooked_output
        ),
    }


# ---------------------------------------------------------------- Haiku models


def haiku_mlp(x):
    return hk.nets.MLP([S.width] * DEPTH, activate_final=True, name="mlp")(x)


def haiku_block(x):
    ln = partial(hk.LayerNorm, -1, create_scale=True, create_offset=True)
    attention = hk.MultiHeadAttention(
        num_heads=S.heads, key_size=S.dim // S.heads, w_init=hk.initializers.VarianceScaling(),
        name="attn",
    )
    h = ln(name="ln_attn")(x)
    x = x + attention(h, h, h)
    h = ln(name="ln_mlp")(x)
    return x + hk.nets.MLP([4 * S.dim, S.dim], activation=jax.nn.gelu, name="mlp")(h)


def haiku_transformer(x):
    # A Python loop of named blocks: the native baseline's interceptor records into a
    # Python dict, which cannot take values out of a layer_stack's scan.
    for i in range(S.blocks):
        x = hk.to_module(haiku_block)(name=f"block_{i}")(x)
    return x


HAIKU_MODELS = {"MLP": haiku_mlp, "transformer": haiku_transformer, "tiny": lambda x: hk.Linear(4)(x)}


def native_haiku_log(transformed):
    """Haiku's own way to log every layer: `apply` under `hk.intercept_methods`,
    recording each module's `__call__` output by its Haiku name."""

    def apply(params, x):
        log = {}

        def record(next_f, args, kwargs, context):
            out = next_f(*args, **kwargs)
            if context.method_name == "__call__":
                log[context.module.module_name] = out
            return out

        with hk.intercept_methods(record):
            out = transformed.apply(params, x)
        return out, log

    return jax.jit(apply)


def haiku_variants(name, x):
    """`(px.from_haiku(...), batched, variants)`: raw = `jax.jit(transformed.apply)`."""
    transformed = hk.without_apply_rng(hk.transform(HAIKU_MODELS[name]))
    params = random_like(jax.eval_shape(transformed.init, jax.random.key(0), x))
    return px.from_haiku(transformed, params), False, jitted_raw(name, transformed.apply, params, x) | {
        "native log": Variant(partial(native_haiku_log(transformed), params, x), hooked_output),
    }


# ---------------------------------------------------------------- Flax NNX models


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(S.width, S.width, rngs=rngs) for _ in range(DEPTH)])

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.ln_attn = nnx.LayerNorm(S.dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(S.heads, S.dim, decode=False, rngs=rngs)
        self.ln_mlp = nnx.LayerNorm(S.dim, rngs=rngs)
        self.fc1 = nnx.Linear(S.dim, 4 * S.dim, rngs=rngs)
        self.fc2 = nnx.Linear(4 * S.dim, S.dim, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln_attn(x))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln_mlp(x))))


class NnxTransformer(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(S.blocks)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class NnxTiny(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


NNX_MODELS = {"MLP": NnxMLP, "transformer": NnxTransformer, "tiny": NnxTiny}


def nnx_variants(name, x):
    """`(px.from_nnx(...), batched, variants)`: raw = `jax.jit` of a split/merge call."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: NNX_MODELS[name](nnx.Rngs(0))))
    state = random_like(state)
    module = nnx.merge(graphdef, state)

    def capture(state, x):
        module = nnx.merge(graphdef, state)
        return nnx.capture(module, nnx.Intermediate, method_outputs=nnx.Intermediate)(x)

    raw = jitted_raw(name, lambda s, x: nnx.merge(graphdef, s)(x), state, x)
    return px.from_nnx(module), False, raw | {
        "native log": Variant(partial(jax.jit(capture), state, x), hooked_output),
    }


# ---------------------------------------------------------------- Flax linen models


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(DEPTH):
            x = jax.nn.relu(nn.Dense(S.width)(x))
        return x


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="ln_attn")(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=S.heads, qkv_features=S.dim, name="attn")(h)
        h = nn.LayerNorm(name="ln_mlp")(x)
        return x + nn.Dense(S.dim, name="fc2")(jax.nn.gelu(nn.Dense(4 * S.dim, name="fc1")(h)))


class LinenTransformer(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(S.blocks):
            x = LinenBlock(name=f"block_{i}")(x)
        return x


class LinenTiny(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="lin")(x)


LINEN_MODELS = {"MLP": LinenMLP, "transformer": LinenTransformer, "tiny": LinenTiny}


def linen_variants(name, x):
    """`(px.from_linen(...), batched, variants)`: raw = `jax.jit(module.apply)`."""
    module = LINEN_MODELS[name]()
    variables = random_like(jax.eval_shape(module.init, jax.random.key(0), x))
    capture = partial(module.apply, capture_intermediates=True, mutable=["intermediates"])
    return px.from_linen(module, variables), False, jitted_raw(name, module.apply, variables, x) | {
        "native log": Variant(partial(jax.jit(capture), variables, x), hooked_output),
    }


BUILDERS = {
    "Equinox": equinox_variants,
    "Haiku": haiku_variants,
    "NNX": nnx_variants,
    "linen": linen_variants,
}


def forward_variants(library, name):
    """Variant name -> `Variant`, for this library's model: its own jitted call ("raw",
    for `jax.jit` libraries also "raw (A/A)" and on the tiny model "bare module":
    `jitted_raw`) and log-everything mechanism ("native log"), and ours on the converted model
    (Equinox: the model itself, so that its "unhooked" repeats "raw"), unhooked and
    hooked, under `eqx.filter_jit` and `jax.jit`."""
    x = inputs(input_shape(name))
    converted, batched, calls = BUILDERS[library](name, x)
    fwd = forward(batched)
    jits = {"": eqx.filter_jit(fwd)}
    # Equinox modules hold non-array leaves that `jax.jit` cannot take (the attention's
    # dropout flags): they run under `eqx.filter_jit` only.
    if library != "Equinox":
        jits[" jax.jit"] = jax.jit(fwd)
    for suffix, jit in jits.items():
        calls[f"unhooked{suffix}"] = Variant(partial(jit, converted, x))
        calls[f"identity{suffix}"] = Variant(partial(jit, px.ForwardHook(converted), x), hooked_output)
    # Like for like: under the native log's own jit. With a dozen outputs, the same
    # program under `eqx.filter_jit` and under `jax.jit` measured up to 15% apart in one
    # run and not in the next, for the native log as for ours.
    calls["log"] = Variant(
        partial(jits.get(" jax.jit", jits[""]), px.ForwardHook(converted, log_fn=px.IdentityLog()), x),
        hooked_output,
    )
    return calls


# ---------------------------------------------------------------- statistics


def stats_log(histogram, axis_name=None):
    """`px.activation_stats()` (mean, std, near-zero, 40-bin histogram), or without its
    histogram."""
    stats = px.activation_stats(axis_name=axis_name)
    if histogram:
        return stats
    return px.StatsLog({k: log for k, log in stats.logs.items() if k != "hist"})


def stats_forward(batched):
    """The hooked forward returning `(output, statistics)`: per-example models run under
    `jax.vmap(axis_name="batch")` and their statistics are pooled over the batch."""

    def run(model, x):
        if not batched:
            return model(x)
        out, log = jax.vmap(model, axis_name="batch")(x)
        return out, px.pool_stats(log, 1)

    return run


def train_step(optimizer, batched, hooked, recorder=None):
    """One jitted training step: forward, grad of the mean squared output, adam update;
    returns the updated model and optimizer state, and the statistics (hooked). With a
    `recorder`, the step takes the step number (an array: decided under `lax.cond`) or
    `recorder.due(i)` (a Python bool, static: two programs) and computes the statistics
    only on due steps."""
    run = stats_forward(batched) if hooked else forward(batched)

    def loss(model, x):
        out, log = run(model, x) if hooked else (run(model, x), {})
        return jnp.mean(out**2), log

    @eqx.filter_jit
    def step(model, opt_state, x, number=None):
        if recorder is None:
            due = contextlib.nullcontext()
        else:
            due = recorder.when(number) if isinstance(number, bool) else recorder.when_due(number)
        with due:
            (_, log), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model, x)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, log

    return step


def converted_model(library, name, batch=None, seq=None):
    """`(converted model, input, batched)`, the input at this batch and sequence length
    (else the model's own); Equinox models are their own converted model."""
    x = inputs(input_shape(name, batch, seq))
    converted, batched, _ = BUILDERS[library](name, x)
    return converted, x, batched


def train_variants(library):
    """`(steps, ten steps)`: training steps on the MLP, plain (the unhooked model), with
    `px.activation_stats()` on every layer, and without its histogram; and ten steps
    with statistics on every 10th against ten plain steps."""
    model, x, batched = converted_model(library, "MLP")
    optimizer = optax.adam(1e-3)
    axis_name = "batch" if batched else None
    models = {
        "train plain": model,
        "train stats": px.ForwardHook(model, log_fn=stats_log(True, axis_name)),
        "train stats no hist": px.ForwardHook(model, log_fn=stats_log(False, axis_name)),
    }
    calls = {}
    for variant, model_ in models.items():
        opt_state = optimizer.init(eqx.filter(model_, eqx.is_inexact_array))
        step = train_step(optimizer, batched, variant != "train plain")
        # The updated parameters are the step's output: statistics must not change them.
        calls[variant] = Variant(partial(step, model_, opt_state, x), train_output)
    return calls, every_ten_variants(models["train stats"], calls, x, batched, optimizer)


def train_output(result):
    return eqx.filter(result[0], eqx.is_inexact_array)


# The smaller MLP (12 x Linear(256), batch 64): a per-layer fixed cost of the
# statistics, hidden by the 512-wide model's larger step, shows on it.
NARROW = 256


def narrow_train_variants():
    """The Equinox training steps of `train_variants` (plain, statistics with and
    without histogram) on the MLP of width `NARROW` (`--quick`: its own width, if
    smaller)."""
    global S
    wide = S
    S = dataclasses.replace(S, width=min(NARROW, S.width))
    try:
        return train_variants("Equinox")[0], f"Equinox MLP {S.width}"
    finally:
        S = wide


# How `every=10` is run: one compiled step deciding under `lax.cond`, or on the host.
EVERY_TEN_TEXT = (
    "ten calls of one compiled statistics step that computes them only on due steps "
    "(`with recorder.when_due(step):` around the loss, `step` an array: `lax.cond`), "
    "`px.Recorder(every=10)`; or decided on the host (`with recorder.when(due):`, `due = "
    "recorder.due(step)` a Python bool, static under `eqx.filter_jit`: one program for due "
    "steps, one without statistics)"
)


def every_ten_variants(hooked, calls, x, batched, optimizer):
    """Ten training steps with statistics on every 10th (`Recorder.when_due`) against
    ten plain steps (`calls["train plain"]`): decided inside one compiled step (the step
    number an array: `lax.cond`), or on the host (`recorder.due(i)`, a Python bool, static under
    `eqx.filter_jit`: one program for due steps, one for the others). And ten off-steps
    and ten due steps of each, the parts of the ten."""
    recorder = px.Recorder(every=10)
    opt_state = optimizer.init(eqx.filter(hooked, eqx.is_inexact_array))
    step = partial(train_step(optimizer, batched, True, recorder), hooked, opt_state, x)
    traced = [partial(step, jnp.asarray(i)) for i in range(10)]
    on_host = [partial(step, recorder.due(i)) for i in range(10)]

    def ten(steps):
        return [step() for step in steps][-1]

    return {
        "10 steps, stats every 10": Variant(partial(ten, traced), train_output),
        "10 plain steps": Variant(partial(ten, [calls["train plain"].call] * 10), train_output),
        "10 off-steps": Variant(partial(ten, traced[1:2] * 10), train_output),
        "10 due steps": Variant(partial(ten, traced[:1] * 10), train_output),
        "10 steps, stats every 10, on the host": Variant(partial(ten, on_host), train_output),
        "10 off-steps, on the host": Variant(partial(ten, on_host[1:2] * 10), train_output),
        "10 due steps, on the host": Variant(partial(ten, on_host[:1] * 10), train_output),
    }


def memory_shapes():
    """(batch, seq) of the statistics-memory rows: seq halved, as given, batch 8x."""
    return (S.batch, S.seq // 2), (S.batch, S.seq), (8 * S.batch, S.seq)


def stats_memory(library, batch, seq):
    """`(bytes, layers)` of the statistics of one transformer forward at this batch and
    sequence length (from `eqx.filter_eval_shape`: exact, nothing runs): their bytes,
    and the layers whose mean is not one number per output (kept per example or per
    position)."""
    model, x, batched = converted_model(library, "transformer", batch, seq)
    hooked = px.ForwardHook(model, log_fn=stats_log(True, "batch" if batched else None))
    _, log = eqx.filter_eval_shape(stats_forward(batched), hooked, x)
    size = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(log))
    return size, [path for path, stats in log.items() if any(m.ndim for m in jax.tree.leaves(stats["mean"]))]


def memory_rows():
    """`(library -> bytes at each of memory_shapes(), library -> the layers not pooled
    to one statistic at the last shape)`."""
    memory, unpooled = {}, {}
    for library in LIBRARIES:
        measured = [stats_memory(library, *shape) for shape in memory_shapes()]
        memory[library], unpooled[library] = [size for size, _ in measured], measured[-1][1]
    return memory, unpooled


# ---------------------------------------------------------------- timing


def max_abs_diff(a, b):
    """`(max |a - b|, max |b|)` over the leaves of two pytrees of one structure: the
    second shows the difference is measured on real values."""
    leaves = list(zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    diff = max(float(jnp.max(jnp.abs(jnp.asarray(x) - jnp.asarray(y)))) for x, y in leaves)
    return diff, max(float(jnp.max(jnp.abs(jnp.asarray(y)))) for _, y in leaves)


def interleaved(variants, budget, min_reps, max_reps):
    """`(medians, outputs, reps)`: median seconds per call of each variant, timed
    round-robin (shuffled order per repetition, fixed seed), as many repetitions as
    fit in `budget` seconds, within `[min_reps, max_reps]`; and each variant's model
    output from its first (compiling) call."""
    outputs = {k: v.output(jax.block_until_ready(v.call())) for k, v in variants.items()}
    start = time.perf_counter()
    for v in variants.values():
        jax.block_until_ready(v.call())
    per_rep = time.perf_counter() - start
    reps = int(min(max_reps, max(min_reps, budget / max(per_rep, 1e-9))))
    names, rng = list(variants), random.Random(0)
    samples = {k: [] for k in names}
    for _ in range(reps):
        rng.shuffle(names)
        for k in names:
            begin = time.perf_counter()
            jax.block_until_ready(variants[k].call())
            samples[k].append(time.perf_counter() - begin)
    return {k: statistics.median(v) for k, v in samples.items()}, outputs, reps


@dataclasses.dataclass
class Budget:
    """Seconds of timing per group, and the repetitions' bounds."""

    forward: float
    tiny: float
    train: float
    first_call_reps: int
    min_reps: int = 3
    max_reps: int = 5000


# About 5.5 minutes on 2 CPU cores: 3 fresh processes per first-call variant (~90 s),
# traces and compilations (~60 s), and these timing budgets (~170 s).
FULL = Budget(forward=10.0, tiny=3.0, train=15.0, first_call_reps=3)
QUICK = Budget(forward=0.1, tiny=0.1, train=0.1, first_call_reps=1, min_reps=2)


def first_calls(reps, parallel):
    """(variant, depth) -> median `[lower, compile, run]` seconds over `reps` fresh
    processes (`first_call.py`) per variant, variants alternating; with `parallel`
    (smoke runs) all processes run at once."""
    script = str(Path(__file__).with_name("first_call.py"))
    sizes = [str(n) for n in (S.dim, S.heads, S.batch, S.seq)]
    runs = [(v, d) for _ in range(reps) for d in COMPILE_DEPTHS for v in WRAPPERS]
    samples = {run: [] for run in runs}

    def start(run):
        command = [sys.executable, script, run[0], str(run[1]), *sizes]
        return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)

    def finish(run, process):
        out, _ = process.communicate()
        if process.returncode:
            raise RuntimeError(f"first call {run} failed (exit {process.returncode})")
        samples[run].append([float(t) for t in out.split()[-3:]])

    if parallel:
        for run, process in [(run, start(run)) for run in runs]:
            finish(run, process)
    else:
        for run in runs:
            finish(run, start(run))
    return {k: [statistics.median(part) for part in zip(*v, strict=True)] for k, v in samples.items()}


# ---------------------------------------------------------------- jaxprs


def jitted_jaxpr(call):
    """The jaxpr of the one jitted function a zero-argument call runs."""
    (eqn,) = [e for e in jax.make_jaxpr(call)().jaxpr.eqns if e.primitive.name in ("pjit", "jit")]
    return eqn.params["jaxpr"].jaxpr


def count_equations(jaxpr):
    """Equations, inlining nested jit/custom-derivative calls and counting the bodies of
    control flow once."""
    total = 0
    for eqn in jaxpr.eqns:
        bodies = [getattr(v, "jaxpr", v) for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
        inline = eqn.primitive.name in ("pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call")
        total += sum(count_equations(b) for b in bodies) + (0 if inline and bodies else 1)
    return total


def jaxpr_size(call):
    """(inputs, outputs, equations, output values) of the jitted function a call runs."""
    jaxpr = jitted_jaxpr(call)
    values = sum(math.prod(v.aval.shape) for v in jaxpr.outvars)
    return len(jaxpr.invars), len(jaxpr.outvars), count_equations(jaxpr), values


def flatten_micros(tree, reps=2000):
    """Median µs of `jax.tree.flatten(tree)`: what every jitted call pays to find its
    inputs."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.tree.flatten(tree)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


# ---------------------------------------------------------------- rows


@dataclasses.dataclass
class Row:
    """One table row: `value` is a ratio, or a difference in seconds (`micros`); `why`,
    where this run measured what explains the value, says so with those numbers."""

    section: str
    label: str
    model: str
    variant: str
    baseline: str
    value: float
    target: float | None
    micros: bool = False
    why: str = ""

    @property
    def status(self):
        if self.target is None:
            return "report"
        if self.value <= self.target:
            return "ok"
        if self.micros:
            return f"over by {(self.value - self.target) * 1e6:.1f} µs"
        return f"over by {100 * (self.value / self.target - 1):.0f}%"

    @property
    def value_text(self):
        return f"{self.value * 1e6:+.1f} µs" if self.micros else f"{self.value:.3f}"

    @property
    def target_text(self):
        if self.target is None:
            return "-"
        return f"<= {self.target * 1e6:.0f} µs" if self.micros else f"<= {self.target:.2f}"


def fmt(seconds):
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} µs"


def signed(seconds):
    return ("-" if seconds < 0 else "+") + fmt(abs(seconds))


def ratio_row(section, label, model, medians, variant, baseline, target, why=""):
    if variant not in medians or baseline not in medians:
        return None
    return Row(section, label, model, fmt(medians[variant]), fmt(medians[baseline]),
               medians[variant] / medians[baseline], target, why=why)


def micros_row(section, label, model, medians, variant, baseline, target, why=""):
    if variant not in medians or baseline not in medians:
        return None
    return Row(section, label, model, fmt(medians[variant]), fmt(medians[baseline]),
               medians[variant] - medians[baseline], target, micros=True, why=why)


def flatten_text(flatten):
    """`jax.tree.flatten` of each tiny call's arguments, from `run`'s `flatten`."""
    return "`jax.tree.flatten` of the call's arguments: " + ", ".join(
        f"{name} {micros:.2f} µs" for name, (_, micros) in flatten.items()
    )


def dispatch_whys(library, name, steady, flatten):
    """`(eqx.filter_jit row's why, jax.jit row's why)` for a converted model, from this
    run: `eqx.filter_jit`'s own cost (the raw call under it, the same model under
    `jax.jit`; on the tiny model, Equinox's raw model too), and on the tiny model the
    floor, the bare module."""
    m = steady[library, name]
    filter_jit = (f"eqx.filter_jit's own cost: the raw call itself under eqx.filter_jit costs "
                  f"{m['raw eqx.filter_jit'] / m['raw']:.3f}x; the same converted model under jax.jit "
                  f"costs {fmt(m['unhooked jax.jit'])} (eqx.filter_jit: "
                  f"{signed(m['unhooked'] - m['unhooked jax.jit'])})")
    if name != "tiny":
        return filter_jit, ""
    filter_jit += (f"; Equinox's own tiny model costs {fmt(steady['Equinox', 'tiny']['raw'])} "
                   f"under eqx.filter_jit")
    jit = (f"the floor: a bare eqx.Module around the raw call's arguments costs "
           f"{m['bare module'] / m['raw']:.3f}x the raw call ({signed(m['bare module'] - m['raw'])}), "
           f"ours {m['unhooked jax.jit'] / m['bare module']:.3f}x the floor; "
           + flatten_text(flatten[library]))
    return filter_jit, jit


def forward_rows(library, name, steady, flatten, sizes):
    medians, model = steady[library, name], f"{library} {name}"
    # peex 0.0.3 logs the transformer's six blocks only, ours every layer: reported.
    like_for_like = library != "Equinox" or name == "MLP"
    native = {"Equinox": "peex 0.0.3 IdentityLog", "Haiku": "hk.intercept_methods",
              "NNX": "nnx.capture", "linen": "capture_intermediates"}[library]
    rows = []
    if name != "tiny":
        aa = medians["unhooked" if library == "Equinox" else "raw (A/A)"] / medians["raw"]
        why = f"the raw call timed twice gives {aa:.3f}"
        if (model, "log") in sizes:  # jaxprs are sized for the MLPs only
            ours, theirs = sizes[model, "log"], sizes[model, "native log"]
            why = (f"jaxprs: ours {ours[2]} equations returning {ours[3]:,} values, the native log "
                   f"{theirs[2]} returning {theirs[3]:,}; " + why)
        rows.append(ratio_row("log-everything", f"px IdentityLog / {native}", model, medians,
                              "log", "native log", 1.05 if like_for_like else None, why))
    # Equinox's "unhooked" is its raw call again.
    rows.append(ratio_row("dispatch", "A/A: the raw call timed twice (noise floor)", model, medians,
                          "unhooked" if library == "Equinox" else "raw (A/A)", "raw", None))
    if library != "Equinox":
        filter_jit, jit = dispatch_whys(library, name, steady, flatten)
        rows += [
            ratio_row("dispatch", "unhooked converted, eqx.filter_jit / raw jitted call",
                      model, medians, "unhooked", "raw", 1.05, filter_jit),
            ratio_row("dispatch", "unhooked converted, eqx.filter_jit / raw call under eqx.filter_jit",
                      model, medians, "unhooked", "raw eqx.filter_jit", 1.05),
            ratio_row("dispatch", "unhooked converted, jax.jit / raw jitted call", model,
                      medians, "unhooked jax.jit", "raw", 1.05, jit),
        ]
    if name == "tiny" and library != "Equinox":
        rows += [
            ratio_row("dispatch", "bare eqx.Module around the params, jax.jit / raw jitted call",
                      model, medians, "bare module", "raw", None, flatten_text(flatten[library])),
            ratio_row("dispatch", "unhooked converted, jax.jit / bare eqx.Module around the params",
                      model, medians, "unhooked jax.jit", "bare module", 1.05),
        ]
    # A few µs are measurable only where the call is all dispatch; on the bigger models
    # the difference is reported, within the A/A noise.
    target = 5e-6 if name == "tiny" else None
    rows += [
        micros_row("dispatch", "hook wrapper: identity-hooked - unhooked, eqx.filter_jit",
                   model, medians, "identity", "unhooked", target),
        micros_row("dispatch", "hook wrapper: identity-hooked - unhooked, jax.jit", model,
                   medians, "identity jax.jit", "unhooked jax.jit", target),
    ]
    return [r for r in rows if r is not None]


def train_rows(library, medians, sizes):
    """The statistics rows of one library, each with what this run measured of its
    parts: ten off-steps and ten due steps of `Recorder.when_due` (decided in the
    compiled step, or on the host) against ten plain steps."""
    model = f"{library} MLP"
    plain = medians["10 plain steps"]
    off, due, host_off, host_due = (
        medians[f"10 {v}"] / plain
        for v in ("off-steps", "due steps", "off-steps, on the host", "due steps, on the host")
    )
    outputs = sizes[model, "train stats"][1] - sizes[model, "train plain"][1]
    histogram = medians["train stats"] - medians["train stats no hist"]
    rows = [
        ratio_row("statistics", "train step, activation_stats without histogram / plain",
                  model, medians, "train stats no hist", "train plain", 1.05,
                  f"with the statistics skipped (the hooks, the log's {outputs} packed outputs of zeros) a step "
                  f"costs {host_off:.3f}x plain; the rest is computing mean, std, near-zero"),
        ratio_row("statistics", "train step, activation_stats with histogram / plain",
                  model, medians, "train stats", "train plain", 1.25,
                  f"the histograms add {histogram / medians['train plain']:.1%} of the plain step: "
                  f"{histogram / DEPTH * 1e6:.0f} µs per layer of {S.mlp_batch * S.width:,} values"),
        ratio_row("statistics", "10 train steps, stats every 10 in one compiled step "
                  "(Recorder.when_due(array): lax.cond) / 10 plain",
                  model, medians, "10 steps, stats every 10", "10 plain steps", 1.03,
                  f"ten off-steps cost {off:.3f}x ten plain steps, ten due steps {due:.3f}x: "
                  f"(9 x {off:.3f} + {due:.3f}) / 10 = {(9 * off + due) / 10:.3f}; skipped on the host (no "
                  f"lax.cond) an off-step costs {host_off:.3f}x: each layer's lax.cond takes its output, which "
                  "XLA then stores where it would fuse it into the next operation (one extra fusion per layer)"),
        ratio_row("statistics", "10 train steps, stats every 10 decided on the host "
                  "(Recorder.when(due): two programs) / 10 plain",
                  model, medians, "10 steps, stats every 10, on the host", "10 plain steps", 1.03,
                  f"ten off-steps cost {host_off:.3f}x ten plain steps, ten due steps {host_due:.3f}x: "
                  f"(9 x {host_off:.3f} + {host_due:.3f}) / 10 = {(9 * host_off + host_due) / 10:.3f}"),
    ]
    return [r for r in rows if r is not None]


def narrow_rows(model, medians):
    """The two statistics rows of the narrow MLP's training step."""
    histogram = medians["train stats"] - medians["train stats no hist"]
    values = S.mlp_batch * min(NARROW, S.width)
    return [
        ratio_row("statistics", "train step, activation_stats without histogram / plain",
                  model, medians, "train stats no hist", "train plain", 1.05,
                  f"a step of {medians['train plain'] * 1e3:.2f} ms: per layer, mean, std and near-zero "
                  f"cost {(medians['train stats no hist'] - medians['train plain']) / DEPTH * 1e6:.0f} µs"),
        ratio_row("statistics", "train step, activation_stats with histogram / plain",
                  model, medians, "train stats", "train plain", 1.25,
                  f"the histograms add {histogram / medians['train plain']:.1%} of the plain step: "
                  f"{histogram / DEPTH * 1e6:.0f} µs per layer of {values:,} values"),
    ]


def memory_table_rows(memory):
    rows = []
    (b_short, s_short), (_, s_long), (b_long, _) = memory_shapes()
    for library, (short, base, wide) in memory.items():
        model = f"{library} transformer"
        rows.append(Row("statistics", f"stats bytes per step, batch {b_long} / batch {b_short}",
                        model, f"{wide:,} B", f"{base:,} B", wide / base, 1.0))
        rows.append(Row("statistics", f"stats bytes per step, seq {s_long} / seq {s_short}",
                        model, f"{base:,} B", f"{short:,} B", base / short, 1.0))
    return rows


def compile_rows(first, sizes):
    """The first-call rows; the log-hooked ones say what returning the log's values
    costs a hand-written forward pass that returns the same values."""
    rows = []
    total = {k: sum(v) for k, v in first.items()}
    values = {depth: sizes[f"scanned L={depth}", "log"][3] for depth in COMPILE_DEPTHS}
    for depth in COMPILE_DEPTHS:
        for variant in ("identity", "log"):
            why = "" if variant == "identity" else (
                f"returning the log's {values[depth]:,} values (raw: {sizes[f'scanned L={depth}', 'raw'][3]:,}): "
                f"a hand-written forward pass returning the same values costs "
                f"{total['by_hand', depth] / total['raw', depth]:.2f}x raw"
            )
            rows.append(Row("compile", f"first call, {variant}-hooked / raw, L = {depth}",
                            f"Equinox scanned transformer L={depth}",
                            fmt(total[variant, depth]), fmt(total["raw", depth]),
                            total[variant, depth] / total["raw", depth], 1.3, why=why))
    for depth in COMPILE_DEPTHS:
        rows.append(Row("compile", f"first call, log-hooked / the same outputs returned by a hand-written "
                        f"forward pass, L = {depth}", f"Equinox scanned transformer L={depth}",
                        fmt(total["log", depth]), fmt(total["by_hand", depth]),
                        total["log", depth] / total["by_hand", depth], None))
    low, high = COMPILE_DEPTHS
    for variant in ("identity", "log"):
        hooked = total[variant, high] / total[variant, low]
        raw = total["raw", high] / total["raw", low]
        why = "" if variant == "identity" else (
            f"the log grows with L: {values[high]:,} values at L = {high}, {values[low]:,} at L = {low}; "
            f"by hand the same values grow {total['by_hand', high] / total['by_hand', low] / raw:.2f}x raw's growth"
        )
        rows.append(Row("compile", f"depth growth of first call: {variant}-hooked / raw "
                        f"(L = {high} over L = {low})", "Equinox scanned transformer",
                        f"{hooked:.2f}x", f"{raw:.2f}x", hooked / raw, 1.1, why=why))
    return rows


# ---------------------------------------------------------------- port


@dataclasses.dataclass(frozen=True)
class PortSizes:
    """The ported language model: the Flax lm1b example's decoder (`--quick`: smaller)."""

    vocab: int
    dim: int
    heads: int
    mlp: int
    layers: int
    batch: int
    seq: int


PORT_FULL = PortSizes(vocab=30_000, dim=512, heads=8, mlp=2048, layers=6, batch=2, seq=64)
PORT_QUICK = PortSizes(vocab=500, dim=32, heads=2, mlp=64, layers=2, batch=2, seq=8)


class LinenPortBlock(nn.Module):
    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x, mask):
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=mask)
        h = nn.relu(nn.Dense(self.mlp)(nn.LayerNorm()(x)))
        return x + nn.Dense(x.shape[-1])(h)


class LinenPortLM(nn.Module):
    """A decoder-only LM with linen's default names (`Embed_0`, `LinenPortBlock_0`, ...)."""

    sizes: PortSizes

    @nn.compact
    def __call__(self, tokens):
        s = self.sizes
        x, mask = nn.Embed(s.vocab, s.dim)(tokens), nn.make_causal_mask(tokens)
        for _ in range(s.layers):
            x = LinenPortBlock(s.heads, s.mlp)(x, mask)
        return nn.Dense(s.vocab)(nn.LayerNorm()(x))


class NnxPortBlock(nnx.Module):
    def __init__(self, s, rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(s.dim, rngs=rngs), nnx.LayerNorm(s.dim, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(s.heads, s.dim, decode=False, rngs=rngs)
        self.hidden, self.out = nnx.Linear(s.dim, s.mlp, rngs=rngs), nnx.Linear(s.mlp, s.dim, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attention(self.norm1(x), mask=mask)
        return x + self.out(nnx.relu(self.hidden(self.norm2(x))))


class NnxPortLM(nnx.Module):
    """The NNX twin, with its own names."""

    def __init__(self, s, rngs):
        self.embed = nnx.Embed(s.vocab, s.dim, rngs=rngs)
        self.blocks = nnx.List([NnxPortBlock(s, rngs) for _ in range(s.layers)])
        self.norm, self.logits = nnx.LayerNorm(s.dim, rngs=rngs), nnx.Linear(s.dim, s.vocab, rngs=rngs)

    def __call__(self, tokens):
        x, mask = self.embed(tokens), nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.logits(self.norm(x))


PORT_TEXT = (
    "Port: a decoder-only LM in linen (default names; the Flax lm1b example's config in a "
    "full run: 6 layers, d 512, 8 heads, MLP 2048, vocab 30,000, 49.7M parameters; "
    "NumPy-drawn weights) ported to its NNX twin built by `nnx.eval_shape`, on 2 x 64 tokens "
    "(`--quick`: a small one). Each stage is timed on empty caches (`jax.clear_caches()`, "
    "then a full garbage collection), as a port runs once: `px.transfer_params(..., "
    "verify=False)` against 0.5 s per 50M "
    "parameters; `px.compare` with the alignment (what `px.port` verifies with), with and "
    "without cotangents, against one first call (trace, compile, run) of `jax.jit` of each "
    "model's forward (`module.apply`; the NNX twin's merge and call) and of its gradient "
    "of `0.5 * sum(logits**2)`; each `px.compare` and its reference timed one after the other "
    "in 5 rounds (which goes first alternating), the row the median of the rounds' ratios "
    "(`--quick`: one round). `px.compare` compiles the hooked passes of both models as one "
    "program (on CPU at XLA's backend optimisation level 0, a program run once); with "
    "cotangents, one gradient pass per model, its forward log the pass's auxiliary output.\n\n"
)


def timed(fn, *args, **kwargs):
    """`(result, seconds)` of one call on empty compilation caches: trace, compile, run.
    A full garbage collection first, so that one collecting a large heap does not land
    inside the call timed."""
    jax.clear_caches()
    gc.collect()
    start = time.perf_counter()
    result = jax.block_until_ready(fn(*args, **kwargs))
    return result, time.perf_counter() - start


# Each port stage runs once per port: first-call timings, one number per call, vary by
# tens of percent on a loaded machine. A row's ratio is the median over this many rounds,
# each round timing the stage and its reference one after the other.
PORT_ROUNDS = 5


def median_ratio(stage, reference, rounds):
    """`(stage's result, median stage seconds, median reference seconds, median of the
    per-round ratios)`: the stage and its reference (callables of no arguments, each
    timed by `timed`) alternated over `rounds` rounds, which goes first alternating too."""
    stage_s, reference_s, ratios = [], [], []
    for i in range(rounds):
        if i % 2:
            reference_s.append(timed(reference)[1])
        result, seconds = timed(stage)
        stage_s.append(seconds)
        if not i % 2:
            reference_s.append(timed(reference)[1])
        ratios.append(stage_s[-1] / reference_s[-1])
    return result, statistics.median(stage_s), statistics.median(reference_s), statistics.median(ratios)


# The groups of port rows (`--only`): the linen LM ported to NNX, and two instances of `OwnLM`.
PORT_GROUPS = ("lm1b", "same-class")


def rounds_text(rounds):
    return f"the median ratio of {rounds} alternated rounds" if rounds > 1 else "one round"


def port_rows(s, rounds=PORT_ROUNDS):
    """The `px.port` rows: a linen LM ported into its abstract NNX twin. Every stage is
    timed on empty compilation caches, as a port runs once: align, transfer (no
    verification), the verification with and without cotangents, the whole port, and
    one raw first-call forward and gradient of each model (`jax.jit` of `module.apply`,
    and of the NNX twin's merge and call); the verification against its reference over
    `rounds` alternated rounds (`median_ratio`)."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, s.vocab, (s.batch, s.seq)), jnp.int32)
    module = LinenPortLM(s)
    variables = random_like(jax.eval_shape(module.init, jax.random.key(0), tokens))
    source = px.from_linen(module, variables)
    abstract = px.from_nnx(nnx.eval_shape(lambda: NnxPortLM(s, nnx.Rngs(0))))
    params = sum(x.size for x in jax.tree.leaves(variables))

    graphdef, state = nnx.split(px.to_nnx(abstract))
    state = random_like(state)
    loss = lambda logits: 0.5 * jnp.sum(logits**2)
    raw_nnx = lambda state: nnx.merge(graphdef, state)(tokens)

    def forward():
        return jax.jit(module.apply)(variables, tokens), jax.jit(raw_nnx)(state)

    def forward_one_shot():
        # Compiled as px.compare compiles its program on CPU (`_align._run_once`).
        options = {"xla_backend_optimization_level": 0}
        apply = jax.jit(module.apply).lower(variables, tokens).compile(options)
        return apply(variables, tokens), jax.jit(raw_nnx).lower(state).compile(options)(state)

    def gradient():
        return (jax.jit(jax.grad(lambda v: loss(module.apply(v, tokens))))(variables),
                jax.jit(jax.grad(lambda state: loss(raw_nnx(state))))(state))

    alignment, align_s = timed(px.align, source, abstract, tokens)
    ported, transfer_s = timed(px.transfer_params, source, abstract, alignment.mapping, inputs=tokens, verify=False)
    # The verification px.port runs: px.compare of the aligned layers (and the outputs).
    comparison, verify_s, forward_s, verify_ratio = median_ratio(
        partial(px.compare, source, ported, tokens, alignment=alignment), forward, rounds)
    _, compare_ct_s, gradient_s, compare_ct_ratio = median_ratio(
        partial(px.compare, source, ported, tokens, alignment=alignment, cotangents=True), gradient, rounds)
    (_, port_comparison), port_s = timed(px.port, source, abstract, tokens)
    forward_one_shot_s = statistics.median(timed(forward_one_shot)[1] for _ in range(3))
    assert comparison.first_divergence is None and port_comparison.first_divergence is None
    model = f"linen LM -> NNX, {params:,} params ({s.layers} layers, d {s.dim}, vocab {s.vocab})"
    per_50m = 0.5 * params / 50e6
    return [
        Row("port", "transfer without verification / 0.5 s per 50M params", model, fmt(transfer_s),
            fmt(per_50m), transfer_s / per_50m, 1.0,
            why=f"align {fmt(align_s)}; {len(alignment.mapping)} layers"),
        Row("port", "verification (px.compare) / raw first-call forward of both models", model, fmt(verify_s),
            fmt(forward_s), verify_ratio, 1.2,
            why=f"the whole px.port {fmt(port_s)}; {rounds_text(rounds)}; on CPU px.compare compiles its "
            f"program at XLA's backend optimisation level 0 (it runs once): the raw forward compiled so "
            f"takes {fmt(forward_one_shot_s)} (median of 3)"),
        Row("port", "px.compare with cotangents / raw first-call gradient of both models", model,
            fmt(compare_ct_s), fmt(gradient_s), compare_ct_ratio, 1.2, why=rounds_text(rounds)),
    ]


# ------------------------------------------------ port between instances of one class


@dataclasses.dataclass(frozen=True)
class OwnLMSizes:
    """The LM built from its own layer classes (`OwnLM`): about 100M parameters in a full
    run (`--quick`: a tiny one)."""

    vocab: int
    width: int
    heads: int
    head_dim: int
    hidden: int
    layers: int
    batch: int
    seq: int

    @property
    def params(self):
        """The parameter count, from the sizes: the tied embedding, each block's fused
        qkv and output einsums, its gated MLP and two norms, and the final norm."""
        attention = 4 * self.heads * self.head_dim * self.width
        block = attention + 3 * self.width * self.hidden + 2 * self.width
        return self.vocab * self.width + self.layers * block + self.width


# vocab 32,000 x 768 (24.6M, tied) + 8 blocks of 9.44M (qkv 1.77M, output 0.59M, MLP 7.08M).
OWN_FULL = OwnLMSizes(vocab=32_000, width=768, heads=12, head_dim=64, hidden=3072, layers=8, batch=2, seq=64)
OWN_QUICK = OwnLMSizes(vocab=500, width=32, heads=2, head_dim=16, hidden=64, layers=2, batch=2, seq=8)


class OwnEinsum(nnx.Module):
    """A layer of the model's own class (as Gemma's `Einsum`): one parameter `w`."""

    def __init__(self, einsum_str, shape, *, rngs):
        self.einsum_str = einsum_str
        self.w = nnx.Param(nnx.initializers.normal()(rngs.params(), shape))

    def __call__(self, x):
        return jnp.einsum(self.einsum_str, x, self.w[...])


class OwnRMSNorm(nnx.Module):
    def __init__(self, dim, *, rngs):
        self.scale = nnx.Param(jnp.zeros((dim,)))

    def __call__(self, x):
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-06) * (1 + self.scale[...])


class OwnEmbedder(nnx.Module):
    """No `__call__`: `encode` embeds tokens, `decode` is the tied output projection."""

    def __init__(self, vocab, width, *, rngs):
        self.input_embedding = nnx.Param(nnx.initializers.normal()(rngs.params(), (vocab, width)))

    def encode(self, tokens):
        x = self.input_embedding[(tokens,)]
        return x * jnp.sqrt(x.shape[-1]).astype(x.dtype)

    def decode(self, x):
        return jnp.dot(x, self.input_embedding[...].T)


def own_rope(inputs, positions, max_wavelength=10_000):
    """Rotary positions on `inputs` (B, T, N, H), as Gemma applies them."""
    head_dim = inputs.shape[-1]
    timescale = max_wavelength ** (2 * jnp.arange(0, head_dim // 2) / head_dim)
    sinusoid = positions[..., jnp.newaxis] / timescale[jnp.newaxis, jnp.newaxis, :]
    sin, cos = jnp.sin(sinusoid)[..., jnp.newaxis, :], jnp.cos(sinusoid)[..., jnp.newaxis, :]
    first, second = jnp.split(inputs, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class OwnAttention(nnx.Module):
    """Causal self-attention with a fused `qkv_einsum`, rotary positions, its own softmax."""

    def __init__(self, s, *, rngs):
        self.scale = s.head_dim**-0.5
        self.qkv_einsum = OwnEinsum("BTD,SNDH->SBTNH", (3, s.heads, s.width, s.head_dim), rngs=rngs)
        self.attn_vec_einsum = OwnEinsum("BTNH,NHD->BTD", (s.heads, s.head_dim, s.width), rngs=rngs)

    def __call__(self, x, positions, mask):
        query, key, value = self.qkv_einsum(x)
        query = own_rope(query, positions) * self.scale
        key = own_rope(key, positions)
        logits = jnp.einsum("BTNH,BSNH->BTNS", query, key)
        probs = jax.nn.softmax(jnp.where(mask[:, :, None, :], logits, -2.3819763e38), axis=-1)
        return self.attn_vec_einsum(jnp.einsum("BTNS,BSNH->BTNH", probs, value))


class OwnFeedForward(nnx.Module):
    def __init__(self, width, hidden, *, rngs):
        self.gate_proj = nnx.Linear(width, hidden, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(width, hidden, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(hidden, width, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(nnx.gelu(self.gate_proj(x)) * self.up_proj(x))


class OwnBlock(nnx.Module):
    def __init__(self, s, *, rngs):
        self.pre_attention_norm = OwnRMSNorm(s.width, rngs=rngs)
        self.attn = OwnAttention(s, rngs=rngs)
        self.pre_ffw_norm = OwnRMSNorm(s.width, rngs=rngs)
        self.mlp = OwnFeedForward(s.width, s.hidden, rngs=rngs)

    def __call__(self, x, positions, mask):
        x = x + self.attn(self.pre_attention_norm(x), positions, mask)
        return x + self.mlp(self.pre_ffw_norm(x))


class OwnLM(nnx.Module):
    """A decoder-only LM in the shape of the Flax Gemma example (`tests/gemma_like.py`),
    built from its own layer classes: `OwnEmbedder` (tied head), `OwnEinsum`,
    `OwnRMSNorm`, blocks in a list; causal positions and mask made from the tokens."""

    def __init__(self, s, *, rngs):
        self.embedder = OwnEmbedder(s.vocab, s.width, rngs=rngs)
        self.layers = nnx.List([OwnBlock(s, rngs=rngs) for _ in range(s.layers)])
        self.final_norm = OwnRMSNorm(s.width, rngs=rngs)

    def __call__(self, tokens):
        length = tokens.shape[-1]
        positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (tokens.shape[0], length, length))
        x = self.embedder.encode(tokens)
        for layer in self.layers:
            x = layer(x, positions, mask)
        return self.embedder.decode(self.final_norm(x))


def own_lm(s, seed):
    """An `OwnLM` built under `nnx.eval_shape` (nothing initialised eagerly) holding
    NumPy draws of seed `seed` (`random_like`)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: OwnLM(s, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, random_like(state, seed=seed))


OWN_TEXT = (
    "Port between two instances of one class: `OwnLM`, a decoder-only LM in the shape of "
    "the Flax Gemma example (`tests/gemma_like.py`) built from its own layer classes, which "
    "no library knows: an `OwnEmbedder` with `encode` (embedding, scaled by sqrt(d)) and "
    "`decode` (the tied output projection) and no `__call__`; per block two `OwnRMSNorm`s "
    "(parameter `scale`, `x * (1 + scale)`), an attention with a fused `OwnEinsum` "
    "`qkv_einsum` (`w` 3 x heads x d x head_dim), rotary positions, its own softmax and an "
    "`OwnEinsum` `attn_vec_einsum`, and a gated MLP of three `nnx.Linear`s without bias (gelu); "
    "the blocks in an `nnx.List`, a final `OwnRMSNorm`. A full run: {full}; `--quick`: "
    "{quick}. Two instances, built by `nnx.eval_shape` and filled with NumPy draws of two "
    "seeds, on {batch} x {seq} tokens. `px.align` matches their own layers by class and "
    "output size and the method sites `embedder.encode` / `embedder.decode` by class and "
    "method; its `layer_mapping` (the method sites replaced by `embedder`), computed once "
    "outside the timing, drives `px.transfer_params(px.from_nnx(a), px.from_nnx(b), "
    "mapping, verify=False)` (the conversions inside the timing), which carries the layers "
    "of no known layout over array by array (jax arrays are immutable: the why column counts "
    "the ported arrays that are a's own buffers, not copies). Its reference is a plain copy: `nnx.split(b)`, "
    "each of b's state leaves replaced by `jnp.array(x, copy=True)` of a's, `nnx.merge`. "
    "The verification, `px.compare(px.from_nnx(a), ported, tokens, alignment=alignment)`, "
    "against one first call (trace, compile, run) of `jax.jit` of each model's forward "
    "(its own split/merge function, so that the two compile separately, as in the lm1b "
    "row). Both rows timed like the port rows above ({rounds}).\n\n"
)


def own_lm_text(rounds):
    describe = lambda s: (f"{s.layers} blocks, d {s.width}, {s.heads} heads x {s.head_dim}, MLP {s.hidden}, "
                          f"vocab {s.vocab:,}, {s.params:,} parameters")
    return OWN_TEXT.format(full=describe(OWN_FULL), quick=describe(OWN_QUICK), batch=OWN_FULL.batch,
                           seq=OWN_FULL.seq, rounds=rounds_text(rounds))


def same_class_port_rows(s, rounds=PORT_ROUNDS):
    """The rows of a port between two instances of `OwnLM` (its own layer classes): the
    transfer against a plain copy of every parameter, and the verification against one
    raw first-call forward of both models, each over `rounds` alternated rounds
    (`median_ratio`) on empty caches."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, s.vocab, (s.batch, s.seq)), jnp.int32)
    a, b = own_lm(s, seed=1), own_lm(s, seed=2)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(a)))
    assert params == s.params, (params, s.params)
    alignment, align_s = timed(px.align, px.from_nnx(a), px.from_nnx(b), tokens)
    assert not (alignment.unmatched or alignment.ambiguous or alignment.unknown), alignment
    mapping = alignment.layer_mapping
    graphdef_a, state_a = nnx.split(a)
    graphdef_b, state_b = nnx.split(b)

    def transfer():
        return px.transfer_params(px.from_nnx(a), px.from_nnx(b), mapping, verify=False)

    def plain_copy():
        graphdef, state = nnx.split(b)
        copied = jax.tree.map(lambda _, x: jnp.array(x, copy=True), state, nnx.state(a))
        return nnx.merge(graphdef, copied), copied

    def forward():
        # One function per model (a jit of each model's own call), so each compiles once.
        return (jax.jit(lambda state: nnx.merge(graphdef_a, state)(tokens))(state_a),
                jax.jit(lambda state: nnx.merge(graphdef_b, state)(tokens))(state_b))

    ported, transfer_s, copy_s, transfer_ratio = median_ratio(transfer, plain_copy, rounds)
    comparison, verify_s, forward_s, verify_ratio = median_ratio(
        partial(px.compare, px.from_nnx(a), ported, tokens, alignment=alignment), forward, rounds)
    # Seeds 1 and 2 differ everywhere: agreement means every parameter was copied.
    assert comparison.first_divergence is None, comparison
    # Whether the ported arrays are a's own buffers (jax arrays are immutable: a transfer
    # may hand them over) or copies, as the reference makes.
    buffers = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(state_a)}
    ported_leaves = jax.tree.leaves(nnx.state(px.to_nnx(ported)))
    shared = sum(x.unsafe_buffer_pointer() in buffers for x in ported_leaves)
    model = (f"NNX own-class LM -> another instance, {params:,} params ({s.layers} layers, d {s.width}, "
             f"vocab {s.vocab})")
    return [
        Row("port", "same-class transfer without verification / a plain copy of every parameter", model,
            fmt(transfer_s), fmt(copy_s), transfer_ratio, 1.5,
            why=f"align {fmt(align_s)} (outside the timing); {len(mapping)} layers of "
            f"{len(alignment.mapping)} aligned sites; {shared} of the ported model's {len(ported_leaves)} "
            f"arrays are a's own buffers (not copied); {rounds_text(rounds)}"),
        Row("port", "same-class verification (px.compare) / raw first-call forward of both models", model,
            fmt(verify_s), fmt(forward_s), verify_ratio, 1.2, why=rounds_text(rounds)),
    ]


def table(rows):
    lines = [
        "| section | row | model | variant | baseline | ratio | target | status | why (this run) |",
        "|---|---|---|---:|---:|---:|---|---|---|",
    ]
    lines += [
        f"| {r.section} | {r.label} | {r.model} | {r.variant} | {r.baseline} | {r.value_text} "
        f"| {r.target_text} | {r.status} | {r.why or '-'} |"
        for r in rows
    ]
    return "\n".join(lines)


def diff_table(diffs):
    lines = ["| model | variant | max abs diff vs raw | max abs of raw |", "|---|---|---:|---:|"]
    lines += [f"| {model} | {variant} | {d:.3g} | {scale:.3g} |" for (model, variant), (d, scale) in diffs.items()]
    return "\n".join(lines)


def memory_table(memory):
    lines = [
        "| transformer statistics of one forward (`activation_stats`, every layer) "
        + "".join(f"| batch {b}, seq {s} " for b, s in memory_shapes()) + "|",
        "|---" + "|---:" * len(memory_shapes()) + "|",
    ]
    lines += [f"| {lib} " + "".join(f"| {n:,} B " for n in sizes) + "|" for lib, sizes in memory.items()]
    return "\n".join(lines)


def jaxpr_table(sizes):
    lines = [
        "| model | variant | jaxpr inputs | outputs | equations | output values |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {m} | {v} | {i} | {o} | {e} | {n:,} |" for (m, v), (i, o, e, n) in sizes.items()]
    return "\n".join(lines)


def first_call_table(first):
    lines = ["| scanned transformer | variant | lower (trace) | XLA compile | run | total |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| L = {d} | {v} | " + " | ".join(fmt(t) for t in [*parts, sum(parts)]) + " |"
              for (v, d), parts in first.items()]
    return "\n".join(lines)


# ---------------------------------------------------------------- findings


def span(values):
    values = sorted(values)
    low, high = f"{values[0]:.2f}", f"{values[-1]:.2f}"
    return low if low == high else f"{low}-{high}"


def dispatch_findings(steady, flatten):
    """Where the tiny model's time goes: `eqx.filter_jit`'s own dispatch, the converted
    pytree's, the hook wrapper's."""
    eqx_raw = steady["Equinox", "tiny"]["raw"]
    parts = [f"Equinox's raw call (`eqx.filter_jit`) {fmt(eqx_raw)}"]
    for library in LIBRARIES[1:]:
        m, (raw, bare, converted) = steady[library, "tiny"], flatten[library].values()
        parts.append(
            f"{library}: raw `jax.jit` {fmt(m['raw'])} (its arguments flatten in {raw[1]:.2f} µs); "
            f"a bare `eqx.Module` around them {fmt(m['bare module'])} "
            f"({signed(m['bare module'] - m['raw'])}; flatten {bare[1]:.2f} µs); the unhooked "
            f"converted model under `jax.jit` {fmt(m['unhooked jax.jit'])} "
            f"({signed(m['unhooked jax.jit'] - m['bare module'])} over the bare module; flatten "
            f"{converted[1]:.2f} µs, {converted[0]} leaves), under `eqx.filter_jit` "
            f"{fmt(m['unhooked'])} ({signed(m['unhooked'] - m['unhooked jax.jit'])} over `jax.jit`: "
            f"`eqx.filter_jit`'s own dispatch)"
        )
    return ("- **Dispatch, on the tiny model** (one Linear 4 -> 4: the call is all "
            "dispatch): " + "; ".join(parts) + ". A converted model's `eqx.filter_jit` "
            "call costs what `eqx.filter_jit` costs any Equinox model; under `jax.jit` the "
            "gap to the raw call is mostly the bare module's: flattening one Equinox pytree "
            "node, a Python function, where the raw call's arguments flatten in C++.")


def findings(rows, steady, sizes, flatten, first, memory, unpooled):
    """The findings: every number comes from this run (medians, jaxprs, flatten times,
    first-call parts, memory)."""
    missed = [r for r in rows if r.status not in ("ok", "report")]
    checked = [r for r in rows if r.target is not None]
    lines = ["## Findings", "", "Computed by `benchmarks/bench.py` from this run.", "",
             f"- **Targets missed: {len(missed)} of {len(checked)} checked rows.**"]
    lines += [f"  - {r.section}, {r.label}, {r.model}: {r.value_text} ({r.status})"
              + (f": {r.why}." if r.why else ".") for r in missed]
    noise = [r.value for r in rows if r.label.startswith("A/A")]
    lines.append(f"- **Noise floor**: each library's raw call timed as two variants of its group "
                 f"(A/A) gives {span(noise)} over the {len(noise)} groups.")
    lines.append(dispatch_findings(steady, flatten))

    parts = []
    for library in LIBRARIES:
        raw, unhooked, identity, log, native = (
            sizes[f"{library} MLP", v] for v in ("raw", "unhooked", "identity", "log", "native log")
        )
        parts.append(
            f"{library}: equations raw {raw[2]}, unhooked {unhooked[2]}, identity-hooked "
            f"{identity[2]}, log-everything {log[2]} ({log[1]} outputs) against the native "
            f"log's {native[2]} ({native[1]} outputs)"
        )
    lines.append("- **The MLP's jaxprs** (`eqx.filter_jit` adds one output, a marker; identity "
                 "hooks leave the program unchanged, so their cost is dispatch): " + "; ".join(parts) + ".")

    parts = []
    for library in LIBRARIES:
        m, model = steady[library, "train"], f"{library} MLP"
        plain, stats, no_hist = (sizes[model, v] for v in ("train plain", "train stats", "train stats no hist"))
        parts.append(
            f"{library}: mean/std/near-zero add {100 * (m['train stats no hist'] / m['train plain'] - 1):+.0f}% "
            f"({no_hist[2] - plain[2]:+} equations, {no_hist[1] - plain[1]:+} outputs), the "
            f"histogram {100 * (m['train stats'] - m['train stats no hist']) / m['train plain']:+.0f}% "
            f"({stats[2] - no_hist[2]:+} equations)"
        )
    lines.append("- **Statistics in the training step** (share of the plain step): " + "; ".join(parts) + ".")

    fixed = [lib for lib, sizes_ in memory.items() if len(set(sizes_)) == 1]
    growing = [lib for lib, sizes_ in memory.items() if len(set(sizes_)) > 1]
    text = (f"- **Statistics memory**: independent of batch and sequence length in "
            f"{', '.join(fixed) or 'no library'}; growing in {', '.join(growing) or 'none'}.")
    for library in growing:
        paths = unpooled[library]
        text += (f" {library}: {len(paths)} layers keep a statistic per example or position "
                 f"(e.g. {', '.join(f'`{p}`' for p in paths[:4])}).")
    lines.append(text)

    parts = []
    for depth in COMPILE_DEPTHS:
        raw = first["raw", depth]
        for variant in ("identity", "log"):
            hooked = first[variant, depth]
            outputs = sizes[f"scanned L={depth}", variant][1], sizes[f"scanned L={depth}", "raw"][1]
            parts.append(f"L = {depth} {variant}: trace + lower {hooked[0] / raw[0]:.2f}x, XLA compile "
                         f"{hooked[1] / raw[1]:.2f}x, run {hooked[2] / raw[2]:.2f}x, jaxpr outputs "
                         f"{outputs[0]} against {outputs[1]}")
    lines.append("- **First calls, hooked / raw, by part**: " + "; ".join(parts) + ".")
    values = [
        f"L = {depth}: log-hooked {sizes[f'scanned L={depth}', 'log'][3]:,}, by hand "
        f"{sizes[f'scanned L={depth}', 'by_hand'][3]:,}, raw {sizes[f'scanned L={depth}', 'raw'][3]:,}"
        for depth in COMPILE_DEPTHS
    ]
    lines.append(
        "- **Values a first call returns** (the log-everything log holds every layer's output, attention "
        "weights included, and a layer that is also its container's last call twice; the hand-written "
        "pass returns the same values): " + "; ".join(values) + "."
    )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def header(budget, wall, quick):
    device = jax.devices()[0]
    return (
        "# Benchmarks\n\n"
        "Generated by `benchmarks/bench.py` (`make bench`) from one run; nothing here is "
        "written by hand." + (" **Smoke run (`--quick`): a few repetitions, numbers are "
                              "noise.**" if quick else "") + "\n\n"
        f"Machine: {device.platform.upper()} ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores), Python {platform.python_version()}, jax {jax.__version__}, "
        f"equinox {eqx.__version__}, dm-haiku {hk.__version__}, flax {flax.__version__}, "
        f"optax {optax.__version__}, peex {getattr(peex, '__version__', '0.0.3')}, "
        f"peex_interop {px.__version__}; date {datetime.date.today().isoformat()}; the run "
        f"took {wall:.0f} s.\n\n"
        "Method: every variant is a zero-argument call of a jitted function, called once "
        "(traced and compiled) before timing; every timed call ends with "
        "`jax.block_until_ready`. The variants of a group (one library's model; the "
        "training steps of one library; the ten-step sequences) are timed round-robin, one "
        "call of each per repetition, shuffled order (fixed seed); a group's repetitions "
        f"fill a time budget ({budget.forward:g} s per model, {budget.tiny:g} s for the "
        f"tiny models, {budget.train:g} s per training group; at least {budget.min_reps}). "
        "Tables report medians; a ratio compares two variants of one group. Hook wrapper "
        "rows are differences of medians in µs, checked on the tiny model (on the bigger "
        "ones a few µs are below the noise that the A/A rows show, so they are reported)."
        "\n\n"
        f"Models, in each library: MLP = {DEPTH} Linear {S.width} -> {S.width} with relu "
        f"after each, batch {S.mlp_batch}; transformer = {S.blocks} pre-LN blocks (LayerNorm, "
        f"the library's attention with {S.heads} heads on d {S.dim}, LayerNorm, Linear "
        f"{S.dim} -> {4 * S.dim}, gelu, Linear {4 * S.dim} -> {S.dim}, residuals) on {S.batch} "
        f"sequences of {S.seq}; tiny = one Linear 4 -> 4 on one example; Equinox MLP "
        f"{min(NARROW, S.width)} = the MLP at width {min(NARROW, S.width)} (statistics rows only). Attention: "
        "`eqx.nn.MultiheadAttention`, `hk.MultiHeadAttention`, `nnx.MultiHeadAttention`, "
        "`nn.MultiHeadDotProductAttention`. Equinox models are per-example, run under "
        "`jax.vmap` inside the jitted function; their layers are depth-1 attributes "
        "(`l0`, `l1`, ..., `b0`, `b1`, ...) so that peex 0.0.3, which hooks only those, can "
        "log them. Parameters are NumPy draws (`tests/models.py: random_like`).\n\n"
        "Variants: raw = the library's own jitted call (`eqx.filter_jit` of the Equinox "
        "model; `jax.jit(transformed.apply)`; `jax.jit` of `nnx.merge(graphdef, state)(x)`; "
        "`jax.jit(module.apply)`); raw under eqx.filter_jit = the same `apply` under "
        "`eqx.filter_jit` instead (what that jit costs with no conversion). Native log = "
        "the library's own way to log every layer: "
        "peex 0.0.3 `peex.ForwardHook(model, log_fn=peex.IdentityLog())` (Equinox), "
        "`hk.intercept_methods` recording each `__call__` output by module name, "
        "`nnx.capture(module, nnx.Intermediate, method_outputs=nnx.Intermediate)` inside "
        "the `jax.jit` split/merge function, linen `module.apply(..., "
        "capture_intermediates=True, mutable=['intermediates'])` under `jax.jit`. Ours: "
        "the converted model (`px.from_haiku`, `px.from_nnx`, `px.from_linen`; Equinox: "
        "the model) unhooked, `px.ForwardHook(model)` (identity) and "
        "`px.ForwardHook(model, log_fn=px.IdentityLog())` (log), under `eqx.filter_jit` "
        "and, where marked, `jax.jit`; the log under the native log's own jit (`jax.jit`; "
        "Equinox: `eqx.filter_jit`), like for like. A/A = the raw call timed as a second variant of its "
        "group (Equinox: the unhooked model, the same call). Bare module (tiny models) = "
        "the raw `apply` under `jax.jit`, reading its arguments from a one-field "
        "`eqx.Module` with Python's own `__getattribute__`: the cheapest Equinox pytree "
        "around the raw arguments, the floor of a converted model's `jax.jit` dispatch. "
        "The why column gives, where this run measured it, what explains a row's value.\n\n"
        "Statistics: a training step (`eqx.filter_jit` of `eqx.filter_value_and_grad` of "
        "the mean squared output and an `optax.adam` update) on the MLP, with "
        "`px.ForwardHook(model, log_fn=px.activation_stats())` on every layer (mean, std, "
        "near-zero, 40-bin histogram; per-example Equinox models under "
        "`jax.vmap(axis_name='batch')` with the histogram's `axis_name='batch'`, pooled "
        "by `px.pool_stats`), or the same statistics without the histogram, against the "
        f"step on the unhooked model; also on the Equinox MLP of width {min(NARROW, S.width)} "
        "(its smaller step shows the statistics' per-layer fixed cost); every 10 = " + EVERY_TEN_TEXT + ", against ten "
        "plain steps. Memory = "
        "bytes of the statistics one transformer forward returns, from `jax.eval_shape`.\n\n"
        "Compile: first call (lower, XLA compile, run of `eqx.filter_jit` of the model "
        "under `jax.vmap`) of `tests/models.py: Transformer(vocab=100, dim="
        f"{S.dim}, heads={S.heads}, num_blocks=L)` (blocks built by `eqx.filter_vmap`, run by "
        f"`lax.scan`) on {S.batch} x {S.seq} tokens, in fresh processes (imports, construction "
        f"and backend start-up excluded, compilation cache off), median of "
        f"{budget.first_call_reps} per variant, "
        + ("all processes at once (a smoke run).\n\n" if quick else "variants alternating.\n\n")
        + PORT_TEXT
        + own_lm_text(1 if quick else PORT_ROUNDS)
        + "Regenerate with `make bench` (`--quick` for a smoke test).\n"
    )


def run(budget):
    """Every measurement of the run: rows, medians, outputs' diffs, jaxpr sizes, dispatch
    evidence, first calls, memory."""
    steady, diffs, sizes, flatten, reps = {}, {}, {}, {}, {}
    start = time.perf_counter()
    for library in LIBRARIES:
        for name in ("tiny", "MLP", "transformer"):
            print(f"[{time.perf_counter() - start:4.0f} s] {library} {name}", file=sys.stderr)
            variants = forward_variants(library, name)
            group_budget = budget.tiny if name == "tiny" else budget.forward
            medians, outputs, reps[library, name] = interleaved(
                variants, group_budget, budget.min_reps, budget.max_reps
            )
            steady[library, name] = medians
            model = f"{library} {name}"
            for variant, output in outputs.items():
                if variant not in ("raw", "raw (A/A)"):
                    diffs[model, variant] = max_abs_diff(output, outputs["raw"])
            if name != "transformer":
                for variant in ("raw", "unhooked", "identity", "log", "native log"):
                    sizes[model, variant] = jaxpr_size(variants[variant].call)
            if name == "tiny" and library != "Equinox":
                # What each call flattens: its arguments (`partial`'s).
                flatten[library] = {
                    label: (len(jax.tree.leaves(args)), flatten_micros(args))
                    for label, args in (("raw", variants["raw"].call.args),
                                        ("bare module", variants["bare module"].call.args),
                                        ("converted", variants["unhooked jax.jit"].call.args))
                }

        print(f"[{time.perf_counter() - start:4.0f} s] {library} training steps", file=sys.stderr)
        steps, ten = train_variants(library)
        medians, outputs, reps[library, "train"] = interleaved(
            steps, budget.train, budget.min_reps, budget.max_reps
        )
        for variant in ("train stats", "train stats no hist"):
            diffs[f"{library} MLP", variant] = max_abs_diff(outputs[variant], outputs["train plain"])
            sizes[f"{library} MLP", variant] = jaxpr_size(steps[variant].call)
        sizes[f"{library} MLP", "train plain"] = jaxpr_size(steps["train plain"].call)
        ten_medians, ten_outputs, reps[library, "every 10"] = interleaved(
            ten, budget.train, budget.min_reps, budget.max_reps
        )
        for variant in ("10 steps, stats every 10", "10 steps, stats every 10, on the host"):
            diffs[f"{library} MLP", variant] = max_abs_diff(ten_outputs[variant], ten_outputs["10 plain steps"])
        medians |= ten_medians
        steady[library, "train"] = medians
    steps, narrow = narrow_train_variants()
    print(f"[{time.perf_counter() - start:4.0f} s] {narrow} training steps", file=sys.stderr)
    medians, outputs, reps[narrow, "train"] = interleaved(steps, budget.train, budget.min_reps, budget.max_reps)
    for variant in ("train stats", "train stats no hist"):
        diffs[narrow, variant] = max_abs_diff(outputs[variant], outputs["train plain"])
    steady[narrow, "train"] = medians
    print(f"[{time.perf_counter() - start:4.0f} s] first calls, memory", file=sys.stderr)
    for depth in COMPILE_DEPTHS:
        model, tokens = scanned_transformer(depth, S.dim, S.heads, S.batch, S.seq)
        for variant, wrap in WRAPPERS.items():
            forward_ = partial(FORWARDS.get(variant, scanned_forward), wrap(model), tokens)
            sizes[f"scanned L={depth}", variant] = jaxpr_size(forward_)
    first = first_calls(budget.first_call_reps, parallel=budget is QUICK)
    memory, unpooled = memory_rows()
    return steady, diffs, sizes, flatten, first, memory, unpooled, reps


def port_section(quick, start, which=PORT_GROUPS):
    """The port rows of the groups `which` (`PORT_GROUPS`), full size or `quick`."""
    rows = []
    if "lm1b" in which:
        print(f"[{time.perf_counter() - start:4.0f} s] port", file=sys.stderr)
        rows += port_rows(PORT_QUICK, rounds=1) if quick else port_rows(PORT_FULL)
    if "same-class" in which:
        print(f"[{time.perf_counter() - start:4.0f} s] same-class port", file=sys.stderr)
        rows += same_class_port_rows(OWN_QUICK, rounds=1) if quick else same_class_port_rows(OWN_FULL)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="markdown file to write")
    parser.add_argument("--quick", action="store_true", help="few repetitions (smoke test)")
    parser.add_argument(
        "--only", choices=("port", *PORT_GROUPS),
        help="run only the port rows (`port`), or one group of them (`lm1b`: linen LM -> NNX; "
        "`same-class`: two instances of an LM of its own layer classes); the page written holds "
        "their description and table alone")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.only:
        rows = port_section(args.quick, start, PORT_GROUPS if args.only == "port" else (args.only,))
        print(table(rows))
        if args.out:
            rounds = 1 if args.quick else PORT_ROUNDS
            texts = {"lm1b": PORT_TEXT, "same-class": own_lm_text(rounds)}
            args.out.write_text(
                f"# Benchmarks: port rows only (`--only {args.only}`"
                + (", `--quick`" if args.quick else "") + f"; {time.perf_counter() - start:.0f} s)\n\n"
                + "".join(texts[group] for group in PORT_GROUPS if args.only in ("port", group))
                + table(rows) + "\n")
        return
    global S
    budget, S = (QUICK, QUICK_SIZES) if args.quick else (FULL, FULL_SIZES)
    steady, diffs, sizes, flatten, first, memory, unpooled, reps = run(budget)
    rows = []
    for library in LIBRARIES:
        for name in ("MLP", "transformer", "tiny"):
            rows += forward_rows(library, name, steady, flatten, sizes)
    for library in LIBRARIES:
        rows += train_rows(library, steady[library, "train"], sizes)
    rows += [row for (model, group), medians in steady.items() if model.startswith("Equinox MLP ")
             for row in narrow_rows(model, medians)]
    rows += memory_table_rows(memory) + compile_rows(first, sizes)
    rows += port_section(args.quick, start)
    order = ("log-everything", "dispatch", "statistics", "compile", "port")
    rows.sort(key=lambda r: order.index(r.section))
    text = "\n\n".join([
        table(rows),
        "Repetitions per group: " + ", ".join(f"{lib} {name} {n}" for (lib, name), n in reps.items()) + ".",
        "## Outputs of the hooked variants against raw\n\n"
        "Forward variants: the model's output against the library's raw jitted call; "
        "training steps: the updated parameters against the plain step's.",
        diff_table(diffs),
        "## Statistics memory",
        memory_table(memory),
        "## First calls",
        first_call_table(first),
        "## Jaxprs\n\n`jax.make_jaxpr` of each jitted function (nested jit bodies inlined, "
        "control-flow bodies counted once; `eqx.filter_jit` adds one output, a marker).",
        jaxpr_table(sizes),
        findings(rows, steady, sizes, flatten, first, memory, unpooled),
    ])
    print(text)
    if args.out:
        wall = time.perf_counter() - start
        args.out.write_text(header(budget, wall, args.quick) + "\n" + text + "\n")


if __name__ == "__main__":
    main()
