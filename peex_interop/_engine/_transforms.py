"""Threading logs out of the JAX transforms a model applies *inside* itself.

A value recorded into Python from inside a `jax.vmap`/`jax.lax.scan`/... body would leak
a tracer. While a hooking context is active in this thread, the public entry points
below are replaced by versions that run the body in a fresh scope and return the scope's
logs as extra outputs of the body: stacked along the mapped/scanned axis for vmap, scan,
`lax.map` and static `fori_loop`, one block per device for `shard_map`, as plain outputs
for cond, switch, checkpoint and jit. Backward-log slots of layers inside a mapped body
are passed in as mapped inputs, so cotangents are per example/step rather than summed.

Arguments are bound against the real entry point's signature, so keyword and positional
calling conventions behave exactly as JAX's own. The entry points are replaced in the
closure cell behind them, so every Python reference reaches them; a jit compiled before
hooking is traced in a deferred scope, and a vmap applied before hooking carries its
values through the traced program (`_harvest`). What neither reaches (`while_loop`,
dynamic `fori_loop`, ...) is refused (`Scopes.unthreadable`).

The bodies: `_bodies.py`; the families of transforms: `_mapped.py`, `_enclosed.py`,
`_jits.py`.
"""

from collections.abc import Callable
from typing import Any

import jax

from . import _arrivals, _enclosed, _harvest, _jax, _jits, _mapped, _patching


def transform_patches() -> list[tuple[Any, str, Callable]]:
    """Patch targets for `_patching.patched`: JAX's transform entry points, replaced in
    the cell that holds the function behind them (so every reference is reached: `from
    jax import vmap`, `import jax.lax as L`, `functools.partial(jax.vmap, ...)`), the
    jit trace entry of functions jitted before hooking, and the primitives that carry
    values through the transforms applied before hooking (`_harvest`)."""
    cell = _patching.WRAPPED_FUNCTION
    return [
        (jax.vmap, cell, _mapped.threaded_vmap),
        (jax.lax.scan, cell, _mapped.threaded_scan),
        (jax.lax.map, cell, _mapped.threaded_map),
        (jax.lax.fori_loop, cell, _mapped.threaded_fori_loop),
        (jax.lax.cond, cell, _enclosed.threaded_cond),
        (jax.lax.switch, cell, _enclosed.threaded_switch),
        (jax.checkpoint, cell, _enclosed.threaded_checkpoint),
        # `jax.jit` and `jax.eval_shape` by attribute only: JAX itself calls them by
        # other references (every eager primitive runs through a `jit`); a jit reached
        # by another reference is traced in a deferred scope instead.
        (jax, "jit", _jits.threaded_jit),
        (jax, "eval_shape", _jits.threaded_eval_shape),
        # `jax.shard_map` calls the module's `_shard_map` however it was reached.
        (*_jax.SHARD_MAP, _mapped.threaded_shard_map),
        (*_jax.FILTER_JIT_CALL, _jits.threaded_filter_jit_call),
        (*_jax.JIT_INFER_PARAMS, _jits.deferring_infer_params),
        (*_jax.JIT_FAST_PATH, _jits.no_fast_path),
        *_harvest.primitive_patches(),
        *_arrivals.arrival_patches(),
    ]
