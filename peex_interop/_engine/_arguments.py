"""A layer call's inputs, as a peex-style pre-hook (`pre_hook=True`) takes them.

Such a hook receives the call's positional arguments, a tuple. `lin(x=x)` passes its
input by keyword: a pre-hook that saw `()` would log nothing and edit nothing, silently.
So floating-point arrays passed by keyword to positional parameters join the positional
arguments (a call of the same meaning), and one passed to a keyword-only parameter makes
the pre-hook raise. `pre_hook_fn` and `pre_log_fn` take `(args, kwargs)` as called.
"""

import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from .._errors import HookError

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _holds_floats(value: Any) -> bool:
    return any(eqx.is_inexact_array(leaf) for leaf in jtu.tree_leaves(value))


def pre_hook_inputs(
    path: str, hook: str, function: Callable[..., Any], args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """`(args, kwargs)` of a call of `function` (at layer `path`), the keyword arguments
    holding floating-point arrays that fill its next positional parameters moved to the
    end of `args`, with those before them (in order; up to the last such array, stopping
    at a parameter not given, whose default would have to be passed). Raises naming
    `hook` if floating-point arrays remain in `kwargs`."""
    try:
        parameters = inspect.signature(function).parameters.values() if kwargs else ()
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        parameters = ()
    following = [p.name for p in parameters if p.kind in _POSITIONAL][len(args):]
    given = []
    for name in following:
        if name not in kwargs:
            break
        given.append(name)
    # Up to the last one holding an input; later keyword arguments stay as they are.
    moved = max((i + 1 for i, name in enumerate(given) if _holds_floats(kwargs[name])), default=0)
    args = (*args, *(kwargs[name] for name in given[:moved]))
    kwargs = {name: value for name, value in kwargs.items() if name not in given[:moved]}
    unseen = sorted(name for name, value in kwargs.items() if _holds_floats(value))
    if unseen:
        raise HookError(
            f"layer {path!r}: {hook} with pre_hook=True takes the call's positional inputs, and this call passes "
            f"floating-point arrays by keyword ({', '.join(unseen)}), which it would not see; pass them "
            "positionally, or hook them with pre_hook_fn/pre_log_fn of px.ForwardHook, which take (args, kwargs)"
        )
    return args, kwargs
