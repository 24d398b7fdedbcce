"""A threaded body: one application of a threaded transform, run in fresh scopes.

Every threaded entry point (`_mapped.py`, `_enclosed.py`, `_jits.py`) runs the user's
function as a `Body`: in a new scope of every context active in this thread, returning
the scope's logs as extra outputs, with backward slots passed in as inputs (per
example, step or device in a mapped body, so that cotangents are never summed).
"""

import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._errors import HookError
from . import _context, _shape_pass

# Marks the engine's own traced bodies, which thread their logs as outputs.
_THREADED_BODY = "__peex_interop_threaded_body__"


def real_eval_shape(fun: Callable, *args: Any) -> Any:
    """The engine's own abstract runs: not threaded as a model's `jax.eval_shape`
    would be, and not traced in a deferred scope as a jit compiled before hooking."""
    return real_eval_shapes([fun], *args)[0]


def real_eval_shapes(funs: list[Callable], *args: Any) -> list:
    """Abstract runs of `funs` one after another, as the real pass traces them (a
    cond's branches), as one shape-only pass: the real pass that follows sees the
    libraries' Python state (Haiku's module names, linen's rng counts) as the model
    would without them (`_shape_pass`)."""
    with _shape_pass.shape_only():
        return [_eval_shape(engine_body(fun), *args) for fun in funs]


_eval_shape = jax.eval_shape  # bound at import: the real one


def engine_body(fun: Callable) -> Callable:
    """Mark one of the engine's own traced bodies: it threads its scopes itself."""
    setattr(fun, _THREADED_BODY, True)
    return fun


def is_engine_body(fun: Callable) -> bool:
    """Whether `fun` is one of the engine's own traced bodies (`engine_body`)."""
    return getattr(fun, _THREADED_BODY, False)


class Body:
    """One application of a threaded transform: runs `fn` as the transform's body in a
    fresh scope of every context active in this thread, and returns the scopes' logs.

    JAX caches traced functions, so a body may outlive its transform call: `release`
    drops every reference to contexts and outer values (tracers) when the call ends.
    """

    def __init__(self, fn: Callable, outer: Any):
        self.fn = fn
        self.outer = outer
        self.contexts = list(_context.active())
        # Counts restart from here each time JAX traces the body, so a retrace does
        # not shift `path@n` keys.
        self.start = [dict(c.counts) for c in self.contexts]
        self.end = self.start
        # Where the enclosing scope's slots cannot be passed in (they are planted, see
        # `_harvest`), an unmapped body plants its own.
        self.plants = [c.scopes.plants() for c in self.contexts]
        # Applied inside a program traced by a transform the engine does not thread (a
        # while_loop body), which JAX may cache: its layers are refused.
        self.cached = [c.scopes.unthreadable() for c in self.contexts]
        self.probed: list[set] = [set() for _ in self.contexts]
        self.steps: list[dict] = [{} for _ in self.contexts]
        # Whether the body ran a stack of layers (model arrays mapped in), per context.
        self.stacked = [False for _ in self.contexts]
        self.static: list[dict] = [{} for _ in self.contexts]
        # A mapped body reads its index only for hooks that use it (it costs an input
        # or an axis name); statistics may need the axis name alone.
        self.needs_indices = any(c.needs_indices for c in self.contexts)
        self.needs_names = self.needs_indices or any(c.needs_axis_names for c in self.contexts)

    def __call__(
        self, probes: list, inner: Any, args: tuple, kwargs: dict, index: Any = None, length: int | None = None,
        visible: list | None = None, plants: list | None = None,
    ):
        """Run the body; `length`: a mapped body's size, `index`: its traced index
        (`None` where no hook needs it);
        `visible`: an enclosed body's inputs standing for the enclosing indices."""
        visible = visible or [None] * len(self.contexts)
        plants = plants or [False] * len(self.contexts)
        for context, counts, probe, planted, seen, cached in zip(
            self.contexts, self.start, probes, plants, visible, self.cached
        ):
            context.counts = dict(counts)
            context.enter_body(self.outer, inner, probe, index, length, seen, planted, cached)
        assert self.fn is not None, "a released body ran again"
        try:
            out = self.fn(*args, **kwargs)
        finally:
            self.stacked = [context.scopes[-1].stacked for context in self.contexts]
            exits = [context.scopes.close() for context in self.contexts]
        # Leaves of logs that are not arrays (a name, a flag) cannot be outputs of a
        # transform: they stay here, the same for every example and step.
        split = [_split_static(log) for log, _, _ in exits]
        logs = [dynamic for dynamic, _ in split]
        self.static = [static for _, static in split]
        self.probed = [probed for _, probed, _ in exits]
        self.steps = [steps for _, _, steps in exits]
        self.end = [dict(c.counts) for c in self.contexts]
        return out, logs

    def no_probes(self) -> list:
        return [{} for _ in self.contexts]

    def enclosing(self) -> tuple[list, list]:
        """The enclosing scopes' backward slots and visible step indices, passed into
        cond/checkpoint/jit bodies as inputs: a body closing over them would leave
        them (tracers of the enclosing trace) in JAX's trace caches after the call."""
        indices = [context.scopes[-1].indices for context in self.contexts]
        if not any(context.needs_probes for context in self.contexts):
            return self.no_probes(), indices
        return [{} if plants else c.scopes[-1].probes for c, plants in zip(self.contexts, self.plants)], indices

    def enclosed(self, carried: tuple[list, list], inner: Any, args: tuple, kwargs: dict):
        """Run an enclosed body given what `enclosing` returned, as its input."""
        probes, visible = carried
        return self(probes, inner, args, kwargs, visible=visible, plants=self.plants)

    def probes(self, run: Callable[[list], Any], logs_of: Callable[[Any], list], length: int | None) -> list:
        """Per context, the backward slots of the layers that run inside the body,
        found by one abstract run in which backward contexts record slot templates (a
        shape-only pass: the real run then names modules and draws keys as unhooked).
        The slot of one step of this body's stack (`blocks.1.attn`) has no step axis:
        it is spread over the `length` steps, and its gradient sums theirs (zeros but
        at its step)."""
        if not any(context.needs_probes for context in self.contexts):
            return self.no_probes()
        saved = [(c.discovering, dict(c.counts)) for c in self.contexts]
        for context in self.contexts:
            context.discovering = True
        try:
            found = logs_of(real_eval_shape(run, self.no_probes()))
        finally:
            for context, (flag, counts) in zip(self.contexts, saved):
                context.discovering, context.counts = flag, counts
        probes = []
        for context, keys, steps in zip(self.contexts, found, self.steps):
            if not context.needs_probes:
                probes.append({})
                continue
            depth = len(context.scopes)  # the body's scope, once entered
            one_step = {key for key, at in steps.items() if any(d == depth for d, _ in at)}
            if context.scopes.plants():
                # Planted, one per layer, through the transforms around this one.
                probes.append({
                    key: _spread(context.scopes.slot(key, _one_step_of(keys[key])), length) if key in one_step
                    else context.scopes.slot(key, keys[key])
                    for key in keys
                })
                continue
            slots = context.scopes[-1].probes
            missing = sorted(set(keys) - set(slots))
            if missing:
                raise HookError(
                    f"BackwardHook has no cotangent slot for layers {missing} (inside a "
                    "vmap/scan body): call `hooked = hooked.init(*args)` with inputs of "
                    "the shapes you call it with"
                )
            probes.append({key: _spread(slots[key], length) if key in one_step else slots[key] for key in keys})
        return probes

    def run_mapped(self, run: Callable[[list], Any], logs_of: Callable[[Any], list], length: int | None) -> Any:
        """Run a mapped transform (`run(probes)`) whose body slots are per
        example/step/device (`length` of them), bring its logs out, and release the
        body."""
        try:
            probes = self.probes(run, logs_of, length)
            result = run(probes)
            self.finish(logs_of(result))
        finally:
            self.release()
        return result

    def run_enclosed(self, run: Callable[[tuple[list, list]], tuple[Any, list]]) -> Any:
        """Run an unmapped transform (`run(carried) -> (out, logs)`: checkpoint, jit)
        with the enclosing scope's slots and indices, bring its logs out, and release
        the body."""
        try:
            out, logs = run(self.enclosing())
            self.finish(logs)
        finally:
            self.release()
        return out

    def finish(
        self, logs: list, end: list | None = None, probed: list | None = None, steps: list | None = None,
        static: list | None = None,
    ) -> None:
        for context, counts, log, slots, one_step, kept in zip(
            self.contexts, end or self.end, logs, probed or self.probed, steps or self.steps, static or self.static
        ):
            context.counts = counts
            log = {key: eqx.combine(value, kept[key]) if key in kept else value for key, value in log.items()}
            context.scopes.merge(log, slots, one_step)

    def release(self) -> None:
        self.fn = self.outer = None
        self.contexts = []


def _split_static(logs: dict) -> tuple[dict, dict]:
    """`logs` without the entries' leaves that no transform can return (strings, other
    Python objects), and those leaves: kept by the body, the same for every example."""
    dynamic, static = {}, {}
    for key, log in logs.items():
        if any(not _returnable(leaf) for leaf in jtu.tree_leaves(log)):
            dynamic[key], static[key] = eqx.partition(log, _returnable)
        else:
            dynamic[key] = log
    return dynamic, static


def _returnable(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, jax.core.Tracer, np.ndarray, np.generic, bool, int, float, complex))


def _one_step_of(template: Any) -> Any:
    return jtu.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), template)


def _spread(slot: Any, length: int | None) -> Any:
    """A slot of one step, as the slots of every step of a stack: its gradient, the
    sum of theirs."""
    assert length is not None, "a one-step slot outside a stack's body"
    return jtu.tree_map(lambda leaf: jnp.broadcast_to(leaf, (length, *jnp.shape(leaf))), slot)


def shift(numbers: Any) -> Any:
    """The probes argument goes first: non-negative argument numbers move by one
    (negative ones count from the end and stay)."""
    if numbers is None:
        return None
    if isinstance(numbers, int):
        numbers = (numbers,)
    return tuple(n + 1 if n >= 0 else n for n in numbers)


def probes_first(fun: Callable, body: Callable) -> Callable:
    # jit and checkpoint map static_argnames to positions through the signature.
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):
        return body
    probes = inspect.Parameter("__peex_interop_probes", inspect.Parameter.POSITIONAL_ONLY)
    body.__signature__ = signature.replace(parameters=[probes, *signature.parameters.values()])
    return body
