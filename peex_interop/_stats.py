"""Statistics logs: reduce activations (or cotangents) on the device, inside the step.

Each log maps every floating-point array leaf of what it receives to a statistic, so it
works on layers with several outputs; non-float leaves (ints, keys) are not logged.
"""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from ._logs import AbstractLog, MeanLog


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
        return _leafwise(lambda x: jnp.histogram(x, self.bins, self.range)[0], args)


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
