"""Scoped, reference-counted attribute patching.

Patches are global (classes and the `jax` namespace are shared by all threads), so every
replacement installed here must fall through to the original when the calling thread has
no active hooking context; that is what makes concurrent calls invisible to each other.
The reference count keeps a patch in place until the last overlapping call has left.
"""

import contextlib
import functools
import inspect
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .._errors import HookError
from . import _jax

_lock = threading.Lock()
# (id(owner), name) -> [owner, had_own_attribute, original_value, count, purpose]
_installed: dict[tuple[int, str], list] = {}

ORIGINAL = "__peex_interop_original__"
# Every replacement function still alive, by id: a name bound to one elsewhere (by an
# overlapping call, or a `from x import f` run while it was installed) is a binding of
# its original (`replacements_of`). Weak, so that an id is forgotten with its function
# and never matches an object that reuses it.
_replacements: "weakref.WeakValueDictionary[int, Callable]" = weakref.WeakValueDictionary()
# The attribute name that stands for the function a JAX entry point wraps (see `_jax.wrapped_cell`).
WRAPPED_FUNCTION = "<wrapped function>"


def unwrap(value: Any) -> Any:
    """The original behind one of our replacements (replacements chain through this)."""
    while hasattr(value, ORIGINAL):
        value = getattr(value, ORIGINAL)
    return value


def replacements_of(wanted: set[int]) -> list[Callable]:
    """The live replacement functions whose original's id is in `wanted`."""
    with _lock:
        alive = list(_replacements.values())
    return [replacement for replacement in alive if id(unwrap(replacement)) in wanted]


def current(owner: Any, name: str) -> Any:
    """What `owner.name` is now (for a JAX entry point's `WRAPPED_FUNCTION`: the
    function in its cell), to check that every patch was undone."""
    return _jax.wrapped_cell(owner).cell_contents if name == WRAPPED_FUNCTION else getattr(owner, name)


def entry_point(wrapper: Any) -> Any:
    """The function behind a JAX entry point (`jax.jit`, `jax.eval_shape`, ...), never
    a hooking replacement: for the engine's own transforms, which must not be threaded."""
    return _jax.wrapped_function(unwrap(wrapper))


def purpose_of(make: Callable[[Any], Any]) -> Any:
    """What a patch maker's replacement does: makers built per call (closures) name it
    in a `purpose` attribute, module-level ones are their own."""
    return getattr(make, "purpose", make)


def _install(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    with _lock:
        entry = _installed.get((id(owner), name))
        if entry is not None:
            # An overlapping call shares the replacement installed first; one wanting
            # another replacement there would silently get the first one's behaviour.
            if entry[4] != purpose_of(make):
                what = getattr(owner, "__name__", type(owner).__name__)
                raise HookError(
                    f"{what}.{name} is already intercepted for {entry[4]!r} and cannot also be for "
                    f"{purpose_of(make)!r} in the same call: select one of the two (a function named in "
                    "px.function_sites that the engine already makes a site of, such as "
                    "jax.nn.dot_product_attention, is selected through that site instead)"
                )
            entry[3] += 1
            return
        if name == WRAPPED_FUNCTION:
            cell = _jax.wrapped_cell(owner)
            had_own, own_value, original = True, cell.cell_contents, unwrap(cell.cell_contents)
        else:
            had_own = name in vars(owner)
            own_value = vars(owner)[name] if had_own else None
            original = unwrap(getattr(owner, name))
        replacement = make(original)
        setattr(replacement, ORIGINAL, original)  # how `unwrap` and chained patches find it
        if type(replacement) is types.FunctionType:
            _replacements[id(replacement)] = replacement
        if name == WRAPPED_FUNCTION:
            _jax.wrapped_cell(owner).cell_contents = replacement
        else:
            setattr(owner, name, replacement)
        _installed[(id(owner), name)] = [owner, had_own, own_value, 1, purpose_of(make)]


def _uninstall(owner: Any, name: str) -> None:
    with _lock:
        entry = _installed[(id(owner), name)]
        entry[3] -= 1
        if entry[3]:
            return
        del _installed[(id(owner), name)]
        if name == WRAPPED_FUNCTION:
            _jax.wrapped_cell(owner).cell_contents = entry[2]
        elif entry[1]:
            setattr(owner, name, entry[2])
        else:
            # An inherited attribute is restored by removing ours, not by copying the
            # parent's value down (which would freeze it against later changes).
            delattr(owner, name)


@contextlib.contextmanager
def patched(
    targets: Iterable[tuple[Any, str, Callable[[Any], Any]]],
) -> Iterator[None]:
    """Install `make(original)` as `owner.name` for each target for the duration of the
    block, undoing every installed patch on every exit path."""
    done = []
    try:
        for owner, name, make in targets:
            _install(owner, name, make)
            done.append((owner, name))
        yield
    finally:
        for owner, name in reversed(done):
            _uninstall(owner, name)


def is_patched(owner: Any, name: str) -> bool:
    with _lock:
        return (id(owner), name) in _installed


def defines(cls: type, name: str) -> bool:
    """Whether `cls` has its own or an inherited `name` (not counting `object`)."""
    return any(name in vars(klass) for klass in cls.__mro__[:-1])


def method_patches(
    types: Iterable[type], name: str, make: Callable[[Any], Any]
) -> list[tuple[type, str, Callable[[Any], Any]]]:
    """Targets replacing method `name` of each type that has one, in a stable order (so
    overlapping calls install and remove patches consistently)."""
    return [
        (cls, name, make)
        for cls in sorted(types, key=lambda c: (c.__module__, c.__qualname__))
        if defines(cls, name)
    ]


def call_patches(
    types: Iterable[type], route: Callable[[Callable, Any, tuple, dict], Any]
) -> list[tuple[type, str, Callable[[Any], Any]]]:
    """Targets replacing `__call__` of each type that has one by
    `route(original, module, args, kwargs)`: how the Equinox and NNX adapters hand
    their modules' calls to the engine's call sites."""

    def make(original: Callable) -> Callable:
        def __call__(self, *args, **kwargs):
            return route(original, self, args, kwargs)

        return __call__

    make.purpose = ("layer calls", route)  # pyright: ignore[reportFunctionMemberAccess]
    return method_patches(types, "__call__", make)


@functools.cache
def signature(fn: Callable) -> inspect.Signature:
    """The signature of the real function behind a replaced entry point."""
    return inspect.signature(unwrap(fn))


def bound_arguments(real: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a call of `real`, by parameter name, as JAX binds them: the
    replacement of a JAX entry point accepts exactly the calling conventions it does."""
    return dict(signature(real).bind(*args, **kwargs).arguments)
