"""`Alignment`: which layer of one model is which layer of another (`px.align`)."""

import dataclasses
import re
from typing import Any

from .._diagnostics import AbstractTabular, Table

# A log key of a layer's repeated call: `path@n` is the n-th call of `path`.
REPEAT = re.compile(r"@\d+\Z")


@dataclasses.dataclass(frozen=True, repr=False)
class Alignment(AbstractTabular):
    """`mapping` (path in model a -> path in model b) and what could not be matched;
    shows as a table (`print`, rich, notebooks).

    Every layer that holds parameters (or state) and was called is in one of
    `mapping`, `unmatched`, `ambiguous` and `unknown` (of no known layout and no
    counterpart of its class), each entry of the last three `(side, path, reason)`.
    Method sites (`embedder.attend`) are matched too, so that `px.compare` has their
    rows; `layer_mapping` gives the layers themselves, for `px.transfer_params`."""

    # Keys and values are paths; in a mapping given by hand, one side of an entry may be
    # a tuple of paths (the layers one fused layer holds).
    mapping: dict[Any, Any]
    unmatched: tuple[tuple[str, str, str], ...]
    ambiguous: tuple[tuple[str, str, str], ...]
    order_preserved: bool
    unknown: tuple[tuple[str, str, str], ...] = ()
    # The method sites among the mapping's keys and values: `<layer>.<method>`.
    methods: frozenset[str] = frozenset()
    # Layers holding parameters that no call reached, of the same class at the same path
    # in both models: matched for a transfer, with no output to compare.
    uncalled: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def layer_mapping(self) -> dict[str, str]:
        """`mapping` with each method site replaced by its layer (a layer reached through
        several methods once), and the `uncalled` layers: the layers whose weights
        `px.transfer_params` copies."""
        layers = {}
        for a, b in self.mapping.items():
            a, b = (layer_of(p) if p in self.methods else p for p in (a, b))
            if a and b:
                layers.setdefault(a, b)
        return {**layers, **self.uncalled}

    def _table(self) -> Table:
        rows = [(a, b, "matched") for a, b in self.mapping.items()]
        for title, entries in (("unmatched", self.unmatched), ("ambiguous", self.ambiguous),
                               ("unknown layout", self.unknown)):
            for side, path, why in entries:
                rows.append((path, "", f"{title}: {why}") if side == "a" else ("", path, f"{title}: {why}"))
        rows += [(a, b, "matched, not called") for a, b in self.uncalled.items()]
        counts = len(self.mapping) + len(self.uncalled), len(self.unmatched), len(self.ambiguous), len(self.unknown)
        caption = "{} layers matched, {} unmatched, {} ambiguous, {} of unknown layout".format(*counts)
        if not self.order_preserved:
            caption += "; matched layers are called in a different order in model b"
        return Table(("model a", "model b", ""), tuple(rows), caption)


def layer_of(method_site: str) -> str:
    """The layer of a method site: `embedder.attend` -> `embedder`."""
    return method_site.rpartition(".")[0]
