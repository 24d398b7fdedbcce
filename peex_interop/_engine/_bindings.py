"""Where a function is bound: every module-global name (and attribute of a loaded
module) that refers to it, so that replacing those names reaches every call of it.

Libraries call functions through their *own* globals (zephyr's `mlp` calls
`zephyr._nets.mlp.linear`; `flax.linen.gelu` and `jax.nn.gelu` are one function under
two modules' names), so a call is reached only by replacing each binding: what the
pure-function adapter does for layer functions and `px.function_sites` for the
functions a layer calls. A reference held elsewhere (a closure, a default argument, an
object's attribute) is not a binding, and is not reached.
"""

import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

from . import _patching


class _Namespace:
    """A globals dict that belongs to no module (code run with `exec`), patched like a
    module: attribute access is access to the dict."""

    def __init__(self, namespace: dict):
        self.__dict__ = namespace


# One proxy per dict, for ever: patches are counted per owner object, so overlapping
# calls must patch a dict through the same proxy.
_namespaces: dict[int, _Namespace] = {}
_namespaces_lock = threading.Lock()


def _owner(namespace: dict) -> Any:
    name = namespace.get("__name__")
    module = sys.modules.get(name) if isinstance(name, str) else None
    if module is not None and vars(module) is namespace:
        return module
    with _namespaces_lock:
        if id(namespace) not in _namespaces:
            _namespaces[id(namespace)] = _Namespace(namespace)
        return _namespaces[id(namespace)]


def _bound(value: Any, wanted: set[int]) -> bool:
    if id(value) in wanted:
        return True
    # A name another overlapping call has already replaced.
    return (
        type(value) is types.FunctionType
        and _patching.ORIGINAL in vars(value)
        and id(_patching.unwrap(value)) in wanted
    )


def bindings(functions: Sequence[Callable], *code: Callable) -> list[tuple[Any, str]]:
    """(owner, name) of every global name bound to one of `functions`, in every loaded
    module and in the globals of `code` (and of the functions they wrap)."""
    wanted = {id(function) for function in functions}
    namespaces = {id(vars(m)): vars(m) for m in list(sys.modules.values()) if hasattr(m, "__dict__")}
    for inner in code:
        while inner is not None:
            if isinstance(getattr(inner, "__globals__", None), dict):
                namespaces.setdefault(id(inner.__globals__), inner.__globals__)
            inner = getattr(inner, "__wrapped__", None)
    found = []
    for namespace in namespaces.values():
        for name, value in list(namespace.items()):
            if _bound(value, wanted):
                found.append((_owner(namespace), name))
    return sorted(found, key=lambda entry: (id(entry[0]), entry[1]))
