"""Pooling a packed log in one pass over its buffers: a few reductions for all the
layers together, each value pooled as its statistic's `columns` say (`_Plan`)."""

import functools
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ..._engine import is_pooled
from .._packing import PackedLog
from ._histogram import Histogram, _refuse_kept, _unshared
from ._pooled import (
    _MAX,
    _MEAN,
    _NORM,
    _RANGE,
    _SHIFT,
    _SQUARES,
    _SUM,
    _TOTAL,
    _mean_of_groups,
    _pooled_moments,
    _Statistic,
)


class _Plan(eqx.Module):
    """How every value of a packed log's buffers pools (`_Statistic.columns`): per
    buffer the kind of each value, the values of the spread it belongs to (`moments`:
    the positions of its total, squares and shift, else its own) and their `counts`
    (else 1), and which histogram it belongs to (`members`: values x histograms, 0 or
    1); per histogram its layer, `kept` axes and leading axes inside the packed values."""

    kinds: tuple[np.ndarray, ...]
    moments: tuple[np.ndarray, ...]
    counts: tuple[np.ndarray, ...]
    members: tuple[np.ndarray, ...]
    histograms: tuple[tuple[str, int, int], ...]


@functools.cache
def packed_plan(structure: Any, sizes: tuple[int, ...], parts: Callable[[Any], list]) -> _Plan | None:
    """The `_Plan` of a packed log of this structure, read off the log unpacked from
    buffers of value positions; None where some value says nothing of how it pools.
    `parts`: the statistics a logged value holds (a module-level function)."""
    offsets = np.cumsum((0, *sizes))
    log = jtu.tree_unflatten(structure, [np.arange(offsets[b], offsets[b + 1])[None] for b in range(len(sizes))])
    kinds = [np.full(size, -1) for size in sizes]
    moments = [np.repeat(np.arange(size)[:, None], 3, axis=1) for size in sizes]
    counts = [np.ones(size) for size in sizes]
    owners = [np.full(size, -1) for size in sizes]
    histograms = []

    def place(positions: Any) -> tuple[int, np.ndarray]:
        positions = np.ravel(positions)
        buffer = int(np.searchsorted(offsets, positions[0], side="right")) - 1 if positions.size else 0
        return buffer, positions - offsets[buffer]

    for key in log:
        for value in jtu.tree_leaves(log[key], is_leaf=is_pooled):
            for statistic in jtu.tree_leaves(parts(value), is_leaf=is_pooled):
                if not isinstance(statistic, (_Statistic, Histogram)):
                    return None
                if isinstance(statistic, Histogram):
                    histograms.append((key, statistic.kept, np.ndim(statistic.below)))
                for kind, field, spread in statistic.columns():
                    buffer, positions = place(field)
                    kinds[buffer][positions] = kind
                    if spread is not None:
                        *sums, count = spread
                        moments[buffer][positions] = np.stack([place(f)[1] for f in sums], axis=-1)
                        counts[buffer][positions] = count
                    if isinstance(statistic, Histogram):
                        owners[buffer][positions] = len(histograms) - 1
    if any(np.any(k < 0) for k in kinds):
        return None
    members = tuple((o[:, None] == np.arange(len(histograms))).astype(np.float32) for o in owners)
    return _Plan(tuple(kinds), tuple(moments), tuple(counts), members, tuple(histograms))


def pooled_packed(log: PackedLog, num_axes: int, plan: _Plan) -> PackedLog:
    """`pool_log` of a packed log, computed on its buffers: a few reductions for all
    the layers together rather than a handful per statistic of each (which cost ~5% of
    a 12-layer MLP's training step on CPU, one small XLA kernel each)."""
    lead = log.buffers[0].shape[:-2]
    for key, kept, inside in plan.histograms:
        for pooled in range(num_axes):
            _refuse_kept(key, kept, len(lead) + inside - pooled)
    groups = math.prod(lead[:num_axes])
    buffers = [buffer.reshape(groups, *buffer.shape[num_axes:]) for buffer in log.buffers]
    # The histograms whose groups' ranges differ (`_unshared`).
    differ = None
    for x, kinds, members in zip(buffers, plan.kinds, plan.members):
        if np.any(kinds == _RANGE):
            range_differs = jnp.any(x != x[0], axis=0) & (kinds == _RANGE)
            hits = range_differs.astype(jnp.float32) @ members > 0
            differ = hits if differ is None else differ | hits
    pooled = []
    for x, kinds, moments, counts, members in zip(buffers, plan.kinds, plan.moments, plan.counts, plan.members):
        out = _pooled_columns(x, kinds, moments, counts)
        if differ is not None and np.any(members):
            (out,) = _unshared(differ.astype(jnp.float32) @ members.T > 0, out)
        pooled.append(out)
    return jtu.tree_unflatten(jtu.tree_structure(log), pooled)


def _pooled_columns(x: Any, kinds: np.ndarray, moments: np.ndarray, counts: np.ndarray) -> Any:
    """Each value of `x` (groups along the leading axis) pooled as its kind says; as
    the statistics' own `pool`."""
    out = x[0]  # a histogram's range: the groups share it
    present = set(np.unique(kinds).tolist())
    if _MEAN in present:
        out = jnp.where(kinds == _MEAN, _mean_of_groups(x), out)
    if present & {_TOTAL, _SQUARES, _SHIFT}:
        count = jnp.asarray(counts, x.dtype)
        total, squares, shift = (x[..., moments[:, i]] for i in range(3))
        mean, var = _pooled_moments(total, squares, shift, count)
        out = jnp.where(kinds == _TOTAL, 0, out)
        out = jnp.where(kinds == _SQUARES, var * count, out)
        out = jnp.where(kinds == _SHIFT, mean, out)
    if _MAX in present:
        out = jnp.where(kinds == _MAX, jnp.max(x, axis=0), out)
    if _NORM in present:
        out = jnp.where(kinds == _NORM, jnp.sqrt(jnp.sum(x**2, axis=0)), out)
    if _SUM in present:
        out = jnp.where(kinds == _SUM, jnp.sum(x, axis=0), out)
    return out
