"""Sites inside a layer: a function call made while a layer runs, as a call site.

A layer's own code computes values no layer call returns: the attention weights of an
attention layer, the activation function inside an MLP block. Adapters (and
`px.function_sites`) route such calls here; each becomes a call site of the innermost
layer running in each active context, named `<layer path>.<name>` (`blocks.0.attn.
weights`, `@n` for repeats), through the same `HookContext.run` as layer calls: hooks,
logs, backward logs, `CallSite`, stacks of layers and threaded transforms all work
unchanged. Its `module` is an `InnerCall`. Only selections that name such sites select
them (`Selection.inner`), so they change no existing selection's logs.
"""

import functools
from collections.abc import Callable
from typing import Any

from ._context import active
from ._kinds import MEMBERS
from ._paths import join
from ._selection import ATTENTION_WEIGHTS
from ._sites import InnerCall
from ._threads import ThreadStack

# (name, kind) of the attention weights site of every attention, in every library.
WEIGHTS = (ATTENTION_WEIGHTS, "attention_weights")

# Calls made in this thread in a trace that is thrown away (linen's `nn.scan` pre-pass)
# are no sites: inside it, the layer running is not the one that makes the calls.
silenced = ThreadStack()


def inner_site(name: str, kind: str, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run `call(*args, **kwargs)` as the site `name` of the layer running now in
    every active context (a call outside any layer runs as it is).

    **Arguments:**

    - `name`: the site's last path segment (`"weights"`, `"gelu"`).
    - `kind`: its kind (`px.KINDS`: `"attention_weights"`, `"function"`).
    - `call`, `args`, `kwargs`: the call itself.

    **Returns:**

    The (possibly hooked) result of the call.
    """
    run = call
    # Innermost context first, so its hooks sit closest to the call.
    for context in reversed(active()):
        if not context.frames:
            continue
        frame = context.frames[-1]
        site = InnerCall(frame.module, name, kind)
        # Inside a method site (`embedder.attend`), a site of its layer (`embedder`).
        layer_local = frame.local[:-1] if frame.kind in MEMBERS else frame.local
        run = functools.partial(
            context.run, run, frame.owner, (*layer_local, name), join(frame.layer, name), site, call, kind
        )
    return run(*args, **kwargs)


def wanted(name: str, kind: str) -> bool:
    """Whether some active context would select the site `name` of the layer running
    now: for adapters that form a value only when it is wanted (attention weights that
    the library's own code computes fused, or per head)."""
    for context in active():
        if context.frames:
            frame = context.frames[-1]
            if context.would_select(join(frame.layer, name), InnerCall(frame.module, name, kind)):
                return True
    return False


def running_layer() -> Any:
    """The library module of the layer running now in the innermost active context
    (`None` outside any)."""
    contexts = active()
    if not contexts or not contexts[-1].frames:
        return None
    return contexts[-1].frames[-1].module


def running_path() -> str | None:
    """The path of the layer running now in the innermost active context, for errors."""
    contexts = active()
    return contexts[-1].frames[-1].layer if contexts and contexts[-1].frames else None


class ModuleView:
    """A module seen with some attributes replaced. Installed as one library module's
    global name (`jax` in Equinox's or Haiku's attention code), it reroutes that
    module's calls only, where patching `jax.nn.softmax` itself would reach every
    softmax of every library."""

    def __init__(self, module: Any, **replaced: Any):
        self.viewed = module
        vars(self).update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.viewed, name)
