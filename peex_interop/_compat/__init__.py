"""Other libraries' conventions carried over: Haiku- and linen-style interceptors, and
peex's hooks (the `peex_interop.peex` module)."""

from ._interceptors import InterceptContext as InterceptContext, Intercepted as Intercepted, intercepted as intercepted
from ._peex import BackwardHook as BackwardHook, ForwardHook as ForwardHook, LayerNameError as LayerNameError
