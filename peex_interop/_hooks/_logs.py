from abc import abstractmethod
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Mapping
from typing import Any, overload

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from .._engine import CallSite, call_with_site, may_name_a_step, needs_indices, takes_site
from .._errors import HookError


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


# The containers a statistic keeps around its values: JAX's own pytree nodes.
_PLAIN = (tuple, list, dict, OrderedDict, defaultdict, type(None))


def plain_containers(value: Any) -> Any:
    """`value` with the same leaves, in which every pytree node other than a tuple, list,
    dict, namedtuple or None is replaced by plain containers: by its only child if it
    has one, else by a dict of its children keyed by name where the node names them
    (the fields of a dataclass or `eqx.Module`, the keys of a mapping), else by a tuple
    of them in order.

    What a statistics log maps its statistic over. A node of another class is the user's
    container (e3nn's `IrrepsArray`, a `flax.struct` dataclass, an `eqx.nn.State`), made
    to hold arrays of its own description: rebuilt around the statistics of its arrays
    (an `IrrepsArray` of irreps `8x0e+4x1o`, 20 values, around a scalar mean), it is a
    broken container that arithmetic, `.filter` or `float()` refuse. The statistic of a
    container is a number, or numbers in plain containers, that any code can read.

    **Arguments:**

    - `value`: a pytree.

    **Returns:**

    A pytree of the same leaves with only plain containers (for a leaf, the leaf).
    """
    children = jtu.tree_flatten_with_path(value, is_leaf=lambda child: child is not value)[0]
    if len(children) == 1 and children[0][1] is value:  # a leaf
        return value
    if type(value) in _PLAIN or _is_namedtuple(value):
        return jtu.tree_map(plain_containers, value, is_leaf=lambda child: child is not value)
    if len(children) == 1:
        return plain_containers(children[0][1])
    keys = [path[0] for path, _ in children]
    if all(isinstance(key, (jtu.GetAttrKey, jtu.DictKey)) for key in keys):
        names = [key.name if isinstance(key, jtu.GetAttrKey) else key.key for key in keys]
        return {name: plain_containers(child) for name, (_, child) in zip(names, children)}
    return tuple(plain_containers(child) for _, child in children)


def _is_namedtuple(value: Any) -> bool:
    # As JAX tells them (a tuple with `_fields`): each is its own pytree node.
    return isinstance(value, tuple) and hasattr(value, "_fields")


class MeanLog(AbstractLog):
    """Records the mean of every array leaf, in plain containers: tuples, lists, dicts
    and namedtuples keep their structure, other pytree nodes do not
    (`plain_containers`)."""

    def __call__(self, args: Any) -> Any:
        return jtu.tree_map(jnp.mean, plain_containers(args))


class MeanStdLog(AbstractLog):
    """Records `(mean, std)` of every array leaf, in plain containers (as `px.MeanLog`)."""

    def __call__(self, args: Any) -> Any:
        args = plain_containers(args)
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
