"""The page's findings: what this run's medians, jaxprs, flatten times, first-call parts
and memory rows show, each number computed from them."""

from first_calls import COMPILE_DEPTHS
from libraries import DEPTH, LIBRARIES
from page import fmt, signed


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


def widths_finding(widths):
    """How the statistics' share of the step changes with the layers' width."""
    parts = []
    for width, measured in widths.items():
        ratios = ", ".join(
            f"{idiom} {measured[f'{idiom}, stats no hist'].median:.3f} / {measured[f'{idiom}, stats'].median:.3f}"
            for idiom in ("your vmap", "the model's own vmap")
        )
        parts.append(f"width {width} (plain step {fmt(measured['plain (A/A)'].plain_seconds)}): {ratios}")
    return ("- **Statistics by width** (the step with mean/std/near-zero / with the histogram, over the "
            "plain step): " + "; ".join(parts) + ".")


def kernels_finding(kernels):
    """What the statistics add to the compiled step, kernel by kernel (`kernels_added`)."""
    parts = []
    for name, label in (("stats no hist", "mean/std/near-zero"), ("stats", "with the histogram")):
        added = kernels[name]
        listed = ", ".join(f"{kind} {count:+}" for kind, count in added.most_common())
        parts.append(f"{label}: {sum(added.values()):+} ({sum(added.values()) / DEPTH:.1f} per layer): {listed}")
    text = (f"- **Kernels the statistics add** to the compiled training step (width {kernels['width']}, your "
            f"vmap, {DEPTH} layers; by who runs them and what they compute; XLA:CPU runs them one after "
            "another, a `conditional` the kernels of its branch): " + "; ".join(parts) + ".")
    # Said only where this run's kernels show it: three reductions a layer, each fed by
    # XLA kernels of their own (the centred values, the near-zero test).
    no_hist = kernels["stats no hist"]
    if no_hist["YNNPACK reduce"] >= 3 * DEPTH and min(no_hist["XLA subtract"], no_hist["XLA convert"]) >= DEPTH:
        text += (" Each of a layer's three sums is a YNNPACK reduction of its own, which reads its input from "
                 "memory: the elementwise work feeding them (the centred values, the near-zero test) runs "
                 "first as XLA kernels of its own, which write the layer's values out.")
    return text


def findings(rows, steady, sizes, flatten, first, memory, unpooled, widths, kernels):
    """The findings: every number comes from this run (medians, jaxprs, flatten times,
    first-call parts, memory, the statistics at three widths and their kernels)."""
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
    lines.append(widths_finding(widths))
    lines.append(kernels_finding(kernels))

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
