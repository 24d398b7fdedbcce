"""Where a function is bound: every module-global name (and attribute of a loaded
module) that refers to it, so that replacing those names reaches every call of it.

Libraries call functions through their *own* globals (zephyr's `mlp` calls
`zephyr._nets.mlp.linear`; `flax.linen.gelu` and `jax.nn.gelu` are one function under
two modules' names), so a call is reached only by replacing each binding: what the
pure-function adapter does for layer functions and `px.function_sites` for the
functions a layer calls. The model's own function may also hold them in its closure
(`layer = linear` in the scope that made it): its closure cells are bindings too. A
reference held elsewhere (a default argument, an object's attribute, a partial) is
not, and is not reached.
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


class _Cell:
    """A closure cell, patched like a module: its free variable's name is an attribute
    whose value is the cell's contents."""

    __slots__ = ("cell", "name")

    def __init__(self, cell: types.CellType, name: str):
        object.__setattr__(self, "cell", cell)
        object.__setattr__(self, "name", name)

    @property
    def __dict__(self) -> dict:  # pyright: ignore[reportIncompatibleVariableOverride]
        return {self.name: self.cell.cell_contents}

    def __getattr__(self, name: str) -> Any:
        if name != self.name:
            raise AttributeError(name)
        return self.cell.cell_contents

    def __setattr__(self, name: str, value: Any) -> None:
        if name != self.name:
            raise AttributeError(name)
        self.cell.cell_contents = value


# One proxy per cell, for ever, as for namespaces.
_cells: dict[int, _Cell] = {}


def _cell_owner(cell: types.CellType, name: str) -> _Cell:
    with _namespaces_lock:
        if id(cell) not in _cells:
            _cells[id(cell)] = _Cell(cell, name)
        return _cells[id(cell)]


def _owner(namespace: dict) -> Any:
    name = namespace.get("__name__")
    module = sys.modules.get(name) if isinstance(name, str) else None
    if module is not None and vars(module) is namespace:
        return module
    with _namespaces_lock:
        if id(namespace) not in _namespaces:
            _namespaces[id(namespace)] = _Namespace(namespace)
        return _namespaces[id(namespace)]


def bindings(functions: Sequence[Callable], *code: Callable) -> list[tuple[Any, str]]:
    """(owner, name) of every global name bound to one of `functions`, in every loaded
    module and in the globals of `code` (and of the functions they wrap), and of every
    closure cell of those holding one."""
    # The functions and the replacements of them another overlapping call installed:
    # a set of ids, so that the scan of every module's globals (tens of thousands of
    # names) is one set lookup per name.
    wanted = {id(function) for function in functions}
    wanted |= _patching.replacements_of(wanted)
    namespaces = {id(vars(m)): vars(m) for m in list(sys.modules.values()) if hasattr(m, "__dict__")}
    found = []
    for inner in code:
        while inner is not None:
            if isinstance(getattr(inner, "__globals__", None), dict):
                namespaces.setdefault(id(inner.__globals__), inner.__globals__)
            if isinstance(inner, types.FunctionType) and inner.__closure__:
                for name, cell in zip(inner.__code__.co_freevars, inner.__closure__):
                    try:
                        if id(cell.cell_contents) in wanted:
                            found.append((_cell_owner(cell, name), name))
                    except ValueError:  # a cell not filled yet
                        pass
            inner = getattr(inner, "__wrapped__", None)
    for namespace in namespaces.values():
        # Most namespaces hold none: told apart without a Python step per name (copies:
        # another thread may import meanwhile).
        if wanted.isdisjoint(map(id, list(namespace.values()))):
            continue
        names = [name for name, value in list(namespace.items()) if id(value) in wanted]
        found.extend((_owner(namespace), name) for name in names)
    return sorted(found, key=lambda entry: (id(entry[0]), entry[1]))
