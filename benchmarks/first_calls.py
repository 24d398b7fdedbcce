"""The compile rows: first calls (trace + lower, XLA compile, run) of a scanned
transformer at two depths, raw and hooked, each timed in a fresh process
(`first_call.py`), and the size of each variant's jaxpr."""

import statistics
import subprocess
import sys
from functools import partial
from pathlib import Path

import libraries
from first_call import FORWARDS, WRAPPERS, scanned_forward, scanned_transformer
from harness import jaxpr_size
from page import Row, fmt

COMPILE_DEPTHS = (4, 64)


def first_calls(reps, parallel):
    """(variant, depth) -> median `[lower, compile, run]` seconds over `reps` fresh
    processes (`first_call.py`) per variant, variants alternating; with `parallel`
    (smoke runs) all processes run at once."""
    script = str(Path(__file__).with_name("first_call.py"))
    S = libraries.S
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


def scanned_sizes():
    """`("scanned L=depth", variant) -> jaxpr_size` of each variant's forward, at both
    depths."""
    S, sizes = libraries.S, {}
    for depth in COMPILE_DEPTHS:
        model, tokens = scanned_transformer(depth, S.dim, S.heads, S.batch, S.seq)
        for variant, wrap in WRAPPERS.items():
            forward_ = partial(FORWARDS.get(variant, scanned_forward), wrap(model), tokens)
            sizes[f"scanned L={depth}", variant] = jaxpr_size(forward_)
    return sizes


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


def first_call_table(first):
    lines = ["| scanned transformer | variant | lower (trace) | XLA compile | run | total |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| L = {d} | {v} | " + " | ".join(fmt(t) for t in [*parts, sum(parts)]) + " |"
              for (v, d), parts in first.items()]
    return "\n".join(lines)
