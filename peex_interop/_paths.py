"""Dotted layer paths over pytrees of `eqx.Module`s."""

from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax.tree_util as jtu


class AbstractTransparent(eqx.Module):
    """A module that wraps `self.model` without adding a path segment (the hook wrappers):
    `ForwardHook(mlp).model.linear1` is logged as `linear1`, so wrappers nest freely."""

    model: eqx.AbstractVar[Any]


def join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def key_name(key: Any) -> str:
    for attribute in ("name", "key", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _is_child(node: Any):
    return lambda x: x is not node and isinstance(x, eqx.Module)


def children(node: eqx.Module) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Direct submodules (through lists, tuples and dicts) and array-or-other leaves of
    `node`, each with its key path relative to `node`."""
    leaves, _ = jtu.tree_flatten_with_path(node, is_leaf=_is_child(node))
    for key_path, leaf in leaves:
        yield tuple(key_name(key) for key in key_path), leaf


def walk(
    node: Any, prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every module (pre-order, root included) and every non-module leaf under `node`,
    with its key path. Transparent wrappers are skipped over."""
    if isinstance(node, AbstractTransparent):
        yield from walk(node.model, prefix)
        return
    if not isinstance(node, eqx.Module):
        yield prefix, node
        return
    yield prefix, node
    for key_path, child in children(node):
        yield from walk(child, prefix + key_path)


def module_paths(root: Any) -> dict[str, eqx.Module]:
    """Dotted path -> module for every submodule of `root` (the root itself is `""`)."""
    return {
        join(*path): node for path, node in walk(root) if isinstance(node, eqx.Module)
    }
