"""Carrying logs out of, and backward slots into, transforms the engine did not thread.

The threaded entry points (`_transforms.py`) cover every call of `jax.vmap`,
`jax.lax.scan`, ... whatever Python reference reached them. What they cannot see is a
transform applied before hooking began: a function decorated with `@jax.vmap` at import
(its vmap already happened, as a closure), or a `jax.jit` function compiled before (its
trace may be replayed from JAX's cache). There, values cross the transform inside the
traced program, as oryx's `harvest` does it:

- a log recorded where the current trace is not the recording scope's is *sown*: bound
  as `peex_interop_sow`, a primitive with no outputs, carrying its log key in its
  parameters. Under `vmap` its batching rule rebinds it on the whole batch (an
  unbatched value is broadcast: one log row per example), so it arrives at the scope's
  trace, where it is recorded. In a jit's traced program it is an equation; when the
  `jit` primitive is bound, its program is rewritten to return the sown values as
  extra outputs, sown again one level up.
- a backward slot is *planted*: `peex_interop_plant` has no inputs and returns the
  slot; under `vmap` it is planted on the whole batch (per-example slots, so
  cotangents are never summed over examples); in a jit's program it becomes an extra
  input, planted one level up.

A sown or planted value that reaches a loop (`while_loop`), an unthreaded `scan`/
`cond`/`checkpoint`, a custom derivative or anything else raises `TransformError`
naming the layer and that transform: never a dropped log or a summed cotangent.

Keys: a jit compiled before hooking may replay a trace made in an earlier hooked call
with other call counts, so its calls count from zero inside it (`Scope.deferred`) and
are renumbered when they arrive (`HookContext.arrive`), in call order.
"""

import dataclasses
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu

from .._errors import TransformError
from . import _jax


@dataclasses.dataclass(frozen=True, eq=False)
class Tag:
    """What travels with a sown or planted value: which context (by position among the
    active ones, so a cached trace serves a later call with the same selections), the
    layer, the log key's parts, and the structure of the logged pytree.

    `count` is the call number of the layer inside the jit it was recorded in when
    `relative` (renumbered on arrival), else the final one. `batch` groups the values
    brought out of one jit application, which are renumbered together."""

    context: int
    path: str
    name: str
    count: int
    suffix: str
    relative: bool
    treedef: Any
    static: tuple
    where: str
    batch: Any = None

    def key(self, count: int | None = None) -> str:
        count = self.count if count is None else count
        return (self.name if count == 0 else f"{self.name}@{count}") + self.suffix


sow_p = _jax.Primitive("peex_interop_sow")
sow_p.multiple_results = True
plant_p = _jax.Primitive("peex_interop_plant")
plant_p.multiple_results = True


def _escaped(primitive: str) -> Callable:
    def rule(*args, tag: Tag, **params):
        del args, params
        raise TransformError(
            f"a log of layer {tag.path!r} ({primitive}) was recorded under {tag.where}, "
            "and the program that holds it was run outside the hooked call, or through a "
            "transform peex_interop cannot thread values out of (it would be a dropped "
            "log or a summed cotangent)."
        )

    return rule


sow_p.def_impl(_escaped("sown"))
plant_p.def_impl(_escaped("planted"))
sow_p.def_abstract_eval(lambda *avals, tag: [])
plant_p.def_abstract_eval(lambda *, tag, avals: list(avals))
_jax.register_lowering(sow_p, _escaped("sown"))
_jax.register_lowering(plant_p, _escaped("planted"))
# Sown values are used by nobody inside the program: keep them through dead-code passes.
_jax.keep_in_dead_code(sow_p)


def _sow_batched(axis_data, values, dims, *, tag):
    # Per example, the mapped axis first; an unbatched value is every example's.
    whole = [
        jnp.broadcast_to(v, (axis_data.size, *jnp.shape(v))) if d is None else jnp.moveaxis(v, d, 0)
        for v, d in zip(values, dims)
    ]
    return sow_p.bind(*whole, tag=tag), []


def _plant_batched(axis_data, values, dims, *, tag, avals):
    del values, dims
    whole = tuple(_jax.ShapedArray((axis_data.size, *a.shape), a.dtype) for a in avals)
    return plant_p.bind(tag=tag, avals=whole), [0] * len(avals)


_jax.register_batching(sow_p, _sow_batched)
_jax.register_batching(plant_p, _plant_batched)


def _sow_jvp(primals, tangents, *, tag):
    del tangents
    return sow_p.bind(*primals, tag=tag), []


def _plant_jvp(primals, tangents, *, tag, avals):
    del primals, tangents, avals
    raise TransformError(
        f"cannot attach the backward log of layer {tag.path!r}: it runs under {tag.where}, "
        "autodiff inside the model (jax.grad/jax.vjp/jax.jacrev/jax.linearize called by "
        "the model's own code); a BackwardHook's slot needs the model's outermost "
        "differentiation. Use a ForwardHook there, or exclude the layer with where=."
    )


_jax.register_jvp(sow_p, _sow_jvp)
_jax.register_jvp(plant_p, _plant_jvp)


def sow(context_index: int, tag_parts: dict, value: Any, where: str) -> None:
    """Record `value` (a log pytree) for the scope below the current trace."""
    leaves, treedef = jtu.tree_flatten(value)
    arrays = [leaf for leaf in leaves if isinstance(leaf, (jax.Array, jax.core.Tracer))]
    if len(arrays) != len(leaves):
        static = tuple(None if isinstance(leaf, (jax.Array, jax.core.Tracer)) else leaf for leaf in leaves)
    else:
        static = ()
    tag = Tag(context_index, treedef=treedef, static=static, where=where, **tag_parts)
    sow_p.bind(*arrays, tag=tag)


def plant(context_index: int, tag_parts: dict, template: Any, where: str) -> Any:
    """The backward slot shaped like `template` (a pytree of arrays), from the scope
    below the current trace."""
    leaves, treedef = jtu.tree_flatten(template)
    tag = Tag(context_index, treedef=treedef, static=(), where=where, **tag_parts)
    avals = tuple(_jax.ShapedArray(jnp.shape(leaf), jnp.result_type(leaf)) for leaf in leaves)
    return jtu.tree_unflatten(treedef, plant_p.bind(tag=tag, avals=avals))


def unflatten(tag: Tag, arrays: list) -> Any:
    if not tag.static:
        return jtu.tree_unflatten(tag.treedef, arrays)
    it = iter(arrays)
    return jtu.tree_unflatten(tag.treedef, [next(it) if s is None else s for s in tag.static])


# -- where jit programs are rewritten -----------------------------------------------------
# Where sown and planted values arrive: `_arrivals.py`.
_batches = itertools.count()


def _carried(jaxpr: Any) -> tuple[list, list]:
    return (
        [e for e in jaxpr.eqns if e.primitive is sow_p],
        [e for e in jaxpr.eqns if e.primitive is plant_p],
    )


def _jit_bind(original: Callable) -> Callable:
    """A jit program holding sown/planted values returns them as extra outputs and takes
    the slots as extra inputs; they are sown/planted again at the trace it is bound at."""

    def bind_with_trace(trace, args, avals, params, /):
        jaxpr = _jax.jit_program(params)
        sown, planted = _carried(jaxpr)
        if not sown and not planted:
            return original(trace, args, avals, params)
        carried = {id(e) for e in (*sown, *planted)}
        new_in = [v for e in planted for v in e.outvars]
        new_out = [a for e in sown for a in e.invars]
        inner = _jax.program_with(
            jaxpr,
            invars=[*jaxpr.invars, *new_in],
            outvars=[*jaxpr.outvars, *new_out],
            eqns=[e for e in jaxpr.eqns if id(e) not in carried],
        )
        batch = next(_batches)
        slots = []
        for e in planted:
            tag = dataclasses.replace(e.params["tag"], batch=(batch, e.params["tag"].batch))
            slots.extend(_jax.bind_at(plant_p, trace, (), {"tag": tag, "avals": e.params["avals"]}))
        new_params = _jax.jit_params_with(params, inner, len(new_in), len(new_out))
        all_args = (*args, *slots)
        outs = original(trace, all_args, tuple(jax.typeof(x) for x in all_args), new_params)
        n = len(jaxpr.outvars)
        extra = list(outs[n:])
        for e in sown:
            values, extra = extra[: len(e.invars)], extra[len(e.invars) :]
            tag = dataclasses.replace(e.params["tag"], batch=(batch, e.params["tag"].batch))
            _jax.bind_at(sow_p, trace, values, {"tag": tag})
        return outs[:n]

    return bind_with_trace


def _jit_impl(original: Callable) -> Callable:
    """A jit called outside any trace runs its program without binding the primitive:
    one holding carried values is bound instead, so that `_jit_bind` rewrites it."""

    def call_impl(*args, **params):
        sown, planted = _carried(_jax.jit_program(params))
        if sown or planted:
            return _jax.jit_call_result(_jax.JIT.bind(*args, **params))
        result = original(*args, **params)
        if params["jaxpr"] in hooked_programs:
            hooked_executables.add(_jax.jit_executable(result))
        return result

    return call_impl


# The programs of jit calls whose trace ran a selected layer (`_transforms`), and the
# executables compiled from them: kept out of JAX's C++ dispatch cache, whose entry a
# later hooked call would run without tracing (replaying this call's edits, dropping
# its logs). An executable, not the last traced jit, tells them: jits run between a
# trace and its cache entry (`jnp`'s own, eagerly) would be taken for it.
hooked_programs: "weakref.WeakSet[Any]" = weakref.WeakSet()
hooked_executables: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _refusing(name: str) -> Callable[[Callable], Callable]:
    """A transform whose body may hold sown/planted values that it cannot return:
    refused, naming the layers."""

    def make(original: Callable) -> Callable:
        def bind_with_trace(trace, args, avals, params, /):
            carried = [e for j in _jax.sub_programs(params) for e in j.eqns if e.primitive in (sow_p, plant_p)]
            if carried:
                paths = sorted({e.params["tag"].path for e in carried})
                raise TransformError(
                    f"cannot thread the logs of layer(s) {paths} out of {name}: it runs under "
                    f"{carried[0].params['tag'].where}, reached in a way the engine does not "
                    "thread (a loop has no per-step output; a body traced before hooking "
                    "cannot be threaded). Move that transform outside the hooked model, or "
                    "exclude the layer with where=."
                )
            return original(trace, args, avals, params)

        return bind_with_trace

    # Built per hooking context: nested contexts (a BackwardHook of a ForwardHook)
    # install the same refusal.
    make.purpose = ("refusing", name)  # pyright: ignore[reportFunctionMemberAccess]
    return make


def primitive_patches() -> list[tuple[Any, str, Callable[[Any], Any]]]:
    """Patch targets for `_patching.patched`: instance-level `bind_with_trace` of the
    jit primitive, and of the transforms that refuse carried values (the carrying
    primitives' own: `_arrivals.arrival_patches`)."""
    bind = _jax.BIND
    return [
        (_jax.JIT, bind, _jit_bind),
        (*_jax.JIT_CALL_IMPL, _jit_impl),
        (_jax.WHILE, bind, _refusing("jax.lax.while_loop (or a fori_loop with traced bounds)")),
        (_jax.SCAN, bind, _refusing("jax.lax.scan")),
        (_jax.COND, bind, _refusing("jax.lax.cond/switch")),
        (_jax.REMAT, bind, _refusing("jax.checkpoint (applied before hooking began)")),
    ]
