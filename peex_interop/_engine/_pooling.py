"""Values that a vmap inside the model pools instead of stacking.

A log recorded inside a threaded `jax.vmap` body leaves it stacked along the mapped axis:
one value per example, or per position when the model maps over positions itself
(`eqx.nn.MultiheadAttention`, `jax.vmap(self.norm)(x)`). For a statistic that makes its
size grow with the batch and the sequence length. A value that knows how to combine a
stack of itself into one (`AbstractPooled`) is pooled instead when it leaves the vmap,
exactly, so that it stays one value per layer whatever the model maps over inside.

Only vmaps pool: the steps of a `jax.lax.scan` (or `lax.map`, `fori_loop`) are kept,
since a scan over a stack of layers runs different layers, and a scan over time steps
different steps; `shard_map` keeps one block per device (a fixed number).

Pooling needs every element of the mapped axis to describe the same bins (histograms):
a histogram shares its range over every vmap by a `custom_vmap` rule (see
`_diagnostics/_stats.py`), and `mapped_vmaps()` counts the threaded vmaps around a
statistic, so that it can tell whether it also runs in a scan, whose steps keep their
own ranges. `mapped_axes()` names the threaded vmaps whose bodies are being traced, for a
log that says `needs_axis_names` (the engine then names every threaded vmap for it).
"""

from abc import abstractmethod
from collections.abc import Callable, Hashable
from typing import Any, Self

import equinox as eqx
import jax.tree_util as jtu

from ._threads import ThreadStack


class AbstractPooled(eqx.Module):
    """A value (a pytree of arrays) that combines exactly with others of its kind: a
    statistic of some values, which pools into the statistic of all of them.

    Leaving a vmap inside a hooked model, it is pooled over the mapped axis instead of
    stacked, unless `pool_mapped` is False (one value per example or position, as
    asked).
    """

    # Part of a hooked model (or of its log), flattened at every call of a compiled
    # step: see `AbstractConverted`'s `__getattribute__`.
    __getattribute__ = object.__getattribute__

    @property
    @abstractmethod
    def pool_mapped(self) -> bool:
        """Whether a vmap inside the model pools it (else it stacks it, as it would
        any log)."""

    @abstractmethod
    def pool(self, where: str, *, mapped: bool = False) -> Self:
        """Combine a stack of values, each the statistic of one equal-sized group of
        values, stacked along a new leading axis of every array, into the statistic
        of all the groups' values.

        **Arguments:**

        - `where`: the log key the value was recorded under, for error messages.
        - `mapped`: whether the axis is a vmap's inside the model, pooled as the vmap
            returns (else one that `px.pool_stats` pools, from around the model).

        **Returns:**

        The pooled value, without the leading axis.
        """


def is_pooled(value: Any) -> bool:
    return isinstance(value, AbstractPooled)


def pool_values(tree: Any, where: str, num_axes: int = 1, *, mapped: bool = False) -> Any:
    """Pool every `AbstractPooled` value of `tree` over its `num_axes` leading axes
    (with `mapped`, only those that ask to be pooled over vmaps); anything else is left
    as it is. `where`: the log key, for error messages."""

    def pooled(value: Any) -> Any:
        if not is_pooled(value) or (mapped and not value.pool_mapped):
            return value
        for _ in range(num_axes):
            value = value.pool(where, mapped=mapped)
        return value

    return jtu.tree_map(pooled, tree, is_leaf=is_pooled)


def pool_log(log: dict[str, Any], num_axes: int = 1, *, mapped: bool = False) -> dict[str, Any]:
    """`pool_values` of every entry of a log (`{key: value}`)."""
    return {key: pool_values(value, key, num_axes, mapped=mapped) for key, value in log.items()}


_axes = ThreadStack()
_vmaps = ThreadStack()


def mapped_axes() -> tuple[Hashable, ...]:
    """The axis names of the threaded vmaps inside the hooked model whose bodies are
    being traced in this thread, outermost first: what a pooled statistic is pooled
    over when it leaves them."""
    return tuple(_axes.items)


def mapped_vmaps() -> int:
    """How many threaded vmaps inside the hooked model, named or not, have bodies being
    traced in this thread: the mapped bodies around a statistic that are no scans."""
    return len(_vmaps.items)


def pooled_vmap(real_vmap: Callable, threaded: Any) -> Callable:
    """`real_vmap` for a threaded body (`_bodies.Body`) that returns `(out, logs)`,
    one log per hooking context: the vmap's `axis_name` (if any) is known to
    `mapped_axes()` while the body is traced, and the `AbstractPooled` values of forward
    logs leave pooled over the mapped axis.

    Not pooled: backward logs (a backward log's slot is a mapped input of the body: its
    cotangents are per example, so its shape keeps the mapped axis), and the logs of a
    vmap over a stack of layers (an ensemble): each element is another layer.
    """
    backward = [getattr(context.policy, "uses_probes", False) for context in threaded.contexts]

    def vmap(body: Callable, in_axes: Any, out_axes: Any, **options) -> Callable:
        # Named when a log asks for it (`needs_axis_names`): the engine names it then.
        names = () if options.get("axis_name") is None else (options["axis_name"],)

        def named_body(*args, **kwargs):
            _axes.items.extend(names)
            _vmaps.items.append(None)
            try:
                return body(*args, **kwargs)
            finally:
                _vmaps.items.pop()
                del _axes.items[len(_axes.items) - len(names) :]

        mapped = real_vmap(named_body, in_axes, out_axes, **options)

        def call(*args, **kwargs):
            out, logs = mapped(*args, **kwargs)
            pools = [not (probes or stack) for probes, stack in zip(backward, threaded.stacked)]
            return out, [pool_log(log, mapped=True) if pooling else log for log, pooling in zip(logs, pools)]

        return call

    return vmap
