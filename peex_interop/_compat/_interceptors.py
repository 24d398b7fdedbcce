"""Interceptors carry over: a Haiku- or linen-style interceptor function
`interceptor(next_f, args, kwargs, context)` runs unchanged around every layer and
method call of any model (Equinox, Haiku, NNX, linen, functions), through every
threaded transform.

The interceptor runs where the call runs, as `hk.intercept_methods` runs it: it may
edit the arguments it passes to `next_f` and the value it returns. What it records
(`records[name] = out`) is another matter: a value recorded inside a `vmap` or `scan`
body is that body's tracer, which leaks once the body returns (the libraries' own
interceptors leak there). So the containers it records into are given to px
(`records=`): at each call, what the interceptor added to them is taken out, carried
out of the transforms it ran in as a log of the call (stacked along their axes), and
put back after the model returns, in call order (a dict's later writes win, a list's
appends follow one another), as the interceptor would have left them with no
transform around.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
from jaxtyping import PyTree

from .._engine import (
    METHOD,
    PERTURBATION,
    SOWN,
    HookContext,
    InnerCall,
    ModuleView,
    Selection,
    Site,
    Where,
    check_same_shape,
    hooking,
)
from .._errors import HookError
from .._hooks import AbstractHookWrapper, selection_fields


class InterceptContext(NamedTuple):
    """What an interceptor gets as `context`: the fields of Haiku's `MethodContext`
    and linen's interceptor context, and the site's path.

    - `module`: the library's module; where it has no `module_name` (every library
        but Haiku), a view of it that adds one, the dotted path (`blocks.0.attn`),
        and `path`/`name` where it has none (the path's segments, the last one).
    - `method_name`: `"__call__"`, or the method's (`"attend"`).
    - `orig_method`, `orig_class`: the function called, and the module's class.
    - `module_name`: the module's dotted path (`""` for the model itself).
    """

    module: Any
    method_name: str
    orig_method: Callable
    orig_class: type
    module_name: str


def _context(site: Site) -> InterceptContext:
    method = site.path.rpartition(".")[2] if site.kind == METHOD else "__call__"
    layer = site.path.rpartition(".")[0] if site.kind == METHOD else site.path
    module = site.module
    if not hasattr(module, "module_name"):
        # Seen with the names a Haiku interceptor reads, where the library has none.
        segments = tuple(layer.split(".")) if layer else ()
        names = {"module_name": layer, "path": segments, "name": layer.rpartition(".")[2]}
        module = ModuleView(module, **{name: value for name, value in names.items() if not hasattr(module, name)})
    return InterceptContext(module, method, site.signature or site.call, type(site.module), layer)


@dataclasses.dataclass(frozen=True, eq=False)
class _Records:
    """The containers an interceptor records into (held by identity: a static field)."""

    containers: tuple[Any, ...]

    def __hash__(self) -> int:
        return hash(tuple(map(id, self.containers)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Records) and len(other.containers) == len(self.containers) and all(
            a is b for a, b in zip(self.containers, other.containers)
        )

    def marks(self) -> list[Any]:
        # A dict's entries (by identity) or a list's length, before a call.
        return [dict((k, id(v)) for k, v in c.items()) if isinstance(c, dict) else len(c) for c in self.containers]

    def take(self, marks: list[Any]) -> list[list[tuple[Any, Any]]]:
        """What the interceptor added since `marks`, taken out of the containers."""
        taken = []
        for container, mark in zip(self.containers, marks):
            if isinstance(container, dict):
                new = [(k, v) for k, v in container.items() if mark.get(k) != id(v)]
                for key, _ in new:
                    del container[key]
            else:
                new = list(enumerate(container[mark:]))
                del container[mark:]
            taken.append(new)
        return taken

    def put_back(self, keys: list[list[Any]], values: list[list[Any]]) -> None:
        """Put the values taken at one call back (as carried out of its transforms)."""
        for container, added, carried in zip(self.containers, keys, values):
            for key, value in zip(added, carried):
                if isinstance(container, dict):
                    container[key] = value
                else:
                    container.append(value)


class Intercepted(AbstractHookWrapper):
    """A model whose layer and method calls run through an interceptor; build it with
    `px.intercepted`."""

    model: PyTree
    interceptor: Callable = eqx.field(static=True)
    records: _Records = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model through the interceptor.

        **Arguments:**

        - `*args`, `**kwargs`: the model's own arguments.

        **Returns:**

        The model's (possibly intercepted) output; what the interceptor recorded is in
        the `records` containers.
        """
        policy = _Interception(self.selection, self.interceptor, self.records)
        with hooking(self.model, policy) as context:
            output = context.root(*args, **kwargs)
        for key, added in policy.order:
            self.records.put_back(added, context.logs[f"{key}:records"])
        return output


@dataclasses.dataclass
class _Interception:
    """One call of an `Intercepted` model: the policy running the interceptor at each
    selected layer or method call, and the records it took, in call order."""

    selection: Selection
    interceptor: Callable
    records: _Records
    order: list[tuple[str, list[list[Any]]]] = dataclasses.field(default_factory=list)

    def run_site(self, context: HookContext, site: Site) -> Any:
        if isinstance(site.module, InnerCall) or site.kind in (SOWN, PERTURBATION):
            return site.call(*site.args, **site.kwargs)  # interceptors see method calls only
        called = []

        def next_f(*args: Any, **kwargs: Any) -> Any:
            called.append(site.call(*args, **kwargs))
            return called[-1]

        marks = self.records.marks()
        run = lambda _: self.interceptor(next_f, site.args, site.kwargs, _context(site))  # noqa: E731
        output = context.apply(site, "interceptor", run, None)
        added = self.records.take(marks)
        if called:
            check_same_shape(site.path, "the interceptor's return value", called[-1], output)
        if any(added):
            context.record(site, f"{site.key}:records", [[value for _, value in entries] for entries in added])
            # The keys only: the values may be this trace's, which must not outlive it.
            self.order.append((site.key, [[key for key, _ in entries] for entries in added]))
        return output


def intercepted(
    model: PyTree,
    interceptor: Callable[[Callable, tuple, dict, InterceptContext], Any],
    *,
    records: dict | list | Sequence[dict | list] = (),
    layer_names: Sequence[str] | None = None,
    where: Where = None,
) -> Intercepted:
    """Run a Haiku- or linen-style interceptor around every layer and method call of
    any model, as `hk.intercept_methods` / `nn.intercept_methods` run it around their
    library's.

    !!! Example

        ```python
        outputs = {}

        def record(next_f, args, kwargs, context):
            out = next_f(*args, **kwargs)
            outputs[f"{context.module.module_name}/{context.method_name}"] = out
            return out

        y = px.intercepted(model, record, records=outputs)(x)
        ```

    **Arguments:**

    - `model`: an `eqx.Module` or converted model (not modified).
    - `interceptor`: `interceptor(next_f, args, kwargs, context)`, unchanged from its
        Haiku/linen use: `next_f(*args, **kwargs)` runs the call; what it returns is
        the call's output. `context` is a `px.InterceptContext`.
    - `records`: the dicts and lists the interceptor records into: what it adds is
        carried out of the transforms it runs in (module docstring) and is there, in
        call order, when the call returns.
    - `layer_names`, `where`: which calls (as for `px.ForwardHook`); every layer and
        method call by default.

    **Returns:**

    An `Intercepted` model, called with the model's own arguments.
    """
    containers = (records,) if isinstance(records, (dict, list)) else tuple(records)
    for container in containers:
        if not isinstance(container, (dict, list)):
            raise HookError(f"px.intercepted: records= takes dicts and lists, got a {type(container).__name__}")
    selection = selection_fields(model, "px.intercepted", layer_names, where, None)
    return Intercepted(
        model=model, layer_names=selection.names, where=selection.where, renames=selection.renames,
        interceptor=interceptor, records=_Records(containers),
    )
