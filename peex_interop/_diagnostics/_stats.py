"""Statistics logs: reduce activations (or cotangents) on the device, inside the step.

Each log maps every floating-point array leaf of what it receives to a statistic, so it
works on layers with several outputs; non-float leaves (ints, keys) are not logged.
"""

from collections.abc import Hashable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array, Float, Int

from .._hooks._logs import AbstractLog, MeanLog


def _leafwise(statistic, value: Any) -> Any:
    return jtu.tree_map(
        lambda x: statistic(x) if eqx.is_inexact_array(x) else None, value
    )


class StdLog(AbstractLog):
    """Standard deviation of every float leaf."""

    def __call__(self, args: Any) -> Any:
        return _leafwise(jnp.std, args)


class NearZeroLog(AbstractLog):
    """Fraction of values `<= threshold` (fastai's `near_zero`: after a ReLU, the share of
    (nearly) dead activations)."""

    threshold: float = 0.05

    def __call__(self, args: Any) -> Any:
        return _leafwise(lambda x: jnp.mean(x <= self.threshold), args)


class Histogram(eqx.Module):
    """What `px.HistogramLog` logs for one array: counts in equal bins from `low` to
    `high` and every value outside them counted, so that
    `counts.sum() + below + above + nan` is the number of values (`total`).

    **Fields:**

    - `counts`: the number of values in each bin: `counts` is exactly
        `numpy.histogram(values, bins=edges)[0]` (each bin includes its left edge, the
        last one both).
    - `edges`: the `bins + 1` edges the values were counted against, equally spaced
        from `low` to `high`.
    - `below`, `above`: the number of values below `low` and above `high` (`-inf`, `inf`
        included).
    - `nan`: the number of NaNs.

    Logged under `jax.vmap` or `jax.lax.scan`, every field gains the leading axes.
    """

    counts: Int[Array, "*batch bins"]
    edges: Float[Array, "*batch bins+1"]
    below: Int[Array, "*batch"]
    above: Int[Array, "*batch"]
    nan: Int[Array, "*batch"]

    @property
    def low(self) -> Float[Array, "*batch"]:
        """The lower end of the bins."""
        return self.edges[..., 0]

    @property
    def high(self) -> Float[Array, "*batch"]:
        """The upper end of the bins."""
        return self.edges[..., -1]

    @property
    def outside(self) -> Int[Array, "*batch"]:
        """The number of values not in the bins: `below + above + nan`."""
        return self.below + self.above + self.nan

    @property
    def total(self) -> Int[Array, "*batch"]:
        """The number of values."""
        return self.counts.sum(axis=-1) + self.outside


def _linspace(low: Any, high: Any, bins: int) -> Any:
    # numpy.linspace's arithmetic in the range's precision, so that on CPU the edges are
    # numpy's to the bit. jnp.linspace rounds differently, and XLA would turn a division
    # by a constant (or a broadcast scalar, under vmap) into a multiplication by its
    # reciprocal and fuse the multiply-add: a divisor computed from the data
    # (`delta - delta + bins`, which XLA does not fold for floats) behind a barrier, and
    # a barrier between the multiply and the add, keep each operation rounded as numpy
    # rounds it. (XLA's GPU division is not correctly rounded, so there an edge can
    # differ from numpy's in its last bit; the counts are exact for the edges logged, on
    # every backend.)
    delta = high - low
    step = delta / lax.optimization_barrier(delta - delta + bins)
    edges = lax.optimization_barrier(jnp.arange(bins + 1, dtype=low.dtype) * step) + low
    return edges.at[-1].set(high)


def _finite_range(x: Any, axis_name: Hashable | None) -> tuple[Any, Any]:
    finite = jnp.isfinite(x)
    low = jnp.min(jnp.where(finite, x, jnp.inf))
    high = jnp.max(jnp.where(finite, x, -jnp.inf))
    if axis_name is not None:
        low, high = lax.pmin(low, axis_name), lax.pmax(high, axis_name)
    # numpy.histogram's conventions: a single value gets a range of width 1 around it;
    # with no finite value at all (numpy raises) the bins are (0, 1) and stay empty.
    low, high = jnp.where(low == high, low - 0.5, low), jnp.where(low == high, high + 0.5, high)
    none = low > high
    return jnp.where(none, 0, low).astype(x.dtype), jnp.where(none, 1, high).astype(x.dtype)


class HistogramLog(AbstractLog):
    """Histogram of every float leaf in `bins` equal bins, as `numpy.histogram`, logged
    as a `px.Histogram`: no value is ever dropped, those outside the bins are counted.

    Without `range`, the bins span the finite values of each call (their min and max,
    like `numpy.histogram`; `-inf` and `inf` count as below and above). Histograms of
    different calls then have different bins: `px.pool_stats` adds histograms only when
    their bins agree, so for per-example layers under `jax.vmap` give the vmap an
    `axis_name` and pass it here, so that all examples share one range (as
    `eqx.nn.BatchNorm` shares its statistics), or give an explicit `range`.

    A forward log only: a `px.BackwardHook` log travels as a gradient, and gradients do
    not carry integer counts.

    **Arguments:**

    - `bins`: the number of equal bins (fixed, so the log has a fixed shape under jit).
    - `range`: `(low, high)` of the bins; values outside are counted as below or above.
        Default: the finite min and max of each call's values (of the whole vmapped
        batch with `axis_name`).
    - `axis_name`: the name of a `jax.vmap` axis (or a tuple of names) over which every
        example shares the data's range.
    """

    bins: int = eqx.field(static=True, default=40)
    range: tuple[float, float] | None = eqx.field(static=True, default=None)
    axis_name: Hashable | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        if self.range is not None and not self.range[0] < self.range[1]:
            raise ValueError(f"HistogramLog needs range=(low, high) with low < high, got {self.range}")

    def __call__(self, args: Any) -> Any:
        return _leafwise(self._histogram, args)

    def _histogram(self, x: Any) -> Histogram:
        # Counts have no gradient; this also keeps pmin/pmax (no differentiation rule)
        # usable inside a loss that is differentiated.
        x = jnp.ravel(lax.stop_gradient(x))
        if self.range is None:
            low, high = _finite_range(x, self.axis_name)
        else:
            low, high = (jnp.asarray(end, x.dtype) for end in self.range)
        edges = _linspace(low, high, self.bins)
        # jnp.histogram lowers to a binary search plus a scatter-add; computing the bin
        # directly and counting with bincount is ~2x faster on CPU. The two corrections
        # reproduce numpy's handling of values that rounding puts in a neighbour bin.
        index = jnp.clip(jnp.floor((x - low) / (high - low) * self.bins).astype(jnp.int32), 0, self.bins - 1)
        index = index - (x < edges[index])
        index = index + ((x >= edges[index + 1]) & (index != self.bins - 1))
        inside = (x >= low) & (x <= high)
        counts = jnp.bincount(jnp.where(inside, index, self.bins), length=self.bins + 1)[: self.bins]
        below, above, nan = (jnp.sum(mask, dtype=counts.dtype) for mask in (x < low, x > high, jnp.isnan(x)))
        return Histogram(counts, edges, below, above, nan)


class AbsMaxLog(AbstractLog):
    """Largest absolute value of every float leaf."""

    def __call__(self, args: Any) -> Any:
        return _leafwise(lambda x: jnp.max(jnp.abs(x)), args)


class L2NormLog(AbstractLog):
    """Euclidean norm of every float leaf (all axes together)."""

    def __call__(self, args: Any) -> Any:
        return _leafwise(jnp.linalg.norm, args)


class StatsLog(AbstractLog):
    """Several logs in one: `StatsLog({"mean": px.MeanLog(), "max": px.AbsMaxLog()})`
    logs `{"mean": ..., "max": ...}` for every layer."""

    logs: dict[str, AbstractLog]

    def __call__(self, args: Any) -> dict[str, Any]:
        return {name: log(args) for name, log in self.logs.items()}


def activation_stats(
    near_zero: float = 0.05,
    bins: int = 40,
    range: tuple[float, float] | None = None,
    axis_name: Hashable | None = None,
) -> StatsLog:
    """fastai's `ActivationStats` statistics: mean, std, near-zero fraction, histogram.

    **Arguments:**

    - `near_zero`: threshold of the near-zero fraction.
    - `bins`, `range`, `axis_name`: the histogram's, as for `px.HistogramLog` (fastai
        uses 40 bins over `(0, 10)`, which suits activations after a ReLU; by default the
        range follows the data).

    **Returns:**

    A `StatsLog` with keys `mean`, `std`, `near_zero`, `hist` (a `px.Histogram`).
    """
    return StatsLog(
        {
            "mean": MeanLog(),
            "std": StdLog(),
            "near_zero": NearZeroLog(near_zero),
            "hist": HistogramLog(bins, range, axis_name),
        }
    )


def _is_histogram(value: Any) -> bool:
    return isinstance(value, Histogram)


def _pool_histogram(path: str, histogram: Histogram, axes: tuple[int, ...]) -> Histogram:
    edges = histogram.edges[(0,) * len(axes)]
    counts = eqx.error_if(
        jnp.sum(histogram.counts, axes),
        jnp.any(histogram.edges != edges),
        f"px.pool_stats: the histograms of layer {path!r} have different bins (each example's "
        "range follows its own values), so their counts cannot be added. Give "
        "px.HistogramLog / px.activation_stats an explicit range=(low, high), or vmap with "
        "axis_name='batch' and pass axis_name='batch' to it so that all examples share one range.",
    )
    below, above, nan = (jnp.sum(field, axes) for field in (histogram.below, histogram.above, histogram.nan))
    return Histogram(counts, edges, below, above, nan)


def _pool(path: str, name: str, values: dict[str, Any], axes: tuple[int, ...]) -> Any:
    value = values[name]
    if name == "hist":
        return jtu.tree_map(lambda h: _pool_histogram(path, h, axes), value, is_leaf=_is_histogram)
    if name == "std":
        # Equal-sized groups: pooled variance = mean(var_i + mean_i**2) - mean**2.
        def pooled_std(std, mean):
            second_moment = jnp.mean(std**2 + mean**2, axis=axes)
            return jnp.sqrt(jnp.maximum(second_moment - jnp.mean(mean, axis=axes) ** 2, 0.0))

        return jtu.tree_map(pooled_std, value, values["mean"])
    if name in ("mean", "near_zero"):
        return jtu.tree_map(lambda v: jnp.mean(v, axis=axes), value)
    raise ValueError(f"cannot pool statistic {name!r}: pool only px.activation_stats() logs")


def pool_stats(log: dict[str, Any], num_axes: int = 1) -> dict[str, Any]:
    """Pool `px.activation_stats()` statistics over their leading `num_axes` axes,
    exactly (as if computed over all examples at once).

    Layers inside a `jax.vmap` over examples (the usual Equinox style) log one
    statistic per example; pooling inside the compiled step keeps what is returned and
    recorded independent of the batch size. Histograms are added, which is exact only
    when their bins agree: an explicit range, or one shared over the vmap's
    `axis_name` (see `px.HistogramLog`); otherwise this raises (at run time, inside
    jit too) instead of adding counts of different bins.

    **Arguments:**

    - `log`: a log of `px.activation_stats()` (`{path: {"mean", "std", ...}}`).
    - `num_axes`: how many leading (example) axes to pool.

    **Returns:**

    The log with those axes pooled.
    """
    axes = tuple(range(num_axes))
    return {
        path: {name: _pool(path, name, values, axes) for name in values}
        for path, values in log.items()
    }
