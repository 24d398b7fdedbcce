"""The hooking contexts active in this thread, and `call_site`: the one door through
which every library's layer call reaches them.

A *call site* is one call of one layer: its owner (the `eqx.Module` in the hooked pytree
that the call belongs to), a local path inside that owner (empty for Equinox layers; the
Haiku/NNX submodule path for converted models), the library's module object (for `where=`
type checks), the callable and its arguments. Adapters feed call sites to `call_site`;
every hooking context active in the calling thread then resolves the site's dotted path,
decides whether it is selected, and runs its policy (forward or backward hooks) around it
(`_hook_context.py`).
"""

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu

from .._errors import TransformError
from ._hook_context import HookContext
from ._kinds import METHOD
from ._paths import join
from ._steps import refuse_if_a_step_of_a_stack
from ._threads import ThreadStack
from ._unthreaded import THREADED, transform_name

_contexts = ThreadStack()


def active() -> list[HookContext]:
    """Contexts active in this thread, outermost first (other threads never see them)."""
    return _contexts.items


@contextlib.contextmanager
def entered(context: HookContext) -> Iterator[list[HookContext]]:
    """Make `context` active in this thread for the block; yields the active ones."""
    stack = active()
    context.thread_contexts = stack
    stack.append(context)
    try:
        yield stack
    finally:
        stack.remove(context)


def name_returned(outer: Any, inner: Any) -> None:
    """Name `inner`'s modules as the layers of `outer` at the same positions, in every
    active context (adapters call it where a library rebuilds layers it returns)."""
    for context in active():
        context.paths.name_returned(outer, inner)


def origin(leaf: Any) -> Any:
    """The leaf of the hooked model that `leaf` stands for: inside a threaded vmap/scan/
    cond/checkpoint body, body inputs are new tracers; outside, a leaf is itself.
    Adapters use it to recognise their own library objects rebuilt inside bodies."""
    for context in reversed(active()):
        found = context.paths.origin(leaf)
        if found is not leaf:
            return found
    return leaf


def call_site(
    owner: Any,
    call: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    *,
    local: tuple[str, ...] = (),
    module: Any = None,
    signature: Callable[..., Any] | None = None,
    member: str | None = None,
    kind: str = METHOD,
) -> Any:
    """Run `call(*args, **kwargs)` as a call site of `owner` (at `local` inside it)
    through every hooking context active in this thread.

    **Arguments:**

    - `owner`: the `eqx.Module` in the hooked pytree that this call belongs to.
    - `call`, `args`, `kwargs`: the layer call itself.
    - `local`: the layer's path inside `owner` (converters); `()` when the owner is
        the layer.
    - `module`: the library's module object, for `where=` types and predicates
        (defaults to `owner`).
    - `signature`: the function whose parameters `args` and `kwargs` fill, where
        `call` takes `(*args, **kwargs)` (defaults to `call`).
    - `member`, `kind`: for a site of the layer other than its call, its name and
        kind: a method (`embedder.attend`, kind `"method"`: `_methods.py`), a value it
        sows (`block.rs_after_attention`, kind `"sown"`). The site is
        `<layer path>.<member>`; one given no array (random keys aside) is none.

    **Returns:**

    The (possibly hooked) result of the call.
    """
    contexts = active()
    # A method given no data computes nothing on data (`init_cache(size, batch)`,
    # `mlp.reverse()`, `cell.initialize_carry(shape, rngs)`): not a site (`_methods.py`).
    if not contexts or (member is not None and not any(map(_is_data, jtu.tree_leaves((args, kwargs))))):
        return call(*args, **kwargs)
    module = owner if module is None else module
    site_kind = None
    if member is not None:
        local, site_kind = (*local, member), kind
    elif not local and module is not owner:
        return _as_root(contexts, owner, module, call, args, kwargs)
    run = call
    # Innermost context first, so its hooks sit closest to the layer.
    for context in reversed(contexts):
        prefix = context.resolve(owner, local)
        if prefix is None:
            continue
        path = join(*prefix, *local)
        run = functools.partial(
            context.run, run, owner, local, path, module, call if signature is None else signature, site_kind
        )
    if run is call and not (contexts[-1].frames and contexts[-1].frames[-1].owner is owner):
        refuse_if_passed_through(type(owner).__name__, owner)
        for context in contexts:
            refuse_if_a_step_of_a_stack(owner, context.paths.nodes, context.selection, context.native_kind)
    return run(*args, **kwargs)


def _is_data(leaf: Any) -> bool:
    """An array a method may compute on: not a random key, which seeds what it builds."""
    return eqx.is_array(leaf) and not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _as_root(contexts: list[HookContext], owner: Any, module: Any, call: Callable, args: tuple, kwargs: dict) -> Any:
    """A converted model running its library's root module (`local` empty): the call
    is the converted model's own call site, whose frame takes the module (its class
    and kind), so that sites inside it are told as a layer's (the weights of a model
    that is an attention)."""
    described = []
    for context in contexts:
        frame = context.frames[-1] if context.frames else None
        if frame is not None and frame.owner is owner and frame.local == ():
            context.frames[-1] = frame._replace(module=module, kind=context.native_kind_of(owner, module))
            described.append((context, frame))
    try:
        return call(*args, **kwargs)
    finally:
        for context, frame in described:
            context.frames[-1] = frame


def refuse_if_passed_through(name: str, values: Any) -> None:
    """A layer that no context can name is either not part of the model (built during
    the call: not a layer) or one that an unthreaded transform received as an argument,
    e.g. a `while_loop` carry: its arrays (`values`) are that transform's tracers. The
    second must not run unhooked. Adapters call this where their own naming fails."""
    contexts = active()
    if not contexts:
        return
    context = contexts[-1]
    if not (context.scopes.in_foreign_trace() or context.scopes[-1].cached):
        return
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in jtu.tree_leaves(values)):
        return
    where = f" (called from layer {context.frames[-1].path!r})" if context.frames else ""
    raise TransformError(
        f"a {name}{where} runs under {context.scopes.unthreadable() or transform_name()}, which received it as an "
        "argument: peex_interop cannot name it or thread its logs out, so it would run "
        f"unhooked. {THREADED} Move that transform outside the hooked model, or pass the "
        "layer in by closure."
    )

