from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, overload

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from .._engine._context import CallSite, call_with_site, needs_indices, takes_site
from .._engine._errors import HookError
from .._engine._selection import may_name_a_step


class AbstractLog(eqx.Module):
    """Base class for all logs.

    A `log_fn` may return anything (a pytree of arrays, or `None` to record nothing). It
    receives what the matching hook receives (see `px.AbstractHook`), after the hook ran,
    and, if its `__call__` takes a second argument, the `px.CallSite`.
    """

    # Part of a hooked model (or of its log), flattened at every call of a compiled
    # step: see `AbstractConverted`'s `__getattribute__`.
    __getattribute__ = object.__getattribute__

    @abstractmethod
    def __call__(self, args: Any) -> Any:
        pass

    def collect(self, log: dict[str, Any]) -> Mapping[str, Any]:
        """What a `px.ForwardHook` returns as the log, given every layer's entry: the
        dictionary itself, unless a log keeps its entries in another mapping (the
        statistics logs pack theirs into few arrays)."""
        return log


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
    """Wraps a plain callable as a log; `fn(value, site)` also receives the
    `px.CallSite`."""

    fn: Callable[..., Any]

    @property
    def takes_site(self) -> bool:
        return takes_site(self.fn)

    def __call__(self, args: Any, site: CallSite | None = None) -> Any:
        return self.fn(args, site) if self.takes_site else self.fn(args)


class LogMap(AbstractLog):
    """Different logs for different layers in one wrapper: `{pattern: log}`, the first
    pattern that names the layer's path or log key wins; layers no pattern names log
    nothing. (A log is whole-layer: to log one step of a stack, select it with
    `where="blocks.1.attn"`.) Built from a dict given as `log_fn`."""

    logs: tuple[AbstractLog, ...]
    patterns: tuple[str, ...] = eqx.field(static=True)

    def __init__(self, logs: Mapping[str, Any]):
        self.patterns = tuple(logs)
        self.logs = tuple(as_log(log) for log in logs.values())

    @property
    def needs_indices(self) -> bool:
        return any(map(may_name_a_step, self.patterns)) or any(map(needs_indices, self.logs))

    @property
    def needs_axis_names(self) -> bool:
        return any(getattr(log, "needs_axis_names", False) for log in self.logs)

    def __call__(self, args: Any, site: CallSite) -> Any:
        for pattern, log in zip(self.patterns, self.logs):
            match = site.matches(pattern)
            if match is True:
                return call_with_site(log, args, site)
            if match is not False:
                raise HookError(
                    f"log_fn pattern {pattern!r} names one step of the stack at {site.path!r}: a "
                    "log covers whole layers; select the step with where= instead"
                )
        return None


# A log as the wrappers accept it: a `px.AbstractLog`, any callable (wrapped), or a
# `{pattern: log}` mapping (a `px.LogMap`).
LogLike = AbstractLog | Callable[..., Any] | Mapping[str, Any]


@overload
def as_log(log: LogLike) -> AbstractLog: ...
@overload
def as_log(log: None) -> None: ...
def as_log(log: LogLike | None) -> AbstractLog | None:
    if log is None or isinstance(log, AbstractLog):
        return log
    if isinstance(log, Mapping):
        return LogMap(log)
    if callable(log):
        return FunctionLog(log)
    raise TypeError(
        f"expected a log (px.AbstractLog or a callable), got {type(log).__name__}"
    )
