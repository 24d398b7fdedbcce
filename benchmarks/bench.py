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
  re-run with `--first-call VARIANT MODEL`; imports and model construction excluded,
  persistent compilation cache off), raw and hooked processes alternating.

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
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
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
    """`(model, input, batched)`; a batched model is called as `jax.vmap(model)(x)`."""
    key, x_key = jax.random.split(jax.random.key(0))
    batch = jax.random.normal(x_key, (BATCH, WIDTH))
    if name == "seed MLP":
        return MLP(1, 2, 1, key=key), jax.random.normal(x_key, (1,)), False
    if name == "MLP depth 12":
        return eqx.nn.MLP(WIDTH, WIDTH, WIDTH, depth=12, key=key), batch, True
    if name == "transformer":
        model = Transformer(vocab=100, dim=WIDTH, heads=4, num_blocks=4, key=key)
        return model, jax.random.randint(x_key, (32,), 0, 100), False
    if name == "flat 12 Linear":
        return Flat12(key=key), batch, True
    raise ValueError(f"unknown model {name!r}")


def forward_fn(batched):
    return eqx.filter_jit(lambda m, x: jax.vmap(m)(x) if batched else m(x))


def grad_fn(batched):
    def loss(m, x):
        return jnp.sum((jax.vmap(m)(x) if batched else m(x)) ** 2)

    return eqx.filter_jit(eqx.filter_grad(loss))


def variants(name):
    """Variant name -> zero-argument call, for this model."""
    model, x, batched = make_model(name)
    forward, grad = forward_fn(batched), grad_fn(batched)
    example = x[0] if batched else x
    identity = px.ForwardHook(model)
    logged = px.ForwardHook(model, log_fn=px.IdentityLog())
    backward = px.BackwardHook(model, log_fn=px.IdentityLog()).init(example)
    theirs = peex.ForwardHook(model, log_fn=peex.IdentityLog())
    return {
        "raw": lambda: forward(model, x),
        "identity": lambda: forward(identity, x),
        "log": lambda: forward(logged, x),
        "grad raw": lambda: grad(model, x),
        "grad logged": lambda: grad(backward, x),
        "peex log": lambda: forward(theirs, x),
    }


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
    calls = variants(name)
    medians = {}
    for group in GROUPS[name]:
        medians |= interleaved_medians({k: calls[k] for k in group}, reps)
    return medians


def first_call(variant, name):
    """Seconds of the first forward call in this (fresh) process."""
    jax.config.update("jax_enable_compilation_cache", False)
    model, x, batched = make_model(name)
    if variant == "identity":
        model = px.ForwardHook(model)
    elif variant == "log":
        model = px.ForwardHook(model, log_fn=px.IdentityLog())
    jax.block_until_ready(x)
    forward = forward_fn(batched)
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
]
FIRST_CALL_ROWS = [
    ("first call (trace+compile) identity-hooked / raw", "identity", "raw", 1.5),
    ("first call (trace+compile) log-everything / raw", "log", "raw", 1.5),
]
# Model -> groups of variants interleaved together (forward apart from the heavier grad
# steps); peex 0.0.3 only hooks depth-1 attributes.
FORWARD, GRAD = ["raw", "identity", "log"], ["grad raw", "grad logged"]
GROUPS = {
    "seed MLP": [FORWARD + ["peex log"], GRAD],
    "MLP depth 12": [FORWARD, GRAD],
    "transformer": [FORWARD, GRAD],
    "flat 12 Linear": [["log", "peex log"]],
}
FIRST_CALL_MODELS = ["seed MLP", "transformer"]


def row(spec, model, medians):
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
        f"`make bench` took {wall:.0f} s.\n\n"
        "Method: ratios are measured within one run, variants interleaved round-robin "
        f"(each of {reps} repetitions times one call of every variant of a group in turn: "
        "a model's forward variants together, its grad steps together, order shuffled "
        "per repetition), "
        "medians reported; every call ends with `jax.block_until_ready` and every jitted "
        "function is compiled before timing. Forward: `eqx.filter_jit` of the model "
        "(batched models under `jax.vmap` inside the jitted function, batch "
        f"{BATCH}); grad step: `eqx.filter_jit(eqx.filter_grad(loss))`, loss = sum of "
        "squares of the output. First calls (trace + compile + run, imports and "
        f"construction excluded) are medians of {first_reps} fresh processes per variant, "
        "variants alternating. Models: seed MLP = `tests/models.py: MLP(1, 2, 1)`; "
        f"MLP depth 12 = `eqx.nn.MLP({WIDTH}, {WIDTH}, {WIDTH}, depth=12)`; transformer = "
        f"`Transformer(vocab=100, dim={WIDTH}, heads=4, num_blocks=4)` on 32 tokens; "
        "flat 12 Linear = 12 `eqx.nn.Linear` attributes at depth 1 (what peex 0.0.3 hooks).\n\n"
        "Regenerate with `make bench` (`--quick` for a smoke test).\n"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="markdown file to write")
    parser.add_argument("--quick", action="store_true", help="few repetitions (smoke test)")
    parser.add_argument("--first-call", nargs=2, metavar=("VARIANT", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_call:
        print(first_call(*args.first_call))
        return
    start = time.perf_counter()
    reps, first_reps = (20, 1) if args.quick else (1000, 5)
    steady = {model: steady_medians(model, reps) for model in GROUPS}
    first = {model: first_call_medians(model, first_reps) for model in FIRST_CALL_MODELS}
    rows = [row(spec, model, medians) for spec in STEADY_ROWS for model, medians in steady.items()]
    rows += [row(spec, model, medians) for spec in FIRST_CALL_ROWS for model, medians in first.items()]
    text = table([r for r in rows if r is not None])
    print(text)
    if args.out:
        wall = time.perf_counter() - start
        args.out.write_text(header(reps, first_reps, wall) + "\n" + text + "\n")


if __name__ == "__main__":
    main()
