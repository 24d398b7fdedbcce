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

from ._context import InnerCall, active
from ._paths import join
from ._selection import ATTENTION_WEIGHTS

# (name, kind) of the attention weights site of every attention, in every library.
WEIGHTS = (ATTENTION_WEIGHTS, "attention_weights")


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
        owner, local, path, _, module = context.frames[-1]
        site = InnerCall(module, name, kind)
        run = functools.partial(context.run, run, owner, (*local, name), join(path, name), site, call)
    return run(*args, **kwargs)


def wanted(name: str, kind: str) -> bool:
    """Whether some active context would select the site `name` of the layer running
    now: for adapters that form a value only when it is wanted (attention weights that
    the library's own code computes fused, or per head)."""
    for context in active():
        if context.frames:
            path = join(context.frames[-1][2], name)
            if context.would_select(path, InnerCall(context.frames[-1][4], name, kind)):
                return True
    return False


def running_layer() -> Any:
    """The library module of the layer running now in the innermost active context
    (`None` outside any)."""
    contexts = active()
    if not contexts or not contexts[-1].frames:
        return None
    return contexts[-1].frames[-1][4]


def running_path() -> str | None:
    """The path of the layer running now in the innermost active context, for errors."""
    contexts = active()
    return contexts[-1].frames[-1][2] if contexts and contexts[-1].frames else None


def routing(name: str, kind: str) -> Callable[[Callable], Callable]:
    """A patch maker (`_patching.patched`): the function it replaces, called inside a
    layer, becomes the site `<layer>.<name>`; called outside any hooked call (another
    thread included), it is the original."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def routed(*args: Any, **kwargs: Any) -> Any:
            return inner_site(name, kind, original, args, kwargs)

        return routed

    make.purpose = ("site", name, kind)  # pyright: ignore[reportFunctionMemberAccess]
    return make


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
