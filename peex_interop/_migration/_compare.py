"""Running two implementations of one network on the same input and comparing them
layer by layer (`px.compare`)."""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._diagnostics import summary
from .._engine import AbstractConverted
from .._errors import HookError, outside_its_vmap, run_on_a_batch
from .._hooks import BackwardHook, ForwardHook, IdentityLog
from ._align import align
from ._alignment import REPEAT, Alignment
from ._comparison import Comparison, ComparisonRow
from ._differences import entry_difference, tree_difference


def _layers(keys: Any) -> list[str]:
    """The layers behind log keys (or tuples of them: the layers one fused layer of the
    other model holds): a repeated call `path@n` is a call of `path`."""
    flat = [part for key in keys for part in ((key,) if isinstance(key, str) else key)]
    return list(dict.fromkeys(REPEAT.sub("", key) for key in flat))


def _label(key: str | tuple[str, ...]) -> str:
    """A comparison row's name for a mapping key: the layers of a tuple joined by ` + `."""
    return key if isinstance(key, str) else " + ".join(key)


def _loss(output: Any) -> Any:
    return 0.5 * sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(output))


# Compiled, not eager: an eager run compiles each operation of the model on its own. Both
# models in one program: XLA compiles one program of two models faster than two (by a
# fifth to a quarter for a 50M-parameter LM on CPU).
@eqx.filter_jit
def _outputs(models: tuple, paths: tuple, args: tuple, kwargs: dict) -> tuple:
    """`(returned, log)` of each model, its log holding the outputs of its `paths`."""
    return tuple(
        ForwardHook(model, log_fn=IdentityLog(), layer_names=layers or None)(*args, **kwargs)
        for model, layers in zip(models, paths)
    )


@eqx.filter_jit
def _outputs_and_cotangents(models: tuple, paths: tuple, args: tuple, kwargs: dict, stepped: bool) -> tuple:
    """`(returned, log, cotangents)` of each model: `_outputs` and the cotangents of
    `_loss` at the same layers, from one gradient pass, the forward log its auxiliary
    output."""

    def run(model: Any, layers: list[str]) -> tuple[Any, Mapping[str, Any], dict]:
        logged = ForwardHook(model, log_fn=IdentityLog(), layer_names=layers or None)
        hooked = BackwardHook(logged, log_fn=IdentityLog(), layer_names=layers).init(*args, **kwargs)

        def loss(h: Any) -> Any:
            returned, log = h(*args, **kwargs)
            # Of a step, the output only: the state it returns is the next step's input.
            return _loss(_carried(model, returned)[0] if stepped else returned), (returned, log)

        grads, (returned, log) = eqx.filter_grad(loss, has_aux=True)(hooked)
        return returned, log, grads.log

    return tuple(run(model, layers) for model, layers in zip(models, paths))


# A comparison runs its program once per input, and on CPU compiling it takes longer
# than running it. XLA's backend (LLVM) optimisation level 0 compiles it a fifth faster
# and runs it about as fast, its matmuls being library calls (a 50M-parameter LM and
# its port: compile 0.64 -> 0.51 s, first run 0.27 s at both; with cotangents 1.55 ->
# 1.26 s, 0.58 -> 0.66 s). Both models are compiled alike; every logged value stays
# within 2e-7 relative of the default level's.
_ONE_SHOT_CPU_OPTIONS = {"xla_backend_optimization_level": 0}


def _run_once(jitted: Any, *args: Any) -> Any:
    if jax.default_backend() != "cpu":
        return jitted(*args)
    return jitted.lower(*args).compile(_ONE_SHOT_CPU_OPTIONS)(*args)


def _carried(model: Any, returned: Any) -> tuple[Any, Any]:
    if not isinstance(model, AbstractConverted):
        raise HookError(
            f"compare(..., steps=) carries each model's state from one call to the next, and a "
            f"{type(model).__name__} is called with its state as an argument (an Equinox model's eqx.nn.State): "
            "compare its calls one at a time"
        )
    return model.carried(returned)


def compare(
    model_a: Any,
    model_b: Any,
    *args: Any,
    steps: Sequence[Any] | None = None,
    tolerance: float = 1e-5,
    cotangents: bool = False,
    alignment: Alignment | None = None,
    **kwargs: Any,
) -> Comparison:
    """Run two implementations of one network on the same input and compare them layer
    by layer (outputs, and on request the cotangents of `0.5 * sum(output**2)`).

    Both models run in one compiled program; on CPU it is compiled at XLA's backend
    optimisation level 0, which compiles a program run once faster (values within 2e-7
    relative of the default level's).

    **Arguments:**

    - `model_a`, `model_b`: Equinox models or converted Haiku/NNX models.
    - `*args`, `**kwargs`: one input both models accept.
    - `steps`: instead of `*args`, the inputs of several calls of stateful models (one
        array, or a tuple of arguments, per call: the tokens of autoregressive decode
        steps), each call starting from the state the previous one left, carried as
        each model's library carries it (`.carried`: a linen model converted with
        `mutable=["cache"]`, an NNX one with `return_state=True`, a Haiku one from
        `hk.transform_with_state`). `**kwargs` go to every call.
    - `tolerance`: a layer diverges where `max abs > tolerance * (1 + max |a|)`.
    - `cotangents`: also compare the cotangents flowing back through each layer (of
        each step's output, with `steps`).
    - `alignment`: a precomputed `px.align` result (computed if not given, on the first
        step's input with `steps`).

    **Returns:**

    A `Comparison` (print it; `.first_divergence` is the first layer whose output
    diverges, at the earliest step with `steps`; `.cotangent_only_rows` the layers
    whose cotangents alone do). With `steps`, it has a row per step and layer, in step
    order (`ComparisonRow.step`).
    """
    if steps is None:
        alignment = alignment or align(model_a, model_b, *args, **kwargs)
        rows = _compare_call(model_a, model_b, args, kwargs, alignment, tolerance, cotangents)[0]
        return Comparison(tuple(rows), alignment, tolerance)
    if args:
        raise TypeError("compare takes one call's inputs as *args or several calls' as steps=, not both")
    calls = [step if isinstance(step, tuple) else (step,) for step in steps]
    if not calls:
        raise ValueError("compare: steps= names no call")
    alignment = alignment or align(model_a, model_b, *calls[0], **kwargs)
    rows = []
    for step, call in enumerate(calls):
        found, model_a, model_b = _compare_call(
            model_a, model_b, call, kwargs, alignment, tolerance, cotangents, stepped=True
        )
        rows += [dataclasses.replace(row, step=step) for row in found]
    return Comparison(tuple(rows), alignment, tolerance)


def _compare_call(
    model_a: Any,
    model_b: Any,
    args: tuple,
    kwargs: dict,
    alignment: Alignment,
    tolerance: float,
    cotangents: bool,
    stepped: bool = False,
) -> tuple[list[ComparisonRow], Any, Any]:
    """The rows of one call of both models, and (`stepped`) the models carrying the
    state that call left."""
    layers_a, layers_b = _layers(list(alignment.mapping)), _layers(list(alignment.mapping.values()))
    models, layers = (model_a, model_b), (layers_a, layers_b)
    with outside_its_vmap("px.compare", run_on_a_batch):
        if cotangents:
            (returned_a, log_a, ct_a), (returned_b, log_b, ct_b) = _run_once(
                _outputs_and_cotangents, models, layers, args, kwargs, stepped
            )
        else:
            (returned_a, log_a), (returned_b, log_b) = _run_once(_outputs, models, layers, args, kwargs)
            ct_a = ct_b = None
    # The differences are computed on the host: one transfer of every logged value, the
    # copies overlapping (on an accelerator), rather than a blocking copy per array.
    log_a, log_b, ct_a, ct_b = jax.device_get((log_a, log_b, ct_a, ct_b))
    if stepped:
        next_a, next_b = _carried(model_a, returned_a)[1], _carried(model_b, returned_b)[1]
    else:
        next_a, next_b = model_a, model_b
    rows = []
    for key_a, key_b in alignment.mapping.items():
        abs_error, rel_error, excess = entry_difference(log_a, log_b, key_a, key_b)
        ct_abs = ct_rel = None
        output_diverged = cotangent_diverged = excess > tolerance
        if cotangents:
            ct_abs, ct_rel, ct_excess = entry_difference(ct_a, ct_b, key_a, key_b)
            cotangent_diverged = ct_excess > tolerance
        rows.append(ComparisonRow(
            _label(key_a), _label(key_b), abs_error, rel_error, ct_abs, ct_rel,
            bool(output_diverged or cotangent_diverged),
            cotangent_only=bool(cotangent_diverged and not output_diverged),
        ))
    if any(row.diverged and not row.cotangent_only for row in rows):
        # Where layers of a scanned stack diverge: the step at which each first does
        # (in its output; a cotangent-only divergence has no such step).
        stack_axes = [_stack_axes(model, args, kwargs) for model in (model_a, model_b)]
        for i, row in enumerate(rows):
            axes = stack_axes[0].get(row.path_a), stack_axes[1].get(row.path_b)
            if row.diverged and not row.cotangent_only and None not in axes:
                first_step = _first_diverging_step(log_a[row.path_a], log_b[row.path_b], axes, tolerance)
                rows[i] = dataclasses.replace(row, first_step=first_step)
    return rows, next_a, next_b


def _stack_axes(model: Any, args: tuple, kwargs: dict) -> dict[str, tuple[int, int]]:
    """Log key -> (axis, length) of the innermost stack of layers the layer runs in."""
    return {
        row.key: (row.stacks[-1], row.lengths[row.stacks[-1]])
        for row in summary(model, *args, **kwargs).rows
        if row.stacks
    }


def _first_diverging_step(a: Any, b: Any, axes: tuple, tolerance: float) -> int | None:
    (axis_a, length), (axis_b, _) = axes

    def step(tree: Any, axis: int, i: int) -> Any:
        return jax.tree.map(lambda x: np.take(np.asarray(x), i, axis) if np.ndim(x) > axis else x, tree)

    for i in range(length):
        if tree_difference(step(a, axis_a, i), step(b, axis_b, i))[2] > tolerance:
            return i
    return None
