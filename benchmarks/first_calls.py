"""The compile rows: first calls (trace + lower, XLA compile, run) of a scanned
transformer at two depths, raw and hooked, each timed in a fresh process
(`first_call.py`), and the size of each variant's jaxpr."""

import re
import statistics
import subprocess
import sys
from functools import partial
from pathlib import Path

import libraries
from first_call import FORWARDS, WRAPPERS, scanned_forward, scanned_transformer
from harness import jaxpr_size
from page import Row, fmt, signed

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


def same_programs():
    """`{depth: whether the identity-hooked forward lowers to the raw forward's
    program}` (StableHLO text, less source locations and result names): then XLA
    compiles the same program and runs the same code, and only tracing differs."""
    S, same = libraries.S, {}
    for depth in COMPILE_DEPTHS:
        model, tokens = scanned_transformer(depth, S.dim, S.heads, S.batch, S.seq)
        raw, identity = (scanned_forward.lower(WRAPPERS[v](model), tokens).as_text() for v in ("raw", "identity"))
        same[depth] = _program_text(raw) == _program_text(identity)
    return same


def _program_text(text):
    return re.sub(r"loc\([^)]*\)|jax.result_info = \"[^\"]*\"", "", text)


def compile_rows(first, sizes, same):
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
            # The log's own values cost what they cost a hand-written pass: held to that
            # pass below, reported against raw.
            rows.append(Row("compile", f"first call, {variant}-hooked / raw, L = {depth}",
                            f"Equinox scanned transformer L={depth}",
                            fmt(total[variant, depth]), fmt(total["raw", depth]),
                            total[variant, depth] / total["raw", depth], 1.3 if variant == "identity" else None,
                            why=why))
    low, high = COMPILE_DEPTHS
    for depth in COMPILE_DEPTHS:
        rows.append(Row("compile", f"first call, log-hooked / the same outputs returned by a hand-written "
                        f"forward pass, L = {depth}", f"Equinox scanned transformer L={depth}",
                        fmt(total["log", depth]), fmt(total["by_hand", depth]),
                        total["log", depth] / total["by_hand", depth], 1.1 if depth == high else None,
                        why=parts_text(first, "log", "by_hand", depth)))
    growth = {variant: total[variant, high] / total[variant, low] for variant in WRAPPERS}
    program = ("the same program as raw (StableHLO identical at both depths: XLA compiles and runs the same code, "
               "only tracing differs); " if all(same.values()) else
               f"NOT the raw program at L = {[d for d, s in same.items() if not s]}; ")
    rows.append(Row("compile", f"depth growth of first call: identity-hooked / raw (L = {high} over L = {low})",
                    "Equinox scanned transformer", f"{growth['identity']:.2f}x", f"{growth['raw']:.2f}x",
                    growth["identity"] / growth["raw"], 1.05,
                    why=program + parts_text(first, "identity", "raw", low) + "; "
                        + parts_text(first, "identity", "raw", high)))
    rows.append(Row("compile", f"depth growth of first call: log-hooked / hand-written pass returning the same "
                    f"values (L = {high} over L = {low})", "Equinox scanned transformer",
                    f"{growth['log']:.2f}x", f"{growth['by_hand']:.2f}x", growth["log"] / growth["by_hand"], 1.1,
                    why=f"the log grows with L: {values[high]:,} values at L = {high}, {values[low]:,} at L = {low}; "
                        f"against raw's growth: {growth['log'] / growth['raw']:.2f}x"))
    return rows


def parts_text(first, variant, baseline, depth):
    """Where a first call's time goes against another's: each part's difference."""
    parts = zip(("trace + lower", "XLA compile", "run"), first[variant, depth], first[baseline, depth], strict=True)
    return f"L = {depth}, {variant} - {baseline}: " + ", ".join(
        f"{name} {signed(ours - theirs)}" for name, ours, theirs in parts
    )


def first_call_table(first):
    lines = ["| scanned transformer | variant | lower (trace) | XLA compile | run | total |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| L = {d} | {v} | " + " | ".join(fmt(t) for t in [*parts, sum(parts)]) + " |"
              for (v, d), parts in first.items()]
    return "\n".join(lines)
