"""Statistics logs: reduce activations (or cotangents) on the device, inside the step.

Each log maps every floating-point array leaf of what it receives to a statistic, so it
works on layers with several outputs; non-float leaves (ints, keys) are not logged. The
statistics keep the tuples, lists, dicts and namedtuples around them, never the user's
own pytree classes (`plain_containers`).

Inside a `px.StatsLog` (and `px.activation_stats`) every statistic is kept in a form that
pools exactly (`AbstractPooled`): the sums behind a mean or a variance (divided where the
statistic is read, or where a packed log pools), a maximum, a norm, a histogram. So the
vmaps a model runs inside itself pool them (see `_engine/_pooling.py`) and
`px.pool_stats` pools the vmap around the model, and the log keeps one statistic per
layer whatever the batch and sequence length.
"""

import contextlib
import functools
import math
from abc import abstractmethod
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import core, lax
from jax.custom_batching import custom_vmap
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from .._engine._patching import entry_point
from .._engine._pooling import AbstractPooled, is_pooled, mapped_vmaps, pool_log
from .._engine._shapes import zeros_like
from .._engine._sites import CallSite
from .._engine._threads import ThreadStack
from .._hooks._logs import AbstractLog, MeanLog, plain_containers
from ._packing import PackedLog, Packing, num_leading_axes

# Bound before hooking patches `jax.lax.cond`, `jax.eval_shape` and `jax.jit`: skipping
# or compiling a statistic is no model transform, with no layer inside to thread logs
# out of.
_real_cond = entry_point(lax.cond)
_real_eval_shape = entry_point(jax.eval_shape)
_real_jit = entry_point(jax.jit)


def _leafwise(statistic, value: Any) -> Any:
    """`statistic` of every float leaf of `value` (None for other leaves), in plain
    containers: the user's own pytree nodes are not rebuilt around statistics
    (`plain_containers`)."""
    return jtu.tree_map(
        lambda x: statistic(x) if eqx.is_inexact_array(x) else None, plain_containers(value)
    )


class _Sums:
    """The sums over an array of the terms its statistics need (`_terms_of`), each
    computed once for all of them (the mean's and the variance's share the centred
    values). The values are shifted by one of them so that a mean large against the
    spread does not cancel the variance away, and summed in float32 at least. The shift
    is the first value clipped to `eps * max` of the dtype: an infinite one (a masked
    -inf logit) would make every shifted value NaN, and a huge one would overflow the
    differences where the values' sum does not. One reduction per term: stacking the
    terms into one reduction measured slower on CPU (XLA then writes the stacked terms
    out, 3x the layer's values), and so did one variadic reduction of all terms (XLA:CPU
    then loops over them unvectorised: 17 µs a layer of 16,384 values instead of 13)."""

    def __init__(self, x: Any, terms: tuple[Hashable, ...]):
        self.dtype, self.size = x.dtype, x.size
        total = jnp.promote_types(x.dtype, jnp.float32)
        values = x.astype(total)
        if jnp.issubdtype(x.dtype, jnp.complexfloating) and set(terms) - {"centred"}:
            raise TypeError(
                f"px.StdLog and px.NearZeroLog (so px.activation_stats) take real arrays, got "
                f"{x.dtype}{list(x.shape)}: log jnp.abs(x), or x.real and x.imag, with a px.FunctionLog"
            )
        self.shift = jnp.zeros((), total)
        if x.size:
            first, info = lax.stop_gradient(jnp.ravel(values)[0]), jnp.finfo(total)
            # A clip, which XLA fuses into each use (a select was a kernel per layer).
            real = not jnp.issubdtype(total, jnp.complexfloating)
            self.shift = jnp.clip(first, -info.eps * info.max, info.eps * info.max) if real else first
        centred = values - self.shift

        def term(name: Any) -> Any:
            if name == "centred":
                return centred
            if name == "centred squares":
                return centred * centred
            _, threshold = name  # ("at most", threshold)
            return (x <= threshold).astype(total)

        self.sums = {name: jnp.sum(term(name)) for name in terms}

    # The statistics, in the forms that pool (`_Statistic`): sums, divided where read.
    def mean(self) -> "_Average":
        return _Average(self.sums["centred"], self.shift, self.size, self.dtype)

    def spread(self) -> "_Spread":
        return _Spread(self.sums["centred"], self.sums["centred squares"], self.shift, self.size, self.dtype)

    def fraction(self, threshold: float) -> "_Average":
        return _Average(self.sums[("at most", threshold)], None, self.size, self.dtype)


def _terms_of(log: AbstractLog) -> tuple[Hashable, ...]:
    """The sums (`_Sums`) a statistic log computes its statistic from; none for those
    that are no sums (maximum, histogram)."""
    if isinstance(log, StdLog):
        return ("centred", "centred squares")
    if isinstance(log, MeanLog):
        return ("centred",)
    if isinstance(log, NearZeroLog):
        return (("at most", log.threshold),)
    return ()


# -- statistics of one array, as they pool ---------------------------------------------
# How each field of a statistic pools over a leading axis: the mean of the groups'; the
# sums of a spread (`_Spread`: differences from a shift, and their squares, and the
# shift), pooled together; the maximum, the norm, the sum, and a histogram's edges (the
# first group's, which all must share).
_MEAN, _TOTAL, _SQUARES, _SHIFT, _MAX, _NORM, _SUM, _EDGES = range(8)


class _Statistic(AbstractPooled):
    """One statistic of one array, kept in the form that pools; `value` is what users
    read. Always pooled with the `Stats` that holds it."""

    @property
    def pool_mapped(self) -> bool:
        return True

    @property
    @abstractmethod
    def value(self) -> Any:
        pass

    @abstractmethod
    def columns(self) -> tuple[tuple[int, Any, Any], ...]:
        """How `pool` combines each field, as `(kind, field, spread)`: for the fields of
        a `_Spread`, its `(total, squares, shift, count)`, else None. What
        `px.pool_stats` computes for a whole packed log at once (`_pooled_packed`)."""


def _read(dtype: Any, count: int, value: Callable[..., Any], *fields: Any) -> Any:
    """`value(xp, *fields)` in `dtype`: a statistic read from its sums, with jax or,
    for records fetched to the host, numpy (`xp`); the shape of it from
    `jax.ShapeDtypeStruct`s (what `jax.eval_shape` gives); NaN for a statistic of no
    values, as numpy's."""
    if isinstance(fields[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(fields[0].shape, dtype)
    xp = jnp if any(isinstance(field, jax.Array) for field in fields) else np
    if not count:
        return xp.full(np.shape(fields[0]), np.nan, dtype)
    return xp.asarray(value(xp, *fields)).astype(dtype)


def _moments(xp: Any, total: Any, squares: Any, shift: Any, count: Any) -> tuple[Any, Any]:
    """`(mean, variance)` of `count` values from the sums of their differences from
    `shift` and of those squared (`count` an array where it differs by column)."""
    centred = total / count
    mean, var = centred + shift, squares / count - centred**2
    # A finite mean means finite values: a NaN here is squares past `max` minus
    # squares past `max`, a variance beyond the float range.
    var = xp.where(xp.isnan(var) & xp.isfinite(mean), xp.inf, var)
    return mean, xp.maximum(var, 0)


def _mean_of_groups(x: Any) -> Any:
    """The mean over the leading axis, as a product with weights `1 / groups`: each
    group is scaled before they are added up, which cannot overflow where their mean
    does not (sums of values spread over the float range: `_Average.total`); and XLA:CPU
    runs it as one matrix-vector product, where reductions down the groups of a packed
    log's columns measured slower."""
    if not x.shape[0]:
        return jnp.mean(x, axis=0)  # NaN, as numpy's mean of nothing
    weights = jnp.full(x.shape[0], 1 / x.shape[0], x.dtype)
    return jnp.tensordot(weights, x, axes=1, precision=lax.Precision.HIGHEST)


def _pooled_moments(total: Any, squares: Any, shift: Any, count: Any) -> tuple[Any, Any]:
    """`(mean, variance)` of equal-sized groups pooled along the leading axis, from each
    group's sums (`_moments`): the mean of their variances plus the variance of their
    means."""
    means, variances = _moments(jnp, total, squares, shift, count)
    mean = _mean_of_groups(means)
    return mean, _mean_of_groups(variances) + _mean_of_groups((means - mean) ** 2)


# The sums are divided where they are read, or where a whole packed log pools
# (`_pooled_columns`, one operation for every layer), not in the step: a mean, a
# variance and a fraction finished there were three small XLA kernels a layer, 1-2% of a
# 12 x Linear(256) training step on CPU.
class _Average(_Statistic):
    """A mean or a fraction, kept as the sum of `count` values, each less `offset` (if
    any): equal-sized groups pool to the mean of their sums and offsets."""

    total: Array
    offset: Array | None
    count: int = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)

    @property
    def value(self) -> Any:
        fields = (self.total,) if self.offset is None else (self.total, self.offset)
        return _read(self.dtype, self.count, lambda xp, total, *offset: total / self.count + sum(offset), *fields)

    def pool(self, where: str, *, mapped: bool = False) -> "_Average":
        offset = None if self.offset is None else _mean_of_groups(self.offset)
        return _Average(_mean_of_groups(self.total), offset, self.count, self.dtype)

    def columns(self) -> tuple[tuple[int, Any, Any], ...]:
        offset = () if self.offset is None else ((_MEAN, self.offset, None),)
        return ((_MEAN, self.total, None), *offset)


class _Spread(_Statistic):
    """A standard deviation, kept as the sums over `count` values of their differences
    from `shift` (the first of them) and of those squared. Pooled, the variance is the
    mean of the groups' variances plus the variance of their means (equal-sized
    groups), and the sums are taken about the pooled mean."""

    total: Array
    squares: Array
    shift: Array
    count: int = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)

    @property
    def value(self) -> Any:
        def std(xp, total, squares, shift):
            return xp.sqrt(_moments(xp, total, squares, shift, self.count)[1])

        return _read(self.dtype, self.count, std, self.total, self.squares, self.shift)

    def pool(self, where: str, *, mapped: bool = False) -> "_Spread":
        mean, var = _pooled_moments(self.total, self.squares, self.shift, self.count)
        return _Spread(jnp.zeros_like(mean), var * self.count, mean, self.count, self.dtype)

    def columns(self) -> tuple[tuple[int, Any, Any], ...]:
        moments = (self.total, self.squares, self.shift, self.count)
        return (_TOTAL, self.total, moments), (_SQUARES, self.squares, moments), (_SHIFT, self.shift, moments)


class _Max(_Statistic):
    max: Float[Array, "*batch"]

    @property
    def value(self) -> Float[Array, "*batch"]:
        return self.max

    def pool(self, where: str, *, mapped: bool = False) -> "_Max":
        return _Max(jnp.max(self.max, axis=0))

    def columns(self) -> tuple[tuple[int, Any, Any], ...]:
        return ((_MAX, self.max, None),)


class _Norm(_Statistic):
    norm: Float[Array, "*batch"]

    @property
    def value(self) -> Float[Array, "*batch"]:
        return self.norm

    def pool(self, where: str, *, mapped: bool = False) -> "_Norm":
        return _Norm(jnp.sqrt(jnp.sum(self.norm**2, axis=0)))

    def columns(self) -> tuple[tuple[int, Any, Any], ...]:
        return ((_NORM, self.norm, None),)


# -- skipping the work on steps that are not recorded -------------------------------------
_due = ThreadStack()


@contextlib.contextmanager
def computed_when(due: bool | Bool[ArrayLike, ""]) -> Iterator[None]:
    """Statistics logs called inside the block compute only when `due` (a traced
    boolean inside a compiled step: under `jax.lax.cond`); otherwise they log zeros of
    the same structure. What `px.Recorder.when_due` uses."""
    _due.items.append(due)
    try:
        yield
    finally:
        _due.items.pop()


@functools.partial(_real_jit, static_argnums=(1, 2, 3))
def _program(arrays: list, compute: Callable, treedef: Any, others: tuple) -> Any:
    leaves = [other if array is None else array for array, other in zip(arrays, others)]
    return compute(*jtu.tree_unflatten(treedef, leaves))


def _compiled(compute: Callable[..., Any], *inputs: Any) -> Any:
    """`compute(*inputs)` as one XLA program, compiled once per log, shapes and
    enclosing vmaps. Called eagerly, a histogram is otherwise ~30 operations each
    dispatched (and compiled on first use) alone: `activation_stats` on a 3-layer MLP
    took 3.0 s on its first eager call and 0.5 s on each next one; 1.2 s and 4 ms so.
    Inside a compiled step the program is inlined (the step's optimised HLO has the
    same instructions). `compute`: a module-level function (hashed by identity); the
    arrays of `inputs` are traced, their other leaves (a threshold, a number of axes)
    are part of the key, or, where one cannot be hashed, computed as they are."""
    leaves, treedef = jtu.tree_flatten(inputs)
    arrays = [leaf if eqx.is_array(leaf) else None for leaf in leaves]
    others = tuple(None if eqx.is_array(leaf) else leaf for leaf in leaves)
    try:
        hash(others)
    except TypeError:
        return compute(*inputs)
    return _program(arrays, compute, treedef, others)


def _when_due(compute: Callable[[Any, Any], Any], config: Any, args: Any) -> Any:
    """`compute(config, args)` as one program (`_compiled`), or zeros of its structure
    on steps that are not due (`computed_when`)."""

    def computed(args):
        return _compiled(compute, config, args)

    if not _due.items:
        return computed(args)
    due = _due.items[-1]

    def skip(args):
        return zeros_like(_real_eval_shape(computed, args))

    if isinstance(due, bool):
        return computed(args) if due else skip(args)
    return _real_cond(due, computed, skip, args)


class _AbstractStatisticLog(AbstractLog):
    """A log of one statistic of every float leaf, which `px.StatsLog` pools exactly
    over mapped axes. Used alone it logs the plain values (arrays stack under vmaps like
    any log's)."""

    @abstractmethod
    def statistic(self, x: Array) -> Any:
        """The statistic of one array, in the form that pools: an `AbstractPooled`
        whose `value` is what the log shows."""

    def __call__(self, args: Any) -> Any:
        return _when_due(_statistic_values, (self, 0), args)

    def collect(self, log: dict[str, Any]) -> PackedLog:
        return PackedLog(log)


def _statistic_values(config: tuple[_AbstractStatisticLog, int], args: Any) -> Any:
    log, kept = config
    return _leafwise(lambda x: _pooling_form(log, kept)(x, _Sums(x, _terms_of(log))).value, args)


def _kept_axes(site: CallSite | None) -> int:
    """How many leading axes the model's own transforms add to the log of a call at
    `site` and keep (it is pooled over the others, its vmaps'), where one of them is a
    scan (or `lax.map`, `fori_loop`): a range that follows the data differs from step
    to step, while a vmap's elements share it. 0 where only vmaps run around the call,
    or outside a hooked model (`site` None)."""
    if site is None or len(site.lengths) <= mapped_vmaps():
        return 0
    return len(site.log_index)


class StdLog(_AbstractStatisticLog):
    """Standard deviation of every float leaf."""

    def statistic(self, x: Array, sums: _Sums | None = None) -> _Spread:
        return (sums or _Sums(x, _terms_of(self))).spread()


class NearZeroLog(_AbstractStatisticLog):
    """Fraction of values `<= threshold` (fastai's `near_zero`: after a ReLU, the share of
    (nearly) dead activations)."""

    # Static: it names the sum the statistics of a layer share (`_terms_of`), which a
    # threshold traced by `jax.jit` (as an array leaf would be) could not.
    threshold: float = eqx.field(static=True, default=0.05)

    def statistic(self, x: Array, sums: _Sums | None = None) -> _Average:
        return (sums or _Sums(x, _terms_of(self))).fraction(self.threshold)


class AbsMaxLog(_AbstractStatisticLog):
    """Largest absolute value of every float leaf."""

    def statistic(self, x: Array) -> _Max:
        return _Max(jnp.max(jnp.abs(x)))


class L2NormLog(_AbstractStatisticLog):
    """Euclidean norm of every float leaf (all axes together)."""

    def statistic(self, x: Array) -> _Norm:
        return _Norm(jnp.linalg.norm(jnp.ravel(x)))


# -- histograms ---------------------------------------------------------------------------
class Histogram(AbstractPooled):
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
    - `pool_mapped`: whether vmaps inside the model pool it (`px.HistogramLog`'s
        `pool`).
    - `kept`: how many of its innermost leading axes the model's own transforms added
        and kept where one of them is a scan, along whose steps the bins differ (each
        step's range follows its own values); `px.pool_stats` refuses to pool them. 0
        for an explicit `range`, and where only vmaps ran around the call: every vmap
        shares the range over its elements, so along a vmap's axis the bins agree.

    Logged under `jax.lax.scan` (or a vmap with `pool=False`), every field gains the
    leading axes.
    """

    counts: Int[Array, "*batch bins"]
    edges: Float[Array, "*batch bins+1"]
    below: Int[Array, "*batch"]
    above: Int[Array, "*batch"]
    nan: Int[Array, "*batch"]
    pool_mapped: bool = eqx.field(static=True, default=True)
    kept: int = eqx.field(static=True, default=0)

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

    @property
    def value(self) -> "Histogram":
        return self

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """The counts (`np.asarray(histogram)`, `np.sum(histogram)`); without it NumPy
        would wrap the histogram in a 0-d object array."""
        return np.asarray(self.counts, dtype=dtype, copy=copy)

    def pool(self, where: str, *, mapped: bool = False) -> "Histogram":
        """Add the counts of histograms stacked along a leading axis, whose bins agree
        by construction (a vmap's elements share the range); raises, while tracing,
        where they may not (the axis is one of those `kept`). Along an axis of
        `px.pool_stats` the edges are compared too (`_unshared`)."""
        kept = self.kept
        if mapped:
            # A vmap inside the model: one of the axes counted in `kept`, if any.
            kept = max(kept - 1, 0)
        else:
            _refuse_kept(where, kept, jnp.ndim(self.below))
        counts = jnp.sum(self.counts, axis=0)
        below, above, nan = (jnp.sum(field, axis=0) for field in (self.below, self.above, self.nan))
        edges = self.edges[0]
        if not mapped:
            differ = jnp.any(self.edges != edges, axis=(0, -1))
            counts, edges = _unshared(differ[..., None], counts, edges)
            below, above, nan = _unshared(differ, below, above, nan)
        return Histogram(counts, edges, below, above, nan, self.pool_mapped, kept)

    def columns(self) -> tuple[tuple[int, Any, Any], ...]:
        counted = ((_SUM, field, None) for field in (self.counts, self.below, self.above, self.nan))
        return (*counted, (_EDGES, self.edges, None))


def _refuse_kept(where: str, kept: int, leading: int) -> None:
    """Raise, while tracing, where `px.pool_stats` would pool an axis of a scan inside
    the model (one of the `kept` innermost of a histogram's `leading` axes)."""
    if kept >= leading:
        raise ValueError(
            f"px.pool_stats: the histograms of layer {where!r} have {leading} leading "
            f"axes left, all kept by the model's own transforms, a jax.lax.scan (or lax.map, fori_loop) "
            "among them: each step of a scan bins its histogram over its own range (its values' min "
            "and max), so their counts cannot be added. Pool only the axes of a jax.vmap around the "
            "model (num_axes; before slicing any of the model's axes away), or give px.HistogramLog / "
            "px.activation_stats an explicit range=(low, high)."
        )


def _unshared(differ: Any, *fields: Any) -> tuple[Any, ...]:
    """`fields` of pooled histograms, poisoned where their groups' edges `differ`:
    histograms logged in the steps of a `jax.lax.scan` (or `lax.map`) around the model
    each bin over their own range, and the axis of a scan around the model cannot be
    told from a vmap's while tracing. The edges become NaN and the counts -1, never
    counts of different bins added up; `px.pool_stats` raises on them where it runs
    eagerly (`_refuse_unshared`), not through a host callback in every compiled step."""
    return tuple(
        jnp.where(differ, jnp.asarray(np.nan if jnp.issubdtype(f.dtype, jnp.floating) else -1, f.dtype), f)
        for f in fields
    )


def _refuse_unshared(pooled: Mapping[str, Any]) -> None:
    """Raise on the histograms `_unshared` poisoned, in a log pooled eagerly."""
    floats = [np.asarray(leaf) for leaf in jtu.tree_leaves(pooled) if jnp.issubdtype(leaf.dtype, jnp.floating)]
    if not any(np.isnan(leaf).any() for leaf in floats):
        return
    for path in pooled:
        for value in jtu.tree_leaves(pooled[path], is_leaf=is_pooled):
            histograms = value.statistics.values() if isinstance(value, Stats) else [value]
            for histogram in jtu.tree_leaves(list(histograms), is_leaf=is_pooled):
                if isinstance(histogram, Histogram) and np.any(np.isnan(histogram.edges)):
                    raise ValueError(_UNSHARED.format(where=path))


_UNSHARED = (
    "px.pool_stats: the histograms of layer {where!r} have different bins along the pooled axes: "
    "each was binned over its own range (its values' min and max), as in the steps of a jax.lax.scan "
    "(or lax.map) around the model; only a vmap's elements share one. Pool only the axes of a "
    "jax.vmap around the model, or give px.HistogramLog / px.activation_stats an explicit "
    "range=(low, high). Inside jit such histograms come back with NaN edges and counts of -1."
)


def _edges(index: Any, low: Any, high: Any, bins: int) -> Any:
    """The edges `index` (integers from 0 to `bins`) of `bins` equal bins from `low` to
    `high`, computed elementwise: no gather from a table of edges, which is slow under
    vmap on CPU; the same operations give the same bits for any shape of `index`."""
    # numpy.linspace's arithmetic in the range's precision, so that on CPU the edges are
    # numpy's to the bit. jnp.linspace rounds differently, and XLA would turn a division
    # by a constant (or a broadcast scalar, under vmap) into a multiplication by its
    # reciprocal and fuse the multiply-add: a divisor computed from the data
    # (`delta - delta + bins`, which XLA does not fold for floats) behind a barrier, and
    # a barrier between the multiply and the add, keep each operation rounded as numpy
    # rounds it. (XLA's GPU division is not correctly rounded, so there an edge can
    # differ from numpy's in its last bit; the counts are exact for the edges logged, on
    # every backend.)
    # A range wider than the dtype's largest value (float32 values near -3e38 and 3e38)
    # has an infinite width, which would make every edge NaN: it is then computed
    # halved. Scaling by a power of two is exact, so other ranges keep numpy's bits.
    scale = jnp.where(jnp.isfinite(high - low), 1, 2).astype(low.dtype)
    delta = high / scale - low / scale
    step = delta / lax.optimization_barrier(delta - delta + bins)
    edge = (lax.optimization_barrier(index.astype(low.dtype) * step) + low / scale) * scale
    return jnp.where(index == bins, high, edge)


@functools.cache
def _counter(length: int) -> Callable[[Any], Any]:
    """`bincount(index, length=length)`, whose vmap counts all the examples with one
    bincount of offset indices: vmapped, bincount becomes a scatter with batch
    dimensions, several times slower on CPU."""

    @custom_vmap
    def count(index):
        return jnp.bincount(index, length=length)

    @count.def_vmap
    def count_mapped(axis_size, in_batched, index):
        if not in_batched[0]:
            return count(index), False
        offsets = jnp.arange(axis_size, dtype=index.dtype).reshape(-1, *([1] * (index.ndim - 1)))
        flat = jnp.ravel(index + offsets * length)
        return jnp.bincount(flat, length=axis_size * length).reshape(axis_size, length), True

    return count


@custom_vmap
def _extrema(x: Any) -> tuple[Any, Any]:
    """The min and max of the finite values of `x` (`inf`, `-inf` if none). Under a
    vmap, any vmap (named or not, around the hooked model or inside it, nested), those
    of every element's values: the same for all, so that their histograms have the same
    bins and pool exactly. A vmap around the model is the user's: unnamed, it has no
    axis for a collective (`jax.lax.pmin`) to share the range over."""
    finite = jnp.isfinite(x)
    low = jnp.min(jnp.where(finite, x, jnp.inf), initial=jnp.inf)
    return low, jnp.max(jnp.where(finite, x, -jnp.inf), initial=-jnp.inf)


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


def _estimated_bins(x: Any, low: Any, high: Any, bins: int) -> Any:
    """The bin of each value from its position in the range, then corrected against
    the edges (numpy's own fast path for equal bins): exact when the position is off
    by less than half a bin (`_estimates_exact`). jnp.histogram lowers to a binary
    search plus a scatter-add; this and one bincount are ~2x faster on CPU."""
    # In float32 at least: the position's own rounding is then negligible.
    wide = jnp.promote_types(x.dtype, jnp.float32)
    position = (x.astype(wide) - low.astype(wide)) / (high.astype(wide) - low.astype(wide)) * bins
    # Half a bin up, the estimate is the value's bin or the next one, never the one
    # before: one edge to compare against instead of numpy's two (the estimate's and
    # the next one's), ~10% of a histogram's cost on CPU.
    index = jnp.clip(jnp.floor(position + 0.5).astype(jnp.int32), 0, bins - 1)
    return index - (x < _edges(index, low, high, bins))


def _searched_bins(x: Any, edges: Any, bins: int) -> Any:
    """The bin of each value by a binary search in the logged edges (the last bin `i`
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
    (which no trace tells from a vmap) by their edges: it raises eagerly, and inside
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
        return _when_due(_statistic_values, (self, _kept_axes(site)), args)

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
        edges = _edges(jnp.arange(self.bins + 1), low, high, self.bins)

        # The values outside the bins go to three more slots (below, above, NaN), so
        # that one bincount counts everything: no pass over the values per slot.
        def slots(bin_of: Callable[[Any], Any]) -> Callable[[Any], Any]:
            def slot(x):
                inside = jnp.where(x < low, self.bins, jnp.where(x > high, self.bins + 1, bin_of(x)))
                return jnp.ravel(jnp.where(jnp.isnan(x), self.bins + 2, inside))

            return slot

        # A scalar test picks the search only where the estimate could miss, so it
        # costs nothing otherwise: the cond ~1-10 µs per 64x512 layer on CPU, where
        # computing both and selecting costs ~20 µs more when the cores are busy.
        slot = _real_cond(
            _estimates_exact(edges, low, high, self.bins),
            slots(lambda x: _estimated_bins(x, low, high, self.bins)),
            slots(lambda x: _searched_bins(x, edges, self.bins)),
            x,
        )
        counts = _counter(self.bins + 3)(slot)
        below, above, nan = (counts[..., self.bins + i] for i in range(3))
        return Histogram(counts[..., : self.bins], edges, below, above, nan, self.pool, kept)

    def _axis_names(self) -> tuple[Hashable, ...]:
        if self.axis_name is None:
            return ()
        return self.axis_name if isinstance(self.axis_name, tuple) else (self.axis_name,)


# -- several statistics in one ------------------------------------------------------------
class Stats(AbstractPooled, Mapping):
    """What `px.StatsLog` logs for one layer: a mapping from each statistic's name to
    its value (an array per float leaf, or a `px.Histogram`), as `stats["mean"]`.

    The statistics are kept in a form that pools exactly, so that the vmaps inside the
    model pool them (unless `pool_mapped` is False) and `px.pool_stats` pools the vmap
    around it. Logged under `jax.lax.scan` every value gains the leading axis.

    Its arrays are packed in one buffer per dtype (`buffers`), as a `px.PackedLog`
    packs the statistics of every layer: each output of a compiled step costs its every
    call.

    **Arguments:**

    - `statistics`: statistic name -> its pooling form (a tree of `_Statistic`s or a
        `px.Histogram`); read them back by name.
    - `pool_mapped`: whether vmaps inside the model pool it (`px.StatsLog`'s `pool`).
    """

    buffers: tuple[Array, ...]
    names: tuple[str, ...] = eqx.field(static=True)
    packing: Packing = eqx.field(static=True)
    pool_mapped: bool = eqx.field(static=True, default=True)

    def __init__(self, statistics: dict[str, Any], pool_mapped: bool = True, *, _own_shapes=None):
        self.names = tuple(statistics)
        self.packing, self.buffers = Packing.pack(tuple(statistics.values()), _own_shapes)
        self.pool_mapped = pool_mapped

    @property
    def statistics(self) -> dict[str, Any]:
        """Each statistic in its pooling form."""
        return {name: self.packing.unpack(self.buffers, i) for i, name in enumerate(self.names)}

    @property
    def num_leading_axes(self) -> int:
        """The axes added by the vmaps and scans it was logged under."""
        return num_leading_axes(self.buffers)

    def __getitem__(self, name: str) -> Any:
        try:
            index = self.names.index(name)
        except ValueError:
            raise KeyError(name) from None
        return jtu.tree_map(lambda s: s.value, self.packing.unpack(self.buffers, index), is_leaf=is_pooled)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def pool(self, where: str, *, mapped: bool = False) -> "Stats":
        # Pooling keeps every array's own shape (and may change a histogram's static
        # fields): the pooled statistics are packed along the same shapes. All of them
        # pool with the `Stats`, whatever their own `pool_mapped`.
        pooled = {
            name: jtu.tree_map(lambda v: v.pool(where, mapped=mapped), value, is_leaf=is_pooled)
            for name, value in self.statistics.items()
        }
        return Stats(pooled, self.pool_mapped, _own_shapes=self.packing.own_shapes())


def _pooling_form(log: AbstractLog, kept: int = 0) -> Callable[[Any, _Sums], Any]:
    """The statistic `log` computes, in its pooling form, from an array and its sums
    (`_Sums`, with at least the terms `_terms_of(log)`); `kept`: the leading axes the
    model's own transforms will keep (`_kept_axes`), which a histogram must know."""
    if isinstance(log, HistogramLog):
        return lambda x, sums: log.statistic(x, kept=kept)
    if _terms_of(log):
        if isinstance(log, MeanLog):
            return lambda x, sums: sums.mean()
        return lambda x, sums: log.statistic(x, sums)
    if isinstance(log, _AbstractStatisticLog):
        return lambda x, sums: log.statistic(x)
    raise TypeError(
        f"px.StatsLog pools its statistics exactly over mapped axes, which {type(log).__name__} "
        "does not say how to do: use px.MeanLog, px.StdLog, px.NearZeroLog, px.AbsMaxLog, "
        "px.L2NormLog or px.HistogramLog, and log anything else with a hook of its own."
    )


class _Logs(Mapping):
    """A `px.StatsLog`'s `{name: statistic log}`, hashable, so that it can be a static
    field. The statistic logs hold no arrays; as pytree nodes each cost every call of a
    compiled step a flatten and an unflatten of every copy of the hooked model's
    structure it takes and returns (the model, the optimiser's moments): ~45 µs of a
    12-layer MLP's training step on CPU."""

    def __init__(self, logs: Mapping[str, AbstractLog]):
        self._items = tuple(logs.items())

    def __getitem__(self, name: str) -> AbstractLog:
        for key, log in self._items:
            if key == name:
                return log
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (key for key, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __repr__(self) -> str:
        return repr(dict(self._items))


class StatsLog(AbstractLog):
    """Several statistics in one: `StatsLog({"mean": px.MeanLog(), "max": px.AbsMaxLog()})`
    logs a `px.Stats` for every layer, read as `log[layer]["mean"]`, `log[layer]["max"]`.

    Its statistics pool exactly over the vmaps inside the model (Equinox's own, as in
    `eqx.nn.MultiheadAttention`, or yours), so that the log has one value per layer (per
    step of a scanned stack) whatever the batch and sequence length; `px.pool_stats`
    pools a vmap around the model.

    **Arguments:**

    - `logs`: name -> statistic log (`px.MeanLog`, `px.StdLog`, `px.NearZeroLog`,
        `px.AbsMaxLog`, `px.L2NormLog`, `px.HistogramLog`).
    - `pool`: pool over the vmaps inside the model (default); False keeps one value per
        example or position there.
    """

    logs: Mapping[str, AbstractLog] = eqx.field(static=True, converter=_Logs)
    pool: bool = eqx.field(static=True, default=True)

    def __check_init__(self):
        for name, log in self.logs.items():
            _pooling_form(log)
            # Static (`_Logs`): arrays there would be hashed into every compiled step's key.
            if any(eqx.is_array(leaf) for leaf in jtu.tree_leaves(log)):
                raise TypeError(f"StatsLog: the statistic log {name!r} holds arrays; a statistic's settings are "
                                f"Python numbers, got {log!r}")

    @property
    def needs_indices(self) -> bool:
        # It takes the call site for its static parts (`_kept_axes`), not the indices.
        return False

    def __call__(self, args: Any, site: CallSite | None = None) -> Stats:
        return _when_due(_stats_of, (self, _kept_axes(site)), args)

    def collect(self, log: dict[str, Any]) -> PackedLog:
        return PackedLog(log)


def _stats_of(config: tuple[StatsLog, int], args: Any) -> Stats:
    log, kept = config
    forms = {name: _pooling_form(statistic, kept) for name, statistic in log.logs.items()}
    # The sums every statistic of a leaf needs, each computed once for all of them.
    terms = tuple(dict.fromkeys(term for statistic in log.logs.values() for term in _terms_of(statistic)))
    leaves, treedef = jtu.tree_flatten(plain_containers(args))
    sums = [_Sums(x, terms) if eqx.is_inexact_array(x) and terms else None for x in leaves]

    def statistics(form: Callable[[Any, Any], Any]) -> Any:
        return jtu.tree_unflatten(
            treedef, [form(x, s) if eqx.is_inexact_array(x) else None for x, s in zip(leaves, sums)]
        )

    return Stats({name: statistics(form) for name, form in forms.items()}, log.pool)


def activation_stats(
    near_zero: float = 0.05,
    bins: int = 40,
    range: tuple[float, float] | None = None,
    axis_name: Hashable | None = None,
    pool: bool = True,
) -> StatsLog:
    """fastai's `ActivationStats` statistics: mean, std, near-zero fraction, histogram.

    **Arguments:**

    - `near_zero`: threshold of the near-zero fraction.
    - `bins`, `range`, `axis_name`: the histogram's, as for `px.HistogramLog` (fastai
        uses 40 bins over `(0, 10)`, which suits activations after a ReLU; by default the
        range follows the data, shared over every vmap).
    - `pool`: pool over the vmaps inside the model (default: one value per layer);
        False keeps one value per example or position there.

    **Returns:**

    A `StatsLog` with keys `mean`, `std`, `near_zero`, `hist` (a `px.Histogram`).
    """
    return StatsLog(
        {
            "mean": MeanLog(),
            "std": StdLog(),
            "near_zero": NearZeroLog(near_zero),
            "hist": HistogramLog(bins, range, axis_name, pool),
        },
        pool,
    )


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
    told from a vmap's while tracing, so the pooled histograms' edges are compared:
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
    # The histograms whose groups' edges differ (`_unshared`).
    differ = None
    for x, kinds, members in zip(buffers, plan.kinds, plan.members):
        if np.any(kinds == _EDGES):
            edges_differ = jnp.any(x != x[0], axis=0) & (kinds == _EDGES)
            hits = edges_differ.astype(jnp.float32) @ members > 0
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
    out = x[0]  # a histogram's edges: the groups share them
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
