"""The engine: one hooked call = one context + the patches that feed it call sites."""

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from .._adapters._equinox import class_patches, equinox_kind
from . import _patching
from ._attention import attention_patches
from ._context import HookContext, Policy, entered
from ._routes import weights_patches
from ._transforms import transform_patches

# JAX's trace caches are keyed on this context. While hooking, a function traced
# before (a `jax.jit` created at import, a loop body defined at module level) misses
# the cache and retraces in Python, so its layer calls reach the call sites. A trace
# made while hooking is reused only under the same selections, and one that ran a
# selected layer not at all (`_transforms._deferred_body`).
_hooking_jit_key = jax.make_user_context(())


@contextlib.contextmanager
def hooking(
    root: Any, policy: Policy, *, probes: dict | None = None, discovering: bool = False
) -> Iterator[HookContext]:
    """Activate `policy` on the layers of `root` in this thread for the block; call
    `context.root` (the model, with each layer object at one path only).

    Class and transform patches are installed (or shared with overlapping calls) and
    undone on every exit path; the context is visible to this thread only.
    """
    context = HookContext(root, policy, probes, discovering, equinox_kind)
    patches = class_patches(context.module_types) + transform_patches() + attention_patches()
    if context.selection.inner.where != ():
        # Some site inside a layer may be selected: any attention layer's weights.
        patches += weights_patches()
    with _patching.patched(patches), entered(context) as active:
        # A static-facts pass (px.summary) records at trace time: never reuse its traces.
        key = tuple(c.selection if c.observes_values else object() for c in active)
        with _hooking_jit_key(key):
            yield context
    context.check_reached()
