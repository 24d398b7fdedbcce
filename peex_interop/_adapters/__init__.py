"""The adapters: where each library's layer call becomes a call site of the engine,
and where each library's facts (kinds, parameter layouts, state) live.

The Equinox and function adapters need no optional library and load with the package.
The Haiku, linen and NNX adapters import their library, which the core does not need:
they load on first use of one of their names, so `import peex_interop` imports neither
Haiku nor Flax. Type checkers read those names from the imports below; the module
`__getattr__` is hidden from them, so that a misspelt name stays an error for them too.
"""

import importlib
from typing import TYPE_CHECKING, Any

from .._optional import needs
from ._equinox import (
    equinox_layout as equinox_layout,
    equinox_write as equinox_write,
    is_state as is_state,
    states_in as states_in,
)
from ._function import FunctionLayer as FunctionLayer, FunctionModule as FunctionModule, from_function as from_function

if TYPE_CHECKING:
    from ._haiku import (
        HaikuFunction as HaikuFunction,
        HaikuModule as HaikuModule,
        from_haiku as from_haiku,
        haiku_function as haiku_function,
    )
    from ._linen import LinenModule as LinenModule, from_linen as from_linen
    from ._nnx import NnxModule as NnxModule, from_nnx as from_nnx, to_nnx as to_nnx
else:

    def __getattr__(name: str) -> Any:
        if name not in LAZY:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        module, library = LAZY[name]
        with needs(f"px.{name}", library):
            value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value


# Public name -> (the adapter that defines it, the optional library it imports).
LAZY: dict[str, tuple[str, str]] = {
    **dict.fromkeys(("from_haiku", "haiku_function", "HaikuFunction", "HaikuModule"), ("._haiku", "haiku")),
    **dict.fromkeys(("from_nnx", "to_nnx", "NnxModule"), ("._nnx", "flax")),
    **dict.fromkeys(("from_linen", "LinenModule"), ("._linen", "flax")),
}
