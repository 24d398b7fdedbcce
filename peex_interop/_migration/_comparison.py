"""`Comparison`: the per-layer differences of two implementations (`px.compare`)."""

import dataclasses
import itertools

from .._diagnostics import AbstractTabular, Table
from ._alignment import Alignment


@dataclasses.dataclass(frozen=True)
class ComparisonRow:
    """One aligned layer of a `px.compare`: the largest differences of its outputs
    (and cotangents, with `cotangents=True`; else `None`), and whether it diverges."""

    path_a: str
    path_b: str
    max_abs: float
    max_rel: float
    cotangent_max_abs: float | None
    cotangent_max_rel: float | None
    diverged: bool
    # For a layer of a scanned stack: the first step at which it diverges (None if it
    # does not, or is not in a stack).
    first_step: int | None = None
    # Diverged in its cotangent only, its output agreeing: a layer upstream of a
    # wrong one receives a wrong cotangent from it, without being wrong itself.
    cotangent_only: bool = False
    # With `px.compare(..., steps=)`: the call (decode step) this row compares.
    step: int | None = None


@dataclasses.dataclass(frozen=True, repr=False)
class Comparison(AbstractTabular):
    """Per-layer differences of two implementations, in model a's call order; shows as
    a table (`print`, rich, notebooks)."""

    rows: tuple[ComparisonRow, ...]
    alignment: Alignment
    tolerance: float

    @property
    def first_divergence(self) -> ComparisonRow | None:
        """The first layer in call order whose output diverges; inside a scanned stack,
        whose layers all run at every step, the one that diverges at the earliest step
        (a layer wrong from step 0 makes the stack's first layer diverge from step 1).

        Outputs rank first: a wrong layer changes the cotangents of every layer before
        it, whose outputs agree (`ComparisonRow.cotangent_only`). Only where every
        output agrees is it a cotangent divergence: the last one in call order, where
        the backward pass (which runs in reverse call order) first goes wrong, between
        that layer and the next.
        """
        diverged = lambda row: row.diverged and not row.cotangent_only  # noqa: E731
        first = next((i for i, row in enumerate(self.rows) if diverged(row)), None)
        if first is None:
            # Calls of several steps run one after the other: the earliest step's.
            step = next((row.step for row in self.rows if row.diverged), None)
            return next((row for row in reversed(self.rows) if row.diverged and row.step == step), None)
        if self.rows[first].first_step is None:
            return self.rows[first]
        step = self.rows[first].step
        stack = itertools.takewhile(
            lambda row: row.step == step and (row.first_step is not None or not diverged(row)), self.rows[first:]
        )
        return min((row for row in stack if diverged(row)), key=lambda row: row.first_step or 0)

    @property
    def cotangent_only_rows(self) -> tuple[ComparisonRow, ...]:
        """The layers whose outputs agree and whose cotangents diverge, in call order."""
        return tuple(row for row in self.rows if row.cotangent_only)

    def _table(self) -> Table:
        first = self.first_divergence

        def mark(row: ComparisonRow) -> str:
            if row is first:
                return "<- first divergence" + (" (cotangent only)" if row.cotangent_only else "")
            return ("diverged (cotangent only)" if row.cotangent_only else "diverged") if row.diverged else ""

        steps = len({row.step for row in self.rows}) if self.rows and self.rows[0].step is not None else None
        if first is None:
            caption = f"all {len(self.rows)} layers agree within {self.tolerance:g}"
            if steps is not None:
                caption = f"all {len(self.rows) // steps} layers agree within {self.tolerance:g} at {steps} steps"
        else:
            caption = f"first divergence at {first.path_a} -> {first.path_b}"
            if first.step is not None:
                caption += f" at step {first.step}"
            if first.cotangent_only:
                caption += " (cotangent only: every output agrees)"
            elif self.cotangent_only_rows:
                caption += f"; {len(self.cotangent_only_rows)} layers diverge in their cotangents only"
        stepped = ("step",) if steps is not None else ()
        return Table(
            (*stepped, "layer (a)", "layer (b)", "max abs", "max rel", "ct max abs", "ct max rel", ""),
            tuple(
                (*((str(r.step),) if stepped else ()), r.path_a, r.path_b, f"{r.max_abs:.2e}", f"{r.max_rel:.2e}",
                 "" if r.cotangent_max_abs is None else f"{r.cotangent_max_abs:.2e}",
                 "" if r.cotangent_max_rel is None else f"{r.cotangent_max_rel:.2e}",
                 mark(r))
                for r in self.rows
            ),
            caption,
            numeric=frozenset(i + len(stepped) for i in (2, 3, 4, 5)),
        )
