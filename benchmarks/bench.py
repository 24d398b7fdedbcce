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
  `haiku_variants`) registered in `MODELS` with its groups; the rows in `STEADY_ROWS`
  apply to every model that has both of their variants. Haiku baselines are native:
  `jax.jit(transformed.apply)`, `hk.intercept_methods` logging, `jax.grad` of params.

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
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import peex

import peex_interop as px

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from models import MLP, Transformer  # noqa: E402

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


# (row, variant, baseline, target); "~1" targets are reported, not checked.
STEADY_ROWS = [
    ("identity-hooked / raw jit forward", "identity", "raw", 1.02),
    ("log-everything / raw jit forward", "log", "raw", 1.05),
    ("backward-logged grad step / plain grad step", "grad logged", "grad raw", 1.10),
    ("peex_interop / peex 0.0.3 (IdentityLog forward)", "log", "peex log", None),
    ("log-everything / native hk.intercept_methods log", "log", "native log", 1.05),
    # Haiku only: the same ratios split at the unhooked converted model.
    ("identity-hooked / unhooked from_haiku, both eqx.filter_jit", "identity", "unhooked", 1.02),
    ("backward-logged / unhooked from_haiku grad step, both eqx.filter_jit", "grad logged",
     "grad unhooked", 1.10),
    ("dispatch: unhooked from_haiku eqx.filter_jit / raw jax.jit forward", "unhooked", "raw",
     None),
    ("dispatch: unhooked from_haiku eqx.filter_jit grad / plain jax.jit grad", "grad unhooked",
     "grad raw", None),
]
FIRST_CALL_ROWS = [
    ("first call (trace+compile) identity-hooked / raw", "identity", "raw", 1.5),
    ("first call (trace+compile) log-everything / raw", "log", "raw", 1.5),
]
# Model -> (variants function, groups of variants interleaved together: forward apart
# from the heavier grad steps); peex 0.0.3 only hooks depth-1 attributes. A new
# framework adds its variants function and its models here.
FORWARD, GRAD = ["raw", "identity", "log"], ["grad raw", "grad logged"]
HAIKU_GROUPS = [FORWARD + ["native log", "unhooked"], GRAD + ["grad unhooked"]]
MODELS = {
    "seed MLP": (equinox_variants, [FORWARD + ["peex log"], GRAD]),
    "MLP depth 12": (equinox_variants, [FORWARD, GRAD]),
    "transformer": (equinox_variants, [FORWARD, GRAD]),
    "flat 12 Linear": (equinox_variants, [["log", "peex log"]]),
    "hk MLP depth 13": (haiku_variants, HAIKU_GROUPS),
    "hk transformer": (haiku_variants, HAIKU_GROUPS),
}
FIRST_CALL_MODELS = ["seed MLP", "transformer"]


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


def fmt(seconds):
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} µs"


def header(reps, first_reps, wall):
    device = jax.devices()[0]
    return (
        "# Benchmarks\n\n"
        f"Machine: {device.platform.upper()} ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores), Python {platform.python_version()}, jax {jax.__version__}, "
        f"equinox {eqx.__version__}, date {datetime.date.today().isoformat()}; "
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
        "plain grad step = `jax.jit(jax.grad(loss))` of the params dict; unhooked = "
        "the converted model without hooks under `eqx.filter_jit` (its rows split "
        "each Haiku ratio into hook cost and `eqx.filter_jit`-vs-`jax.jit` dispatch "
        "cost). \"~1\" targets are reported, not checked.\n\n"
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
    reps, first_reps = (20, 1) if args.quick else (1500, 5)
    steady = {model: steady_medians(model, reps) for model in MODELS}
    first = {model: first_call_medians(model, first_reps) for model in FIRST_CALL_MODELS}
    rows = [row(spec, model, m) for spec in STEADY_ROWS for model, m in steady.items()]
    rows += [row(spec, model, m) for spec in FIRST_CALL_ROWS for model, m in first.items()]
    text = table([r for r in rows if r is not None])
    print(text)
    if args.out:
        wall = time.perf_counter() - start
        args.out.write_text(header(reps, first_reps, wall) + "\n" + text + "\n")


if __name__ == "__main__":
    main()
