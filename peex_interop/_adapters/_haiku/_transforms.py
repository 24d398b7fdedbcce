"""How one hooked call names the modules of the Haiku transforms (`hk.lift`,
`layer_stack`) run inside the model's own."""

from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
from haiku._src import base as hk_base  # the frames: Haiku's per-transform Python state
from haiku._src.lift import LiftingModule  # the plumbing of hk.lift and layer_stack

from ..._engine import BatchTracer, origin, site_methods
from ..._errors import HookError
from ._names import haiku_path, is_internal, params_path


class Transforms:
    """How one call names the modules of the Haiku transforms run inside the model's
    own. Haiku names the modules of an inner transform as if it were the whole model
    (`mlp/~/linear_0`), while the model keeps the params that `hk.lift` (or
    `layer_stack`, `hk.transparent_lift`) gave that transform under the lift
    (`lifted/mlp/~/linear_0`): such modules are named by the lift that gave out the
    params they run on, or `lifted.mlp.linear_0` and the model's own `mlp.linear_0`
    would be one path."""

    def __init__(self, depth: int):
        self.depth = depth  # the model's own transform: its place in Haiku's context stack
        # The lifts called so far: (path, keys of the params and state given out, ids of
        # the model arrays among them), and those arrays, held so that no id is reused.
        self.lifts: list[tuple[tuple[str, ...], set[str], set[int]]] = []
        self.held: list[Any] = []
        self.lifting = 0  # lift calls running: at init they run the lifted init function

    def local(self, methods: tuple[str, ...] | None, context: Any) -> tuple[str, ...] | None:
        """The path of the module of a layer call (or method site), or None for a call
        that is not one."""
        module, method = context.module, context.method_name
        # Interceptors also see `__init__` (module_name not yet set), every public
        # method, and Haiku's internal modules: only site methods (`methods`, if given)
        # of user modules are calls. Calls inside a lift's call make params, not the
        # model's output.
        if methods is None:
            wanted = method == "__call__" or method in site_methods(type(module), hk.Module)
        else:
            wanted = method in methods
        if not wanted or isinstance(module, LiftingModule) or self.lifting or is_internal(module.module_name):
            return None
        return (*self._prefix(module), *haiku_path(module.module_name))

    def run(self, context: Any, next_f: Callable, args: tuple, kwargs: dict) -> Any:
        """Run a call that is not a layer call; the params and state a lift gives out
        are remembered, to name the modules that run on them."""
        module = context.module
        if not isinstance(module, LiftingModule) or context.method_name != "__call__" or self.lifting:
            return next_f(*args, **kwargs)
        self.lifting += 1
        try:
            out = next_f(*args, **kwargs)
        finally:
            self.lifting -= 1
        params, state = out
        arrays = [_array(leaf) for leaf in jax.tree.leaves(out)]
        self.held.extend(arrays)
        path = (*self._prefix(module), *params_path(module.prefix_name))
        self.lifts.append((path, {*params, *state}, set(map(id, arrays))))
        return out

    def _prefix(self, module: hk.Module) -> tuple[str, ...]:
        """The path of the transform `module` runs in: `()` for the model's own."""
        if len(hk_base.context_stack) <= self.depth:
            return ()
        frame = hk_base.current_frame()
        own = {**module.params_dict(), **module.state_dict()}
        # A module without params of its own runs on its transform's.
        keys = {name.rpartition("/")[0] for name in own} or {*frame.params, *(frame.state or {})}
        arrays = list(own.values()) or jax.tree.leaves(frame.params)
        lifts = [(path, ids) for path, given, ids in self.lifts if keys and keys <= given]
        paths = {path for path, _ in lifts}
        if len(paths) > 1:
            # The same names given out by two lifts: the arrays tell which.
            found = {id(_array(leaf)) for leaf in arrays}
            paths = {path for path, ids in lifts if ids & found}
        if len(paths) != 1:
            given = "no hk.lift of this call gave out" if not lifts else "several hk.lift calls gave out"
            raise HookError(
                f"the Haiku module {module.module_name!r} runs in an inner hk.transform on params that {given}: "
                "its path in the model is unknown, so it can be neither selected nor skipped; give the inner "
                "apply the params its hk.lift returns, unchanged"
            )
        return paths.pop()


def _array(leaf: Any) -> Any:
    """The array of the call that `leaf` stands for: the model's own, through the bodies
    the engine threads, and a batch tracer's value (a vmap the engine does not thread,
    as in `haiku_names`, maps its inputs along axis 0 into tracers holding them)."""
    leaf = origin(leaf)
    while isinstance(leaf, BatchTracer):
        leaf = leaf.val
    return leaf
