"""Hooks keep shapes: the check a hook's output must pass, and the zeros that stand in
for a value (log templates, backward slots, the logs of branches not taken)."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._errors import HookError


def _spec(x: Any) -> Any:
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or hasattr(x, "aval"):
        return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"
    return type(x).__name__


def zeros_like(tree: Any) -> Any:
    """Zeros in place of every array (or `jax.ShapeDtypeStruct`) leaf: log templates,
    backward slots, and the logs of branches not taken."""
    return jtu.tree_map(
        lambda x: jnp.zeros(x.shape, x.dtype) if eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct) else x,
        tree,
    )


def check_same_shape(path: str, role: str, expected: Any, got: Any) -> None:
    """Hooks must preserve structure, shapes and dtypes exactly."""
    expected_leaves, expected_tree = jtu.tree_flatten(expected)
    got_leaves, got_tree = jtu.tree_flatten(got)
    if expected_tree != got_tree:
        raise HookError(
            f"{role} at layer {path!r} changed the structure: expected {expected_tree}, "
            f"got {got_tree}"
        )
    for a, b in zip(expected_leaves, got_leaves):
        is_array = eqx.is_array(a) or isinstance(a, jax.ShapeDtypeStruct)
        if is_array and (not hasattr(b, "shape") or a.shape != b.shape or a.dtype != b.dtype):
            raise HookError(
                f"{role} at layer {path!r} must keep shapes and dtypes: expected "
                f"{jtu.tree_map(_spec, expected)}, got {jtu.tree_map(_spec, got)}"
            )

