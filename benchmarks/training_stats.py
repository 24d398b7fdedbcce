"""The statistics rows: a training step with `px.activation_stats()` on every layer
(with and without its histogram) against the plain step, in each library; ten steps
with statistics on every 10th (`px.Recorder`) against ten plain ones; and the bytes of
the statistics a transformer forward returns. (At three widths, as a new user writes
it: `stats_widths.py`.)"""

import contextlib
import math
from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import libraries
import peex_interop as px
from harness import Variant
from libraries import BUILDERS, DEPTH, LIBRARIES, forward, input_shape, inputs
from page import Row, ratio_row


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
    S = libraries.S
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


def train_rows(library, medians, sizes):
    """The statistics rows of one library, each with what this run measured of its
    parts: ten off-steps and ten due steps of `Recorder.when_due` (decided in the
    compiled step, or on the host) against ten plain steps."""
    model, S = f"{library} MLP", libraries.S
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


def memory_table(memory):
    lines = [
        "| transformer statistics of one forward (`activation_stats`, every layer) "
        + "".join(f"| batch {b}, seq {s} " for b, s in memory_shapes()) + "|",
        "|---" + "|---:" * len(memory_shapes()) + "|",
    ]
    lines += [f"| {lib} " + "".join(f"| {n:,} B " for n in sizes) + "|" for lib, sizes in memory.items()]
    return "\n".join(lines)
