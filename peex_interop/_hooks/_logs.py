from abc import abstractmethod
from collections.abc import Callable
from typing import Any, overload

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu


class AbstractLog(eqx.Module):
    """Base class for all logs.

    A `log_fn` may return anything (a pytree of arrays, or `None` to record nothing). It
    receives what the matching hook receives (see `px.AbstractHook`), after the hook ran.
    """

    @abstractmethod
    def __call__(self, args: Any) -> Any:
        pass


class NoneLog(AbstractLog):
    """Records nothing."""

    def __call__(self, args: Any) -> None:
        return None


class IdentityLog(AbstractLog):
    """Records the value itself."""

    def __call__(self, args: Any) -> Any:
        return args


class MeanLog(AbstractLog):
    """Records the mean of every array leaf."""

    def __call__(self, args: Any) -> Any:
        return jtu.tree_map(jnp.mean, args)


class MeanStdLog(AbstractLog):
    """Records `(mean, std)` of every array leaf."""

    def __call__(self, args: Any) -> Any:
        return jtu.tree_map(jnp.mean, args), jtu.tree_map(jnp.std, args)


class FunctionLog(AbstractLog):
    """Wraps a plain callable as a log."""

    fn: Callable[[Any], Any]

    def __call__(self, args: Any) -> Any:
        return self.fn(args)


# A log as the wrappers accept it: a `px.AbstractLog`, or any callable (wrapped).
LogLike = AbstractLog | Callable[[Any], Any]


@overload
def as_log(log: LogLike) -> AbstractLog: ...
@overload
def as_log(log: None) -> None: ...
def as_log(log: LogLike | None) -> AbstractLog | None:
    if log is None or isinstance(log, AbstractLog):
        return log
    if callable(log):
        return FunctionLog(log)
    raise TypeError(
        f"expected a log (px.AbstractLog or a callable), got {type(log).__name__}"
    )
