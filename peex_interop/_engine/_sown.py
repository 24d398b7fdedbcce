"""Values a layer sows, and its perturbation points, as sites of that layer.

Flax models expose intermediate values themselves: `self.sow(nnx.Intermediate, "h",
x)` (NNX; linen's `self.sow("intermediates", "h", x)`), collected by `nnx.capture`
or a mutable `intermediates` collection, and `x = self.perturb("h", x)`, whose
gradient is the cotangent of `x`. While hooking, each is a site of the layer that
calls it, `<layer path>.<name>` (kinds `"sown"` and `"perturbation"`), selected like
a layer (`where=None` logs them): a log of a sown value is that value, wherever the
layer runs (`nnx.scan`, `nnx.vmap`, threaded transforms), without `nnx.capture`; a
perturbation point is the value `perturb` returns, whose cotangent a
`px.BackwardHook` logs and edits. The library's own `sow`/`perturb` still run (given
the hooked value), so its collections fill as before.
"""

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from ._context import call_site
from ._kinds import PERTURBATION, SOWN

# `(module) -> (owner, local path)` of a library module running in this thread's
# hooked call, or `None`: how an adapter names the module calling `sow`/`perturb`.
Locate = Callable[[Any], tuple[Any, tuple[str, ...]] | None]


def _member(locate: Locate, kind: str) -> Callable[[Callable], Callable]:
    """A patch maker: `sow` or `perturb` (`kind`), run with the value it is given as
    the site `<layer>.<name>`: a sown value is the site's output (then sown as
    hooked), a perturbation point the value `perturb` returns."""

    def make(original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def member(self: Any, *args: Any, **kwargs: Any) -> Any:
            where = locate(self)
            if where is None:
                return original(self, *args, **kwargs)
            bound = signature.bind(self, *args, **kwargs)

            def with_value(value: Any) -> Any:
                bound.arguments["value"] = value
                return original(*bound.args, **bound.kwargs)

            owner, local = where
            value, name = bound.arguments["value"], bound.arguments["name"]
            if isinstance(value, (int, float, complex)) and not isinstance(value, bool):
                # The array Flax makes of a Python number (`x = 1.0`): a site with a value.
                value = jnp.asarray(value)
            site = functools.partial(call_site, owner, local=local, module=self, member=name, kind=kind)
            if kind == SOWN:
                return with_value(site(_identity, (value,), {}))
            return site(with_value, (value,), {})

        return member

    make.purpose = ("member", kind, locate)  # pyright: ignore[reportFunctionMemberAccess]
    return make


def _identity(value: Any) -> Any:
    return value


def sown_patches(base: type, locate: Locate) -> list[tuple[type, str, Callable[[Any], Any]]]:
    """Patch targets making `base.sow` and `base.perturb` (Flax's `nnx.Module`, linen's
    `nn.Module`: `sow(self, collection, name, value, ...)`, `perturb(self, name, value,
    ...)`) sites of the layer calling them, named by `locate`."""
    return [(base, "sow", _member(locate, SOWN)), (base, "perturb", _member(locate, PERTURBATION))]
