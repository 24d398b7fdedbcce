"""One runtime hook-and-log API for Equinox (and converted Haiku / Flax NNX) models."""

from ._backward import BackwardHook as BackwardHook
from ._errors import HookError as HookError, TransformError as TransformError
from ._forward import ForwardHook as ForwardHook
from ._haiku import (
    from_haiku as from_haiku,
    haiku_function as haiku_function,
    HaikuFunction as HaikuFunction,
    HaikuModule as HaikuModule,
)
from ._hooks import (
    AbstractHook as AbstractHook,
    FunctionHook as FunctionHook,
    IdentityHook as IdentityHook,
)
from ._logs import (
    AbstractLog as AbstractLog,
    FunctionLog as FunctionLog,
    IdentityLog as IdentityLog,
    MeanLog as MeanLog,
    MeanStdLog as MeanStdLog,
    NoneLog as NoneLog,
)
from ._paths import module_paths as module_paths
from ._selection import glob_to_regex as glob_to_regex
