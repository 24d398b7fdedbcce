"""The library-neutral protocol by which a layer exposes its parameters to
`px.transfer_params`: where a layout conversion is made exact or refused.

A layer is read as a `Layout`: its kind (`LAYOUT_KINDS`), and each parameter by a
library-neutral name with its *named axes*. Axes are a tuple of entries, one per array
axis; an entry is a tuple of atoms, major first, when the library merges several named
axes into one (Haiku's attention query `w` is `(("in",), ("heads", "head_dim"))`, NNX's
kernel `(("in",), ("heads",), ("head_dim",))`), and `()` for a broadcast axis of size 1.
Axes in front of the declared ones are a stack (`hk.experimental.layer_stack`,
`eqx.filter_vmap`, `nnx.vmap`): they must match exactly and stay in front.

Converting a parameter from one layout to another splits merged entries into atoms,
permutes the atoms by name and merges them as the destination declares, with every
atom's size checked equal on both sides. There is no reshape of "anything of equal
size": what cannot be matched atom by atom raises an error naming the layer.

A destination may be abstract (built with `jax.eval_shape`, `nnx.eval_shape`: its
arrays are `jax.ShapeDtypeStruct`s): only shapes and dtypes are read from it, and every
value written into it is placed where it keeps its array (`put_like`): with the
sharding its library's metadata declares, else the sharding of the array (or of the
`ShapeDtypeStruct`) it replaces.

Each library's adapter declares its own layouts (its facts stay with it); this module
knows no library.
"""

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp

from .._errors import HookError

Axes = tuple[tuple[str, ...], ...]

# The kind of a layer of no known layout, read as stored (`_declarations.as_stored`).
AS_STORED = "as stored"

# What each kind of layout holds (the atoms of every parameter); documented per library
# in docs/migrating.md.
LAYOUT_KINDS: dict[str, dict[str, tuple[str, ...]]] = {
    "linear": {"kernel": ("in", "out"), "bias": ("out",)},
    "attention_in": {"kernel": ("in", "heads", "head_dim"), "bias": ("heads", "head_dim")},
    "attention_out": {"kernel": ("heads", "head_dim", "out"), "bias": ("out",)},
    "conv": {"kernel": ("window", "in", "out"), "bias": ("out",)},
    # The kernel of the stride-1 convolution the libraries run over the input dilated by
    # the stride (`lax.conv_transpose`); `facts` carry that convolution's padding.
    "conv_transpose": {"kernel": ("window", "in", "out"), "bias": ("out",)},
    "embedding": {"embedding": ("vocab", "features")},
    "norm": {"scale": ("features",), "offset": ("features",)},
    "batch_norm": {"scale": ("features",), "offset": ("features",), "mean": ("features",), "var": ("features",)},
    "lstm": {
        "input_kernel": ("in", "gate", "hidden"),
        "hidden_kernel": ("recurrent", "gate", "hidden"),
        "bias": ("gate", "hidden"),
    },
    # `recurrent_bias` is added to the candidate's recurrent term inside the reset gate.
    "gru": {
        "input_kernel": ("in", "gate", "hidden"),
        "hidden_kernel": ("recurrent", "gate", "hidden"),
        "bias": ("gate", "hidden"),
        "recurrent_bias": ("hidden",),
    },
    # State beyond parameters: an autoregressive decode cache, the keys and values of
    # the positions decoded so far and the next position (a scalar); batch and stack
    # axes lead, as a stack's do, and must match exactly. A layer without keys and values (a
    # position embedding) keeps the index only.
    "decode_cache": {
        "cached_key": ("length", "heads", "head_dim"),
        "cached_value": ("length", "heads", "head_dim"),
        "cache_index": (),
    },
}


def axes(*entries: str | tuple[str, ...]) -> Axes:
    """`axes("out", ("heads", "head_dim"))` -> `(("out",), ("heads", "head_dim"))`."""
    return tuple((entry,) if isinstance(entry, str) else tuple(entry) for entry in entries)


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter: its value (`None` where the layer has none, e.g. no bias) and the
    named axes of the value's trailing dimensions."""

    value: Any
    axes: Axes
    # Constants the library adds to the stored value when it uses it, as (atom, member,
    # constant): Haiku's LSTM adds 1 to the forget gate's bias, `("gate", "f", 1.0)`.
    # Conversion carries the value used, not the value stored.
    shift: tuple[tuple[str, str, float], ...] = ()
    # Atoms stored in reverse order: flax's `ConvTranspose(transpose_kernel=True)` keeps
    # its kernel spatially flipped, `("window0", "window1")`.
    flipped: tuple[str, ...] = ()
    # A constant the library adds to the whole stored value when it uses it (Gemma's
    # RMSNorm computes with `1 + scale`).
    offset: float = 0.0


def placed(value: Any, declared: "Axes | Param") -> Param:
    """`value` as a `Param` of `declared`: axes, or a `Param` whose other fields (a flip)
    an adapter declares with them."""
    return dataclasses.replace(declared, value=value) if isinstance(declared, Param) else Param(value, declared)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A layer's parameters in named axes, as one adapter reads it.

    - `kind`: a key of `LAYOUT_KINDS`.
    - `params`: library-neutral name -> `Param`.
    - `sizes`: atom sizes the layer knows from its configuration rather than from an
        array axis (an Equinox attention projection's `heads`).
    - `orders`: atom -> the order of its named members, for atoms whose members a
        library orders its own way (LSTM gates `("i", "f", "g", "o")`).
    - `facts`: other configuration both sides must share (`groups` of a conv).
    """

    kind: str
    params: dict[str, Param]
    sizes: dict[str, int] = dataclasses.field(default_factory=dict)
    orders: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The layer's state beyond parameters (a `decode_cache` layout), or `None`.
    state: "Layout | None" = None


@dataclasses.dataclass(frozen=True)
class Container:
    """A layer with no parameters of its own (an attention block, a Sequential): its
    parameters are in the layers at `parts` (paths relative to it). It may still hold
    state (`state`: an attention block's decode cache, a position embedding's index)."""

    parts: tuple[str, ...]
    state: Layout | None = None


def refuse(path: str, reason: str) -> HookError:
    return HookError(f"transfer_params cannot map layer {path!r}: {reason}")


def refuse_reparametrised(path: str, cause: str) -> HookError:
    """Refuse a layer whose weights something maps before the layer uses them (a
    WeightNorm wrapper, linen's `nn.map_variables`; `cause` says what): the stored
    weights are not the ones it computes with, so copying them would be wrong."""
    return refuse(
        path, f"{cause}: the weights it computes with are not the stored ones; transfer into or from a model without it"
    )


def refuse_unread(path: str, kind: str, layer: str, held: set[str], read: set[str]) -> None:
    """Refuse a layer holding parameters (`held`, by name) that its kind's layout does
    not read (`read`): a transfer would silently drop them (a LoRA update beside a
    linear layer's kernel, a gate in a subclass of one)."""
    if held - read:
        raise refuse(
            path,
            f"its parameters {sorted(held - read)} are not part of a {kind} layer's ({sorted(held & read)}): "
            f"a {layer} has no counterpart in another library; fold them into the layer's own (a LoRA update "
            "into its kernel) before transferring",
        )


def _atoms(entries: Axes) -> list[str]:
    return [atom for entry in entries for atom in entry]


def _render(entries: Axes) -> str:
    return "(" + ", ".join("*".join(entry) if entry else "1" for entry in entries) + ")"


def _entry_sizes(shape: tuple[int, ...], entries: Axes) -> list[int]:
    return list(shape[len(shape) - len(entries) :])


def _learn_sizes(path: str, name: str, side: str, param: Param, sizes: dict[str, int], known: dict[str, int]) -> None:
    """Record the size of every atom `param`'s axes determine (entries of one atom, and
    entries whose other atoms are known); a conflict is an error naming the layer."""
    shape = tuple(param.value.shape)
    for entry, size in zip(param.axes, _entry_sizes(shape, param.axes)):
        if not entry:
            if size != 1:
                raise refuse(path, f"{side} {name} has size {size} on an axis declared of size 1")
            continue
        unknown = [atom for atom in entry if atom not in known and atom not in sizes]
        product = math.prod(known.get(atom, sizes.get(atom, 1)) for atom in entry if atom not in unknown)
        if len(unknown) == 1:
            if size % product:
                raise refuse(path, f"{side} {name} axis {'*'.join(entry)} of size {size} does not split by {product}")
            known[unknown[0]] = size // product
        elif not unknown and product != size:
            raise refuse(path, f"{side} {name} axis {'*'.join(entry)} has size {size}, its atoms {product}")


def convert(path: str, name: str, source: Layout, target: Layout) -> Any:
    """The value of `source.params[name]` in `target.params[name]`'s axes, shape and
    dtype, or an error naming the layer."""
    src, dst = source.params[name], target.params[name]
    if sorted(_atoms(src.axes)) != sorted(_atoms(dst.axes)):
        raise refuse(
            path,
            f"{name}: source axes {_render(src.axes)} and destination axes {_render(dst.axes)} "
            "do not name the same axes",
        )
    for side, param in (("source", src), ("destination", dst)):
        if param.value.ndim < len(param.axes):
            raise refuse(
                path, f"{side} {name} of shape {tuple(param.value.shape)} has fewer axes than {_render(param.axes)}"
            )
    src_stack = tuple(src.value.shape[: src.value.ndim - len(src.axes)])
    dst_stack = tuple(dst.value.shape[: dst.value.ndim - len(dst.axes)])
    if src_stack != dst_stack:
        raise refuse(path, f"{name}: stacked {src_stack} in the source, {dst_stack} in the destination")
    # An atom whose members are named (gates) has as many as it names.
    src_sizes = {atom: len(order) for atom, order in source.orders.items()}
    dst_sizes = {atom: len(order) for atom, order in target.orders.items()}
    # Sizes first from what each side states, then from the other side's, so that an
    # entry merged on both sides (Haiku and Equinox attention) is still checked.
    _learn_sizes(path, name, "destination", dst, target.sizes, dst_sizes)
    _learn_sizes(path, name, "source", src, source.sizes, src_sizes)
    for atom in _atoms(src.axes):
        a = src_sizes.get(atom, source.sizes.get(atom))
        b = dst_sizes.get(atom, target.sizes.get(atom))
        if a is not None and b is not None and a != b:
            raise refuse(
                path,
                f"{name} of shape {tuple(src.value.shape)} {_render(src.axes)} does not fit "
                f"{tuple(dst.value.shape)} {_render(dst.axes)}: axis {atom!r} has size {a} in the source, "
                f"{b} in the destination",
            )
    merged = {**target.sizes, **dst_sizes, **source.sizes, **src_sizes}
    _learn_sizes(path, name, "source", src, merged, src_sizes)
    _learn_sizes(path, name, "destination", dst, merged, dst_sizes)
    merged = {**merged, **src_sizes, **dst_sizes}
    missing = [atom for atom in _atoms(src.axes) if atom not in merged]
    if missing:
        raise refuse(path, f"{name}: the size of axes {missing} is known to neither side")
    value = jnp.reshape(src.value, src_stack + tuple(merged[a] for a in _atoms(src.axes)))
    value = _flipped(value, src, len(src_stack))
    value = _shifted(value, src, len(src_stack), source.orders, +1)
    if src.offset != dst.offset:
        value = value + (src.offset - dst.offset)
    value = _reorder(path, name, value, _atoms(src.axes), len(src_stack), source.orders, target.orders)
    order = [_atoms(src.axes).index(atom) for atom in _atoms(dst.axes)]
    value = jnp.transpose(value, (*range(len(src_stack)), *(len(src_stack) + i for i in order)))
    value = _shifted(value, dst, len(dst_stack), target.orders, -1)
    value = _flipped(value, dst, len(dst_stack))
    value = jnp.reshape(value, dst.value.shape).astype(dst.value.dtype)
    # Never the source's own buffer: a destination trained with donated buffers
    # (`donate_argnums`) would delete the source's arrays.
    return jnp.array(value, copy=True) if value is src.value else value


def _reorder(path: str, name: str, value: Any, atoms: list[str], lead: int, src_orders: dict, dst_orders: dict) -> Any:
    """Members of ordered atoms (gates) taken in the destination's order."""
    for position, atom in enumerate(atoms):
        if atom not in src_orders and atom not in dst_orders:
            continue
        src_order, dst_order = src_orders.get(atom), dst_orders.get(atom)
        if src_order is None or dst_order is None or sorted(src_order) != sorted(dst_order):
            raise refuse(
                path,
                f"{name}: the members of axis {atom!r} are {src_order} in the source, {dst_order} in the destination",
            )
        value = jnp.take(value, jnp.array([src_order.index(m) for m in dst_order]), axis=lead + position)
    return value


def _shifted(value: Any, param: Param, lead: int, orders: dict, sign: int) -> Any:
    """The value a library uses (`sign=+1`: stored plus its constants) or stores
    (`sign=-1`: used minus them). `value` is in atoms, in `param`'s atom order."""
    atoms = _atoms(param.axes)
    for atom, member, constant in param.shift:
        index = [slice(None)] * value.ndim
        index[lead + atoms.index(atom)] = orders[atom].index(member)
        value = value.at[tuple(index)].add(sign * constant)
    return value


def _flipped(value: Any, param: Param, lead: int) -> Any:
    """`value`, in `param`'s atom order, with `param.flipped` atoms reversed (an
    involution: stored to used and back)."""
    atoms = _atoms(param.axes)
    if not param.flipped:
        return value
    return jnp.flip(value, tuple(lead + atoms.index(atom) for atom in param.flipped))


def lax_transpose_padding(
    kernel: tuple[int, ...], strides: tuple[int, ...], dilation: tuple[int, ...], padding: Any
) -> tuple[tuple[int, int], ...]:
    """The padding `lax.conv_transpose` gives its dilated convolution (a fact of a
    conv-transpose layout), from a padding string or explicit pairs."""
    if not isinstance(padding, str):  # pairs pad the dilated convolution itself
        return tuple((int(before), int(after)) for before, after in padding)
    pads = []
    for k, s, d in zip(kernel, strides, dilation):
        k = (k - 1) * d + 1
        if padding == "SAME":
            total = k + s - 2
            before = k - 1 if s > k - 1 else math.ceil(total / 2)
        else:  # VALID
            total, before = k + s - 2 + max(k - s, 0), k - 1
        pads.append((before, total - before))
    return tuple(pads)


def _check_declared(layout: Layout) -> None:
    # An adapter's layout must use its kind's names and atoms (`window` stands for the
    # spatial atoms `window0`, `window1`, ...): a slip in a declaration is a bug here,
    # not a silently different layout.
    # A kind of the user's own, or a layer read as stored, has no table to follow.
    declared = LAYOUT_KINDS.get(layout.kind)
    if declared is None:
        return
    for name, param in layout.params.items():
        atoms = {"window" if atom.startswith("window") else atom for atom in _atoms(param.axes)}
        # Atoms with named members beyond the kind's: a fused layer's, split along them.
        if sorted(atoms - (set(layout.orders) - set(declared[name]))) != sorted(declared[name]):
            raise AssertionError(f"{layout.kind} {name} declared with axes {_render(param.axes)}, not {declared[name]}")


def fit(path: str, source: Layout, target: Layout, source_path: str | None = None) -> dict[str, Any]:
    """`{name: value}` for every parameter of `target` (the destination layer at
    `path`), converted from `source` (the source's layer at `source_path`). A parameter
    the destination has and the source lacks becomes zeros when that is the same layer
    (a missing bias is a zero bias); the other way round is an error."""
    _check_declared(source)
    _check_declared(target)
    source_name = "the source" if source_path is None else f"the source {source_path!r}"
    mismatch = f"{source_name} is {_described(source)}, the destination {_described(target)}"
    if source.kind != target.kind:
        raise refuse(path, mismatch)
    for fact in sorted(set(source.facts) & set(target.facts)):
        if source.facts[fact] != target.facts[fact]:
            raise refuse(path, f"{fact} is {source.facts[fact]} in the source, {target.facts[fact]} in the destination")
    if AS_STORED in (source.kind, target.kind) and _held(source) != _held(target):
        # Arrays of no known meaning: the same names and shapes, or refused.
        raise refuse(path, mismatch)
    values = {}
    for name in sorted(set(source.params) | set(target.params)):
        src, dst = source.params.get(name), target.params.get(name)
        has_source = src is not None and src.value is not None
        if dst is None or dst.value is None:
            if has_source:
                raise refuse(path, f"the source has a {name} and the destination has none")
        elif has_source:
            values[name] = convert(path, name, source, target)
        else:
            values[name] = _zero(path, name, dst, target)
    return values


def _held(layout: Layout) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.value.shape) for name, p in layout.params.items() if p.value is not None}


def _described(layout: Layout) -> str:
    if layout.kind != AS_STORED:
        return f"a {layout.kind} layer"
    held = ", ".join(f"{name} {shape}" for name, shape in _held(layout).items())
    return (
        f"a layer of no known parameter layout, holding {held} (declare the axes of its class with "
        "layouts={Class: px.declare(...)})"
    )


def fit_state(path: str, source: Layout | None, target: Layout | None) -> dict[str, Any]:
    """`{name: value}` for the destination layer's state (`Layout.state`,
    `Container.state`), converted from the source's like parameters. Where the source
    has none, the destination's starts afresh (zeros: an empty cache at position 0, as
    the libraries initialise it); state the destination has no place for is an error
    naming it: dropping it would make the port continue from another position."""
    if source is None and target is None:
        return {}
    if target is None:
        assert source is not None
        held = sorted(name for name, p in source.params.items() if p.value is not None)
        raise refuse(
            path,
            f"the source holds a decode cache ({', '.join(held)}) and the destination none: build the "
            "destination in decode mode with its cache (NNX `init_cache`, linen `decode=True`), or port the "
            "parameters only from the source without its cache (linen variables without the `cache` collection, "
            "an NNX model before `init_cache`)",
        )
    if source is None:
        return {name: _zero(path, name, p, target) for name, p in target.params.items() if p.value is not None}
    return fit(path, source, target)


def _zero(path: str, name: str, dst: Param, target: Layout) -> Any:
    # A layer without this parameter behaves as one whose used value is 0: what the
    # destination stores is 0 minus what it adds.
    # By shape and dtype: an abstract destination's sharding is applied when written.
    zero = Param(jnp.zeros(dst.value.shape, dst.value.dtype), dst.axes)
    if not dst.shift:
        return zero.value
    probe = Layout(target.kind, {name: zero}, target.sizes, target.orders)
    return convert(path, name, probe, Layout(target.kind, {name: dst}, target.sizes, target.orders))


# -- where written values go ---------------------------------------------------------


def is_abstract(x: Any) -> bool:
    """Whether `x` stands for an array without holding one (an abstract destination's
    leaf: what `jax.eval_shape` returns)."""
    return isinstance(x, jax.ShapeDtypeStruct)


def is_inexact(x: Any) -> bool:
    """Whether `x` is a floating-point (or complex) array, or an abstract one."""
    return (eqx.is_inexact_array(x) if not is_abstract(x) else jnp.issubdtype(x.dtype, jnp.inexact))


def context_mesh() -> jax.sharding.Mesh | None:
    """The concrete mesh of the enclosing `jax.set_mesh`, or `None` outside one."""
    mesh = jax.sharding.get_mesh()
    return None if mesh.empty else mesh


def put_like(path: str, value: Any, current: Any, declared: Any = None) -> Any:
    """`value` placed where the destination keeps the array it replaces.

    **Arguments:**

    - `path`: the destination layer (for errors).
    - `value`: the converted value.
    - `current`: what the destination holds there now: an array, or a
        `jax.ShapeDtypeStruct` of an abstract destination.
    - `declared`: the sharding the destination's library declares for it (partitioning
        metadata resolved on a mesh by the adapter), or `None`.

    **Returns:**

    `value` with `declared`, else with `current`'s sharding where the destination chose
    one (a committed array, or a `ShapeDtypeStruct` carrying a sharding); otherwise
    `value` itself. An uncommitted array's place is JAX's default device, which is no
    placement: committing it would stop JAX from moving it next to sharded arrays.
    """
    sharding = declared
    if sharding is None and is_abstract(current):
        sharding = current.sharding
    elif sharding is None and isinstance(current, jax.Array) and not isinstance(current, jax.core.Tracer):
        sharding = current.sharding if current.committed else None
    if sharding is None:
        return value
    sharding = _concrete(path, sharding)
    try:
        return jax.device_put(value, sharding)
    except ValueError as error:  # jax's IndivisibleError: the library would not create it either
        declared = f"the destination declares the sharding {sharding} for an array of shape {tuple(value.shape)}"
        raise refuse(path, f"{declared}: {error}") from error


def _concrete(path: str, sharding: Any) -> Any:
    # `nnx.eval_shape` under `jax.set_mesh` gives NamedShardings over the mesh's
    # AbstractMesh: the arrays go on the concrete mesh of that shape in context.
    if not isinstance(sharding, jax.sharding.NamedSharding) or not isinstance(
        sharding.mesh, jax.sharding.AbstractMesh
    ):
        return sharding
    mesh = context_mesh()
    if mesh is None or mesh.shape_tuple != sharding.mesh.shape_tuple:
        raise refuse(
            path,
            f"the destination is sharded {sharding.spec} over an abstract mesh {dict(sharding.mesh.shape)}, "
            f"and the mesh in context is {None if mesh is None else dict(mesh.shape)}: transfer under "
            "`with jax.set_mesh(mesh):` with the mesh the destination was built for",
        )
    return jax.sharding.NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


# -- one layer for several: members of a named axis ------------------------------------


def member_axis(path: str, layout: Layout, count: int, side: str) -> str:
    """The atom along which the fused layer at `path` (on `side`) holds `count` layers
    of the other model: the one atom with `count` named members (`Layout.orders`),
    an axis of its own in every parameter the layer holds."""
    candidates = [atom for atom, members in layout.orders.items() if len(members) == count]
    if len(candidates) != 1:
        declared = {atom: members for atom, members in layout.orders.items()} or "none"
        raise refuse(
            path,
            f"the mapping makes the {side} layer one for {count} layers of the other model, which needs one axis "
            f"with {count} named members to split it along (px.declare(..., members={{'kv': ('k', 'v')}})); its "
            f"axes with members: {declared}",
        )
    atom = candidates[0]
    for name, param in layout.params.items():
        if param.value is not None and (atom,) not in param.axes:
            raise refuse(
                path,
                f"{name} {_render(param.axes)} has no axis {atom!r} of its own: it cannot be split into "
                f"{count} layers along it",
            )
    return atom


def _position(param: Param, atom: str) -> int:
    return param.value.ndim - len(param.axes) + param.axes.index((atom,))


def member_of(layout: Layout, atom: str, index: int) -> Layout:
    """The layout of member `index` of `atom`: every parameter taken at it along that
    axis, which it no longer has (abstract values keep their shapes only)."""

    def taken(param: Param) -> Param:
        if param.value is None:
            return param
        position = _position(param, atom)
        if is_abstract(param.value):
            shape = param.value.shape[:position] + param.value.shape[position + 1 :]
            value = jax.ShapeDtypeStruct(shape, param.value.dtype)
        else:
            value = jnp.take(param.value, index, axis=position)
        kept = tuple(entry for entry in param.axes if entry != (atom,))
        return dataclasses.replace(param, value=value, axes=kept)

    orders = {a: members for a, members in layout.orders.items() if a != atom}
    return dataclasses.replace(layout, params={n: taken(p) for n, p in layout.params.items()}, orders=orders)


def merged_members(layout: Layout, atom: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """`fit`'s values of the members of `atom` (one dict per member, in member order)
    stacked along that axis of `layout`'s parameters."""
    return {
        name: jnp.stack([part[name] for part in parts], axis=_position(layout.params[name], atom))
        for name in parts[0]
    }
