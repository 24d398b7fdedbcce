"""Where an NNX submodule call becomes a call site: while hooking is active in the
calling thread, `__call__` (and every method site) of every NNX module class of the
model is replaced for the duration of the call by one that hands the call to
`_context.call_site`, named by its `Call` (`_naming.py`)."""

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from flax import nnx
from flax.nnx import bridge
from flax.nnx.nn import attention as nnx_attention  # its `dot_product_attention_weights`

from ..._engine import (
    AbstractConverted,
    ThreadStack,
    active,
    call_patches,
    call_site,
    method_call_patches,
    patched,
    register_weights_function,
    sown_patches,
)
from ._graph import Path, modules_by_path
from ._naming import PATH_ATTRIBUTE, Call

# NNX's `dot_product_attention` (the default `attention_fn` of `MultiHeadAttention`)
# forms the weights `(..., heads, q, k)` with its module's
# `dot_product_attention_weights` when it has dropout or sows them, else it calls
# `jax.nn.dot_product_attention` (whose weights site is the engine's, `_attention.py`).
register_weights_function(nnx_attention.dot_product_attention_weights)

# The NNX calls in progress in this thread, innermost last.
_calls = ThreadStack()


def _route(original: Callable, module: nnx.Module, args: tuple, kwargs: dict) -> Any:
    return _route_method(original, module, None, args, kwargs)


def _route_method(original: Callable, module: nnx.Module, method: str | None, args: tuple, kwargs: dict) -> Any:
    calls = _calls.items
    if not calls or not active():
        return original(module, *args, **kwargs)
    call = calls[-1]
    path = call.path_of(module)
    call.running.append((module, path))
    try:
        return call_site(
            call.owner, functools.partial(original, module), args, kwargs,
            local=path, module=module, member=method,
        )
    finally:
        call.running.pop()


def _locate(module: nnx.Module) -> tuple[AbstractConverted, Path] | None:
    """The converted model and path of a module sowing during this thread's hooked
    call (`_engine/_sown.py`), or `None` outside one."""
    calls = _calls.items
    if not calls or not active():
        return None
    return calls[-1].owner, calls[-1].path_of(module)


def with_method_sites(types: Iterable[type]) -> list[type]:
    # `nnx.List` and `nnx.Dict` are containers: `append` and `get` are not computations.
    return [cls for cls in types if not issubclass(cls, (nnx.List, nnx.Dict))]


@contextlib.contextmanager
def routing(owner: AbstractConverted, root: nnx.Module) -> Iterator[None]:
    """While hooking is active in this thread, route the NNX submodule calls of one
    `NnxModule` call to call sites; otherwise a plain call costs nothing."""
    if not active():
        yield
        return
    paths = modules_by_path(root)
    calls = _calls.items
    call = Call(owner, root, {id(module): module for _, module in paths}, PATH_ATTRIBUTE.format(depth=len(calls)))
    types = {type(module) for _, module in paths}
    try:
        for path, module in paths:
            # `bridge.ToNNX` reads every attribute of its own as a linen variable: it is
            # named as a descendant of the module calling it instead.
            if not isinstance(module, bridge.ToNNX):
                setattr(module, call.attribute, path)
        patches = [
            *call_patches(types, _route),
            *method_call_patches(with_method_sites(types), nnx.Module, _route_method),
            *sown_patches(nnx.Module, _locate),
        ]
        with patched(patches):
            calls.append(call)
            try:
                yield
            finally:
                calls.remove(call)
    finally:
        # The path leaves with the call: the module's graph definition (what
        # `return_state=True` and `px.to_nnx` split again) is the model's own. A
        # transform may have put new module objects in the graph.
        for module in [*call.merged.values(), *(module for _, module in nnx.iter_modules(root))]:
            if call.attribute in vars(module):
                delattr(module, call.attribute)
