"""peex 0.0.3's API with peex's conventions, on peex_interop's engine: replace
`import peex as px` by `from peex_interop import peex as px` and peex code runs
unchanged, with peex's keys and numbers (see "Coming from ..." in the docs for what
the default `peex_interop` API does differently)."""

from ._compat import BackwardHook as BackwardHook, ForwardHook as ForwardHook, LayerNameError as LayerNameError
from ._hooks import (
    AbstractHook as AbstractHook,
    AbstractLog as AbstractLog,
    IdentityHook as IdentityHook,
    IdentityLog as IdentityLog,
    MeanLog as MeanLog,
    MeanStdLog as MeanStdLog,
    NoneLog as NoneLog,
)

__all__ = [
    "AbstractHook",
    "AbstractLog",
    "BackwardHook",
    "ForwardHook",
    "IdentityHook",
    "IdentityLog",
    "LayerNameError",
    "MeanLog",
    "MeanStdLog",
    "NoneLog",
]
