"""Issue 9's property: over generated architectures that mix every transform shape, a
hooked model computes bit-for-bit what the unhooked one computes, and every layer
call is either logged (with the stacking its enclosing transforms imply) or refused
with `px.TransformError` — never silently skipped."""

from typing import Any

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import event, given, settings

import peex_interop as px

WIDTH = 4

# kind -> (extent it stacks a log by, or None; threaded when its body is traced?)
TRANSFORMS = {
    "vmap": 3, "scan": 2, "map": 2, "fori_static": 2, "fori_traced": 2,
    "cond": None, "switch": None, "jit": None, "checkpoint": None, "while": None,
}
REFUSED = {"while"}


def _apply(kind: str, f, x):
    if kind == "vmap":
        return jnp.mean(jax.vmap(f)(jnp.stack([x, -x, 0.5 * x])), axis=0)
    if kind == "scan":
        return jax.lax.scan(lambda c, _: (f(c), None), x, None, length=2)[0]
    if kind == "map":
        return jnp.mean(jax.lax.map(f, jnp.stack([x, 2 * x])), axis=0)
    if kind == "fori_static":
        return jax.lax.fori_loop(0, 2, lambda i, c: f(c), x)
    if kind == "fori_traced":
        upper = jnp.where(jnp.sum(x) > -1e9, 2, 0)
        return jax.lax.fori_loop(0, upper, lambda i, c: f(c), x)
    if kind == "cond":
        return jax.lax.cond(jnp.sum(x) > 0, f, lambda v: -v, x)
    if kind == "switch":
        return jax.lax.switch(jnp.where(jnp.sum(x) > 0, 1, 0), [lambda v: 0.5 * v, f], x)
    if kind == "jit":
        return jax.jit(f)(x)
    if kind == "checkpoint":
        return jax.checkpoint(f)(x)
    assert kind == "while"
    return jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, f(c[1])), (0, x))[1]


class Arch(eqx.Module):
    """A program of layer calls under nested transforms (static), over its layers."""

    layers: list
    program: Any = eqx.field(static=True)

    def __call__(self, x):
        return self._run(self.program, x)

    def _run(self, node, x):
        if node[0] == "layer":
            return jnp.tanh(self.layers[node[1]](x))
        if node[0] == "seq":
            for child in node[1]:
                x = self._run(child, x)
            return x
        kind, child = node
        return _apply(kind, lambda v: self._run(child, v), x)


def _expected(node, stack: tuple, traced: bool, out: dict, refused: list) -> None:
    """Log shape of every layer call, and whether any would have to be refused."""
    if node[0] == "layer":
        out[f"layers.{node[1]}"] = (*stack, WIDTH)
        return
    if node[0] == "seq":
        for child in node[1]:
            _expected(child, stack, traced, out, refused)
        return
    kind, child = node
    if kind in REFUSED or (kind == "fori_traced" and traced):
        refused.append(kind)
    extent = TRANSFORMS[kind]
    _expected(child, (*stack, extent) if extent else stack, True, out, refused)


def _programs():
    def extend(children):
        return st.one_of(
            st.tuples(st.sampled_from(sorted(TRANSFORMS)), children),
            st.lists(children, min_size=2, max_size=3).map(lambda c: ("seq", tuple(c))),
        )

    return st.recursive(st.just(("layer", None)), extend, max_leaves=6)


def _numbered(node, counter: list) -> Any:
    # Every layer call gets its own layer (index in call order).
    if node[0] == "layer":
        counter.append(None)
        return ("layer", len(counter) - 1)
    if node[0] == "seq":
        return ("seq", tuple(_numbered(child, counter) for child in node[1]))
    return (node[0], _numbered(node[1], counter))


def _model(program) -> Arch:
    counter: list = []
    numbered = _numbered(program, counter)
    keys = jax.random.split(jax.random.key(len(counter)), len(counter))
    return Arch([eqx.nn.Linear(WIDTH, WIDTH, key=k) for k in keys], numbered)


X = jnp.array([0.3, -0.1, 0.4, 0.2])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(program=_programs(), jit=st.booleans())
def test_every_layer_call_is_logged_or_refused(program, jit):
    model = _model(program)
    call = eqx.filter_jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
    shapes: dict = {}
    refused: list = []
    _expected(model.program, (), jit, shapes, refused)
    event("refused" if refused else f"logged {len(shapes)} layer(s), {max(map(len, shapes.values())) - 1} stack axes")
    plain = call(model, X)
    logged = px.ForwardHook(model, log_fn=px.IdentityLog())
    if refused:
        # Even hooks that only look: a selected call is hooked or refused.
        for hooked in (px.ForwardHook(model), logged):
            with jax.checking_leaks(), pytest.raises(px.TransformError):
                call(hooked, X)
        return
    with jax.checking_leaks():
        hooked_out, log = call(px.ForwardHook(model), X)
    np.testing.assert_array_equal(hooked_out, plain)
    assert log == {}
    with jax.checking_leaks():
        out, log = call(logged, X)
    np.testing.assert_array_equal(out, plain)
    assert {key: value.shape for key, value in log.items()} == shapes
    assert all(isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer) for value in log.values())
