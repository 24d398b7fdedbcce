"""The Equinox adapter: where an `eqx.Module` call becomes a call site.

For the duration of a hooked call, `__call__` of every module class found in the hooked
pytree is replaced at class level by a function that hands the call to
`_context.call_site`. Dispatching on the object actually called (not on a proxy of the
root, as peex does) reaches layers at any depth: in lists, `eqx.nn.Sequential`, helper
methods, `jax.vmap(self.proj)` inside library layers, and layers rebuilt inside scans.
"""

from collections.abc import Iterable
from typing import Any

from .._engine import _context, _patching
from .._engine._paths import AbstractTransparent


def _hooked_call(original: Any) -> Any:
    def __call__(self, *args, **kwargs):
        return _context.call_site(
            self, lambda *a, **k: original(self, *a, **k), args, kwargs
        )

    setattr(__call__, _patching.ORIGINAL, original)
    return __call__


def class_patches(types: Iterable[type]) -> list[tuple[type, str, Any]]:
    """Patch targets for the `__call__` of each module type (wrappers excluded: they are
    transparent and run their own context)."""
    layers = [cls for cls in types if not issubclass(cls, AbstractTransparent)]
    return _patching.method_patches(layers, "__call__", _hooked_call)
