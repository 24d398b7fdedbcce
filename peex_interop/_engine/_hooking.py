"""The engine: one hooked call = one context + the patches that feed it call sites."""

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax

from . import _patching
from ._attention import attention_patches
from ._attention_scores import SCORES  # noqa: F401  (the scores site registers itself on import)
from ._closed_world import check_reached
from ._context import entered
from ._hook_context import HookContext, Policy
from ._routes import weights_patches
from ._transforms import transform_patches

# JAX's trace caches are keyed on this context. While hooking, a function traced
# before (a `jax.jit` created at import, a loop body defined at module level) misses
# the cache and retraces in Python, so its layer calls reach the call sites. A trace
# made while hooking is reused only under the same selections, and one that ran a
# selected layer not at all (`_jits._deferred_body`).
_hooking_jit_key = jax.make_user_context(())


class Native(NamedTuple):
    """The library whose modules make up hooked pytrees (Equinox): how a module's kind
    is told (`px.KINDS`), and the patch targets (for `_patching.patched`) that make
    every call of the given module types a call site. Its adapter registers it
    (`register_native`, at import): the engine imports no adapter."""

    kind: Callable[[Any], str]
    class_patches: Callable[[Iterable[type]], list[tuple[Any, str, Any]]]


_native: list[Native] = []


def register_native(native: Native) -> None:
    """Make `native` the library whose module calls hooked pytrees are made of."""
    _native[:] = [native]


@contextlib.contextmanager
def hooking(
    root: Any, policy: Policy, *, probes: dict | None = None, discovering: bool = False
) -> Iterator[HookContext]:
    """Activate `policy` on the layers of `root` in this thread for the block; call
    `context.root` (the model, with each layer object at one path only).

    Class and transform patches are installed (or shared with overlapping calls) and
    undone on every exit path; the context is visible to this thread only.
    """
    native = _native[0]
    context = HookContext(root, policy, probes, discovering, native.kind)
    patches = native.class_patches(context.paths.module_types) + transform_patches() + attention_patches()
    if context.selection.inner.where != ():
        # Some site inside a layer may be selected: any attention layer's weights.
        patches += weights_patches()
    with _patching.patched(patches), entered(context) as active:
        # A static-facts pass (px.summary) records at trace time: never reuse its traces.
        key = tuple(c.selection if c.observes_values else object() for c in active)
        with _hooking_jit_key(key):
            yield context
    check_reached(context)
