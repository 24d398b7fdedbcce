"""Threading logs out of the JAX transforms a model applies *inside* itself.

A value recorded into Python from inside a `jax.vmap`/`jax.lax.scan`/... body would leak
a tracer. While a hooking context is active in this thread, the public entry points
below are replaced by versions that run the body in a fresh scope and return the scope's
logs as extra outputs of the body: stacked along the mapped/scanned axis for vmap, scan,
`lax.map` and static `fori_loop`, one block per device for `shard_map`, as plain outputs
for cond, switch, checkpoint and jit. Backward-log slots of layers inside a mapped body
are passed in as mapped inputs, so cotangents are per example/step rather than summed.

Arguments are bound against the real entry point's signature, so keyword and positional
calling conventions behave exactly as JAX's own. The entry points are replaced in the
closure cell behind them, so every Python reference reaches them; a jit compiled before
hooking is traced in a deferred scope, and a vmap applied before hooking carries its
values through the traced program (`_harvest`). What neither reaches (`while_loop`,
dynamic `fori_loop`, ...) is refused (`HookContext.unthreadable`).
"""

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from . import _arrivals, _context, _harvest, _jax, _patching, _pooling, _shape_pass, _shapes, _threads, _unthreaded
from ._errors import HookError


def _real_eval_shape(fun: Callable, *args: Any) -> Any:
    """The engine's own abstract runs: not threaded as a model's `jax.eval_shape`
    would be, and not traced in a deferred scope as a jit compiled before hooking."""
    return _real_eval_shapes([fun], *args)[0]


def _real_eval_shapes(funs: list[Callable], *args: Any) -> list:
    """Abstract runs of `funs` one after another, as the real pass traces them (a
    cond's branches), as one shape-only pass: the real pass that follows sees the
    libraries' Python state (Haiku's module names, linen's rng counts) as the model
    would without them (`_shape_pass`)."""
    with _shape_pass.shape_only():
        return [_eval_shape(_engine_body(fun), *args) for fun in funs]


_eval_shape = jax.eval_shape  # bound at import: the real one


def _engine_body(fun: Callable) -> Callable:
    """Mark one of the engine's own traced bodies: it threads its scopes itself."""
    setattr(fun, _THREADED_BODY, True)
    return fun


class _Body:
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
        self.plants = [c.carries() or c.scopes[-1].plants for c in self.contexts]
        # Applied inside a program traced by a transform the engine does not thread (a
        # while_loop body), which JAX may cache: its layers are refused.
        self.cached = [c.unthreadable() for c in self.contexts]
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
            exits = [context.exit_body() for context in self.contexts]
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
            found = logs_of(_real_eval_shape(run, self.no_probes()))
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
            if context.carries() or context.scopes[-1].plants:
                # Planted, one per layer, through the transforms around this one.
                probes.append({
                    key: _spread(context.slot(key, _one_step_of(keys[key])), length) if key in one_step
                    else context.slot(key, keys[key])
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
            context.merge(log, slots, one_step)

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


@functools.cache
def _signature(fn: Callable) -> inspect.Signature:
    return inspect.signature(_patching.unwrap(fn))


def _bind(real: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a call of `real`, by parameter name, as JAX binds them."""
    return dict(_signature(real).bind(*args, **kwargs).arguments)


def _engine_axis_name() -> str:
    """An axis name for a vmap the user left unnamed: one per nesting depth of the
    named vmaps being traced, so that nested ones differ and each call of the model
    gets the same names (a fresh name would recompile every collective and retrace
    every jit inside, eager or not)."""
    return f"peex_interop_vmap_{len(_pooling.mapped_axes())}"


def _mapped_size(in_axes: Any, args: tuple, kwargs: dict, axis_size: int | None) -> int:
    """The size of a vmap's mapped axis, as JAX reads it from the arguments."""
    if axis_size is not None:
        return axis_size
    sizes = []

    def visit(axis: Any, tree: Any) -> None:
        if axis is not None:
            # A leaf without that axis is for the real vmap to refuse, in its own words.
            sizes.extend(
                jnp.shape(leaf)[axis] for leaf in jtu.tree_leaves(tree) if -jnp.ndim(leaf) <= axis < jnp.ndim(leaf)
            )

    per_arg = in_axes if isinstance(in_axes, (tuple, list)) else [in_axes] * len(args)
    for axis, arg in zip(per_arg, args):
        jtu.tree_map(visit, axis, arg, is_leaf=lambda x: x is None)
    for arg in kwargs.values():
        visit(0, arg)
    return sizes[0] if sizes else 0


def _with_leading_axis(in_axes: Any, num_args: int) -> Any:
    if isinstance(in_axes, (tuple, list)):
        return (0, *in_axes)
    return (0, *([in_axes] * num_args))


def threaded_vmap(real_vmap: Callable) -> Callable:
    def vmap(*vmap_args, **vmap_kwargs):
        options = _bind(real_vmap, vmap_args, vmap_kwargs)
        fun = options.pop("fun")
        in_axes = options.pop("in_axes", 0)
        out_axes = options.pop("out_axes", 0)

        def mapped(*args, **kwargs):
            # An in_axes tuple not one per positional argument is JAX's to refuse, in its
            # own words (which differ by release), not about the engine's extra argument.
            mismatched = isinstance(in_axes, (tuple, list)) and len(in_axes) != len(args)
            if not _context.active() or mismatched:
                return real_vmap(fun, in_axes, out_axes, **options)(*args, **kwargs)
            body = _Body(fun, (args, kwargs))
            length = _mapped_size(in_axes, args, kwargs, options.get("axis_size"))
            named = options
            if body.needs_names:
                # The index is read through an axis name (the user's, or one of ours).
                # Only then: a new axis name makes JAX retrace every jit inside.
                named = {**options, "axis_name": options.get("axis_name") or _engine_axis_name()}

            def run(probes):
                def mapped_body(probes, *inner_args, **inner_kwargs):
                    name = named.get("axis_name")
                    index = jax.lax.axis_index(name) if body.needs_indices else None
                    return body(probes, (inner_args, inner_kwargs), inner_args, inner_kwargs, index, length)

                axes = _with_leading_axis(in_axes, len(args))
                return _pooling.pooled_vmap(real_vmap, body)(mapped_body, axes, (out_axes, 0), **named)(
                    probes, *args, **kwargs
                )

            return body.run_mapped(run, lambda result: result[1], length)[0]

        return mapped

    return vmap


def threaded_scan(real_scan: Callable) -> Callable:
    def scan(*scan_args, **scan_kwargs):
        if not _context.active():
            return real_scan(*scan_args, **scan_kwargs)
        options = _bind(real_scan, scan_args, scan_kwargs)
        f, init, xs = options.pop("f"), options.pop("init"), options.pop("xs", None)
        body = _Body(f, (init, xs))
        length = options.get("length")
        if length is None:
            leaves = jtu.tree_leaves(xs)
            if not leaves:
                return real_scan(*scan_args, **scan_kwargs)  # JAX's own error: no length
            length = leaves[0].shape[0]
        steps = jnp.arange(length, dtype=jnp.int32) if body.needs_indices else None

        def run(probes):
            def scan_body(carry, x_probes_step):
                x, step_probes, step = x_probes_step
                (carry, y), logs = body(step_probes, (carry, x), (carry, x), {}, step, length)
                return carry, (y, logs)

            return real_scan(scan_body, init, (xs, probes, steps), **options)

        carry, (ys, _) = body.run_mapped(run, lambda result: result[1][1], length)
        return carry, ys

    return scan


def threaded_map(real_map: Callable) -> Callable:
    def map(*map_args, **map_kwargs):
        options = _bind(real_map, map_args, map_kwargs)
        if not _context.active():
            return real_map(*map_args, **map_kwargs)
        if options.get("batch_size") is not None:
            # JAX's own scan-of-vmap plus a remainder: logs would be laid out by
            # batches, not per element; layers inside are refused.
            with _unthreaded.refusing("jax.lax.map with batch_size"):
                return real_map(*map_args, **map_kwargs)
        f = options["f"]
        # JAX's own definition of map without batch_size; logs stack per element.
        _, ys = jax.lax.scan(lambda carry, x: (carry, f(x)), (), options["xs"])
        return ys

    return map


def threaded_fori_loop(real_fori_loop: Callable) -> Callable:
    def fori_loop(*loop_args, **loop_kwargs):
        options = _bind(real_fori_loop, loop_args, loop_kwargs)
        lower, upper = options["lower"], options["upper"]
        if not _context.active() or any(isinstance(b, jax.core.Tracer) for b in (lower, upper)):
            # Dynamic bounds make a while_loop, whose logs cannot leave: refused.
            return real_fori_loop(*loop_args, **loop_kwargs)
        body_fun, unroll = options["body_fun"], options.get("unroll")

        # JAX's own lowering of a static-bound fori_loop; logs stack per step.
        def scanned(carry, _):
            i, x = carry
            return (i + 1, body_fun(i, x)), None

        (_, result), _ = jax.lax.scan(
            scanned, (int(lower), options["init_val"]), None,
            length=max(int(upper) - int(lower), 0),
            unroll=False if unroll is None else unroll,
        )
        return result

    return fori_loop


def _branches(fns: list, operands: tuple, select: Callable) -> Any:
    """cond/switch: each branch is a body; the branches' logs are padded to one
    structure (a layer that only some branches call logs zeros in the others)."""
    bodies = [_Body(fn, operands) for fn in fns]

    def branch(body: _Body, union: list | None) -> Callable:
        def run(carried, *inner):
            out, logs = body.enclosed(carried, inner, inner, {})
            if union is not None:
                logs = [
                    {key: log.get(key, zeros) for key, zeros in _shapes.zeros_like(u).items()}
                    for log, u in zip(logs, union)
                ]
            return out, logs

        return run

    carried = bodies[0].enclosing()
    try:
        # In one pass: the real cond traces its branches in turn, and the second sees the
        # names the first gave (two default-named Haiku modules: `linear`, `linear_1`).
        runs = [branch(body, None) for body in bodies]
        shapes = [logs for _, logs in _real_eval_shapes(runs, carried, *operands)]
        union = [
            {key: value for branch_logs in per_context for key, value in branch_logs.items()}
            for per_context in zip(*shapes)
        ]
        out, logs = select([branch(body, union) for body in bodies], carried, *operands)
        end = [
            {path: max(counts.get(path, 0) for counts in per_context) for path in set().union(*per_context)}
            for per_context in zip(*(body.end for body in bodies))
        ]
        probed = [set().union(*per_context) for per_context in zip(*(body.probed for body in bodies))]
        steps = [{k: v for branch_steps in per_context for k, v in branch_steps.items()}
                 for per_context in zip(*(body.steps for body in bodies))]
        static = [{k: v for branch_static in per_context for k, v in branch_static.items()}
                  for per_context in zip(*(body.static for body in bodies))]
        bodies[0].finish(logs, end, probed, steps, static)
    finally:
        for body in bodies:
            body.release()
    return out


def _operands(options: dict) -> tuple:
    operands = options.get("operands", ())
    if "operand" in options:
        operands = (*operands, options["operand"])
    return operands


def threaded_cond(real_cond: Callable) -> Callable:
    def cond(*cond_args, **cond_kwargs):
        options = _bind(real_cond, cond_args, cond_kwargs)
        true_fun, false_fun = options.get("true_fun"), options.get("false_fun")
        if not _context.active() or not (callable(true_fun) and callable(false_fun)):
            return real_cond(*cond_args, **cond_kwargs)
        pred = options["pred"]
        return _branches(
            [true_fun, false_fun], _operands(options),
            lambda branches, *operands: real_cond(pred, *branches, *operands),
        )

    return cond


def threaded_switch(real_switch: Callable) -> Callable:
    def switch(*switch_args, **switch_kwargs):
        if not _context.active():
            return real_switch(*switch_args, **switch_kwargs)
        options = _bind(real_switch, switch_args, switch_kwargs)
        index = options["index"]
        return _branches(
            list(options["branches"]), _operands(options),
            lambda branches, *operands: real_switch(index, branches, *operands),
        )

    return switch


def _shift(numbers: Any) -> Any:
    """The probes argument goes first: non-negative argument numbers move by one
    (negative ones count from the end and stay)."""
    if numbers is None:
        return None
    if isinstance(numbers, int):
        numbers = (numbers,)
    return tuple(n + 1 if n >= 0 else n for n in numbers)


def _probes_first(fun: Callable, body: Callable) -> Callable:
    # jit and checkpoint map static_argnames to positions through the signature.
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):
        return body
    probes = inspect.Parameter("__peex_interop_probes", inspect.Parameter.POSITIONAL_ONLY)
    body.__signature__ = signature.replace(parameters=[probes, *signature.parameters.values()])
    return body


def threaded_checkpoint(real_checkpoint: Callable) -> Callable:
    def checkpoint(*checkpoint_args, **checkpoint_kwargs):
        options = _bind(real_checkpoint, checkpoint_args, checkpoint_kwargs)
        fun = options.pop("fun")
        shifted = {**options, "static_argnums": _shift(options.get("static_argnums", ()))}

        def checkpointed(*args, **kwargs):
            if not _context.active():
                return real_checkpoint(fun, **options)(*args, **kwargs)
            body = _Body(fun, (args, kwargs))

            def checkpointed_body(carried, *inner_args, **inner_kwargs):
                return body.enclosed(carried, (inner_args, inner_kwargs), inner_args, inner_kwargs)

            def run(carried):
                return real_checkpoint(_probes_first(fun, checkpointed_body), **shifted)(carried, *args, **kwargs)

            return body.run_enclosed(run)

        return checkpointed

    return checkpoint


def _jit_call(real_jit: Callable, fun: Callable, options: dict, args: tuple, kwargs: dict, *, filtered: bool) -> Any:
    """Run `fun(*args, **kwargs)` under a fresh `real_jit` whose outputs carry the logs.

    `filtered` follows `eqx.filter_jit`: arrays are traced, everything else is static.
    Outputs are split the same way, so a body may return non-arrays. Shardings and
    donation are left out (they place values, never change them)."""
    body = _Body(fun, (args, kwargs))
    static_out = []

    def jitted_body(carried, *inner_args, **inner_kwargs):
        if filtered:
            (inner_args, inner_kwargs) = eqx.combine(inner_args[0], static_in)
        out_and_logs = body.enclosed(carried, (inner_args, inner_kwargs), inner_args, inner_kwargs)
        dynamic, static = eqx.partition(out_and_logs, eqx.is_array)
        static_out.append(static)
        return dynamic

    _engine_body(jitted_body)

    if filtered:
        dynamic_in, static_in = eqx.partition((args, kwargs), eqx.is_array)
        jitted = real_jit(jitted_body)
        call_args, call_kwargs = (dynamic_in,), {}
    else:
        kept = {
            name: value for name, value in options.items()
            if name in ("static_argnames", "keep_unused", "inline", "compiler_options", "backend", "device")
        }
        jitted = real_jit(
            _probes_first(fun, jitted_body), static_argnums=_shift(options.get("static_argnums")), **kept
        )
        call_args, call_kwargs = args, kwargs
    return body.run_enclosed(lambda carried: eqx.combine(jitted(carried, *call_args, **call_kwargs), static_out[-1]))


class _ThreadedJit:
    """What the patched `jax.jit` returns: a jitted function that threads logs out when
    called with hooking active in the calling thread, and is the real one otherwise
    (its attributes, e.g. `.lower`, are the real one's)."""

    def __init__(self, real_jit: Callable, fun: Callable, options: dict):
        self._real_jit, self._fun, self._options = real_jit, fun, options
        self.__wrapped__ = fun

    @functools.cached_property
    def _jitted(self) -> Callable:
        return self._real_jit(self._fun, **self._options)

    def __call__(self, *args, **kwargs):
        if not _context.active():
            return self._jitted(*args, **kwargs)
        return _jit_call(self._real_jit, self._fun, self._options, args, kwargs, filtered=False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jitted, name)


def threaded_eval_shape(real_eval_shape: Callable) -> Callable:
    """`jax.eval_shape` inside the model (NNX's `fori_loop` runs its body this way
    first): the body runs in a scope of its own whose logs are dropped, since no value
    leaves an abstract evaluation, and whose calls do not count as calls."""

    def eval_shape(*shape_args, **shape_kwargs):
        if not _context.active():
            return real_eval_shape(*shape_args, **shape_kwargs)
        options = _bind(real_eval_shape, shape_args, shape_kwargs)
        fun, args, kwargs = options["fun"], options.get("args", ()), options.get("kwargs", {})
        body = _Body(fun, (args, kwargs))

        def shaped(*inner_args, **inner_kwargs):
            return body(body.no_probes(), (inner_args, inner_kwargs), inner_args, inner_kwargs)[0]

        # Backward slots are not needed either: contexts only discover, as in `.init`.
        flags = [context.discovering for context in body.contexts]
        for context in body.contexts:
            context.discovering = True
        try:
            return real_eval_shape(_engine_body(shaped), *args, **kwargs)
        finally:
            for context, counts, flag in zip(body.contexts, body.start, flags):
                context.counts, context.discovering = counts, flag
            body.release()

    return eval_shape


def threaded_jit(real_jit: Callable) -> Callable:
    def jit(*jit_args, **jit_kwargs):
        options = _bind(real_jit, jit_args, jit_kwargs)
        fun = options.pop("fun", None)
        if fun is None or not callable(fun):
            return functools.partial(jit, **options)  # used as `@jax.jit(static_argnums=...)`
        return _ThreadedJit(real_jit, fun, options)

    return jit


def threaded_filter_jit_call(original_call: Callable) -> Callable:
    """`eqx.filter_jit` wrappers are usually created before hooking begins (decorated
    methods): their call is patched instead of `eqx.filter_jit` itself."""
    real_jit = _patching.entry_point(jax.jit)

    def __call__(self, /, *args, **kwargs):
        if not _context.active():
            return original_call(self, *args, **kwargs)
        return _jit_call(real_jit, self.__wrapped__, {}, args, kwargs, filtered=True)

    return __call__


def threaded_shard_map(real_shard_map: Callable) -> Callable:
    """Logs leave a `shard_map` body one block per device: a leading axis over the
    body's manual mesh axes (`(num_devices, *local_shape)`); backward slots come in
    the same way, so cotangents are per device."""

    def shard_map(*shard_args, **shard_kwargs):
        options = _bind(real_shard_map, shard_args, shard_kwargs)
        f = options.pop("f", None)
        if f is None:
            return functools.partial(shard_map, **options)  # used as a decorator factory

        def sharded(*args):
            if not _context.active() or options.get("_smap"):
                return real_shard_map(f, **options)(*args)
            mesh = options.get("mesh") or jax.sharding.get_abstract_mesh()
            per_device = jax.sharding.PartitionSpec(tuple(options.get("axis_names") or mesh.axis_names))
            in_specs = options.get("in_specs", _signature(real_shard_map).parameters["in_specs"].default)
            if not isinstance(in_specs, tuple):
                in_specs = (in_specs,) * len(args)
            body = _Body(f, args)

            def run(probes):
                def sharded_body(probes, *inner):
                    local = jtu.tree_map(lambda slot: slot[0], probes)
                    out, logs = body(local, inner, inner, {})
                    return out, jtu.tree_map(lambda log: log[None], logs)

                if isinstance(mesh, jax.sharding.Mesh):
                    # Eager inputs must already be laid out as their in_specs say.
                    probes = jax.device_put(probes, jax.sharding.NamedSharding(mesh, per_device))
                return real_shard_map(
                    sharded_body,
                    **{**options, "in_specs": (per_device, *in_specs), "out_specs": (options["out_specs"], per_device)},
                )(probes, *args)

            # Not a stack: no slot of one step to spread over the devices.
            return body.run_mapped(run, lambda result: result[1], None)[0]

        return sharded

    return shard_map


def _deferring_infer_params(real_infer_params: Callable) -> Callable:
    """A `jax.jit` function created before hooking began (decorated at import, or
    already compiled) traces its body through JAX's `pjit._infer_params`, whose cache
    may replay a trace made in an earlier hooked call. Its body runs in a deferred
    scope (`HookContext.enter_deferred`): layers are named through its arguments,
    calls count from zero, and logs leave through the traced program (`_harvest`)."""

    def infer_params(fun, jit_info, args, kwargs):
        contexts = _context.active()
        if not contexts or getattr(fun, _THREADED_BODY, False):
            return real_infer_params(fun, jit_info, args, kwargs)
        # Where the jit is called: what its body stands for, and whether it runs inside a
        # transform that can neither be threaded nor carried through (a while_loop).
        _jit_arguments.items.append(((args, kwargs), [context.unthreadable() for context in contexts]))
        try:
            inferred = real_infer_params(_deferred_body(fun), jit_info, args, kwargs)
        finally:
            _jit_arguments.items.pop()
        if fun in _hooked_inside:
            _harvest.hooked_programs.add(_jax.jit_traced_program(inferred))
        return inferred

    return infer_params


def _no_fast_path(real_get_fastpath_data: Callable) -> Callable:
    """A jit called eagerly while hooking whose trace ran a selected layer gets no entry
    in JAX's C++ dispatch cache: a later hooked call with other hooks would run this
    call's program without reaching Python (`_infer_params`), silently replaying its
    edits and dropping its logs. Its compiled program is still cached, keyed on its
    trace; jits that run no selected layer (`jnp`'s own) keep their fast path."""

    def get_fastpath_data(executable, *args, **kwargs):
        if executable is not None and executable in _harvest.hooked_executables:
            return None
        return real_get_fastpath_data(executable, *args, **kwargs)

    return get_fastpath_data

# Marks the engine's own jit bodies, which thread their logs as outputs.
_THREADED_BODY = "__peex_interop_threaded_body__"
# The outer arguments of the jit calls being traced in this thread (innermost last).
_jit_arguments = _threads.ThreadStack()
_deferred_bodies: "weakref.WeakKeyDictionary[Any, Callable]" = weakref.WeakKeyDictionary()


def _deferred_body(fun: Callable) -> Callable:
    """The function that `jax.jit` traces in place of `fun` while hooking.

    One wrapper per function, so that JAX's trace cache (keyed on it) still serves
    functions that call no selected layer (`jnp`'s own jits). A function that did call
    one gets a new wrapper in each hooked call: its trace holds that call's hooks
    (which may close over its values), never to be replayed in another."""
    if fun in _hooked_inside:
        # Shape-only runs (slot discovery) trace other programs than the real run.
        key = (fun, tuple(context.discovering for context in _context.active()))
        per_call = _context.active()[0].deferred_bodies
        if key not in per_call:
            per_call[key] = _make_deferred(fun)
        return per_call[key]
    try:
        return _deferred_bodies[fun]
    except (KeyError, TypeError):
        pass
    deferred = _make_deferred(fun)
    if _weakrefable(fun):
        _deferred_bodies[fun] = deferred
    return deferred


_hooked_inside: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _make_deferred(fun: Callable) -> Callable:
    reference = weakref.ref(fun) if _weakrefable(fun) else (lambda: fun)

    @functools.wraps(fun)
    def deferred(*args, **kwargs):
        function = reference()
        assert function is not None, "a jitted function was collected while traced"
        contexts = list(_context.active())
        outer, cached = _jit_arguments.items[-1] if _jit_arguments.items else ((args, kwargs), [None] * len(contexts))
        for context, where in zip(contexts, cached):
            context.enter_deferred(outer, (args, kwargs), where)
        hooked = False
        try:
            return function(*args, **kwargs)
        finally:
            for context in reversed(contexts):
                hooked = context.exit_deferred() or hooked
            if hooked and _weakrefable(function):
                _hooked_inside.add(function)
                # Its shared wrapper's trace holds that call's hooks (and may close over
                # its tracers): let JAX's cache entry for it go.
                _deferred_bodies.pop(function, None)

    # No strong reference back to `fun`: the wrapper is the value of a weak-keyed cache.
    del deferred.__wrapped__
    return deferred


def _weakrefable(fun: Any) -> bool:
    try:
        weakref.ref(fun)
    except TypeError:
        return False
    return True


def transform_patches() -> list[tuple[Any, str, Callable]]:
    """Patch targets for `_patching.patched`: JAX's transform entry points, replaced in
    the cell that holds the function behind them (so every reference is reached: `from
    jax import vmap`, `import jax.lax as L`, `functools.partial(jax.vmap, ...)`), the
    jit trace entry of functions jitted before hooking, and the primitives that carry
    values through the transforms applied before hooking (`_harvest`)."""
    cell = _patching.WRAPPED_FUNCTION
    return [
        (jax.vmap, cell, threaded_vmap),
        (jax.lax.scan, cell, threaded_scan),
        (jax.lax.map, cell, threaded_map),
        (jax.lax.fori_loop, cell, threaded_fori_loop),
        (jax.lax.cond, cell, threaded_cond),
        (jax.lax.switch, cell, threaded_switch),
        (jax.checkpoint, cell, threaded_checkpoint),
        # `jax.jit` and `jax.eval_shape` by attribute only: JAX itself calls them by
        # other references (every eager primitive runs through a `jit`); a jit reached
        # by another reference is traced in a deferred scope instead.
        (jax, "jit", threaded_jit),
        (jax, "eval_shape", threaded_eval_shape),
        # `jax.shard_map` calls the module's `_shard_map` however it was reached.
        (*_jax.SHARD_MAP, threaded_shard_map),
        (*_jax.FILTER_JIT_CALL, threaded_filter_jit_call),
        (*_jax.JIT_INFER_PARAMS, _deferring_infer_params),
        (*_jax.JIT_FAST_PATH, _no_fast_path),
        *_harvest.primitive_patches(),
        *_arrivals.arrival_patches(),
    ]
