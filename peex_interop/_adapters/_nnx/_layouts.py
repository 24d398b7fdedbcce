"""NNX's parameter layouts (`px.transfer_params`): the parameters of an NNX layer in
named axes (`_engine/_layouts.py`), read from and written into its Variables.

NNX's facts: kernels are (in, out) / (*window, in / groups, out); attention
projections are `LinearGeneral`s with (in, heads, head_dim) and (heads, head_dim, out)
kernels; a norm's shift is called `bias`; BatchNorm statistics are `BatchStat`s on
the module; an `LSTMCell` holds one `Linear` per gate and side (input projections
without bias), a `GRUCell` one per side with gates (r, z, n) and no recurrent bias.
Each layer's layout is a `Declared` (`_engine/_declarations.py`), as a user's own:
each parameter is read from the attributes it is stacked from (one attribute: the
value itself).
"""

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.spmd import get_var_pspec

from ..._engine import (
    AS_STORED,
    Container,
    Declarations,
    Declared,
    Layout,
    as_stored,
    at,
    axes,
    context_mesh,
    declare,
    placed,
    put_like,
    refuse,
    refuse_reparametrised,
    refuse_unread,
)
from ..._errors import HookError
from .._flax import LSTM_GATES, flax_attention_spec, flax_transpose_spec
from ._graph import Path, modules_by_path


def _lstm_attributes(side: str, name: str) -> tuple[str, ...]:
    # NNX names the forget gate `if_` / `hf` (`if` is a keyword).
    return tuple(f"{side}{gate}{'_' if side == 'i' and gate == 'f' else ''}.{name}" for gate in "ifgo")


def _built_in(layer: nnx.Module, parent: nnx.Module | None, attr: str) -> Declared | None:
    """The layout of one of NNX's own layers, `None` for another."""
    attention = flax_attention_spec(attr) if isinstance(parent, nnx.MultiHeadAttention) else None
    if isinstance(layer, nnx.LinearGeneral) and attention is not None:
        return attention
    if isinstance(layer, nnx.Linear) or (
        isinstance(layer, nnx.LinearGeneral) and len(layer.in_features) == len(layer.out_features) == 1
    ):
        return declare("linear", kernel=at("kernel", "in", "out"), bias=at("bias", "out"))
    if type(layer) is nnx.Conv:
        window = tuple(f"window{i}" for i in range(len(layer.kernel_size)))
        return declare(
            "conv", kernel=at("kernel", *window, "in", "out"), bias=at("bias", "out"),
            facts={"groups": layer.feature_group_count},
        )
    if isinstance(layer, nnx.ConvTranspose):
        return flax_transpose_spec(layer, len(layer.kernel_size))
    if isinstance(layer, nnx.Embed):
        return declare("embedding", embedding=at("embedding", "vocab", "features"))
    norm = {"scale": at("scale", "features"), "offset": at("bias", "features")}
    if isinstance(layer, (nnx.LayerNorm, nnx.RMSNorm)):
        return declare("norm", scale=norm["scale"], offset=norm["offset"])
    if isinstance(layer, nnx.GroupNorm):
        return declare("norm", scale=norm["scale"], offset=norm["offset"], facts={"groups": layer.num_groups})
    if isinstance(layer, nnx.BatchNorm):
        stats = {"mean": at("mean", "features"), "var": at("var", "features")}
        return declare("batch_norm", scale=norm["scale"], offset=norm["offset"], mean=stats["mean"], var=stats["var"])
    if isinstance(layer, nnx.LSTMCell):
        return declare(
            "lstm", members={"gate": LSTM_GATES},
            input_kernel=at(_lstm_attributes("i", "kernel"), "in", "gate", "hidden"),
            hidden_kernel=at(_lstm_attributes("h", "kernel"), "recurrent", "gate", "hidden"),
            bias=at(_lstm_attributes("h", "bias"), "gate", "hidden"),
        )
    if isinstance(layer, nnx.GRUCell):
        gates = ("gate", "hidden")
        return declare(
            "gru", members={"gate": ("r", "z", "n")},
            input_kernel=at("dense_i.kernel", "in", gates),
            hidden_kernel=at("dense_h.kernel", "recurrent", gates),
            bias=at("dense_i.bias", gates),
        )
    return None


def _own_arrays(layer: nnx.Module, cache: dict) -> dict[str, Any]:
    """The arrays the layer holds in Variables of its own (not its submodules'), less
    its decode cache and RNG state, which no port carries."""
    return {
        name: value.get_value() for name, value in vars(layer).items()
        if isinstance(value, nnx.Variable) and not isinstance(value, nnx.RngState) and name not in cache
        and hasattr(value.get_value(), "shape")
    }


def _nnx_spec(
    layer: nnx.Module, parent: nnx.Module | None, attr: str, path: str, declarations: Declarations
) -> Declared:
    """The layout of an NNX layer: the user's declaration, else NNX's, else as stored."""
    return (
        declarations.find(layer, path) or _built_in(layer, parent, attr)
        or as_stored(_own_arrays(layer, _cache_spec(layer, path)))
    )


def _variable(layer: nnx.Module, dotted: str) -> Any:
    node = layer
    for name in dotted.split("."):
        node = getattr(node, name, None)
    return node


def _value(layer: nnx.Module, attributes: tuple[str, ...]) -> Any:
    variables = [_variable(layer, a) for a in attributes]
    if any(v is None for v in variables):
        return None
    values = [v.get_value() for v in variables]
    # Several attributes (one per gate) form one parameter along a gate axis.
    return values[0] if len(values) == 1 else jnp.stack(values, axis=-2)


def _find(modules: dict[Path, nnx.Module], local: Path) -> tuple[nnx.Module, nnx.Module | None]:
    layer = modules.get(local)
    if layer is None:
        raise HookError(f"transfer_params: no NNX submodule at {'.'.join(local)!r}")
    return layer, modules.get(local[:-1]) if local else None


def _cache_spec(layer: nnx.Module, path: str) -> dict:
    """{name: (attributes, axes)} of the layer's `nnx.Cache` variables: the decode cache
    of `nnx.MultiHeadAttention` (`init_cache`: keys and values (*batch, length,
    kv_heads, head_dim)) and any layer's `cache_index` (a position embedding's,
    as the Flax lm1b model keeps it); another cache's layout is its author's."""
    spec = {}
    for name, value in vars(layer).items():
        if not isinstance(value, nnx.Cache):
            continue
        if name == "cache_index":
            spec[name] = ((name,), axes())
        elif name in ("cached_key", "cached_value") and isinstance(layer, nnx.MultiHeadAttention):
            spec[name] = ((name,), axes("length", "heads", "head_dim"))
        else:
            raise refuse(
                path,
                f"its nnx.Cache {name!r} {tuple(value.get_value().shape)} has no known layout (only "
                "MultiHeadAttention's decode cache and cache_index variables are transferred)",
            )
    return spec


def nnx_layout(modules: dict[Path, nnx.Module], local: Path, declarations: Declarations) -> Layout | Container:
    path = ".".join(local)
    layer, parent = _find(modules, local)
    cache = _cache_spec(layer, path)
    state = None
    if cache:
        state = Layout("decode_cache", {name: placed(_value(layer, a), ax) for name, (a, ax) in cache.items()})
    if not _own_arrays(layer, cache) and not isinstance(layer, (nnx.LSTMCell, nnx.GRUCell)):
        parts = [
            ".".join(p) for p, m in modules_by_path(layer)
            if p and any(isinstance(v, nnx.Param) for v in vars(m).values())
        ]
        if parts or state is not None:
            return Container(tuple(parts), state)
    if isinstance(parent, (nnx.WeightNorm, nnx.SpectralNorm)):
        # Scaled to unit norm, or divided by its spectral norm.
        wrapper = type(parent).__name__
        raise refuse_reparametrised(path, f"its parameters are reparametrised by the {wrapper} holding it")
    declared = _nnx_spec(layer, parent, local[-1] if local else "", path, declarations)
    # An nnx.LoRALinear is a Linear whose `lora` adds to its output; a layer read as
    # stored holds its own arrays, its submodules being layers of their own.
    below = modules_by_path(layer) if declared.kind != AS_STORED else [((), layer)]
    held = {
        ".".join((*p, name)) for p, module in below for name, value in vars(module).items()
        if isinstance(value, nnx.Param)
    }
    refuse_unread(path, declared.kind, type(layer).__name__, held, declared.places())
    return declared.read(lambda attributes: _value(layer, attributes), state)


def _declared_sharding(variable: nnx.Variable) -> Any:
    """The sharding an NNX variable's `out_sharding` metadata declares, on its `mesh`
    metadata or the mesh of `jax.set_mesh` (names mapped by its `sharding_rules` and
    `nn.logical_axis_rules`, as NNX does when it creates the variable); `None` without
    metadata or a mesh."""
    names = variable.get_metadata("out_sharding", None)
    if not names:
        return None
    if isinstance(names, jax.sharding.Sharding):
        return names
    mesh = variable.get_metadata("mesh", None)
    mesh = context_mesh() if mesh is None else mesh
    spec = get_var_pspec(variable)
    return None if mesh is None or spec is None else jax.sharding.NamedSharding(mesh, spec)


def nnx_write(
    modules: dict[Path, nnx.Module], local: Path, values: dict[str, Any], declarations: Declarations
) -> None:
    # Values go into the existing Variables: their type and metadata (sharding names,
    # rules, mesh) stay, and an abstract one becomes concrete.
    path = ".".join(local)
    layer, parent = _find(modules, local)
    places = {name: attributes for name, (attributes, _) in _cache_spec(layer, path).items()}
    if set(values) - set(places):
        declared = _nnx_spec(layer, parent, local[-1] if local else "", path, declarations)
        places.update({name: param.where for name, param in declared.params.items()})
    for name, value in values.items():
        attributes = places[name]
        parts = [value] if len(attributes) == 1 else [jnp.take(value, i, axis=-2) for i in range(len(attributes))]
        for attribute, part in zip(attributes, parts):
            variable = _variable(layer, attribute)
            variable.set_value(put_like(path, part, variable.get_value(), _declared_sharding(variable)))
