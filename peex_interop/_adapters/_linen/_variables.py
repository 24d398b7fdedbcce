"""A linen model's variables: nested dicts of collections (`params`, `batch_stats`,
`cache`, ...), read along a path and rewritten as new dicts, so that the user's
variables are never mutated; and the metadata boxes some variables are stored in.

`nn.with_partitioning` / `nn.with_logical_partitioning` initialisers store a variable
boxed (`nn.Partitioned`, `nn.LogicallyPartitioned`: `flax.core.meta.AxisMetadata`);
`apply` unboxes it, applying the partitioning as a sharding constraint. Values are
read from the box as stored, and written back into a copy of it.
"""

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
from flax.linen.spmd import logical_to_mesh_sharding

from ..._engine import context_mesh, put_like

Path = tuple[str, ...]


def plain(tree: Mapping[str, Any]) -> dict[str, Any]:
    # FrozenDicts become dicts: one pytree structure whichever flax returned.
    return {key: plain(value) if isinstance(value, Mapping) else value for key, value in tree.items()}


def node_at(tree: Any, path: Path) -> Any:
    for part in path:
        if not isinstance(tree, Mapping) or part not in tree:
            return None
        tree = tree[part]
    return tree


def own_variables(tree: Any) -> dict[str, Any]:
    """A module's own variables (not its submodules')."""
    if not isinstance(tree, Mapping):
        return {}
    return {name: value for name, value in tree.items() if not isinstance(value, Mapping)}


def replaced(tree: Mapping[str, Any], path: Path, value: Any) -> dict[str, Any]:
    # New dicts along the path: the user's variables are never mutated.
    head, *rest = path
    return {**tree, head: replaced(tree[head], tuple(rest), value) if rest else value}


def subtree_paths(tree: Any, prefix: Path = ()) -> list[Path]:
    paths = []
    if isinstance(tree, Mapping):
        for key, child in tree.items():
            if isinstance(child, Mapping):
                path = (*prefix, str(key))
                paths.append(path)
                paths.extend(subtree_paths(child, path))
    return paths


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def _contents(box: Any) -> Any:
    # A Partitioned box's `unbox()` constrains its value's sharding; the stored value
    # is what is read.
    return box.value if isinstance(box, nn.Partitioned) else box.unbox()


def unboxed(variables: Mapping[str, Any]) -> Any:
    """The variables with every metadata box replaced by the value it holds."""
    return jax.tree.map(lambda x: _contents(x) if _is_box(x) else x, variables, is_leaf=_is_box)


def _box_sharding(box: Any) -> Any:
    """The sharding a partitioning box declares on its mesh (the box's own, else the one
    of `jax.set_mesh`), logical names resolved by its rules or `nn.logical_axis_rules`;
    `None` without a mesh."""
    if not isinstance(box, nn.Partitioned):
        return None
    mesh = box.mesh if box.mesh is not None else context_mesh()
    if mesh is None:
        return None
    if isinstance(box, nn.LogicallyPartitioned):
        return logical_to_mesh_sharding(box.get_partition_spec(), mesh, box.rules)
    return box.get_sharding(mesh)


def written(path: str, current: Any, value: Any) -> Any:
    """`value` as the destination variable `current` (an array, an abstract one, or a
    box) holds it: placed with its sharding, in a copy of its box."""
    if not _is_box(current):
        return put_like(path, value, current)
    return current.replace_boxed(put_like(path, value, _contents(current), _box_sharding(current)))
