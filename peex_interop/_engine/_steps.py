"""Stacks of layers and their steps: selecting one step of a scanned (or vmapped) stack.

A mapped body into which the model's arrays come mapped runs a stack of layers
(`Scope.stacked`); its traced index is the step. A selection may name one step
(`blocks.1.attn`): the call is then selected under a traced condition, and its log,
stacked along the step axis when the body returns, is sliced to that step.
"""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from .._errors import HookError
from ._paths import AbstractConverted, join
from ._scopes import Scope
from ._selection import Selection, step_path
from ._sites import Frame, InnerCall


def level(scopes: list[Scope], depth: int) -> int:
    """The position of the mapped body at scope `depth` among the mapped bodies."""
    return sum(scope.length is not None for scope in scopes[:depth])


def stacks(scopes: list[Scope], frames: list[Frame]) -> list[tuple[int, str]]:
    """The stacks a call runs in: (depth of the stack body's scope, the path of the
    outermost layer called inside that body, which the step index follows)."""
    found = []
    for depth, scope in enumerate(scopes):
        if scope.stacked:
            root = next(frame.layer for frame in frames if frame.depth > depth)
            found.append((depth, root))
    return found


def steps_selected(
    selection: Selection, scopes: list[Scope], path: str, module: Any, kind: str, stacks: list
) -> tuple[Any, set[str]]:
    """`True` if the call is selected, the steps of its stacks at which it is (a
    one-step selection), or `[]`; and the names and patterns that named steps."""
    # Sites inside layers are selected only where a selection names them.
    selection = selection.inner if isinstance(module, InnerCall) else selection
    if selection.selects(path, module, kind):
        return True, set()
    roots = [root for _, root in stacks]
    lengths = [scopes[d].length or 0 for d, _ in stacks]
    return selection.step_selects(path, roots, lengths)


def at_steps(
    scopes: list[Scope], key: str, name: str, stacks: list, steps: list[dict[int, int]]
) -> tuple[str, Any, bool]:
    """A call selected at some steps only: the traced condition, and, for one step,
    the log key with the step (`blocks.1.attn`), registered to be sliced out of
    the stacked logs when the stack's body returns."""
    active = jnp.asarray(False)
    for choice in steps:
        hit = jnp.asarray(True)
        for at, step in choice.items():
            hit = hit & (scopes[-1].indices[level(scopes, stacks[at][0])] == step)
        active = active | hit
    if len(steps) == 1 and len(steps[0]) == len(stacks):
        roots = [root for _, root in stacks]
        step_key = step_path(name, roots, [str(steps[0][at]) for at in range(len(stacks))])
        key = key.replace(name, step_key, 1)
        for at, step in steps[0].items():
            scopes[-1].steps.setdefault(key, []).append((stacks[at][0], step))
        return key, active, True
    return key, active, False


def refuse_if_a_step_of_a_stack(owner: Any, nodes: dict, selection: Selection, native_kind: Any) -> None:
    """A module no path names whose arrays have the shapes of one step of a selected
    stack of layers of its type (one axis fewer; `nodes`: the model's modules by path)
    is, most likely, that step run by indexing the stack's arrays
    (`eqx.combine(tree_map(lambda a: a[i], ...))`): new arrays the engine cannot trace
    back to the stack. Refused rather than left unhooked."""
    if isinstance(owner, AbstractConverted) or not isinstance(owner, eqx.Module):
        return
    shapes = [jnp.shape(leaf) for leaf in jtu.tree_leaves(eqx.filter(owner, eqx.is_array))]
    if not shapes:
        return
    for path, node in nodes.items():
        if type(node) is not type(owner):
            continue
        stacked = [jnp.shape(leaf) for leaf in jtu.tree_leaves(eqx.filter(node, eqx.is_array))]
        if len(stacked) != len(shapes) or not all(
            len(s) == len(t) + 1 and s[1:] == t and s[0] == stacked[0][0] for s, t in zip(stacked, shapes)
        ):
            continue
        dotted = join(*path)
        if selection.selects(dotted, node, native_kind(node)):
            raise HookError(
                f"a {type(owner).__name__} with the shapes of one step of the stack of layers "
                f"{dotted!r} was called, built from arrays that are not the stack's (a step "
                "run by indexing the stacked arrays?): peex_interop cannot tell which step it "
                f"is, so it would run unhooked. Scan (or vmap) over the stacked arrays "
                f"instead, so that each step's arrays come from {dotted!r}, or exclude it "
                "with where=."
            )
