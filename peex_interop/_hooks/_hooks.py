from abc import abstractmethod
from collections.abc import Callable
from typing import Any, overload

import equinox as eqx


class AbstractHook(eqx.Module):
    """Base class for all hooks.

    The defining rule of a `hook_fn` is that its output has exactly the structure,
    shapes and dtypes of its input:

    - as a post-hook it receives the layer's output;
    - as a peex-style pre-hook (`pre_hook=True`) it receives the positional `args` tuple;
    - as a `pre_hook_fn` it receives `(args, kwargs)`;
    - in a `BackwardHook` it receives the cotangent of whichever of those it wraps.
    """

    @abstractmethod
    def __call__(self, args: Any) -> Any:
        pass


class IdentityHook(AbstractHook):
    """Returns its input unchanged."""

    def __call__(self, args: Any) -> Any:
        return args


class FunctionHook(AbstractHook):
    """Wraps a plain callable as a hook, so it travels as a pytree argument (not a stale
    closure) under `jax.jit`."""

    fn: Callable[[Any], Any]

    def __call__(self, args: Any) -> Any:
        return self.fn(args)


# A hook as the wrappers accept it: a `px.AbstractHook`, or any callable (wrapped).
HookLike = AbstractHook | Callable[[Any], Any]


@overload
def as_hook(hook: HookLike) -> AbstractHook: ...
@overload
def as_hook(hook: None) -> None: ...
def as_hook(hook: HookLike | None) -> AbstractHook | None:
    if hook is None or isinstance(hook, AbstractHook):
        return hook
    if callable(hook):
        return FunctionHook(hook)
    raise TypeError(
        f"expected a hook (px.AbstractHook or a callable), got {type(hook).__name__}"
    )
