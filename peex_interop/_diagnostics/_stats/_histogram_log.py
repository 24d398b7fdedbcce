"""`px.HistogramLog`: every value counted in equal bins, exactly as `numpy.histogram`
counts it, with one bincount per array; the bins span the values' range, shared over
every vmap the call runs in (`_extrema`), so that the histograms pool exactly."""

import functools
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap
from jaxtyping import Array

from ..._engine import CallSite
from ._histogram import Histogram, bin_edges, edge_spacing
from ._statistic_logs import _AbstractStatisticLog, _kept_axes, _leafwise
from ._when_due import _real_cond, _when_due


def _bincount(index: Any, length: int) -> Any:
    """`jnp.bincount(index, length=length)` of a flat array of indices in range: one
    scatter-add. Its ones are a constant, which jnp.bincount would broadcast (an array
    as large as the indices, written on every call), and the indices are taken as they
    are (`.at[]` first maps negative ones: one more pass writing them out)."""
    numbers = lax.ScatterDimensionNumbers(
        update_window_dims=(), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
    )
    return lax.scatter_add(
        jnp.zeros(length, jnp.int32), index[:, None], np.ones(index.shape, np.int32), numbers,
        indices_are_sorted=False, unique_indices=False, mode=lax.GatherScatterMode.FILL_OR_DROP,
    )


@functools.cache
def _counter(length: int) -> Callable[[Any], Any]:
    """`bincount(index, length=length)` of indices in range, whose vmap counts all the
    examples with one bincount of offset indices: vmapped, bincount becomes a scatter
    with batch dimensions, several times slower on CPU."""

    @custom_vmap
    def count(index):
        return _bincount(index, length)

    @count.def_vmap
    def count_mapped(axis_size, in_batched, index):
        if not in_batched[0]:
            return count(index), False
        offsets = jnp.arange(axis_size, dtype=index.dtype).reshape(-1, *([1] * (index.ndim - 1)))
        flat = jnp.ravel(index + offsets * length)
        return _bincount(flat, axis_size * length).reshape(axis_size, length), True

    return count


def _finite_extrema(x: Any) -> tuple[Any, Any]:
    """The min and max of the finite values of `x` (`inf`, `-inf` if none)."""
    finite = jnp.isfinite(x)
    low = jnp.min(jnp.where(finite, x, jnp.inf), initial=jnp.inf)
    return low, jnp.max(jnp.where(finite, x, -jnp.inf), initial=-jnp.inf)


@custom_vmap
def _extrema(x: Any) -> tuple[Any, Any]:
    """The min and max of the finite values of `x` (`inf`, `-inf` if none). Under a
    vmap, any vmap (named or not, around the hooked model or inside it, nested), those
    of every element's values: the same for all, so that their histograms have the same
    bins and pool exactly. A vmap around the model is the user's: unnamed, it has no
    axis for a collective (`jax.lax.pmin`) to share the range over."""
    # The plain min and max, which a NaN or an infinity makes non-finite, are those of
    # the finite values otherwise: two reductions XLA:CPU reads the values straight
    # into, where masking the non-finite ones out first writes each mask's output
    # (~2 passes more over every layer's values).
    low, high = jnp.min(x, initial=jnp.inf), jnp.max(x, initial=-jnp.inf)
    return _real_cond(jnp.isfinite(low) & jnp.isfinite(high), lambda x: (low, high), _finite_extrema, x)


@_extrema.def_vmap
def _extrema_mapped(axis_size: int, in_batched: list[bool], x: Any) -> tuple[tuple[Any, Any], tuple[bool, bool]]:
    # Reduced over the mapped axis too, and left unmapped: the bins that follow are
    # computed once, not once per element. An enclosing vmap meets `_extrema` again.
    return _extrema(x), (False, False)


def _finite_range(x: Any, axis_names: tuple[Hashable, ...]) -> tuple[Any, Any]:
    low, high = _extrema(x)
    # Axes that are no vmap's (`jax.shard_map`, `jax.pmap`): shared by name.
    if axis_names:
        low, high = lax.pmin(low, axis_names), lax.pmax(high, axis_names)
    # numpy.histogram's conventions: a single value gets a range of width 1 around it;
    # with no finite value at all (numpy raises) the bins are (0, 1) and stay empty.
    low, high = jnp.where(low == high, low - 0.5, low), jnp.where(low == high, high + 0.5, high)
    none = low > high
    return jnp.where(none, 0, low).astype(x.dtype), jnp.where(none, 1, high).astype(x.dtype)


def _bins_per_unit(low: Any, high: Any, bins: int) -> Any:
    """`bins / (high - low)`, in float32 at least, by which `_estimated_bins` scales
    every value's distance from `low` (numpy's `norm`): computed once, behind a
    barrier, or XLA would divide again for every value."""
    wide = jnp.promote_types(low.dtype, jnp.float32)
    return lax.optimization_barrier(bins / (high.astype(wide) - low.astype(wide)))


def _estimated_bins(x: Any, low: Any, high: Any, bins: int, spacing: tuple[Any, Any], per_unit: Any) -> Any:
    """The bin of each value from its position in the range, then corrected against
    the edges (numpy's own fast path for equal bins): exact when the position is off
    by less than half a bin (`_estimates_exact`). jnp.histogram lowers to a binary
    search plus a scatter-add; this and one bincount are ~2x faster on CPU.
    `spacing`: `edge_spacing(low, high, bins)`; `per_unit`: `_bins_per_unit(low, high,
    bins)`."""
    # In float32 at least: the position's own rounding is then negligible.
    position = (x.astype(per_unit.dtype) - low.astype(per_unit.dtype)) * per_unit
    # Half a bin up, the estimate is the value's bin or the next one, never the one
    # before: one edge to compare against instead of numpy's two (the estimate's and
    # the next one's), ~10% of a histogram's cost on CPU.
    index = jnp.clip(jnp.floor(position + 0.5).astype(jnp.int32), 0, bins - 1)
    return index - (x < bin_edges(index, low, high, bins, spacing))


def _searched_bins(x: Any, edges: Any, bins: int) -> Any:
    """The bin of each value by a binary search in the edges (the last bin `i`
    with `edges[i] <= x`): exact whatever the edges, repeated ones included. ~2x the
    estimate's cost (a gather per step), so only for ranges too narrow for it."""
    size = 1 << bins.bit_length()  # > bins: the table's padding is never a bin
    table = jnp.concatenate([edges[..., :bins], jnp.full((size - bins,), jnp.inf, edges.dtype)])
    count = jnp.zeros(x.shape, jnp.int32)  # edges <= x, found by halving
    step = size // 2
    while step:
        count = jnp.where(table[count + step - 1] <= x, count + step, count)
        step //= 2
    return count - 1


def _estimates_exact(edges: Any, low: Any, high: Any, bins: int) -> Any:
    """Whether `_estimated_bins` is exact for these edges: when every edge lies within
    half a bin of its place in the range (the values' positions, in float32 at least,
    are off by far less), a value's position is less than half a bin before its bin's
    lower edge or after its upper one, and half a bin up it is in its bin or the next
    (the one comparison `_estimated_bins` makes tells them apart). Not so when the
    range spans few steps of the data's precision (near-constant float32 values,
    bfloat16 with many bins): edges repeat, and estimates miss by several bins."""
    wide = jnp.promote_types(edges.dtype, jnp.float32)
    low, high = low.astype(wide)[..., None], high.astype(wide)[..., None]
    places = (edges.astype(wide) - low) / (high - low) * bins
    off = jnp.max(jnp.abs(places - jnp.arange(bins + 1, dtype=wide)))
    # The bound's own rounding (~10 float32 roundings of numbers up to `bins`).
    return off + 16 * jnp.finfo(wide).eps * bins <= 0.5


class HistogramLog(_AbstractStatisticLog):
    """Histogram of every float leaf in `bins` equal bins, as `numpy.histogram`, logged
    as a `px.Histogram`: no value is ever dropped, those outside the bins are counted.

    Without `range`, the bins span the finite values of each call (their min and max,
    like `numpy.histogram`; `-inf` and `inf` count as below and above), shared over
    every vmap the call runs in, named or not: the vmaps inside the model, which pool
    the histograms, and a `jax.vmap` of your own around a per-example model, whose
    histograms `px.pool_stats` then pools exactly. Only the steps of a scan (inside the
    model or around it) keep ranges of their own: `px.pool_stats` refuses to pool the
    steps of the model's own scans while tracing, and those of a scan around the model
    (which no trace tells from a vmap) by their ranges: it raises eagerly, and inside
    jit returns NaN edges and counts of -1. Give an explicit `range` to pool them.

    A forward log only: a `px.BackwardHook` log travels as a gradient, and gradients do
    not carry integer counts.

    **Arguments:**

    - `bins`: the number of equal bins (fixed, so the log has a fixed shape under jit).
    - `range`: `(low, high)` of the bins; values outside are counted as below or above.
        Default: the finite min and max of each call's values, of all the elements of
        every vmap around it.
    - `axis_name`: the name of a mapped axis that is no vmap's (a `jax.shard_map` or
        `jax.pmap` axis; or a tuple of names) over which the data's range is shared too.
    - `pool`: pool over the vmaps inside the model (default); False keeps one histogram
        per mapped element (all over the same range).
    """

    bins: int = eqx.field(static=True, default=40)
    range: tuple[float, float] | None = eqx.field(static=True, default=None)
    axis_name: Hashable | None = eqx.field(static=True, default=None)
    pool: bool = eqx.field(static=True, default=True)

    def __check_init__(self):
        if self.range is not None and not self.range[0] < self.range[1]:
            raise ValueError(f"HistogramLog needs range=(low, high) with low < high, got {self.range}")

    @property
    def needs_indices(self) -> bool:
        # It takes the call site for its static parts (`_kept_axes`), not the indices.
        return False

    def __call__(self, args: Any, site: CallSite | None = None) -> Any:
        return _when_due(_histograms, (self, _kept_axes(site)), args)

    def statistic(self, x: Array, kept: int = 0) -> Histogram:
        """The histogram of `x`; `kept`: the leading axes the model's own transforms
        will keep, scans among them (`_kept_axes`)."""
        # Counts have no gradient; this also keeps pmin/pmax and `_extrema` (no
        # differentiation rules) usable inside a loss that is differentiated.
        # Materialised once, in its own shape: a layer's output is often no array yet
        # (XLA fuses `dot + bias` into each of its consumers), and each of the ~8 passes
        # below would recompute it, raveled: a flat index into the broadcast bias, an
        # integer division per value. One copy instead: ~230 -> ~40 µs per 64x512 layer
        # on CPU (Haiku MLP train step: 1.30x -> 1.16x the plain step). Only the slots
        # are raveled, to count them.
        x = lax.optimization_barrier(lax.stop_gradient(x))
        if self.range is None:
            low, high = _finite_range(x, self._axis_names())
        else:
            low, high = (jnp.asarray(end, x.dtype) for end in self.range)
            kept = 0  # the same bins along every axis
        spacing, per_unit = edge_spacing(low, high, self.bins), _bins_per_unit(low, high, self.bins)
        edges = bin_edges(jnp.arange(self.bins + 1), low, high, self.bins, spacing)

        # The values outside the bins go to three more slots (below, above, NaN), so
        # that one bincount counts everything: no pass over the values per slot.
        def counted(bin_of: Callable[[Any], Any]) -> Callable[[Any], Any]:
            def count(x):
                inside = jnp.where(x < low, self.bins, jnp.where(x > high, self.bins + 1, bin_of(x)))
                return _counter(self.bins + 3)(jnp.ravel(jnp.where(jnp.isnan(x), self.bins + 2, inside)))

            return count

        # A scalar test picks the search only where the estimate could miss. The branch
        # is not free (a `lax.cond` costs ~17 µs per layer of a 2-core CPU's training
        # step, a trivial one too), but the search, computed for every value and
        # selected, costs more. Each branch counts its slots itself: XLA:CPU then
        # computes them inside the scatter's own loop instead of writing them out.
        counts = _real_cond(
            _estimates_exact(edges, low, high, self.bins),
            counted(lambda x: _estimated_bins(x, low, high, self.bins, spacing, per_unit)),
            counted(lambda x: _searched_bins(x, edges, self.bins)),
            x,
        )
        below, above, nan = (counts[..., self.bins + i] for i in range(3))
        return Histogram(counts[..., : self.bins], low, high, below, above, nan, self.pool, kept, x.dtype)

    def _axis_names(self) -> tuple[Hashable, ...]:
        if self.axis_name is None:
            return ()
        return self.axis_name if isinstance(self.axis_name, tuple) else (self.axis_name,)


def _histograms(config: tuple[HistogramLog, int], args: Any) -> Any:
    log, kept = config
    return _leafwise(lambda x: log.statistic(x, kept=kept), args)
