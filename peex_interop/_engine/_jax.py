"""JAX's internals, in one place: every private name and every version-dependent
behaviour the engine relies on.

The engine threads logs through JAX's transforms by replacing their entry points and
the `bind_with_trace` of their primitives (`_transforms`, `_harvest`), carries values
out of programs traced before hooking with primitives of its own (`_harvest`,
`_batching`), and reads the current trace (`_unthreaded`, `_hook_context`, `_arrivals`). That reaches below JAX's public
API, which moves between releases. Each item below says what it is for, since which
release it holds, and what changes inside the supported window (`peex_interop._versions`:
JAX 0.10 to 0.12). `tests/test_jax_internals.py` asserts every assumption made here, so
the first failure on a new JAX release names the item that moved. No other module of the
package imports `jax._src`.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.core
import jax.extend.core as jex_core
from equinox._jit import _JitWrapper  # pyright: ignore[reportPrivateImportUsage]
from jax._src import core, pjit, shard_map
from jax._src.interpreters import ad, batching, mlir, partial_eval as pe
from jax._src.named_sharding import UNSPECIFIED
from jax._src.nn import functions as nn_functions
from jax.extend.core import primitives

VERSION: tuple[int, ...] = jax.__version_info__
"""The running JAX's release numbers (`(0, 12, 1)`; JAX's own reading of its version,
public in every release of the window)."""


# -- version-dependent behaviour ---------------------------------------------------------
JIT_HOLDS_OPEN_JAXPR: bool = VERSION >= (0, 11)
"""Whether the `jaxpr` parameter of a `jit` equation is an open `Jaxpr` (0.11.0 on) or a
`ClosedJaxpr` (0.10): `jit_program` and `jit_params_with` read and rebuild either."""

DCE_RULE_TAKES_LIVE_INPUTS: bool = VERSION >= (0, 12)
"""Whether a dead-code rule is called as `rule(used_outputs, live_inputs, eqn)` (0.12.0
on) or `rule(used_outputs, eqn)` (0.10, 0.11): `keep_in_dead_code` registers either."""

TANGENT_SURVIVES_CUSTOM_VJP_IN_SCAN: bool = VERSION >= (0, 12)
"""Whether a `jax.custom_jvp` identity that adds a tangent, called in the forward of a
`jax.custom_vjp` inside a `jax.lax.scan` body, still perturbs a derivative taken around
the backward pass (`jax.grad` of a function of `jax.grad`): from 0.12.0. On 0.10 and
0.11 JAX drops that tangent: the derivative is silently all zeros (a pure-JAX case is
in `tests/test_jax_internals.py`). `BackwardHook` then perturbs a layer's output by
adding its slot in the forward pass instead (`_hooks/_backward.py`)."""


# -- the current trace -------------------------------------------------------------------
def current_trace() -> Any:
    """The trace the code running now binds to (`core.trace_ctx.trace`, every release
    of the window; an `EvalTrace` outside any transform)."""
    return core.trace_ctx.trace


def trace_state() -> Any:
    """An opaque value equal between two points of the code exactly when they run under
    the same traces (`jax.extend.core.get_opaque_trace_state`, public since 0.10.0): how
    the engine tells that a layer runs under a transform it did not thread."""
    return jex_core.get_opaque_trace_state()


def is_trace_at(trace: Any, state: Any) -> bool:
    """Whether `trace` (the trace a primitive is bound at) is the innermost trace of
    `state` (a `trace_state()`): where a value carried out of a program reaches the
    scope that recorded under `state`. Reads the state's private `_trace_ref` and the
    trace's `_weakref` (every release of the window)."""
    return state._trace_ref == trace._weakref


BatchTrace = batching.BatchTrace
"""The trace of a `jax.vmap` (every release of the window): a `vmap` the engine did not
thread leaves no program, so values may still be carried out of it."""

BatchTracer = batching.BatchTracer
"""A value inside a `jax.vmap` body; `.val` is the batched array it stands for (every
release of the window)."""


def traced_for(trace: Any) -> tuple[str, str]:
    """What a staging trace traces, for error messages: `(traced_for, function name)`
    from its frame's debug info (`"while_body"`, `"custom_vjp fun"`, `"jit"`, ...).
    Raises `AttributeError` for a trace with no frame (an eval or batch trace)."""
    info = trace.frame.debug_info
    return info.traced_for, info.func_name


# -- entry points: `jax.vmap`, `jax.lax.scan`, ... ---------------------------------------
def wrapped_cell(wrapper: Callable) -> Any:
    """The closure cell in which a JAX entry point (`jax.vmap`, `jax.lax.scan`, ...)
    holds the function it calls: its `api_boundary` wrapper's free variable `fun`
    (since 0.8.3; every release of the window). Replacing the cell's contents reaches
    every reference to the entry point: `from jax import vmap`, an alias module, a
    `functools.partial` of it, JAX's own internal calls."""
    return wrapper.__closure__[wrapper.__code__.co_freevars.index("fun")]  # pyright: ignore


def wrapped_function(wrapper: Callable) -> Callable:
    """The function behind a JAX entry point (`jax.jit`, `jax.eval_shape`): the
    `__wrapped__` that its `api_boundary` wrapper sets (since 0.8.3)."""
    return wrapper.__wrapped__  # pyright: ignore[reportFunctionMemberAccess]


JIT_INFER_PARAMS = (pjit, "_infer_params")
"""`pjit._infer_params(fun, ji, args, kwargs) -> (params, ...)`: where a `jax.jit`
function traces its body (every release of the window). Replaced so that a function
jitted before hooking traces in a deferred scope (`_transforms`); `jit_traced_program`
reads the program it returns."""

JIT_FAST_PATH = (pjit, "_get_fastpath_data")
"""`pjit._get_fastpath_data(executable, ...)`: the entry of a compiled call in JAX's C++
dispatch cache, or None for none (every release of the window)."""

JIT_CALL_IMPL = (pjit, "_pjit_call_impl_python")
"""`pjit._pjit_call_impl_python(*args, **params) -> (outputs, executable, profiler,
const_args)`: a `jit` called outside any trace runs its program here without binding
the `jit` primitive (every release of the window)."""

SHARD_MAP = (shard_map, "_shard_map")
"""`shard_map._shard_map(f, *, mesh, in_specs, out_specs, ...)`: what `jax.shard_map`
calls however it was reached (every release of the window)."""

FILTER_JIT_CALL = (_JitWrapper, "__call__")
"""`equinox._jit._JitWrapper.__call__`: the call of every `eqx.filter_jit` function
(Equinox's private class, every release from equinox 0.13.7), most of them created
before hooking (decorated methods): replaced instead of `eqx.filter_jit` itself
(`_transforms`); `.__wrapped__` is the function it jits."""


# -- primitives ---------------------------------------------------------------------------
Primitive = jex_core.Primitive
"""JAX's primitive class (public in `jax.extend.core`)."""

BIND = "bind_with_trace"
"""The method of a primitive that binds it at a given trace, replaced per primitive
instance (`_harvest`). Its signature is `(trace, args, avals, params, /)` from 0.8.3 on
(`(trace, args, params)` before): `bind_at` calls it."""

JIT = primitives.jit_p
"""The primitive of a `jax.jit` call (`jax.extend.core.primitives.jit_p`); its
parameters: see `jit_program` and `jit_params_with`."""

SCAN, WHILE, COND, REMAT = primitives.scan_p, primitives.while_p, primitives.cond_p, primitives.remat_p
"""The primitives of `jax.lax.scan`, `jax.lax.while_loop`, `jax.lax.cond`/`switch` and
`jax.checkpoint` (`jax.extend.core.primitives`); their bodies' programs are found by
`sub_programs`."""


def bind_at(primitive: Any, trace: Any, args: Sequence, params: dict) -> Any:
    """Bind `primitive` on `args` at `trace` (not the current one): the outputs.

    **Arguments:**

    - `primitive`: a JAX primitive.
    - `trace`: the trace to bind at (the one a replaced `bind_with_trace` received).
    - `args`: the input values.
    - `params`: the primitive's parameters.
    """
    return getattr(primitive, BIND)(trace, tuple(args), tuple(jax.typeof(a) for a in args), params)


def register_batching(primitive: Any, rule: Callable) -> None:
    """Batch `primitive` with `rule(axis_data, values, dims, **params) -> (outputs,
    out_dims)`, called at every enclosing `vmap` even for unbatched inputs
    (`batching.fancy_primitive_batchers`; `axis_data.size` is the mapped axis' size)."""
    batching.fancy_primitive_batchers[primitive] = rule


def register_jvp(primitive: Any, rule: Callable) -> None:
    """Differentiate `primitive` with `rule(primals, tangents, **params) -> (outputs,
    output_tangents)` (`ad.primitive_jvps`)."""
    ad.primitive_jvps[primitive] = rule


def register_linear(primitive: Any, transpose: Callable) -> None:
    """Make `primitive` linear in its inputs, with `transpose(cotangent, *args,
    **params)` (`ad.deflinear2`)."""
    ad.deflinear2(primitive, transpose)


def register_lowering(primitive: Any, rule: Callable) -> None:
    """Lower `primitive` to MLIR with `rule(ctx, *args, **params)` (public:
    `jax.interpreters.mlir.register_lowering`)."""
    mlir.register_lowering(primitive, rule)


def keep_in_dead_code(primitive: Any) -> None:
    """Keep every equation of `primitive` (and its inputs) through JAX's dead-code
    passes, though nothing uses its outputs (`pe.dce_rules`; the rule's signature:
    `DCE_RULE_TAKES_LIVE_INPUTS`)."""

    def keep(eqn: Any) -> tuple[list[bool], Any]:
        return [True] * len(eqn.invars), eqn

    if DCE_RULE_TAKES_LIVE_INPUTS:
        pe.dce_rules[primitive] = lambda used_outputs, live_inputs, eqn: keep(eqn)
    else:
        pe.dce_rules[primitive] = lambda used_outputs, eqn: keep(eqn)  # pyright: ignore[reportArgumentType]


ShapedArray = jax.core.ShapedArray
"""The abstract value of an array of a given shape and dtype (public in `jax.core`)."""


# -- programs: jaxprs in equations' parameters --------------------------------------------
Jaxpr = jex_core.Jaxpr
"""An open program (public in `jax.extend.core`)."""


def jit_program(params: dict) -> Any:
    """The open `Jaxpr` of a `jit` equation's (or call's) parameters: `params["jaxpr"]`,
    a `Jaxpr` from 0.11.0 on, a `ClosedJaxpr` before (`JIT_HOLDS_OPEN_JAXPR`)."""
    program = params["jaxpr"]
    return program if JIT_HOLDS_OPEN_JAXPR else program.jaxpr


def program_with(program: Any, invars: list, outvars: list, eqns: list) -> Any:
    """An open program like `program` (its constants' variables, effects) with other
    inputs, outputs and equations; its debug info no longer names them (`Jaxpr.replace`
    and `DebugInfo.with_unknown_names`, every release of the window)."""
    return program.replace(
        invars=invars, outvars=outvars, eqns=eqns, debug_info=program.debug_info.with_unknown_names()
    )


def jit_params_with(params: dict, program: Any, added_inputs: int, added_outputs: int) -> dict:
    """A `jit` equation's parameters, its program replaced by `program` (an open
    `Jaxpr`, as `jit_program` gives) that takes `added_inputs` more inputs and returns
    `added_outputs` more outputs, after the original ones.

    **Arguments:**

    - `params`: the parameters of the `jit` equation (`jit_program` read its program).
    - `program`: the rewritten open program (same constants as the original one).
    - `added_inputs`, `added_outputs`: how many inputs and outputs it adds; they get
        no sharding and no layout, and are not donated.

    **Returns:**

    The new parameters (the ones named here are those of every release of the window).
    """
    k, m = added_inputs, added_outputs
    return {
        **params,
        "jaxpr": program if JIT_HOLDS_OPEN_JAXPR else params["jaxpr"].replace(jaxpr=program),
        "in_shardings": (*params["in_shardings"], *[UNSPECIFIED] * k),
        "in_layouts": (*params["in_layouts"], *[None] * k),
        "donated_invars": (*params["donated_invars"], *[False] * k),
        "out_shardings": (*params["out_shardings"], *[UNSPECIFIED] * m),
        "out_layouts": (*params["out_layouts"], *[None] * m),
    }


def jit_traced_program(inferred: Any) -> Any:
    """What `JIT_INFER_PARAMS` returned: the `jaxpr` parameter of the traced jit (the
    object a later `JIT_CALL_IMPL` call receives as its `jaxpr`)."""
    return inferred[0].params["jaxpr"]


def jit_executable(call_result: tuple) -> Any:
    """The compiled executable in what `JIT_CALL_IMPL` returned."""
    return call_result[1]


def jit_call_result(outputs: Any) -> tuple:
    """What `JIT_CALL_IMPL` returns for outputs computed without compiling (no
    executable, profiler or constants: JAX's C++ cache keeps no entry)."""
    return outputs, None, None, []


def sub_programs(params: dict) -> list[Any]:
    """The open programs among an equation's parameters (a `Jaxpr`, a `ClosedJaxpr`'s,
    or in a tuple of them: a `cond`'s branches), at any release of the window."""
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, Jaxpr):
                found.append(item)
            elif isinstance(getattr(item, "jaxpr", None), Jaxpr):
                found.append(item.jaxpr)
    return found


# -- jax.nn.dot_product_attention's XLA implementation ------------------------------------
def apply_masks(
    logits: Any, mask: Any, is_causal: bool, q_seqlen: Any, kv_seqlen: Any, local_window_size: Any
) -> Any:
    """The logits of `jax.nn.dot_product_attention` (layout `(B, N, T, S)`) with its
    masks applied as its XLA implementation applies them (`nn.functions._apply_masks`,
    every release of the window): the engine forms the attention weights itself."""
    return nn_functions._apply_masks(  # pyright: ignore[reportPrivateUsage]
        logits, mask, is_causal, q_seqlen, kv_seqlen, local_window_size
    )


def padding_mask_encoded(length: int, q_seqlen: Any) -> Any:
    """The mask that zeroes the padded query positions of the encoded output of
    `jax.nn.dot_product_attention` (`nn.functions._get_padding_mask_encoded`)."""
    return nn_functions._get_padding_mask_encoded(length, q_seqlen)  # pyright: ignore[reportPrivateUsage]
