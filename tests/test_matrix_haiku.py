"""Issue 9's transform matrix for Haiku: {eager, filter_jit} x Haiku's own transforms
(and plain JAX ones where Haiku allows them) x {around a layer, nested in hk.vmap}.

Each case is a Haiku forward function and an independent reference: the same
computation with the transform written out (Python loops over steps, `jnp.where` for
branch selection, `x @ w + b` with the params by hand). See `matrix_check.py`.
"""

import dataclasses
import functools
from collections.abc import Callable

import pytest

pytest.importorskip("haiku")  # skipped where the [haiku] extra is not installed

import haiku as hk
import jax
import jax.numpy as jnp

import peex_interop as px
from matrix_check import MODES, check_refused, check_threaded, nested
from models import close

W, STEPS, B = 3, 3, 2


def linear(params: dict, name: str, x: jax.Array) -> jax.Array:
    return x @ params[name]["w"] + params[name]["b"]


def block(x):
    return jnp.tanh(hk.Linear(W, name="lin")(x))


def loop_reference(step: Callable) -> Callable:
    """Reference of `STEPS` steps of `c -> tanh(step(c) + delta[i])`, logging the
    pre-activations per step."""

    def reference(params, deltas, x, *extra):
        ys = []
        for i in range(STEPS):
            ys.append(step(params, x) + deltas["lin"][i])
            x = jnp.tanh(ys[-1])
        return x, {"lin": jnp.stack(ys)}

    return reference


def block_reference(params, deltas, x, *extra):
    y = linear(params, "lin", x) + deltas["lin"]
    return jnp.tanh(y), {"lin": y}


def branches_reference(names: tuple[str, ...], index_of: Callable) -> Callable:
    """Reference of a cond/switch over layers `names`: every branch computed, the
    taken one selected; layers of branches not taken log zeros."""

    def reference(params, deltas, x, selector):
        index = index_of(selector)
        ys = {n: linear(params, n, x) + deltas[n] for n in names}
        out = sum(jnp.where(index == i, ys[n], 0.0) for i, n in enumerate(names))
        return out, {n: jnp.where(index == i, ys[n], 0.0) for i, n in enumerate(names)}

    return reference


# -- forward functions -----------------------------------------------------------------
def vmap_fwd(xs):
    return hk.vmap(block, split_rng=False)(xs)


def scan_fwd(x):
    lin = hk.Linear(W, name="lin")
    return hk.scan(lambda c, _: (jnp.tanh(lin(c)), None), x, None, length=STEPS)[0]


def map_fwd(xs):
    # Created outside: hk.map (a scan) unrolls one step at init, then would build a
    # second `lin` inside its body.
    lin = hk.Linear(W, name="lin")
    return hk.map(lambda r: jnp.tanh(lin(r)), xs)


def two_branches():
    return hk.Linear(W, name="a"), hk.Linear(W, name="b")


def cond_positional_fwd(x, pred):
    a, b = two_branches()
    if hk.running_init():  # Haiku creates no params inside a branch
        return a(x) + b(x)
    return hk.cond(pred, a, b, x)


def cond_keyword_fwd(x, pred):
    a, b = two_branches()
    if hk.running_init():
        return a(x) + b(x)
    return hk.cond(pred=pred, true_fun=a, false_fun=b, operand=x)


def switch_fwd(x, index):
    layers = [hk.Linear(W, name=n) for n in "abc"]
    if hk.running_init():
        return sum(layer(x) for layer in layers)
    return hk.switch(index, layers, x)


def fori_fwd(x, upper=STEPS):
    lin = hk.Linear(W, name="lin")
    return hk.fori_loop(0, upper, lambda i, c: jnp.tanh(lin(c)), x)


def while_fwd(x):
    lin = hk.Linear(W, name="lin")
    if hk.running_init():
        return lin(x)
    return hk.while_loop(lambda c: c[0] < STEPS, lambda c: (c[0] + 1, jnp.tanh(lin(c[1]))), (0, x))[1]


def remat_fwd(x):
    return hk.remat(block)(x)


def remat_static_fwd(static_argnums):
    def forward(x):
        scaled = lambda x, k: block(x) * k
        return hk.remat(scaled, static_argnums=static_argnums)(x, 2.0)

    return forward


def layer_stack_fwd(x):
    return hk.experimental.layer_stack(STEPS)(block)(x)


def jit_inside_fwd(x):
    if hk.running_init():  # params created inside a jit trace would leak
        return block(x)
    # A fresh function per call: a `jax.jit` inside a Haiku function closes over the
    # parameters it reads (Haiku asks for `hk.jit`), and JAX's trace cache, keyed on
    # the function, would replay them (stale arrays, or another test's tracers).
    return jax.jit(lambda x: block(x))(x)


# Created at import, before any hooking: the engine cannot thread logs out of it.
block_jitted_at_import = jax.jit(block)


def jit_created_before_fwd(jitted: Callable) -> Callable:
    def forward(x):
        if hk.running_init():
            return block(x)
        return jitted(x)

    return forward


def vmap_in_fori_fwd(xs):
    lin = hk.Linear(W, name="lin")
    rows = hk.vmap(lambda r: jnp.tanh(lin(r)), split_rng=False)
    return hk.fori_loop(0, STEPS, lambda i, c: rows(c), xs)


def vmap_in_while_fwd(xs):
    lin = hk.Linear(W, name="lin")
    rows = hk.vmap(lambda r: jnp.tanh(lin(r)), split_rng=False)
    if hk.running_init():
        return rows(xs)
    return hk.while_loop(lambda c: c[0] < STEPS, lambda c: (c[0] + 1, rows(c[1])), (0, xs))[1]


def remat_static_reference(params, deltas, x):
    out, logs = block_reference(params, deltas, x)
    return out * 2.0, logs


def layer_stack_reference(params, deltas, x):
    stack = params["__layer_stack_no_per_layer/lin"]
    one = lambda i: {"lin": {"w": stack["w"][i], "b": stack["b"][i]}}
    ys = []
    for i in range(STEPS):
        ys.append(linear(one(i), "lin", x) + deltas["lin"][i])
        x = jnp.tanh(ys[-1])
    return x, {"lin": jnp.stack(ys)}


@dataclasses.dataclass(frozen=True)
class Case:
    forward: Callable
    reference: Callable  # (params, deltas, x, *extra) -> (output, {path: log})
    shapes: dict  # path -> log shape of one call
    x_shape: tuple = (W,)
    extra: tuple = ()  # further call arguments
    nested_extra: tuple = ()  # the same when nested in hk.vmap (None: not mapped)
    refused: tuple = ()  # modes in which logs are refused
    init_refused: tuple = ()  # modes in which only BackwardHook.init refuses

    def nested_extra_axes(self) -> tuple:
        return tuple(None if e is None else 0 for e in self.nested_extra)


STEP_SHAPE = {"lin": (STEPS, W)}
BLOCK_SHAPE = {"lin": (W,)}
layer_step = loop_reference(lambda p, c: linear(p, "lin", c))

CASES = {
    "vmap": Case(vmap_fwd, block_reference, {"lin": (B, W)}, x_shape=(B, W)),
    "scan": Case(scan_fwd, layer_step, STEP_SHAPE),
    "map": Case(map_fwd, lambda p, d, xs: block_reference(p, d, xs), STEP_SHAPE, x_shape=(STEPS, W)),
    "cond_positional": Case(
        cond_positional_fwd, branches_reference(("a", "b"), lambda pred: 1 - pred.astype(int)),
        {"a": (W,), "b": (W,)}, extra=(jnp.asarray(False),), nested_extra=(jnp.asarray([True, False]),),
    ),
    "cond_keyword": Case(
        cond_keyword_fwd, branches_reference(("a", "b"), lambda pred: 1 - pred.astype(int)),
        {"a": (W,), "b": (W,)}, extra=(jnp.asarray(True),), nested_extra=(jnp.asarray([False, True]),),
    ),
    "switch": Case(
        switch_fwd, branches_reference(("a", "b", "c"), lambda index: index),
        {n: (W,) for n in "abc"}, extra=(jnp.asarray(2),), nested_extra=(jnp.asarray([1, 0]),),
    ),
    "fori_static": Case(fori_fwd, layer_step, STEP_SHAPE),
    # Eager, concrete bounds make JAX itself use a scan: logs; under jit they are traced.
    "fori_traced": Case(
        fori_fwd, layer_step, STEP_SHAPE, extra=(jnp.asarray(STEPS),),
        nested_extra=(None,), refused=("filter_jit",), init_refused=("eager",),
    ),
    "while": Case(while_fwd, layer_step, STEP_SHAPE, refused=MODES),
    "remat": Case(remat_fwd, block_reference, BLOCK_SHAPE),
    "remat_static_argnums": Case(remat_static_fwd((1,)), remat_static_reference, BLOCK_SHAPE),
    "remat_negative_static_argnums": Case(remat_static_fwd((-1,)), remat_static_reference, BLOCK_SHAPE),
    "layer_stack": Case(layer_stack_fwd, layer_stack_reference, STEP_SHAPE),
    "jit_inside": Case(jit_inside_fwd, block_reference, BLOCK_SHAPE),
    # The example: a threaded transform inside another one.
    "vmap_in_fori": Case(vmap_in_fori_fwd, layer_step, {"lin": (STEPS, B, W)}, x_shape=(B, W)),
    "vmap_in_while": Case(
        vmap_in_while_fwd, layer_step, {"lin": (STEPS, B, W)}, x_shape=(B, W), refused=MODES
    ),
}


def build(case: Case, where: str) -> tuple:
    """(model, args, reference, shapes) of a case, around a layer or nested in an
    hk.vmap over a batch of `B`."""
    x = jax.random.normal(jax.random.key(1), case.x_shape)
    forward, extra, shapes = case.forward, case.extra, case.shapes
    if where == "nested":
        x = jax.random.normal(jax.random.key(2), (B, *case.x_shape))
        extra = tuple(e if b is None else b for e, b in zip(case.extra, case.nested_extra))
        forward = lambda xs, *e: hk.vmap(
            case.forward, in_axes=(0, *case.nested_extra_axes()), split_rng=False
        )(xs, *e)
        shapes = {p: (B, *s) for p, s in case.shapes.items()}
    params = hk.transform(forward).init(jax.random.key(0), x, *extra)
    model = px.from_haiku(hk.without_apply_rng(hk.transform(forward)), params)
    reference = functools.partial(case.reference, params)
    if where == "nested":
        reference = nested(reference, (0, *case.nested_extra_axes()))
    args = (x, *extra)
    return model, args, lambda deltas: reference(deltas, *args), shapes


built = functools.cache(lambda name, where: build(CASES[name], where))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["around", "nested"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matrix(name, where, mode):
    case = CASES[name]
    model, args, reference, shapes = built(name, where)
    if mode in case.refused:
        check_refused(mode, model, args, reference, shapes)
    else:
        check_threaded(mode, model, args, reference, shapes, init_refused=mode in case.init_refused)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["around", "nested"])
def test_jit_created_before_hooking_is_threaded(where, mode):
    # A fresh jit of a fresh function per test (JAX's trace cache is keyed on the
    # function), so the outcome does not depend on test order; compiled before hooking
    # by a plain eager call. (A jit closing over Haiku's parameters whose first call is
    # traced inside another jit keeps that trace's tracers in JAX's cache, unhooked
    # too: the plain call of `check_threaded` would fail `checking_leaks`.)
    case = Case(jit_created_before_fwd(jax.jit(lambda x: block(x))), block_reference, BLOCK_SHAPE)
    model, args, *rest = build(case, where)
    model(*args)
    check_threaded(mode, model, args, *rest)


def test_jit_created_at_import_never_replays_another_hooked_call():
    case = Case(jit_created_before_fwd(block_jitted_at_import), block_reference, BLOCK_SHAPE)
    model, args, reference, _ = build(case, "around")
    # A call that selects nothing lets JAX cache the jit's trace (no call site selected
    # inside it) ...
    plain, log = px.ForwardHook(model, where=lambda path, module: False)(*args)
    close(plain, reference({"lin": jnp.zeros(W)})[0])
    assert log == {}
    # ... which no later call selecting the layer replays: each gets its own hooks.
    ones = {"lin": jnp.ones(W)}
    edited, _ = px.ForwardHook(model, where="lin", hook_fn=lambda y: y + 1.0)(*args)
    close(edited, reference(ones)[0])
    doubled, _ = px.ForwardHook(model, where="lin", hook_fn=lambda y: 2 * y)(*args)
    close(doubled, reference({"lin": reference({"lin": jnp.zeros(W)})[1]["lin"]})[0])
    _, log = px.ForwardHook(model, where="lin", log_fn=px.IdentityLog())(*args)
    close(log["lin"], reference({"lin": jnp.zeros(W)})[1]["lin"])
