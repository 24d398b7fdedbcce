"""How the bench measures a call: its steady-state time among the variants of its group
(`interleaved`, within a `Budget`), its first call on empty caches (`timed`, and
`median_ratio` over alternated rounds), its output against the raw call's
(`max_abs_diff`), and the size of the jaxpr it runs (`jaxpr_size`)."""

import dataclasses
import gc
import math
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class Variant:
    """A zero-argument jitted call, and how to read the model's output from its result."""

    call: Callable[[], Any]
    output: Callable[[Any], Any] = lambda result: result


def hooked_output(result):
    return result[0]


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
    calls = {k: v.call for k, v in variants.items()}
    samples = round_robin(calls, list(variants), random.Random(0), reps)
    return {k: statistics.median(v) for k, v in samples.items()}, outputs, reps


def round_robin(calls, names, rng, repetitions):
    """`{name: seconds of each call}`: `repetitions` times, one call of each of `calls`,
    in an order `rng` shuffles `names` into (the list, kept shuffled for the next)."""
    samples = {name: [] for name in names}
    for _ in range(repetitions):
        rng.shuffle(names)
        for name in names:
            begin = time.perf_counter()
            jax.block_until_ready(calls[name]())
            samples[name].append(time.perf_counter() - begin)
    return samples


@dataclasses.dataclass
class Budget:
    """Seconds of timing per group, and the repetitions' bounds."""

    forward: float
    tiny: float
    train: float
    first_call_reps: int
    min_reps: int = 3
    max_reps: int = 5000


# About 7 minutes on 2 CPU cores: 5 fresh processes per first-call variant (~150 s; 3 gave
# depth growths that moved by 20% between runs),
# traces and compilations (~60 s), and these timing budgets (~170 s).
FULL = Budget(forward=10.0, tiny=3.0, train=15.0, first_call_reps=5)
QUICK = Budget(forward=0.1, tiny=0.1, train=0.1, first_call_reps=1, min_reps=2)


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


def rounds_text(rounds):
    return f"the median ratio of {rounds} alternated rounds" if rounds > 1 else "one round"


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
