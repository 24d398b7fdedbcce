"""Linen's parameter layouts (`px.transfer_params`): the parameters of a linen layer
in named axes (`_engine/_layouts.py`), read from and written into the variables.

linen's facts: kernels are (in, out) / (*window, in / groups, out); the projections of
`nn.MultiHeadDotProductAttention` are `DenseGeneral`s named query/key/value with
(in, heads, head_dim) kernels and `out` with a (heads, head_dim, out) kernel; a norm's
shift is called `bias`; BatchNorm statistics are in the `batch_stats` collection; an
`LSTMCell` holds one `Dense` per gate and side, named ii/if/ig/io (no bias) and
hi/hf/hg/ho; `nn.scan`/`nn.vmap` put stack axes in front of every variable. A spec
maps a parameter to the variables it is stacked from (one variable: the value itself)
and its named axes. The module's class is known from a call (`modules`); without
one, the variables' names and shapes decide where they are unambiguous.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from ..._engine import (
    Container,
    Declarations,
    Declared,
    Layout,
    as_stored,
    at,
    axes,
    declare,
    placed,
    refuse,
    refuse_reparametrised,
    refuse_unread,
)
from ..._errors import HookError
from .._flax import ATTENTION_INPUTS, LSTM_GATES, flax_attention_spec, flax_transpose_spec
from ._variables import Path, node_at, own_variables, replaced, subtree_paths, unboxed, written

_LSTM_NAMES = {f"{side}{gate}" for side in "ih" for gate in LSTM_GATES}
_GRU_NAMES = {"ir", "iz", "in", "hr", "hz", "hn"}

Location = tuple[str, Path]
Spec = dict[str, tuple[tuple[Location, ...], Any]]


def _location(where: str) -> Location:
    """A place of a linen layout (`StoredParam.where`): a variable of the `params`
    collection, `/` between nested names (`"ii/kernel"`), another collection's as
    `"batch_stats:mean"`."""
    collection, _, name = where.rpartition(":")
    return collection or "params", tuple(name.split("/"))


def _lstm_spec() -> Declared:
    def gates(side: str, name: str) -> tuple[str, ...]:
        return tuple(f"{side}{gate}/{name}" for gate in LSTM_GATES)

    return declare(
        "lstm", members={"gate": LSTM_GATES},
        input_kernel=at(gates("i", "kernel"), "in", "gate", "hidden"),
        hidden_kernel=at(gates("h", "kernel"), "recurrent", "gate", "hidden"),
        bias=at(gates("h", "bias"), "gate", "hidden"),
    )


def _is_attention(variables: Mapping[str, Any], local: Path, parent: Any, kernel: Any) -> bool:
    if parent is not None:
        return isinstance(parent, nn.MultiHeadDotProductAttention)
    # Without a call, the names tell: linen's attention always names its projections so.
    siblings = node_at(variables["params"], local[:-1]) if local else {}
    return {*ATTENTION_INPUTS, "out"} <= set(siblings) and kernel.ndim == 3


def _kernel_spec(variables: Mapping[str, Any], local: Path, module: Any, parent: Any) -> Declared | None:
    path = ".".join(local)
    own = own_variables(node_at(variables["params"], local))
    kernel, bias = own["kernel"], own.get("bias")
    attention = flax_attention_spec(local[-1]) if _is_attention(variables, local, parent, kernel) else None
    if attention is not None:
        return attention
    if isinstance(module, nn.Dense) or (module is None and kernel.ndim == 2):
        return declare("linear", kernel=at("kernel", "in", "out"), bias=at("bias", "out"))
    if isinstance(module, nn.Conv) or (module is None and (bias is None or bias.ndim == 1)):
        if isinstance(module, nn.Conv):
            # An int kernel_size is a 1-D convolution's window.
            window = 1 if isinstance(module.kernel_size, int) else len(module.kernel_size)
            facts = {"groups": module.feature_group_count}
        else:
            window, facts = kernel.ndim - 2, {}
        window_axes = (f"window{i}" for i in range(window))
        return declare("conv", kernel=at("kernel", *window_axes, "in", "out"), bias=at("bias", "out"), facts=facts)
    if module is None and bias is not None:  # no bias or a 1-D one was read as a conv above
        raise refuse(
            path, f"a kernel {tuple(kernel.shape)} with a bias {tuple(bias.shape)} is a stacked "
            "Dense or a DenseGeneral: which one is known from a call (pass inputs=)"
        )
    # A DenseGeneral with several input or feature axes: read as stored.
    return None


def _linen_spec(
    variables: Mapping[str, Any], local: Path, modules: dict, declarations: Declarations
) -> Declared:
    """The layout of the linen layer at `local`: the user's declaration, else linen's,
    else as stored."""
    path = ".".join(local)
    module = modules.get(local)
    declared = declarations.find(module, path) or _built_in(variables, local, modules)
    return declared or as_stored(own_variables(node_at(variables.get("params", {}), local)))


def _built_in(variables: Mapping[str, Any], local: Path, modules: dict) -> Declared | None:
    path = ".".join(local)
    module, parent = modules.get(local), modules.get(local[:-1]) if local else None
    params = node_at(variables.get("params", {}), local)
    own = own_variables(params)
    children = {name for name in params if name not in own} if isinstance(params, Mapping) else set()
    if isinstance(module, nn.LSTMCell) or (module is None and not own and children == _LSTM_NAMES):
        return _lstm_spec()
    if isinstance(module, nn.GRUCell) or (module is None and not own and children == _GRU_NAMES):
        raise refuse(path, "GRU cells are not transferred (no other library's adapter reads them yet)")
    if isinstance(module, nn.ConvTranspose):
        kernel_size = (module.kernel_size,) if isinstance(module.kernel_size, int) else module.kernel_size
        return flax_transpose_spec(module, len(kernel_size))
    if module is None and "ConvTranspose" in path:
        raise refuse(path, "a conv-transpose layer's stride and padding are known from a call (pass inputs=)")
    if "kernel" in own:
        return _kernel_spec(variables, local, module, parent)
    if set(own) == {"embedding"}:
        return declare("embedding", embedding=at("embedding", "vocab", "features"))
    if own and set(own) <= {"scale", "bias"}:
        norm = {"scale": at("scale", "features"), "offset": at("bias", "features")}
        stats = node_at(variables.get("batch_stats", {}), local)
        if isinstance(module, nn.BatchNorm) or (module is None and {"mean", "var"} <= set(own_variables(stats))):
            return declare(
                "batch_norm", scale=norm["scale"], offset=norm["offset"],
                mean=at("batch_stats:mean", "features"), var=at("batch_stats:var", "features"),
            )
        facts = {"groups": module.num_groups} if isinstance(module, nn.GroupNorm) else {}
        return declare("norm", scale=norm["scale"], offset=norm["offset"], facts=facts)
    return None


def _cache_spec(variables: Mapping[str, Any], local: Path, modules: dict) -> Spec:
    """The layer's variables in the `cache` collection: the decode cache of
    `nn.MultiHeadDotProductAttention(decode=True)` (keys and values (*batch, length,
    heads, head_dim)) and any module's `cache_index` (a position embedding's, as
    the Flax lm1b model keeps it); another cache's layout is its author's."""
    path = ".".join(local)
    module = modules.get(local)
    params = node_at(variables.get("params", {}), local)
    # Without a call, the names tell: linen's attention always names its projections so.
    attention = isinstance(module, nn.MultiHeadDotProductAttention) or (
        module is None and isinstance(params, Mapping) and {*ATTENTION_INPUTS, "out"} <= set(params)
    )
    spec = {}
    for name, value in own_variables(node_at(variables.get("cache", {}), local)).items():
        if name == "cache_index":
            spec[name] = ((("cache", (name,)),), axes())
        elif name in ("cached_key", "cached_value") and attention:
            spec[name] = ((("cache", (name,)),), axes("length", "heads", "head_dim"))
        else:
            raise refuse(
                path,
                f"its cache variable {name!r} {tuple(value.shape)} has no known layout (only "
                "MultiHeadDotProductAttention's decode cache and cache_index variables are transferred)",
            )
    return spec


def _values(variables: Mapping[str, Any], local: Path, spec: Spec) -> dict[str, Any]:
    values = {}
    for name, (locations, ax) in spec.items():
        values[name] = placed(_value(variables, local, locations), ax)
    return values


def _value(variables: Mapping[str, Any], local: Path, locations: tuple[Location, ...]) -> Any:
    found = [node_at(variables.get(collection, {}), (*local, *relative)) for collection, relative in locations]
    if any(value is None for value in found):
        return None
    # Several variables (one per gate) form one parameter along a gate axis.
    return found[0] if len(found) == 1 else jnp.stack(found, axis=-2)


def linen_layout(
    variables: Mapping[str, Any], local: Path, modules: dict, declarations: Declarations
) -> Layout | Container:
    path = ".".join(local)
    params = node_at(variables.get("params", {}), local)
    cache = _cache_spec(variables, local, modules)
    state = Layout("decode_cache", _values(variables, local, cache)) if cache else None
    if not isinstance(params, Mapping):
        if local in modules or state is not None:
            # A module without parameters: with a cache only (a position embedding), or
            # without variables (nn.RNN, nn.Sequential: linen creates the layers it
            # wraps in its parent's scope, so they are not below it).
            return Container((), state)
        raise HookError(
            f"transfer_params: no linen module with parameters at {path!r} (modules "
            "without variables, such as nn.RNN, are known from a call: pass inputs=)"
        )
    cell = isinstance(modules.get(local), nn.RNNCellBase) or set(params) in (_LSTM_NAMES, _GRU_NAMES)
    if not own_variables(params) and not cell:
        return Container(tuple(".".join(p) for p in subtree_paths(params) if own_variables(node_at(params, p))), state)
    if isinstance(modules.get(local), Mapped):
        raise refuse_reparametrised(
            path,
            f"it runs inside the nn.map_variables {modules[local].wrapper!r}, whose trans_in_fn maps its stored "
            "variables before it uses them",
        )
    wrapper = _reparametrising(variables, local)
    if wrapper is not None:
        raise refuse_reparametrised(
            path,
            f"its parameters are reparametrised by the module at {wrapper or 'the root'!r} (an nn.WeightNorm or "
            "nn.SpectralNorm, which keeps their scales or spectral norms)",
        )
    declared = _linen_spec(variables, local, modules, declarations)
    # A LoRA wrapper sharing its Dense's scope (`nn.share_scope`) adds its own parameters.
    read = {relative[0] for collection, relative in map(_location, declared.places()) if collection == "params"}
    refuse_unread(path, declared.kind, "linen scope holding them", set(own_variables(params)), read)
    return declared.read(lambda places: _value(variables, local, tuple(map(_location, places))), state)


@dataclasses.dataclass(frozen=True)
class Mapped:
    """What `LinenModule.detached` keeps of a module seen inside an `nn.map_variables`:
    that wrapper's class name."""

    wrapper: str


def _reparametrising(variables: Mapping[str, Any], local: Path) -> str | None:
    """The path of the module reparametrising the parameters of the layer at `local`,
    if any: linen's `nn.WeightNorm` and `nn.SpectralNorm` keep, in their own scope (the
    layer's parent, or a sibling of the layer), variables named after the layer's
    parameters: `<layer name>/kernel/scale`, `<layer name>/kernel/sigma`."""
    if not local:
        return None
    for collection in variables.values():
        parent = node_at(collection, local[:-1])
        if not isinstance(parent, Mapping):
            continue
        for name, node in [("", parent), *parent.items()]:
            if isinstance(node, Mapping) and any(
                isinstance(key, str) and key.startswith(f"{local[-1]}/") for key in node
            ):
                return ".".join((*local[:-1], name) if name else local[:-1])
    return None


def linen_write(
    variables: Mapping[str, Any], values: dict[Path, dict[str, Any]], modules: dict, declarations: Declarations
) -> Mapping[str, Any]:
    """`variables` with `values` (local path -> values from `_layouts.fit`) in the
    submodules at those paths: new dicts along the way; a variable in a metadata box
    (`nn.Partitioned`) stays in a box with the same metadata."""
    unboxed_variables = unboxed(variables)
    for local, layer_values in values.items():
        places = {name: locations for name, (locations, _) in _cache_spec(unboxed_variables, local, modules).items()}
        if set(layer_values) - set(places):
            declared = _linen_spec(unboxed_variables, local, modules, declarations)
            places.update({name: tuple(map(_location, p.where)) for name, p in declared.params.items()})
        for name, value in layer_values.items():
            locations = places[name]
            parts = [value] if len(locations) == 1 else [jnp.take(value, i, axis=-2) for i in range(len(locations))]
            for (collection, relative), part in zip(locations, parts):
                where = (collection, *local, *relative)
                variables = replaced(variables, where, written(".".join(local), node_at(variables, where), part))
    return variables
