"""Threading logs out of the JAX transforms a model applies *inside* itself.

A value recorded into Python from inside a `jax.vmap`/`jax.lax.scan`/... body would leak
a tracer. While a hooking context is active in this thread, the public entry points
below are replaced by versions that run the body in a fresh scope and return the scope's
logs as extra outputs of the body: stacked along the mapped/scanned axis for vmap and
scan, as plain outputs for cond and checkpoint. Backward-log slots of layers inside a
vmap/scan body are passed in as mapped inputs, so cotangents are per example/step rather
than summed. Everything else is left to `HookContext._check_trace`, which refuses loudly.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _context, _patching
from ._errors import HookError


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

    def __call__(self, probes: list, inner: Any, args: tuple, kwargs: dict):
        for context, counts, probe in zip(self.contexts, self.start, probes):
            context.counts = dict(counts)
            context.enter_body(self.outer, inner, probe)
        try:
            out = self.fn(*args, **kwargs)
        finally:
            logs = [context.exit_body() for context in self.contexts]
        self.end = [dict(c.counts) for c in self.contexts]
        return out, logs

    def no_probes(self) -> list:
        return [{} for _ in self.contexts]

    def enclosing_probes(self) -> list:
        # Passed into cond/checkpoint bodies as inputs: a body closing over them
        # would leave them in JAX's trace caches after the call.
        return [context.scopes[-1].probes for context in self.contexts]

    def probes(self, run: Callable[[list], Any], logs_of: Callable[[Any], list]) -> list:
        """Per context, the backward slots of the layers that run inside the body,
        found by one abstract run in which backward contexts record slot templates."""
        if not any(context.needs_probes for context in self.contexts):
            return self.no_probes()
        saved = [(c.discovering, dict(c.counts)) for c in self.contexts]
        for context in self.contexts:
            context.discovering = True
        try:
            found = logs_of(jax.eval_shape(run, self.no_probes()))
        finally:
            for context, (flag, counts) in zip(self.contexts, saved):
                context.discovering, context.counts = flag, counts
        probes = []
        for context, keys in zip(self.contexts, found):
            if not context.needs_probes:
                probes.append({})
                continue
            slots = context.scopes[-1].probes
            missing = sorted(set(keys) - set(slots))
            if missing:
                raise HookError(
                    f"BackwardHook has no cotangent slot for layers {missing} (inside a "
                    "vmap/scan body): call `hooked = hooked.init(*args)` with inputs of "
                    "the shapes you call it with"
                )
            probes.append({key: slots[key] for key in keys})
        return probes

    def finish(self, logs: list, end: list | None = None) -> None:
        for context, counts, log in zip(self.contexts, end or self.end, logs):
            context.counts = counts
            context.merge(log)

    def release(self) -> None:
        self.fn = self.outer = None
        self.contexts = []


def _with_leading_axis(in_axes: Any, num_args: int) -> Any:
    if isinstance(in_axes, (tuple, list)):
        return (0, *in_axes)
    return (0, *([in_axes] * num_args))


def threaded_vmap(real_vmap: Callable) -> Callable:
    def vmap(fun, in_axes=0, out_axes=0, *rest, **options):
        def mapped(*args, **kwargs):
            if not _context.active():
                return real_vmap(fun, in_axes, out_axes, *rest, **options)(*args, **kwargs)
            body = _Body(fun, (args, kwargs))

            def run(probes):
                def mapped_body(probes, *inner_args, **inner_kwargs):
                    return body(probes, (inner_args, inner_kwargs), inner_args, inner_kwargs)

                axes = _with_leading_axis(in_axes, len(args))
                return real_vmap(mapped_body, axes, (out_axes, 0), *rest, **options)(
                    probes, *args, **kwargs
                )

            try:
                out, logs = run(body.probes(run, lambda shapes: shapes[1]))
                body.finish(logs)
            finally:
                body.release()
            return out

        return mapped

    return vmap


def threaded_scan(real_scan: Callable) -> Callable:
    def scan(f, init, xs=None, *rest, **options):
        if not _context.active():
            return real_scan(f, init, xs, *rest, **options)
        body = _Body(f, (init, xs))

        def run(probes):
            def scan_body(carry, x_and_probes):
                x, step_probes = x_and_probes
                (carry, y), logs = body(step_probes, (carry, x), (carry, x), {})
                return carry, (y, logs)

            return real_scan(scan_body, init, (xs, probes), *rest, **options)

        try:
            carry, (ys, logs) = run(body.probes(run, lambda shapes: shapes[1][1]))
            body.finish(logs)
        finally:
            body.release()
        return carry, ys

    return scan


def _zeros(shapes: Any) -> Any:
    return jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def threaded_cond(real_cond: Callable) -> Callable:
    def cond(pred, true_fun, false_fun, *operands, **options):
        if not _context.active() or not (callable(true_fun) and callable(false_fun)):
            return real_cond(pred, true_fun, false_fun, *operands, **options)
        bodies = [_Body(fn, operands) for fn in (true_fun, false_fun)]

        def branch(body: _Body, union: list | None) -> Callable:
            def run(probes, *inner):
                out, logs = body(probes, inner, inner, {})
                if union is not None:
                    # Both branches must return the same structure: a layer that only
                    # one branch calls logs zeros when the other branch is taken.
                    logs = [
                        {key: log.get(key, zeros) for key, zeros in _zeros(u).items()}
                        for log, u in zip(logs, union)
                    ]
                return out, logs

            return run

        probes = bodies[0].enclosing_probes()
        try:
            true_logs, false_logs = (
                jax.eval_shape(branch(body, None), probes, *operands)[1] for body in bodies
            )
            union = [{**a, **b} for a, b in zip(true_logs, false_logs)]
            out, logs = real_cond(
                pred, *(branch(body, union) for body in bodies), probes, *operands, **options
            )
            end = [
                {path: max(a.get(path, 0), b.get(path, 0)) for path in {*a, *b}}
                for a, b in zip(bodies[0].end, bodies[1].end)
            ]
            bodies[0].finish(logs, end)
        finally:
            for body in bodies:
                body.release()
        return out

    return cond


def _shift_static(options: dict) -> dict:
    """The probes argument goes first: static argument numbers move by one."""
    numbers = options.get("static_argnums", ())
    if isinstance(numbers, int):
        numbers = (numbers,)
    return {**options, "static_argnums": tuple(n + 1 for n in numbers)}


def threaded_checkpoint(real_checkpoint: Callable) -> Callable:
    def checkpoint(fun, *rest, **options):
        def checkpointed(*args, **kwargs):
            if not _context.active():
                return real_checkpoint(fun, *rest, **options)(*args, **kwargs)
            body = _Body(fun, (args, kwargs))

            def checkpointed_body(probes, *inner_args, **inner_kwargs):
                return body(probes, (inner_args, inner_kwargs), inner_args, inner_kwargs)

            try:
                out, logs = real_checkpoint(checkpointed_body, *rest, **_shift_static(options))(
                    body.enclosing_probes(), *args, **kwargs
                )
                body.finish(logs)
            finally:
                body.release()
            return out

        return checkpointed

    return checkpoint


def transform_patches() -> list[tuple[Any, str, Callable]]:
    """Patch targets for `_patching.patched`: the public entry points whose bodies the
    engine threads logs out of."""
    return [
        (jax, "vmap", _marked(threaded_vmap)),
        (jax.lax, "scan", _marked(threaded_scan)),
        (jax.lax, "cond", _marked(threaded_cond)),
        (jax, "checkpoint", _marked(threaded_checkpoint)),
        (jax, "remat", _marked(threaded_checkpoint)),
    ]


def _marked(make: Callable) -> Callable:
    def install(original: Callable) -> Callable:
        replacement = make(original)
        setattr(replacement, _patching.ORIGINAL, original)
        return replacement

    return install
