"""A shape-only pass must not change what the real pass computes.

The engine runs parts of a model abstractly that the model itself runs once: a threaded
`vmap`/`scan` body, to find its backward slots (`_bodies.Body.probes`); the branches
of a `cond`, to pad their logs to one structure; the whole model, in `BackwardHook.init`.
JAX traces are pure, but the model libraries keep Python state that every trace
advances: Haiku names a module by counting the names its frame has seen (`mlp`, then
`mlp_1`) and draws keys from a `PRNGSequence`; linen counts the keys each scope has made,
and a lifted body's scope shares its parent's counts. An extra abstract run would move
both on, and the real run would ask for `mlp_1`'s parameters, or fold another count into
its dropout keys.

The engine knows no library: each adapter registers a `Save` for its own (at import: a
library's models reach the engine only through their adapter). `shape_only` brackets a
shape-only pass with every registered one.
"""

import contextlib
from collections.abc import Callable, Iterable, Iterator, MutableMapping, MutableSequence, MutableSet
from typing import Any

# Snapshots the library's Python state as it is in this thread now; returns what puts
# it back.
Save = Callable[[], Callable[[], None]]

_savers: list[Save] = []


def register_shape_pass_save(save: Save) -> None:
    """Have every shape-only pass leave a library's Python state as it found it."""
    if save not in _savers:
        _savers.append(save)


@contextlib.contextmanager
def shape_only() -> Iterator[None]:
    """A shape-only pass: on exit (exceptions included), every library's Python state is
    what it was on entry. Passes nest (a body's probe run inside a branch's abstract
    run): each puts back what it found, so the enclosing one replays the real pass."""
    restores = [save() for save in _savers]
    try:
        yield
    finally:
        for restore in reversed(restores):
            restore()


def snapshot_containers(objects: Iterable[Any]) -> Callable[[], None]:
    """Snapshot mutable containers (dicts, sets, lists, deques) now; the result restores
    their contents *in place*: the library holds references to these very objects (a
    lifted linen scope shares its parent's counts dict), so new ones would not do."""
    saved = {id(obj): (obj, _copy(obj)) for obj in objects}

    def restore() -> None:
        for obj, contents in saved.values():
            obj.clear()
            if isinstance(obj, MutableSequence):
                obj.extend(contents)
            else:
                obj.update(contents)

    return restore


def _copy(obj: Any) -> Any:
    if isinstance(obj, MutableMapping):
        return dict(obj)  # `Counter.update` after `clear` sets counts, as `dict.update` does
    if isinstance(obj, (MutableSet, MutableSequence)):
        return list(obj)
    raise TypeError(f"cannot restore a {type(obj).__name__} in place")
