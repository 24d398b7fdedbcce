"""How the submodules of one hooked `NnxModule` call are named. A submodule is named,
in this order:

1. by the path it carries: for the duration of the call every module of the merged
   graph holds its path as a static attribute, which NNX's transforms copy into the
   fresh module objects they hand their bodies (`nnx.vmap`, `nnx.jit`, `nnx.remat`,
   ...), whatever those hold: the same arrays as another layer, no arrays at all, or
   arrays the transform made (split RNG keys, a previous transform's outputs);
2. as a descendant of the module whose call is running (a module attached during the
   call);
3. by its arrays, for a module built during the call from the model's Variables:
   `_context.origin` maps body tracers back to the merged module's arrays, whose NNX
   paths are known, and arrays shared by two layers name neither.
"""

import dataclasses
from typing import Any

from flax import nnx

from ..._engine import AbstractConverted, origin, refuse_if_passed_through
from ..._errors import HookError
from ._graph import Path, as_path, variable_values

# The static attribute by which a module of a hooked call carries its NNX path through
# NNX's transforms: they split their module arguments into a graph definition, which
# holds static attributes by value, and merge fresh objects from it inside the body.
# One attribute per depth of nested calls, so that a module of an enclosing call is no
# module of this one; the name and value stay the same from call to call, so that
# JAX's caches keyed on graph definitions keep hitting.
PATH_ATTRIBUTE = "_peex_interop_path_{depth}"


@dataclasses.dataclass(eq=False)
class Call:
    """One hooked call of one `NnxModule`: how its submodules are named."""

    owner: AbstractConverted  # the `NnxModule` called
    root: nnx.Module
    # The merged modules by id, held so that no id is reused during the call.
    merged: dict[int, nnx.Module]
    attribute: str
    running: list[tuple[nnx.Module, Path]] = dataclasses.field(default_factory=list)
    arrays: dict[int, tuple[Any, list[Path]]] = dataclasses.field(default_factory=dict)

    def path_of(self, module: nnx.Module) -> Path:
        path = vars(module).get(self.attribute)
        if path is not None:
            if self.merged.get(id(module)) is not module and not self._traced_back(module):
                # A copy whose arrays do not come from the model through a threaded
                # transform: one that an unthreaded transform (a while_loop carry)
                # received must not run unhooked.
                self._refuse_if_passed_through(module)
            return path
        path = self._as_descendant(module)
        if path is None:
            path = self._by_arrays(module)
        if path is None:
            self._refuse_if_passed_through(module)
            raise HookError(self._unnamed(module))
        return path

    def _as_descendant(self, module: nnx.Module) -> Path | None:
        if not self.running:
            return None
        parent, parent_path = self.running[-1]
        for relative, node in nnx.graph.iter_graph(parent):
            if node is module:
                return parent_path + as_path(relative)
        return None

    def _traced_back(self, module: nnx.Module) -> bool:
        return any(self._array_paths(origin(value)) for _, value in variable_values(module))

    def _by_arrays(self, module: nnx.Module) -> Path | None:
        # Every array that comes from the model must place the module at one path.
        candidates: set[Path] | None = None
        for relative, value in variable_values(module):
            found = {
                path[: -len(relative)]
                for path in self._array_paths(origin(value))
                if path[-len(relative) :] == relative
            }
            if found:
                candidates = found if candidates is None else candidates & found
        if not candidates:
            return None
        if len(candidates) > 1:
            paths = ", ".join(sorted(repr(".".join(path)) for path in candidates))
            raise HookError(
                f"cannot name the {type(module).__name__} called from NNX path {self._caller()!r}: "
                f"it was built during the call from arrays that the layers {paths} all hold, "
                "so it could be any of them. Call the model's own submodules, or give each "
                "layer its own arrays."
            )
        return candidates.pop()

    def _array_paths(self, array: Any) -> list[Path]:
        # Eager calls replace arrays as they go (BatchNorm statistics, RNG counts):
        # index the root's current values again before giving up. The index holds the
        # values, so that a replaced array's id cannot name a new one.
        if self.arrays.get(id(array), (None,))[0] is not array:
            self.arrays = {}
            for path, value in variable_values(self.root):
                self.arrays.setdefault(id(value), (value, []))[1].append(path)
        return self.arrays.get(id(array), (None, []))[1]

    def _refuse_if_passed_through(self, module: nnx.Module) -> None:
        refuse_if_passed_through(type(module).__name__, [v for _, v in variable_values(module)])

    def _caller(self) -> str:
        return ".".join(self.running[-1][1]) if self.running else ""

    def _unnamed(self, module: nnx.Module) -> str:
        return (
            f"cannot name the {type(module).__name__} called from NNX path {self._caller()!r}: "
            "it is not a submodule of the converted model, and none of its arrays "
            "comes from the model's state through a transform peex_interop threads "
            "(a module created during the call, or an NNX transform built before "
            "hooking began, e.g. nnx.vmap/nnx.remat applied at import time). Create "
            "submodules in __init__ and apply NNX transforms inside __call__."
        )
