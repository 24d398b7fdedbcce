"""Issue 9's property: over generated architectures that mix every transform shape, a
hooked model computes bit-for-bit what the unhooked one computes, and every layer
call is either logged (with the stacking its enclosing transforms imply) or refused
with `px.TransformError` — never silently skipped.

Issue 21: each transform is also reached in a drawn import style — the `jax`
attribute, a name bound when this module was imported (before any hooked call: `from
jax import vmap`), a `functools.partial` made at import, and for `jit` a function
jitted at import and compiled by the unhooked call that precedes the hooked ones."""

import functools
from typing import Any

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, settings
from jax import checkpoint as bound_checkpoint, jit as bound_jit, vmap as bound_vmap
from jax.lax import (
    cond as bound_cond,
    fori_loop as bound_fori_loop,
    map as bound_map,
    scan as bound_scan,
    switch as bound_switch,
    while_loop as bound_while_loop,
)

import peex_interop as px

WIDTH = 4

# kind -> (extent it stacks a log by, or None; threaded when its body is traced?)
TRANSFORMS = {
    "vmap": 3, "scan": 2, "map": 2, "fori_static": 2, "fori_traced": 2,
    "cond": None, "switch": None, "jit": None, "checkpoint": None, "while": None,
}
REFUSED = {"while"}


# The import styles: how the model's code reaches each transform (`compiled`: jit only).
STYLES = ("attribute", "bound", "partial", "compiled")
# kind -> the transform reached by attribute, by a name bound at import, by a
# `functools.partial` made at import (its options bound there, the rest at the call).
REACHED = {
    "vmap": (lambda: jax.vmap, bound_vmap, functools.partial(jax.vmap, in_axes=0)),
    "scan": (lambda: jax.lax.scan, bound_scan, functools.partial(jax.lax.scan, length=2)),
    "map": (lambda: jax.lax.map, bound_map, functools.partial(jax.lax.map)),
    "fori_static": (lambda: jax.lax.fori_loop, bound_fori_loop, functools.partial(jax.lax.fori_loop, 0)),
    "fori_traced": (lambda: jax.lax.fori_loop, bound_fori_loop, functools.partial(jax.lax.fori_loop, 0)),
    "cond": (lambda: jax.lax.cond, bound_cond, functools.partial(jax.lax.cond)),
    "switch": (lambda: jax.lax.switch, bound_switch, functools.partial(jax.lax.switch)),
    "jit": (lambda: jax.jit, bound_jit, functools.partial(jax.jit, inline=False)),
    "checkpoint": (lambda: jax.checkpoint, bound_checkpoint, functools.partial(jax.checkpoint, prevent_cse=True)),
    "while": (lambda: jax.lax.while_loop, bound_while_loop, functools.partial(jax.lax.while_loop)),
}


def _reached(kind: str, style: str) -> Any:
    attribute, bound, partial = REACHED[kind]
    return {"attribute": attribute(), "bound": bound, "partial": partial}[style]


def _apply(kind: str, style: str, f, x):
    t = _reached(kind, style)
    if kind == "vmap":
        return jnp.mean(t(f)(jnp.stack([x, -x, 0.5 * x])), axis=0)
    if kind == "scan":
        scan = functools.partial(t, length=2) if style != "partial" else t
        return scan(lambda c, _: (f(c), None), x, None)[0]
    if kind == "map":
        return jnp.mean(t(f, jnp.stack([x, 2 * x])), axis=0)
    if kind in ("fori_static", "fori_traced"):
        upper = 2 if kind == "fori_static" else jnp.where(jnp.sum(x) > -1e9, 2, 0)
        loop = functools.partial(t, 0) if style != "partial" else t
        return loop(upper, lambda i, c: f(c), x)
    if kind == "cond":
        return t(jnp.sum(x) > 0, f, lambda v: -v, x)
    if kind == "switch":
        return t(jnp.where(jnp.sum(x) > 0, 1, 0), [lambda v: 0.5 * v, f], x)
    if kind == "jit":
        return t(f)(x)
    if kind == "checkpoint":
        return t(f)(x)
    assert kind == "while"
    return t(lambda c: c[0] < 2, lambda c: (c[0] + 1, f(c[1])), (0, x))[1]


class Arch(eqx.Module):
    """A program of layer calls under nested transforms (static), over its layers."""

    layers: list
    program: Any = eqx.field(static=True)
    # The `compiled` style's jit, made with the model (before any hooked call), taking it.
    jitted: Any = eqx.field(static=True, default=None)

    def __call__(self, x):
        return self._run(self.program, x)

    def _run(self, node, x):
        if node[0] == "layer":
            return jnp.tanh(self.layers[node[1]](x))
        if node[0] == "seq":
            for child in node[1]:
                x = self._run(child, x)
            return x
        kind, style, child = node
        if style == "compiled":
            return self.jitted(self, child, x)
        return _apply(kind, style, lambda v: self._run(child, v), x)


def _expected(node, stack: tuple, traced: bool, out: dict, refused: list) -> None:
    """Log shape of every layer call, and whether any would have to be refused."""
    if node[0] == "layer":
        out[f"layers.{node[1]}"] = (*stack, WIDTH)
        return
    if node[0] == "seq":
        for child in node[1]:
            _expected(child, stack, traced, out, refused)
        return
    kind, _, child = node
    if kind in REFUSED or (kind == "fori_traced" and traced):
        refused.append(kind)
    extent = TRANSFORMS[kind]
    _expected(child, (*stack, extent) if extent else stack, True, out, refused)


def _programs():
    def extend(children):
        return st.one_of(
            st.tuples(_kind_styles(), children).map(lambda t: (*t[0], t[1])),
            st.lists(children, min_size=2, max_size=3).map(lambda c: ("seq", tuple(c))),
        )

    return st.recursive(st.just(("layer", None)), extend, max_leaves=6)


def _kind_styles():
    """(kind, style): a jit compiled before hooking one node in ten, else any kind
    reached by attribute, bound name or partial."""
    styles = st.sampled_from([*STYLES[:3] * 3, "compiled"])
    kinds = lambda style: st.just("jit") if style == "compiled" else st.sampled_from(sorted(TRANSFORMS))
    return styles.flatmap(lambda style: st.tuples(kinds(style), st.just(style)))


def _numbered(node, counter: list) -> Any:
    # Every layer call gets its own layer (index in call order).
    if node[0] == "layer":
        counter.append(None)
        return ("layer", len(counter) - 1)
    if node[0] == "seq":
        return ("seq", tuple(_numbered(child, counter) for child in node[1]))
    return (node[0], node[1], _numbered(node[2], counter))


def _styles(node) -> set:
    if node[0] == "layer":
        return set()
    if node[0] == "seq":
        return set().union(*map(_styles, node[1]))
    return {node[1]} | _styles(node[2])


def _model(program) -> Arch:
    counter: list = []
    numbered = _numbered(program, counter)
    keys = jax.random.split(jax.random.key(len(counter)), len(counter))
    # A fresh function per model: the engine remembers which jitted functions ran a
    # selected layer, so a shared one would let earlier examples change later ones.
    jitted = jax.jit(lambda arch, node, x: arch._run(node, x), static_argnums=1)
    return Arch([eqx.nn.Linear(WIDTH, WIDTH, key=k) for k in keys], numbered, jitted)


X = jnp.array([0.3, -0.1, 0.4, 0.2])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(program=_programs(), jit=st.booleans())
def test_every_layer_call_is_logged_or_refused(program, jit):
    _check(program, jit, events=True)


def _check(program, jit: bool, events: bool = False) -> None:
    """Identity-hooked, then logged: a later hooked call must never replay an earlier
    one's program (a jit compiled before hooking). Refusals are checked too."""
    model = _model(program)
    call = eqx.filter_jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
    shapes: dict = {}
    refused: list = []
    _expected(model.program, (), jit, shapes, refused)
    if events:
        stacks = max(map(len, shapes.values()), default=1) - 1
        event("refused" if refused else f"logged {len(shapes)} layer(s), {stacks} stack axes")
        for style in sorted(_styles(model.program)):
            event(f"a transform reached by {style}")
    plain = call(model, X)  # compiles the `compiled` style's jits, unhooked
    logged = px.ForwardHook(model, log_fn=px.IdentityLog())
    if refused:
        # Even hooks that only look: a selected call is hooked or refused.
        for hooked in (px.ForwardHook(model), logged):
            with jax.checking_leaks(), pytest.raises(px.TransformError):
                call(hooked, X)
        return
    for step in ("identity", "logged"):
        with jax.checking_leaks():
            out, log = call(logged if step == "logged" else px.ForwardHook(model), X)
        np.testing.assert_array_equal(out, plain)
        if step == "identity":
            assert log == {}
            continue
        assert {key: value.shape for key, value in log.items()} == shapes
        assert all(isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer) for value in log.values())


# Examples the property found with its jits compiled before hooking (bugs, fixed),
# checked in the property's order: the identity-hooked call first.
def test_a_compiled_jit_logs_after_an_identity_hooked_call():
    _check(("jit", "compiled", ("layer", None)), jit=False)


def test_a_compiled_jit_with_a_transform_inside_logs_after_an_identity_hooked_call():
    _check(("jit", "compiled", ("checkpoint", "attribute", ("layer", None))), jit=True)


def test_a_compiled_jit_in_a_traced_loop_is_refused_even_for_edits():
    _check(("fori_traced", "attribute", ("jit", "compiled", ("layer", None))), jit=True)
