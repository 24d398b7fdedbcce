"""Haiku's parameter layouts (`px.transfer_params`): the parameters of a Haiku module
in named axes (`_engine/_layouts.py`), read from and written into the params and state.

Haiku's facts: `w` is (in, out) / (*window, in / groups, out); `hk.MultiHeadAttention`
projects with `hk.Linear`s named query/key/value/linear whose outputs merge
(heads, head_dim) head-major; `hk.LSTM` is one `linear` on concat(x, h) with gates
(i, g, f, o) and 1 added to the forget gate; BatchNorm keeps its statistics in state
(`<name>/~/mean_ema`, `var_ema`), shaped like its (1, ..., features) scale.
`hk.experimental.layer_stack` puts a stack axis in front of every parameter under
its `__layer_stack...` scope.
"""

import dataclasses
import re

import haiku as hk
import jax.numpy as jnp

from ..._engine import (
    AS_STORED,
    Container,
    Declarations,
    Declared,
    Layout,
    Param,
    as_stored,
    axes,
    is_abstract,
    lax_transpose_padding,
    put_like,
    refuse,
)
from ..._errors import HookError
from ._names import haiku_path, params_path

_ATTENTION = ("query", "key", "value", "linear")
_LSTM_GATES = ("i", "g", "f", "o")


def _param_key(params: dict, local: tuple[str, ...]) -> str | None:
    return next((key for key in params if params_path(key) == local), None)


def _stacked(key: str) -> int:
    return sum(segment.startswith("__layer_stack") for segment in haiku_path(key))


def _is_attention(params: dict, local: tuple[str, ...], modules: dict) -> bool:
    if local[:-1] in modules:
        return isinstance(modules[local[:-1]], hk.MultiHeadAttention)
    # Without a call, the names tell: Haiku's attention always names its projections so.
    return bool(local) and local[-1] in _ATTENTION and all(
        _param_key(params, (*local[:-1], name)) is not None for name in _ATTENTION
    )


def _lstm_key(params: dict, local: tuple[str, ...]) -> str:
    key = _param_key(params, (*local, "linear"))
    if key is None:
        raise HookError(f"transfer_params: the hk.LSTM at {'.'.join(local)!r} has no parameters")
    return key


def _lstm(params: dict, local: tuple[str, ...]) -> Layout:
    key = _lstm_key(params, local)
    w, b = params[key]["w"], params[key].get("b")
    hidden = w.shape[-1] // 4
    gates = axes(("gate", "hidden"))[0]
    layout = Layout("lstm", {
        "input_kernel": Param(w[..., : w.shape[-2] - hidden, :], axes("in", gates)),
        "hidden_kernel": Param(w[..., w.shape[-2] - hidden :, :], axes("recurrent", gates)),
        "bias": Param(b, axes(gates), (("gate", "f", 1.0),)),
    }, {"hidden": hidden}, {"gate": _LSTM_GATES})
    return layout


def _transpose(params: dict, local: tuple[str, ...], module: hk.ConvNDTranspose) -> Layout:
    # Haiku runs `w` (*window, out, in) unflipped over the input dilated by the stride.
    path = ".".join(local)
    if module.output_shape is not None:
        raise refuse(path, "with output_shape= its padding depends on the input size, so no other layer's can be "
                     "checked equal")
    key = _param_key(params, local)
    if key is None:
        raise HookError(f"transfer_params: the hk.ConvNDTranspose at {path!r} has no parameters")
    w, b = params[key]["w"], params[key].get("b")
    dims = module.num_spatial_dims
    window = tuple(f"window{i}" for i in range(dims))
    padding = lax_transpose_padding(module.kernel_shape, module.stride, (1,) * dims, module.padding)
    facts = {"groups": 1, "stride": tuple(module.stride), "dilation": (1,) * dims, "padding": padding}
    bias = axes("out") if module.channel_index == -1 else axes("out", *[()] * dims)
    return Layout("conv_transpose", {"kernel": Param(w, axes(*window, "out", "in")), "bias": Param(b, bias)},
                  facts=facts)


# A conv's and a conv-transpose's params look alike (`w`, `b`); only the module, known
# from a call, or the default name of hk.Conv1D/2D/3D/ConvND (`conv2_d`, `conv2_d_1`
# for a second one) tells them apart.
_CONV_NAME = re.compile(r"(conv[123]_d|conv_nd)(_\d+)?")
_UNKNOWN_KIND = (
    "its parameters could be a conv's or a conv-transpose's (laid out differently), and its name is not a default "
    "name of hk.Conv1D/2D/3D/ConvND: pass inputs= (example inputs) so the layer kind is known"
)


def _haiku_cache(state: dict, local: tuple[str, ...]) -> Layout | None:
    """The module's own state (`hk.get_state`) as a `decode_cache` layout, or `None`
    without any. Haiku keeps no decode cache of its own: the layout of keys and values
    a module caches is its author's, so only a `cache_index` (a position) is
    transferred, and other state is refused by name."""
    key = _param_key(state, local)
    if key is None:
        return None
    held = {}
    for name, value in state[key].items():
        if name != "cache_index":
            raise refuse(
                ".".join(local),
                f"its state {name!r} {tuple(value.shape)} has no known layout: Haiku has no decode cache of its own, "
                "and the axes of one a module keeps with hk.get_state are its author's (only a cache_index "
                "is transferred)",
            )
        held[name] = Param(value, axes())
    return Layout("decode_cache", held)


def haiku_layout(
    params: dict, state: dict, local: tuple[str, ...], modules: dict, declarations: Declarations
) -> Layout | Container:
    cache = _haiku_cache(state, local)
    below = any(params_path(key)[: len(local)] == local for key in params)
    if cache is not None and not below:
        return Container((), cache)  # a module with state only (a position embedding)
    layout = _params_layout(params, state, local, modules, declarations)
    return layout if cache is None else dataclasses.replace(layout, state=cache)


def _params_layout(
    params: dict, state: dict, local: tuple[str, ...], modules: dict, declarations: Declarations
) -> Layout | Container:
    path = ".".join(local)
    module = modules.get(local)
    declared = _declared(params, local, modules, declarations)
    if declared is not None:
        own = params[_param_key(params, local)]
        return declared.read(lambda places: own.get(places[0]))
    if isinstance(module, hk.LSTM):
        return _lstm(params, local)
    if isinstance(module, (hk.GRU, hk.VanillaRNN)):
        raise refuse(
            path,
            f"hk.{type(module).__name__} has no exact counterpart: its gates differ from Equinox's and NNX's cells "
            "(hk.GRU applies the reset gate before the recurrent matmul)",
        )
    if isinstance(module, hk.ConvNDTranspose):
        return _transpose(params, local, module)
    key = _param_key(params, local)
    if key is None:
        parts = [
            ".".join(p[len(local):])
            for p in map(params_path, params)
            if p[: len(local)] == local and len(p) > len(local)
        ]
        if not parts:
            raise HookError(f"transfer_params: no Haiku module with parameters at {path!r}")
        return Container(tuple(parts))
    values, lead = params[key], _stacked(key)
    names = set(values)
    if names <= {"w", "b"} and "w" in names:
        w, b = values["w"], values.get("b")
        if w.ndim - lead == 2 and _is_attention(params, local, modules):
            heads = axes(("heads", "head_dim"))[0]
            sizes = {"heads": modules[local[:-1]].num_heads} if local[:-1] in modules else {}
            if local[-1] == "linear":
                return Layout(
                    "attention_out", {"kernel": Param(w, axes(heads, "out")), "bias": Param(b, axes("out"))}, sizes
                )
            return Layout("attention_in", {"kernel": Param(w, axes("in", heads)), "bias": Param(b, axes(heads))}, sizes)
        if w.ndim - lead == 2:
            return Layout("linear", {"kernel": Param(w, axes("in", "out")), "bias": Param(b, axes("out"))})
        if module is None and not _CONV_NAME.fullmatch(local[-1]):
            raise refuse(path, _UNKNOWN_KIND)
        window = tuple(f"window{i}" for i in range(w.ndim - lead - 2))
        facts = {"groups": module.feature_group_count} if isinstance(module, hk.ConvND) else {}
        kernel = Param(w, axes(*window, "in", "out"))
        return Layout("conv", {"kernel": kernel, "bias": Param(b, axes("out"))}, facts=facts)
    if names == {"embeddings"}:
        return Layout("embedding", {"embedding": Param(values["embeddings"], axes("vocab", "features"))})
    if names <= {"scale", "offset"}:
        some = next(iter(values.values()))
        feature = axes(*[()] * (some.ndim - lead - 1), "features")
        norm = {"scale": Param(values.get("scale"), feature), "offset": Param(values.get("offset"), feature)}
        facts = {"groups": module.groups} if isinstance(module, hk.GroupNorm) else {}
        stats = {name: state.get(f"{key}/~/{name}_ema") or {} for name in ("mean", "var")}
        if all("average" in s for s in stats.values()):
            return Layout("batch_norm", {**norm, **{n: Param(s["average"], feature) for n, s in stats.items()}})
        return Layout("norm", norm, facts=facts)
    if names == {"w_i", "w_h", "b"}:
        raise refuse(
            path,
            "hk.GRU has no exact counterpart: it applies the reset gate before the recurrent matmul, Equinox's and "
            "NNX's cells after",
        )
    return as_stored(values).read(lambda places: values[places[0]])


def _declared(params: dict, local: tuple[str, ...], modules: dict, declarations: Declarations) -> Declared | None:
    """The user's declaration for the module at `local` (by path; by class too where a
    call told it), which holds parameters of its own."""
    if _param_key(params, local) is None:
        return None
    return declarations.find(modules.get(local), ".".join(local))


_NATIVE = {"kernel": "w", "bias": "b", "embedding": "embeddings", "scale": "scale", "offset": "offset"}


def _into(path: str, old: dict, new: dict) -> dict:
    # Haiku keeps no metadata beside an array: where it goes is the sharding of the
    # array (or of the abstract one) it replaces.
    return {**old, **{name: put_like(path, value, old.get(name)) for name, value in new.items()}}


def haiku_write(
    params: dict, state: dict, local: tuple[str, ...], modules: dict, values: dict, declarations: Declarations
) -> tuple[dict, dict]:
    path = ".".join(local)
    if isinstance(modules.get(local), hk.LSTM):
        key = _lstm_key(params, local)
        kernel = jnp.concatenate([values["input_kernel"], values["hidden_kernel"]], axis=-2)
        new = {"w": kernel, **({"b": values["bias"]} if "bias" in values else {})}
        return {**params, key: _into(path, params[key], new)}, state
    new_state = dict(state)
    if "cache_index" in values:
        held = _param_key(state, local)
        assert held is not None  # _haiku_cache found it
        new_state[held] = _into(path, state[held], {"cache_index": values["cache_index"]})
    values = {name: value for name, value in values.items() if name != "cache_index"}
    if not values:
        return params, new_state
    key = _param_key(params, local)
    assert key is not None  # haiku_layout found it
    for name in ("mean", "var"):
        if name in values:
            ema = f"{key}/~/{name}_ema"
            # Inference reads `average`; `hidden` restarts the moving average from it.
            new = {"average": values[name], "hidden": values[name]}
            if is_abstract(state[ema].get("counter")):
                # An abstract destination has no count of updates: a fresh one's is 0.
                new["counter"] = jnp.zeros(state[ema]["counter"].shape, state[ema]["counter"].dtype)
            new_state[ema] = _into(path, state[ema], new)
    declared = _declared(params, local, modules, declarations)
    if declared is not None:
        native = {declared.params[name].where[0]: value for name, value in values.items()}
    elif getattr(_params_layout(params, state, local, modules, declarations), "kind", None) == AS_STORED:
        native = values  # read as stored, by Haiku's own names
    else:
        native = {_NATIVE[name]: value for name, value in values.items() if name in _NATIVE}
    return {**params, key: _into(path, params[key], native)}, new_state
