"""Scopes: the traced bodies a hooked call runs in, and what each has recorded.

The hooked call itself is the first scope; every body of a threaded transform inside it
(vmap, scan, cond, checkpoint, a jit compiled before hooking) opens one more. A value
recorded in a body leaves it as the body's output (`_transforms.py`), or, where the
engine did not thread the transform, through the traced program (`_harvest.py`).
"""

import dataclasses
from typing import Any

from ._errors import HookError


@dataclasses.dataclass
class Scope:
    """Recording state of one traced body: the hooked call itself, or a vmap/scan/cond/
    checkpoint body inside it. Values recorded in a body leave it as the body's outputs."""

    probes: dict
    trace_state: Any
    # Backward slots come planted (`_harvest`): the body's transform was applied where
    # the enclosing scope's slots cannot be passed in as inputs.
    plants: bool = False
    # The body of a jit compiled before hooking: JAX may replay its trace, so its calls
    # count from zero and its logs leave sown, renumbered on arrival (`_harvest`).
    deferred: bool = False
    # Opened inside a program traced by a transform the engine did not thread (a
    # while_loop body), named here: JAX may cache that trace and replay it with other
    # hooks.
    cached: str | None = None
    logs: dict = dataclasses.field(default_factory=dict)
    # Keys of the backward slots attached in this body (and the bodies inside it).
    probed: set = dataclasses.field(default_factory=set)
    # Body inputs are new tracers: map them to the model leaves they stand for, so layers
    # rebuilt from them (e.g. `eqx.combine` in a scan over a layer stack) are recognised.
    # id(inner leaf) -> (paths of the model leaf, inner leaf, outer leaf)
    leaves: dict = dataclasses.field(default_factory=dict)
    modules: dict = dataclasses.field(default_factory=dict)
    # A mapped body's size (`None`: not a mapped body) and traced index (`None` where
    # no hook needs it); `stacked`: model arrays come in mapped (one slice per step: a
    # stack of layers). `indices`, `lengths`: those of every mapped body this scope
    # runs in (its own last), the indices as values of its own trace.
    length: int | None = None
    index: Any = None
    stacked: bool = False
    indices: tuple = ()
    lengths: tuple[int, ...] = ()
    # Logs of one step of this or an enclosing stack: key -> (depth of the stack's
    # scope, step), sliced out when that scope's stacked logs come out.
    steps: dict = dataclasses.field(default_factory=dict)


def check_unique(taken: Any, keys: Any, what: str) -> None:
    """Two calls must never share a log key (one would silently replace the other, or
    their cotangents add up): `rename=` onto a generated key (`{"b": "a@1"}` while `a`
    is called twice, `{"layers.1": "head:in"}` with a pre-log) is refused."""
    clash = sorted(set(keys) & set(taken))
    if clash:
        raise HookError(
            f"two calls would put their {what} under the same key(s) {clash}: a rename= "
            "target collides with a key the engine gives (`path@n` for repeated calls, "
            "`path:in` for pre-logs). Choose rename= keys that no other call gets."
        )

