"""The canary for a new JAX release: every assumption `peex_interop/_engine/_jax.py` makes
about JAX's internals, asserted directly, one test per item. On a release that moves
one, the first failure here names it (the engine's own tests then fail further away,
in whatever used it)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peex_interop._engine import _harvest, _jax, _patching, _unthreaded
from peex_interop._engine._jax import pe  # JAX's own dead-code rules, to compare with

x = jnp.linspace(-1.0, 1.0, 3)


def parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


# -- version-dependent behaviour --------------------------------------------------------
def test_jit_equations_hold_the_program_kind_the_version_says():
    (eqn,) = jax.make_jaxpr(jax.jit(lambda x: x * 2.0))(x).eqns
    assert eqn.primitive is _jax.JIT
    kind = jax.extend.core.Jaxpr if _jax.JIT_HOLDS_OPEN_JAXPR else jax.extend.core.ClosedJaxpr
    assert type(eqn.params["jaxpr"]) is kind
    assert isinstance(_jax.jit_program(eqn.params), jax.extend.core.Jaxpr)


def test_dead_code_rules_take_the_arguments_the_version_says():
    # JAX's own rule for `jit`, called as every rule is.
    expected = ["used_outputs", "live_ins", "eqn"] if _jax.DCE_RULE_TAKES_LIVE_INPUTS else ["used_outputs", "eqn"]
    assert parameters(pe.dce_rules[_jax.JIT]) == expected


def test_a_sown_value_survives_dead_code_elimination():
    def sows(x):
        _harvest.sow_p.bind(x * 2.0, tag=None)
        return x + 1.0

    program = jax.make_jaxpr(sows)(x).jaxpr
    kept, _ = pe.dce_jaxpr(program, [True])
    assert [e.primitive for e in kept.eqns] == [e.primitive for e in program.eqns]


@jax.custom_jvp
def _tangent_only(value, slot):
    return value


@_tangent_only.defjvp
def _tangent_only_jvp(primals, tangents):
    return primals[0], tangents[0] + tangents[1]


@jax.custom_vjp
def _probe(value, slot):
    return _tangent_only(value, slot)


_probe.defvjp(lambda value, slot: (_tangent_only(value, slot), None), lambda _, ct: (ct, ct))


def test_a_tangent_added_in_a_scanned_custom_vjp_survives_as_the_version_says():
    # A pure-JAX model of BackwardHook's slot (`_hooks/_backward.py`): the gradient of a
    # function of the cotangents at the slot, of a layer in a scan body.
    weight = jnp.array([[0.3, -0.2, 0.1], [0.5, 0.1, -0.4], [0.2, 0.2, 0.3]])

    def loss(slots):
        def step(carry, slot):
            return _probe(jnp.tanh(weight @ carry), slot), None

        return jnp.sum(jnp.sin(jax.lax.scan(step, x, slots)[0]) ** 2)

    outer = jax.grad(lambda slots: jnp.sum(jnp.cos(jax.grad(loss)(slots))))(jnp.zeros((2, 3)))
    assert bool(jnp.any(outer != 0)) == _jax.TANGENT_SURVIVES_CUSTOM_VJP_IN_SCAN


# -- the current trace --------------------------------------------------------------------
def test_trace_state_and_batch_tracers():
    seen = {}

    def body(row):
        seen["trace"], seen["state"], seen["row"] = _jax.current_trace(), _jax.trace_state(), row
        return row

    outside = _jax.trace_state()
    assert _jax.trace_state() == outside
    jax.vmap(body)(jnp.stack([x, 2 * x]))
    assert isinstance(seen["trace"], _jax.BatchTrace)
    assert isinstance(seen["row"], _jax.BatchTracer)
    np.testing.assert_array_equal(seen["row"].val, jnp.stack([x, 2 * x]))
    assert seen["state"] != outside


def _custom_vjp(f):
    g = jax.custom_vjp(f)
    g.defvjp(lambda x: (f(x), None), lambda _, cotangent: (cotangent,))
    return g


def _custom_jvp(f):
    g = jax.custom_jvp(f)
    g.defjvp(lambda primals, tangents: (f(*primals), tangents[0]))
    return g


# How each transform traces a body `f`, and what `_unthreaded.transform_name` calls it.
STAGED = {
    "while_loop": (
        lambda f: lambda x: jax.lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, f(c[1])), (0, x))[1],
        "jax.lax.while_loop (or a fori_loop with traced bounds)",
    ),
    "scan": (lambda f: lambda x: jax.lax.scan(lambda c, _: (f(c), None), x, None, length=2)[0], "jax.lax.scan"),
    "cond": (lambda f: lambda x: jax.lax.cond(True, f, lambda x: x, x), "jax.lax.cond/switch"),
    "switch": (lambda f: lambda x: jax.lax.switch(0, [f, lambda x: x], x), "jax.lax.cond/switch"),
    "checkpoint": (jax.checkpoint, "jax.checkpoint"),
    "jit": (jax.jit, "jax.jit"),
    "custom_vjp": (_custom_vjp, "jax.custom_vjp"),
    "custom_jvp": (_custom_jvp, "jax.custom_jvp"),
}


@pytest.mark.parametrize("transform", STAGED)
def test_staging_traces_name_their_transform(transform):
    stage, name = STAGED[transform]
    seen = []

    def body(x):
        seen.append(_jax.traced_for(_jax.current_trace()))
        return x

    jax.make_jaxpr(stage(body))(x)
    traced_for, function = seen[0]
    # JAX's names ("while_body", "custom_vjp fun"), looked up as `transform_name` does.
    assert (_unthreaded._TRACED_FOR.get(traced_for) or _unthreaded._TRACED_FOR.get(traced_for.split(" ")[0])) == name
    assert function in ("body", "<lambda>")


# -- entry points -------------------------------------------------------------------------
# The entry points the engine replaces in their cell, and the parameters it reads by name.
CELLS = {
    "jax.vmap": (jax.vmap, ["fun", "in_axes", "out_axes", "axis_name", "axis_size"]),
    "jax.lax.scan": (jax.lax.scan, ["f", "init", "xs", "length"]),
    "jax.lax.map": (jax.lax.map, ["f", "xs", "batch_size"]),
    "jax.lax.fori_loop": (jax.lax.fori_loop, ["lower", "upper", "body_fun", "init_val", "unroll"]),
    "jax.lax.cond": (jax.lax.cond, ["pred", "true_fun", "false_fun", "operands"]),
    "jax.lax.switch": (jax.lax.switch, ["index", "branches", "operands"]),
    "jax.checkpoint": (jax.checkpoint, ["fun", "static_argnums"]),
}


@pytest.mark.parametrize("name", CELLS)
def test_entry_points_hold_their_function_in_a_cell(name):
    wrapper, names = CELLS[name]
    cell = _jax.wrapped_cell(wrapper)
    assert callable(cell.cell_contents)
    assert set(names) <= set(parameters(cell.cell_contents))


def test_jit_and_eval_shape_wrap_their_function():
    assert parameters(_jax.wrapped_function(jax.jit))[0] == "fun"
    assert parameters(_jax.wrapped_function(jax.eval_shape))[:1] == ["fun"]


def test_shard_map_calls_the_function_the_engine_replaces():
    assert {"f", "mesh", "in_specs", "out_specs", "axis_names"} <= set(parameters(getattr(*_jax.SHARD_MAP)))


def test_a_jit_traces_through_infer_params_and_runs_its_program_through_call_impl():
    assert parameters(getattr(*_jax.JIT_INFER_PARAMS)) == ["fun", "ji", "args", "kwargs"]
    assert parameters(getattr(*_jax.JIT_FAST_PATH))[0] == "executable"
    seen = {}

    def infer(original):
        def infer_params(fun, ji, args, kwargs):
            inferred = original(fun, ji, args, kwargs)
            seen["traced"] = _jax.jit_traced_program(inferred)
            return inferred

        return infer_params

    def call(original):
        def call_impl(*args, **params):
            result = original(*args, **params)
            seen["ran"], seen["executable"] = params["jaxpr"], _jax.jit_executable(result)
            return result

        return call_impl

    doubled = jax.jit(lambda x: x * 2.0 + 0.125)  # a program of its own, not cached yet
    with _patching.patched([(*_jax.JIT_INFER_PARAMS, infer), (*_jax.JIT_CALL_IMPL, call)]):
        np.testing.assert_allclose(doubled(x), x * 2.0 + 0.125)
    assert seen["ran"] is seen["traced"]
    assert callable(seen["executable"].unsafe_call)


# -- primitives ---------------------------------------------------------------------------
def test_primitives_bind_with_trace_and_avals():
    assert parameters(_jax.Primitive.bind_with_trace) == ["self", "trace", "args", "avals", "params"]
    assert _jax.BIND == "bind_with_trace"


@pytest.mark.parametrize(
    "primitive, make",
    [
        (_jax.SCAN, lambda x: jax.lax.scan(lambda c, _: (c * 2.0, None), x, None, length=2)[0]),
        (_jax.WHILE, lambda x: jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))[1]),
        (_jax.COND, lambda x: jax.lax.cond(x[0] > 0, lambda x: x * 2.0, lambda x: x, x)),
        (_jax.REMAT, jax.checkpoint(lambda x: jnp.sin(x) * 2.0)),
        (_jax.JIT, jax.jit(lambda x: x * 2.0)),
    ],
    ids=["scan", "while", "cond", "remat", "jit"],
)
def test_transform_primitives_and_their_bodies(primitive, make):
    eqns = [e for e in jax.make_jaxpr(make)(x).eqns if e.primitive is primitive]
    assert len(eqns) == 1
    bodies = _jax.sub_programs(eqns[0].params)
    assert bodies and all(isinstance(b, jax.extend.core.Jaxpr) for b in bodies)
    assert any(b.eqns for b in bodies)


def test_a_jit_program_rewritten_with_more_inputs_and_outputs_runs():
    (eqn,) = jax.make_jaxpr(jax.jit(lambda x, y: x * 2.0))(x, x).eqns
    program = _jax.jit_program(eqn.params)
    extra_in = program.invars[1]  # taken as a new last input, and returned as a last output
    rewritten = _jax.program_with(
        program, invars=[program.invars[0], extra_in], outvars=[*program.outvars, extra_in], eqns=program.eqns
    )
    params = _jax.jit_params_with(eqn.params, rewritten, 0, 1)
    doubled, extra = _jax.JIT.bind(x, x + 1.0, **params)
    np.testing.assert_allclose(doubled, x * 2.0)
    np.testing.assert_allclose(extra, x + 1.0)


def test_bind_at_binds_at_the_given_trace():
    outside = _jax.current_trace()
    seen = []

    def body(row):
        # Bound at the trace outside the vmap: an array, not a batch tracer.
        seen.append(_jax.bind_at(jax.lax.add_p, outside, (x, x), {}))
        return row

    jax.vmap(body)(jnp.stack([x, x]))
    assert not isinstance(seen[0], jax.core.Tracer)
    np.testing.assert_allclose(seen[0], 2 * x)


# -- jax.nn.dot_product_attention's XLA implementation ------------------------------------
def test_attention_masks_as_the_xla_implementation_applies_them():
    assert parameters(_jax.apply_masks) == parameters(_jax.nn_functions._apply_masks)
    assert parameters(_jax.nn_functions._get_padding_mask_encoded) == ["T", "q_seqlen"]
    logits = jnp.zeros((1, 1, 3, 3))
    causal = _jax.apply_masks(logits, None, True, None, None, None)
    assert bool(jnp.all((causal[0, 0] < -1e30) == ~jnp.tri(3, dtype=bool)))
    padding = _jax.padding_mask_encoded(3, jnp.array([2]))
    assert jnp.ravel(padding).tolist() == [True, True, False]  # the third query is padding
