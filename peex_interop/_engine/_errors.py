class HookError(ValueError):
    """Raised when a hook, log or selection is used wrongly at a named layer path."""


class TransformError(RuntimeError):
    """Raised when a log would be recorded under a JAX transform that the engine cannot
    thread the log out of (it would otherwise leak a tracer or be silently dropped)."""
