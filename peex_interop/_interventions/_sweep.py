"""`px.patch_sweep`: activation patching at every cell of every selected call (every
layer x position, layer x head, ...), as one compiled call: TransformerLens's
`patching.get_act_patch_*` functions, for any model and any site.

Why the selected calls are a Python loop and the cells a `vmap`: each call's forward
passes are traced with that call's number fixed, so everything the model computes
before that call does not depend on the vmapped cell, `vmap` leaves it unbatched, and
XLA computes it once for all the call's cells (a layer sweep's passes share their
prefix: about half the work of a sweep over every layer, and less the later the
layer). A scanned stack's steps are one call, selected by the traced step inside the
scan: their passes share no prefix.
"""

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PyTree, Scalar

from .._engine import CallSite, Where
from .._errors import HookError
from .._hooks import ForwardHook, IdentityLog
from ._cells import WHOLE, Cells
from ._component import Component, Entry, entries, patch_cell, patched

# `metric(output) -> scalar`: what a sweep keeps of each patched forward pass.
Metric = Callable[[Any], Scalar]


def map_cells(fn: Callable[[Int[Array, ""]], Any], size: int, batch_size: int | None) -> Any:
    """`fn` over `range(size)`: one `vmap` of them all, or `batch_size` at a time."""
    flat = jnp.arange(size)
    return jax.vmap(fn)(flat) if batch_size is None else jax.lax.map(fn, flat, batch_size=batch_size)


def measured(patched_model: Any, metric: Metric, metric_site: str | None, args: tuple, kwargs: dict) -> Scalar:
    """`metric` of one patched run: of its output, or of the value of the call
    `metric_site` selects (then what the model computes after that call, such as an
    unembedding over every position, is not computed at all: XLA drops what no output
    reads)."""
    if metric_site is None:
        value = metric(patched_model(*args, **kwargs))
    else:
        _, log = ForwardHook(patched_model, log_fn=IdentityLog(), where=metric_site)(*args, **kwargs)
        if len(log) != 1:
            raise HookError(
                f"metric_site={metric_site!r} selects {len(log)} calls ({', '.join(log) or 'none'}); "
                "the metric reads the value of one call"
            )
        value = metric(*log.values())
    if jnp.shape(value) != ():
        raise HookError(f"the metric returned a value of shape {jnp.shape(value)}; a sweep's metric returns a scalar")
    return value


def same_counts(found: list[Entry]) -> tuple[int, ...]:
    """The cell counts every entry shares (the axes of a sweep's result)."""
    for entry in found[1:]:
        if entry.counts != found[0].counts:
            raise HookError(
                f"layers {found[0].key!r} (value {found[0].row_shape}) and {entry.key!r} (value {entry.row_shape}) "
                f"split into {found[0].counts} and {entry.counts} cells: a sweep's rows need the same counts"
            )
    return found[0].counts


def entry_patch(entry: Entry, component: Component, steps: Any, cell: Any) -> Callable:
    """A patch `fn(current, replacement, site)` that changes the given cell of one entry
    only (the call chosen by its static key) and leaves the component's other calls."""

    def fn(current: Any, replacement: Any, site: CallSite) -> Any:
        if site.key != entry.key:
            return current
        return patch_cell(entry, component, current, replacement, site, steps, cell)

    return fn


@eqx.filter_jit
def _sweep(
    model: PyTree,
    cache: dict,
    args: tuple,
    kwargs: dict,
    component: Component,
    metric: Metric,
    metric_site: str | None,
    batch_size: int | None,
) -> Array:
    found = entries(model, args, kwargs, component, cache)
    return table_of(model, cache, found, component, metric, metric_site, args, kwargs, batch_size)


def table_of(
    model: PyTree,
    cache: Mapping[str, Any],
    found: list[Entry],
    component: Component,
    metric: Metric,
    metric_site: str | None,
    args: tuple,
    kwargs: dict,
    batch_size: int | None,
) -> Array:
    """`metric` of a run with each cell of each row of `found` (the component's calls)
    patched from `cache` alone: `(rows, *cell counts)`. Path patching's pass 2 too."""
    counts = same_counts(found)
    rows = []
    for entry in found:

        def one(flat: Any, entry: Entry = entry) -> Scalar:
            fn = entry_patch(entry, component, *entry.unravel(flat))
            return measured(patched(model, cache, component, fn), metric, metric_site, args, kwargs)

        rows.append(map_cells(one, entry.size, batch_size).reshape(-1, *counts))
    return jnp.concatenate(rows)


def patch_sweep(
    model: PyTree,
    clean_cache: Mapping[str, Any],
    *args: Any,
    where: Where,
    metric: Metric,
    cells: Cells = WHOLE,
    inputs: bool = False,
    metric_site: str | None = None,
    batch_size: int | None = None,
    **kwargs: Any,
) -> Float[Array, "..."]:
    """Activation patching at every cell of every selected call, in one compiled call:
    for each call and cell, `metric` of a forward pass on `args` (the corrupted input)
    with that cell of that call's value (and nothing else) replaced by its value in
    `clean_cache`.

    !!! Example

        ```python
        _, clean_cache = px.cache(model, clean, where="blocks", inputs=True)
        # TransformerLens's get_act_patch_resid_pre: every block's input, per position.
        table = px.patch_sweep(model, clean_cache, corrupted, where="blocks", inputs=True,
                               cells=px.Along(0), metric=logit_difference)
        ```

    **Arguments:**

    - `model`: the `eqx.Module` to patch (converted Haiku/NNX/linen models included; not
        modified).
    - `clean_cache`: the values patched in: a cache from `px.cache` on the clean input,
        taken with a `where=` that covers this one (and `inputs=True` for `inputs`).
    - `*args`, `**kwargs`: the model's arguments for the patched runs (the corrupted
        input).
    - `where`: the calls to sweep, as in `px.ForwardHook`.
    - `metric`: `metric(output) -> scalar`, of each patched run's output. Pass the same
        function again to reuse the compiled sweep.
    - `cells`: how each call's value splits: `px.Whole()` (the default: one cell),
        `px.Along(axis)` (positions, neurons), `px.Groups(axis, count)` (heads of a
        concatenated head axis), or a tuple of them for their product. Axes count on a
        row's value: the cached value of the call, a stack's steps taken off (the axes
        of `vmap`s inside the stack kept).
    - `inputs`: patch each call's first positional argument instead of its output
        (a block's input is TransformerLens's `resid_pre`).
    - `metric_site`: a site whose value `metric` takes instead of the output (one
        call: `"transformer.ln_f"`, the final residual stream); the runs then stop
        there, which spares a sweep the unembedding of every position when the metric
        reads one (a logit difference is the final residual dotted with the difference
        of two unembedding columns).
    - `batch_size`: at most this many forward passes at once (`jax.lax.map`), to bound
        memory; `None`: all of a call's cells in one `vmap`.

    **Returns:**

    An array `(rows, *cell counts)`: row `i` is the `i`-th selected call in the order
    the model makes them (`px.sweep_rows` names them: `h.2` before `h.10`), each step of a scanned stack a row
    of its own. Every call must split into the same counts. A `where` that selects
    nothing, a cache without a selected call's value (or with one of another shape), a
    cell axis out of range or not divisible raise `px.HookError` naming the layer.
    """
    return _sweep(
        model, dict(clean_cache), args, kwargs, Component(where, cells, inputs=inputs), metric, metric_site, batch_size
    )
