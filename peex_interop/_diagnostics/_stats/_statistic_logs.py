"""The logs of one statistic of every float leaf (`px.StdLog`, `px.NearZeroLog`,
`px.AbsMaxLog`, `px.L2NormLog`; `px.HistogramLog` in `_histogram_log.py`), and the sums
(`_terms_of`) the statistics of a `px.StatsLog` share."""

from abc import abstractmethod
from collections.abc import Hashable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array

from ..._engine import CallSite, mapped_vmaps
from ..._hooks import AbstractLog, MeanLog, plain_containers
from .._packing import PackedLog
from ._pooled import _Average, _Max, _Norm, _Spread
from ._sums import _Sums
from ._when_due import _when_due


def _leafwise(statistic, value: Any) -> Any:
    """`statistic` of every float leaf of `value` (None for other leaves), in plain
    containers: the user's own pytree nodes are not rebuilt around statistics
    (`plain_containers`)."""
    return jtu.tree_map(
        lambda x: statistic(x) if eqx.is_inexact_array(x) else None, plain_containers(value)
    )


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


class _AbstractStatisticLog(AbstractLog):
    """A log of one statistic of every float leaf, which `px.StatsLog` pools exactly
    over mapped axes. Used alone it logs the plain values (arrays stack under vmaps like
    any log's)."""

    @abstractmethod
    def statistic(self, x: Array) -> Any:
        """The statistic of one array, in the form that pools: an `AbstractPooled`
        whose `value` is what the log shows."""

    def __call__(self, args: Any) -> Any:
        return _when_due(_statistic_values, self, args)

    def collect(self, log: dict[str, Any]) -> PackedLog:
        return PackedLog(log)


def _statistic_values(log: _AbstractStatisticLog, args: Any) -> Any:
    return _leafwise(lambda x: log.statistic(x).value, args)


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
