"""The Flax NNX adapter: an NNX module as an `eqx.Module`, its submodule calls as call
sites.

`from_nnx` splits a module into a static graph definition and a state whose arrays are
the pytree leaves (`_module.py`). Every call merges a *copy* (`nnx.merge(...,
copy=True)`), so the user's module is never mutated, and runs it. While a hooking
context is active in the calling thread, `__call__` of every NNX module class of the
model is replaced for the duration of the call by one that hands the call to
`_context.call_site` (`_routing.py`), named by the submodule's NNX path (`_naming.py`).
`px.transfer_params` reads and writes its layers' parameters in named axes
(`_layouts.py`).
"""

from ._module import NnxModule as NnxModule, from_nnx as from_nnx, to_nnx as to_nnx
