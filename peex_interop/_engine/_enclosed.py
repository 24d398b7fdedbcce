"""The unmapped transforms whose body runs once: `jax.lax.cond`, `jax.lax.switch` and
`jax.checkpoint`. Logs leave their body as plain outputs; the enclosing scope's slots
and indices come in as inputs (`Body.enclosing`). A cond's branches log one structure:
a layer that only some branches call logs zeros in the others.
"""

from collections.abc import Callable
from typing import Any

from . import _context, _patching, _shapes
from ._bodies import Body, probes_first, real_eval_shapes, shift


def _branches(fns: list, operands: tuple, select: Callable) -> Any:
    """cond/switch: each branch is a body; the branches' logs are padded to one
    structure (a layer that only some branches call logs zeros in the others)."""
    bodies = [Body(fn, operands) for fn in fns]

    def branch(body: Body, union: list | None) -> Callable:
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
        shapes = [logs for _, logs in real_eval_shapes(runs, carried, *operands)]
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
        options = _patching.bound_arguments(real_cond, cond_args, cond_kwargs)
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
        options = _patching.bound_arguments(real_switch, switch_args, switch_kwargs)
        index = options["index"]
        return _branches(
            list(options["branches"]), _operands(options),
            lambda branches, *operands: real_switch(index, branches, *operands),
        )

    return switch


def threaded_checkpoint(real_checkpoint: Callable) -> Callable:
    def checkpoint(*checkpoint_args, **checkpoint_kwargs):
        options = _patching.bound_arguments(real_checkpoint, checkpoint_args, checkpoint_kwargs)
        fun = options.pop("fun")
        shifted = {**options, "static_argnums": shift(options.get("static_argnums", ()))}

        def checkpointed(*args, **kwargs):
            if not _context.active():
                return real_checkpoint(fun, **options)(*args, **kwargs)
            body = Body(fun, (args, kwargs))

            def checkpointed_body(carried, *inner_args, **inner_kwargs):
                return body.enclosed(carried, (inner_args, inner_kwargs), inner_args, inner_kwargs)

            def run(carried):
                return real_checkpoint(probes_first(fun, checkpointed_body), **shifted)(carried, *args, **kwargs)

            return body.run_enclosed(run)

        return checkpointed

    return checkpoint
