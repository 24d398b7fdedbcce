"""The Flax linen adapter: where a linen submodule call becomes a call site.

`from_linen` wraps a linen module definition and its variables as an `eqx.Module`
(`_module.py`). While a hooking context is active in the calling thread, its call runs
`module.apply` inside `nn.intercept_methods`, and the interceptor hands every selected
method call of every submodule to `_context.call_site`, named by the submodule's scope
path (`_interception.py`). `px.transfer_params` reads and writes its layers' parameters
in named axes (`_layouts.py`), in the variables dicts and their metadata boxes
(`_variables.py`).
"""

from ._module import LinenModule as LinenModule, from_linen as from_linen
