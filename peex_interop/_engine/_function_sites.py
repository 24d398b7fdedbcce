"""`px.function_sites`: the calls of named functions made by a model's layers, as sites.

The engine must know which function objects to intercept before the model runs, and
a hook wrapper's selection is only glob patterns and kinds: so the functions are named
by a transparent wrapper of the model (like the hook wrappers, it adds no path
segment), which, while a hooking context is active in the calling thread, replaces
every binding of each function (`_bindings.py`: `jax.nn.gelu` is reached through the
`jax.nn` module, `from jax.nn import gelu` through the importing module's globals,
`nnx.gelu`/`nn.gelu` through Flax's) by one that makes each call made inside a layer
the site `<layer path>.<function name>` (`_inner_sites.py`). Being a static field,
the list of functions is part of the model's structure: a jitted function retraces
when it changes.

References the bindings do not reach are found where they can be: a field of an
Equinox module holding the function (`eqx.nn.MLP(activation=jax.nn.gelu)`) is
replaced, in a copy, by a callable that makes its calls sites too; a default argument
or closure cell of a layer's `__call__`, a static field, or a `functools.partial` of
the function held by a field, is refused.
"""

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.tree_util as jtu
from jaxtyping import PyTree

from . import _patching
from ._bindings import bindings
from ._context import active
from ._errors import HookError
from ._inner_sites import inner_site, routing
from ._paths import AbstractTransparent, join, module_paths, walk


class FunctionSites(AbstractTransparent):
    """A model whose layers' calls of some functions are call sites
    `<layer path>.<function name>` (kind `"function"`); build it with
    `px.function_sites`."""

    model: PyTree
    functions: tuple[tuple[str, Callable], ...] = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model, its calls of the functions routed to call sites while hooking.

        **Arguments:**

        - `*args`, `**kwargs`: the model's own arguments.

        **Returns:**

        What the model returns.
        """
        if not active():
            return self.model(*args, **kwargs)
        originals = [function for _, function in self.functions]
        names = {id(function): name for name, function in self.functions}
        targets = [
            (owner, attribute, routing(names[id(_patching.unwrap(getattr(owner, attribute)))], "function"))
            for owner, attribute in bindings(originals, *_code(self.model))
        ]
        with _patching.patched(targets):
            return self.model(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class _HeldFunction:
    """A function held by a field of a layer (`eqx.nn.MLP`'s `activation`): calling it
    is a site of the layer that calls it. Not a module (it would be a layer), but a
    hashable leaf, static under `eqx.filter_jit` as the function was."""

    name: str
    function: Callable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return inner_site(self.name, "function", self.function, args, kwargs)


def declared_sites(model: Any) -> tuple[str, ...]:
    """The names of the function sites that the `FunctionSites` in `model` add, for
    `where=` checks ahead of the call."""
    nodes = jtu.tree_leaves(model, is_leaf=lambda node: isinstance(node, FunctionSites))
    return tuple(name for node in nodes if isinstance(node, FunctionSites) for name, _ in node.functions)


def _code(model: Any) -> list[Callable]:
    """The functions whose globals may bind the wanted functions outside any loaded
    module (code run with `exec`): the layers' `__call__` and a function model's `fn`."""
    code = []
    for module in module_paths(model).values():
        cls = module if isinstance(module, type) else type(module)
        call = inspect.getattr_static(cls, "__call__", None) if module is not None else None
        if call is not None:
            code.append(call)
        function = getattr(module, "fn", None)
        if callable(function):
            code.append(function)
    return code


def _refuse_captured(model: Any, functions: dict[int, str]) -> None:
    """Refuse references that no binding and no field replacement reaches."""
    for path, node in walk(model):
        if not isinstance(node, eqx.Module):
            continue
        call = vars(type(node)).get("__call__")
        captured = [
            *(getattr(call, "__defaults__", None) or ()),
            *(getattr(call, "__kwdefaults__", None) or {}).values(),
            *(value for cell in getattr(call, "__closure__", None) or () for value in _contents(cell)),
        ]
        for field in dataclasses.fields(node):
            value = getattr(node, field.name, None)
            if isinstance(value, functools.partial):
                captured.append(value.func)
            elif field.metadata.get("static", False):
                captured.append(value)  # not a leaf: not replaced
        for value in captured:
            name = functions.get(id(_patching.unwrap(value)))
            if name is not None:
                raise HookError(
                    f"px.function_sites cannot intercept {name!r} in layer "
                    f"{join(*path)!r} ({type(node).__name__}): its code holds the function "
                    "itself (a default argument, a closure, a static field, or a "
                    "functools.partial in a field), which no binding reaches, so its calls "
                    "would not be sites. Call "
                    "it through a module (`jax.nn.gelu(x)`) or keep it in a field of its own."
                )


def _contents(cell: Any) -> list:
    try:
        return [cell.cell_contents]
    except ValueError:  # an empty cell
        return []


def function_sites(model: PyTree, *functions: Callable) -> FunctionSites:
    """Make each call of `functions` made by the model's layers a call site, named
    `<layer path>.<function name>` (`blocks.0.mlp.gelu`; `@1`, `@2`, ... for repeated
    calls in one layer), of kind `"function"`: select it with `where=` (a pattern
    naming it, e.g. `"**.gelu"`, or `px.kind("function")`) in `px.ForwardHook`,
    `px.BackwardHook`, `px.cache`, ... like any layer.

    !!! Example

        ```python
        model = px.function_sites(model, jax.nn.gelu)
        _, log = px.ForwardHook(model, log_fn=px.IdentityLog(), where="**.gelu")(x)
        ```

    **Arguments:**

    - `model`: an `eqx.Module` or a converted model (`px.from_haiku`, `px.from_nnx`,
        `px.from_linen`, `px.from_function`); not modified.
    - `*functions`: the functions, as the model's code reaches them (`jax.nn.gelu`,
        `jax.nn.softmax`, `jnp.einsum`, `nnx.gelu` is the same function).

    **Returns:**

    A `FunctionSites` wrapping (a copy of) `model`: fields of its Equinox layers that
    hold one of the functions call it as a site.

    Calls are reached through every module-global binding of the functions (attribute
    access `jax.nn.gelu`, `from jax.nn import gelu` in any loaded module and in the
    layers' own code) and fields of Equinox layers. A function captured before hooking
    in a default argument, a closure, a static field or a `functools.partial` is
    refused when found there; one held elsewhere is not reached, and a pattern
    selecting its site then raises after the call (it selected no call).
    """
    named: dict[str, Callable] = {}
    for function in functions:
        original = _patching.unwrap(function)
        name = getattr(original, "__name__", None)
        if not callable(original) or not isinstance(name, str):
            raise HookError(f"px.function_sites takes named functions, got {function!r}")
        if named.get(name, original) is not original:
            raise HookError(f"px.function_sites got two different functions named {name!r}: their sites would clash")
        named[name] = original
    by_id = {id(function): name for name, function in named.items()}
    _refuse_captured(model, by_id)
    model = jtu.tree_map(
        lambda leaf: _HeldFunction(by_id[id(leaf)], leaf) if id(leaf) in by_id else leaf, model,
    )
    return FunctionSites(model, tuple(sorted(named.items())))
