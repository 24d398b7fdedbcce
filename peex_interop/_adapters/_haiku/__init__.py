"""The Haiku adapter: where a Haiku module call becomes a call site.

`from_haiku` wraps `(transformed, params, state)` as an `eqx.Module` (`_module.py`);
`haiku_function` hooks a function of Haiku modules inside the user's own transform
(`_function.py`). While a hooking context is active, their call runs inside
`hk.intercept_methods`, and the interceptor hands every selected method call of every
Haiku submodule to `_context.call_site`, with the Haiku module name turned into a
dotted local path (`_interception.py`). `px.transfer_params` reads and writes its
modules' parameters in named axes (`_layouts.py`).
"""

from ._function import HaikuFunction as HaikuFunction, haiku_function as haiku_function
from ._module import HaikuModule as HaikuModule, from_haiku as from_haiku
