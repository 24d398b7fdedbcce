"""Statistics travel packed: every array of a log of statistics in one buffer per dtype.

Each output of a compiled step costs its every call: a buffer to allocate and fill, an
array to build, a leaf to flatten and unflatten (measured on a 2-core CPU: ~12 µs an
output, 3% of an MLP training step for 24 small outputs). The statistics of every layer
are a few scalars and counts per layer, so they leave the step as two arrays (floats,
counts) instead of dozens, and are unpacked, by slicing, where they are read.

A buffer is `(1, size)`, not `(size,)`: a vmap or scan over a packed value adds its axes
in front, and with `out_axes=1` (or later) it would add one after the packed axis, where
slices would cut across examples. The unit axis shows where every added axis went,
whatever its length; a buffer of `(n, size)` could not tell `out_axes=1` over `size`
examples from `out_axes=0`.
"""

import math
from collections.abc import Iterator, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array

# (buffer index, start, stop, own shape) of one array in the buffers.
_Span = tuple[int, int, int, tuple[int, ...]]


class Packing(eqx.Module):
    """Where the arrays of some entries (pytrees) lie in one flat buffer per dtype: per
    entry its structure, and per array its buffer, span and own shape. Arrays gain
    leading axes after packing (vmaps, scans over the packed value): their own shape
    stays the trailing part. Buffers are `(*leading, 1, size)` (see the module's
    docstring)."""

    treedefs: tuple[Any, ...]
    spans: tuple[tuple[_Span, ...], ...]
    # The length of each buffer (its last axis), as packing counted them.
    sizes: tuple[int, ...]

    @staticmethod
    def pack(
        entries: tuple[Any, ...], own_shapes: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    ) -> tuple["Packing", tuple[Array, ...]]:
        """`(packing, buffers)` of `entries`, whose arrays have the shapes `own_shapes`
        (one tuple per entry; default: their shapes) after leading axes they share."""
        flat = [jtu.tree_flatten(entry) for entry in entries]
        if own_shapes is None:
            own_shapes = tuple(tuple(np.shape(leaf) for leaf in leaves) for leaves, _ in flat)
        first = next(((leaves[0], shapes[0]) for (leaves, _), shapes in zip(flat, own_shapes) if leaves), None)
        lead = () if first is None else np.shape(first[0])[: np.ndim(first[0]) - len(first[1])]
        dtypes: dict[np.dtype, int] = {}
        parts: list[list[Any]] = []
        sizes: list[int] = []
        spans = []
        for (leaves, _), shapes in zip(flat, own_shapes):
            entry_spans = []
            for leaf, shape in zip(leaves, shapes):
                buffer = dtypes.setdefault(np.dtype(leaf.dtype), len(dtypes))
                if buffer == len(parts):
                    parts.append([])
                    sizes.append(0)
                size = math.prod(shape)
                entry_spans.append((buffer, sizes[buffer], sizes[buffer] + size, shape))
                sizes[buffer] += size
                parts[buffer].append(jnp.reshape(leaf, (*lead, size)))
            spans.append(tuple(entry_spans))
        buffers = tuple(jnp.concatenate(part, axis=-1)[..., None, :] for part in parts)
        return Packing(tuple(treedef for _, treedef in flat), tuple(spans), tuple(sizes)), buffers

    def unpack(self, buffers: tuple[Any, ...], index: int) -> Any:
        """Entry `index`, from buffers of jax or (fetched to the host) numpy arrays, or
        of `jax.ShapeDtypeStruct`s (what `jax.eval_shape` gives)."""
        lead = buffers[0].shape[:-2] if buffers else ()
        # A vmap or scan around the packed value must add its axes in front of the unit
        # axis: after it, slices would cut across examples instead of statistics.
        if [tuple(buffer.shape) for buffer in buffers] != [(*lead, 1, size) for size in self.sizes]:
            raise ValueError(
                f"packed statistics: buffers of shapes {[tuple(b.shape) for b in buffers]}, expected "
                f"{', '.join(f'(..., 1, {size})' for size in self.sizes)} with the same leading axes: a vmap "
                "or scan over a statistics log must put its axes first (out_axes=0)"
            )

        def leaf(buffer: Any, start: int, stop: int, shape: tuple[int, ...]) -> Any:
            if isinstance(buffer, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct((*lead, *shape), buffer.dtype)
            return buffer[..., 0, start:stop].reshape((*lead, *shape))

        leaves = [leaf(buffers[b], start, stop, shape) for b, start, stop, shape in self.spans[index]]
        return jtu.tree_unflatten(self.treedefs[index], leaves)

    def own_shapes(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        return tuple(tuple(shape for *_, shape in spans) for spans in self.spans)


def num_leading_axes(buffers: tuple[Any, ...]) -> int:
    """The axes added to packed buffers since they were packed."""
    return np.ndim(buffers[0]) - 2 if buffers else 0


class PackedLog(eqx.Module, Mapping):
    """What a `px.ForwardHook` returns as the log of `px.StatsLog` (`px.activation_stats`)
    or of one statistic: `{key: statistics}` as a mapping, read as
    `log["layers.0"]["mean"]`, whose arrays are packed in one buffer per dtype (two
    outputs of the compiled step, whatever the number of layers).

    Entries are unpacked (sliced out) when read, inside jit as on the host (after
    `jax.device_get`, as numpy arrays). `px.pool_stats` and `px.Recorder` take it as
    they take a dict; `dict(log)` is the plain dictionary.
    """

    # A compiled step's output, flattened at every call: see `AbstractConverted`'s
    # `__getattribute__`.
    __getattribute__ = object.__getattribute__

    buffers: tuple[Array, ...]
    keys_: tuple[str, ...] = eqx.field(static=True)
    packing: Packing = eqx.field(static=True)

    def __init__(self, log: Mapping[str, Any], *, _own_shapes=None):
        """**Arguments:**

        - `log`: `{key: value}`, values pytrees of arrays.
        """
        self.keys_ = tuple(log)
        self.packing, self.buffers = Packing.pack(tuple(log.values()), _own_shapes)

    def with_keys(self, keys: tuple[str, ...]) -> "PackedLog":
        """The same entries under new keys (in order), around the same buffers."""
        if len(keys) != len(self.keys_):
            raise ValueError(f"expected {len(self.keys_)} keys, got {len(keys)}")
        # Built as unflattening builds a module: `__init__` would pack again.
        renamed = object.__new__(PackedLog)
        for name, value in (("buffers", self.buffers), ("keys_", keys), ("packing", self.packing)):
            object.__setattr__(renamed, name, value)
        return renamed

    def __getitem__(self, key: str) -> Any:
        try:
            index = self.keys_.index(key)
        except ValueError:
            raise KeyError(key) from None
        return self.packing.unpack(self.buffers, index)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_)

    def __len__(self) -> int:
        return len(self.keys_)

    def __contains__(self, key: object) -> bool:
        return key in self.keys_
