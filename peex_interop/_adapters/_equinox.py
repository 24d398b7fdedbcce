"""The Equinox adapter: where an `eqx.Module` call becomes a call site.

For the duration of a hooked call, `__call__` of every module class found in the hooked
pytree is replaced at class level by a function that hands the call to
`_context.call_site`. Dispatching on the object actually called (not on a proxy of the
root, as peex does) reaches layers at any depth: in lists, `eqx.nn.Sequential`, helper
methods, `jax.vmap(self.proj)` inside library layers, and layers rebuilt inside scans.
"""

import functools
from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from equinox.nn import _attention as eqx_attention  # its module globals: how MHA calls jax

from .._engine import (
    AS_STORED,
    NO_DECLARATIONS,
    WEIGHTS,
    AbstractConverted,
    AbstractTransparent,
    Container,
    Declarations,
    Declared,
    Layout,
    ModuleView,
    Native,
    Param,
    StoredParam,
    ThreadStack,
    as_stored,
    at,
    attention_sites_wanted,
    axes,
    call_patches,
    call_site,
    children,
    declare,
    inner_site,
    is_inexact,
    join,
    kind_of,
    method_call_patches,
    method_patches,
    name_returned,
    patched,
    put_like,
    refuse,
    refuse_reparametrised,
    refuse_unread,
    register_native,
    register_shape_pass_save,
    running_layer,
    walk,
)

# Equinox's built-in layers, by library-independent kind (`px.KINDS`).
EQUINOX_KINDS: dict[type, str] = {
    eqx.nn.Linear: "linear",
    eqx.nn.Identity: "other",
    eqx.nn.Conv: "conv",
    eqx.nn.ConvTranspose: "conv",
    eqx.nn.MultiheadAttention: "attention",
    eqx.nn.LayerNorm: "norm",
    eqx.nn.BatchNorm: "norm",
    eqx.nn.GroupNorm: "norm",
    eqx.nn.RMSNorm: "norm",
    eqx.nn.Embedding: "embedding",
    eqx.nn.Dropout: "dropout",
    eqx.nn.LSTMCell: "recurrent",
    eqx.nn.GRUCell: "recurrent",
    eqx.nn.Pool: "pool",
    eqx.nn.AdaptivePool: "pool",
    eqx.nn.Lambda: "activation",
    eqx.nn.PReLU: "activation",
    eqx.nn.Sequential: "container",
    eqx.nn.MLP: "container",
}


def equinox_kind(module: Any) -> str:
    """The library-independent kind of an Equinox module (or class)."""
    return kind_of(module, EQUINOX_KINDS)


def _route(original: Callable, module: eqx.Module, args: tuple, kwargs: dict) -> Any:
    return call_site(module, functools.partial(original, module), args, kwargs)


def _route_method(original: Callable, module: eqx.Module, name: str, args: tuple, kwargs: dict) -> Any:
    return call_site(module, functools.partial(original, module), args, kwargs, member=name)


def _shared_call(original: Callable) -> Callable:
    def __call__(self, *args, **kwargs):
        layers = original(self, *args, **kwargs)
        # The returned layers are rebuilt with the tied arrays put back: each is the one
        # at its position under `pytree` (tied arrays alone cannot tell them apart).
        name_returned(self.pytree, layers)
        return layers

    return __call__


def _all_heads(vmap: Callable, keywords: dict, query_heads: Any, key_heads: Any, value_heads: Any, **kwargs) -> Any:
    # Equinox's `dot_product_attention` of every head, as `MultiheadAttention` vmaps it
    # (heads along axis 1; the keyword arguments of a vmapped call, along axis 0), with
    # the weights of all heads formed at once: the site `<attention>.weights`.
    mask = kwargs.get("mask", keywords.get("mask"))
    dropout, inference, key = keywords.get("dropout"), keywords.get("inference"), kwargs.get("key")
    weights_of = vmap(eqx_attention.dot_product_attention_weights, in_axes=(1, 1, 0 if "mask" in kwargs else None))
    weights = inner_site(*WEIGHTS, weights_of, (query_heads, key_heads, mask), {})

    def attend(weights: Any, value: Any, key: Any) -> Any:
        if dropout is not None:
            weights = dropout(weights, key=key, inference=inference)
        return jnp.einsum("sS,Sd->sd", weights, value)

    return vmap(attend, in_axes=(0, 1, 0), out_axes=1)(weights, value_heads, key)


def _attention_jax(jax_module: Any) -> ModuleView:
    """What `jax` is to Equinox's attention code while hooking. `MultiheadAttention`
    forms each head's weights inside `jax.vmap(dot_product_attention, in_axes=1,
    out_axes=1)`; while its weights site is selected, that vmap runs as `_all_heads`,
    so that the site is the weights of all heads, `(heads, q, k)`, as in every other
    library. Code of another shape is run as it is (the site is then never reached,
    and selecting it raises)."""
    vmap = jax_module.vmap

    def heads_vmap(fun: Callable, in_axes: Any = 0, out_axes: Any = 0, *args: Any, **kwargs: Any) -> Any:
        per_head = isinstance(fun, functools.partial) and fun.func is eqx_attention.dot_product_attention
        if (
            per_head and in_axes == 1 and out_axes == 1 and not (args or kwargs)
            and isinstance(running_layer(), eqx.nn.MultiheadAttention)
            and attention_sites_wanted()
        ):
            return functools.partial(_all_heads, vmap, fun.keywords)
        return vmap(fun, in_axes, out_axes, *args, **kwargs)

    return ModuleView(jax_module, vmap=heads_vmap)


def class_patches(types: Iterable[type]) -> list[tuple[Any, str, Any]]:
    """Patch targets for the `__call__` and the site methods (`_engine/_methods.py`) of
    each module type (wrappers excluded: they are transparent and run their own
    context), and for the attention weights site of `eqx.nn.MultiheadAttention`."""
    # `eqx.nn.Shared` returns its tied layers, not activations: the layers it returns
    # are the call sites (named by their paths under it).
    types = list(types)
    layers = [cls for cls in types if not issubclass(cls, (AbstractTransparent, eqx.nn.Shared))]
    shared = [cls for cls in types if issubclass(cls, eqx.nn.Shared)]
    # A converted model's own methods (`with_state`, `carried`) are peex_interop's API.
    with_methods = [cls for cls in layers if not issubclass(cls, AbstractConverted)]
    patches = (
        call_patches(layers, _route)
        + method_call_patches(with_methods, eqx.Module, _route_method)
        + method_patches(shared, "__call__", _shared_call)
    )
    if any(issubclass(cls, eqx.nn.MultiheadAttention) for cls in types):
        patches.append((eqx_attention, "jax", _attention_jax))
    return patches


# Equinox modules make up every hooked pytree (converted models are `eqx.Module`s too).
register_native(Native(equinox_kind, class_patches))


# -- shape-only passes ------------------------------------------------------------------
# `eqx.nn.State.set` and `update` return a new State and mark the one they were called
# on as spent ("Attempted to use old state"). A body the engine runs abstractly first
# (`_engine/_shape_pass.py`) would spend a State it closes over, or that was passed to
# `BackwardHook.init`, before the real run uses it. The States spent in this thread's
# innermost pass, to hand back when it ends:
_spent = ThreadStack()


def _keeping_spent(original: Callable) -> Callable:
    def spend(self: eqx.nn.State, *args: Any, **kwargs: Any) -> eqx.nn.State:
        if _spent.items:  # only this thread's passes: other threads' calls fall through
            _spent.items[-1].append((self, self._state))
        return original(self, *args, **kwargs)

    return spend


def _save_equinox_states() -> Callable[[], None]:
    spent: list[tuple[eqx.nn.State, Any]] = []
    patches = patched(
        [(eqx.nn.State, "set", _keeping_spent), (eqx.nn.State, "update", _keeping_spent)]
    )
    patches.__enter__()
    _spent.items.append(spent)

    def restore() -> None:
        try:
            for state, contents in reversed(spent):
                state._state = contents
        finally:
            _spent.items.pop()
            patches.__exit__(None, None, None)

    return restore


register_shape_pass_save(_save_equinox_states)


# -- parameter layouts (px.transfer_params) ------------------------------------------
# Equinox's facts: `Linear.weight` is (out, in), `Conv.weight` (out, in / groups,
# *window) with a bias (out, 1, ...), attention projections merge (heads, head_dim)
# head-major, LSTM gates are stacked (i, f, g, o) and GRU gates (r, z, n) with the
# candidate's recurrent bias apart (`bias_n`), BatchNorm statistics live in an
# `eqx.nn.State`.

_ATTENTION_INPUTS = ("query_proj", "key_proj", "value_proj")


def _linear_layout(module: eqx.nn.Linear, parent: Any, field: str | None) -> Declared:
    if isinstance(parent, eqx.nn.MultiheadAttention) and field in _ATTENTION_INPUTS:
        heads = ("heads", "head_dim")
        return declare(
            "attention_in", kernel=at("weight", heads, "in"), bias=at("bias", heads), sizes={"heads": parent.num_heads}
        )
    if isinstance(parent, eqx.nn.MultiheadAttention) and field == "output_proj":
        heads = ("heads", "head_dim")
        sizes = {"heads": parent.num_heads}
        return declare("attention_out", kernel=at("weight", "out", heads), bias=at("bias", "out"), sizes=sizes)
    return declare("linear", kernel=at("weight", "out", "in"), bias=at("bias", "out"))


# BatchNorm's statistics are read from its `eqx.nn.State`, not from a field.
_IN_STATE = StoredParam((), axes("features"))


def _built_in(module: Any, parent: Any, field: str | None) -> Declared | None:
    """The layout of one of Equinox's own layers, `None` for another."""
    if isinstance(module, eqx.nn.Linear):
        return _linear_layout(module, parent, field)
    if isinstance(module, (eqx.nn.Conv, eqx.nn.ConvTranspose)):
        window = tuple(f"window{i}" for i in range(module.num_spatial_dims))
        kernel, bias = at("weight", "out", "in", *window), at("bias", "out", *[()] * len(window))
        if isinstance(module, eqx.nn.Conv):
            return declare("conv", kernel=kernel, bias=bias, facts={"groups": module.groups})
        return declare("conv_transpose", kernel=kernel, bias=bias, facts=_transpose_facts(module))
    if isinstance(module, eqx.nn.Embedding):
        return declare("embedding", embedding=at("weight", "vocab", "features"))
    norm = {"scale": at("weight", "features"), "offset": at("bias", "features")}
    if isinstance(module, (eqx.nn.LayerNorm, eqx.nn.RMSNorm)) and len(module.shape) == 1:
        return declare("norm", scale=norm["scale"], offset=norm["offset"])
    if isinstance(module, eqx.nn.GroupNorm):
        return declare("norm", scale=norm["scale"], offset=norm["offset"], facts={"groups": module.groups})
    if isinstance(module, eqx.nn.BatchNorm):
        return declare("batch_norm", scale=norm["scale"], offset=norm["offset"], mean=_IN_STATE, var=_IN_STATE)
    gates = ("gate", "hidden")
    if isinstance(module, eqx.nn.LSTMCell):
        return declare(
            "lstm", members={"gate": ("i", "f", "g", "o")},
            input_kernel=at("weight_ih", gates, "in"), hidden_kernel=at("weight_hh", gates, "recurrent"),
            bias=at("bias", gates),
        )
    if isinstance(module, eqx.nn.GRUCell):
        return declare(
            "gru", members={"gate": ("r", "z", "n")},
            input_kernel=at("weight_ih", gates, "in"), hidden_kernel=at("weight_hh", gates, "recurrent"),
            bias=at("bias", gates), recurrent_bias=at("bias_n", "hidden"),
        )
    return None


def _own_arrays(module: Any) -> dict[str, Any]:
    """The arrays a module holds in its own fields (through lists and dicts), by dotted
    place; its submodules are layers of their own."""
    return {".".join(key): leaf for key, leaf in children(module) if is_inexact(leaf)}


def _equinox_spec(module: Any, parent: Any, field: str | None, path: str, declarations: Declarations) -> Declared:
    """The layout of an Equinox layer: the user's declaration, else Equinox's, else as
    stored."""
    declared = declarations.find(module, path) or _built_in(module, parent, field)
    if declared is not None:
        return declared
    name = type(module).__name__
    if any(isinstance(leaf, eqx.nn.StateIndex) for _, leaf in children(module)):
        raise refuse(path, f"no known parameter layout for {name}, which keeps values in an eqx.nn.State")
    own = _own_arrays(module)
    if not own:
        raise refuse(path, f"no known parameter layout for {name}, which holds no arrays")
    return as_stored(own)


def _at_place(module: Any, place: str) -> Any:
    node = module
    for name in place.split("."):
        if isinstance(node, (list, tuple)):
            node = node[int(name)]
        elif isinstance(node, dict):
            node = next(value for key, value in node.items() if str(key) == name)
        else:
            node = getattr(node, name)
    return node


def _transpose_facts(module: eqx.nn.ConvTranspose) -> dict:
    # Equinox runs `weight` unflipped over the input dilated by the stride, padded as
    # `_padding_transpose` says (its `padding` is the forward conv's, `output_padding`
    # included).
    padding = module._padding_transpose() if module.padding_mode == "ZEROS" else module.padding_mode
    stride, dilation = tuple(module.stride), tuple(module.dilation)
    return {"groups": module.groups, "stride": stride, "dilation": dilation, "padding": padding}


def is_state(x: Any) -> bool:
    return isinstance(x, eqx.nn.State)


def states_in(tree: Any) -> list[eqx.nn.State]:
    """The `eqx.nn.State`s in `tree`: a model holding its State as a field, or a call's
    arguments."""
    return [leaf for leaf in jtu.tree_leaves(tree, is_leaf=is_state) if is_state(leaf)]


def _batch_norm_stats(module: eqx.nn.BatchNorm, state: eqx.nn.State) -> tuple[Any, Any]:
    if module.ema_state_index is not None:  # mode="ema"
        return state.get(module.ema_state_index)
    # mode="batch" keeps zero-debiased hidden averages.
    assert module.batch_counter is not None and module.batch_state_index is not None
    counter = state.get(module.batch_counter)
    scale = jnp.where(counter == 0, 1, 1 - module.momentum**counter)
    hidden_mean, hidden_var = state.get(module.batch_state_index)
    return hidden_mean / scale, hidden_var / scale


def _with_batch_norm_stats(module: eqx.nn.BatchNorm, state: eqx.nn.State, mean: Any, var: Any) -> eqx.nn.State:
    # `State.set` invalidates the State it is called on: set on a copy, never on the
    # caller's.
    state = jax.tree.map(lambda x: x, state)
    if module.ema_state_index is not None:  # mode="ema"
        assert module.ema_first_time_index is not None
        # Not "first time" any more: training must update these, not replace them (one
        # flag per step in a stacked State).
        first_time = state.get(module.ema_first_time_index)
        state = state.set(module.ema_first_time_index, jnp.zeros_like(first_time))
        return state.set(module.ema_state_index, (mean, var))
    assert module.batch_counter is not None and module.batch_state_index is not None
    counter = state.get(module.batch_counter)
    scale = jnp.where(counter == 0, 1, 1 - module.momentum**counter)
    return state.set(module.batch_state_index, (mean * scale, var * scale))


def _parts(module: eqx.Module) -> tuple[str, ...]:
    # The layers under a container that hold parameters (the container holds none).
    return tuple(
        join(*key_path) for key_path, node in walk(module)
        if key_path and isinstance(node, eqx.Module) and _holds_arrays(node)
    )


def _holds_arrays(node: eqx.Module) -> bool:
    return any(eqx.is_array(leaf) for _, leaf in children(node))


def _holds_arrays_below(node: eqx.Module) -> bool:
    return any(isinstance(child, eqx.Module) and eqx.is_array(leaf)
               for _, child in children(node) for leaf in jax.tree.leaves(child))


def equinox_layout(
    module: Any, path: str, parent: Any = None, field: str | None = None, state: Any = None,
    declarations: Declarations = NO_DECLARATIONS,
) -> Layout | Container:
    """The parameters of an Equinox layer in named axes (`_engine/_layouts.py`); a
    container (no arrays of its own, e.g. `MultiheadAttention`, `Sequential`) lists its
    parameterised parts.

    **Arguments:**

    - `module`: the layer; `parent` and `field`: the module holding it and the field
        it sits in (an attention projection is read as one).
    - `path`: its path, for errors.
    - `state`: the `eqx.nn.State` holding BatchNorm statistics, if any.
    - `declarations`: the user's layouts, read before Equinox's.
    """
    if not _holds_arrays(module) and _holds_arrays_below(module):
        return Container(_parts(module))
    if isinstance(parent, (eqx.nn.WeightNorm, eqx.nn.SpectralNorm)) and field == "layer":
        # Its stored weight is not the one it computes with (g * v / |v|, or W / sigma).
        raise refuse_reparametrised(
            path, f"its {parent.weight_name} is reparametrised by the {type(parent).__name__} holding it"
        )
    declared = _equinox_spec(module, parent, field, path, declarations)
    # A subclass of eqx.nn.Linear may add arrays of its own (a LoRA update, a gate); a
    # layer read as stored holds its own arrays, its submodules being layers of their own.
    held = set(_own_arrays(module)) if declared.kind == AS_STORED else {
        key[0] for key, leaf in children(module)
        if eqx.is_inexact_array(leaf) or (
            isinstance(leaf, eqx.Module) and not isinstance(leaf, eqx.nn.StateIndex)
            and any(eqx.is_inexact_array(x) for x in jax.tree.leaves(leaf))
        )
    }
    refuse_unread(path, declared.kind, type(module).__name__, held, declared.places())
    layout = declared.read(lambda places: _at_place(module, places[0]))
    params = layout.params
    if layout.kind == "batch_norm":
        if state is None:
            raise refuse(
                path,
                "its running statistics are in an eqx.nn.State: hold the State in the model (a field of it; "
                "px.port reads it only there) or pass it to transfer_params (src_state=, dst_state=)",
            )
        mean, var = _batch_norm_stats(module, state)
        params["mean"], params["var"] = Param(mean, params["mean"].axes), Param(var, params["var"].axes)
    return layout


def equinox_write(
    module: Any, path: str, values: dict[str, Any], parent: Any = None, field: str | None = None, state: Any = None,
    declarations: Declarations = NO_DECLARATIONS,
) -> tuple[Any, Any]:
    """`(module, state)` with `values` (from `_layouts.fit`) in the layer's fields and,
    for BatchNorm, its statistics in `state`."""
    declared = _equinox_spec(module, parent, field, path, declarations)
    present = [(declared.params[name].where, value) for name, value in values.items()]
    present = [(where[0], value) for where, value in present if where]
    if "mean" in values:
        state = _with_batch_norm_stats(module, state, values["mean"], values["var"])
    if present:
        # Equinox keeps no metadata beside an array: it goes where the one it replaces is.
        placed = [put_like(path, v, _at_place(module, f)) for f, v in present]
        module = eqx.tree_at(lambda m: [_at_place(m, f) for f, _ in present], module, placed)
    return module, state
