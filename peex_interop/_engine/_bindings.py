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

import itertools
import sys
import threading
import types
from collections.abc import Callable, Iterable, Sequence
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


class _Wanted:
    """The functions `bindings` looks for, found among a namespace's values without an
    `id()` per value: `id` raises an audit event, which costs every value once any audit
    hook is installed (importing jax installs one: ~350 ns a value, ~23 ms a scan of
    every loaded module's ~64,000 globals). The values are first filtered by type
    (`type` raises none), then looked up by hash where the type hashes and compares by
    identity (functions, jitted functions: ~4 ms a scan), by id otherwise (a builtin
    method's hash is its object's, which may raise)."""

    def __init__(self, functions: Sequence[Callable]):
        self.ids = {id(function) for function in functions}
        self.objects = {function for function in functions if _by_identity(type(function))}
        self.types = frozenset(type(function) for function in self.objects)
        self.other_types = frozenset(type(function) for function in functions) - self.types

    def among(self, values: Any) -> bool:
        """Whether one of the functions is in `values` (a dict's values view)."""
        if not self.objects.isdisjoint(_of_types(values, self.types)):
            return True
        return bool(self.other_types) and not self.ids.isdisjoint(map(id, _of_types(values, self.other_types)))


def _by_identity(cls: type) -> bool:
    return cls.__hash__ is object.__hash__ and cls.__eq__ is object.__eq__


def _of_types(values: Any, types: frozenset[type]) -> Iterable[Any]:
    # In C from end to end: a view iterates the dict's values in one order.
    return itertools.compress(values, map(types.__contains__, map(type, values)))


def bindings(functions: Sequence[Callable], *code: Callable) -> list[tuple[Any, str]]:
    """(owner, name) of every global name bound to one of `functions`, in every loaded
    module and in the globals of `code` (and of the functions they wrap), and of every
    closure cell of those holding one."""
    # The functions and the replacements of them another overlapping call installed.
    ids = {id(function) for function in functions}
    wanted = _Wanted([*functions, *_patching.replacements_of(ids)])
    # A namespace listed twice (a module under two names) is found twice, then once.
    namespaces = [vars(m) for m in list(sys.modules.values()) if isinstance(getattr(m, "__dict__", None), dict)]
    found = []
    for inner in code:
        while inner is not None:
            if isinstance(getattr(inner, "__globals__", None), dict):
                namespaces.append(inner.__globals__)
            if isinstance(inner, types.FunctionType) and inner.__closure__:
                for name, cell in zip(inner.__code__.co_freevars, inner.__closure__):
                    try:
                        if id(cell.cell_contents) in wanted.ids:
                            found.append((_cell_owner(cell, name), name))
                    except ValueError:  # a cell not filled yet
                        pass
            inner = getattr(inner, "__wrapped__", None)
    for namespace in namespaces:
        # Most namespaces hold none: told apart without a Python step per name (copies:
        # another thread may import meanwhile).
        if not wanted.among(dict(namespace).values()):
            continue
        names = [name for name, value in list(namespace.items()) if id(value) in wanted.ids]
        found.extend((_owner(namespace), name) for name in names)
    unique = {(id(owner), name): (owner, name) for owner, name in found}
    return [unique[key] for key in sorted(unique)]
