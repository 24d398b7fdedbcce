"""Threading logs out of the JAX transforms a model applies *inside* itself.

A value recorded into Python from inside a `jax.vmap`/`jax.lax.scan`/... body would leak
a tracer. While a hooking context is active in this thread, the public entry points
below are replaced by versions that run the body in a fresh scope and return the scope's
logs as extra outputs of the body: stacked along the mapped/scanned axis for vmap and
scan, as plain outputs for cond and checkpoint. Backward-log slots of layers inside a
vmap/scan body are passed in as mapped inputs, so cotangents are per example/step rather
than summed. Everything else is left to `HookContext._check_trace`, which refuses loudly.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _context, _patching


def _run_body(contexts, start_counts, fn, outer, inner, probes, args, kwargs):
    # Counts restart from the body's start each time JAX traces it, so a retrace
    # does not shift `path@n` keys.
    for context, counts, probe in zip(contexts, start_counts, probes):
        context.counts = dict(counts)
        context.enter_body(outer, inner, probe)
    try:
        out = fn(*args, **kwargs)
    finally:
        logs = [context.exit_body() for context in contexts]
    return out, logs


def _finish(contexts, end_counts, logs) -> None:
    for context, counts, log in zip(contexts, end_counts, logs):
        context.counts = counts
        context.merge(log)


def _slot_probes(contexts, discovered_logs) -> list[dict | None]:
    """Per context: the backward slots of the layers that run inside the body."""
    probes = []
    for context, found in zip(contexts, discovered_logs):
        if not context.needs_probes:
            probes.append({})
            continue
        slots = context.scopes[-1].probes
        missing = sorted(set(found) - set(slots))
        if missing:
            raise _context.HookError(
                f"BackwardHook has no cotangent slot for layers {missing} (inside a "
                "vmap/scan body): call `hooked = hooked.init(*args)` with inputs of the "
                "shapes you call it with"
            )
        probes.append({key: slots[key] for key in found})
    return probes


class _discovering:
    """Backward contexts record their slot templates instead of using slots, so one
    abstract run of a body tells which slots it needs."""

    def __init__(self, contexts):
        self.contexts = contexts

    def __enter__(self):
        self.saved = [(c.discovering, dict(c.counts)) for c in self.contexts]
        for context in self.contexts:
            context.discovering = True

    def __exit__(self, *exc):
        for context, (flag, counts) in zip(self.contexts, self.saved):
            context.discovering, context.counts = flag, counts


def _needs_discovery(contexts) -> bool:
    return any(context.needs_probes for context in contexts)


def _with_leading_axis(in_axes: Any, num_args: int) -> Any:
    if isinstance(in_axes, (tuple, list)):
        return (0, *in_axes)
    return (0, *([in_axes] * num_args))


def threaded_vmap(real_vmap: Callable) -> Callable:
    def vmap(fun, in_axes=0, out_axes=0, *rest, **options):
        def mapped(*args, **kwargs):
            contexts = list(_context.active())
            if not contexts:
                return real_vmap(fun, in_axes, out_axes, *rest, **options)(*args, **kwargs)
            start = [dict(c.counts) for c in contexts]
            end = []

            def body(probes, *inner_args, **inner_kwargs):
                out, logs = _run_body(
                    contexts, start, fun, (args, kwargs), (inner_args, inner_kwargs),
                    probes, inner_args, inner_kwargs,
                )
                end[:] = [dict(c.counts) for c in contexts]
                return out, logs

            def run(probes):
                axes = _with_leading_axis(in_axes, len(args))
                return real_vmap(body, axes, (out_axes, 0), *rest, **options)(
                    probes, *args, **kwargs
                )

            probes = [{} for _ in contexts]
            if _needs_discovery(contexts):
                with _discovering(contexts):
                    _, found = jax.eval_shape(run, probes)
                probes = _slot_probes(contexts, found)
            out, logs = run(probes)
            _finish(contexts, end, logs)
            return out

        return mapped

    return vmap


def threaded_scan(real_scan: Callable) -> Callable:
    def scan(f, init, xs=None, *rest, **options):
        contexts = list(_context.active())
        if not contexts:
            return real_scan(f, init, xs, *rest, **options)
        start = [dict(c.counts) for c in contexts]
        end = []

        def body(carry, x_and_probes):
            x, probes = x_and_probes
            (carry, y), logs = _run_body(
                contexts, start, f, (init, xs), (carry, x), probes, (carry, x), {}
            )
            end[:] = [dict(c.counts) for c in contexts]
            return carry, (y, logs)

        def run(probes):
            return real_scan(body, init, (xs, probes), *rest, **options)

        probes = [{} for _ in contexts]
        if _needs_discovery(contexts):
            with _discovering(contexts):
                _, (_, found) = jax.eval_shape(run, probes)
            probes = _slot_probes(contexts, found)
        carry, (ys, logs) = run(probes)
        _finish(contexts, end, logs)
        return carry, ys

    return scan


def _zeros(shapes: Any) -> Any:
    return jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def threaded_cond(real_cond: Callable) -> Callable:
    def cond(pred, true_fun, false_fun, *operands, **options):
        contexts = list(_context.active())
        if not contexts or not (callable(true_fun) and callable(false_fun)):
            return real_cond(pred, true_fun, false_fun, *operands, **options)
        start = [dict(c.counts) for c in contexts]
        branch_ends: dict[int, list] = {}

        def branch(index: int, fn: Callable, union: Sequence[dict] | None):
            def run(*inner):
                out, logs = _run_body(
                    contexts, start, fn, operands, inner, [None] * len(contexts), inner, {}
                )
                branch_ends[index] = [dict(c.counts) for c in contexts]
                if union is not None:
                    # Both branches must return the same structure: a layer that only
                    # one branch calls logs zeros when the other branch is taken.
                    logs = [
                        {key: log.get(key, zeros) for key, zeros in _zeros(u).items()}
                        for log, u in zip(logs, union)
                    ]
                return out, logs

            return run

        functions = (true_fun, false_fun)
        shapes = [
            jax.eval_shape(branch(i, fn, None), *operands)[1]
            for i, fn in enumerate(functions)
        ]
        union = [{**a, **b} for a, b in zip(*shapes)]
        out, logs = real_cond(
            pred, *(branch(i, fn, union) for i, fn in enumerate(functions)),
            *operands, **options,
        )
        end = [
            {path: max(a.get(path, 0), b.get(path, 0)) for path in {*a, *b}}
            for a, b in zip(branch_ends[0], branch_ends[1])
        ]
        _finish(contexts, end, logs)
        return out

    return cond


def threaded_checkpoint(real_checkpoint: Callable) -> Callable:
    def checkpoint(fun, *rest, **options):
        def checkpointed(*args, **kwargs):
            contexts = list(_context.active())
            if not contexts:
                return real_checkpoint(fun, *rest, **options)(*args, **kwargs)
            start = [dict(c.counts) for c in contexts]
            end = []

            def body(*inner_args, **inner_kwargs):
                out, logs = _run_body(
                    contexts, start, fun, (args, kwargs), (inner_args, inner_kwargs),
                    [None] * len(contexts), inner_args, inner_kwargs,
                )
                end[:] = [dict(c.counts) for c in contexts]
                return out, logs

            out, logs = real_checkpoint(body, *rest, **options)(*args, **kwargs)
            _finish(contexts, end, logs)
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
