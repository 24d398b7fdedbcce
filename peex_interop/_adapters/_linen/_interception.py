"""Where a linen submodule call becomes a call site: one hooked call of a `LinenModule`.

While a hooking context is active in the calling thread, the model's call runs
`module.apply` inside `nn.intercept_methods`, and the interceptor hands every selected
method call of every submodule to `_context.call_site`, named by the submodule's scope
path (`Dense_0`, `blocks_0.attn`). Linen names a module by its scope, not by object
identity, so modules that linen's lifted transforms (`nn.scan`, `nn.vmap`, `nn.remat`)
clone inside their bodies keep their names; the engine threads the bodies' logs out,
stacked.

`nn.scan` traces its body once *outside* `jax.lax.scan` to check which variables are
loop invariants (`flax.core.axes_scan`'s constancy check) and throws that trace away.
For the duration of a hooked call `axes_scan.scan` is replaced by a version that runs
that pre-pass with the interceptor passing calls through, so that only the scan proper
records logs.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
from flax.core import axes_scan
from flax.linen import (
    attention as linen_attention,  # its `dot_product_attention_weights`
    module as linen_module,  # its `_context`: the modules being called
)

from ..._engine import (
    ORIGINAL,
    AbstractConverted,
    ThreadStack,
    active,
    call_site,
    patched,
    register_shape_pass_save,
    register_weights_function,
    silenced,
    site_methods,
    snapshot_containers,
    sown_patches,
)
from ._variables import Path

# Linen's `dot_product_attention` (the default `attention_fn` of
# `MultiHeadDotProductAttention` and `SelfAttention`, decode mode included), and models
# that write their own attention (Hugging Face's), form the weights `(..., heads, q, k)`
# with `dot_product_attention_weights`, dropout included: that call is the attention
# layer's `.weights` site.
register_weights_function(linen_attention.dot_product_attention_weights)


def _save_linen_state() -> Callable[[], None]:
    """What a trace of linen code advances in the modules being called in this thread,
    for the engine's shape-only passes (`_engine/_shape_pass.py`):

    - their scopes' rng counts: `make_rng` folds a scope's count into its key and counts
        on; a child scope's counts hang in its parent's dict, and the scope of a lifted
        body (`nn.scan`, `nn.vmap`) shares its parent's, so each extra trace of a body
        would give the real run other dropout masks;
    - the names they gave: a submodule created in a `jax.vmap` body is named by its
        parent's cursor (`Dense_0`, then `Dense_1`), registered among its children and
        reserved in its scope.
    """
    calls = [
        (module, module.scope) for module in linen_module._context.module_stack  # pyright: ignore[reportPrivateUsage]
        if module is not None and module.scope is not None
    ]
    held: dict[int, Any] = {}
    counts = [scope.rng_counters for _, scope in calls]
    while counts:
        tree = counts.pop()
        if id(tree) not in held:
            held[id(tree)] = tree
            counts.extend(child for child in tree.values() if isinstance(child, dict))
    names = []
    for module, scope in calls:
        state = module._state  # pyright: ignore[reportPrivateUsage]
        # Leaving a lifted transform rebinds the cursor (`reimport`): bind it back too.
        names.append((state, state.autoname_cursor, state.children))
        reservations = scope.reservations
        for container in (state.autoname_cursor, state.children, reservations, *reservations.values()):
            held[id(container)] = container
    restore_containers = snapshot_containers(held.values())

    def restore() -> None:
        restore_containers()
        for state, cursor, children in names:
            state.autoname_cursor, state.children = cursor, children

    return restore


register_shape_pass_save(_save_linen_state)

# The hooked `LinenModule` calls running in this thread, innermost last.
_intercepting = ThreadStack()
# The `nn.map_variables` wrappers whose modules are running in this thread (class names).
mapping_in_thread = ThreadStack()


def intercepted(owner: AbstractConverted, methods: tuple[str, ...] | None, apply: Callable[[], Any]) -> Any:
    """Run `apply` (a call of `owner`'s `module.apply`, a `LinenModule`) with every
    selected submodule call a call site of `owner`: a call of one of `methods` (every
    `__call__` and site method when `None`)."""
    state = _Interception(owner, methods)
    patches = [
        (axes_scan, "scan", _scan_with_silent_prepass),
        (nn.Module, "apply", _nested_apply),
        *sown_patches(nn.Module, _locate),
    ]
    with patched(patches), nn.intercept_methods(state.intercept):
        _intercepting.items.append(state)
        try:
            return apply()
        finally:
            _intercepting.items.pop()


@dataclasses.dataclass(eq=False)
class _Interception:
    """One hooked call of one `LinenModule`: its interceptor."""

    owner: AbstractConverted
    methods: tuple[str, ...] | None
    # The modules whose hooked methods are running (the root's included), outermost
    # first, with the paths their calls got.
    running: list[tuple[nn.Module, Path]] = dataclasses.field(default_factory=list)
    # The paths of the modules `nn.map_variables` wrappers run, with the wrappers' class
    # names: their variables are mapped before they use them.
    mapped: dict[Path, str] = dataclasses.field(default_factory=dict)
    # Where the modules of the `apply` calls running inside the model sit in it
    # (`self.lm_head.apply(...)`: `("lm_head",)`), innermost last.
    applied: list[Path] = dataclasses.field(default_factory=list)

    def place(self, module: nn.Module) -> Path:
        """Where a module `apply`-ed during the call sits in the model: a bound
        submodule (`self.lm_head`, tied weights applied with their own variables) at its
        own path; one built during the call under the layer running, by its name."""
        if module.scope is not None:
            return (*(self.applied[-1] if self.applied else ()), *(str(part) for part in module.path))
        name = module.name if isinstance(module.name, str) else type(module).__name__
        return (*(self.running[-1][1] if self.running else ()), name)

    def intercept(self, next_f: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
        module = context.module
        # Lifted-transform wrappers run under other method names; nn.scan's pre-pass is
        # not a call.
        if not self._is_site(module, context.method_name) or silenced.items:
            if _maps_variables(module):
                # It runs the module it wraps (a clone, under its own name) afterwards;
                # wrapping the root, every module.
                prefix = (*self.running[-1][1], str(module.name)) if self.running else ()
                self.mapped[prefix] = type(module).__name__
            return next_f(*args, **kwargs)
        local = self.path_of(module)
        wrappers = [name for prefix, name in self.mapped.items() if local[: len(prefix)] == prefix]
        self.running.append((module, local))
        mapping_in_thread.items.extend(wrappers)
        try:
            method = None if context.method_name == "__call__" else context.method_name
            return call_site(self.owner, next_f, args, kwargs, local=local, module=module, member=method)
        finally:
            del mapping_in_thread.items[len(mapping_in_thread.items) - len(wrappers):]
            self.running.pop()

    def _is_site(self, module: nn.Module, method: str) -> bool:
        if self.methods is not None:
            return method in self.methods
        return method == "__call__" or method in site_methods(type(module), nn.Module)

    def path_of(self, module: nn.Module) -> Path:
        """The module's scope path; but a module given the scope of one whose call it
        runs inside (`nn.share_scope`: a LoRA wrapper and its base, a child sharing its
        parent's parameters) is named under that one's path by its own name, as its
        own layer: one path for both would make it the same layer, its call unlogged.
        (The clones linen's lifted transforms call have scopes of their own.) Inside a
        nested `apply`, scope paths start from the applied module's place."""
        path = (*(self.applied[-1] if self.applied else ()), *(str(part) for part in module.path))
        for outer, outer_path in reversed(self.running):
            if outer.scope is module.scope and outer is not module:
                return (*outer_path, str(module.name))
        return path


def _maps_variables(module: nn.Module) -> bool:
    # `nn.map_variables(Dense, ...)` is a class linen's lifted transforms name after
    # the transform and the class: `Map_variablesDense`.
    return type(module).__module__ == nn.transforms.__name__ and type(module).__name__.startswith("Map_variables")


def _locate(module: nn.Module) -> tuple[AbstractConverted, Path] | None:
    """The converted model and path of a module sowing during this thread's hooked
    call (`_engine/_sown.py`), or `None` (outside one, or in `nn.scan`'s pre-pass)."""
    if not _intercepting.items or silenced.items or not active():
        return None
    state = _intercepting.items[-1]
    return state.owner, state.path_of(module)


def _nested_apply(original: Callable) -> Callable:
    """`nn.Module.apply` while hooking: a module applied with its own variables inside
    the model's call (HF's tied LM head, `self.lm_head.apply({"params": ...}, h)`) runs
    on a scope of its own whose path is empty, as if it were the model itself. Its
    calls are named from where the module sits in the model instead."""

    def apply(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = _intercepting.items[-1] if _intercepting.items else None
        if state is None or not state.running:
            return original(self, *args, **kwargs)
        state.applied.append(state.place(self))
        try:
            return original(self, *args, **kwargs)
        finally:
            state.applied.pop()

    return apply


def _scan_with_silent_prepass(original: Callable) -> Callable:
    def scan(fn: Callable, *args: Any, check_constancy_invariants: bool = True, **kwargs: Any):
        if not check_constancy_invariants:
            return original(fn, *args, check_constancy_invariants=False, **kwargs)
        # With the constancy check, axes_scan traces the body once before it calls
        # jax.lax.scan: that first trace is the pre-pass.
        pending = [True]

        def body(*body_args: Any) -> Any:
            if not pending:
                return fn(*body_args)
            pending.clear()
            silenced.items.append(True)
            try:
                return fn(*body_args)
            finally:
                silenced.items.pop()

        scan_fn = original(body, *args, check_constancy_invariants=True, **kwargs)

        def scanned(*call_args: Any) -> Any:
            pending[:] = [True]
            return scan_fn(*call_args)

        return scanned

    setattr(scan, ORIGINAL, original)
    return scan
