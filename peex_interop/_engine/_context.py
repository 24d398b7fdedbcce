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
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import equinox as eqx
import jax
import jax.core
import jax.extend.core as jex_core
import jax.numpy as jnp
import jax.tree_util as jtu

from ._errors import HookError, TransformError
from ._paths import AbstractConverted, join, walk
from ._selection import Selection


@dataclasses.dataclass(frozen=True)
class Site:
    """One selected call of one layer, as a policy sees it."""

    path: str
    key: str
    owner: Any
    module: Any
    kind: str
    call: Callable[..., Any]
    args: tuple
    kwargs: dict


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
    # The body's transform was applied under a transform the engine does not thread
    # (a vmap inside a while_loop): nothing recorded in it can leave.
    foreign: bool = False
    logs: dict = dataclasses.field(default_factory=dict)
    # Keys of the backward slots attached in this body (and the bodies inside it).
    probed: set = dataclasses.field(default_factory=set)
    # Body inputs are new tracers: map them to the model leaves they stand for, so layers
    # rebuilt from them (e.g. `eqx.combine` in a scan over a layer stack) are recognised.
    # id(inner leaf) -> (paths of the model leaf, inner leaf, outer leaf)
    leaves: dict = dataclasses.field(default_factory=dict)
    modules: dict = dataclasses.field(default_factory=dict)


def _trace_state() -> Any:
    return jex_core.get_opaque_trace_state()


THREADED = (
    "Threaded transforms: jax.vmap, eqx.filter_vmap, jax.lax.scan, jax.lax.map, "
    "jax.lax.fori_loop with static bounds, jax.lax.cond, jax.lax.switch, jax.jit and "
    "eqx.filter_jit (also created inside the model), jax.checkpoint/remat, "
    "eqx.filter_checkpoint, jax.shard_map."
)


def _transform_name() -> str:
    # Private JAX API, used only to make an error message precise.
    try:
        from jax._src import core

        trace = core.trace_ctx.trace
        if type(trace).__name__ == "BatchTrace":
            return "jax.vmap (a reference to vmap taken before hooking began)"
        info = trace.frame.debug_info
        return f"a '{info.traced_for}' transform of {info.func_name!r}"
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
        self.renames = self.selection.rename
        self.discovering = discovering
        self.root = root
        if not self._index(root):
            self.root = jtu.tree_unflatten(*reversed(jtu.tree_flatten(root)))
            self._index(self.root)
        self.frames: list[tuple[Any, tuple[str, ...], str]] = []
        self.counts: dict[str, int] = {}
        self.claims: dict[str, str] = {}
        self.scopes = [_Scope({} if probes is None else probes, _trace_state())]

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
        for table in (self.leaves, *(s.leaves for s in reversed(self.scopes))):
            entry = table.get(id(leaf))
            if entry is not None:
                return entry[0]
        return []

    def resolve(self, owner: Any, local: tuple[str, ...]) -> tuple[str, ...] | None:
        """The owner's path, or None if it is not part of this context's model, or if
        this is the owner re-entering its own call (`super().__call__`)."""
        if self.frames and self.frames[-1][0] is owner and self.frames[-1][1] == local:
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

    # -- running a call site ----------------------------------------------------------
    def run(
        self, call: Callable[..., Any], owner: Any, local: tuple[str, ...], path: str, module: Any, *args, **kwargs
    ) -> Any:
        self.frames.append((owner, local, path))
        try:
            # Converted models know their library's classes; the rest are Equinox's.
            converted = isinstance(owner, AbstractConverted) and owner is not module
            kind = owner.layer_kind(module) if converted else self.native_kind(module)
            if not self.selection.selects(path, module, kind):
                return call(*args, **kwargs)
            # Edits too: a trace made under an unthreaded transform may be cached by
            # JAX (a jit or loop body defined before hooking) and replayed by a later
            # hooked call with other hooks.
            if self.observes_values:
                self._admit([path], "hook the call")
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
            return self.policy.run_site(self, Site(path, key, owner, module, kind, call, args, kwargs))
        finally:
            self.frames.pop()

    def apply(self, site: Site, role: str, fn: Any, value: Any) -> Any:
        """Run a user hook or log, attaching the layer path to anything it raises
        (KeyboardInterrupt included)."""
        try:
            return fn(value)
        except BaseException as error:
            error.add_note(f"peex_interop: raised by {role} at layer {site.path!r}")
            raise

    def apply_hook(self, site: Site, role: str, hook: Any, value: Any) -> Any:
        out = self.apply(site, role, hook, value)
        check_same_shape(site.path, role, value, out)
        return out

    def _admit(self, keys: Any, doing: str) -> None:
        """The closed-world rule: a value enters a scope only from that scope's own
        trace. Anything else would leak a tracer (or, for a backward slot, sum
        cotangents over steps), so it is refused, naming the layers."""
        if self.in_foreign_trace():
            raise TransformError(
                f"cannot {doing} of layer(s) {sorted(keys)}: they run under "
                f"{_transform_name()}, which peex_interop cannot thread the value out "
                f"of (it would leak a tracer). {THREADED} Move that transform outside "
                "the hooked model, or exclude the layer with where=."
            )

    def in_foreign_trace(self) -> bool:
        """Whether code running now is under a transform the engine does not thread."""
        return _trace_state() != self.scopes[-1].trace_state or self.scopes[-1].foreign

    def record(self, site: Site, key: str, value: Any) -> None:
        if value is None:
            return
        self._admit([site.path], "record the log")
        self.scopes[-1].logs[key] = value

    def probe(self, site: Site, template: Any) -> Any:
        """The cotangent slot for this site (a `BackwardHook.log` entry)."""
        self._admit([site.path], "attach the backward log")
        probes = self.scopes[-1].probes
        if site.key not in probes:
            raise HookError(
                f"BackwardHook has no cotangent slot for layer {site.key!r}: call "
                "`hooked = hooked.init(*args)` with inputs of the shapes you call it "
                f"with (slots it has: {sorted(probes) or 'none'})"
            )
        probe = probes[site.key]
        check_same_shape(site.key, "the BackwardHook.log entry (from .init)", template, probe)
        self.scopes[-1].probed.add(site.key)
        return probe

    # -- transformed bodies -------------------------------------------------------------
    def enter_body(self, outer: Any, inner: Any, probes: dict, foreign: bool) -> None:
        """Open the scope of a body whose inputs `inner` stand for `outer`: a known
        module passed in names its inner counterpart (and everything under it) by
        position, so one layer object at two paths stays two layers; other array
        inputs are named by the model paths of the arrays they stand for."""
        scope = _Scope(probes, _trace_state(), foreign)
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
        self.scopes.append(scope)

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

    def exit_body(self) -> tuple[dict, set]:
        """Close the innermost body's scope: its logs and the slots it attached."""
        scope = self.scopes.pop()
        return scope.logs, scope.probed

    def merge(self, logs: dict, probed: set) -> None:
        """Bring what a body returned into the current scope: only if the body's
        transform ran in this scope's trace (a threaded transform nested in one that
        is not would otherwise leak its logs' tracers)."""
        if logs or probed:
            self._admit({key.split("@")[0] for key in (*logs, *probed)}, "bring out the logs")
        self.scopes[-1].logs.update(logs)
        self.scopes[-1].probed |= probed

    @property
    def logs(self) -> dict:
        return self.scopes[0].logs

    @property
    def needs_probes(self) -> bool:
        return not self.discovering and getattr(self.policy, "uses_probes", False)


def _positions(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
    """Every module (pre-order) and leaf of `tree`, with its key path: two trees of one
    structure give the same positions."""
    nodes = []
    for key_path, top in jtu.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, eqx.Module))[0]:
        prefix = tuple(str(k) for k in key_path)
        nodes.extend((prefix + relative, node) for relative, node in walk(top))
    return nodes


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

    **Returns:**

    The (possibly hooked) result of the call.
    """
    contexts = active()
    if not contexts:
        return call(*args, **kwargs)
    module = owner if module is None else module
    run = call
    # Innermost context first, so its hooks sit closest to the layer.
    for context in reversed(contexts):
        prefix = context.resolve(owner, local)
        if prefix is None:
            continue
        path = join(*prefix, *local)
        run = functools.partial(context.run, run, owner, local, path, module)
    if run is call and not (contexts[-1].frames and contexts[-1].frames[-1][0] is owner):
        refuse_if_passed_through(type(owner).__name__, owner)
    return run(*args, **kwargs)


def refuse_if_passed_through(name: str, values: Any) -> None:
    """A layer that no context can name is either not part of the model (built during
    the call: not a layer) or one that an unthreaded transform received as an argument,
    e.g. a `jax.jit` function created before hooking began, or a `while_loop` carry:
    its arrays (`values`) are that transform's tracers. The second must not run
    unhooked. Adapters call this where their own naming fails."""
    contexts = active()
    if not contexts:
        return
    context = contexts[-1]
    if not context.in_foreign_trace():
        return
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in jtu.tree_leaves(values)):
        return
    where = f" (called from layer {context.frames[-1][2]!r})" if context.frames else ""
    raise TransformError(
        f"a {name}{where} runs under {_transform_name()}, which received it as an "
        "argument: peex_interop cannot name it or thread its logs out, so it would run "
        f"unhooked. {THREADED} A jax.jit function created before hooking began (at "
        "import or class definition) is not: create it inside the model's call, use "
        "eqx.filter_jit, or move it outside the hooked model."
    )
