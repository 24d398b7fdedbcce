"""One runtime hook-and-log API for Equinox (and converted Haiku / Flax NNX) models."""

from ._migration._align import (
    align as align,
    Alignment as Alignment,
    compare as compare,
    Comparison as Comparison,
    ComparisonRow as ComparisonRow,
)

from ._hooks._backward import BackwardHook as BackwardHook
from ._engine._errors import HookError as HookError, TransformError as TransformError
from ._hooks._forward import ForwardHook as ForwardHook
from ._adapters._haiku import (
    from_haiku as from_haiku,
    haiku_function as haiku_function,
    HaikuFunction as HaikuFunction,
    HaikuModule as HaikuModule,
)
from ._hooks._hooks import (
    AbstractHook as AbstractHook,
    FunctionHook as FunctionHook,
    IdentityHook as IdentityHook,
)
from ._hooks._logs import (
    AbstractLog as AbstractLog,
    FunctionLog as FunctionLog,
    IdentityLog as IdentityLog,
    MeanLog as MeanLog,
    MeanStdLog as MeanStdLog,
    NoneLog as NoneLog,
)
from ._adapters._nnx import from_nnx as from_nnx, to_nnx as to_nnx, NnxModule as NnxModule
from ._engine._kinds import KINDS as KINDS
from ._engine._paths import module_paths as module_paths
from ._diagnostics._recorder import Recorder as Recorder
from ._migration._rename import rename as rename
from ._engine._selection import (
    all_of as all_of,
    glob_to_regex as glob_to_regex,
    kind as kind,
    not_ as not_,
)
from ._diagnostics._stats import (
    AbsMaxLog as AbsMaxLog,
    activation_stats as activation_stats,
    HistogramLog as HistogramLog,
    L2NormLog as L2NormLog,
    NearZeroLog as NearZeroLog,
    pool_stats as pool_stats,
    StatsLog as StatsLog,
    StdLog as StdLog,
)
from ._diagnostics._summary import (
    LayerRow as LayerRow,
    model_sizes as model_sizes,
    num_features as num_features,
    Summary as Summary,
    summary as summary,
    total_params as total_params,
)
from ._migration._transfer import transfer_params as transfer_params
