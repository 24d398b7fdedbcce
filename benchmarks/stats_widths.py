"""The statistics rows as a new user writes them, at three widths: a training step
(`optax.sgd`, `eqx.filter_jit`) of an Equinox MLP of 12 Linear layers with relu after
each, on a batch of 64, whose statistics are `px.activation_stats()` (or its mean, std
and near-zero alone) on every layer, pooled by `px.pool_stats`, against the same step
without hooks. Two ways of batching the per-example model: your own `jax.vmap` around
`px.ForwardHook(model, ...)` (the issue's idiom), and the model's own `jax.vmap`
inside its `__call__`, which the hooks thread and pool.

The variants of a width are timed in rounds (`rounds_until_stable`): each round calls
every variant as many times as fill about `ROUND_SECONDS`, one call of each per
repetition in a shuffled order, and a variant's value in a round is its median there
over the plain step's; rounds go on until every ratio's median has settled. Each row
reports that median, the smallest and largest round, and the rounds it took."""

import collections
import dataclasses
import random
import re
import statistics
import time
from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import libraries
import peex_interop as px
from harness import Variant, round_robin
from libraries import EqxMLP, inputs, random_like, use_sizes
from page import Row, fmt
from training_stats import stats_log

FULL_WIDTHS = (64, 256, 1024)
QUICK_WIDTHS = (16, 32)
# The goals, at the width the issue measured (256): the histogram's, and mean, std and
# near-zero's; the other widths show how the overhead changes with a layer's size.
GOAL_WIDTH = 256
GOALS = {"stats": 1.15, "stats no hist": 1.03}


@dataclasses.dataclass(frozen=True)
class Rounds:
    """How long the rounds go on: at least `least`, at most `most`; settled when the
    median over all rounds is within `settled` (relative) of the median without the
    last `window` rounds, for every ratio."""

    least: int
    most: int
    window: int = 5
    settled: float = 0.005
    seconds: float = 0.3  # per round


FULL_ROUNDS = Rounds(least=15, most=45)
QUICK_ROUNDS = Rounds(least=2, most=2, seconds=0.02)


@dataclasses.dataclass
class Ratio:
    """A variant's per-round ratios to the plain step: their median, extremes, and the
    rounds it took to settle (None: not within the most rounds)."""

    variant_seconds: float
    plain_seconds: float
    median: float
    low: float
    high: float
    rounds: int
    settled_after: int | None


def per_example_mlp(width):
    """The bench's Equinox MLP (`libraries.EqxMLP`, NumPy-drawn weights) at `width`, on
    one example."""
    sizes = libraries.S
    use_sizes(dataclasses.replace(sizes, width=width))
    try:
        return random_like(eqx.filter_eval_shape(lambda: EqxMLP(key=jax.random.key(0))))
    finally:
        use_sizes(sizes)


class Batched(eqx.Module):
    """The same MLP batching itself: its own `jax.vmap`, inside the hooked model."""

    model: EqxMLP

    def __call__(self, x):
        return jax.vmap(self.model)(x)


STATISTICS = {"stats": partial(stats_log, True), "stats no hist": partial(stats_log, False)}
IDIOMS = {
    "your vmap": "`jax.vmap(px.ForwardHook(model, log_fn=...))(x)`, then `px.pool_stats(log)`",
    "the model's own vmap": "`px.ForwardHook(model, log_fn=...)(x)`, the model calling `jax.vmap` itself "
    "(the hooks pool over it: no `px.pool_stats`)",
}


def step_of(model, loss, optimizer):
    """One jitted SGD step on the mean squared output; returns the updated model, the
    optimizer's state and the statistics."""

    @eqx.filter_jit
    def step(model, opt_state, x):
        (_, log), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model, x)
        updates, opt_state = optimizer.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, log

    return step


def width_variants(width):
    """The training steps at `width`: plain (twice: the second, "plain (A/A)", is the
    noise floor), and each idiom with each set of statistics."""
    per_example = per_example_mlp(width)
    x = inputs((libraries.S.mlp_batch, width))
    optimizer = optax.sgd(1e-3)

    def plain_loss(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2), {}

    def your_vmap_loss(hooked, x):
        out, log = jax.vmap(hooked)(x)
        return jnp.mean(out**2), px.pool_stats(log)

    def own_vmap_loss(hooked, x):
        out, log = hooked(x)
        return jnp.mean(out**2), log

    models = {"plain": (per_example, plain_loss), "plain (A/A)": (per_example, plain_loss)}
    for name, statistic in STATISTICS.items():
        models[f"your vmap, {name}"] = (px.ForwardHook(per_example, log_fn=statistic()), your_vmap_loss)
        models[f"the model's own vmap, {name}"] = (
            px.ForwardHook(Batched(per_example), log_fn=statistic()), own_vmap_loss
        )
    variants = {}
    for variant, (model, loss) in models.items():
        opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        # A step of its own per variant: one compiled program each, as a user's would be.
        step = step_of(model, loss, optimizer)
        variants[variant] = Variant(partial(step, model, opt_state, x), updated_parameters)
    return variants


def updated_parameters(result):
    model = result[0]
    model = model.model if isinstance(model, px.ForwardHook) else model
    model = model.model if isinstance(model, Batched) else model
    return eqx.filter(model, eqx.is_inexact_array)


def rounds_until_stable(variants, rounds, seed=0):
    """`{variant: Ratio}` against "plain", timed in rounds (module docstring)."""
    calls = {name: v.call for name, v in variants.items()}
    start = time.perf_counter()
    for call in calls.values():
        jax.block_until_ready(call())
    repetitions = max(3, round(rounds.seconds / (time.perf_counter() - start)))
    names, rng = list(calls), random.Random(seed)
    seconds = {name: [] for name in names}
    ratios = {name: [] for name in names if name != "plain"}
    settled = dict.fromkeys(ratios)
    for done in range(1, rounds.most + 1):
        samples = round_robin(calls, names, rng, repetitions)
        for name in names:
            seconds[name].append(statistics.median(samples[name]))
        for name in ratios:
            ratios[name].append(seconds[name][-1] / seconds["plain"][-1])
            if settled[name] is None and done >= max(rounds.least, rounds.window + 1):
                now, before = statistics.median(ratios[name]), statistics.median(ratios[name][: -rounds.window])
                if abs(now / before - 1) <= rounds.settled:
                    settled[name] = done
        if done >= rounds.least and all(after is not None for after in settled.values()):
            break
    plain = statistics.median(seconds["plain"])
    return {
        name: Ratio(statistics.median(seconds[name]), plain, statistics.median(r), min(r), max(r), len(r),
                    settled[name])
        for name, r in ratios.items()
    }


def width_rows(width, measured):
    """The rows of one width: the A/A noise floor, and each idiom's statistics over the
    plain step; your vmap's at `GOAL_WIDTH` held to `GOALS` (the issue's idiom), the
    rest reported."""
    model = f"Equinox MLP {width} (12 x Linear, batch {libraries.S.mlp_batch}, SGD)"
    rows = [_row("A/A: the plain step timed twice (noise floor)", model, measured["plain (A/A)"], None)]
    for idiom in IDIOMS:
        for name, label in (("stats no hist", "mean/std/near-zero"), ("stats", "activation_stats() with histogram")):
            target = GOALS[name] if width == GOAL_WIDTH and idiom == "your vmap" else None
            rows.append(_row(f"train step, {idiom}, {label} / plain", model, measured[f"{idiom}, {name}"], target))
    return rows


def _row(label, model, ratio, target):
    settled = (f"settled after {ratio.settled_after} rounds" if ratio.settled_after is not None
               else f"not settled in {ratio.rounds} rounds")
    spread = f"rounds: min {ratio.low:.3f}, max {ratio.high:.3f} over {ratio.rounds}; {settled}"
    if target is not None and ratio.high > target:
        spread += f"; the largest round is over the goal {target:.2f}"
    return Row("statistics", label, model, fmt(ratio.variant_seconds), fmt(ratio.plain_seconds), ratio.median,
               target, why=spread)


def width_groups(widths, rounds):
    """`{width: {variant: Ratio}}`, `{width: {variant: updated parameters}}` (each
    variant's first call, to check the statistics leave the step unchanged), and the
    kernels your vmap's statistics add to the compiled step (`kernels_added`) at the
    goal width (the widest, where it is not measured)."""
    measured, outputs, kernels = {}, {}, {}
    counted = GOAL_WIDTH if GOAL_WIDTH in widths else max(widths)
    for width in widths:
        variants = width_variants(width)
        outputs[width] = {name: v.output(jax.block_until_ready(v.call())) for name, v in variants.items()}
        measured[width] = rounds_until_stable(variants, rounds)
        if width == counted:
            kernels = {"width": width} | kernels_added(variants)
    return measured, outputs, kernels


def kernels_added(variants):
    """`{statistics: Counter}`: the kernels of the compiled step with your vmap's
    statistics less the plain step's, by who runs them and what they compute
    (`compiled_kernels`)."""
    plain = compiled_kernels(variants["plain"])
    added = {}
    for name in STATISTICS:
        kernels = compiled_kernels(variants[f"your vmap, {name}"])
        kernels.subtract(plain)
        added[name] = collections.Counter({kind: n for kind, n in kernels.items() if n})
    return added


# What a fusion computes, by the first of these operations it holds, else its root's.
MAIN_OPERATIONS = ("dot", "scatter", "reduce", "reduce-window")


def compiled_kernels(variant):
    """The kernels of a variant's compiled step: the entry computation's fusions, by who
    runs them (XLA, or YNNPACK for the fusions XLA:CPU hands it) and what they compute
    (`MAIN_OPERATIONS`: `YNNPACK reduce` is a reduction, `XLA convert` an elementwise
    kernel ending in a conversion), and the operations outside any fusion."""
    call = variant.call
    text = call.func.lower(*call.args, **call.keywords).compile().compiled.as_text()
    computations = dict(re.findall(r"^%([\w.\-]+) .*?\{\n((?:.*\n)*?)\}", text, re.M))
    kernels = collections.Counter()
    for line in text[text.index("\nENTRY"):].splitlines():
        operation = re.search(r"= \S+ ([\w\-]+)\(", line)
        if operation is None or operation.group(1) in ("parameter", "constant", "bitcast", "get-tuple-element",
                                                        "tuple"):
            continue
        if operation.group(1) == "fusion":
            body = computations.get(re.search(r"calls=%([\w.\-]+)", line).group(1), "")
            held = set(re.findall(r"= \S+ ([\w\-]+)\(", body))
            root = re.search(r"ROOT %\S+ = \S+ ([\w\-]+)\(", body)
            main = next((op for op in MAIN_OPERATIONS if op in held), root.group(1) if root else "fusion")
            kernels[f"{'YNNPACK' if '__ynn_fusion' in line else 'XLA'} {main}"] += 1
        else:
            kernels[operation.group(1)] += 1
    return kernels


STATS_WIDTHS_TEXT = (
    "Statistics at three widths: a training step (`eqx.filter_jit` of "
    "`eqx.filter_value_and_grad` of the mean squared output and an `optax.sgd` update) of an "
    "Equinox MLP of 12 Linear layers of width w with relu after each, per example, on a batch of {batch}, with "
    "`px.activation_stats()` on every layer (or its mean, std and near-zero alone) against the "
    "same step without hooks; batched " + " or ".join(IDIOMS.values()) + ". Timed in rounds: each "
    "round calls every variant as many times as fill about {seconds:g} s, one call of each per "
    "repetition in a shuffled order (fixed seed); a row's ratio is the median over the rounds of "
    "each round's median over the plain step's; rounds go on (at least {least}, at most {most}) "
    "until every ratio's median moves less than {settled:.1%} over the last {window} rounds. The why "
    "column gives the smallest and largest round and the rounds it took. Goals, for your vmap at "
    "width {goal}: {goal_hist:.2f} with the histogram, {goal_plain:.2f} without. No CPU setting is "
    "applied: one core (`taskset -c 1`) narrowed the rounds' spread but changed what is measured (the "
    "statistics could no longer run beside the matmuls), and `NPROC=1` was no steadier.\n\n"
)


def stats_widths_text(rounds):
    return STATS_WIDTHS_TEXT.format(
        batch=libraries.S.mlp_batch, seconds=rounds.seconds, least=rounds.least, most=rounds.most,
        settled=rounds.settled, window=rounds.window, goal=GOAL_WIDTH, goal_hist=GOALS["stats"],
        goal_plain=GOALS["stats no hist"],
    )
