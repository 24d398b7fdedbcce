"""Path patching: the clean value of a sender patched in along one path only, into a
receiver, every other frozen site seeing the corrupted run (`px.path_patch`), and its
sweep over every pair of sender and receiver cells in one compiled call
(`px.path_patch_sweep`).

Two passes on the corrupted input. Pass 1 patches the sender's cell from the clean
cache, freezes every `freeze` site at its corrupted value and records the receivers'
values; pass 2 patches only the receiver's cell with its recorded value. Each pass
nests hook wrappers, in the order the engine applies them (an inner wrapper's hooks and
logs see the call's output first, an outer wrapper's pre-hooks its inputs first): the
receivers are recorded before anything freezes them, the sender's cell is patched after
the freeze of its site. In a sweep, pass 1 depends on the sender only and runs once per
sender cell; pass 2 runs per receiver cell on it, the run up to the receiver shared by
all of them (`_sweep.py` says why).
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from .._engine import CallSite, Where
from .._errors import HookError
from .._hooks import ForwardHook, IdentityLog
from ._cache import cache
from ._component import Component, Entry, entries, patch_cell, patched
from ._sweep import Metric, entry_patch, map_cells, same_counts, table_of

# What `freeze=` takes: a component, several, or a `where=` of outputs.
Freeze = Component | Sequence[Component] | Where


def _freezes(freeze: Freeze) -> tuple[Component, ...]:
    if isinstance(freeze, Component):
        return (freeze,)
    if isinstance(freeze, (list, tuple)) and freeze and all(isinstance(f, Component) for f in freeze):
        return tuple(f for f in freeze if isinstance(f, Component))
    return (Component(cast(Where, freeze)),)


def _recorder(model: PyTree, receiver: Component) -> ForwardHook:
    """`model` logging the receiver's values (its inputs as `"path:in"`)."""
    if receiver.inputs:
        return ForwardHook(model, pre_log_fn=IdentityLog(), where=receiver.where)
    return ForwardHook(model, log_fn=IdentityLog(), where=receiver.where)


def _frozen_values(model: PyTree, args: tuple, kwargs: dict, freezes: tuple[Component, ...]) -> dict[str, Any]:
    """The freeze sites' values in the corrupted run."""
    values: dict[str, Any] = {}
    for component in freezes:
        values.update(cache(model, *args, where=component.where, inputs=component.inputs, **kwargs)[1])
    return values


def _recorded(
    model: PyTree,
    clean_cache: Mapping[str, Any],
    frozen: Mapping[str, Any],
    args: tuple,
    kwargs: dict,
    paths: tuple[Component, Component, tuple[Component, ...]],
    sender_fn: Callable,
) -> dict[str, Any]:
    """Pass 1: the receivers' values, the sender patched by `sender_fn` from the clean
    cache and the freeze sites at their corrupted values."""
    sender, receiver, freezes = paths
    # Wrappers from the innermost out: receivers' outputs recorded, outputs frozen, the
    # sender, inputs frozen, receivers' inputs recorded.
    run: Any = model if receiver.inputs else _recorder(model, receiver)
    for component in (f for f in freezes if not f.inputs):
        run = patched(run, frozen, component, None)
    run = patched(run, clean_cache, sender, sender_fn)
    for component in (f for f in freezes if f.inputs):
        run = patched(run, frozen, component, None)
    if receiver.inputs:
        run = _recorder(run, receiver)
    _, log = run(*args, **kwargs)
    return dict(log)


def _every_entry(found: list[Entry], component: Component, cell: tuple[int, ...]) -> Callable:
    """A patch of cell `cell` of every call of `found`, at every step."""
    by_key = {entry.key: entry for entry in found}

    def fn(current: Any, replacement: Any, site: CallSite) -> Any:
        entry = by_key.get(site.key)
        return current if entry is None else patch_cell(entry, component, current, replacement, site, None, cell)

    return fn


def _checked_cell(found: list[Entry], cell: int | Sequence[int], what: str) -> tuple[int, ...]:
    index = (cell,) if isinstance(cell, int) else tuple(cell)
    for entry in found:
        if len(index) != len(entry.counts) or not all(0 <= i < n for i, n in zip(index, entry.counts)):
            raise HookError(
                f"{what}={index}: layer {entry.key!r} (value {entry.row_shape}) splits into {entry.counts} cells"
            )
    return index


def path_patch(
    model: PyTree,
    clean_cache: Mapping[str, Any],
    *args: Any,
    sender: Component,
    receiver: Component,
    freeze: Freeze,
    sender_cell: int | Sequence[int] = (),
    receiver_cell: int | Sequence[int] = (),
    **kwargs: Any,
) -> Any:
    """Path patching (TransformerLens issue 111): the clean value of the sender reaches
    the receiver, and nothing else changes.

    !!! Example

        ```python
        heads = px.Component("h.*.attn.c_proj", px.Groups(-1, 4), inputs=True)
        out = px.path_patch(
            model, clean_cache, corrupted,
            sender=px.Component("h.0.attn.c_proj", px.Groups(-1, 4), inputs=True), sender_cell=1,
            receiver=px.Component("h.1.attn.c_attn", px.Groups(-1, 12)), receiver_cell=0,
            freeze=[heads, px.Component("h.*.mlp")],
        )
        ```

    **Arguments:**

    - `model`: the model (not modified).
    - `clean_cache`: a cache of the clean run holding the sender's values.
    - `*args`, `**kwargs`: the model's arguments: the corrupted input.
    - `sender`: the component whose clean value is sent (every call it selects, at
        `sender_cell`).
    - `receiver`: the component that receives it (every call it selects, at
        `receiver_cell`).
    - `freeze`: the sites held at their corrupted values in pass 1, so that the
        sender's value reaches the receiver along no other path: a `px.Component`, a
        list of them, or a `where=` of outputs (typically every attention head and every
        MLP). The sender's own cell is patched in over its freeze; the receivers are
        recorded before theirs.
    - `sender_cell`, `receiver_cell`: the cell of each, one index per count of its
        cells (an int for one split; `()` for `px.Whole()`).

    **Returns:**

    The model's output in pass 2: the corrupted input with only the receiver's cell
    replaced by its value in pass 1 (the corrupted input, the sender's cell clean, the
    freeze sites corrupted).
    """
    cells = (sender_cell if isinstance(sender_cell, int) else tuple(sender_cell),
             receiver_cell if isinstance(receiver_cell, int) else tuple(receiver_cell))
    return _path_patch(model, dict(clean_cache), args, kwargs, (sender, receiver, _freezes(freeze)), cells)


# Compiled as one program: both passes and the corrupted run that freezes take their
# values from (eagerly, each of their operations would be dispatched, and compiled, alone).
@eqx.filter_jit
def _path_patch(
    model: PyTree,
    clean_cache: dict,
    args: tuple,
    kwargs: dict,
    paths: tuple[Component, Component, tuple[Component, ...]],
    cells: tuple[int | tuple[int, ...], int | tuple[int, ...]],
) -> Any:
    sender, receiver, freezes = paths
    senders = entries(model, args, kwargs, sender, clean_cache)
    receivers = entries(model, args, kwargs, receiver, None)
    sent = _every_entry(senders, sender, _checked_cell(senders, cells[0], "sender_cell"))
    received = _every_entry(receivers, receiver, _checked_cell(receivers, cells[1], "receiver_cell"))
    frozen = _frozen_values(model, args, kwargs, freezes)
    recorded = _recorded(model, clean_cache, frozen, args, kwargs, paths, sent)
    return patched(model, recorded, receiver, received)(*args, **kwargs)


@eqx.filter_jit
def _path_sweep(
    model: PyTree,
    clean_cache: dict,
    args: tuple,
    kwargs: dict,
    paths: tuple[Component, Component, tuple[Component, ...]],
    metric: Metric,
    metric_site: str | None,
    batch_size: int | None,
) -> Array:
    sender, receiver, freezes = paths
    senders = entries(model, args, kwargs, sender, clean_cache)
    receivers = entries(model, args, kwargs, receiver, None)
    sender_counts = same_counts(senders)
    frozen = _frozen_values(model, args, kwargs, freezes)
    rows = []
    for sent in senders:

        def per_sender(flat: Any, sent: Entry = sent) -> Array:
            fn = entry_patch(sent, sender, *sent.unravel(flat))
            recorded = _recorded(model, clean_cache, frozen, args, kwargs, paths, fn)
            # Pass 2: a sweep of the receivers, their values taken from pass 1.
            return table_of(model, recorded, receivers, receiver, metric, metric_site, args, kwargs, batch_size)

        table = map_cells(per_sender, sent.size, batch_size)
        rows.append(table.reshape(-1, *sender_counts, *table.shape[1:]))
    return jnp.concatenate(rows)


def path_patch_sweep(
    model: PyTree,
    clean_cache: Mapping[str, Any],
    *args: Any,
    sender: Component,
    receiver: Component,
    freeze: Freeze,
    metric: Metric,
    metric_site: str | None = None,
    batch_size: int | None = None,
    **kwargs: Any,
) -> Float[Array, "..."]:
    """Path patching from every sender cell to every receiver cell, in one compiled call
    (each entry as `px.path_patch` computes it; pass 1 runs once per sender cell).

    **Arguments:**

    - `model`, `clean_cache`, `*args`, `**kwargs`, `freeze`: as in `px.path_patch`.
    - `sender`, `receiver`: components; each row of theirs (`px.sweep_rows`) and each
        cell of a row is one sender (receiver).
    - `metric`: `metric(output) -> scalar` of pass 2's output.
    - `metric_site`: as in `px.patch_sweep`: the metric takes that call's value.
    - `batch_size`: at most this many sender cells at once, and receiver cells per
        sender cell (`jax.lax.map`); `None`: all in one `vmap`.

    **Returns:**

    An array `(sender rows, *sender cell counts, receiver rows, *receiver cell counts)`.
    A receiver that runs before its sender gets the corrupted run's value in pass 1:
    its entries are `metric` of the corrupted output (computed anyway).
    """
    paths = (sender, receiver, _freezes(freeze))
    return _path_sweep(model, dict(clean_cache), args, kwargs, paths, metric, metric_site, batch_size)
