"""Scopes: the traced bodies a hooked call runs in, and how a value leaves each.

The hooked call itself is the first scope; every body of a threaded transform inside it
(vmap, scan, cond, checkpoint, a jit compiled before hooking) opens one more. This is
the one place that decides how a recorded value leaves a transform, and how a backward
slot comes in (`Scopes`): through the innermost scope's dicts, as the body's outputs
and inputs (`_bodies.py`), or, where the code runs under a transform the engine did not
thread (or in a jit whose trace JAX may replay), through the traced program
(`_harvest.py`: sown and planted).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.tree_util as jtu

from .._errors import HookError
from . import _harvest, _jax
from ._shapes import check_same_shape
from ._unthreaded import refused_here, transform_name

# Where a value carried out of a jit compiled before hooking was recorded (the trace
# itself is JAX's to replay).
_DEFERRED = "a jax.jit compiled before hooking began"


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



class Scopes(list[Scope]):
    """A context's open scopes, outermost first, and how values leave and enter them.

    **Arguments:**

    - `probes`: the hooked call's backward slots, by log key.
    - `position`: the context's position among the thread's active contexts: what
        names it in a carried value's tag.
    - `tag_parts`: a log key's parts for a carried value's tag (`_harvest.Tag`), its
        call number relative to a deferred scope or not.
    """

    def __init__(self, probes: dict, position: Callable[[], int], tag_parts: Callable[[str, bool], dict]):
        super().__init__([Scope(probes, _jax.trace_state())])
        self._position = position
        self._tag_parts = tag_parts

    # -- the decision -------------------------------------------------------------------
    def in_foreign_trace(self) -> bool:
        """Whether code running now is under a transform the engine did not thread."""
        return _jax.trace_state() != self[-1].trace_state

    def in_foreign_jaxpr(self) -> bool:
        """Whether code running now is traced into a program by a transform the engine
        did not thread (a vmap the engine did not thread is no program: it may carry)."""
        return self.in_foreign_trace() and not isinstance(_jax.current_trace(), _jax.BatchTrace)

    def carries(self) -> bool:
        """Whether values recorded now leave, and slots arrive, through the traced
        program (`_harvest`) rather than this scope's dicts: the current trace is not
        the scope's (a transform applied before hooking), or the scope is a deferred one."""
        return self.in_foreign_trace() or self[-1].deferred

    def plants(self) -> bool:
        """Whether backward slots are planted here (`_harvest.plant`), not read from
        this scope's probes."""
        return self.carries() or self[-1].plants

    def carried_under(self) -> str:
        """What values are carried through, for error messages."""
        return transform_name() if self.in_foreign_trace() else _DEFERRED

    def unthreadable(self) -> str | None:
        """The transform around the code running now that the engine can neither thread
        nor carry values through, if any."""
        refused = refused_here()
        if refused is not None:
            return refused
        if self.in_foreign_jaxpr():
            return transform_name()
        return self[-1].cached

    # -- values leaving -----------------------------------------------------------------
    def record(self, key: str, value: Any) -> None:
        """Record the log `value` under `key` in the innermost scope, or sow it."""
        if value is None:
            return
        # A log holds its own copy of the structure (the arrays are shared): an
        # `eqx.nn.State` logged at a call is invalidated when a later call updates it.
        value = jtu.tree_map(lambda leaf: leaf, value)
        if self.in_foreign_trace():
            _harvest.sow(self._position(), self._tag_parts(key, False), value, transform_name())
            return
        check_unique(self[-1].logs, [key], "logs")
        self[-1].logs[key] = value

    def merge(self, logs: dict, probed: set, steps: dict | None = None) -> None:
        """Bring what a body returned into the current scope: only if the body's
        transform ran in this scope's trace (a threaded transform nested in one that
        is not would otherwise leak its logs' tracers). One-step logs of the stack
        whose body this was (stacked along the leading axis) are sliced to their step."""
        depth = len(self)
        for key, stack_steps in (steps or {}).items():
            step = next((step for d, step in stack_steps if d == depth), None)
            if step is not None and key in logs:
                logs = {**logs, key: jtu.tree_map(lambda log, step=step: log[step], logs[key])}
            self[-1].steps[key] = [(d, s) for d, s in stack_steps if d != depth]
        check_unique(self[-1].probed, probed, "cotangent slots")
        self[-1].probed |= probed
        if self.in_foreign_trace():
            # The body's transform ran under one the engine did not thread: the logs
            # leave through the traced program.
            index, where = self._position(), transform_name()
            for key, value in logs.items():
                _harvest.sow(index, self._tag_parts(key, False), value, where)
            return
        check_unique(self[-1].logs, logs, "logs")
        self[-1].logs.update(logs)

    # -- slots entering -----------------------------------------------------------------
    def probe(self, key: str, template: Any) -> Any:
        """The cotangent slot of log key `key` (a `BackwardHook.log` entry)."""
        if self.plants():
            return self.slot(key, template)
        probes = self[-1].probes
        if key not in probes:
            raise HookError(
                f"BackwardHook has no cotangent slot for layer {key!r}: call "
                "`hooked = hooked.init(*args)` with inputs of the shapes you call it "
                f"with (slots it has: {sorted(probes) or 'none'})"
            )
        probe = probes[key]
        check_same_shape(key, "the BackwardHook.log entry (from .init)", template, probe)
        check_unique(self[-1].probed, [key], "cotangent slots")
        self[-1].probed.add(key)
        return probe

    def slot(self, key: str, template: Any) -> Any:
        """The slot of log key `key`, shaped like `template`, planted when it cannot be
        read from this scope's dict."""
        if not self.plants():
            return self[-1].probes[key]
        # Counted from zero inside a deferred scope: renumbered where it is taken.
        relative = self[-1].deferred
        return _harvest.plant(self._position(), self._tag_parts(key, relative), template, self.carried_under())

    # -- bodies -------------------------------------------------------------------------
    def body(
        self, probes: dict, index: Any = None, length: int | None = None, visible: tuple | None = None,
        plants: bool = False, cached: str | None = None,
    ) -> Scope:
        """A new scope for a body run in the innermost one (not yet open: its inputs are
        named first). A mapped body (`length`) has a traced `index`; `visible`: an
        enclosed body's inputs that stand for the enclosing scope's indices."""
        parent = self[-1]
        scope = Scope(probes, _jax.trace_state(), plants, length=length, index=index)
        scope.cached = parent.cached or cached
        scope.indices = parent.indices if visible is None else tuple(visible)
        scope.lengths = parent.lengths
        if length is not None:
            scope.indices, scope.lengths = (*scope.indices, index), (*scope.lengths, length)
        return scope

    def close(self) -> tuple[dict, set, dict]:
        """Close the innermost body's scope: its logs, the slots it attached, and the
        one-step logs to slice out of stacks (`Scope.steps`)."""
        scope = self.pop()
        return scope.logs, scope.probed, scope.steps

    def leave_deferred(self, logs: dict) -> None:
        """The logs of a closed scope of a jit compiled before hooking leave sown, with
        their call numbers inside it (renumbered where they arrive)."""
        if not logs:
            return
        index = self._position()
        for key, value in logs.items():
            _harvest.sow(index, self._tag_parts(key, True), value, _DEFERRED)
