"""Method sites: a layer's calls of its methods other than `__call__`, as call sites.

Real models reach layers through other doors than `__call__`: Gemma's logits are
`self.embedder.attend(x)` (the tied embedding as output projection), autoencoders
have `encode`/`decode`, a helper method `self.body(x)` (a layer in peex). Each call of
such a method is the site `<layer path>.<method>` (`embedder.attend`; the root's own
methods: `body`), of kind `"method"`, with everything a layer call has (hooks, logs,
backward logs, `CallSite`, stacks, threaded transforms).

Which methods: the public ones (no leading underscore) written in the body of the
module's own classes, not of its library's base class (`eqx.Module`, `nnx.Module`,
`nn.Module`, `hk.Module`: `sow`, `param`, `params_dict` are plumbing), and not
properties, static or class methods, nested classes or a field's default function
(linen's `kernel_init`). That is what `hk.intercept_methods` and
`nnx.capture(method_outputs=)` see, less two kinds of calls that compute nothing on
data: methods that take no argument (`is_stateful()`: a question about the layer), and
calls given no array but random keys (`init_cache(size, batch)`, `mlp.reverse()`,
`cell.initialize_carry(shape, rngs)`: they build things), checked per call by
`_context.call_site`. Private methods are the layer's
implementation, as for Haiku and `nnx.capture`.
"""

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx

from . import _patching
from ._paths import AbstractConverted, join, walk

_NOT_METHODS = (property, staticmethod, classmethod, functools.cached_property)


@functools.cache
def site_methods(cls: type, base: type) -> tuple[str, ...]:
    """The names of the methods of `cls` whose calls are method sites (see the module
    docstring); `base` is its library's module base class, whose methods are not."""
    names: set[str] = set()
    shadowed: set[str] = set()
    for klass in cls.__mro__:
        if issubclass(base, klass):  # the base class and what it derives from
            continue
        for name, value in vars(klass).items():
            if name in shadowed or name.startswith("_"):
                continue
            shadowed.add(name)  # the subclass's attribute decides, whatever it is
            if _defined_as_method(klass, name, value) and _takes_an_argument(value):
                names.add(name)
    return tuple(sorted(names))


def _defined_as_method(klass: type, name: str, value: Any) -> bool:
    # A function written in the class body (decorated or not): not a field's default
    # function (linen's `kernel_init`, an `activation`), a nested class or a property.
    if isinstance(value, (type, *_NOT_METHODS)) or not callable(value):
        return False
    return getattr(value, "__qualname__", None) == f"{klass.__qualname__}.{name}"


def _takes_an_argument(method: Any) -> bool:
    try:
        parameters = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return True  # a wrapped method whose signature is hidden: assume it computes
    return len(parameters) > 1 or any(p.kind is p.VAR_POSITIONAL for p in parameters)


def method_call_patches(
    types: Iterable[type], base: type, route: Callable[[Callable, Any, str, tuple, dict], Any]
) -> list[tuple[type, str, Callable[[Any], Any]]]:
    """Targets replacing each site method of each type by
    `route(original, module, method name, args, kwargs)`: how adapters whose library
    has no interceptor (Equinox, NNX) hand method calls to the engine's call sites."""
    targets = []
    for name in sorted({name for cls in types for name in site_methods(cls, base)}):

        def make(original: Callable, name: str = name) -> Callable:
            @functools.wraps(original)
            def method(self, *args, **kwargs):
                return route(original, self, name, args, kwargs)

            return method

        make.purpose = ("method calls", route, name)  # pyright: ignore[reportFunctionMemberAccess]
        having = [cls for cls in types if name in site_methods(cls, base)]
        targets.extend(_patching.method_patches(having, name, make))
    return targets


def method_paths(modules: Iterable[tuple[str, Any]], base: type) -> list[str]:
    """`<path>.<method>` of every site method of the given `(path, module)`s: the
    method sites a selection may name ahead of the call."""
    paths = []
    for path, module in modules:
        cls = module if isinstance(module, type) else type(module)
        paths.extend(f"{path}.{name}" if path else name for name in site_methods(cls, base))
    return paths


def known_method_paths(root: Any) -> list[str]:
    """The paths of the method sites of `root`'s Equinox modules and of the converted
    models in it that list theirs (`AbstractConverted.method_paths`)."""
    paths = []
    for path, node in walk(root):
        if isinstance(node, AbstractConverted):
            paths.extend(join(*path, *local) for local in node.method_paths())
        elif isinstance(node, eqx.Module):
            paths.extend(method_paths([(join(*path), node)], eqx.Module))
    return paths
