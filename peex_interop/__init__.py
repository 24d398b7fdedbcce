"""One runtime hook-and-log API for Equinox (and converted Haiku / Flax NNX) models."""

from typing import TYPE_CHECKING, Any as _Any

# `_versions` first: an unsupported JAX or Equinox is one clear ImportError naming the
# versions, raised before any other module touches JAX's internals.
from . import _versions as _versions

# isort: split
from . import _adapters as _adapters, peex as peex  # peex's conventions: `from peex_interop import peex`
from ._adapters import (
    LAZY as _LAZY_ADAPTERS,
    FunctionLayer as FunctionLayer,
    FunctionModule as FunctionModule,
    from_function as from_function,
)
from ._compat import (
    InterceptContext as InterceptContext,
    Intercepted as Intercepted,
    intercepted as intercepted,
)
from ._diagnostics import (
    AbsMaxLog as AbsMaxLog,
    Histogram as Histogram,
    HistogramLog as HistogramLog,
    L2NormLog as L2NormLog,
    NearZeroLog as NearZeroLog,
    PackedLog as PackedLog,
    Recorder as Recorder,
    SiteRow as SiteRow,
    Stats as Stats,
    StatsLog as StatsLog,
    StdLog as StdLog,
    Summary as Summary,
    activation_stats as activation_stats,
    model_sizes as model_sizes,
    num_features as num_features,
    pool_stats as pool_stats,
    sites as sites,
    summary as summary,
    total_params as total_params,
)
from ._engine import (
    KINDS as KINDS,
    CallSite as CallSite,
    Declared as Declared,
    FunctionSites as FunctionSites,
    InnerCall as InnerCall,
    StoredParam as StoredParam,
    all_of as all_of,
    at as at,
    declare as declare,
    function_sites as function_sites,
    kind as kind,
    module_paths as module_paths,
    not_ as not_,
)
from ._errors import (
    HookError as HookError,
    PeexInteropError as PeexInteropError,
    PortError as PortError,
    TransformError as TransformError,
    UnsupportedVersionError as UnsupportedVersionError,
)
from ._hooks import (
    AbstractHook as AbstractHook,
    AbstractLog as AbstractLog,
    BackwardHook as BackwardHook,
    ForwardHook as ForwardHook,
    FunctionHook as FunctionHook,
    FunctionLog as FunctionLog,
    HookMap as HookMap,
    IdentityHook as IdentityHook,
    IdentityLog as IdentityLog,
    LogMap as LogMap,
    MeanLog as MeanLog,
    MeanStdLog as MeanStdLog,
    NoneLog as NoneLog,
)
from ._interventions import (
    AbstractCells as AbstractCells,
    Along as Along,
    CachePatch as CachePatch,
    Component as Component,
    Groups as Groups,
    MeanAblation as MeanAblation,
    Patched as Patched,
    Whole as Whole,
    ZeroAblation as ZeroAblation,
    cache as cache,
    patch as patch,
    patch_sweep as patch_sweep,
    path_patch as path_patch,
    path_patch_sweep as path_patch_sweep,
    sweep_rows as sweep_rows,
)
from ._migration import (
    Alignment as Alignment,
    Comparison as Comparison,
    ComparisonRow as ComparisonRow,
    align as align,
    compare as compare,
    port as port,
    rename as rename,
    transfer_params as transfer_params,
)

__version__ = "0.1.0"

# The Haiku, linen and NNX adapters load on first use of one of their names (see
# `_adapters`), so `import peex_interop` imports neither Haiku nor Flax. Type checkers
# read the names from the imports below; the module `__getattr__` is hidden from them,
# so that a misspelt `px.name` stays an error for them too.
if TYPE_CHECKING:
    from ._adapters import (
        HaikuFunction as HaikuFunction,
        HaikuModule as HaikuModule,
        LinenModule as LinenModule,
        NnxModule as NnxModule,
        from_haiku as from_haiku,
        from_linen as from_linen,
        from_nnx as from_nnx,
        haiku_function as haiku_function,
        to_nnx as to_nnx,
    )
else:

    def __getattr__(name: str) -> _Any:
        if name not in _LAZY_ADAPTERS:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        # `_adapters` imports the adapter, and says what to install when its library is missing.
        value = getattr(_adapters, name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    # The public names (adapters included, loaded or not) and the module's dunders.
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})


__all__ = [
    "KINDS",
    "AbsMaxLog",
    "AbstractCells",
    "AbstractHook",
    "AbstractLog",
    "Alignment",
    "Along",
    "BackwardHook",
    "CachePatch",
    "CallSite",
    "Comparison",
    "ComparisonRow",
    "Component",
    "Declared",
    "ForwardHook",
    "FunctionHook",
    "FunctionLayer",
    "FunctionLog",
    "FunctionModule",
    "FunctionSites",
    "Groups",
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
    "Whole",
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
    "patch_sweep",
    "path_patch",
    "path_patch_sweep",
    "peex",
    "pool_stats",
    "port",
    "rename",
    "sites",
    "summary",
    "sweep_rows",
    "to_nnx",
    "total_params",
    "transfer_params",
]
