"""Copying weights between aligned layers of different libraries.

Every library's layer is read into one canonical layout and written back from it:

- linear: `kernel` (in, out), `bias` (out,)
- conv: `kernel` (*window, in, out), `bias` (out,)
- norm: `scale`, `offset` (the normalised features)
- embedding: `embedding` (vocabulary, features)

(Equinox stores `Linear.weight` as (out, in) and `Conv.weight` as (out, in, *window);
Haiku `w` and NNX `kernel` are (in, out) / (*window, in, out).)
"""

from typing import Any

import equinox as eqx
import jax.numpy as jnp

from .._engine._errors import HookError
from .._engine._paths import AbstractConverted, join, walk

_EQUINOX_FIELDS = {
    eqx.nn.Linear: {"kernel": "weight", "bias": "bias"},
    eqx.nn.Conv: {"kernel": "weight", "bias": "bias"},
    eqx.nn.LayerNorm: {"scale": "weight", "offset": "bias"},
    eqx.nn.BatchNorm: {"scale": "weight", "offset": "bias"},
    eqx.nn.GroupNorm: {"scale": "weight", "offset": "bias"},
    eqx.nn.RMSNorm: {"scale": "weight", "offset": "bias"},
    eqx.nn.Embedding: {"embedding": "weight"},
}


def _fields(module: Any, path: str) -> dict[str, str]:
    for cls, fields in _EQUINOX_FIELDS.items():
        if isinstance(module, cls):
            return fields
    raise HookError(f"transfer_params cannot map layer {path!r}: no known parameter layout for {type(module).__name__}")


def _to_canonical(module: Any, name: str, value: Any) -> Any:
    if name == "kernel" and isinstance(module, eqx.nn.Linear):
        return value.T
    if name == "kernel":  # Conv: (out, in, *window) -> (*window, in, out)
        return jnp.transpose(value, (*range(2, value.ndim), 1, 0))
    if name == "bias" and isinstance(module, eqx.nn.Conv):
        return jnp.ravel(value)
    return value


def _from_canonical(module: Any, name: str, value: Any) -> Any:
    if value is None or name != "kernel":
        return value
    if isinstance(module, eqx.nn.Linear):
        return value.T
    return jnp.transpose(value, (value.ndim - 1, value.ndim - 2, *range(value.ndim - 2)))


def canonical_params(path: str, values: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """A library layer's `{its name: value}` in canonical names (`names` maps them)."""
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise HookError(f"transfer_params cannot map layer {path!r}: unknown parameters {unknown}")
    return {names[name]: value for name, value in values.items()}


def fitted_params(path: str, params: dict[str, Any], targets: dict[str, Any]) -> dict[str, Any]:
    """Canonical `params` fitted to a library layer's canonical `targets` (a missing
    parameter on either side is an error naming the layer)."""
    for name in sorted(set(params) | set(targets)):
        if params.get(name) is not None and name not in targets:
            check_and_fit(path, name, params[name], None)
    return {name: check_and_fit(path, name, params.get(name), target) for name, target in targets.items()}


def check_and_fit(path: str, name: str, value: Any, target: Any) -> Any:
    """`value` in `target`'s shape (equal sizes may differ by broadcast axes, e.g. a
    bias (out,) vs (out, 1, 1)), or an error naming the layer."""
    if target is None or value is None:
        if target is value:
            return None
        has, lacks = ("the source", "the destination") if target is None else ("the destination", "the source")
        raise HookError(f"transfer_params: layer {path!r}: {has} has a {name} and {lacks} has none")
    if value.size != target.size:
        raise HookError(
            f"transfer_params: layer {path!r}: {name} of shape {tuple(value.shape)} does not "
            f"fit {tuple(target.shape)}"
        )
    return jnp.reshape(value, target.shape).astype(target.dtype)


def read_equinox(module: Any, path: str) -> dict[str, Any]:
    fields = _fields(module, path)
    return {
        name: None if getattr(module, field) is None else _to_canonical(module, name, getattr(module, field))
        for name, field in fields.items()
    }


def write_equinox(module: Any, path: str, params: dict[str, Any]) -> Any:
    fields = _fields(module, path)
    missing = sorted(set(fields) - set(params))
    if missing:
        raise HookError(f"transfer_params: layer {path!r} needs {missing}, the source layer has {sorted(params)}")
    values = [
        check_and_fit(path, name, _from_canonical(module, name, params[name]), getattr(module, field))
        for name, field in fields.items()
    ]
    present = [(field, value) for (name, field), value in zip(fields.items(), values) if value is not None]
    return eqx.tree_at(lambda m: [getattr(m, f) for f, _ in present], module, [v for _, v in present])


def _locate(model: Any, path: str) -> tuple[str, Any, tuple[str, ...]]:
    """(prefix, node, local): the Equinox layer at `path` (local = ()), or the converted
    model holding it (local = its path inside)."""
    for key_path, node in walk(model):
        prefix = join(*key_path)
        if isinstance(node, AbstractConverted):
            rest = path if not prefix else path.removeprefix(prefix + ".")
            if rest and rest != path or not prefix:
                return prefix, node, tuple(rest.split("."))
        elif isinstance(node, eqx.Module) and prefix == path:
            return prefix, node, ()
    raise HookError(f"transfer_params: no layer {path!r} in {type(model).__name__}")


def _read(model: Any, path: str) -> dict[str, Any]:
    _, node, local = _locate(model, path)
    return node.read_layer(local) if local else read_equinox(node, path)


def _write(model: Any, path: str, params: dict[str, Any]) -> Any:
    prefix, node, local = _locate(model, path)
    new = node.write_layer(local, params) if local else write_equinox(node, path, params)
    if node is model:
        return new
    return eqx.tree_at(lambda m: next(n for p, n in walk(m) if join(*p) == prefix and isinstance(n, eqx.Module)), model, new)


def transfer_params(src: Any, dst: Any, mapping: dict[str, str]) -> Any:
    """Copy the weights of aligned layers from one model into another, across libraries.

    **Arguments:**

    - `src`: the model to copy from (Equinox, or converted Haiku/NNX).
    - `dst`: the model to copy into (not modified).
    - `mapping`: `{path in src: path in dst}`, e.g. `px.align(src, dst, x).mapping`.

    **Returns:**

    A copy of `dst` holding `src`'s weights in those layers. Layers of unknown layout,
    or whose shapes do not fit, raise an error naming the layer.
    """
    for path_src, path_dst in mapping.items():
        dst = _write(dst, path_dst, _read(src, path_src))
    return dst
