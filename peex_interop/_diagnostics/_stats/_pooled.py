"""Statistics of one array, kept in the form that pools.

A mean or a fraction is kept as a sum, a standard deviation as the sums of differences
from a shift and of their squares, a maximum and a norm as themselves: each pools
exactly over a leading axis (`pool`), and is divided into what users read only where it
is read (`value`). `columns` says how each field pools, so that `px.pool_stats` can pool
a whole packed log at once (`_pool_stats.py`).
"""

from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from ..._engine import AbstractPooled

# How each field of a statistic pools over a leading axis: the mean of the groups'; the
# sums of a spread (`_Spread`: differences from a shift, and their squares, and the
# shift), pooled together; the maximum, the norm, the sum, and a histogram's range (the
# first group's, which all must share).
_MEAN, _TOTAL, _SQUARES, _SHIFT, _MAX, _NORM, _SUM, _RANGE = range(8)


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


