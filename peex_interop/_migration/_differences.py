"""How far apart the logged values of two implementations of one layer are, whatever
the libraries' layouts (channels first or last, heads split or merged, fused layers)."""

import itertools
import math
from typing import Any

import jax
import numpy as np


def first_array(value: Any) -> Any:
    """The first array of a logged value (a layer may return several: a cell's `(h, c)`)."""
    return next(leaf for leaf in jax.tree.leaves(value) if hasattr(leaf, "shape"))


def _difference(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Max abs / max rel difference, with b's axes permuted to a's layout (the
    permutation that fits best, when several fit), or reshaped when no permutation fits
    (e.g. attention heads split in one library and merged in the other)."""
    candidates = [
        np.transpose(b, order)
        for order in itertools.permutations(range(b.ndim))
        if tuple(b.shape[i] for i in order) == a.shape
    ] or [np.reshape(b, a.shape)]
    best = min(float(np.max(np.abs(a - c), initial=0.0)) for c in candidates)
    scale = float(np.max(np.abs(a), initial=0.0))
    return best, best / scale if scale else best


def tree_difference(a: Any, b: Any) -> tuple[float, float, float]:
    """(max abs, max rel, max of abs / (1 + max |x|)) of one layer's outputs. Libraries
    return different structures (an LSTM cell `(h, c)` in Equinox, `((c, h), h)` in NNX;
    an Equinox BatchNorm its state too): each array of the side with fewer arrays is
    compared with its best-fitting unused array of the same size on the other side."""
    arrays_a = [np.asarray(x) for x in jax.tree.leaves(a) if hasattr(x, "shape")]
    arrays_b = [np.asarray(x) for x in jax.tree.leaves(b) if hasattr(x, "shape")]
    fewer, more = (arrays_a, arrays_b) if len(arrays_a) <= len(arrays_b) else (arrays_b, arrays_a)
    unused, worst = list(range(len(more))), (0.0, 0.0, 0.0)
    for x in fewer:
        scored = [
            ((*_difference(x, more[i]), i)) for i in unused if more[i].size == x.size
        ] or [(*_difference(fewer[0], more[0]), 0)]
        abs_error, rel_error, used = min(scored)
        if used in unused:
            unused.remove(used)
        excess = abs_error / (1 + float(np.max(np.abs(x), initial=0.0)))
        worst = max(worst, (abs_error, rel_error, excess), key=lambda row: row[2])
    return worst


def entry_difference(log_a: Any, log_b: Any, key_a: Any, key_b: Any) -> tuple[float, float, float]:
    """`tree_difference` of one mapping entry's logged values; an entry of several
    layers on one side is compared with the fused layer on the other as their outputs
    stacked along one axis (the axis, and a layout, that fits best)."""
    if isinstance(key_a, str) and isinstance(key_b, str):
        return tree_difference(log_a[key_a], log_b[key_b])
    fused, parts = (log_a[key_a], [log_b[k] for k in key_b]) if isinstance(key_a, str) else (
        log_b[key_b], [log_a[k] for k in key_a]
    )
    x = np.asarray(first_array(fused))
    arrays = [np.asarray(first_array(part)) for part in parts]
    if len({a.shape for a in arrays}) != 1 or len(arrays) * arrays[0].size != x.size:
        return math.inf, math.inf, math.inf
    abs_error = min(_difference(x, np.stack(arrays, axis=axis))[0] for axis in range(arrays[0].ndim + 1))
    scale = float(np.max(np.abs(x), initial=0.0))
    return abs_error, abs_error / scale if scale else abs_error, abs_error / (1 + scale)
