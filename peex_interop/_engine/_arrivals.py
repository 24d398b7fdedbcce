"""Where a value carried through a traced program (`_harvest.py`) arrives.

A sown log or a planted slot is bound again at each trace it comes out to, until the
trace is that of the innermost scope of the context its tag names: there the log is
recorded (`HookContext.arrive`), the slot taken from the scope's probes
(`HookContext.arrive_slot`). At any other trace it passes on, as JAX binds it.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.tree_util as jtu

from . import _harvest, _jax
from ._context import active
from ._hook_context import HookContext
from ._scopes import Scope


def _arrival(trace: Any, tag: _harvest.Tag) -> tuple[HookContext, Scope] | None:
    """Where a sown or planted value bound at `trace` is taken: the innermost scope of
    the context the tag names, when `trace` is that scope's trace."""
    contexts = active()
    if tag.context >= len(contexts):
        return None
    context = contexts[tag.context]
    scope = context.scopes[-1]
    if not _jax.is_trace_at(trace, scope.trace_state):
        return None
    return context, scope


def _sow_bind(original: Callable) -> Callable:
    def bind_with_trace(trace, args, avals, params, /):
        tag = params["tag"]
        found = _arrival(trace, tag)
        if found is None:
            return original(trace, args, avals, params)
        found[0].arrive(tag, _harvest.unflatten(tag, list(args)))
        return []

    return bind_with_trace


def _plant_bind(original: Callable) -> Callable:
    def bind_with_trace(trace, args, avals, params, /):
        tag = params["tag"]
        found = _arrival(trace, tag)
        if found is None:
            return original(trace, args, avals, params)
        context, scope = found
        if scope.deferred or scope.plants:
            # Slots are not this scope's: the plant passes through (numbered among the
            # deferred scope's calls when it comes out of a jit inside it).
            if tag.batch is not None:
                tag = context.renumber_passing(tag)
            return original(trace, args, avals, {**params, "tag": tag})
        template = jtu.tree_unflatten(tag.treedef, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in params["avals"]])
        return jtu.tree_leaves(context.arrive_slot(tag, template))

    return bind_with_trace


def arrival_patches() -> list[tuple[Any, str, Callable[[Any], Any]]]:
    """Patch targets for `_patching.patched`: instance-level `bind_with_trace` of the
    carrying primitives."""
    return [(_harvest.sow_p, _jax.BIND, _sow_bind), (_harvest.plant_p, _jax.BIND, _plant_bind)]
