"""`px.pool_stats`: statistics logged under a `jax.vmap` around the model, pooled over
its axes exactly; a packed log is pooled in one pass over its buffers (`_Plan`)."""

import functools
import math
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import core

from ..._engine import is_pooled, pool_log
from .._packing import PackedLog, num_leading_axes
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
from ._stats_log import Stats
from ._when_due import _when_due


def pool_stats(log: Mapping[str, Any], num_axes: int = 1) -> Mapping[str, Any]:
    """Pool statistics (`px.Stats`, `px.Histogram`) over their leading `num_axes` axes,
    exactly (as if computed over all examples at once).

    Layers of a model under a `jax.vmap` of your own (the usual Equinox style: the
    model runs per example) log one statistic per example; pooling inside the compiled
    step keeps what is returned and recorded independent of the batch size (the vmaps
    inside the model are pooled already). Histograms are added, which is exact because
    every vmap's elements share one range (see `px.HistogramLog`). The steps of a scan
    do not: this raises, while tracing, rather than pool the steps of the model's own
    scans (a scanned stack of layers). The axes of a scan around the model cannot be
    told from a vmap's while tracing, so the pooled histograms' ranges are compared:
    where they differ this raises when run eagerly, and inside jit (where raising
    would take a host callback in every call) the histogram comes back with NaN edges
    and counts of -1, never counts of different bins added up. Give an explicit
    `range` to pool the steps of a scan.

    **Arguments:**

    - `log`: a log of `px.StatsLog` or `px.activation_stats()` (`{path: stats}`), or of
        `px.HistogramLog`.
    - `num_axes`: how many leading (example) axes to pool: those of the vmaps around
        the model.

    **Returns:**

    The log with those axes pooled.
    """
    for path, value in log.items():
        values = jtu.tree_leaves(value, is_leaf=is_pooled)
        if any(not is_pooled(v) for v in values):
            raise ValueError(
                f"px.pool_stats cannot pool the log of layer {path!r}: it holds values that do not "
                "say how they pool (plain arrays); pool only logs of px.StatsLog, "
                "px.activation_stats() or px.HistogramLog"
            )
        # Each statistic has a per-group scalar (a histogram's `below`): its axes are
        # the ones to pool.
        axes = min(
            (v.num_leading_axes if isinstance(v, Stats) else jnp.ndim(leaf)
             for v in values for leaf in jtu.tree_leaves(v)),
            default=num_axes,
        )
        if axes < num_axes:
            raise ValueError(
                f"px.pool_stats(num_axes={num_axes}): the statistics of layer {path!r} have "
                f"{axes} leading axes (the vmaps inside the model pool them already; pool only "
                "the axes of a jax.vmap around the model)"
            )
    # Under `px.Recorder.when_due`, pooling too runs only on due steps: a layer's
    # pooling is a handful of small reductions, which add up over every layer.
    pooled = _when_due(_pooled, num_axes, log)
    if not any(isinstance(leaf, core.Tracer) for leaf in jtu.tree_leaves(pooled)):
        _refuse_unshared(pooled)
    return pooled


def _refuse_unshared(pooled: Mapping[str, Any]) -> None:
    """Raise on the histograms `_unshared` poisoned, in a log pooled eagerly."""
    floats = [np.asarray(leaf) for leaf in jtu.tree_leaves(pooled) if jnp.issubdtype(leaf.dtype, jnp.floating)]
    if not any(np.isnan(leaf).any() for leaf in floats):
        return
    for path in pooled:
        for value in jtu.tree_leaves(pooled[path], is_leaf=is_pooled):
            histograms = value.statistics.values() if isinstance(value, Stats) else [value]
            for histogram in jtu.tree_leaves(list(histograms), is_leaf=is_pooled):
                if isinstance(histogram, Histogram) and np.any(np.isnan(histogram.low)):
                    raise ValueError(_UNSHARED.format(where=path))


_UNSHARED = (
    "px.pool_stats: the histograms of layer {where!r} have different bins along the pooled axes: "
    "each was binned over its own range (its values' min and max), as in the steps of a jax.lax.scan "
    "(or lax.map) around the model; only a vmap's elements share one. Pool only the axes of a "
    "jax.vmap around the model, or give px.HistogramLog / px.activation_stats an explicit "
    "range=(low, high). Inside jit such histograms come back with NaN edges and counts of -1."
)


def _pooled(num_axes: int, log: Mapping[str, Any]) -> Mapping[str, Any]:
    if not isinstance(log, PackedLog):
        return pool_log(dict(log), num_axes)
    plan = None
    # Axes of the statistics inside the packed values (a scanned stack's) pool one by one.
    if log.buffers and num_axes <= num_leading_axes(log.buffers):
        plan = _packed_plan(jtu.tree_structure(log), tuple(b.shape[-1] for b in log.buffers))
    if plan is None:
        # Pooled, a packed log stays packed: it is what the compiled step returns.
        return PackedLog(pool_log(dict(log), num_axes))
    return _pooled_packed(log, num_axes, plan)


def pooled_over_a_vmap(where: str, stats: Stats) -> Stats | None:
    """`stats`, logged inside a vmap of the model's own, pooled over its axis as the vmap
    returns, in one pass over its buffers (`_pooled_packed`): statistic by statistic,
    unpacked and packed again, a layer's pooling is a dozen small XLA kernels. None
    where the one pass does not apply: a histogram along a scan's steps (whose `kept`
    the pooling changes), a statistic that says nothing of how it pools."""
    # Packed along the vmap's axis, which the buffers lead with.
    log = PackedLog({where: stats}, _own_shapes=(tuple(np.shape(b)[1:] for b in stats.buffers),))
    plan = _packed_plan(jtu.tree_structure(log), tuple(b.shape[-1] for b in log.buffers)) if log.buffers else None
    if plan is None or any(kept for _, kept, _ in plan.histograms):
        return None
    return _pooled_packed(log, 1, plan)[where]


# -- pooling a packed log in one pass ---------------------------------------------------
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
def _packed_plan(structure: Any, sizes: tuple[int, ...]) -> _Plan | None:
    """The `_Plan` of a packed log of this structure, read off the log unpacked from
    buffers of value positions; None where some value says nothing of how it pools."""
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
            statistics = list(value.statistics.values()) if isinstance(value, Stats) else [value]
            for statistic in jtu.tree_leaves(statistics, is_leaf=is_pooled):
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


def _pooled_packed(log: PackedLog, num_axes: int, plan: _Plan) -> PackedLog:
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
