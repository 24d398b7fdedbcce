"""The page's rows and tables: a `Row` per ratio or difference, with its target and
status, and the markdown tables the page is made of."""

import dataclasses


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


def jaxpr_table(sizes):
    lines = [
        "| model | variant | jaxpr inputs | outputs | equations | output values |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {m} | {v} | {i} | {o} | {e} | {n:,} |" for (m, v), (i, o, e, n) in sizes.items()]
    return "\n".join(lines)
