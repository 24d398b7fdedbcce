"""`px.function_sites`: the calls of named functions made by a model's layers, as sites.

The engine must know which functions to route before the model runs, and a hook
wrapper's selection is only glob patterns and kinds: so the functions are named by a
transparent wrapper of the model (like the hook wrappers, it adds no path segment).
While a hooking context is active in the calling thread, its call routes every call
of each function, through whatever reference reaches it (`_routes.py`: a module
attribute, an imported name, a partial in a table, a field, a default argument), and
each call made inside a layer is the site `<layer path>.<function name>`
(`_inner_sites.py`), unless it is the layer's attention weights where those are
selected (`<layer>.weights`: one call is one site). Being a static field, the list of functions is part of the
model's structure: a jitted function retraces when it changes.

A jitted function held by a field of an Equinox module (`eqx.nn.MLP(activation=
jax.nn.silu)`) is replaced, in a copy, by a callable that routes its calls outside the
jit, as its module-global bindings are (`_routes.py`).
"""

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._errors import HookError
from . import _patching, _routes
from ._context import active
from ._paths import AbstractTransparent, module_paths


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
        with _routes.named(self.functions, *_code(self.model)):
            return self.model(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class _HeldFunction:
    """A function held by a field of a layer (`eqx.nn.MLP`'s `activation`): calling it
    is a site of the layer that calls it. Not a module (it would be a layer), but a
    hashable leaf, static under `eqx.filter_jit` as the function was."""

    name: str
    function: Callable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _routes.route(self.function, self.function, args, kwargs)


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

    Calls are reached through every reference to the functions: attribute access
    (`jax.nn.gelu`), names imported into any module, partials (Hugging Face's
    `ACT2FN["gelu_new"]`), tables, fields, default arguments and closures. A call of a
    jitted function (`jax.nn.silu`) reached only through a partial or a default
    argument is a site inside that jit: hooks that read the call site, and one-step
    selections, are refused there. A call that is an attention layer's weights
    (`jax.nn.softmax` in a model's own attention) is its `.weights` site where a
    selection names those.
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
    model = jtu.tree_map(
        lambda leaf: _HeldFunction(by_id[id(leaf)], leaf) if id(leaf) in by_id else leaf, model,
    )
    return FunctionSites(model, tuple(sorted(named.items())))
