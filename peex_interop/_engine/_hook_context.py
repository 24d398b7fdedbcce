"""The hooking context: one hooked call of one wrapper, and how it runs a call site.

A context resolves each call's dotted path (`_path_index.py`), decides whether it is
selected (at every step, or at some steps of a stack: `_steps.py`), runs its policy's
hooks around it, and records what the policy logs in the innermost scope
(`_scopes.py`), or carries it through a program the engine did not thread
(`_harvest.py`). Adapters reach the active contexts through `_context.call_site`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax.numpy as jnp
import jax.tree_util as jtu

from .._errors import HookError, TransformError
from . import _steps
from ._kinds import MEMBERS
from ._path_index import PathIndex
from ._paths import AbstractConverted
from ._scopes import Scopes
from ._selection import Selection
from ._shapes import check_same_shape
from ._sites import CallSite, Frame, InnerCall, Site, takes_site
from ._unthreaded import THREADED


class Policy(Protocol):
    """What a hook wrapper does at the call sites it selects."""

    @property
    def selection(self) -> Selection: ...

    def run_site(self, context: "HookContext", site: Site) -> Any: ...


class HookContext:
    """One hooked call of one wrapper: its path index, call stack, counts and scopes.

    `root` is the model the wrapper calls: the wrapped model itself, or, when one layer
    object is stored at several paths, a copy in which each path holds its own object
    (`PathIndex`), so that a layer is named by the field it is called through,
    identically eager, under `jit` and in `BackwardHook.init`.
    """

    def __init__(
        self,
        root: Any,
        policy: Policy,
        probes: dict | None,
        discovering: bool,
        native_kind: Callable[[Any], str],
    ):
        self.policy = policy
        self.native_kind = native_kind
        # Policies that only read static facts (px.summary) may run under any trace.
        self.observes_values = getattr(policy, "observes_values", True)
        # Read once: the wrappers build their selection from static fields on access.
        self.selection = policy.selection
        # Whether mapped bodies must provide their traced index (hooks that take the
        # call site, one-step selections), or only name their axis (statistics that
        # pool over it).
        self.reads_sites = getattr(policy, "needs_indices", False)
        self.needs_indices = self.reads_sites or bool(self.selection.step_patterns())
        self.needs_axis_names = getattr(policy, "needs_axis_names", False)
        self.renames = self.selection.rename
        self.discovering = discovering
        self.scopes = Scopes({} if probes is None else probes, self._index_in_active, self._tag_parts)
        self.paths = PathIndex(root, self.scopes)
        self.root = self.paths.root
        # This thread's active contexts, set on entry (`_context.entered`): the position
        # among them names this context in values carried through traced programs.
        self.thread_contexts: list[HookContext] = []
        self.frames: list[Frame] = []
        self.counts: dict[str, int] = {}
        # Paths called, and names/patterns that selected one step of a stack: a
        # pattern like `blocks.7.attn` is checked against them after the call.
        self.seen: set[str] = set()
        self.step_hits: set[str] = set()
        # Paths and log keys of the calls the selection selected (the closed-world rule:
        # every pattern the user gave must reach one).
        self.selected: set[str] = set()
        # Keys of calls of selected layers that a name of another call left out (`lin`
        # for `lin@1`): an error's closest keys.
        self.passed_over: set[str] = set()
        self.claims: dict[str, str] = {}
        # Every log key given out: key -> (path, key without its call number, number),
        # so that keys counted inside a deferred scope can be renumbered on arrival.
        self.key_parts: dict[str, tuple[str, str, int]] = {}
        # One-step keys given out (`blocks.1.attn`) -> the path of their stack's layer.
        self.step_keys: dict[str, str] = {}
        self._batch: Any = None
        self._batch_base: dict[str, int] = {}
        self._outer_counts: list[dict[str, int]] = []
        # Selected calls so far, and at the entry of each open deferred scope.
        self.hooked_calls = 0
        self._hooked_at_entry: list[int] = []
        # This call's own wrappers of jitted functions that call selected layers.
        self.deferred_bodies: dict[Any, Callable] = {}

    def resolve(self, owner: Any, local: tuple[str, ...]) -> tuple[str, ...] | None:
        """The owner's path, or None if it is not part of this context's model, or if
        this is the owner re-entering its own call (`super().__call__`)."""
        if self.frames and self.frames[-1].owner is owner and self.frames[-1].local == local:
            return None
        return self.paths.owner_path(owner)

    # -- running a call site ----------------------------------------------------------
    def run(
        self,
        call: Callable[..., Any],
        owner: Any,
        local: tuple[str, ...],
        path: str,
        module: Any,
        signature: Callable[..., Any],
        kind: str | None,
        *args,
        **kwargs,
    ) -> Any:
        kind = self._kind(owner, module) if kind is None else kind
        layer = path.rpartition(".")[0] if kind in MEMBERS else path
        self.frames.append(Frame(owner, local, path, len(self.scopes), module, kind, layer, []))
        try:
            stacks = _steps.stacks(self.scopes, self.frames)
            self.seen.add(path)
            steps, matched = _steps.steps_selected(self.selection, self.scopes, path, module, kind, stacks)
            self.step_hits |= matched
            if not steps:
                return call(*args, **kwargs)
            if self.observes_values:
                self._check_carryable(path, steps is not True)
            # Any selected call (also in a body inside a deferred scope) makes its jit's
            # trace one of this call's own.
            self.hooked_calls += 1
            name = self.renames.get(path, path)
            claimed = self.claims.setdefault(name, path)
            if claimed != path:
                raise HookError(
                    f"rename= gives layers {claimed!r} and {path!r} the same log key "
                    f"{name!r}: their logs would overwrite (or their cotangents add up)"
                )
            count = self.counts.get(path, 0)
            self.counts[path] = count + 1
            selection = self.selection.inner if isinstance(module, InnerCall) else self.selection
            key = name if count == 0 else f"{name}@{count}"
            if selection.names_calls:  # a name of one call (`lin@1`): is it this one?
                roots, lengths = [root for _, root in stacks], [self.scopes[d].length or 0 for d, _ in stacks]
                if not selection.selects_call(path, module, kind, count, roots, lengths):
                    self.passed_over.add(key)
                    return call(*args, **kwargs)  # another call of the layer is named
            active, one_step = None, False
            if steps is not True:
                key, active, one_step = _steps.at_steps(self.scopes, key, name, stacks, steps)
            self._refuse_two_readings(key, path, one_step)
            self.key_parts[key] = (path, key if count == 0 else key.rsplit("@", 1)[0], count)
            self.selected |= {path, key}
            site = Site(
                path, key, owner, module, kind, call, args, kwargs, count,
                self.scopes[-1].indices,
                self.scopes[-1].lengths,
                tuple((_steps.level(self.scopes, d), root) for d, root in stacks),
                active,
                one_step,
                signature,
            )
            return self.policy.run_site(self, site)
        finally:
            self.frames.pop()

    def native_kind_of(self, owner: Any, module: Any) -> str:
        """The kind of a library module of `owner`, a converted model."""
        return owner.layer_kind(module) if isinstance(owner, AbstractConverted) else self.native_kind(module)

    def _kind(self, owner: Any, module: Any) -> str:
        if isinstance(module, InnerCall):
            return module.kind
        # Converted models know their library's classes; the rest are Equinox's.
        converted = isinstance(owner, AbstractConverted) and owner is not module
        return owner.layer_kind(module) if converted else self.native_kind(module)

    def would_select(self, path: str, module: InnerCall) -> bool:
        """Whether a site inside the running layer would be selected at some step: for
        adapters that expose a value only when it is wanted (attention weights that a
        fused implementation never forms)."""
        self.frames.append(Frame(self.frames[-1].owner, (), path, len(self.scopes), module, module.kind, path, []))
        try:
            stacks = _steps.stacks(self.scopes, self.frames)
            return bool(_steps.steps_selected(self.selection, self.scopes, path, module, module.kind, stacks)[0])
        finally:
            self.frames.pop()

    def _refuse_two_readings(self, key: str, path: str, one_step: bool) -> None:
        """A one-step key that is also another layer's key (`blocks.0`: step 0 of the
        stack `blocks`, and a function model's params key 0 under `blocks`) would have
        one selection act on both calls, and their logs collide."""
        if one_step:
            self.step_keys[key] = path
            layer, stack = self.key_parts.get(key, (path,))[0], path
        else:
            layer, stack = path, self.step_keys.get(key, path)
        if layer != stack:
            raise HookError(
                f"{key!r} names two calls: the layer {layer!r}, and one step of the stack of "
                f"layers {stack!r} (a number after a stack's root names one of its steps); "
                "hooks would act on both. Select the layer alone, at every step, with a "
                f"predicate: `where=lambda path, layer: path == {layer!r}`."
            )

    def apply(self, site: Site, role: str, fn: Any, value: Any) -> Any:
        """Run a user hook or log (given the call site if it takes one), attaching the
        layer path to anything it raises (KeyboardInterrupt included)."""
        try:
            return fn(value, CallSite.of(site)) if takes_site(fn) else fn(value)
        except BaseException as error:
            error.add_note(f"peex_interop: raised by {role} at layer {site.path!r}")
            raise

    def apply_hook(self, site: Site, role: str, hook: Any, value: Any) -> Any:
        out = self.apply(site, role, hook, value)
        check_same_shape(site.path, role, value, out)
        if site.active is not None:
            # Selected at some steps of a stack only: the other steps keep their value.
            out = jtu.tree_map(lambda edited, kept: jnp.where(site.active, edited, kept), out, value)
        return out

    def _check_carryable(self, path: str, one_step: bool) -> None:
        """Carried values have no traced index of the unthreaded transforms around them
        and, in a deferred scope, only a provisional call number: hooks that read the
        call site, and one-step selections, are refused there."""
        where = self.scopes.unthreadable()
        if where is not None:
            raise TransformError(
                f"cannot hook layer(s) {[path]}: they run under {where}, which "
                f"peex_interop cannot thread values out of (JAX may also replay that trace "
                f"with other hooks). {THREADED} Move that transform outside the hooked "
                "model, or exclude the layer with where=."
            )
        if not self.scopes.carries():
            return
        # A pattern that may name a step (`layers.0`) refuses only the calls it selects
        # as a step: as a plain path it selects whole calls, which carry.
        if self.reads_sites or one_step:
            where = self.scopes.carried_under()
            raise TransformError(
                f"cannot run the site-aware hooks of layer {path!r} (or select one step of "
                f"its stack): it runs under {where}, whose index and call count the engine "
                "cannot know. Plain hooks and logs work there; move that transform outside "
                "the hooked model, or exclude the layer with where=."
            )

    def _tag_parts(self, key: str, relative: bool) -> dict:
        base, suffix = (key[:-3], ":in") if key.endswith(":in") and key[:-3] in self.key_parts else (key, "")
        path, name, count = self.key_parts.get(base, (base.split("@")[0], base, 0))
        if not relative:
            name, count = base, 0
        return {"path": path, "name": name, "count": count, "suffix": suffix, "relative": relative}

    def _index_in_active(self) -> int:
        return next(i for i, c in enumerate(self.thread_contexts) if c is self)

    def record(self, site: Site, key: str, value: Any) -> None:
        """Record a log of `site` under `key` (`Scopes.record`)."""
        self.scopes.record(key, value)

    def probe(self, site: Site, template: Any) -> Any:
        """The cotangent slot for this site (a `BackwardHook.log` entry)."""
        return self.scopes.probe(site.key, template)

    # -- carried values arriving (`_harvest`) ------------------------------------------
    def _renumber(self, tag: Any) -> tuple[str, int]:
        """The key of a value counted inside a deferred scope: its number there, after
        the calls of its layer made before the deferred scope's values arrived."""
        if not tag.relative:
            return tag.key(), tag.count
        if tag.batch != self._batch:
            self._batch, self._batch_base = tag.batch, dict(self.counts)
        count = self._batch_base.get(tag.path, 0) + tag.count
        self.counts[tag.path] = max(self.counts.get(tag.path, 0), count + 1)
        return tag.key(count), count

    def arrive(self, tag: Any, value: Any) -> None:
        """A sown log reaching this context's innermost scope's trace."""
        key, count = self._renumber(tag)
        self.seen.add(tag.path)
        self.selected |= {tag.path, key}
        self.hooked_calls += 1
        logs = self.scopes[-1].logs
        if key in logs:
            raise HookError(
                f"two logs of layer {tag.path!r} arrived under the key {key!r} (a trace "
                "replayed by JAX?): refusing to overwrite one with the other"
            )
        base = key[: -len(tag.suffix)] if tag.suffix else key
        if tag.relative and not tag.suffix:
            self.key_parts[base] = (tag.path, tag.name, count)
        logs[key] = value

    def arrive_slot(self, tag: Any, template: Any) -> Any:
        """The slot asked for by a planted value reaching this scope's trace."""
        key, _ = self._renumber(tag)
        self.seen.add(tag.path)
        self.selected |= {tag.path, key}
        scope = self.scopes[-1]
        if key not in scope.probes:
            raise HookError(
                f"BackwardHook has no cotangent slot for layer {key!r} (under {tag.where}): "
                "call `hooked = hooked.init(*args)` with inputs of the shapes you call it "
                f"with (slots it has: {sorted(scope.probes) or 'none'})"
            )
        slot = scope.probes[key]
        check_same_shape(key, "the BackwardHook.log entry (from .init)", template, slot)
        scope.probed.add(key)
        return slot

    def renumber_passing(self, tag: Any) -> Any:
        """A planted slot passing through a deferred scope: numbered among its calls."""
        key, count = self._renumber(tag)
        del key
        self.hooked_calls += 1
        return dataclasses.replace(tag, count=count, batch=None)

    def enter_deferred(self, outer: Any, inner: Any, cached: str | None = None) -> None:
        """Open the scope of a jit compiled before hooking (its trace may be replayed):
        layers are named through its arguments, calls count from zero. `cached`: the
        unthreadable transform the jit was called in, if any."""
        self._hooked_at_entry.append(self.hooked_calls)
        self.enter_body(outer, inner, {}, cached=cached)
        scope = self.scopes[-1]
        # The enclosing indices are values of another trace: unknown here (hooks that
        # read them are refused); the lengths still say how the logs are stacked.
        scope.deferred, scope.indices = True, tuple(None for _ in scope.indices)
        self._outer_counts.append(self.counts)
        if self.observes_values:
            # A static-facts pass (px.summary) is never replayed: it counts on.
            self.counts = {}

    def exit_deferred(self) -> bool:
        """Close it: its logs leave sown, with their call numbers inside it. Returns
        whether a selected layer ran in it."""
        scope = self.scopes.pop()
        self.counts = self._outer_counts.pop()
        hooked = self.hooked_calls > self._hooked_at_entry.pop()
        # Sown after the counts are the enclosing scope's: a log may arrive at once.
        self.scopes.leave_deferred(scope.logs)
        return hooked

    # -- transformed bodies -------------------------------------------------------------
    def enter_body(
        self, outer: Any, inner: Any, probes: dict, index: Any = None, length: int | None = None,
        visible: tuple | None = None, plants: bool = False, cached: str | None = None,
    ) -> None:
        """Open the scope of a body whose inputs `inner` stand for `outer`: a known
        module passed in names its inner counterpart (and everything under it) by
        position, so one layer object at two paths stays two layers; other array
        inputs are named by the model paths of the arrays they stand for. A mapped
        body (`index`: its traced index) into which model arrays come mapped (one
        axis fewer inside) runs a stack of layers. `visible`: an enclosed body's
        inputs that stand for the enclosing scope's indices."""
        scope = self.scopes.body(probes, index, length, visible, plants, cached)
        self.paths.name(scope, outer, inner, length)
        self.scopes.append(scope)

    @property
    def logs(self) -> dict:
        return self.scopes[0].logs

    @property
    def needs_probes(self) -> bool:
        return not self.discovering and getattr(self.policy, "uses_probes", False)

