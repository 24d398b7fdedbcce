from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, overload

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from .._engine import CallSite, call_with_site, may_name_a_step, needs_indices, takes_site


class AbstractHook(eqx.Module):
    """Base class for all hooks.

    The defining rule of a `hook_fn` is that its output has exactly the structure,
    shapes and dtypes of its input:

    - as a post-hook it receives the layer's output;
    - as a peex-style pre-hook (`pre_hook=True`) it receives the positional `args` tuple;
    - as a `pre_hook_fn` it receives `(args, kwargs)`;
    - in a `BackwardHook` it receives the cotangent of whichever of those it wraps.

    A hook whose `__call__` takes a second argument, `__call__(self, args, site)`,
    also receives the `px.CallSite` it runs at (path, kind, module type, call index,
    and traced step/example indices inside vmap/scan bodies).
    """

    # Part of a hooked model (or of its log), flattened at every call of a compiled
    # step: see `AbstractConverted`'s `__getattribute__`.
    __getattribute__ = object.__getattribute__

    @abstractmethod
    def __call__(self, args: Any) -> Any:
        pass


class IdentityHook(AbstractHook):
    """Returns its input unchanged."""

    def __call__(self, args: Any) -> Any:
        return args


class FunctionHook(AbstractHook):
    """Wraps a plain callable as a hook, so it travels as a pytree argument (not a stale
    closure) under `jax.jit`. A callable of two arguments `fn(value, site)` also
    receives the `px.CallSite`."""

    fn: Callable[..., Any]

    @property
    def takes_site(self) -> bool:
        return takes_site(self.fn)

    def __call__(self, args: Any, site: CallSite | None = None) -> Any:
        return self.fn(args, site) if self.takes_site else self.fn(args)


class HookMap(AbstractHook):
    """Different hooks for different layers in one wrapper: `{pattern: hook}`, the
    first pattern that names the call wins (patterns as in `where=`, matched against
    the layer's path or log key; `"blocks.1.attn"` names one step of a stack); layers
    no pattern names are left unchanged. Built from a dict given as `hook_fn`."""

    hooks: tuple[AbstractHook, ...]
    patterns: tuple[str, ...] = eqx.field(static=True)

    def __init__(self, hooks: Mapping[str, Any]):
        self.patterns = tuple(hooks)
        self.hooks = tuple(as_hook(hook) for hook in hooks.values())

    @property
    def needs_indices(self) -> bool:
        return any(map(may_name_a_step, self.patterns)) or any(map(needs_indices, self.hooks))

    def __call__(self, args: Any, site: CallSite) -> Any:
        out = args
        # Last pattern first, so that earlier ones override: the first match wins.
        for pattern, hook in reversed(tuple(zip(self.patterns, self.hooks))):
            match = site.matches(pattern)
            if match is True:
                out = call_with_site(hook, args, site)
            elif match is not False:
                edited = call_with_site(hook, args, site)
                out = jtu.tree_map(lambda e, o, m=match: jnp.where(m, e, o), edited, out)
        return out


# A hook as the wrappers accept it: a `px.AbstractHook`, any callable (wrapped), or a
# `{pattern: hook}` mapping (a `px.HookMap`).
HookLike = AbstractHook | Callable[..., Any] | Mapping[str, Any]


@overload
def as_hook(hook: HookLike) -> AbstractHook: ...
@overload
def as_hook(hook: None) -> None: ...
def as_hook(hook: HookLike | None) -> AbstractHook | None:
    if hook is None or isinstance(hook, AbstractHook):
        return hook
    if isinstance(hook, Mapping):
        return HookMap(hook)
    if callable(hook):
        return FunctionHook(hook)
    raise TypeError(
        f"expected a hook (px.AbstractHook, a callable or a {{pattern: hook}} dict), got {type(hook).__name__}"
    )
