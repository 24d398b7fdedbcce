"""Walking an NNX module graph: its modules and the arrays of its Variables, by path."""

from collections.abc import Iterable
from typing import Any

from flax import nnx

Path = tuple[str, ...]


def modules_by_path(root: nnx.Module) -> list[tuple[Path, nnx.Module]]:
    # iter_modules yields a shared module once, under its first path.
    return [(as_path(path), module) for path, module in nnx.iter_modules(root)]


def as_path(parts: Iterable[Any]) -> Path:
    return tuple(str(part) for part in parts)


def variable_values(node: nnx.Module) -> Iterable[tuple[Path, Any]]:
    for path, value in nnx.graph.iter_graph(node):
        if isinstance(value, nnx.Variable):
            yield as_path(path), value.get_value()
