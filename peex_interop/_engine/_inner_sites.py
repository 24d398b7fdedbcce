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
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

from ._context import active
from ._kinds import MEMBERS
from ._paths import join
from ._sites import Frame, InnerCall
from ._threads import ThreadStack


class InnerKind(NamedTuple):
    """A kind of site inside a layer: its last path segment and its kind (`px.KINDS`)."""

    name: str
    kind: str


# The attention weights site of every attention, in every library (`_routes.py`,
# `_attention.py`, the adapters' own attention code).
WEIGHTS = InnerKind("weights", "attention_weights")

# The sites every attention layer has inside it, formed where it forms its weights:
# the weights, and the sites registered with `attention_argument_site`.
_attention_sites: list[InnerKind] = [WEIGHTS]
# `(function, argument position, kind)`: see `attention_argument_site`.
_argument_sites: list[tuple[Callable, int, InnerKind]] = []


def attention_argument_site(kind: InnerKind, function: Callable, position: int) -> None:
    """Make one argument of `function` a site of every attention layer: where the layer
    forms its weights (its weights function is `function`, or calls it), the argument at
    `position` of each call of `function` is the site `<attention>.<kind.name>`. A new
    kind of attention site is this one registration (`_attention_scores.py`), for every
    library and every attention written in one; `function` must be one whose calls are
    routed while hooking (`_routes.register_weights_function`)."""
    _attention_sites.append(kind)
    _argument_sites.append((function, position, kind))


def attention_site_names() -> set[str]:
    """The last path segments of the sites inside every attention layer."""
    return {kind.name for kind in _attention_sites}


def attention_sites_wanted() -> bool:
    """Whether some active context would select a site inside the attention layer
    running now: it must then form its weights where the engine sees them."""
    return any(wanted(*kind) for kind in _attention_sites)


def with_argument_sites(function: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`args` and `kwargs` of a call of `function` made while an attention layer forms
    its weights, with each argument registered as a site (`attention_argument_site`),
    given by position or by keyword, run as that site where it is wanted."""
    for registered, position, kind in _argument_sites:
        if registered is not function or not wanted(*kind):
            continue
        if len(args) > position:
            args = (*args[:position], inner_site(*kind, _same, (args[position],), {}), *args[position + 1 :])
        else:
            name = list(inspect.signature(function).parameters)[position]
            if name in kwargs:
                kwargs = {**kwargs, name: inner_site(*kind, _same, (kwargs[name],), {})}
    return args, kwargs


def _same(value: Any) -> Any:
    return value

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
        frame = _layer_frame(context.frames)
        if frame is None:
            continue
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
        frame = _layer_frame(context.frames)
        if frame is not None and context.would_select(join(frame.layer, name), InnerCall(frame.module, name, kind)):
            return True
    return False


def running_layer() -> Any:
    """The library module of the layer running now in the innermost active context
    (`None` outside any)."""
    contexts = active()
    frame = _layer_frame(contexts[-1].frames) if contexts else None
    return None if frame is None else frame.module


def running_path() -> str | None:
    """The path of the layer running now in the innermost active context, for errors."""
    contexts = active()
    frame = _layer_frame(contexts[-1].frames) if contexts else None
    return None if frame is None else frame.layer


def _layer_frame(frames: list[Frame]) -> Frame | None:
    """The innermost layer call running: a site inside a layer (the attention weights
    being formed) makes sites of that layer, not of itself (`attn.scores`)."""
    for frame in reversed(frames):
        if not isinstance(frame.module, InnerCall):
            return frame
    return None


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
