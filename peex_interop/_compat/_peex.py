"""peex 0.0.3 as its users wrote it: `from peex_interop import peex as px` runs peex code
unchanged, with peex's keys and numbers, on the engine (so also on converted Haiku,
NNX, linen and function models, and under every threaded transform).

What peex does, and the default API (`px.ForwardHook`) does differently:

- **Depth.** peex hooks the submodules the model's own `__call__` reaches as attributes
  (`self.linear1(x)`, a helper method `self.body(x)`: a bound method is a module), not
  what they call: here, the calls of depth-1 paths (`*`) made by the model's own code,
  not from inside another selected call. The default API hooks every depth.
- **A layer called twice.** peex's log holds its *last* call (each call overwrites, as
  fastai's `Hook.stored`), and its backward slot the *sum* of both calls' cotangents
  (one slot read twice): here too. The default API keeps every call (`lin`, `lin@1`)
  and a slot per call.
- **Pre-hooks** see the positional arguments only; keyword arguments pass through
  untouched (`self.head(x=h)` logs `()`). The default API binds arrays passed by
  keyword to positional parameters (`(h,)`).
- **An unknown `layer_names` entry** raises at call time an error that is both
  `px.HookError` and `AssertionError` (peex asserts), where the default API raises
  `px.HookError` at construction.
"""

import re
from collections.abc import Sequence
from typing import Any

import equinox as eqx
from jaxtyping import PyTree

from .._engine import HookContext, Selection, Site, hooking
from .._errors import HookError
from .._hooks import (
    AbstractLog,
    BackwardHook as PxBackwardHook,
    ForwardHook as PxForwardHook,
    HookLike,
    IdentityHook,
    NoneLog,
)

_REPEAT = re.compile(r"@(\d+)\Z")


class LayerNameError(HookError, AssertionError):
    """A `layer_names` entry that is no submodule of the model: peex asserted it at call
    time, so `except AssertionError` in peex code still catches it."""


def _check_layer_names(model: Any, layer_names: Sequence[str] | None) -> None:
    for name in layer_names or ():
        if not hasattr(model, name):
            raise LayerNameError(f"{type(model).__name__} does not have an attribute `{name}`.")
        if not isinstance(getattr(model, name), eqx.Module):
            raise LayerNameError(f"`{name}` is not an Equinox module.")


def _selection(layer_names: Sequence[str] | None) -> Selection:
    # The model's attributes (and its own methods): paths of one segment.
    return Selection(where=tuple(layer_names) if layer_names is not None else ("*",))


def _made_by_the_model(context: HookContext) -> bool:
    """Whether the call running now is made by the model's own code, not from inside
    another selected call (a helper method's own calls are that method's)."""
    return not any(frame.path for frame in context.frames[:-1])


def _base(key: str) -> str:
    return _REPEAT.sub("", key)


def _last_calls(log: dict[str, Any]) -> dict[str, Any]:
    """`{path: the log of its last call}`: later calls overwrite, as in peex."""
    numbered = sorted(log, key=lambda key: int(m.group(1)) if (m := _REPEAT.search(key)) else 0)
    return {_base(key): log[key] for key in numbered}


class _PeexConventions(eqx.Module):
    """What peex's two wrappers share: its signature, and its selection (depth 1, or
    `layer_names` checked at call time)."""

    # peex's field, holding what was given (a list): not static, as in peex (whose
    # users read it back); a static field must be hashable.
    layer_names: list[str] | None  # pyright: ignore[reportIncompatibleVariableOverride]

    def __init__(
        self,
        model: PyTree,
        hook_fn: HookLike | None = IdentityHook(),
        log_fn: AbstractLog = NoneLog(),
        log: dict = {},  # noqa: B006 - peex's signature; never mutated
        pre_hook: bool = False,
        layer_names: Sequence[str] | None = None,
    ):
        """**Arguments:** as peex's: `model`, `hook_fn` and `log_fn` (applied after each
        call of a depth-1 submodule, or before it to its positional arguments with
        `pre_hook=True`), `log` (entries to start the log with), `layer_names`
        (attribute names; all by default). For `BackwardHook`, `log` holds the slots
        `.init` makes."""
        # The next class in the MRO: px's ForwardHook or BackwardHook.
        super().__init__(model, hook_fn, log_fn, log, pre_hook)  # pyright: ignore[reportCallIssue]
        self.layer_names = layer_names  # pyright: ignore[reportAttributeAccessIssue]

    @property
    def selection(self) -> Selection:
        return _selection(self.layer_names)


class ForwardHook(_PeexConventions, PxForwardHook):
    """peex's `ForwardHook`: `(output, log)` with `log[name]` the last call of each
    depth-1 submodule the model's own code calls (see the module docstring)."""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        """**Returns:** `(output, log)`, as peex's."""
        _check_layer_names(self.model, self.layer_names)
        with hooking(self.model, self) as context:
            output = context.root(*args, **kwargs)
        return output, {**self.log, **_last_calls(context.logs)}

    def run_site(self, context: HookContext, site: Site) -> Any:
        if not _made_by_the_model(context):
            return site.call(*site.args, **site.kwargs)
        if not self.pre_hook:
            return super().run_site(context, site)
        args = site.args if self.hook_fn is None else context.apply_hook(site, "hook_fn", self.hook_fn, site.args)
        context.record(site, site.key, context.apply(site, "log_fn", self.log_fn, args))
        return site.call(*args, **site.kwargs)


class BackwardHook(_PeexConventions, PxBackwardHook):
    """peex's `BackwardHook`: `.init(*args)` gives one slot per depth-1 submodule the
    model's own code calls; a submodule called twice adds both calls' cotangents into
    its slot (see the module docstring)."""

    def init(self, *args: Any, **kwargs: Any) -> "BackwardHook":
        """**Returns:** a copy with a zero slot per hooked submodule (the first call's
        shapes; every call of a submodule shares its slot)."""
        _check_layer_names(self.model, self.layer_names)
        slots = super().init(*args, **kwargs).log
        shared = {_base(key): slot for key, slot in reversed(slots.items())}
        # peex's signature (`_PeexConventions.__init__`), which type checkers do not see.
        return BackwardHook(
            self.model, self.hook_fn, self.log_fn, shared, self.pre_hook, self.layer_names  # pyright: ignore[reportCallIssue]
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """**Returns:** the model's output; cotangent logs appear in gradients with
        respect to `log`."""
        _check_layer_names(self.model, self.layer_names)
        with hooking(self.model, self, probes=_Shared(self.log)) as context:
            return context.root(*args, **kwargs)

    def run_site(self, context: HookContext, site: Site) -> Any:
        if not _made_by_the_model(context):
            return site.call(*site.args, **site.kwargs)
        if not self.pre_hook:
            return super().run_site(context, site)
        return site.call(*self._attach(context, site, site.args), **site.kwargs)


class _Shared(dict):
    """Slots by log key where every call of a layer (`lin@1`) reads its layer's slot
    (`lin`): the same input twice, whose gradient is the sum of both cotangents."""

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and dict.__contains__(self, _base(key))

    def __getitem__(self, key: str) -> Any:
        return dict.__getitem__(self, _base(key))

