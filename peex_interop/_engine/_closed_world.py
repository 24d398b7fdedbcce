"""The closed-world rule: every name and pattern the user gave must reach a call.

An empty log is never the answer to an explicit selection: checked after each hooked
call (`_hooking.hooking`), against the paths the call ran and the layers the model has
(`_known_paths.py`: the one exception).
"""

import difflib

from .._errors import HookError
from . import _known_paths
from ._hook_context import HookContext
from ._selection import could_be_step, glob_to_regex, may_name_a_step


def check_reached(context: HookContext) -> None:
    """After the call, the closed-world rule: every name and pattern the user gave
    (`layer_names`, `where=` globs, `rename=` keys, `{pattern: hook}` maps) must have
    reached a call. An empty log is never the answer to an explicit selection: a
    typo, a layer used only through another method than `__call__`, or a stack of
    layers run by indexing its arrays (whose steps are new objects) all raise. The
    one exception: a name or pattern that names only layers the model has (listed,
    or reached by an earlier call) none of which ran, or sites inside such layers,
    selects nothing, as the libraries' own interceptors do (`_known_paths.py`)."""
    models = list(context.paths.modules.values())
    _known_paths.remember(models, context.seen)
    known = None  # built on the first name or pattern that reached no call
    selection = context.selection
    given = [
        *(("layer name", name) for name in selection.names or ()),
        *(("where pattern", c) for c in selection.where or () if isinstance(c, str)),
        *(("rename= path", source) for source, _ in selection.renames),
        *(("hook/log map pattern", p) for p in getattr(context.policy, "explicit_patterns", ())),
    ]
    for what, pattern in given:
        regex = glob_to_regex(pattern)
        # A map's pattern acts on selected calls only; the selection's own names and
        # patterns reach a call when it runs (other criteria may then leave it out).
        # Keys reach too: a name of one call (`lin@1`) reaches that call's key.
        reached = context.selected if what == "hook/log map pattern" else context.seen | context.selected
        if pattern in context.step_hits or any(regex.match(path) for path in reached):
            continue
        one_step = what == "hook/log map pattern" and may_name_a_step(pattern)
        if one_step and could_be_step(pattern, list(context.selected)):
            continue
        if known is None:
            known = _known_paths.Known(models, context.seen, context.root)
        if known.names_only_layers_not_run(pattern):
            continue
        # The paths and keys of this call: what `px.sites` lists.
        called = sorted(p for p in context.seen | context.selected | context.passed_over if p)
        close = difflib.get_close_matches(pattern, called, n=5, cutoff=0.4) or called[:12]
        raise HookError(
            f"{what} {pattern!r} selected no call of the model: no selected layer with a "
            "matching path was called (a layer used only through a method other than "
            "`__call__` is not called itself: its method sites are, `enc.encode`; an "
            "attention layer's `.weights` exists only where it forms its weights with "
            "jax.nn.softmax or Flax's dot_product_attention_weights; a stack of layers run by indexing its arrays "
            "makes new layers that are not the stack's; a number names one step of a "
            f"stack, following the first layer called in its scan/vmap body, e.g. "
            f"`blocks.1.attn`; only a layer the model has that did not run at all is "
            f"no error). Closest layers called: {', '.join(close) or 'none'}"
        )

