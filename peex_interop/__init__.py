"""One runtime hook-and-log API for Equinox (and converted Haiku / Flax NNX) models."""

import importlib as _importlib
from typing import TYPE_CHECKING, Any as _Any

# `_versions` first: an unsupported JAX or Equinox is one clear ImportError naming the
# versions, raised before any other module touches JAX's internals.
from . import _versions as _versions, peex as peex  # peex's conventions: `from peex_interop import peex`
from ._adapters._function import (
    FunctionLayer as FunctionLayer,
    FunctionModule as FunctionModule,
    from_function as from_function,
)
from ._compat._interceptors import (
    InterceptContext as InterceptContext,
    Intercepted as Intercepted,
    intercepted as intercepted,
)
from ._diagnostics._packing import PackedLog as PackedLog
from ._diagnostics._recorder import Recorder as Recorder
from ._diagnostics._sites import SiteRow as SiteRow, sites as sites
from ._diagnostics._stats import (
    AbsMaxLog as AbsMaxLog,
    Histogram as Histogram,
    HistogramLog as HistogramLog,
    L2NormLog as L2NormLog,
    NearZeroLog as NearZeroLog,
    Stats as Stats,
    StatsLog as StatsLog,
    StdLog as StdLog,
    activation_stats as activation_stats,
    pool_stats as pool_stats,
)
from ._diagnostics._summary import (
    Summary as Summary,
    model_sizes as model_sizes,
    num_features as num_features,
    summary as summary,
    total_params as total_params,
)
from ._engine._declarations import Declared as Declared, StoredParam as StoredParam, at as at, declare as declare
from ._engine._errors import (
    HookError as HookError,
    PeexInteropError as PeexInteropError,
    PortError as PortError,
    TransformError as TransformError,
    UnsupportedVersionError as UnsupportedVersionError,
)
from ._engine._function_sites import FunctionSites as FunctionSites, function_sites as function_sites
from ._engine._kinds import KINDS as KINDS
from ._engine._paths import module_paths as module_paths
from ._engine._selection import (
    all_of as all_of,
    kind as kind,
    not_ as not_,
)
from ._engine._sites import CallSite as CallSite, InnerCall as InnerCall
from ._hooks._backward import BackwardHook as BackwardHook
from ._hooks._forward import ForwardHook as ForwardHook
from ._hooks._hooks import (
    AbstractHook as AbstractHook,
    FunctionHook as FunctionHook,
    HookMap as HookMap,
    IdentityHook as IdentityHook,
)
from ._hooks._logs import (
    AbstractLog as AbstractLog,
    FunctionLog as FunctionLog,
    IdentityLog as IdentityLog,
    LogMap as LogMap,
    MeanLog as MeanLog,
    MeanStdLog as MeanStdLog,
    NoneLog as NoneLog,
)
from ._interventions._ablation import MeanAblation as MeanAblation, ZeroAblation as ZeroAblation
from ._interventions._cache import cache as cache
from ._interventions._patch import CachePatch as CachePatch, Patched as Patched, patch as patch
from ._migration._align import align as align
from ._migration._alignment import Alignment as Alignment
from ._migration._compare import compare as compare
from ._migration._comparison import Comparison as Comparison, ComparisonRow as ComparisonRow
from ._migration._port import port as port
from ._migration._rename import rename as rename
from ._migration._transfer import transfer_params as transfer_params
from ._optional import needs as _needs

__version__ = "0.1.0"

# The adapters import their library, which the core does not need: they load on first
# use of one of their names, so `import peex_interop` imports neither Haiku nor Flax.
# Type checkers read the names from the imports below; the module `__getattr__` is
# hidden from them, so that a misspelt `px.name` stays an error for them too.
if TYPE_CHECKING:
    from ._adapters._haiku import (
        HaikuFunction as HaikuFunction,
        HaikuModule as HaikuModule,
        from_haiku as from_haiku,
        haiku_function as haiku_function,
    )
    from ._adapters._linen import LinenModule as LinenModule, from_linen as from_linen
    from ._adapters._nnx import NnxModule as NnxModule, from_nnx as from_nnx, to_nnx as to_nnx
else:

    def __getattr__(name: str) -> _Any:
        if name not in _LAZY:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        module, library = _LAZY[name]
        with _needs(f"px.{name}", library):
            value = getattr(_importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value


# Public name -> (the adapter that defines it, the optional library it imports).
_LAZY: dict[str, tuple[str, str]] = {
    **dict.fromkeys(
        ("from_haiku", "haiku_function", "HaikuFunction", "HaikuModule"), ("._adapters._haiku", "haiku")
    ),
    **dict.fromkeys(("from_nnx", "to_nnx", "NnxModule"), ("._adapters._nnx", "flax")),
    **dict.fromkeys(("from_linen", "LinenModule"), ("._adapters._linen", "flax")),
}


def __dir__() -> list[str]:
    # The public names (adapters included, loaded or not) and the module's dunders.
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})


__all__ = [
    "KINDS",
    "AbsMaxLog",
    "AbstractHook",
    "AbstractLog",
    "Alignment",
    "BackwardHook",
    "CachePatch",
    "CallSite",
    "Comparison",
    "ComparisonRow",
    "Declared",
    "ForwardHook",
    "FunctionHook",
    "FunctionLayer",
    "FunctionLog",
    "FunctionModule",
    "FunctionSites",
    "HaikuFunction",
    "HaikuModule",
    "Histogram",
    "HistogramLog",
    "HookError",
    "HookMap",
    "IdentityHook",
    "IdentityLog",
    "InnerCall",
    "InterceptContext",
    "Intercepted",
    "L2NormLog",
    "LinenModule",
    "LogMap",
    "MeanAblation",
    "MeanLog",
    "MeanStdLog",
    "NearZeroLog",
    "NnxModule",
    "NoneLog",
    "PackedLog",
    "Patched",
    "PeexInteropError",
    "PortError",
    "Recorder",
    "SiteRow",
    "Stats",
    "StatsLog",
    "StdLog",
    "StoredParam",
    "Summary",
    "TransformError",
    "UnsupportedVersionError",
    "ZeroAblation",
    "activation_stats",
    "align",
    "all_of",
    "at",
    "cache",
    "compare",
    "declare",
    "from_function",
    "from_haiku",
    "from_linen",
    "from_nnx",
    "function_sites",
    "haiku_function",
    "intercepted",
    "kind",
    "model_sizes",
    "module_paths",
    "not_",
    "num_features",
    "patch",
    "peex",
    "pool_stats",
    "port",
    "rename",
    "sites",
    "summary",
    "to_nnx",
    "total_params",
    "transfer_params",
]
