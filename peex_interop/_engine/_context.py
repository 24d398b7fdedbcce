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
import jax.extend.core as jex_core
import jax.numpy as jnp
import jax.tree_util as jtu

from ._errors import HookError, TransformError
from ._kinds import layer_kind
from ._paths import join, walk
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

    selection: Selection

    def run_site(self, context: "HookContext", site: Site) -> Any: ...


@dataclasses.dataclass
class _Scope:
    """Recording state of one traced body: the hooked call itself, or a vmap/scan/cond/
    checkpoint body inside it. Values recorded in a body leave it as the body's outputs."""

    probes: dict
    trace_state: Any
    logs: dict = dataclasses.field(default_factory=dict)
    # Body inputs are new tracers: map them to the model leaves they stand for, so layers
    # rebuilt from them (e.g. `eqx.combine` in a scan over a layer stack) are recognised.
    leaves: dict = dataclasses.field(default_factory=dict)
    modules: dict = dataclasses.field(default_factory=dict)


def _trace_state() -> Any:
    return jex_core.get_opaque_trace_state()


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
    """One hooked call of one wrapper: its path index, call stack, counts and scopes."""

    def __init__(
        self, root: Any, policy: Policy, probes: dict | None, discovering: bool
    ):
        self.policy = policy
        # Read once: the wrappers build their selection from static fields on access.
        self.selection = policy.selection
        self.renames = self.selection.rename
        self.discovering = discovering
        self.modules: dict[int, tuple[tuple[str, ...], Any]] = {}
        self.leaves: dict[int, tuple[tuple[str, ...], Any]] = {}
        for path, node in walk(root):
            # Only arrays identify layers: ints, functions etc. are shared objects.
            if isinstance(node, eqx.Module):
                table = self.modules
            elif eqx.is_array(node):
                table = self.leaves
            else:
                continue
            # An object stored twice is named by its first path.
            table.setdefault(id(node), (path, node))
        self.frames: list[tuple[Any, tuple[str, ...]]] = []
        self.counts: dict[str, int] = {}
        self.scopes = [_Scope({} if probes is None else probes, _trace_state())]

    @property
    def module_types(self) -> set[type]:
        return {type(node) for _, node in self.modules.values()}

    # -- paths ---------------------------------------------------------------------
    def _leaf_path(self, leaf: Any) -> tuple[str, ...] | None:
        for table in (self.leaves, *(s.leaves for s in reversed(self.scopes))):
            entry = table.get(id(leaf))
            if entry is not None:
                return entry[0]
        return None

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
        # A module rebuilt inside a body holds the body's input tracers: its path is the
        # path of the model leaf behind its first known leaf, minus that leaf's own
        # path inside the module.
        for relative, leaf in walk(owner):
            if isinstance(leaf, eqx.Module) or not relative:
                continue
            found = self._leaf_path(leaf)
            if found is None or found[-len(relative) :] != relative:
                continue
            path = found[: -len(relative)]
            table = self.scopes[-1].modules
            for sub_path, node in walk(owner, path):
                if isinstance(node, eqx.Module):
                    table.setdefault(id(node), (sub_path, node))
            return path
        return None

    # -- running a call site ----------------------------------------------------------
    def run(self, call, owner, local, path, module, *args, **kwargs):
        self.frames.append((owner, local))
        try:
            kind = layer_kind(owner, module)
            if not self.selection.selects(path, module, kind):
                return call(*args, **kwargs)
            count = self.counts.get(path, 0)
            self.counts[path] = count + 1
            name = self.renames.get(path, path)
            key = name if count == 0 else f"{name}@{count}"
            return self.policy.run_site(self, Site(path, key, owner, module, kind, call, args, kwargs))
        finally:
            self.frames.pop()

    def apply(self, site: Site, role: str, fn: Any, value: Any) -> Any:
        """Run a user hook or log, attaching the layer path to anything it raises."""
        try:
            return fn(value)
        except Exception as error:
            error.add_note(f"peex_interop: raised by {role} at layer {site.path!r}")
            raise

    def apply_hook(self, site: Site, role: str, hook: Any, value: Any) -> Any:
        out = self.apply(site, role, hook, value)
        check_same_shape(site.path, role, value, out)
        return out

    def _check_trace(self, site: Site, doing: str) -> None:
        if _trace_state() != self.scopes[-1].trace_state:
            raise TransformError(
                f"cannot {doing} of layer {site.path!r}: it runs under "
                f"{_transform_name()}, which peex_interop cannot thread the value out "
                "of (it would leak a tracer). Threaded transforms: jax.vmap, "
                "eqx.filter_vmap, jax.lax.scan, jax.lax.cond, jax.checkpoint, "
                "jax.remat, eqx.filter_checkpoint. Move that transform outside the "
                "hooked model, or exclude the layer with where=."
            )

    def record(self, site: Site, key: str, value: Any) -> None:
        if value is None:
            return
        self._check_trace(site, "record the log")
        self.scopes[-1].logs[key] = value

    def probe(self, site: Site, template: Any) -> Any:
        """The cotangent slot for this site (a `BackwardHook.log` entry)."""
        self._check_trace(site, "attach the backward log")
        probes = self.scopes[-1].probes
        if site.key not in probes:
            raise HookError(
                f"BackwardHook has no cotangent slot for layer {site.key!r}: call "
                "`hooked = hooked.init(*args)` with inputs of the shapes you call it "
                f"with (slots it has: {sorted(probes) or 'none'})"
            )
        probe = probes[site.key]
        check_same_shape(site.key, "the BackwardHook.log entry (from .init)", template, probe)
        return probe

    # -- transformed bodies -------------------------------------------------------------
    def enter_body(self, outer: Any, inner: Any, probes: dict) -> None:
        scope = _Scope(probes, _trace_state())
        outer_leaves, inner_leaves = jtu.tree_leaves(outer), jtu.tree_leaves(inner)
        if len(outer_leaves) == len(inner_leaves):
            for outer_leaf, inner_leaf in zip(outer_leaves, inner_leaves):
                found = self._leaf_path(outer_leaf)
                if found is not None:
                    scope.leaves[id(inner_leaf)] = (found, inner_leaf, outer_leaf)
        self.scopes.append(scope)

    def origin(self, leaf: Any) -> Any:
        """The model leaf that a body input stands for (through nested bodies)."""
        for scope in reversed(self.scopes):
            entry = scope.leaves.get(id(leaf))
            if entry is not None:
                leaf = entry[2]
        return leaf

    def exit_body(self) -> dict:
        return self.scopes.pop().logs

    def merge(self, logs: dict) -> None:
        """Bring logs returned by a body into the current scope."""
        self.scopes[-1].logs.update(logs)

    @property
    def logs(self) -> dict:
        return self.scopes[0].logs

    @property
    def needs_probes(self) -> bool:
        return not self.discovering and getattr(self.policy, "uses_probes", False)


def _spec(x: Any) -> Any:
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or hasattr(x, "aval"):
        return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"
    return type(x).__name__


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
        if eqx.is_array(a) or isinstance(a, jax.ShapeDtypeStruct):
            if not hasattr(b, "shape") or a.shape != b.shape or a.dtype != b.dtype:
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
def entered(context: HookContext) -> Iterator[HookContext]:
    stack = active()
    stack.append(context)
    try:
        yield context
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
    return run(*args, **kwargs)
