"""The transforms the engine does not thread: naming them in errors, and refusing.

A layer run under a transform the engine neither threads nor carries values out of
(`_harvest.py`) must never run unhooked: it is refused, and the error names that
transform as the user wrote it (`jax.lax.while_loop`, not JAX's trace name).
"""

import contextlib
from collections.abc import Iterator

from . import _jax
from ._threads import ThreadStack

THREADED = (
    "Threaded transforms, whatever reference reaches them: jax.vmap, eqx.filter_vmap, "
    "jax.lax.scan, jax.lax.map, jax.lax.fori_loop with static bounds, jax.lax.cond, "
    "jax.lax.switch, jax.jit and eqx.filter_jit (also compiled before hooking), "
    "jax.checkpoint/remat, eqx.filter_checkpoint, jax.shard_map, a function decorated "
    "with @jax.vmap."
)


_TRACED_FOR = {
    "while_loop": "jax.lax.while_loop (or a fori_loop with traced bounds)",
    "while_body": "jax.lax.while_loop (or a fori_loop with traced bounds)",
    "while_cond": "jax.lax.while_loop (or a fori_loop with traced bounds)",
    "scan": "jax.lax.scan", "cond": "jax.lax.cond/switch", "switch": "jax.lax.cond/switch",
    "checkpoint": "jax.checkpoint", "jit": "jax.jit", "custom_vjp": "jax.custom_vjp",
    "custom_jvp": "jax.custom_jvp", "shard_map": "jax.shard_map",
}


def transform_name() -> str:
    """The transform the current trace belongs to, for error messages (private JAX
    API, used only to make a message precise)."""
    try:
        trace = _jax.current_trace()
        kind = type(trace).__name__
        if kind == "BatchTrace":
            return "jax.vmap applied before hooking began (a function decorated with @jax.vmap at import)"
        if kind in ("JVPTrace", "LinearizeTrace", "JaxprTrace"):
            return "autodiff inside the model (jax.grad/jax.vjp/jax.jacrev/jax.linearize)"
        traced_for, func_name = _jax.traced_for(trace)
        # JAX names sub-traces after their transform ("custom_vjp fun", "while_body").
        named = _TRACED_FOR.get(traced_for) or _TRACED_FOR.get(traced_for.split(" ")[0])
        return f"{named or repr(traced_for)} of {func_name!r}"
    except Exception:
        return "a JAX transform"


# The transforms around the code running in this thread whose layers are refused
# (`refusing`), innermost last.
_refused = ThreadStack()


@contextlib.contextmanager
def refusing(transform: str) -> Iterator[None]:
    """Refuse every selected layer called in the block, naming `transform`: one whose
    logs the engine could only give in a layout of JAX's choosing."""
    _refused.items.append(transform)
    try:
        yield
    finally:
        _refused.items.pop()


def refused_here() -> str | None:
    """The innermost transform around the code running now that refuses every selected
    layer (`refusing`), if any."""
    return _refused.items[-1] if _refused.items else None
