"""The package's errors: one base class, so `except px.PeexInteropError` catches every
refusal, while each keeps the built-in type its situation calls for."""


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
