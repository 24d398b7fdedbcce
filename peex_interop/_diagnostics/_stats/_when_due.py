"""How a statistic is computed: as one compiled program (`_compiled`), and only on the
steps that are recorded (`computed_when`): on the others its log is zeros of the same
structure, under `jax.lax.cond` inside a compiled step."""

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax import lax
from jaxtyping import ArrayLike, Bool

from ..._engine import ThreadStack, entry_point, zeros_like

# Bound before hooking patches `jax.lax.cond`, `jax.eval_shape` and `jax.jit`: skipping
# or compiling a statistic (or choosing how a histogram bins its values) is no model
# transform, with no layer inside to thread logs out of.
_real_cond = entry_point(lax.cond)
_real_eval_shape = entry_point(jax.eval_shape)
_real_jit = entry_point(jax.jit)

# The `due` of each enclosing `computed_when` block, innermost last.
_due = ThreadStack()


@contextlib.contextmanager
def computed_when(due: bool | Bool[ArrayLike, ""]) -> Iterator[None]:
    """Statistics logs called inside the block compute only when `due` (a traced
    boolean inside a compiled step: under `jax.lax.cond`); otherwise they log zeros of
    the same structure. What `px.Recorder.when_due` uses."""
    _due.items.append(due)
    try:
        yield
    finally:
        _due.items.pop()


@functools.partial(_real_jit, static_argnums=(1, 2, 3))
def _program(arrays: list, compute: Callable, treedef: Any, others: tuple) -> Any:
    leaves = [other if array is None else array for array, other in zip(arrays, others)]
    return compute(*jtu.tree_unflatten(treedef, leaves))


def _compiled(compute: Callable[..., Any], *inputs: Any) -> Any:
    """`compute(*inputs)` as one XLA program, compiled once per log, shapes and
    enclosing vmaps. Called eagerly, a histogram is otherwise ~30 operations each
    dispatched (and compiled on first use) alone: `activation_stats` on a 3-layer MLP
    took 3.0 s on its first eager call and 0.5 s on each next one; 1.2 s and 4 ms so.
    Inside a compiled step the program is inlined (the step's optimised HLO has the
    same instructions). `compute`: a module-level function (hashed by identity); the
    arrays of `inputs` are traced, their other leaves (a threshold, a number of axes)
    are part of the key, or, where one cannot be hashed, computed as they are."""
    leaves, treedef = jtu.tree_flatten(inputs)
    arrays = [leaf if eqx.is_array(leaf) else None for leaf in leaves]
    others = tuple(None if eqx.is_array(leaf) else leaf for leaf in leaves)
    try:
        hash(others)
    except TypeError:
        return compute(*inputs)
    return _program(arrays, compute, treedef, others)


def _when_due(compute: Callable[[Any, Any], Any], config: Any, args: Any) -> Any:
    """`compute(config, args)` as one program (`_compiled`), or zeros of its structure
    on steps that are not due (`computed_when`)."""

    def computed(args):
        return _compiled(compute, config, args)

    if not _due.items:
        return computed(args)
    due = _due.items[-1]

    def skip(args):
        return zeros_like(_real_eval_shape(computed, args))

    if isinstance(due, bool):
        return computed(args) if due else skip(args)
    return _real_cond(due, computed, skip, args)

