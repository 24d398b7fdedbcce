"""Issue 21's import-style matrix for the other four model styles: Haiku
(`px.from_haiku`), Flax NNX (`px.from_nnx`), Flax linen (`px.from_linen`) and
pure-function models (`px.from_function` over zephyr's `linear`); the Equinox one is
`test_import_styles.py`.

One layer, the library's own Linear/Dense named `lin` (in linen's scan: `steps.lin`),
is called inside the model through a transform reached by each import style: the
`jax.vmap` attribute, names bound when this module is imported, before any hooked call
(`from jax import vmap, jit, checkpoint`, `from jax.lax import cond, switch,
fori_loop, while_loop`), an alias module (`import jax.lax as L`: `L.map`, `L.scan`), a
`functools.partial` of `jax.vmap` made at import, functions decorated at import
(`@functools.partial(jax.vmap, in_axes=(None, 0))`, `@jax.jit`, `@eqx.filter_jit`,
`@jax.checkpoint`) and jits compiled by an unhooked call at import. Where a library's
users reach a transform through the library (NNX's `nnx.vmap`/`nnx.jit`, linen's
`nn.vmap`/`nn.scan`/`nn.jit`/`nn.remat`/`nn.cond`), those are reached the same ways.

Every library gets the same parameters (`x @ w + b`), so one hand-written reference
per computation serves all of them: the transform written out (all rows at once, loops
unrolled, the branch taken), the additive `delta` at the layer's output.

The checks are the transform matrices' (`matrix_check.check_threaded`): under
`jax.checking_leaks()`, eager and under `eqx.filter_jit`, the identity-hooked output
is bit-equal to the unhooked one and equal to the reference's, the forward log equals
the reference's layer output, an edit `y + 1` equals the reference at `delta = 1`, and
the backward log equals `jax.grad` of the loss w.r.t. `delta` at 0. A refused cell
(`while_loop`, `@jax.checkpoint` applied at import) raises `px.TransformError` naming
the layer and the transform that encloses it. The engine bugs these cases found are
fixed; the cases that found them stay.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import pytest

# The [haiku] and [flax] extras and zephyr's nets (the test extra): the matrix is one
# file, so it runs where all are installed (`[test]` has them all).
pytest.importorskip("haiku")
pytest.importorskip("flax")
pytest.importorskip("zephyr")

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.lax as L
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import (
    checkpoint as linen_checkpoint,
    cond as linen_cond,
    jit as linen_jit,
    scan as linen_scan,
    vmap as linen_vmap,
)
from jax import checkpoint as bound_checkpoint, jit as bound_jit, vmap as bound_vmap
from jax.lax import (
    cond as bound_cond,
    fori_loop as bound_fori_loop,
    switch as bound_switch,
    while_loop as bound_while_loop,
)
from zephyr.nets import linear

import peex_interop as px
from matrix_check import MODES, _call, _grad, _in, check_threaded

W, ROWS, STEPS = 3, 2, 2
_rng = np.random.default_rng(21)
KERNEL = jnp.asarray(_rng.standard_normal((W, W)) / np.sqrt(W), jnp.float32)
BIAS = jnp.asarray(_rng.standard_normal(W) * 0.1, jnp.float32)
XS = jnp.asarray(_rng.standard_normal((ROWS, W)), jnp.float32)


# -- the independent references: the same parameters applied by hand ------------------
def rows_reference(path: str) -> Callable:
    """`tanh(xs @ w + b + delta)`, logging the layer's output (one row per input row)."""

    def reference(deltas):
        y = XS @ KERNEL + BIAS + deltas[path]
        return jnp.tanh(y), {path: y}

    return reference


def loop_reference(path: str) -> Callable:
    """`STEPS` steps of `c -> tanh(c @ w + b + delta[i])` on the whole batch, logging
    the layer's output per step."""

    def reference(deltas):
        c, ys = XS, []
        for i in range(STEPS):
            ys.append(c @ KERNEL + BIAS + deltas[path][i])
            c = jnp.tanh(ys[-1])
        return c, {path: jnp.stack(ys)}

    return reference


def not_taken_reference(path: str) -> Callable:
    """A branch not taken: the input comes out, the layer logs zeros, and neither an
    edit nor a delta there changes anything."""

    def reference(deltas):
        return XS + 0.0 * jnp.sum(deltas[path]), {path: jnp.zeros((ROWS, W))}

    return reference


REFERENCES = {"rows": (rows_reference, (ROWS, W)), "loop": (loop_reference, (STEPS, ROWS, W)),
              "not_taken": (not_taken_reference, (ROWS, W))}


# -- transforms reached inside the model by a closure over the layer ---------------------
def _tanh_of(lin: Callable) -> Callable:
    return lambda v: jnp.tanh(lin(v))


# Made at import: binds the `jax.vmap` object itself, as a library's module-level
# `vmap_rows = partial(jax.vmap, ...)` does.
vmap_rows = functools.partial(jax.vmap, in_axes=0)

# style -> (body(lin, xs), reference family): the same for every library, `lin` a
# callable (an hk.Module, a bound linen module, an NNX module, or the params applied
# by zephyr's `linear`).
CLOSURE_STYLES: dict[str, tuple[Callable, str]] = {
    "attribute_vmap": (lambda lin, xs: jax.vmap(_tanh_of(lin))(xs), "rows"),
    "bound_vmap": (lambda lin, xs: bound_vmap(_tanh_of(lin))(xs), "rows"),
    "partial_vmap": (lambda lin, xs: vmap_rows(_tanh_of(lin))(xs), "rows"),
    "alias_map": (lambda lin, xs: L.map(_tanh_of(lin), xs), "rows"),
    "alias_scan": (lambda lin, xs: L.scan(lambda c, _: (jnp.tanh(lin(c)), None), xs, None, length=STEPS)[0], "loop"),
    "bound_cond": (lambda lin, xs: bound_cond(jnp.all(xs < 10.0), _tanh_of(lin), lambda v: v, xs), "rows"),
    "bound_cond_not_taken": (
        lambda lin, xs: bound_cond(jnp.any(xs > 10.0), _tanh_of(lin), lambda v: v, xs), "not_taken"
    ),
    "bound_switch": (
        lambda lin, xs: bound_switch(jnp.where(jnp.all(xs < 10.0), 1, 0), [lambda v: v, _tanh_of(lin)], xs), "rows"
    ),
    "bound_fori_loop": (lambda lin, xs: bound_fori_loop(0, STEPS, lambda i, c: jnp.tanh(lin(c)), xs), "loop"),
    "bound_vmap_in_bound_fori_loop": (
        lambda lin, xs: bound_fori_loop(0, STEPS, lambda i, c: bound_vmap(_tanh_of(lin))(c), xs), "loop"
    ),
    "bound_checkpoint": (lambda lin, xs: bound_checkpoint(_tanh_of(lin))(xs), "rows"),
    "bound_jit": (lambda lin, xs: bound_jit(_tanh_of(lin))(xs), "rows"),
    # Refused (no exact way to thread a loop of unknown length): below, REFUSED_STYLES.
    "bound_while_loop": (
        lambda lin, xs: bound_while_loop(lambda c: c[0] < STEPS, lambda c: (c[0] + 1, jnp.tanh(lin(c[1]))), (0, xs))[1],
        "loop",
    ),
}
# style -> a regex naming the layer and the transform that encloses it
REFUSED_STYLES = {"bound_while_loop": r"\['lin'\][\s\S]*jax\.lax\.while_loop"}


# -- transforms applied at import to functions that take the layer -----------------------
def made_at_import() -> dict[str, tuple]:
    """style -> (Haiku forward(xs), NNX body(lin, xs), function model(params, xs)), None
    where the style is not a cell of that library, over functions transformed here.

    Called once per mode when this module is imported, so each test has functions of
    its own: the engine remembers which jitted functions ran a selected layer, and JAX
    caches their traces, so shared ones would make a cell's outcome depend on the cells
    run before it (see the replay tests below).

    A module is passed where the library allows it: an hk.Module or a bound linen
    module as an unmapped leaf of a vmap, an NNX module (a pytree) anywhere; a
    pure-function model passes its params subtree. Haiku modules are not pytrees, so a
    Haiku jit makes its layer inside (`jax.jit(block)`, its params read from Haiku's
    frame)."""

    @functools.partial(jax.vmap, in_axes=(None, 0))
    def module_rows(layer, x):
        return jnp.tanh(layer(x))

    @functools.partial(jax.vmap, in_axes=(None, 0))
    def params_rows(params, x):
        return jnp.tanh(linear(params, x, W))

    @jax.jit
    def module_jitted(layer, xs):
        return jnp.tanh(layer(xs))

    @jax.jit
    def params_jitted(params, xs):
        return jnp.tanh(linear(params, xs, W))

    @jax.jit
    def haiku_jitted(xs):
        return jnp.tanh(hk.Linear(W, name="lin")(xs))

    @eqx.filter_jit
    def module_filter_jitted(layer, xs):
        return jnp.tanh(layer(xs))

    @eqx.filter_jit
    def params_filter_jitted(params, xs):
        return jnp.tanh(linear(params, xs, W))

    @eqx.filter_jit
    def haiku_filter_jitted(xs):
        return jnp.tanh(hk.Linear(W, name="lin")(xs))

    @jax.checkpoint
    def module_checkpointed(layer, xs):
        return jnp.tanh(layer(xs))

    @jax.checkpoint
    def params_checkpointed(params, xs):
        return jnp.tanh(linear(params, xs, W))

    @jax.checkpoint
    def haiku_checkpointed(xs):
        return jnp.tanh(hk.Linear(W, name="lin")(xs))

    # NNX's own transforms.
    @functools.partial(nnx.vmap, in_axes=(None, 0))
    def nnx_vmapped_rows(layer, x):
        return jnp.tanh(layer(x))

    nnx_jit_compiled = nnx.jit(lambda layer, xs: jnp.tanh(layer(xs)))

    # Compiled by the unhooked calls below, before any hooked call (the `_vmap` ones
    # with a `vmap` reached by a bound name inside).
    module_compiled = jax.jit(lambda layer, xs: jnp.tanh(layer(xs)))
    params_compiled = jax.jit(lambda params, xs: jnp.tanh(linear(params, xs, W)))
    haiku_compiled = jax.jit(lambda xs: jnp.tanh(hk.Linear(W, name="lin")(xs)))
    module_compiled_vmap = jax.jit(lambda layer, xs: bound_vmap(_tanh_of(layer))(xs))
    params_compiled_vmap = jax.jit(lambda params, xs: bound_vmap(lambda x: jnp.tanh(linear(params, x, W)))(xs))
    haiku_compiled_vmap = jax.jit(lambda xs: bound_vmap(_tanh_of(hk.Linear(W, name="lin")))(xs))
    for compiled in (module_compiled, module_compiled_vmap, nnx_jit_compiled):
        compiled(NNXHost(compiled).lin, XS)
    params_compiled(FUNCTION_PARAMS["lin"], XS)
    params_compiled_vmap(FUNCTION_PARAMS["lin"], XS)
    for compiled in (haiku_compiled, haiku_compiled_vmap):
        hk.without_apply_rng(hk.transform(lambda xs: compiled(xs))).apply(HAIKU_PARAMS, XS)

    return {
        "decorated_vmap": (
            lambda xs: module_rows(hk.Linear(W, name="lin"), xs), module_rows, lambda p, xs: params_rows(p["lin"], xs)
        ),
        "decorated_jit": (lambda xs: haiku_jitted(xs), module_jitted, lambda p, xs: params_jitted(p["lin"], xs)),
        "decorated_filter_jit": (
            lambda xs: haiku_filter_jitted(xs), module_filter_jitted, lambda p, xs: params_filter_jitted(p["lin"], xs)
        ),
        "compiled_before_hooking": (
            lambda xs: haiku_compiled(xs), module_compiled, lambda p, xs: params_compiled(p["lin"], xs)
        ),
        "compiled_before_hooking_vmap_inside": (
            lambda xs: haiku_compiled_vmap(xs), module_compiled_vmap, lambda p, xs: params_compiled_vmap(p["lin"], xs)
        ),
        "decorated_checkpoint": (
            lambda xs: haiku_checkpointed(xs), module_checkpointed, lambda p, xs: params_checkpointed(p["lin"], xs)
        ),
        "nnx_vmap_at_import": (None, nnx_vmapped_rows, None),
        "nnx_jit_compiled_before_hooking": (None, nnx_jit_compiled, None),
        # linen: a bound linen module as an unmapped vmap leaf
        "linen_decorated_vmap": module_rows,
    }


# -- linen: its own lifted transforms, made at import or reached by bound names ----------
ROWS_AXES = dict(variable_axes={"params": None}, split_rngs={"params": False}, in_axes=0)


def linen_made_at_import() -> dict[str, type]:
    """The lifted classes of the linen cells made at import (once per mode, as above)."""
    return {
        "linen_vmap_class_at_import": nn.vmap(nn.Dense, **ROWS_AXES),
        "linen_jit_class_at_import": nn.jit(nn.Dense),
        "linen_jit_compiled_before_hooking": nn.jit(nn.Dense),  # applied unhooked below
        "linen_remat_class_at_import": nn.remat(nn.Dense),
    }


class LinenStep(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        return jnp.tanh(nn.Dense(W, name="lin")(c)), None


# style -> the class of `lin` made in `setup` by a bound name (or: LINEN_AT_IMPORT)
LINEN_BOUND: dict[str, Callable[[], type]] = {
    "linen_bound_vmap": lambda: linen_vmap(nn.Dense, **ROWS_AXES),
    "linen_partial_vmap": lambda: functools.partial(linen_vmap, **ROWS_AXES)(nn.Dense),
    "linen_bound_jit": lambda: linen_jit(nn.Dense),
    "linen_bound_checkpoint": lambda: linen_checkpoint(nn.Dense),
}


class LinenHost(nn.Module):
    """`lin` (or the scan `steps`) made in `setup`, `style` the case, `mode` the set of
    functions made at import it uses. The variables are given, not initialised."""

    style: str
    mode: str

    def setup(self):
        if self.style == "linen_bound_scan":
            scanned = linen_scan(LinenStep, variable_broadcast="params", split_rngs={"params": False}, length=STEPS)
            self.steps = scanned()
        elif self.style in LINEN_BOUND:
            self.lin = LINEN_BOUND[self.style]()(W)
        else:
            self.lin = LINEN_AT_IMPORT[self.mode].get(self.style, nn.Dense)(W)

    def __call__(self, xs):
        if self.style in CLOSURE_STYLES:
            return CLOSURE_STYLES[self.style][0](self.lin, xs)
        if self.style == "decorated_vmap":
            return AT_IMPORT[self.mode]["linen_decorated_vmap"](self.lin, xs)
        if self.style == "linen_bound_scan":
            return self.steps(xs, None)[0]
        if self.style == "linen_bound_cond":
            return linen_cond(jnp.all(xs < 10.0), lambda m, v: jnp.tanh(m.lin(v)), lambda m, v: v, self, xs)
        return jnp.tanh(self.lin(xs))


LINEN_STYLES: dict[str, tuple[str, str]] = {  # style -> (reference family, layer path)
    **{style: ("rows", "lin") for style in LINEN_BOUND},
    **{style: ("rows", "lin") for style in (
        "linen_vmap_class_at_import", "linen_jit_class_at_import", "linen_jit_compiled_before_hooking",
        "linen_remat_class_at_import",
    )},
    "linen_bound_scan": ("loop", "steps.lin"),
    "linen_bound_cond": ("rows", "lin"),
}
# Cells no linen user can write, left out: raw `jax.jit`, `eqx.filter_jit` and
# `jax.checkpoint` decorated at import or compiled before hooking. A bound linen module
# is no JAX type (jit and checkpoint refuse it as an argument) and a function made at
# import cannot close over a module bound in a later call; linen's users write
# `nn.jit`/`nn.remat` (the linen_* cells). Linen has no static loop of its own
# (`nn.while_loop` only, refused like `jax.lax.while_loop`); `jax.lax.fori_loop` over a
# linen module is `linen-bound_fori_loop`. (Flax 0.12 no longer refuses raw JAX
# transforms around bound linen modules: `flax.core.tracers.check_trace_level` is a
# no-op, so the closure styles are cells of linen too.)


# -- the models ---------------------------------------------------------------------------
HAIKU_PARAMS = {"lin": {"w": KERNEL, "b": BIAS}}
FUNCTION_PARAMS = {"lin": {"weights": KERNEL, "bias": BIAS}}
LINEN_VARIABLES = {"params": {"lin": {"kernel": KERNEL, "bias": BIAS}}}


class NNXHost(nnx.Module):
    def __init__(self, body: Callable):
        self.body = body
        self.lin = nnx.Linear(W, W, rngs=nnx.Rngs(0))
        self.lin.kernel[...] = KERNEL
        self.lin.bias[...] = BIAS

    def __call__(self, xs):
        return self.body(self.lin, xs)


def haiku_model(style: str, mode: str) -> Any:
    if style in CLOSURE_STYLES:
        body = CLOSURE_STYLES[style][0]
        forward = lambda xs: body(hk.Linear(W, name="lin"), xs)
    else:
        forward = AT_IMPORT[mode][style][0]
    return px.from_haiku(hk.without_apply_rng(hk.transform(forward)), HAIKU_PARAMS)


def nnx_model(style: str, mode: str) -> Any:
    body = CLOSURE_STYLES[style][0] if style in CLOSURE_STYLES else AT_IMPORT[mode][style][1]
    return px.from_nnx(NNXHost(body))


def function_model(style: str, mode: str) -> Any:
    if style in CLOSURE_STYLES:
        body = CLOSURE_STYLES[style][0]
        model = lambda params, xs: body(lambda v: linear(params["lin"], v, W), xs)
    else:
        model = AT_IMPORT[mode][style][2]
    return px.from_function(model, FUNCTION_PARAMS, layers=[linear])


def linen_model(style: str, mode: str) -> Any:
    variables = {"params": {"steps": LINEN_VARIABLES["params"]}} if style == "linen_bound_scan" else LINEN_VARIABLES
    return px.from_linen(LinenHost(style, mode), variables)


# Everything "made at import" is made now, one set per mode; the jits "compiled before
# hooking" are traced and compiled by unhooked calls now.
AT_IMPORT = {mode: made_at_import() for mode in MODES}
LINEN_AT_IMPORT = {mode: linen_made_at_import() for mode in MODES}
for _mode in MODES:
    LinenHost("linen_jit_compiled_before_hooking", _mode).apply(LINEN_VARIABLES, XS)


# -- the matrix ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    build: Callable[[str], Any]  # mode -> the converted model
    family: str = "rows"  # the reference (REFERENCES)
    path: str = "lin"
    refused: str | None = None  # when refused: a regex naming the layer and the transform
    unhooked_leaks: bool = False  # see HAIKU_UNHOOKED_LEAKS


def _family(style: str) -> str:
    return CLOSURE_STYLES[style][1] if style in CLOSURE_STYLES else "rows"


# `@jax.checkpoint` applied at import is refused (docs/engine.md, the transform table),
# naming the layer, the transform and the function it was applied to.
_CHECKPOINT_OF = r"under (jax\.checkpoint|'checkpoint / remat') of '{}'"
CHECKPOINT_REFUSED = {
    "haiku": r"\['lin'\][\s\S]*" + _CHECKPOINT_OF.format("haiku_checkpointed"),
    # The module reaches the checkpoint as an argument: named by its type.
    "nnx": r"a Linear[\s\S]*" + _CHECKPOINT_OF.format("module_checkpointed"),
    "function": r"'linear'[\s\S]*" + _CHECKPOINT_OF.format("params_checkpointed"),
}


# A Haiku jit made outside hk.transform reads its params from Haiku's frame, i.e. closes
# over them. When its trace is made under an outer jit, JAX's own jit cache keeps those
# outer tracers: the unhooked model fails `jax.checking_leaks()` (jax 0.12, haiku
# 0.0.17, without peex_interop imported too). Compiled eagerly first, it leaks only once
# JAX's cache has evicted that eager trace (many jits later: test order decides). The
# unhooked call of these cells runs outside `checking_leaks`; the hooked calls miss that
# cache (px's own trace context) and run under it.
HAIKU_UNHOOKED_LEAKS = (
    "decorated_jit", "decorated_filter_jit", "compiled_before_hooking", "compiled_before_hooking_vmap_inside"
)
LIBRARIES = {"haiku": haiku_model, "nnx": nnx_model, "function": function_model}

CASES: dict[str, Case] = {}
for _style in CLOSURE_STYLES:
    for _library, _build in (*LIBRARIES.items(), ("linen", linen_model)):
        CASES[f"{_library}-{_style}"] = Case(
            functools.partial(_build, _style), _family(_style), refused=REFUSED_STYLES.get(_style)
        )
for _style, _cells in AT_IMPORT[MODES[0]].items():
    if _style.startswith("linen_"):
        continue
    for (_library, _build), _cell in zip(LIBRARIES.items(), _cells):
        if _cell is None:
            continue
        _case = Case(functools.partial(_build, _style))
        if _library == "haiku" and _style in HAIKU_UNHOOKED_LEAKS:
            _case = dataclasses.replace(_case, unhooked_leaks=True)
        if _style == "decorated_checkpoint":
            _case = dataclasses.replace(_case, refused=CHECKPOINT_REFUSED[_library])
        CASES[f"{_library}-{_style}"] = _case
CASES["linen-decorated_vmap"] = Case(functools.partial(linen_model, "decorated_vmap"))
for _style, (_family_name, _path) in LINEN_STYLES.items():
    CASES[f"linen-{_style}"] = Case(functools.partial(linen_model, _style), _family_name, _path)


@functools.cache
def built(name: str, mode: str) -> tuple:
    case = CASES[name]
    make_reference, shape = REFERENCES[case.family]
    return case.build(mode), make_reference(case.path), {case.path: shape}


def check_refused_naming(mode: str, model: Any, path: str, naming: str) -> None:
    """Logs, edits and backward slots of `path` raise `px.TransformError` matching
    `naming` (the layer and the transform that encloses it)."""
    with jax.checking_leaks():
        for hooked in (
            px.ForwardHook(model, log_fn=px.IdentityLog(), where=path),
            px.ForwardHook(model, hook_fn=lambda y: y + 1.0, where=path),
        ):
            with pytest.raises(px.TransformError, match=naming):
                _in(mode, _call)(hooked, (XS,))
        with pytest.raises(px.TransformError, match=naming):
            backward = px.BackwardHook(model, log_fn=px.IdentityLog(), where=path).init(XS)
            _in(mode, _grad)(backward, (XS,))


def matrix():
    for name in sorted(CASES):
        for mode in MODES:
            yield pytest.param(name, mode, id=f"{name}-{mode}")


@pytest.mark.parametrize("name, mode", list(matrix()))
def test_import_style(name, mode):
    case = CASES[name]
    model, reference, shapes = built(name, mode)
    if case.refused:
        check_refused_naming(mode, model, case.path, case.refused)
    else:
        check_threaded(mode, model, (XS,), reference, shapes, unhooked_leaks=case.unhooked_leaks)


def test_the_references_are_the_unhooked_models():
    # Each converted model computes its reference at delta = 0 unhooked, so a reference
    # cannot agree with a hooked model by sharing a mistake with it.
    for name in sorted(CASES):
        model, reference, shapes = built(name, MODES[0])
        out, _ = reference({p: jnp.zeros(s) for p, s in shapes.items()})
        np.testing.assert_allclose(np.asarray(model(XS)), np.asarray(out), rtol=1e-5, atol=1e-5, err_msg=name)


# -- a jit made before hooking never replays another hooked call's trace -----------------
# Fresh jits per test (so the outcome does not depend on test order), made and compiled
# by an unhooked call before the hooked calls. The first hooked call only edits; each
# later one must get its own hooks: another edit, then logs. (The matrix above logs
# first, which hides this.)
def _fresh_jit(library: str, kind: str) -> tuple[Any, jax.Array]:
    """A model calling a fresh jit of `kind`, and its input."""
    if library == "equinox":
        # eqx.nn.Linear maps one row: `jit` takes one (the layer called in the jit's own
        # body), `jit_vmap_inside` maps the rows in the jit's body.
        inner = {"jit": lambda m, x: jnp.tanh(m(x)), "jit_vmap_inside": lambda m, xs: bound_vmap(_tanh_of(m))(xs)}[kind]
        jitted = jax.jit(inner)

        class Host(eqx.Module):
            lin: eqx.nn.Linear

            def __call__(self, xs):
                return jitted(self.lin, xs)

        layer = eqx.nn.Linear(W, W, key=jax.random.key(0))
        layer = eqx.tree_at(lambda m: (m.weight, m.bias), layer, (KERNEL.T, BIAS))
        return Host(layer), XS[0] if kind == "jit" else XS
    if library == "haiku":
        inner = {"jit": lambda xs: jnp.tanh(hk.Linear(W, name="lin")(xs)),
                 "jit_vmap_inside": lambda xs: bound_vmap(_tanh_of(hk.Linear(W, name="lin")))(xs)}[kind]
        jitted = jax.jit(inner)
        return px.from_haiku(hk.without_apply_rng(hk.transform(lambda xs: jitted(xs))), HAIKU_PARAMS), XS
    if library == "function":
        inner = {"jit": lambda p, xs: jnp.tanh(linear(p, xs, W)),
                 "jit_vmap_inside": lambda p, xs: bound_vmap(lambda x: jnp.tanh(linear(p, x, W)))(xs)}[kind]
        jitted = jax.jit(inner)
        return px.from_function(lambda params, xs: jitted(params["lin"], xs), FUNCTION_PARAMS, layers=[linear]), XS
    if library == "nnx":
        jitted = {"jit": lambda: jax.jit(lambda m, xs: jnp.tanh(m(xs))),
                  "jit_vmap_inside": lambda: jax.jit(lambda m, xs: bound_vmap(_tanh_of(m))(xs)),
                  "nnx_jit": lambda: nnx.jit(lambda m, xs: jnp.tanh(m(xs)))}[kind]()
        return px.from_nnx(NNXHost(jitted)), XS
    assert (library, kind) == ("linen", "linen_jit")
    dense = nn.jit(nn.Dense)

    class Jitted(nn.Module):
        def setup(self):
            self.lin = dense(W)

        def __call__(self, xs):
            return jnp.tanh(self.lin(xs))

    return px.from_linen(Jitted(), LINEN_VARIABLES), XS


REPLAYED = [
    ("equinox", "jit"), ("equinox", "jit_vmap_inside"), ("haiku", "jit"), ("haiku", "jit_vmap_inside"),
    ("function", "jit"), ("function", "jit_vmap_inside"), ("nnx", "jit"), ("nnx", "jit_vmap_inside"),
    ("nnx", "nnx_jit"), ("linen", "linen_jit"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("library, kind", REPLAYED, ids=[f"{lib}-{kind}" for lib, kind in REPLAYED])
def test_a_later_hooked_call_never_replays_an_edit_only_one(library, kind, mode):
    model, xs = _fresh_jit(library, kind)
    y = xs @ KERNEL + BIAS  # the layer's output, by hand
    close_to = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    close_to(model(xs), jnp.tanh(y))  # compiled, unhooked
    with jax.checking_leaks():
        for shift in (1.0, -1.0):
            edited, _ = _in(mode, _call)(px.ForwardHook(model, hook_fn=lambda v: v + shift), (xs,))
            close_to(edited, jnp.tanh(y + shift))
        _, log = _in(mode, _call)(px.ForwardHook(model, log_fn=px.IdentityLog()), (xs,))
    assert set(log) == {"lin"}
    close_to(log["lin"], y)
