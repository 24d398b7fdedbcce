"""Overheads of peex_interop's hooks, as ratios measured within one run.

Method:

- Every ratio compares a variant with its baseline measured in the same run, on the
  same machine, with the variants interleaved round-robin: each repetition times one
  call of every variant of a group in turn (forward variants of a model together, its
  grad steps together; order shuffled per repetition), so drifts in machine load hit
  all of them alike. Tables report medians over the repetitions.
- Each timed call ends with `jax.block_until_ready`; every jitted function is called
  once (traced and compiled) before timing starts.
- The first call (trace + compile + run) is timed in fresh processes (this script
  re-run with `--first-call VARIANT MODEL`; imports, model construction and backend
  start-up excluded, persistent compilation cache off), raw and hooked processes
  alternating.
- Weights are zeros (see `make_model`).
- Each model is built by a framework's variants function (`equinox_variants`,
  `haiku_variants`, `nnx_variants`, plus `train_variants` for the training step)
  registered in `MODELS` with its groups; the rows in `STEADY_ROWS` apply to every
  model that has both of their variants. Haiku baselines are native:
  `jax.jit(transformed.apply)`, `hk.intercept_methods` logging, `jax.grad` of params.
  NNX baselines are native: `jax.jit` of an `nnx.split`/`nnx.merge` function and
  `nnx.jit`, `nnx.capture(method_outputs=nnx.Intermediate)` logging, `jax.grad` of the
  split state and `nnx.jit(nnx.grad(...))`.
- Also reported: the bytes of the statistics a training step records, at two batch
  sizes, and each variant's jaxpr size (inputs, outputs, equations).
- The findings section is computed from the run's own medians, jaxpr sizes and memory
  rows (`findings`); the one piece of prose a run cannot check says so and is dated.

Usage: `python benchmarks/bench.py [--quick] [--out docs/benchmarks.md]`.
"""

import argparse
import datetime
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import equinox as eqx
import flax
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import peex
from flax import nnx

import peex_interop as px

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from models import MLP, Transformer

BATCH = 256
WIDTH = 64


class Flat12(eqx.Module):
    """Twelve Linear layers as depth-1 attributes (peex 0.0.3 hooks depth 1 only)."""

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
        for i, k in enumerate(jax.random.split(key, 12)):
            setattr(self, f"l{i}", eqx.nn.Linear(WIDTH, WIDTH, key=k))

    def __call__(self, x):
        for i in range(12):
            x = jax.nn.relu(getattr(self, f"l{i}")(x))
        return x


def make_model(name):
    """`(model, input, batched)`; a batched model is called as `jax.vmap(model)(x)`.

    Weights are zeros of the right shapes, built without running JAX: timings do not
    depend on values, and eager initialisation (seconds for the transformer) would
    dominate every `--first-call` process. Inputs come from NumPy for the same reason.
    """
    rng = np.random.default_rng(0)
    batch = rng.standard_normal((BATCH, WIDTH), np.float32)
    build, x, batched = {
        "seed MLP": (lambda k: MLP(1, 2, 1, key=k), rng.standard_normal(1, np.float32), False),
        "MLP depth 12": (lambda k: eqx.nn.MLP(WIDTH, WIDTH, WIDTH, depth=12, key=k), batch, True),
        "transformer": (
            lambda k: Transformer(vocab=100, dim=WIDTH, heads=4, num_blocks=4, key=k),
            rng.integers(0, 100, 32, np.int32),
            False,
        ),
        "flat 12 Linear": (lambda k: Flat12(key=k), batch, True),
    }[name]
    shapes = eqx.filter_eval_shape(lambda: build(jax.random.key(0)))
    model = jax.tree.map(zeros_if_array, shapes)
    return model, jnp.asarray(x), batched


def zeros_if_array(leaf):
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jnp.asarray(np.zeros(leaf.shape, leaf.dtype))
    return leaf


# Forward variants: how each wraps the model.
WRAPPERS = {
    "raw": lambda model: model,
    "identity": px.ForwardHook,
    "log": lambda model: px.ForwardHook(model, log_fn=px.IdentityLog()),
    "peex log": lambda model: peex.ForwardHook(model, log_fn=peex.IdentityLog()),
}


def forward_fn(batched):
    """The jitted forward pass; a hooked model returns `(output, log)`."""
    return eqx.filter_jit(lambda m, x: jax.vmap(m)(x) if batched else m(x))


def grad_fn(batched):
    """The jitted gradient of the sum of squares of the output."""

    def loss(m, x):
        return jnp.sum((jax.vmap(m)(x) if batched else m(x)) ** 2)

    return eqx.filter_jit(eqx.filter_grad(loss))


def equinox_variants(name):
    """Variant name -> zero-argument call, for this Equinox model."""
    model, x, batched = make_model(name)
    forward, grad = forward_fn(batched), grad_fn(batched)
    backward = px.BackwardHook(model, log_fn=px.IdentityLog()).init(x[0] if batched else x)
    calls = {k: partial(forward, wrap(model), x) for k, wrap in WRAPPERS.items()}
    calls["grad raw"] = partial(grad, model, x)
    calls["grad logged"] = partial(grad, backward, x)
    return calls


class HaikuBlock(hk.Module):
    """Pre-norm transformer block: self-attention, then a two-layer MLP."""

    def __call__(self, x):
        h = hk.LayerNorm(-1, create_scale=True, create_offset=True, name="ln_attn")(x)
        attn = hk.MultiHeadAttention(
            num_heads=4, key_size=WIDTH // 4, w_init=hk.initializers.VarianceScaling(),
            name="attn",
        )
        x = x + attn(h, h, h)
        h = hk.LayerNorm(-1, create_scale=True, create_offset=True, name="ln_mlp")(x)
        return x + hk.nets.MLP([4 * WIDTH, WIDTH], activation=jax.nn.gelu, name="mlp")(h)


def haiku_transformer(x):
    # A Python loop, not hk.experimental.layer_stack: the native baseline's interceptor
    # records into a Python dict, which cannot take values out of layer_stack's scan.
    for i in range(4):
        x = HaikuBlock(name=f"block_{i}")(x)
    return x


# Haiku model -> (function to hk.transform, input shape).
HAIKU_MODELS = {
    "hk MLP depth 13": (lambda x: hk.nets.MLP([WIDTH] * 12 + [WIDTH])(x), (BATCH, WIDTH)),
    "hk transformer": (haiku_transformer, (32, WIDTH)),
}


def make_haiku_model(name):
    """`(transformed, params, input)`; params are zeros, shapes from `jax.eval_shape`."""
    fn, shape = HAIKU_MODELS[name]
    transformed = hk.without_apply_rng(hk.transform(fn))
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape, np.float32))
    shapes = jax.eval_shape(transformed.init, jax.random.key(0), x)
    return transformed, jax.tree.map(zeros_if_array, shapes), x


def native_haiku_log(transformed):
    """The native Haiku way to log every layer: `apply` under `hk.intercept_methods`,
    recording each module's `__call__` output by its Haiku name; returns `(out, log)`."""

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


def haiku_variants(name):
    """Variant name -> zero-argument call, for this Haiku model: hooked variants wrap
    `px.from_haiku(transformed, params)`, baselines are native Haiku under `jax.jit`."""
    transformed, params, x = make_haiku_model(name)
    converted = px.from_haiku(transformed, params)
    forward, grad = forward_fn(False), grad_fn(False)
    backward = px.BackwardHook(converted, log_fn=px.IdentityLog()).init(x)

    def loss_of_params(params, x):
        return jnp.sum(transformed.apply(params, x) ** 2)

    calls = {k: partial(forward, WRAPPERS[k](converted), x) for k in ("identity", "log")}
    calls["raw"] = partial(jax.jit(transformed.apply), params, x)
    calls["native log"] = partial(native_haiku_log(transformed), params, x)
    calls["grad raw"] = partial(jax.jit(jax.grad(loss_of_params)), params, x)
    calls["grad logged"] = partial(grad, backward, x)
    # The converted model without hooks, under eqx.filter_jit like the hooked variants:
    # splits each hooked/native ratio into hook cost and filter_jit dispatch cost.
    calls["unhooked"] = partial(forward, converted, x)
    calls["grad unhooked"] = partial(grad, converted, x)
    return calls


class NnxMLP(nnx.Module):
    """Twelve `nnx.Linear(64, 64)` with relu, in an `nnx.List`; batched (no vmap)."""

    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(12)])

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


class NnxBlock(nnx.Module):
    """The Haiku block's twin: pre-norm self-attention, then a two-layer gelu MLP."""

    def __init__(self, rngs):
        self.ln_attn = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(4, WIDTH, decode=False, rngs=rngs)
        self.ln_mlp = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs), jax.nn.gelu,
            nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs),
        )

    def __call__(self, x):
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class NnxTransformer(nnx.Module):
    """Four `NnxBlock`s in an `nnx.List`, run in a Python loop."""

    def __init__(self, rngs):
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(4)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


# NNX model -> (class, input shape).
NNX_MODELS = {
    "nnx MLP depth 12": (NnxMLP, (BATCH, WIDTH)),
    "nnx transformer": (NnxTransformer, (32, WIDTH)),
}


def make_nnx_model(name):
    """`(module, input)`; the module's state is zeros, shapes from `nnx.eval_shape`."""
    cls, shape = NNX_MODELS[name]
    graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(nnx.Rngs(0))))
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape, np.float32))
    return nnx.merge(graphdef, jax.tree.map(zeros_if_array, state)), x


def nnx_variants(name):
    """Variant name -> zero-argument call, for this NNX model: hooked variants wrap
    `px.from_nnx(module)` under `eqx.filter_jit`; baselines are native NNX, under
    `jax.jit` of a split/merge function ("raw") and under `nnx.jit` ("raw nnx.jit")."""
    module, x = make_nnx_model(name)
    graphdef, state = nnx.split(module)
    converted = px.from_nnx(module)
    forward, grad = forward_fn(False), grad_fn(False)
    backward = px.BackwardHook(converted, log_fn=px.IdentityLog()).init(x)

    def capture(module, x):
        return nnx.capture(module, nnx.Intermediate, method_outputs=nnx.Intermediate)(x)

    def loss_of_state(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

    calls = {k: partial(forward, WRAPPERS[k](converted), x) for k in ("identity", "log")}
    calls["raw"] = partial(jax.jit(lambda state, x: nnx.merge(graphdef, state)(x)), state, x)
    calls["raw nnx.jit"] = partial(nnx.jit(lambda module, x: module(x)), module, x)
    calls["capture log"] = partial(
        jax.jit(lambda state, x: capture(nnx.merge(graphdef, state), x)), state, x
    )
    calls["grad raw"] = partial(jax.jit(jax.grad(loss_of_state)), state, x)
    calls["grad nnx.jit"] = partial(
        nnx.jit(nnx.grad(lambda module, x: jnp.sum(module(x) ** 2))), module, x
    )
    calls["grad logged"] = partial(grad, backward, x)
    calls["unhooked"] = partial(forward, converted, x)
    calls["grad unhooked"] = partial(grad, converted, x)
    return calls


def train_step(optimizer, batched, hooked):
    """A jitted training step (forward, grad, adam update) on a batch; a hooked model is a
    `ForwardHook`, and the step also returns its statistics (pooled over the examples of
    a per-example model with `px.pool_stats`)."""

    def loss(model, x):
        out = jax.vmap(model)(x) if batched else model(x)
        out, log = out if hooked else (out, {})
        log = px.pool_stats(log, 1) if batched else log
        return jnp.mean(out**2), log

    @eqx.filter_jit
    def step(model, opt_state, x):
        (_, log), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model, x)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, log

    return step


def with_stats(model, names=None):
    """The model logging `px.activation_stats()` on every layer, or only its statistics
    `names` (`()`: identity hooks, no log)."""
    stats = px.activation_stats()
    if names is None:
        return px.ForwardHook(model, log_fn=stats)
    if not names:
        return px.ForwardHook(model)
    return px.ForwardHook(model, log_fn=px.StatsLog({k: stats.logs[k] for k in names}))


# The training step's statistics added one at a time (variant -> statistics), so that
# the findings can split the cost of `activation_stats` between hooks and statistics.
TRAIN_PARTS = {
    "train identity": (),
    "train mean": ("mean",),
    "train mean+std": ("mean", "std"),
    "train mean+std+near_zero": ("mean", "std", "near_zero"),
}


def train_variants(name):
    """The training step with statistics on every layer, with parts of them
    (`TRAIN_PARTS`), and without hooks; and ten steps with statistics on one of them
    (`Recorder(every=10)`, `Recorder.due` choosing the step variant), against ten plain
    steps."""
    model, x, batched = make_model(name)
    optimizer = optax.adam(1e-3)
    calls = {}
    hooked = {"train stats": with_stats(model), "train plain": model}
    hooked |= {variant: with_stats(model, names) for variant, names in TRAIN_PARTS.items()}
    for variant, model_ in hooked.items():
        opt_state = optimizer.init(eqx.filter(model_, eqx.is_inexact_array))
        step = train_step(optimizer, batched, variant != "train plain")
        calls[variant] = partial(step, model_, opt_state, x)
    recorder = px.Recorder(every=10)

    def ten_steps(due):
        for step in range(10):
            out = (calls["train stats"] if due(step) else calls["train plain"])()
        return out

    calls["train stats every 10"] = partial(ten_steps, recorder.due)
    calls["train plain x10"] = partial(ten_steps, lambda step: False)
    return calls


def stats_bytes(model, x, batched, pool=True):
    """Bytes of the statistics one training step returns on this batch."""
    optimizer = optax.adam(1e-3)
    hooked = with_stats(model)
    opt_state = optimizer.init(eqx.filter(hooked, eqx.is_inexact_array))
    step = train_step(optimizer, batched, True)
    if not pool:  # the per-example statistics, before px.pool_stats
        step = eqx.filter_jit(lambda m, x: jax.vmap(m)(x)[1])
        log = step(hooked, x)
    else:
        _, _, log = step(hooked, opt_state, x)
    return sum(leaf.nbytes for leaf in jax.tree.leaves(log))


def memory_rows(batches=(32, 256)):
    """(model, bytes per batch size) of the recorded statistics of one training step."""
    rng = np.random.default_rng(0)
    equinox, _, _ = make_model("MLP depth 12")
    nnx_module, _ = make_nnx_model("nnx MLP depth 12")
    hk_transformed, hk_params, _ = make_haiku_model("hk MLP depth 13")
    models = {
        "MLP depth 12 (Equinox, px.pool_stats in the step)": (equinox, True, True),
        "MLP depth 12 (Equinox, per-example, not pooled)": (equinox, True, False),
        "nnx MLP depth 12 (from_nnx, batched layers)": (px.from_nnx(nnx_module), False, True),
        "hk MLP depth 13 (from_haiku, batched layers)": (
            px.from_haiku(hk_transformed, hk_params), False, True
        ),
    }
    rows = []
    for label, (model, batched, pool) in models.items():
        sizes = []
        for batch in batches:
            x = jnp.asarray(rng.standard_normal((batch, WIDTH), np.float32))
            sizes.append(stats_bytes(model, x, batched, pool))
        rows.append((label, sizes))
    return rows


# Variants whose jitted function is compared at the jaxpr level (zero-argument calls of
# one jitted function each; nnx.jit variants are left out: they mutate the live module).
JAXPR_VARIANTS = ["raw", "unhooked", "identity", "log", "native log", "capture log",
                  "grad raw", "grad unhooked", "grad logged"]
JAXPR_MODELS = ["MLP depth 12", "hk MLP depth 13", "nnx MLP depth 12", "nnx transformer"]


def jitted_jaxpr(call):
    """The jaxpr of the one jitted function a zero-argument call runs."""
    (eqn,) = [e for e in jax.make_jaxpr(call)().jaxpr.eqns if e.primitive.name in ("pjit", "jit")]
    return eqn.params["jaxpr"].jaxpr


def count_equations(jaxpr):
    """Equations, inlining nested jit/custom-derivative calls (their bodies are run)."""
    total = 0
    for eqn in jaxpr.eqns:
        bodies = [v for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
        if eqn.primitive.name in ("pjit", "jit", "closed_call", "custom_jvp_call",
                                  "custom_vjp_call") and bodies:
            total += sum(count_equations(getattr(b, "jaxpr", b)) for b in bodies)
        else:
            total += 1
    return total


def jaxpr_sizes():
    """(model, variant) -> (inputs, outputs, equations) of each variant's jitted function."""
    sizes = {}
    for name in JAXPR_MODELS:
        calls = MODELS[name][0](name)
        for variant in JAXPR_VARIANTS:
            if variant in calls:
                jaxpr = jitted_jaxpr(calls[variant])
                sizes[name, variant] = (
                    len(jaxpr.invars), len(jaxpr.outvars), count_equations(jaxpr)
                )
    return sizes


def jaxpr_table(sizes):
    lines = [
        "| model | variant | jaxpr inputs | outputs | equations |",
        "|---|---|---:|---:|---:|",
    ]
    for (name, variant), (inputs, outputs, equations) in sizes.items():
        lines.append(f"| {name} | {variant} | {inputs} | {outputs} | {equations} |")
    return "\n".join(lines)


def interleaved_medians(calls, reps):
    """Median seconds per call of each variant, timed round-robin `reps` times; the
    order within a repetition is shuffled (fixed seed) so that no variant always runs
    right after the same neighbour."""
    for call in calls.values():
        jax.block_until_ready(call())
    names, rng = list(calls), random.Random(0)
    samples = {k: [] for k in names}
    for _ in range(reps):
        rng.shuffle(names)
        for k in names:
            start = time.perf_counter()
            jax.block_until_ready(calls[k]())
            samples[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in samples.items()}


def steady_medians(name, reps):
    """Medians of every variant of this model, each group interleaved separately."""
    build, groups = MODELS[name]
    calls = build(name)
    medians = {}
    for group in groups:
        medians |= interleaved_medians({k: calls[k] for k in group}, reps)
    return medians


def first_call(variant, name):
    """Seconds of the first forward call in this (fresh) process."""
    jax.config.update("jax_enable_compilation_cache", False)
    model, x, batched = make_model(name)
    model, forward = WRAPPERS[variant](model), forward_fn(batched)
    jax.block_until_ready(jax.jit(jnp.negative)(x))  # backend start-up, not timed
    start = time.perf_counter()
    jax.block_until_ready(forward(model, x))
    return time.perf_counter() - start


def first_call_medians(name, reps):
    """Median first-call seconds of each forward variant, in alternating processes."""
    samples = {"raw": [], "identity": [], "log": []}
    for _ in range(reps):
        for variant, runs in samples.items():
            command = [sys.executable, __file__, "--first-call", variant, name]
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            runs.append(float(result.stdout.split()[-1]))
    return {k: statistics.median(v) for k, v in samples.items()}


# (row, variant, baseline, target); "~1" targets are reported, not checked. "raw" and
# "grad raw" are each framework's plain model under `jax.jit` (Equinox: `eqx.filter_jit`).
STEADY_ROWS = [
    ("identity-hooked / raw jit forward", "identity", "raw", 1.02),
    ("identity-hooked / raw nnx.jit forward", "identity", "raw nnx.jit", 1.02),
    ("log-everything / raw jit forward", "log", "raw", 1.05),
    ("backward-logged grad step / plain grad step", "grad logged", "grad raw", 1.10),
    ("backward-logged grad step / plain nnx.jit(nnx.grad) step", "grad logged",
     "grad nnx.jit", 1.10),
    ("peex_interop / peex 0.0.3 (IdentityLog forward)", "log", "peex log", None),
    ("log-everything / native hk.intercept_methods log", "log", "native log", 1.05),
    ("log-everything / native nnx.capture(method_outputs=...) under jax.jit", "log",
     "capture log", 1.05),
    ("train step with activation_stats on every layer / without hooks", "train stats",
     "train plain", 1.10),
    ("10 train steps, activation_stats on every 10th (Recorder.due) / 10 plain steps",
     "train stats every 10", "train plain x10", 1.10),
    # Converted models only: the same ratios split at the unhooked converted model.
    ("identity-hooked / unhooked converted, both eqx.filter_jit", "identity", "unhooked",
     1.02),
    ("backward-logged / unhooked converted grad step, both eqx.filter_jit", "grad logged",
     "grad unhooked", 1.10),
    ("dispatch: unhooked converted eqx.filter_jit / raw jax.jit forward", "unhooked", "raw",
     None),
    ("dispatch: unhooked converted eqx.filter_jit grad / plain jax.jit grad",
     "grad unhooked", "grad raw", None),
]
FIRST_CALL_ROWS = [
    ("first call (trace+compile) identity-hooked / raw", "identity", "raw", 1.5),
    ("first call (trace+compile) log-everything / raw", "log", "raw", 1.5),
]
# Model -> (variants function, groups of variants interleaved together: forward apart
# from the heavier grad steps); peex 0.0.3 only hooks depth-1 attributes. A new
# framework adds its variants function and its models here.
FORWARD, GRAD = ["raw", "identity", "log"], ["grad raw", "grad logged"]
HAIKU_GROUPS = [[*FORWARD, "native log", "unhooked"], [*GRAD, "grad unhooked"]]
NNX_GROUPS = [
    [*FORWARD, "raw nnx.jit", "capture log", "unhooked"],
    [*GRAD, "grad nnx.jit", "grad unhooked"],
]
TRAIN = ["train stats", "train plain", *TRAIN_PARTS]
TRAIN_TEN = ["train stats every 10", "train plain x10"]
MODELS = {
    "seed MLP": (equinox_variants, [[*FORWARD, "peex log"], GRAD]),
    "MLP depth 12": (lambda name: equinox_variants(name) | train_variants(name),
                     [FORWARD, GRAD, TRAIN, TRAIN_TEN]),
    "transformer": (equinox_variants, [FORWARD, GRAD]),
    "flat 12 Linear": (equinox_variants, [["log", "peex log"]]),
    "hk MLP depth 13": (haiku_variants, HAIKU_GROUPS),
    "hk transformer": (haiku_variants, HAIKU_GROUPS),
    "nnx MLP depth 12": (nnx_variants, NNX_GROUPS),
    "nnx transformer": (nnx_variants, NNX_GROUPS),
}
FIRST_CALL_MODELS = ["seed MLP", "transformer"]


def span(values, digits=2):
    """`a` or `a-b` of the smallest and largest of `values`."""
    values = list(values)
    low, high = min(values), max(values)
    return f"{low:.{digits}f}" if f"{low:.{digits}f}" == f"{high:.{digits}f}" else (
        f"{low:.{digits}f}-{high:.{digits}f}"
    )


def ratios(steady, variant, baseline):
    """model -> median ratio variant / baseline, for the models that have both."""
    return {m: v[variant] / v[baseline] for m, v in steady.items()
            if variant in v and baseline in v}


def named(models):
    return ", ".join(models) if models else "none"


def findings(rows, steady, first, sizes, memory):
    """The findings section: every number and comparison in it is computed from this
    run's medians, jaxpr sizes and memory rows; prose that a run cannot check is marked
    with the date of the measurement behind it."""
    over = [r for r in rows if r[-1] == "over"]
    lines = [
        "## Findings",
        "",
        "Computed by `benchmarks/bench.py` from this run's numbers above.",
        "",
        f"- **Rows over target: {len(over)} of {sum(r[-1] != 'report' for r in rows)} "
        "checked rows.**",
    ]

    def size(model, variant):
        return sizes.get((model, variant))

    # Identity hooks: the compiled step against the call.
    same, differ = [], []
    for model in JAXPR_MODELS:
        base = size(model, "unhooked") or size(model, "raw")
        if size(model, "identity") and base:
            ident = size(model, "identity")
            (same if (ident[0], ident[2]) == (base[0], base[2]) else differ).append(model)
    dispatch = ratios(steady, "unhooked", "raw")
    hook_only = ratios(steady, "identity", "unhooked")
    parts = []
    if same or differ:
        parts.append(
            "The identity-hooked jaxpr has the same inputs and equations as the unhooked "
            f"(or raw) one for {named(same)}; it differs for {named(differ)}."
        )
    if dispatch and hook_only:
        parts.append(
            "Split of the converted models' identity-hooked / raw ratios "
            f"({span(ratios(steady, 'identity', 'raw')[m] for m in dispatch)}): "
            f"`eqx.filter_jit` dispatch of the unhooked converted model / raw `jax.jit` "
            f"{span(dispatch.values())}, identity-hooked / unhooked (both "
            f"`eqx.filter_jit`) {span(hook_only.values())}."
        )
    against_nnx_jit = ratios(steady, "identity", "raw nnx.jit")
    if against_nnx_jit:
        faster = all(r < 1 for r in against_nnx_jit.values())
        parts.append(
            f"Against `nnx.jit` the identity-hooked converted model runs at "
            f"{span(against_nnx_jit.values())} ({'faster' if faster else 'not always faster'})."
        )
    if parts:
        lines.append("- **Identity hooks in the compiled step.** " + " ".join(parts))

    # Log-everything: outputs, not equations.
    parts = []
    for model in JAXPR_MODELS:
        log, raw = size(model, "log"), size(model, "unhooked") or size(model, "raw")
        if not (log and raw):
            continue
        part = (f"{model}: {log[2]} equations against {raw[2]}, {log[1]} outputs against "
                f"{raw[1]}")
        for native in ("native log", "capture log"):
            if size(model, native):
                part += (f" (native log: {size(model, native)[2]} equations, "
                         f"{size(model, native)[1]} outputs)")
        parts.append(part)
    if parts:
        text = "- **Log-everything's jaxpr** (`eqx.filter_jit` adds one output, a marker): "
        text += "; ".join(parts) + "."
        native = ratios(steady, "log", "native log") | ratios(steady, "log", "capture log")
        if native:
            text += (f" Log-everything / native log: {span(native.values())}; the same "
                     f"models' unhooked dispatch ratio: "
                     f"{span(dispatch[m] for m in native if m in dispatch)}.")
        lines.append(text)

    # Backward: slots.
    parts = []
    for model in JAXPR_MODELS:
        logged, plain = size(model, "grad logged"), size(model, "grad unhooked") or size(
            model, "grad raw")
        if logged and plain:
            parts.append(f"{model}: +{logged[0] - plain[0]} inputs, "
                         f"+{logged[1] - plain[1]} outputs, +{logged[2] - plain[2]} equations")
    if parts:
        text = ("- **Backward-logged grad steps against the unhooked (or plain) grad "
                "step's jaxpr**: " + "; ".join(parts) + ".")
        grad_hook_only = ratios(steady, "grad logged", "grad unhooked")
        if grad_hook_only:
            text += (f" Backward-logged / unhooked grad step (both `eqx.filter_jit`): "
                     f"{span(grad_hook_only.values())}.")
        against = ratios(steady, "grad logged", "grad nnx.jit")
        if against:
            text += f" Against `nnx.jit(nnx.grad(...))`: {span(against.values())}."
        lines.append(text)

    # Training step: the statistics' share.
    for model, medians in steady.items():
        if "train plain" not in medians or "train stats" not in medians:
            continue
        plain = medians["train plain"]
        text = (f"- **Training step with `px.activation_stats()` on every layer ({model})**: "
                f"{medians['train stats'] / plain:.2f}x the plain step")
        # Each variant adds one statistic to the previous one (the last: the histogram).
        steps = [(k, f"+ {names[-1]}" if names else "identity hooks")
                 for k, names in TRAIN_PARTS.items() if k in medians]
        if steps:
            added, previous = [], plain
            for variant, label in [*steps, ("train stats", "+ hist")]:
                added.append(f"{label} {100 * (medians[variant] - previous) / plain:+.0f}%")
                previous = medians[variant]
            text += " (each part's cost, as a share of the plain step: " + ", ".join(added) + ")"
        if "train stats every 10" in medians:
            text += (f"; statistics on every 10th step (`Recorder(every=10).due`): "
                     f"{medians['train stats every 10'] / medians['train plain x10']:.2f}x "
                     "ten plain steps")
        lines.append(text + ".")
    if memory:
        fixed = [label for label, sizes_ in memory if len(set(sizes_)) == 1]
        growing = [label for label, sizes_ in memory if len(set(sizes_)) > 1]
        lines.append(f"- **Recorded statistics independent of the batch**: {named(fixed)}; "
                     f"growing with it: {named(growing)}.")
    first_ratios = {(m, v): f[v] / f["raw"] for m, f in first.items() for v in ("identity", "log")}
    if first_ratios:
        lines.append("- **First calls** (trace + compile + run) / raw: " + "; ".join(
            f"{v} {m} {r:.2f}" for (m, v), r in first_ratios.items()) + ".")
    lines.append(
        "- *Dated note, an earlier measurement, not from this run (2026-11-29, Equinox "
        "12-layer MLP, batch 256):* with a 40-bin histogram through `jnp.histogram` (a "
        "`searchsorted` loop plus a scatter-add) the statistics added about 220% to the "
        "plain step; `HistogramLog` bins directly and counts with `jnp.bincount` instead "
        "(identical counts, about 2x faster then)."
    )
    return "\n".join(lines) + "\n"


def row(spec, model, medians):
    """A table row, or `None` where this model has no such variants."""
    label, variant, baseline, target = spec
    if variant not in medians or baseline not in medians:
        return None
    ratio = medians[variant] / medians[baseline]
    status = "report" if target is None else ("ok" if ratio <= target else "over")
    target_text = "~1" if target is None else f"<= {target:.2f}"
    return (label, model, medians[variant], medians[baseline], ratio, target_text, status)


def table(rows):
    lines = [
        "| row | model | variant | baseline | ratio | target | status |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for label, model, variant, baseline, ratio, target, status in rows:
        lines.append(
            f"| {label} | {model} | {fmt(variant)} | {fmt(baseline)} | {ratio:.3f} "
            f"| {target} | {status} |"
        )
    return "\n".join(lines)


def memory_table(rows, batches=(32, 256)):
    lines = [
        "| recorded statistics of one training step (`px.activation_stats()`, every layer) "
        + "".join(f"| batch {b} " for b in batches) + "| independent of batch |",
        "|---" + "|---:" * len(batches) + "|---|",
    ]
    for label, sizes in rows:
        same = "yes" if len(set(sizes)) == 1 else "no"
        lines.append(f"| {label} " + "".join(f"| {n:,} B " for n in sizes) + f"| {same} |")
    return "\n".join(lines)


def fmt(seconds):
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} µs"


def header(reps, first_reps, wall):
    device = jax.devices()[0]
    return (
        "# Benchmarks\n\n"
        f"Machine: {device.platform.upper()} ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores), Python {platform.python_version()}, jax {jax.__version__}, "
        f"equinox {eqx.__version__}, dm-haiku {hk.__version__}, flax {flax.__version__}, "
        f"optax {optax.__version__}, date {datetime.date.today().isoformat()}; "
        f"the run took {wall:.0f} s.\n\n"
        "Method: ratios are measured within one run, variants interleaved round-robin "
        f"(each of {reps} repetitions times one call of every variant of a group in turn: "
        "a model's forward variants together, its grad steps together, order shuffled "
        "per repetition), "
        "medians reported; every call ends with `jax.block_until_ready` and every jitted "
        "function is compiled before timing. Forward: `eqx.filter_jit` of the model "
        "(batched models under `jax.vmap` inside the jitted function, batch "
        f"{BATCH}); grad step: `eqx.filter_jit(eqx.filter_grad(loss))`, loss = sum of "
        "squares of the output; weights are zeros (timings do not depend on values). "
        "First calls (trace + compile + run; imports, construction and backend start-up "
        f"excluded) are medians of {first_reps} fresh processes per variant, "
        "variants alternating. Models: seed MLP = `tests/models.py: MLP(1, 2, 1)`; "
        f"MLP depth 12 = `eqx.nn.MLP({WIDTH}, {WIDTH}, {WIDTH}, depth=12)`; transformer = "
        f"`Transformer(vocab=100, dim={WIDTH}, heads=4, num_blocks=4)` on 32 tokens; "
        "flat 12 Linear = 12 `eqx.nn.Linear` attributes at depth 1 (what peex 0.0.3 hooks).\n\n"
        "Haiku models (`hk.without_apply_rng(hk.transform(f))`, zero params; hooked "
        "variants wrap `px.from_haiku(transformed, params)` and run as above, without "
        "`jax.vmap`): hk MLP depth 13 = `hk.nets.MLP("
        f"[{WIDTH}] * 12 + [{WIDTH}])` on a ({BATCH}, {WIDTH}) batch; hk transformer = 4 "
        "pre-norm blocks (`hk.LayerNorm`, `hk.MultiHeadAttention(num_heads=4, "
        f"key_size={WIDTH // 4})`, `hk.LayerNorm`, `hk.nets.MLP([{4 * WIDTH}, {WIDTH}])` "
        "with gelu, residuals) in a Python loop, on a (32, "
        f"{WIDTH}) input. Haiku baselines are native, under `jax.jit`: raw = "
        "`jax.jit(transformed.apply)`; native log = `apply` inside "
        "`hk.intercept_methods` with an interceptor recording every `__call__` output "
        "into a dict keyed by `context.module.module_name`, returning `(out, dict)`; "
        "plain grad step = `jax.jit(jax.grad(loss))` of the params dict.\n\n"
        "Flax NNX models (state zeros, from `nnx.eval_shape`; hooked variants wrap "
        "`px.from_nnx(module)` and run as above, without `jax.vmap`): nnx MLP depth 12 "
        f"= 12 `nnx.Linear({WIDTH}, {WIDTH})` with relu in an `nnx.List`, on a ({BATCH}, "
        f"{WIDTH}) batch; nnx transformer = the Haiku transformer's twin: 4 pre-norm "
        "blocks (`nnx.LayerNorm`, `nnx.MultiHeadAttention(4, "
        f"{WIDTH}, decode=False)`, `nnx.LayerNorm`, `nnx.Sequential(nnx.Linear({WIDTH}, "
        f"{4 * WIDTH}), gelu, nnx.Linear({4 * WIDTH}, {WIDTH}))`, residuals) in an "
        f"`nnx.List` run by a Python loop, on a (32, {WIDTH}) input. NNX baselines are "
        "native: raw = `jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))` of "
        "`graphdef, state = nnx.split(module)`; raw nnx.jit = `nnx.jit(lambda m, x: "
        "m(x))(module, x)`; native log = `nnx.capture(module, nnx.Intermediate, "
        "method_outputs=nnx.Intermediate)(x)` inside the same `jax.jit` split/merge "
        "function; plain grad step = `jax.jit(jax.grad(loss))` of the split state, and "
        "`nnx.jit(nnx.grad(loss))(module, x)`.\n\n"
        "For converted (Haiku, NNX) models, unhooked = the converted model without hooks "
        "under `eqx.filter_jit`: its rows split each converted ratio into hook cost and "
        "`eqx.filter_jit`-vs-`jax.jit` dispatch cost. Training step (MLP depth 12): "
        "`eqx.filter_jit` of forward (under `jax.vmap`), `eqx.filter_value_and_grad` of "
        "the mean squared output and an `optax.adam` update, returning the updated model; "
        "with stats, the model is `px.ForwardHook(model, log_fn=px.activation_stats())` "
        "(every layer; mean, std, near-zero, 40-bin histogram) and the step returns the "
        "statistics pooled over the batch with `px.pool_stats`; the step is also timed "
        "with the statistics added one at a time (identity hooks, mean, std, near-zero) "
        "for the findings. \"~1\" targets are "
        "reported, not checked.\n\n"
        "Regenerate with `make bench` (`--quick` for a smoke test).\n"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="markdown file to write")
    parser.add_argument("--quick", action="store_true", help="few repetitions (smoke test)")
    parser.add_argument(
        "--first-call", nargs=2, metavar=("VARIANT", "MODEL"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.first_call:
        print(first_call(*args.first_call))
        return
    start = time.perf_counter()
    reps, first_reps = (20, 1) if args.quick else (1000, 3)
    steady = {model: steady_medians(model, reps) for model in MODELS}
    first = {model: first_call_medians(model, first_reps) for model in FIRST_CALL_MODELS}
    rows = [row(spec, model, m) for spec in STEADY_ROWS for model, m in steady.items()]
    rows += [row(spec, model, m) for spec in FIRST_CALL_ROWS for model, m in first.items()]
    rows = [r for r in rows if r is not None]
    memory, sizes = memory_rows(), jaxpr_sizes()
    text = "\n\n".join([
        table(rows),
        "Memory of the recorded statistics (`sum(x.nbytes for x in jax.tree.leaves(log))` "
        "of the log one training step returns):",
        memory_table(memory),
        "The jitted functions at the jaxpr level (`jax.make_jaxpr`; nested jit bodies "
        "inlined; `eqx.filter_jit` adds one output, a marker):",
        jaxpr_table(sizes),
        findings(rows, steady, first, sizes, memory),
    ])
    print(text)
    if args.out:
        wall = time.perf_counter() - start
        args.out.write_text(header(reps, first_reps, wall) + "\n" + text + "\n")


if __name__ == "__main__":
    main()
