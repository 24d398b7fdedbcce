"""`px.Histogram`: the counts of one array's values in equal bins, which pool by adding
up where their bins agree (`pool`), and refuse to where they may not."""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ..._engine import AbstractPooled
from ._pooled import _EDGES, _SUM


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
