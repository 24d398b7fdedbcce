"""Statistics logs: reduce activations (or cotangents) on the device, inside the step.

Each log maps every floating-point array leaf of what it receives to a statistic, so it
works on layers with several outputs; non-float leaves (ints, keys) are not logged.
"""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

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


class HistogramLog(AbstractLog):
    """Counts in `bins` equal bins over `range` (fastai: 40 bins over [0, 10]); values
    outside the range are not counted, as in `numpy.histogram`."""

    bins: int = eqx.field(static=True, default=40)
    range: tuple[float, float] = eqx.field(static=True, default=(0.0, 10.0))

    def __call__(self, args: Any) -> Any:
        return _leafwise(self._counts, args)

    def _counts(self, x: Any) -> Any:
        # jnp.histogram lowers to a binary search plus a scatter-add; computing the bin
        # directly and counting with bincount is ~2x faster on CPU. The two corrections
        # reproduce numpy's handling of values that rounding puts in a neighbour bin.
        low, high = self.range
        x = jnp.ravel(x)
        # The edges numpy.histogram uses (computed in float64, then cast).
        edges = jnp.asarray(np.linspace(low, high, self.bins + 1).astype(x.dtype))
        index = jnp.clip(jnp.floor((x - low) * (self.bins / (high - low))).astype(jnp.int32), 0, self.bins - 1)
        index = index - (x < edges[index])
        index = index + ((x >= edges[index + 1]) & (index != self.bins - 1))
        inside = (x >= low) & (x <= high)
        return jnp.bincount(jnp.where(inside, index, self.bins), length=self.bins + 1)[: self.bins]


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
    near_zero: float = 0.05, bins: int = 40, range: tuple[float, float] = (0.0, 10.0)
) -> StatsLog:
    """fastai's `ActivationStats` statistics: mean, std, near-zero fraction, histogram.

    **Arguments:**

    - `near_zero`: threshold of the near-zero fraction.
    - `bins`, `range`: the histogram's bins.

    **Returns:**

    A `StatsLog` with keys `mean`, `std`, `near_zero`, `hist`.
    """
    return StatsLog(
        {
            "mean": MeanLog(),
            "std": StdLog(),
            "near_zero": NearZeroLog(near_zero),
            "hist": HistogramLog(bins, range),
        }
    )


def _pool(name: str, values: dict[str, Any], axes: tuple[int, ...]) -> Any:
    value = values[name]
    if name == "hist":
        return jnp.sum(value, axis=axes)
    if name == "std":
        # Equal-sized groups: pooled variance = mean(var_i + mean_i**2) - mean**2.
        mean = values["mean"]
        second_moment = jnp.mean(value**2 + mean**2, axis=axes)
        return jnp.sqrt(jnp.maximum(second_moment - jnp.mean(mean, axis=axes) ** 2, 0.0))
    if name in ("mean", "near_zero"):
        return jnp.mean(value, axis=axes)
    raise ValueError(f"cannot pool statistic {name!r}: pool only px.activation_stats() logs")


def pool_stats(log: dict[str, Any], num_axes: int = 1) -> dict[str, Any]:
    """Pool `px.activation_stats()` statistics over their leading `num_axes` axes,
    exactly (as if computed over all examples at once).

    Layers inside a `jax.vmap` over examples (the usual Equinox style) log one
    statistic per example; pooling inside the compiled step keeps what is returned and
    recorded independent of the batch size.

    **Arguments:**

    - `log`: a log of `px.activation_stats()` (`{path: {"mean", "std", ...}}`).
    - `num_axes`: how many leading (example) axes to pool.

    **Returns:**

    The log with those axes pooled.
    """
    axes = tuple(range(num_axes))
    return {
        path: {name: _pool(name, values, axes) for name in values}
        for path, values in log.items()
    }
