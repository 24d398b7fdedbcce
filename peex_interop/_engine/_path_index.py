"""The path index: which layer of the hooked model an object is.

Layers are named by the field they are reached through. The model's modules and arrays
are indexed by identity once, at the start of a hooked call; inside a traced body the
inputs are new objects (tracers), so each scope (`_scopes.py`) maps the ones that stand
for the model's modules and arrays (`PathIndex.name`), and a module the model's code
rebuilt from such arrays is told by the arrays it holds (`PathIndex.owner_path`).
"""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from .._errors import HookError
from . import _jax
from ._paths import join, walk
from ._scopes import Scope


class PathIndex:
    """The paths of a model's modules and arrays, and of the body inputs standing for
    them in each open scope.

    **Arguments:**

    - `root`: the hooked model. When one module object sits at several paths, a copy in
        which each path holds its own object is indexed instead (what `jax.jit` does to
        every model), so that a layer is named by the field it is called through,
        identically eager and under `jit`: `root` is then that copy.
    - `scopes`: the context's open scopes, outermost first (read, never reordered).
    """

    def __init__(self, root: Any, scopes: list[Scope]):
        self.scopes = scopes
        self.root = root
        if not self._index(root):
            self.root = jtu.tree_unflatten(*reversed(jtu.tree_flatten(root)))
            self._index(self.root)

    def _index(self, root: Any) -> bool:
        """Index modules by identity and array leaves by identity (every path of a
        leaf: tied weights sit at several). False if a module object sits at two
        paths."""
        self.modules: dict[int, tuple[tuple[str, ...], Any]] = {}
        self.leaves: dict[int, tuple[list[tuple[str, ...]], Any]] = {}
        self.nodes: dict[tuple[str, ...], Any] = {}
        for path, node in walk(root):
            # Only arrays identify layers: ints, functions etc. are shared objects.
            if isinstance(node, eqx.Module):
                if id(node) in self.modules:
                    return False
                self.modules[id(node)] = (path, node)
                self.nodes[path] = node
            elif eqx.is_array(node):
                self.leaves.setdefault(id(node), ([], node))[0].append(path)
        return True

    @property
    def module_types(self) -> set[type]:
        return {type(node) for _, node in self.modules.values()}

    def leaf_paths(self, leaf: Any) -> list[tuple[str, ...]]:
        while True:
            for table in (self.leaves, *(s.leaves for s in reversed(self.scopes))):
                entry = table.get(id(leaf))
                if entry is not None:
                    return entry[0]
            # Inside a vmap the engine did not thread, a model array passed in is held
            # by a batch tracer (the array itself when it is mapped along axis 0).
            if not isinstance(leaf, _jax.BatchTracer):
                return []
            leaf = leaf.val

    def known_path(self, module: Any) -> tuple[str, ...] | None:
        """The path of a module of the model, or of a body input standing for one."""
        for table in (self.modules, *(s.modules for s in reversed(self.scopes))):
            entry = table.get(id(module))
            if entry is not None:
                return entry[0]
        return None

    def owner_path(self, owner: Any) -> tuple[str, ...] | None:
        """The path of `owner`, or None if it is not part of the model."""
        path = self.known_path(owner)
        return self._rebuilt_path(owner) if path is None else path

    def _rebuilt_path(self, owner: Any) -> tuple[str, ...] | None:
        # A module rebuilt inside a body (or by `eqx.tree_at`, `eqx.nn.Shared`) holds
        # body input tracers or model arrays: each leaf votes for the model path of a
        # module of the owner's type that holds it at the same relative path. Tied
        # weights vote for several paths; the other leaves decide.
        votes: dict[tuple[str, ...], int] = {}
        for relative, leaf in walk(owner):
            if isinstance(leaf, eqx.Module) or not relative:
                continue
            for found in self.leaf_paths(leaf):
                path = found[: -len(relative)]
                if found[-len(relative) :] == relative and type(self.nodes.get(path)) is type(owner):
                    votes[path] = votes.get(path, 0) + 1
        if not votes:
            return None
        most = max(votes.values())
        paths = sorted(path for path, count in votes.items() if count == most)
        if len(paths) > 1:
            raise HookError(
                f"cannot tell which layer a {type(owner).__name__} rebuilt during the call "
                f"is: its arrays belong equally to {[join(*p) for p in paths]}"
            )
        path = paths[0]
        table = self.scopes[-1].modules
        for sub_path, node in walk(owner, path):
            if isinstance(node, eqx.Module):
                table.setdefault(id(node), (sub_path, node))
        return path

    def name(self, scope: Scope, outer: Any, inner: Any, length: int | None) -> None:
        """Name in `scope` the body inputs `inner` that stand for `outer`: a known
        module passed in names its inner counterpart (and everything under it) by
        position, so one layer object at two paths stays two layers; other array
        inputs are named by the model paths of the arrays they stand for. A mapped body
        (`length`) into which model arrays come mapped (one axis fewer inside) runs a
        stack of layers (`Scope.stacked`)."""
        outer_nodes, inner_nodes = _positions(outer), _positions(inner)
        if len(outer_nodes) == len(inner_nodes):
            base: tuple[str, ...] = ()
            known: tuple[str, ...] | None = None
            for (position, outer_node), (_, inner_node) in zip(outer_nodes, inner_nodes):
                if known is not None and position[: len(base)] != base:
                    known = None  # left the known module
                if known is None and isinstance(outer_node, eqx.Module):
                    known, base = self.known_path(outer_node), position
                if known is not None:
                    path = known + position[len(base) :]
                    if isinstance(outer_node, eqx.Module):
                        scope.modules[id(inner_node)] = (path, inner_node)
                    elif eqx.is_array(outer_node):
                        scope.leaves[id(inner_node)] = ([path], inner_node, outer_node)
                elif eqx.is_array(outer_node):
                    paths = self.leaf_paths(outer_node)
                    if paths:
                        scope.leaves[id(inner_node)] = (paths, inner_node, outer_node)
                if length is not None and id(inner_node) in scope.leaves and _one_axis_fewer(inner_node, outer_node):
                    scope.stacked = True

    def name_returned(self, outer: Any, inner: Any) -> None:
        """Name the modules of `inner`, a pytree of `outer`'s structure that the model's
        code rebuilt (`eqx.nn.Shared` returns its layers with the tied arrays put back),
        by position: each is the layer of `outer` at its position."""
        self.name(self.scopes[-1], outer, inner, None)

    def origin(self, leaf: Any) -> Any:
        """The model leaf that a body input stands for (through nested bodies)."""
        for scope in reversed(self.scopes):
            entry = scope.leaves.get(id(leaf))
            if entry is not None:
                leaf = entry[2]
        return leaf


def _one_axis_fewer(inner: Any, outer: Any) -> bool:
    return jnp.ndim(inner) < jnp.ndim(outer)


def _positions(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
    """Every module (pre-order) and leaf of `tree`, with its key path: two trees of one
    structure give the same positions."""
    nodes = []
    for key_path, top in jtu.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, eqx.Module))[0]:
        prefix = tuple(str(k) for k in key_path)
        nodes.extend((prefix + relative, node) for relative, node in walk(top))
    return nodes
