"""Issue 9's transform matrix for Flax NNX: {eager, filter_jit} x NNX's own transforms
(and plain JAX ones inside NNX modules) x {around a layer, nested in nnx.vmap}.

Each case is an NNX module and an independent reference: the same computation with
the transform written out (Python loops over steps, `jnp.where` for branch selection,
the submodules called directly, unhooked). See `matrix_check.py`.
"""

import dataclasses
import functools
import textwrap
from collections.abc import Callable

import pytest

pytest.importorskip("flax")  # skipped where the [nnx] extra is not installed

import jax
import jax.numpy as jnp
from flax import nnx

import peex_interop as px
from matrix_check import MODES, check_refused, check_threaded, nested
from models import run_on_8_cpu_devices

W, STEPS, B = 3, 3, 2


class Layers(nnx.Module):
    """Linear layers `lin`, `a`, `b`, `c` and a stack of `STEPS` linears `blocks`;
    `body(self, x, *extra)` is the case."""

    def __init__(self, body: Callable, rngs: nnx.Rngs):
        self.body = body
        self.lin = nnx.Linear(W, W, rngs=rngs)
        self.a = nnx.Linear(W, W, rngs=rngs)
        self.b = nnx.Linear(W, W, rngs=rngs)
        self.c = nnx.Linear(W, W, rngs=rngs)
        self.blocks = nnx.vmap(lambda key: nnx.Linear(W, W, rngs=nnx.Rngs(key)))(jax.random.split(rngs.params(), STEPS))

    def __call__(self, x, *extra):
        return self.body(self, x, *extra)


class InVmap(nnx.Module):
    """A case run by `nnx.vmap` over a batch: the case's layers sit under `m`."""

    def __init__(self, m: Layers, extra_axes: tuple):
        self.m = m
        self.extra_axes = extra_axes

    def __call__(self, xs, *extra):
        return nnx.vmap(lambda m, x, *e: m(x, *e), in_axes=(None, 0, *self.extra_axes))(self.m, xs, *extra)


def tanh_of(layer: nnx.Module) -> Callable:
    return lambda x: jnp.tanh(layer(x))


# -- bodies ------------------------------------------------------------------------------
def vmap_body(self, xs):
    return nnx.vmap(lambda m, x: jnp.tanh(m(x)), in_axes=(None, 0))(self.lin, xs)


def scan_body(self, x):
    return nnx.scan(
        lambda c, m: jnp.tanh(m(c)), in_axes=(nnx.Carry, None), out_axes=nnx.Carry, length=STEPS
    )(x, self.lin)


def scan_stack_body(self, x):
    # NNX's layer stack: layers made by nnx.vmap, run by nnx.scan.
    return nnx.scan(lambda c, m: jnp.tanh(m(c)), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)


def cond_operands_body(self, x, pred):
    # Modules passed as operands, as NNX recommends.
    return nnx.cond(pred, lambda m, x: m.a(x), lambda m, x: m.b(x), self, x)


def cond_keyword_body(self, x, pred):
    return jax.lax.cond(pred, true_fun=self.a, false_fun=self.b, operand=x)


def switch_body(self, x, index):
    return nnx.switch(index, [lambda m, x: m.a(x), lambda m, x: m.b(x), lambda m, x: m.c(x)], self, x)


def lax_switch_body(self, x, index):
    return jax.lax.switch(index, [self.a, self.b, self.c], x)


def fori_body(self, x, upper=STEPS):
    # The module in the carry, as NNX's docs do.
    return nnx.fori_loop(0, upper, lambda i, mx: (mx[0], jnp.tanh(mx[0](mx[1]))), (self.lin, x))[1]


def fori_tree_body(self, x):
    # Tree mode runs the loop without NNX's graph-mode eval_shape pass.
    return nnx.fori_loop(0, STEPS, lambda i, mx: (mx[0], jnp.tanh(mx[0](mx[1]))), (self.lin, x), graph=False)[1]


def fori_closure_body(self, x):
    return nnx.fori_loop(0, STEPS, lambda i, c: jnp.tanh(self.lin(c)), x)


def while_body(self, x):
    return nnx.while_loop(
        lambda c: c[0] < STEPS, lambda c: (c[0] + 1, c[1], jnp.tanh(c[1](c[2]))), (0, self.lin, x)
    )[2]


def while_closure_body(self, x):
    return nnx.while_loop(lambda c: c[0] < STEPS, lambda c: (c[0] + 1, jnp.tanh(self.lin(c[1]))), (0, x))[1]


def jit_inside_body(self, x):
    return nnx.jit(lambda m, x: jnp.tanh(m(x)))(self.lin, x)


def remat_body(self, x):
    return nnx.remat(lambda m, x: jnp.tanh(m(x)))(self.lin, x)


def lax_map_body(self, xs):
    return jax.lax.map(tanh_of(self.lin), xs)


def checkpoint_static_body(static_argnums):
    # The layer is an argument: a jax.checkpoint with static_argnums closing over
    # arrays leaks them under jax.checking_leaks by itself, hooked or not (jax 0.12).
    def body(self, x):
        return jax.checkpoint(lambda m, x, k: jnp.tanh(m(x)) * k, static_argnums=static_argnums)(self.lin, x, 2.0)

    return body


# NNX itself refuses a module closed over from outside a loop body into an nnx.vmap
# ("Cannot extract graph node from different trace level"): it goes in the carry.
def rows(m, xs):
    return nnx.vmap(lambda m, r: jnp.tanh(m(r)), in_axes=(None, 0))(m, xs)


def vmap_in_fori_body(self, xs):
    return nnx.fori_loop(0, STEPS, lambda i, mc: (mc[0], rows(*mc)), (self.lin, xs))[1]


def vmap_in_while_body(self, xs):
    return nnx.while_loop(lambda c: c[0] < STEPS, lambda c: (c[0] + 1, c[1], rows(c[1], c[2])), (0, self.lin, xs))[2]


# Created at import, before any hooking: traced in a deferred scope, logs carried out.
nnx_jitted_at_import = nnx.jit(lambda m, x: jnp.tanh(m(x)))
jax_jitted_at_import = jax.jit(lambda m, x: jnp.tanh(m(x)))


def jitted_before_body(jitted: Callable) -> Callable:
    return lambda self, x: jitted(self.lin, x)


# -- references: the same computations, unhooked and without the transform -------------
def block_reference(m, deltas, x, *extra):
    y = m.lin(x) + deltas["lin"]
    return jnp.tanh(y), {"lin": y}


def loop_reference(layer_at: Callable, path: str = "lin") -> Callable:
    def reference(m, deltas, x, *extra):
        ys = []
        for i in range(STEPS):
            ys.append(layer_at(m, i)(x) + deltas[path][i])
            x = jnp.tanh(ys[-1])
        return x, {path: jnp.stack(ys)}

    return reference


def stacked_layer(m, i):
    return lambda x: x @ m.blocks.kernel[i] + m.blocks.bias[i]


def branches_reference(names: tuple[str, ...], index_of: Callable) -> Callable:
    def reference(m, deltas, x, selector):
        index = index_of(selector)
        ys = {n: getattr(m, n)(x) + deltas[n] for n in names}
        out = sum(jnp.where(index == i, ys[n], 0.0) for i, n in enumerate(names))
        return out, {n: jnp.where(index == i, ys[n], 0.0) for i, n in enumerate(names)}

    return reference


def scaled_reference(m, deltas, x):
    out, logs = block_reference(m, deltas, x)
    return out * 2.0, logs


@dataclasses.dataclass(frozen=True)
class Case:
    body: Callable
    reference: Callable  # (module, deltas, x, *extra) -> (output, {path: log})
    shapes: dict  # path -> log shape of one call
    x_shape: tuple = (W,)
    extra: tuple = ()
    nested_extra: tuple = ()  # the extras when nested in nnx.vmap (None: not mapped)
    refused: tuple = ()  # modes in which logs are refused
    init_refused: tuple = ()  # modes in which only BackwardHook.init refuses
    # The layer reaches an unthreaded transform as an argument (a while_loop carry, a
    # jit's argument): errors name its type, edits are refused too.
    passed_through: bool = False

    def nested_extra_axes(self) -> tuple:
        return tuple(None if e is None else 0 for e in self.nested_extra)


STEP_SHAPE = {"lin": (STEPS, W)}
BLOCK_SHAPE = {"lin": (W,)}
layer_step = loop_reference(lambda m, i: m.lin)
cond_reference = branches_reference(("a", "b"), lambda pred: 1 - pred.astype(int))
switch_reference = branches_reference(("a", "b", "c"), lambda index: index)
AB, ABC = {"a": (W,), "b": (W,)}, {n: (W,) for n in "abc"}
PREDS = dict(extra=(jnp.asarray(False),), nested_extra=(jnp.asarray([True, False]),))
INDICES = dict(extra=(jnp.asarray(2),), nested_extra=(jnp.asarray([1, 0]),))

CASES = {
    "vmap": Case(vmap_body, block_reference, {"lin": (B, W)}, x_shape=(B, W)),
    "scan": Case(scan_body, layer_step, STEP_SHAPE),
    "scan_stack": Case(scan_stack_body, loop_reference(stacked_layer, "blocks"), {"blocks": (STEPS, W)}),
    "cond_operands": Case(cond_operands_body, cond_reference, AB, **PREDS),
    "lax_cond_keyword": Case(
        cond_keyword_body, cond_reference, AB, extra=(jnp.asarray(True),), nested_extra=(jnp.asarray([False, True]),)
    ),
    "switch": Case(switch_body, switch_reference, ABC, **INDICES),
    "lax_switch": Case(lax_switch_body, switch_reference, ABC, **INDICES),
    "fori_static": Case(fori_body, layer_step, STEP_SHAPE),
    # Eager, concrete bounds make JAX itself use a scan: logs; under jit they are traced.
    "fori_traced": Case(
        fori_body, layer_step, STEP_SHAPE, extra=(jnp.asarray(STEPS),), nested_extra=(None,),
        refused=("filter_jit",), init_refused=("eager",), passed_through=True,
    ),
    "fori_static_closure": Case(fori_closure_body, layer_step, STEP_SHAPE),
    "fori_static_tree_mode": Case(fori_tree_body, layer_step, STEP_SHAPE),
    "while": Case(while_body, layer_step, STEP_SHAPE, refused=MODES, passed_through=True),
    "while_closure": Case(while_closure_body, layer_step, STEP_SHAPE, refused=MODES),
    "jit_inside": Case(jit_inside_body, block_reference, BLOCK_SHAPE),
    "remat": Case(remat_body, block_reference, BLOCK_SHAPE),
    "lax_map": Case(lax_map_body, block_reference, STEP_SHAPE, x_shape=(STEPS, W)),
    "checkpoint_static_argnums": Case(checkpoint_static_body((2,)), scaled_reference, BLOCK_SHAPE),
    "checkpoint_negative_static_argnums": Case(checkpoint_static_body((-1,)), scaled_reference, BLOCK_SHAPE),
    # The example: a threaded transform inside another one.
    "vmap_in_fori": Case(vmap_in_fori_body, layer_step, {"lin": (STEPS, B, W)}, x_shape=(B, W)),
    "vmap_in_while": Case(
        vmap_in_while_body, layer_step, {"lin": (STEPS, B, W)}, x_shape=(B, W), refused=MODES,
        passed_through=True,
    ),
    "nnx_jit_at_import": Case(
        jitted_before_body(nnx_jitted_at_import), block_reference, BLOCK_SHAPE
    ),
    "jax_jit_at_import": Case(
        jitted_before_body(jax_jitted_at_import), block_reference, BLOCK_SHAPE
    ),
}


def build(case: Case, where: str) -> tuple:
    """(model, args, reference, shapes) of a case, around a layer or nested in an
    nnx.vmap over a batch of `B`."""
    live = Layers(case.body, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), case.x_shape)
    extra, shapes, reference = case.extra, case.shapes, functools.partial(case.reference, live)
    if where == "nested":
        x = jax.random.normal(jax.random.key(2), (B, *case.x_shape))
        extra = tuple(e if b is None else b for e, b in zip(case.extra, case.nested_extra))
        live = InVmap(live, case.nested_extra_axes())
        shapes = {f"m.{p}": (B, *s) for p, s in case.shapes.items()}
        batched = nested(reference, (0, *case.nested_extra_axes()))

        def reference(deltas, *args):
            out, logs = batched({p: deltas[f"m.{p}"] for p in case.shapes}, *args)
            return out, {f"m.{p}": log for p, log in logs.items()}

    args = (x, *extra)
    return px.from_nnx(live), args, lambda deltas: reference(deltas, *args), shapes


built = functools.cache(lambda name, where: build(CASES[name], where))



def matrix():
    for name in sorted(CASES):
        for where in ("around", "nested"):
            for mode in MODES:
                yield pytest.param(name, where, mode, id=f"{name}-{where}-{mode}")


@pytest.mark.parametrize("name, where, mode", list(matrix()))
def test_matrix(name, where, mode):
    case = CASES[name]
    model, args, reference, shapes = built(name, where)
    unnamed = "Linear" if case.passed_through else None
    if mode in case.refused:
        check_refused(mode, model, args, reference, shapes, unnamed=unnamed)
    else:
        check_threaded(mode, model, args, reference, shapes, init_refused=mode in case.init_refused, unnamed=unnamed)


# shard_map needs several devices: 8 simulated CPU devices, set before JAX starts, so
# in a subprocess. The checks are the matrix's own (`matrix_check`).
SHARD_MAP = textwrap.dedent('''
    import jax, jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    import peex_interop as px
    from matrix_check import check_threaded, MODES

    assert jax.device_count() == 8
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    W, LOCAL = 3, 2

    def rows(m, x):
        return nnx.vmap(lambda m, r: jnp.tanh(m(r)), in_axes=(None, 0))(m, x)

    BODIES = {
        "around": lambda m, x: jnp.tanh(m(x)),
        "vmap_inside": rows,  # a threaded transform nested in the shard_map body
    }

    class Sharded(nnx.Module):
        def __init__(self, body):
            self.body = body
            self.lin = nnx.Linear(W, W, rngs=nnx.Rngs(0))

        def __call__(self, xs):
            return jax.shard_map(self.body, mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d"))(self.lin, xs)

    xs = jax.random.normal(jax.random.key(1), (8 * LOCAL, W))
    xs = jax.device_put(xs, NamedSharding(mesh, P("d")))
    for name, body in BODIES.items():
        live = Sharded(body)

        def reference(deltas):
            # One (LOCAL, W) block per device, in mesh order.
            y = live.lin(xs).reshape(8, LOCAL, W) + deltas["lin"]
            return jnp.tanh(y).reshape(8 * LOCAL, W), {"lin": y}

        for mode in MODES:
            check_threaded(mode, px.from_nnx(live), (xs,), reference, {"lin": (8, LOCAL, W)})
            print(name, mode)
''')


def test_shard_map_on_8_cpu_devices():
    lines = run_on_8_cpu_devices(SHARD_MAP)
    assert lines == [f"{n} {m}" for n in ("around", "vmap_inside") for m in MODES]
