"""How a layer's value splits into cells, for patching sweeps (`px.patch_sweep`) and
path patching: `px.Whole`, `px.Along`, `px.Groups`, and a tuple of them for their
product (by position *and* head).

A split is described on the value one row of a sweep holds: the cached value of one
call, the steps of a stack of layers taken off, the axes of the `vmap`s inside it kept
(Equinox's attention projects each position in a `vmap`: its `output_proj` value is
`(positions, width)` here, though each call sees one position). The masks are built on
that shape and sliced to each call by its traced indices.
"""

import abc
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from .._errors import HookError


class AbstractCells(eqx.Module):
    """One way of splitting a value into cells (`px.Whole`, `px.Along`, `px.Groups`)."""

    @abc.abstractmethod
    def counts(self, shape: tuple[int, ...], path: str) -> tuple[int, ...]:
        """The number of cells along each axis this split adds to a sweep's result, for
        a value of `shape` at layer `path` (raising `px.HookError` if it does not fit)."""

    @abc.abstractmethod
    def mask(self, shape: tuple[int, ...], index: tuple[Any, ...]) -> Bool[Array, "..."]:
        """Where the cell `index` (one integer per count, traced or not) lies in a value
        of `shape`: a boolean array broadcastable to `shape`."""


class Whole(AbstractCells):
    """The whole value is one cell (TransformerLens's `_all_pos` sweeps, with the head
    split: `(px.Groups(-1, heads),)` alone). Adds no axis to a sweep's result."""

    def counts(self, shape: tuple[int, ...], path: str) -> tuple[int, ...]:
        return ()

    def mask(self, shape: tuple[int, ...], index: tuple[Any, ...]) -> Bool[Array, "..."]:
        return jnp.ones((), bool)


def _axis(cells: AbstractCells, axis: int, shape: tuple[int, ...], path: str) -> int:
    if not -len(shape) <= axis < len(shape):
        raise HookError(
            f"{cells} for layer {path!r}: axis {axis} is out of range for its value of shape {shape} "
            f"(a stack's steps taken off, the axes of the vmaps inside it kept)"
        )
    return axis % len(shape)


def _along(axis: int, ndim: int, values: Int[Array, " n"]) -> Int[Array, "..."]:
    return values.reshape((-1,) + (1,) * (ndim - axis - 1))


class Along(AbstractCells):
    """One cell per index of an axis: per position (`px.Along(1)` on a `(batch,
    positions, width)` value), per neuron (`px.Along(-1)`)."""

    axis: int = eqx.field(static=True)

    def __init__(self, axis: int):
        """**Arguments:**

        - `axis`: the axis of the row's value (negative counts from the end).
        """
        self.axis = axis

    def counts(self, shape: tuple[int, ...], path: str) -> tuple[int, ...]:
        return (shape[_axis(self, self.axis, shape, path)],)

    def mask(self, shape: tuple[int, ...], index: tuple[Any, ...]) -> Bool[Array, "..."]:
        axis = self.axis % len(shape)
        return _along(axis, len(shape), jnp.arange(shape[axis])) == index[0]


class Groups(AbstractCells):
    """An axis split into `count` equal consecutive groups: the heads of a concatenated
    head axis (`px.Groups(-1, heads)` on the input of an attention's output projection;
    `px.Groups(-1, 3 * heads)` on a fused query-key-value projection's output: the
    queries of each head, then the keys, then the values)."""

    axis: int = eqx.field(static=True)
    count: int = eqx.field(static=True)

    def __init__(self, axis: int, count: int):
        """**Arguments:**

        - `axis`: the axis of the row's value (negative counts from the end).
        - `count`: how many equal groups it splits into.
        """
        self.axis = axis
        self.count = count

    def counts(self, shape: tuple[int, ...], path: str) -> tuple[int, ...]:
        size = shape[_axis(self, self.axis, shape, path)]
        if self.count < 1 or size % self.count:
            raise HookError(
                f"{self} for layer {path!r}: axis {self.axis} of its value of shape {shape} has "
                f"size {size}, which does not split into {self.count} equal groups"
            )
        return (self.count,)

    def mask(self, shape: tuple[int, ...], index: tuple[Any, ...]) -> Bool[Array, "..."]:
        axis = self.axis % len(shape)
        return _along(axis, len(shape), jnp.arange(shape[axis]) // (shape[axis] // self.count)) == index[0]


# A split, or a tuple of splits for their product (cells by position and head).
Cells = AbstractCells | Sequence[AbstractCells]
# The default split: one cell, the whole value.
WHOLE = Whole()


def _parts(cells: Cells) -> tuple[AbstractCells, ...]:
    parts = (cells,) if isinstance(cells, AbstractCells) else tuple(cells)
    for part in parts:
        if not isinstance(part, AbstractCells):
            raise HookError(
                f"cells= takes px.Whole(), px.Along(axis), px.Groups(axis, count) or a tuple of them, not {part!r}"
            )
    return parts


def cell_counts(cells: Cells, shape: tuple[int, ...], path: str) -> tuple[int, ...]:
    """The cell counts of `cells` on a value of `shape` at layer `path`: the axes a sweep
    adds to its result, outermost first."""
    return tuple(count for part in _parts(cells) for count in part.counts(shape, path))


def cell_mask(cells: Cells, shape: tuple[int, ...], index: Sequence[Any]) -> Bool[Array, "..."]:
    """Where cell `index` (one integer per count of `cell_counts`) lies in a value of
    `shape`: a boolean array of that shape."""
    mask, used = jnp.ones(shape, bool), 0
    for part in _parts(cells):
        taken = len(part.counts(shape, ""))
        mask = mask & part.mask(shape, tuple(index[used : used + taken]))
        used += taken
    return mask
