"""The package's errors: one base class, so `except px.PeexInteropError` catches every
refusal, while each keeps the built-in type its situation calls for."""

import contextlib
import re
import threading
from collections.abc import Callable, Iterator


class PeexInteropError(Exception):
    """Base class of every error peex_interop raises on purpose (a refusal, never a
    crash): catch it to tell "the tool said no" from a bug in the model."""


class HookError(PeexInteropError, ValueError):
    """Raised when a hook, log or selection is used wrongly at a named layer path."""


class TransformError(PeexInteropError, RuntimeError):
    """Raised when a layer call runs under a JAX transform that the engine cannot thread
    its logs out of (it would otherwise leak a tracer or be silently dropped)."""


class PortError(HookError):
    """Raised by `px.port` when the ported model computes differently from its source: the
    message names the first diverging layer and by how much, `comparison` holds the
    whole layer-by-layer `px.Comparison` (print it)."""

    def __init__(self, message: str, comparison: object = None):
        super().__init__(message)
        self.comparison = comparison


class UnsupportedVersionError(PeexInteropError, ImportError):
    """Raised when an installed library is older than the releases peex_interop supports
    (`import peex_interop` for JAX and Equinox, the first use of an adapter for Flax and
    Haiku): the message names the installed and the supported versions, and the upgrade
    that fixes it."""


_UNBOUND_AXIS = re.compile(r"unbound axis name: (.+?)\.?(?: To fix|$)")


@contextlib.contextmanager
def outside_its_vmap(caller: str, remedy: Callable[[str], str]) -> Iterator[None]:
    """Turn JAX's bare `NameError` for an axis name that no vmap binds into a
    `HookError` naming the axis and `remedy(axis_name)`: `caller` ran a per-example
    model with a collective over its batch (`eqx.nn.BatchNorm(axis_name=...)`) on one
    example, outside the vmap the model is written for. Other `NameError`s pass."""
    # Nested (transfer_params verifying with px.compare): the error names the function
    # the user called.
    _callers.stack = [*getattr(_callers, "stack", []), caller]
    try:
        yield
    except NameError as error:
        unbound = _UNBOUND_AXIS.search(str(error))
        if unbound is None:
            raise
        raise HookError(
            f"{_callers.stack[0]} ran the model on the example arguments outside the vmap whose axis name "
            f"{unbound[1]!r} it uses: a collective over a vmap axis (eqx.nn.BatchNorm(axis_name=...), "
            f"jax.lax.pmean) needs that axis bound. {remedy(unbound[1])}"
        ) from error
    finally:
        _callers.stack.pop()


_callers = threading.local()


def run_on_a_batch(axis_name: str) -> str:
    """The remedy for the functions that run a whole model on the arguments given."""
    return (
        "Pass a batch of examples and a model that maps itself over it: an eqx.Module holding "
        f"the model whose __call__ is jax.vmap(self.model, axis_name={axis_name!r}, ...) (an "
        "eqx.nn.State with in_axes=None and out_axes=None); its layers keep their paths, under "
        "the field's name"
    )
