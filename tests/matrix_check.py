"""Checks shared by the Haiku and NNX transform matrices (issue 9's acceptance).

A case is a converted model, its call arguments, and an independent reference: the
same computation written without the transform (Python loops over steps, `jnp.where`
for branch selection, parameters applied by hand), taking an additive `delta` per
selected layer (shaped like that layer's expected log) and returning
`(output, {path: stacked layer outputs})`. Then, for a threaded case:

- the identity-hooked output is bit-equal to the unhooked one and equal to the
  reference's, and the forward log equals the reference's layer outputs at `delta=0`;
- an editing hook `y + 1` on one layer gives the reference's output at `delta=1` on
  that layer (it edits exactly where it selects);
- the `BackwardHook` cotangent log equals `jax.grad` of the loss w.r.t. `delta` at 0.

A refused case raises `px.TransformError` naming the layer, both for forward logs and
backward slots; an edit without logs has nothing to thread out and still applies.
Everything runs under `jax.checking_leaks()`.
"""

import contextlib
import functools
import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peex_interop as px
from models import close

MODES = ("eager", "filter_jit")


def _call(hooked, args):
    return hooked(*args)


def _grad(hooked, args):
    return eqx.filter_grad(lambda h, a: loss(_call(h, a)))(hooked, args)


def _in(mode: str, fn: Callable) -> Callable:
    return eqx.filter_jit(fn) if mode == "filter_jit" else fn


def loss(out: Any) -> jax.Array:
    return sum(jnp.sum(jnp.sin(leaf) * leaf) for leaf in jax.tree.leaves(out))


def _deltas(shapes: dict[str, tuple], ones: str | None = None) -> dict[str, jax.Array]:
    return {p: (jnp.ones if p == ones else jnp.zeros)(shape) for p, shape in shapes.items()}


@functools.cache
def _compiled(reference: Callable) -> tuple[Callable, Callable]:
    """The reference and its gradient w.r.t. the deltas, jitted (eager dispatch of
    their many small ops would dominate the run time); cached across modes."""
    return jax.jit(reference), jax.jit(jax.grad(lambda d: loss(reference(d)[0])))


def _naming(path: str) -> str:
    return re.escape(repr(path))


def check_threaded(
    mode: str,
    model: Any,
    args: tuple,
    reference: Callable,
    shapes: dict[str, tuple],
    *,
    init_refused: bool = False,
    unnamed: str | None = None,
    unhooked_leaks: bool = False,
) -> None:
    """Logs, edits and cotangents of the layers in `shapes` equal the reference's.

    `init_refused`: `BackwardHook.init` runs the model abstractly (`eval_shape`), so a
    value that is concrete in an eager call (a loop bound) is traced there: its
    layers are refused at `.init`, naming them (or `unnamed`, as in `check_refused`).

    `unhooked_leaks`: the unhooked model leaks tracers under JAX alone (its own jit cache
    keeps what a jit made at import closes over), so only the hooked calls run under
    `jax.checking_leaks()`."""
    paths = sorted(shapes)
    reference, reference_grad = _compiled(reference)
    ref_out, ref_logs = reference(_deltas(shapes))
    with contextlib.nullcontext() if unhooked_leaks else jax.checking_leaks():
        plain = _in(mode, _call)(model, args)
    with jax.checking_leaks():
        out, log = _in(mode, _call)(px.ForwardHook(model, log_fn=px.IdentityLog(), where=paths), args)
    jax.tree.map(np.testing.assert_array_equal, out, plain)
    jax.tree.map(close, out, ref_out)
    assert sorted(log) == paths
    for path in paths:
        assert log[path].shape == shapes[path], (path, log[path].shape)
        close(log[path], ref_logs[path])

    # One layer (for cond/switch: taken around, taken and not taken in the batch).
    with jax.checking_leaks():
        edited, _ = _in(mode, _call)(px.ForwardHook(model, hook_fn=lambda y: y + 1.0, where=paths[-1]), args)
    jax.tree.map(close, edited, reference(_deltas(shapes, ones=paths[-1]))[0])

    if init_refused:
        with jax.checking_leaks(), pytest.raises(px.TransformError, match=unnamed or _naming(paths[0])):
            px.BackwardHook(model, log_fn=px.IdentityLog(), where=paths).init(*args)
        return
    expected = reference_grad(_deltas(shapes))
    with jax.checking_leaks():
        hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where=paths).init(*args)
        grads = _in(mode, _grad)(hooked, args)
    assert sorted(grads.log) == paths
    for path in paths:
        close(grads.log[path], expected[path])


def check_refused(
    mode: str,
    model: Any,
    args: tuple,
    reference: Callable,
    shapes: dict[str, tuple],
    *,
    model_leaks: bool = False,
    unnamed: str | None = None,
) -> None:
    """Logging, editing or backward-hooking any layer in `shapes` raises
    `px.TransformError` naming it (an edit traced under an unthreaded transform could be
    cached by JAX and replayed by a later hooked call, so it is refused too).

    `unnamed`: the type name of a layer that reaches the transform as an argument (a
    loop carry, a jit's argument): no path can be told, so the error names its type.
    `model_leaks`: the unhooked model itself fails `jax.checking_leaks()` (JAX's jit
    cache keeps the tracers a jit created before the call closed over): the edit is
    then checked without it."""
    reference, _ = _compiled(reference)
    for path in sorted(shapes):
        naming = unnamed or _naming(path)
        editing = px.ForwardHook(model, hook_fn=lambda y: y + 1.0, where=path)
        with jax.checking_leaks():
            with pytest.raises(px.TransformError, match=naming):
                _in(mode, _call)(px.ForwardHook(model, log_fn=px.IdentityLog(), where=path), args)
            with pytest.raises(px.TransformError, match=naming):
                hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where=path).init(*args)
                _in(mode, _grad)(hooked, args)
        with (
            jax.checking_leaks() if not model_leaks else contextlib.nullcontext(),
            pytest.raises(px.TransformError, match=naming),
        ):
            _in(mode, _call)(editing, args)


def nested(reference: Callable, in_axes: tuple) -> Callable:
    """The reference of a case run inside a vmap over the batch: `reference(deltas,
    *args)` vmapped over the args mapped by `in_axes` and over the deltas."""

    def batched(deltas, *args):
        return jax.vmap(reference, in_axes=(0, *in_axes))(deltas, *args)

    return batched
