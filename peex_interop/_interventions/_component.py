"""What a patching sweep or a path patch acts on: `px.Component` (the calls a `where=`
selects, their outputs or inputs, and how their values split into cells), and its plan:
one `Entry` per selected call, found by one shape pass of the model (`entries`).

An entry's rows are the steps of the stacks it runs in (a scanned stack of layers is one
call per step, one log key for all: its steps are separate rows); its cells are the
split of one row's value. Inside a hook, `patch_cell` puts one row's cell of another
value in place, selecting the step and slicing the cell's mask to the call by the
call's traced indices (`px.CallSite.log_index`), so one compiled forward pass serves
every row and cell.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Bool, PyTree

from .._engine import CallSite, Where, step_path
from .._errors import HookError
from .._hooks import ForwardHook, IdentityLog
from ._cells import WHOLE, Cells, cell_counts, cell_mask
from ._patch import Patched, cached_at, patched_at


def _static(where: Where) -> Where:
    # A component is a static argument of the compiled sweeps: its selection hashable.
    return tuple(where) if isinstance(where, list) else where


class Component(eqx.Module):
    """The calls a sweep or a path patch acts on: those `where` selects, their outputs
    (or first positional inputs), split into cells."""

    where: Where = eqx.field(static=True)
    cells: Cells
    inputs: bool = eqx.field(static=True)

    def __init__(self, where: Where, cells: Cells = WHOLE, *, inputs: bool = False):
        """**Arguments:**

        - `where`: which calls, as in `px.ForwardHook` (a scanned stack's steps are rows
            of their own; `"blocks.1.attn"` selects one step).
        - `cells`: how each call's value splits into cells: `px.Whole()`,
            `px.Along(axis)`, `px.Groups(axis, count)`, or a tuple of them (their
            product). Axes count on the value of one row: the cached value, a stack's
            steps taken off.
        - `inputs`: act on each call's first positional argument (its input: the
            residual stream entering a block, the heads entering an output projection)
            instead of its output.
        """
        self.where = _static(where)
        self.cells = cells
        self.inputs = inputs


class Entry(NamedTuple):
    """One selected call of a component: its log `key`, its rows' `names` (one per step
    of its stacks), which axes of its cached value are `stack_axes`, the value's whole
    `shape` (stack axes included) and its cells' `counts`."""

    key: str
    names: tuple[str, ...]
    stack_axes: tuple[int, ...]
    shape: tuple[int, ...]
    counts: tuple[int, ...]

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(self.shape[axis] for axis in self.stack_axes)

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(n for axis, n in enumerate(self.shape) if axis not in self.stack_axes)

    @property
    def size(self) -> int:
        """Rows times cells: the forward passes a sweep of this entry runs."""
        return math.prod(self.steps) * math.prod(self.counts)

    def unravel(self, flat: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The (steps, cell) of a flat index in `range(self.size)`, row-major."""
        index: list[Any] = []
        for count in reversed(self.steps + self.counts):
            flat, rest = jnp.divmod(flat, count)
            index.insert(0, rest)
        return tuple(index[: len(self.steps)]), tuple(index[len(self.steps) :])


def split_leaf(value: PyTree, inputs: bool, path: str) -> tuple[Any, Callable[[Any], PyTree]]:
    """The one array of a call's value that cells split (for `inputs`, of the value's
    first positional argument), and a function that puts another in its place."""
    if inputs:
        args = value[0]
        if not args:
            raise HookError(f"layer {path!r} was called with no positional argument: inputs=True splits the first")
        target = args[0]
    else:
        target = value
    leaves, treedef = jtu.tree_flatten(target)
    arrays = [i for i, leaf in enumerate(leaves) if hasattr(leaf, "shape") and hasattr(leaf, "dtype")]
    if len(arrays) != 1:
        shapes = [tuple(leaves[i].shape) for i in arrays]
        raise HookError(
            f"layer {path!r}: its {'first input' if inputs else 'output'} has {len(arrays)} arrays "
            f"(shapes {shapes}); cells split a value with one array"
        )

    def put(leaf: Any) -> PyTree:
        new = jtu.tree_unflatten(treedef, [leaf if i == arrays[0] else x for i, x in enumerate(leaves)])
        return ((new, *value[0][1:]), value[1]) if inputs else new

    return leaves[arrays[0]], put


def entries(
    model: PyTree, args: tuple, kwargs: dict, component: Component, cache: Mapping[str, Any] | None
) -> list[Entry]:
    """The component's selected calls, in the order the model makes them, by one shape pass
    of `model(*args, **kwargs)`. Each must fit its cells and have a value of its shape
    in `cache` (where a sweep takes the values it patches in; `None`: not checked);
    else `px.HookError`."""
    suffix = ":in" if component.inputs else ""
    facts: dict[str, tuple] = {}

    def record(value: Any, site: CallSite) -> Any:
        # A one-step key's log entry has its stacks' axes sliced off: one row.
        whole = len(site.log_index) == len(site.indices)
        stacks = (site.stack_roots, site.stack_levels) if whole else ((), ())
        facts[site.key] = (site.path, site.call_index, *stacks)
        current = split_leaf(value, component.inputs, site.path)[0]
        if cache is not None:
            cached = split_leaf(cached_at(cache, site, suffix), component.inputs, site.path)[0]
            if tuple(cached.shape) != tuple(current.shape):
                raise HookError(
                    f"layer {site.path!r}: the cache holds a value of shape {tuple(cached.shape)} for this call, "
                    f"which has shape {tuple(current.shape)} on these arguments"
                )
        return value

    if component.inputs:
        hooked = ForwardHook(model, pre_hook_fn=record, pre_log_fn=IdentityLog(), where=component.where)
    else:
        hooked = ForwardHook(model, hook_fn=record, log_fn=IdentityLog(), where=component.where)
    _, log = jax.eval_shape(lambda: hooked(*args, **kwargs))
    if not facts:
        raise HookError(f"where={component.where!r} selects no call of the model on these arguments")
    found = []
    # The order of the calls (`facts` is filled as the model runs), not the log's: a log
    # returned through a transform is a pytree dict, its keys sorted as strings
    # (`h.0`, `h.1`, `h.10`, `h.11`, `h.2`, ...), which would permute a sweep's rows.
    for key, (path, call_index, roots, stack_axes) in facts.items():
        shape = tuple(split_leaf(log[key + suffix], component.inputs, path)[0].shape)
        steps = [shape[axis] for axis in stack_axes]
        row_shape = tuple(n for axis, n in enumerate(shape) if axis not in stack_axes)
        names = tuple(
            step_path(path, roots, labels) + (f"@{call_index}" if call_index else "") if roots else key
            for labels in _product(steps)
        )
        found.append(Entry(key, names, stack_axes, shape, cell_counts(component.cells, row_shape, key)))
    return found


def _product(steps: Sequence[int]) -> list[tuple[str, ...]]:
    """The labels of every combination of steps, row-major."""
    combos: list[tuple[str, ...]] = [()]
    for count in steps:
        combos = [(*combo, str(step)) for combo in combos for step in range(count)]
    return combos


def selected(
    entry: Entry, cells: Cells, site: CallSite, steps: Sequence[Any] | None, cell: Sequence[Any] | None
) -> Bool[Array, "..."]:
    """Where the call at `site` holds the rows at `steps` (`None`: every step) and cell
    `cell` (`None`: the whole value) of `entry`: a mask of the call's own shape."""
    index = site.log_index
    inner = tuple(i for axis, i in enumerate(index) if axis not in entry.stack_axes)
    shape = entry.row_shape
    mask = jnp.ones(shape[len(inner) :], bool) if cell is None else cell_mask(cells, shape, cell)[inner]
    for axis, step in zip(entry.stack_axes, steps if steps is not None else ()):
        mask = mask & (index[axis] == step)
    return mask


def patch_cell(
    entry: Entry,
    component: Component,
    current: PyTree,
    replacement: PyTree,
    site: CallSite,
    steps: Sequence[Any] | None,
    cell: Sequence[Any] | None,
) -> PyTree:
    """`current` with `replacement`'s values where `selected` is true."""
    leaf, put = split_leaf(current, component.inputs, site.path)
    new = split_leaf(replacement, component.inputs, site.path)[0]
    return put(jnp.where(selected(entry, component.cells, site, steps, cell), new, leaf))


def patched(model: PyTree, cache: Mapping[str, Any], component: Component, fn: Callable | None) -> Patched:
    """`model` with `fn(current, cached, site)` applied to the component's calls, `cached`
    taken from `cache` (`None`: the cached value in place), as `px.patch` does, with the
    component's own selection (`where=None` selects every layer here)."""
    return patched_at(model, cache, component.where, fn, component.inputs)


def sweep_rows(model: PyTree, *args: Any, where: Where, inputs: bool = False, **kwargs: Any) -> list[str]:
    """The names of the rows of a sweep over the calls `where` selects: one per selected
    call, a scanned stack's steps apart (`"blocks.0.attn"`, `"blocks.1.attn"`, ...),
    in the order of `px.patch_sweep`'s rows.

    **Arguments:**

    - `model`, `*args`, `**kwargs`: the model and its arguments, as given to the sweep.
    - `where`, `inputs`: as given to the sweep.

    **Returns:**

    A list of names, one per row.
    """
    found = entries(model, args, kwargs, Component(where, inputs=inputs), None)
    return [name for entry in found for name in entry.names]
