"""Hooking contexts and call sites: where any library's layer call becomes a hook call.

A *call site* is one call of one layer: its owner (the `eqx.Module` in the hooked pytree
that the call belongs to), a local path inside that owner (empty for Equinox layers; the
Haiku/NNX submodule path for converted models), the library's module object (for `where=`
type checks), the callable and its arguments. Adapters feed call sites to `call_site`;
every hooking context active in the calling thread then resolves the site's dotted path,
decides whether it is selected, and runs its policy (forward or backward hooks) around it.
"""

import contextlib
import dataclasses
import difflib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _harvest, _jax, _known_paths
from ._errors import HookError, TransformError
from ._kinds import MEMBERS, METHOD
from ._paths import AbstractConverted, join, walk
from ._selection import (
    Selection,
    could_be_step,
    glob_to_regex,
    may_name_a_step,
    step_path,
    step_segments,
    steps_of,
)


@dataclasses.dataclass(frozen=True)
class Site:
    """One selected call of one layer, as a policy sees it.

    `indices`/`lengths`: the traced index and the size of every threaded mapped body
    (vmap, scan, map, static fori_loop) the call runs in, outermost first. `stacks`:
    which of those bodies map the model's own arrays (a scanned stack of layers), each
    with the path of the layer the stack's step index follows (`blocks` in
    `blocks.1.attn`). `active`: for a call selected at some steps only (`where=
    "blocks.1.attn"`), the traced condition under which hooks apply.
    """

    path: str
    key: str
    owner: Any
    module: Any
    kind: str
    call: Callable[..., Any]
    args: tuple
    kwargs: dict
    call_index: int = 0
    indices: tuple = ()
    lengths: tuple[int, ...] = ()
    stacks: tuple[tuple[int, str], ...] = ()
    active: Any = None
    # Whether the log key is one step's (`blocks.1.attn`): its stacks' axes are sliced.
    one_step: bool = False
    # The function whose parameters `args` and `kwargs` fill (a peex-style pre-hook
    # binds them: `_arguments.py`).
    signature: Callable[..., Any] | None = None

    @property
    def log_index(self) -> tuple:
        """This call's index into its log entry (the mapped axes the entry keeps)."""
        sliced = {level for level, _ in self.stacks} if self.one_step else set()
        return tuple(index for level, index in enumerate(self.indices) if level not in sliced)

    @property
    def step_path(self) -> str:
        """The path with each stack's step index after its root: `blocks.{i}.attn`
        (`{i}` a placeholder: steps are traced)."""
        return step_path(self.path, [root for _, root in self.stacks], ["{i}"] * len(self.stacks))


@dataclasses.dataclass(frozen=True, eq=False)
class InnerCall:
    """The `module` of a site inside a layer (`_inner_sites.py`): what `CallSite.
    module_type` names and `px.sites` lists for it. `layer` is the library module of
    the layer it runs in, `name` the site's last path segment, `kind` its kind."""

    layer: Any
    name: str
    kind: str


class Frame(NamedTuple):
    """A call site running in a context (`HookContext.frames`, innermost last)."""

    owner: Any
    local: tuple[str, ...]
    path: str
    # How many scopes were open when the call began (the stacks it runs in).
    depth: int
    module: Any
    kind: str
    # The path of the layer the call belongs to: its own, or, for a method site
    # (`embedder.attend`), its module's (`embedder`). Sites inside the call are named
    # under it, and a stack's step index follows it.
    layer: str
    # The functions by which this call formed attention weights (`_routes.py`): a
    # second one makes its `.weights` ambiguous.
    weights_formed: list[str]


class CallSite(eqx.Module):
    """Where a hook or log runs: given to any hook or log that takes a second argument
    (`def hook(value, site): ...`).

    - `path`: the layer's dotted path (`"blocks.attn"`; a stack's layers share one).
    - `key`: its log key (`"blocks.attn@1"` for a second call, `"blocks.1.attn"` for
      one selected step).
    - `kind`: its library-independent kind (`px.KINDS`); `module_type`: the library's
      class (`eqx.nn.Linear`, `hk.Linear`, `nnx.Linear`, ...), `px.InnerCall` for a
      site inside a layer (`attn.weights`, `mlp.gelu`).
    - `call_index`: 0 for the layer's first call in this forward pass, 1 for the next...
    - `indices`, `lengths`: inside threaded `vmap`/`scan`/`map`/`fori_loop` bodies, the
      traced index (int32 scalar) and the size of each, outermost first (`()` outside).
    - `log_index`: this call's index into its log entry: `log[site.key][site.log_index]`
      is this call's value (the entry is stacked along the mapped axes it runs in).
    - `steps`, `stack_roots`, `stack_lengths`: inside scanned (or vmapped) stacks of
      layers, the traced index of this layer in each stack, the path each step
      follows (`blocks` for `blocks.1.attn`) and each stack's size, outermost first.
      `step` and `stack_root` are the innermost stack's (`None` outside a stack).
    """

    # A pytree (an `eqx.Module`): the traced indices are its leaves, so it can be
    # passed through `jax.custom_vjp` to backward hooks; the rest is static.
    path: str = eqx.field(static=True)
    key: str = eqx.field(static=True)
    kind: str = eqx.field(static=True)
    module_type: type = eqx.field(static=True)
    call_index: int = eqx.field(static=True)
    indices: tuple
    lengths: tuple[int, ...] = eqx.field(static=True)
    log_index: tuple
    steps: tuple
    stack_roots: tuple[str, ...] = eqx.field(static=True)
    stack_lengths: tuple[int, ...] = eqx.field(static=True)

    @classmethod
    def of(cls, site: "Site") -> "CallSite":
        return cls(
            site.path, site.key, site.kind, type(site.module), site.call_index, site.indices, site.lengths,
            site.log_index,
            tuple(site.indices[level] for level, _ in site.stacks),
            tuple(root for _, root in site.stacks),
            tuple(site.lengths[level] for level, _ in site.stacks),
        )

    @property
    def step(self) -> Any:
        return self.steps[-1] if self.steps else None

    @property
    def stack_root(self) -> str | None:
        return self.stack_roots[-1] if self.stack_roots else None

    def matches(self, pattern: str) -> Any:
        """Whether `pattern` (a glob as in `where=`) names this call: `True`/`False`, or,
        for one step of a stack (`"blocks.1.attn"`), a traced boolean."""
        if glob_to_regex(pattern).match(self.path) or glob_to_regex(pattern).match(self.key):
            return True
        found = steps_of(pattern, step_segments(self.path, self.stack_roots), self.stack_lengths)
        if not found:
            return False
        condition = jnp.asarray(True)
        for level, step in found[0].items():
            condition = condition & (self.steps[level] == step)
        return condition


class Policy(Protocol):
    """What a hook wrapper does at the call sites it selects."""

    @property
    def selection(self) -> Selection: ...

    def run_site(self, context: "HookContext", site: Site) -> Any: ...


@dataclasses.dataclass
class _Scope:
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


THREADED = (
    "Threaded transforms, whatever reference reaches them: jax.vmap, eqx.filter_vmap, "
    "jax.lax.scan, jax.lax.map, jax.lax.fori_loop with static bounds, jax.lax.cond, "
    "jax.lax.switch, jax.jit and eqx.filter_jit (also compiled before hooking), "
    "jax.checkpoint/remat, eqx.filter_checkpoint, jax.shard_map, a function decorated "
    "with @jax.vmap."
)


_TRACED_FOR = {
    "while_loop": "jax.lax.while_loop (or a fori_loop with traced bounds)",
    "while_body": "jax.lax.while_loop (or a fori_loop with traced bounds)",
    "while_cond": "jax.lax.while_loop (or a fori_loop with traced bounds)",
    "scan": "jax.lax.scan", "cond": "jax.lax.cond/switch", "switch": "jax.lax.cond/switch",
    "checkpoint": "jax.checkpoint", "jit": "jax.jit", "custom_vjp": "jax.custom_vjp",
    "custom_jvp": "jax.custom_jvp", "shard_map": "jax.shard_map",
}


def transform_name() -> str:
    """The transform the current trace belongs to, for error messages (private JAX
    API, used only to make a message precise)."""
    try:
        trace = _jax.current_trace()
        kind = type(trace).__name__
        if kind == "BatchTrace":
            return "jax.vmap applied before hooking began (a function decorated with @jax.vmap at import)"
        if kind in ("JVPTrace", "LinearizeTrace", "JaxprTrace"):
            return "autodiff inside the model (jax.grad/jax.vjp/jax.jacrev/jax.linearize)"
        traced_for, func_name = _jax.traced_for(trace)
        # JAX names sub-traces after their transform ("custom_vjp fun", "while_body").
        named = _TRACED_FOR.get(traced_for) or _TRACED_FOR.get(traced_for.split(" ")[0])
        return f"{named or repr(traced_for)} of {func_name!r}"
    except Exception:
        return "a JAX transform"


class HookContext:
    """One hooked call of one wrapper: its path index, call stack, counts and scopes.

    `root` is the model the wrapper calls: the wrapped model itself, or, when one layer
    object is stored at several paths, a copy in which each path holds its own object
    (what `jax.jit` does to every model), so that a layer is named by the field it is
    called through, identically eager, under `jit` and in `BackwardHook.init`.
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
        self.root = root
        if not self._index(root):
            self.root = jtu.tree_unflatten(*reversed(jtu.tree_flatten(root)))
            self._index(self.root)
        self.frames: list[Frame] = []
        self.counts: dict[str, int] = {}
        # Paths called, and names/patterns that selected one step of a stack: a
        # pattern like `blocks.7.attn` is checked against them after the call.
        self.seen: set[str] = set()
        self.step_hits: set[str] = set()
        # Paths and log keys of the calls the selection selected (the closed-world rule:
        # every pattern the user gave must reach one).
        self.selected: set[str] = set()
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
        self.scopes = [_Scope({} if probes is None else probes, _jax.trace_state())]

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

    # -- paths ---------------------------------------------------------------------
    def _leaf_paths(self, leaf: Any) -> list[tuple[str, ...]]:
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

    def resolve(self, owner: Any, local: tuple[str, ...]) -> tuple[str, ...] | None:
        """The owner's path, or None if it is not part of this context's model, or if
        this is the owner re-entering its own call (`super().__call__`)."""
        if self.frames and self.frames[-1].owner is owner and self.frames[-1].local == local:
            return None
        for table in (self.modules, *(s.modules for s in reversed(self.scopes))):
            entry = table.get(id(owner))
            if entry is not None:
                return entry[0]
        return self._resolve_rebuilt(owner)

    def _resolve_rebuilt(self, owner: Any) -> tuple[str, ...] | None:
        # A module rebuilt inside a body (or by `eqx.tree_at`, `eqx.nn.Shared`) holds
        # body input tracers or model arrays: each leaf votes for the model path of a
        # module of the owner's type that holds it at the same relative path. Tied
        # weights vote for several paths; the other leaves decide.
        votes: dict[tuple[str, ...], int] = {}
        for relative, leaf in walk(owner):
            if isinstance(leaf, eqx.Module) or not relative:
                continue
            for found in self._leaf_paths(leaf):
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

    def refuse_if_a_step_of_a_stack(self, owner: Any) -> None:
        """A module no path names whose arrays have the shapes of one step of a selected
        stack of layers of its type (one axis fewer) is, most likely, that step run by
        indexing the stack's arrays (`eqx.combine(tree_map(lambda a: a[i], ...))`): new
        arrays the engine cannot trace back to the stack. Refused rather than left
        unhooked."""
        if isinstance(owner, AbstractConverted) or not isinstance(owner, eqx.Module):
            return
        shapes = [jnp.shape(leaf) for leaf in jtu.tree_leaves(eqx.filter(owner, eqx.is_array))]
        if not shapes:
            return
        for path, node in self.nodes.items():
            if type(node) is not type(owner):
                continue
            stacked = [jnp.shape(leaf) for leaf in jtu.tree_leaves(eqx.filter(node, eqx.is_array))]
            if len(stacked) != len(shapes) or not all(
                len(s) == len(t) + 1 and s[1:] == t and s[0] == stacked[0][0] for s, t in zip(stacked, shapes)
            ):
                continue
            dotted = join(*path)
            if self.selection.selects(dotted, node, self.native_kind(node)):
                raise HookError(
                    f"a {type(owner).__name__} with the shapes of one step of the stack of layers "
                    f"{dotted!r} was called, built from arrays that are not the stack's (a step "
                    "run by indexing the stacked arrays?): peex_interop cannot tell which step it "
                    f"is, so it would run unhooked. Scan (or vmap) over the stacked arrays "
                    f"instead, so that each step's arrays come from {dotted!r}, or exclude it "
                    "with where=."
                )

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
            stacks = self._stacks()
            self.seen.add(path)
            steps, matched = self._steps_selected(path, module, kind, stacks)
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
            key = name if count == 0 else f"{name}@{count}"
            active, one_step = None, False
            if steps is not True:
                key, active, one_step = self._at_steps(key, name, stacks, steps)
            self._refuse_two_readings(key, path, one_step)
            self.key_parts[key] = (path, key if count == 0 else key.rsplit("@", 1)[0], count)
            self.selected |= {path, key}
            site = Site(
                path, key, owner, module, kind, call, args, kwargs, count,
                self.scopes[-1].indices,
                self.scopes[-1].lengths,
                tuple((self._level(d), root) for d, root in stacks),
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

    def _steps_selected(self, path: str, module: Any, kind: str, stacks: list) -> tuple[Any, set[str]]:
        """`True` if the call is selected, the steps of its stacks at which it is (a
        one-step selection), or `[]`; and the names and patterns that named steps."""
        # Sites inside layers are selected only where a selection names them.
        selection = self.selection.inner if isinstance(module, InnerCall) else self.selection
        if selection.selects(path, module, kind):
            return True, set()
        roots = [root for _, root in stacks]
        lengths = [self.scopes[d].length or 0 for d, _ in stacks]
        return selection.step_selects(path, roots, lengths)

    def would_select(self, path: str, module: InnerCall) -> bool:
        """Whether a site inside the running layer would be selected at some step: for
        adapters that expose a value only when it is wanted (attention weights that a
        fused implementation never forms)."""
        self.frames.append(Frame(self.frames[-1].owner, (), path, len(self.scopes), module, module.kind, path, []))
        try:
            return bool(self._steps_selected(path, module, module.kind, self._stacks())[0])
        finally:
            self.frames.pop()

    def _level(self, depth: int) -> int:
        """The position of the mapped body at scope `depth` among the mapped bodies."""
        return sum(scope.length is not None for scope in self.scopes[:depth])

    def _stacks(self) -> list[tuple[int, str]]:
        """The stacks this call runs in: (depth of the stack body's scope, the path of
        the outermost layer called inside that body, which the step index follows)."""
        stacks = []
        for depth, scope in enumerate(self.scopes):
            if scope.stacked:
                root = next(frame.layer for frame in self.frames if frame.depth > depth)
                stacks.append((depth, root))
        return stacks

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

    def _at_steps(self, key: str, name: str, stacks: list, steps: list[dict[int, int]]) -> tuple[str, Any, bool]:
        """A call selected at some steps only: the traced condition, and, for one step,
        the log key with the step (`blocks.1.attn`), registered to be sliced out of
        the stacked logs when the stack's body returns."""
        active = jnp.asarray(False)
        for choice in steps:
            hit = jnp.asarray(True)
            for level, step in choice.items():
                hit = hit & (self.scopes[-1].indices[self._level(stacks[level][0])] == step)
            active = active | hit
        if len(steps) == 1 and len(steps[0]) == len(stacks):
            roots = [root for _, root in stacks]
            step_key = step_path(name, roots, [str(steps[0][level]) for level in range(len(stacks))])
            key = key.replace(name, step_key, 1)
            for level, step in steps[0].items():
                self.scopes[-1].steps.setdefault(key, []).append((stacks[level][0], step))
            return key, active, True
        return key, active, False

    def check_reached(self) -> None:
        """After the call, the closed-world rule: every name and pattern the user gave
        (`layer_names`, `where=` globs, `rename=` keys, `{pattern: hook}` maps) must have
        reached a call. An empty log is never the answer to an explicit selection: a
        typo, a layer used only through another method than `__call__`, or a stack of
        layers run by indexing its arrays (whose steps are new objects) all raise. The
        one exception: a name or pattern that names only layers the model has (listed,
        or reached by an earlier call) none of which ran, or sites inside such layers,
        selects nothing, as the libraries' own interceptors do (`_known_paths.py`)."""
        models = list(self.modules.values())
        _known_paths.remember(models, self.seen)
        known = None  # built on the first name or pattern that reached no call
        selection = self.selection
        given = [
            *(("layer name", name) for name in selection.names or ()),
            *(("where pattern", c) for c in selection.where or () if isinstance(c, str)),
            *(("rename= path", source) for source, _ in selection.renames),
            *(("hook/log map pattern", p) for p in getattr(self.policy, "explicit_patterns", ())),
        ]
        for what, pattern in given:
            regex = glob_to_regex(pattern)
            # A map's pattern acts on selected calls only; the selection's own names and
            # patterns reach a call when it runs (other criteria may then leave it out).
            reached = self.selected if what == "hook/log map pattern" else self.seen
            if pattern in self.step_hits or any(regex.match(path) for path in reached):
                continue
            one_step = what == "hook/log map pattern" and may_name_a_step(pattern)
            if one_step and could_be_step(pattern, list(self.selected)):
                continue
            if known is None:
                known = _known_paths.Known(models, self.seen, self.root)
            if known.names_only_layers_not_run(pattern):
                continue
            called = sorted(p for p in self.seen if p)
            close = difflib.get_close_matches(pattern, called, n=5, cutoff=0.4) or called[:12]
            raise HookError(
                f"{what} {pattern!r} selected no call of the model: no selected layer with a "
                "matching path was called (a layer used only through a method other than "
                "`__call__` is not called itself: its method sites are, `enc.encode`; an "
                "attention layer's `.weights` exists only where it forms its weights with "
                "jax.nn.softmax or Flax's dot_product_attention_weights; a stack of layers run by indexing its arrays "
                "makes new layers that are not the stack's; a number names one step of a "
                f"stack, following the first layer called in its scan/vmap body, e.g. "
                f"`blocks.1.attn`; only a layer the model has that did not run at all is "
                f"no error). Closest layers called: {', '.join(close) or 'none'}"
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

    def carries(self) -> bool:
        """Whether values recorded now leave, and slots arrive, through the traced
        program (`_harvest`) rather than this scope's dicts: the current trace is not
        the scope's (a transform applied before hooking), or the scope is a deferred one."""
        return self.in_foreign_trace() or self.scopes[-1].deferred

    def unthreadable(self) -> str | None:
        """The transform around the code running now that the engine can neither thread
        nor carry values through, if any."""
        if _refused.items:
            return _refused.items[-1]
        if self.in_foreign_jaxpr():
            return transform_name()
        return self.scopes[-1].cached

    def in_foreign_jaxpr(self) -> bool:
        """Whether code running now is traced into a program by a transform the engine
        did not thread (a vmap the engine did not thread is no program: it may carry)."""
        return self.in_foreign_trace() and not isinstance(_jax.current_trace(), _jax.BatchTrace)

    def in_foreign_trace(self) -> bool:
        """Whether code running now is under a transform the engine did not thread."""
        return _jax.trace_state() != self.scopes[-1].trace_state

    def _check_carryable(self, path: str, one_step: bool) -> None:
        """Carried values have no traced index of the unthreaded transforms around them
        and, in a deferred scope, only a provisional call number: hooks that read the
        call site, and one-step selections, are refused there."""
        where = self.unthreadable()
        if where is not None:
            raise TransformError(
                f"cannot hook layer(s) {[path]}: they run under {where}, which "
                f"peex_interop cannot thread values out of (JAX may also replay that trace "
                f"with other hooks). {THREADED} Move that transform outside the hooked "
                "model, or exclude the layer with where=."
            )
        if not self.carries():
            return
        # A pattern that may name a step (`layers.0`) refuses only the calls it selects
        # as a step: as a plain path it selects whole calls, which carry.
        if self.reads_sites or one_step:
            where = transform_name() if self.in_foreign_trace() else "a jax.jit compiled before hooking began"
            raise TransformError(
                f"cannot run the site-aware hooks of layer {path!r} (or select one step of "
                f"its stack): it runs under {where}, whose index and call count the engine "
                "cannot know. Plain hooks and logs work there; move that transform outside "
                "the hooked model, or exclude the layer with where=."
            )

    def _tag_parts(self, key: str, relative: bool = False) -> dict:
        base, suffix = (key[:-3], ":in") if key.endswith(":in") and key[:-3] in self.key_parts else (key, "")
        path, name, count = self.key_parts.get(base, (base.split("@")[0], base, 0))
        if not relative:
            name, count = base, 0
        return {"path": path, "name": name, "count": count, "suffix": suffix, "relative": relative}

    def _index_in_active(self) -> int:
        return next(i for i, c in enumerate(active()) if c is self)

    def record(self, site: Site, key: str, value: Any) -> None:
        if value is None:
            return
        # A log holds its own copy of the structure (the arrays are shared): an
        # `eqx.nn.State` logged at a call is invalidated when a later call updates it.
        value = jtu.tree_map(lambda leaf: leaf, value)
        if self.in_foreign_trace():
            _harvest.sow(self._index_in_active(), self._tag_parts(key), value, transform_name())
            return
        _check_unique(self.scopes[-1].logs, [key], "logs")
        self.scopes[-1].logs[key] = value

    def probe(self, site: Site, template: Any) -> Any:
        """The cotangent slot for this site (a `BackwardHook.log` entry)."""
        if self.carries() or self.scopes[-1].plants:
            return self.slot(site.key, template)
        probes = self.scopes[-1].probes
        if site.key not in probes:
            raise HookError(
                f"BackwardHook has no cotangent slot for layer {site.key!r}: call "
                "`hooked = hooked.init(*args)` with inputs of the shapes you call it "
                f"with (slots it has: {sorted(probes) or 'none'})"
            )
        probe = probes[site.key]
        check_same_shape(site.key, "the BackwardHook.log entry (from .init)", template, probe)
        _check_unique(self.scopes[-1].probed, [site.key], "cotangent slots")
        self.scopes[-1].probed.add(site.key)
        return probe

    def slot(self, key: str, template: Any) -> Any:
        """The slot of log key `key`, shaped like `template`, planted when it cannot be
        read from this scope's dict."""
        if not (self.carries() or self.scopes[-1].plants):
            return self.scopes[-1].probes[key]
        where = transform_name() if self.in_foreign_trace() else "a jax.jit compiled before hooking began"
        # Counted from zero inside a deferred scope: renumbered where it is taken.
        relative = self.scopes[-1].deferred
        return _harvest.plant(self._index_in_active(), self._tag_parts(key, relative), template, where)

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
        if not scope.logs:
            return hooked
        index = self._index_in_active()
        for key, value in scope.logs.items():
            _harvest.sow(index, self._tag_parts(key, relative=True), value, "a jax.jit compiled before hooking began")
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
        parent = self.scopes[-1]
        scope = _Scope(probes, _jax.trace_state(), plants, length=length, index=index)
        scope.cached = self.scopes[-1].cached or cached
        scope.indices = parent.indices if visible is None else tuple(visible)
        scope.lengths = parent.lengths
        if length is not None:
            scope.indices, scope.lengths = (*scope.indices, index), (*scope.lengths, length)
        self._name(scope, outer, inner, length)
        self.scopes.append(scope)

    def name_returned(self, outer: Any, inner: Any) -> None:
        """Name the modules of `inner`, a pytree of `outer`'s structure that the model's
        code rebuilt (`eqx.nn.Shared` returns its layers with the tied arrays put back),
        by position: each is the layer of `outer` at its position."""
        self._name(self.scopes[-1], outer, inner, None)

    def _name(self, scope: "_Scope", outer: Any, inner: Any, length: int | None) -> None:
        outer_nodes, inner_nodes = _positions(outer), _positions(inner)
        if len(outer_nodes) == len(inner_nodes):
            base: tuple[str, ...] = ()
            known: tuple[str, ...] | None = None
            for (position, outer_node), (_, inner_node) in zip(outer_nodes, inner_nodes):
                if known is not None and position[: len(base)] != base:
                    known = None  # left the known module
                if known is None and isinstance(outer_node, eqx.Module):
                    known, base = self._known_path(outer_node), position
                if known is not None:
                    path = known + position[len(base) :]
                    if isinstance(outer_node, eqx.Module):
                        scope.modules[id(inner_node)] = (path, inner_node)
                    elif eqx.is_array(outer_node):
                        scope.leaves[id(inner_node)] = ([path], inner_node, outer_node)
                elif eqx.is_array(outer_node):
                    paths = self._leaf_paths(outer_node)
                    if paths:
                        scope.leaves[id(inner_node)] = (paths, inner_node, outer_node)
                if length is not None and id(inner_node) in scope.leaves and _one_axis_fewer(inner_node, outer_node):
                    scope.stacked = True

    def _known_path(self, module: Any) -> tuple[str, ...] | None:
        for table in (self.modules, *(s.modules for s in reversed(self.scopes))):
            entry = table.get(id(module))
            if entry is not None:
                return entry[0]
        return None

    def origin(self, leaf: Any) -> Any:
        """The model leaf that a body input stands for (through nested bodies)."""
        for scope in reversed(self.scopes):
            entry = scope.leaves.get(id(leaf))
            if entry is not None:
                leaf = entry[2]
        return leaf

    def exit_body(self) -> tuple[dict, set, dict]:
        """Close the innermost body's scope: its logs, the slots it attached, and the
        one-step logs to slice out of stacks (`_Scope.steps`)."""
        scope = self.scopes.pop()
        return scope.logs, scope.probed, scope.steps

    def merge(self, logs: dict, probed: set, steps: dict | None = None) -> None:
        """Bring what a body returned into the current scope: only if the body's
        transform ran in this scope's trace (a threaded transform nested in one that
        is not would otherwise leak its logs' tracers). One-step logs of the stack
        whose body this was (stacked along the leading axis) are sliced to their step."""
        depth = len(self.scopes)
        for key, stack_steps in (steps or {}).items():
            step = next((step for d, step in stack_steps if d == depth), None)
            if step is not None and key in logs:
                logs = {**logs, key: jtu.tree_map(lambda log, step=step: log[step], logs[key])}
            self.scopes[-1].steps[key] = [(d, s) for d, s in stack_steps if d != depth]
        _check_unique(self.scopes[-1].probed, probed, "cotangent slots")
        self.scopes[-1].probed |= probed
        if self.in_foreign_trace():
            # The body's transform ran under one the engine did not thread: the logs
            # leave through the traced program.
            index, where = self._index_in_active(), transform_name()
            for key, value in logs.items():
                _harvest.sow(index, self._tag_parts(key), value, where)
            return
        _check_unique(self.scopes[-1].logs, logs, "logs")
        self.scopes[-1].logs.update(logs)

    @property
    def logs(self) -> dict:
        return self.scopes[0].logs

    @property
    def needs_probes(self) -> bool:
        return not self.discovering and getattr(self.policy, "uses_probes", False)


def _check_unique(taken: Any, keys: Any, what: str) -> None:
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


def _takes_site(fn: Callable) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    # A second parameter with a default is an option (`jnp.max(a, axis=None)`), unless
    # it is called `site`.
    return len(positional) >= 2 and (positional[1].default is inspect.Parameter.empty or positional[1].name == "site")


@functools.cache
def _takes_site_by_type(cls: type) -> bool:
    return _takes_site(functools.partial(cls.__call__, None))  # without `self`


def takes_site(fn: Any) -> bool:
    """Whether a user hook or log takes the call site as a second positional argument
    (`hook(value, site)`); peex's one-argument form does not. A callable may say so
    itself with a `takes_site` attribute (`px.FunctionHook` does, for the function it
    wraps)."""
    declared = getattr(fn, "takes_site", None)
    if isinstance(declared, bool):
        return declared
    if isinstance(fn, eqx.Module):
        return _takes_site_by_type(type(fn))
    return _takes_site(fn)


def needs_indices(fn: Any) -> bool:
    """Whether a user hook or log reads traced indices of the call site (it takes the
    site, unless it says otherwise with a `needs_indices` attribute)."""
    declared = getattr(fn, "needs_indices", None)
    return declared if isinstance(declared, bool) else takes_site(fn)


def call_with_site(fn: Any, value: Any, site: CallSite) -> Any:
    """`fn(value, site)` for a hook or log that takes the call site, `fn(value)`
    otherwise."""
    return fn(value, site) if takes_site(fn) else fn(value)


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


# -- the thread's active contexts ------------------------------------------------------
class ThreadStack(threading.local):
    """A list per thread (`threading.local` runs `__init__` once in each thread)."""

    def __init__(self):
        self.items: list = []


_contexts = ThreadStack()


def active() -> list[HookContext]:
    """Contexts active in this thread, outermost first (other threads never see them)."""
    return _contexts.items


@contextlib.contextmanager
def entered(context: HookContext) -> Iterator[list[HookContext]]:
    """Make `context` active in this thread for the block; yields the active ones."""
    stack = active()
    stack.append(context)
    try:
        yield stack
    finally:
        stack.remove(context)


def name_returned(outer: Any, inner: Any) -> None:
    """Name `inner`'s modules as the layers of `outer` at the same positions, in every
    active context (adapters call it where a library rebuilds layers it returns)."""
    for context in active():
        context.name_returned(outer, inner)


def origin(leaf: Any) -> Any:
    """The leaf of the hooked model that `leaf` stands for: inside a threaded vmap/scan/
    cond/checkpoint body, body inputs are new tracers; outside, a leaf is itself.
    Adapters use it to recognise their own library objects rebuilt inside bodies."""
    for context in reversed(active()):
        found = context.origin(leaf)
        if found is not leaf:
            return found
    return leaf


def call_site(
    owner: Any,
    call: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    *,
    local: tuple[str, ...] = (),
    module: Any = None,
    signature: Callable[..., Any] | None = None,
    member: str | None = None,
    kind: str = METHOD,
) -> Any:
    """Run `call(*args, **kwargs)` as a call site of `owner` (at `local` inside it)
    through every hooking context active in this thread.

    **Arguments:**

    - `owner`: the `eqx.Module` in the hooked pytree that this call belongs to.
    - `call`, `args`, `kwargs`: the layer call itself.
    - `local`: the layer's path inside `owner` (converters); `()` when the owner is
        the layer.
    - `module`: the library's module object, for `where=` types and predicates
        (defaults to `owner`).
    - `signature`: the function whose parameters `args` and `kwargs` fill, where
        `call` takes `(*args, **kwargs)` (defaults to `call`).
    - `member`, `kind`: for a site of the layer other than its call, its name and
        kind: a method (`embedder.attend`, kind `"method"`: `_methods.py`), a value it
        sows (`block.rs_after_attention`, kind `"sown"`). The site is
        `<layer path>.<member>`; one given no array (random keys aside) is none.

    **Returns:**

    The (possibly hooked) result of the call.
    """
    contexts = active()
    # A method given no data computes nothing on data (`init_cache(size, batch)`,
    # `mlp.reverse()`, `cell.initialize_carry(shape, rngs)`): not a site (`_methods.py`).
    if not contexts or (member is not None and not any(map(_is_data, jtu.tree_leaves((args, kwargs))))):
        return call(*args, **kwargs)
    module = owner if module is None else module
    site_kind = None
    if member is not None:
        local, site_kind = (*local, member), kind
    elif not local and module is not owner:
        return _as_root(contexts, owner, module, call, args, kwargs)
    run = call
    # Innermost context first, so its hooks sit closest to the layer.
    for context in reversed(contexts):
        prefix = context.resolve(owner, local)
        if prefix is None:
            continue
        path = join(*prefix, *local)
        run = functools.partial(
            context.run, run, owner, local, path, module, call if signature is None else signature, site_kind
        )
    if run is call and not (contexts[-1].frames and contexts[-1].frames[-1].owner is owner):
        refuse_if_passed_through(type(owner).__name__, owner)
        for context in contexts:
            context.refuse_if_a_step_of_a_stack(owner)
    return run(*args, **kwargs)


def _is_data(leaf: Any) -> bool:
    """An array a method may compute on: not a random key, which seeds what it builds."""
    return eqx.is_array(leaf) and not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _as_root(contexts: list[HookContext], owner: Any, module: Any, call: Callable, args: tuple, kwargs: dict) -> Any:
    """A converted model running its library's root module (`local` empty): the call
    is the converted model's own call site, whose frame takes the module (its class
    and kind), so that sites inside it are told as a layer's (the weights of a model
    that is an attention)."""
    described = []
    for context in contexts:
        frame = context.frames[-1] if context.frames else None
        if frame is not None and frame.owner is owner and frame.local == ():
            context.frames[-1] = frame._replace(module=module, kind=context.native_kind_of(owner, module))
            described.append((context, frame))
    try:
        return call(*args, **kwargs)
    finally:
        for context, frame in described:
            context.frames[-1] = frame


def refuse_if_passed_through(name: str, values: Any) -> None:
    """A layer that no context can name is either not part of the model (built during
    the call: not a layer) or one that an unthreaded transform received as an argument,
    e.g. a `while_loop` carry: its arrays (`values`) are that transform's tracers. The
    second must not run unhooked. Adapters call this where their own naming fails."""
    contexts = active()
    if not contexts:
        return
    context = contexts[-1]
    if not (context.in_foreign_trace() or context.scopes[-1].cached):
        return
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in jtu.tree_leaves(values)):
        return
    where = f" (called from layer {context.frames[-1].path!r})" if context.frames else ""
    raise TransformError(
        f"a {name}{where} runs under {context.unthreadable() or transform_name()}, which received it as an "
        "argument: peex_interop cannot name it or thread its logs out, so it would run "
        f"unhooked. {THREADED} Move that transform outside the hooked model, or pass the "
        "layer in by closure."
    )


def _arrival(trace: Any, tag: Any) -> tuple[HookContext, _Scope] | None:
    """Where a sown or planted value bound at `trace` is taken: the innermost scope of
    the context the tag names, when `trace` is that scope's trace."""
    contexts = active()
    if tag.context >= len(contexts):
        return None
    context = contexts[tag.context]
    scope = context.scopes[-1]
    if scope.trace_state._trace_ref != trace._weakref:  # pyright: ignore[reportAttributeAccessIssue]
        return None
    return context, scope


_harvest._arrival.append(_arrival)


_refused = ThreadStack()


@contextlib.contextmanager
def refusing(transform: str) -> Iterator[None]:
    """Refuse every selected layer called in the block, naming `transform`: one whose
    logs the engine could only give in a layout of JAX's choosing."""
    _refused.items.append(transform)
    try:
        yield
    finally:
        _refused.items.pop()
