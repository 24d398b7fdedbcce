"""`px.pool_stats`: statistics logged under a `jax.vmap` around the model, pooled over
its axes exactly; a packed log is pooled in one pass over its buffers
(`_packed_pooling.py`)."""

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import core

from ..._engine import is_pooled, pool_log
from .._packing import PackedLog, num_leading_axes
from ._histogram import Histogram
from ._packed_pooling import packed_plan, pooled_packed
from ._stats_log import Stats, statistics_of
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
            for histogram in jtu.tree_leaves(statistics_of(value), is_leaf=is_pooled):
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
        plan = packed_plan(jtu.tree_structure(log), tuple(b.shape[-1] for b in log.buffers), statistics_of)
    if plan is None:
        # Pooled, a packed log stays packed: it is what the compiled step returns.
        return PackedLog(pool_log(dict(log), num_axes))
    return pooled_packed(log, num_axes, plan)
