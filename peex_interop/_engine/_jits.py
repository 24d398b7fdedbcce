"""Jits: `jax.jit`, `eqx.filter_jit`, `jax.eval_shape`, and the jits compiled before
hooking.

A jit called while hooking runs under a fresh jit whose outputs carry the logs. A jit
created before hooking began (decorated at import, or already compiled) traces its body
through JAX's `pjit._infer_params`, whose cache may replay a trace made in an earlier
hooked call: its body runs in a deferred scope (`HookContext.enter_deferred`), and its
logs leave through the traced program (`_harvest`).
"""

import functools
import weakref
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from . import _context, _harvest, _jax, _patching, _threads
from ._bodies import Body, engine_body, is_engine_body, probes_first, shift


def _jit_call(real_jit: Callable, fun: Callable, options: dict, args: tuple, kwargs: dict, *, filtered: bool) -> Any:
    """Run `fun(*args, **kwargs)` under a fresh `real_jit` whose outputs carry the logs.

    `filtered` follows `eqx.filter_jit`: arrays are traced, everything else is static.
    Outputs are split the same way, so a body may return non-arrays. Shardings and
    donation are left out (they place values, never change them)."""
    body = Body(fun, (args, kwargs))
    static_out = []

    def jitted_body(carried, *inner_args, **inner_kwargs):
        if filtered:
            (inner_args, inner_kwargs) = eqx.combine(inner_args[0], static_in)
        out_and_logs = body.enclosed(carried, (inner_args, inner_kwargs), inner_args, inner_kwargs)
        dynamic, static = eqx.partition(out_and_logs, eqx.is_array)
        static_out.append(static)
        return dynamic

    engine_body(jitted_body)

    if filtered:
        dynamic_in, static_in = eqx.partition((args, kwargs), eqx.is_array)
        jitted = real_jit(jitted_body)
        call_args, call_kwargs = (dynamic_in,), {}
    else:
        kept = {
            name: value for name, value in options.items()
            if name in ("static_argnames", "keep_unused", "inline", "compiler_options", "backend", "device")
        }
        jitted = real_jit(
            probes_first(fun, jitted_body), static_argnums=shift(options.get("static_argnums")), **kept
        )
        call_args, call_kwargs = args, kwargs
    return body.run_enclosed(lambda carried: eqx.combine(jitted(carried, *call_args, **call_kwargs), static_out[-1]))


class _ThreadedJit:
    """What the patched `jax.jit` returns: a jitted function that threads logs out when
    called with hooking active in the calling thread, and is the real one otherwise
    (its attributes, e.g. `.lower`, are the real one's)."""

    def __init__(self, real_jit: Callable, fun: Callable, options: dict):
        self._real_jit, self._fun, self._options = real_jit, fun, options
        self.__wrapped__ = fun

    @functools.cached_property
    def _jitted(self) -> Callable:
        return self._real_jit(self._fun, **self._options)

    def __call__(self, *args, **kwargs):
        if not _context.active():
            return self._jitted(*args, **kwargs)
        return _jit_call(self._real_jit, self._fun, self._options, args, kwargs, filtered=False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jitted, name)


def threaded_eval_shape(real_eval_shape: Callable) -> Callable:
    """`jax.eval_shape` inside the model (NNX's `fori_loop` runs its body this way
    first): the body runs in a scope of its own whose logs are dropped, since no value
    leaves an abstract evaluation, and whose calls do not count as calls."""

    def eval_shape(*shape_args, **shape_kwargs):
        if not _context.active():
            return real_eval_shape(*shape_args, **shape_kwargs)
        options = _patching.bound_arguments(real_eval_shape, shape_args, shape_kwargs)
        fun, args, kwargs = options["fun"], options.get("args", ()), options.get("kwargs", {})
        body = Body(fun, (args, kwargs))

        def shaped(*inner_args, **inner_kwargs):
            return body(body.no_probes(), (inner_args, inner_kwargs), inner_args, inner_kwargs)[0]

        # Backward slots are not needed either: contexts only discover, as in `.init`.
        flags = [context.discovering for context in body.contexts]
        for context in body.contexts:
            context.discovering = True
        try:
            return real_eval_shape(engine_body(shaped), *args, **kwargs)
        finally:
            for context, counts, flag in zip(body.contexts, body.start, flags):
                context.counts, context.discovering = counts, flag
            body.release()

    return eval_shape


def threaded_jit(real_jit: Callable) -> Callable:
    def jit(*jit_args, **jit_kwargs):
        options = _patching.bound_arguments(real_jit, jit_args, jit_kwargs)
        fun = options.pop("fun", None)
        if fun is None or not callable(fun):
            return functools.partial(jit, **options)  # used as `@jax.jit(static_argnums=...)`
        return _ThreadedJit(real_jit, fun, options)

    return jit


def threaded_filter_jit_call(original_call: Callable) -> Callable:
    """`eqx.filter_jit` wrappers are usually created before hooking begins (decorated
    methods): their call is patched instead of `eqx.filter_jit` itself."""
    real_jit = _patching.entry_point(jax.jit)

    def __call__(self, /, *args, **kwargs):
        if not _context.active():
            return original_call(self, *args, **kwargs)
        return _jit_call(real_jit, self.__wrapped__, {}, args, kwargs, filtered=True)

    return __call__


def deferring_infer_params(real_infer_params: Callable) -> Callable:
    """A `jax.jit` function created before hooking began (decorated at import, or
    already compiled) traces its body through JAX's `pjit._infer_params`, whose cache
    may replay a trace made in an earlier hooked call. Its body runs in a deferred
    scope (`HookContext.enter_deferred`): layers are named through its arguments,
    calls count from zero, and logs leave through the traced program (`_harvest`)."""

    def infer_params(fun, jit_info, args, kwargs):
        contexts = _context.active()
        if not contexts or is_engine_body(fun):
            return real_infer_params(fun, jit_info, args, kwargs)
        # Where the jit is called: what its body stands for, and whether it runs inside a
        # transform that can neither be threaded nor carried through (a while_loop).
        _jit_arguments.items.append(((args, kwargs), [context.scopes.unthreadable() for context in contexts]))
        try:
            inferred = real_infer_params(_deferred_body(fun), jit_info, args, kwargs)
        finally:
            _jit_arguments.items.pop()
        if fun in _hooked_inside:
            _harvest.hooked_programs.add(_jax.jit_traced_program(inferred))
        return inferred

    return infer_params


def no_fast_path(real_get_fastpath_data: Callable) -> Callable:
    """A jit called eagerly while hooking whose trace ran a selected layer gets no entry
    in JAX's C++ dispatch cache: a later hooked call with other hooks would run this
    call's program without reaching Python (`_infer_params`), silently replaying its
    edits and dropping its logs. Its compiled program is still cached, keyed on its
    trace; jits that run no selected layer (`jnp`'s own) keep their fast path."""

    def get_fastpath_data(executable, *args, **kwargs):
        if executable is not None and executable in _harvest.hooked_executables:
            return None
        return real_get_fastpath_data(executable, *args, **kwargs)

    return get_fastpath_data


# The outer arguments of the jit calls being traced in this thread (innermost last).
_jit_arguments = _threads.ThreadStack()
_deferred_bodies: "weakref.WeakKeyDictionary[Any, Callable]" = weakref.WeakKeyDictionary()


def _deferred_body(fun: Callable) -> Callable:
    """The function that `jax.jit` traces in place of `fun` while hooking.

    One wrapper per function, so that JAX's trace cache (keyed on it) still serves
    functions that call no selected layer (`jnp`'s own jits). A function that did call
    one gets a new wrapper in each hooked call: its trace holds that call's hooks
    (which may close over its values), never to be replayed in another."""
    if fun in _hooked_inside:
        # Shape-only runs (slot discovery) trace other programs than the real run.
        key = (fun, tuple(context.discovering for context in _context.active()))
        per_call = _context.active()[0].deferred_bodies
        if key not in per_call:
            per_call[key] = _make_deferred(fun)
        return per_call[key]
    try:
        return _deferred_bodies[fun]
    except (KeyError, TypeError):
        pass
    deferred = _make_deferred(fun)
    if _weakrefable(fun):
        _deferred_bodies[fun] = deferred
    return deferred


_hooked_inside: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _make_deferred(fun: Callable) -> Callable:
    reference = weakref.ref(fun) if _weakrefable(fun) else (lambda: fun)

    @functools.wraps(fun)
    def deferred(*args, **kwargs):
        function = reference()
        assert function is not None, "a jitted function was collected while traced"
        contexts = list(_context.active())
        outer, cached = _jit_arguments.items[-1] if _jit_arguments.items else ((args, kwargs), [None] * len(contexts))
        for context, where in zip(contexts, cached):
            context.enter_deferred(outer, (args, kwargs), where)
        hooked = False
        try:
            return function(*args, **kwargs)
        finally:
            for context in reversed(contexts):
                hooked = context.exit_deferred() or hooked
            if hooked and _weakrefable(function):
                _hooked_inside.add(function)
                # Its shared wrapper's trace holds that call's hooks (and may close over
                # its tracers): let JAX's cache entry for it go.
                _deferred_bodies.pop(function, None)

    # No strong reference back to `fun`: the wrapper is the value of a weak-keyed cache.
    del deferred.__wrapped__
    return deferred


def _weakrefable(fun: Any) -> bool:
    try:
        weakref.ref(fun)
    except TypeError:
        return False
    return True
