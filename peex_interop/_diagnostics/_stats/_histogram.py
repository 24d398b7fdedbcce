"""`px.Histogram`: the counts of one array's values in equal bins, which pool by adding
up where their bins agree (`pool`), and refuse to where they may not; and the edges of
equal bins (`bin_edges`), as `numpy.histogram` computes them."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from ..._engine import AbstractPooled
from ._pooled import _RANGE, _SUM


def bin_edges(index: Any, low: Any, high: Any, bins: int, spacing: tuple[Any, Any] | None = None) -> Any:
    """The edges `index` (integers from 0 to `bins`) of `bins` equal bins from `low` to
    `high`, computed elementwise as `numpy.linspace` computes them, to the bit on CPU:
    in a compiled step for every value binned (no gather from a table of edges, which
    XLA:CPU runs a value at a time), and where a histogram's `edges` are read.
    `spacing`: `edge_spacing(low, high, bins)`, if computed already."""
    # numpy.linspace's arithmetic in the range's precision. jnp.linspace rounds
    # differently, and XLA would contract the multiply-add into a fused one: the
    # product passes through an integer xor with a zero XLA cannot see (`_opaque`), so
    # that each operation is rounded as numpy rounds it. (XLA's GPU division is not
    # correctly rounded, so there an edge can differ from numpy's in its last bit; the
    # counts are exact for the edges logged, on every backend.)
    low, high = jnp.asarray(low), jnp.asarray(high)
    scale, step = edge_spacing(low, high, bins) if spacing is None else spacing
    product = _opaque(jnp.asarray(index).astype(low.dtype) * step)
    return jnp.where(index == bins, high, (product + low / scale) * scale)


def edge_spacing(low: Any, high: Any, bins: int) -> tuple[Any, Any]:
    """`(scale, step)` of `bin_edges`: the edges are `index * step + low` in units of
    `scale`. Computed once, behind a barrier: XLA would otherwise compute them again
    for every value binned, a division each."""
    # A range wider than the dtype's largest value (float32 values near -3e38 and 3e38)
    # has an infinite width, which would make every edge NaN: it is then computed
    # halved. Scaling by a power of two is exact, so other ranges keep numpy's bits.
    # The divisor is hidden (`_opaque`): XLA would turn a division by a constant into a
    # multiplication by its reciprocal, rounded differently.
    scale = jnp.where(jnp.isfinite(high - low), 1, 2).astype(low.dtype)
    step = (high / scale - low / scale) / _opaque(jnp.asarray(bins, low.dtype))
    return lax.optimization_barrier((scale, step))


def _opaque(x: Any) -> Any:
    """`x`, through an integer xor with a zero that XLA cannot see: XLA and LLVM neither
    fold it nor fuse the operations on either side of it, as an optimization barrier
    would keep them apart, but inside one fused loop (a barrier writes its operand out:
    one more pass over every layer's values)."""
    bits = jnp.dtype(f"int{8 * x.dtype.itemsize}")
    zero = lax.optimization_barrier(jnp.zeros((), bits))
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, bits) ^ zero, x.dtype)


class Histogram(AbstractPooled):
    """What `px.HistogramLog` logs for one array: counts in equal bins from `low` to
    `high` and every value outside them counted, so that
    `counts.sum() + below + above + nan` is the number of values (`total`).

    **Fields:**

    - `counts`: the number of values in each bin: `counts` is exactly
        `numpy.histogram(values, bins=edges)[0]` (each bin includes its left edge, the
        last one both).
    - `low`, `high`: the range of the bins, in the values' `dtype`. Their `edges`
        (`bins + 1`, equally spaced, as `numpy.histogram` computes them) are computed
        where read: logged, they would be most of a training step's statistics, and
        every step would compare them where `px.pool_stats` pools.
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
    - `dtype`: the dtype the values were binned in (their edges are computed in it).

    Logged under `jax.lax.scan` (or a vmap with `pool=False`), every field gains the
    leading axes.
    """

    counts: Int[Array, "*batch bins"]
    low: Float[Array, "*batch"]
    high: Float[Array, "*batch"]
    below: Int[Array, "*batch"]
    above: Int[Array, "*batch"]
    nan: Int[Array, "*batch"]
    pool_mapped: bool = eqx.field(static=True, default=True)
    kept: int = eqx.field(static=True, default=0)
    dtype: Any = eqx.field(static=True, default=None)

    @property
    def edges(self) -> Float[Array, "*batch bins+1"] | np.ndarray | jax.ShapeDtypeStruct:
        """The `bins + 1` edges the values were counted against (NaN where
        `px.pool_stats` found bins that differ): numpy's for a histogram fetched to the
        host, a shape for one from `jax.eval_shape`."""
        bins = self.counts.shape[-1]
        if isinstance(self.low, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((*self.low.shape, bins + 1), self.low.dtype)
        # In the dtype the values were binned in, whatever the range was cast to since.
        dtype = self.dtype or self.low.dtype
        low, high = (jnp.asarray(end).astype(dtype)[..., None] for end in (self.low, self.high))
        edges = bin_edges(jnp.arange(bins + 1), low, high, bins)
        host = not any(isinstance(end, jax.Array) for end in (self.low, self.high))
        return np.asarray(edges) if host else edges

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
        low, high = self.low[0], self.high[0]
        if not mapped:
            differ = jnp.any(self.low != low, axis=0) | jnp.any(self.high != high, axis=0)
            (counts,) = _unshared(differ[..., None], counts)
            low, high, below, above, nan = _unshared(differ, low, high, below, above, nan)
        return Histogram(counts, low, high, below, above, nan, self.pool_mapped, kept, self.dtype)

    def columns(self) -> tuple[tuple[int, Any, Any], ...]:
        counted = ((_SUM, field, None) for field in (self.counts, self.below, self.above, self.nan))
        return (*counted, (_RANGE, self.low, None), (_RANGE, self.high, None))


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
    """`fields` of pooled histograms, poisoned where their groups' ranges `differ`:
    histograms logged in the steps of a `jax.lax.scan` (or `lax.map`) around the model
    each bin over their own range, and the axis of a scan around the model cannot be
    told from a vmap's while tracing. The range (so the edges) becomes NaN and the
    counts -1, never counts of different bins added up; `px.pool_stats` raises on them
    where it runs eagerly (`_refuse_unshared`), not through a host callback in every
    compiled step."""
    return tuple(
        jnp.where(differ, jnp.asarray(np.nan if jnp.issubdtype(f.dtype, jnp.floating) else -1, f.dtype), f)
        for f in fields
    )
