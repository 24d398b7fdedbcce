"""The Flax linen adapter: where a linen submodule call becomes a call site.

`from_linen` wraps a linen module definition and its variables as an `eqx.Module`. While
a hooking context is active in the calling thread, its call runs `module.apply` inside
`nn.intercept_methods`, and the interceptor hands every selected method call of every
submodule to `_context.call_site`, named by the submodule's scope path (`Dense_0`,
`blocks_0.attn`). Linen names a module by its scope, not by object identity, so modules
that linen's lifted transforms (`nn.scan`, `nn.vmap`, `nn.remat`) clone inside their
bodies keep their names; the engine threads the bodies' logs out, stacked.

`nn.scan` traces its body once *outside* `jax.lax.scan` to check which variables are
loop invariants (`flax.core.axes_scan`'s constancy check) and throws that trace away.
For the duration of a hooked call `axes_scan.scan` is replaced by a version that runs
that pre-pass with the interceptor passing calls through, so that only the scan proper
records logs.
"""

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import axes_scan
from flax.linen import (
    attention as linen_attention,  # its `dot_product_attention_weights`
    module as linen_module,  # its `_context`: the modules being called
)
from flax.linen.spmd import logical_to_mesh_sharding
from jaxtyping import PRNGKeyArray, PyTree

from .._engine import _context, _inner_sites, _methods, _patching, _routes, _shape_pass, _sown, _threads
from .._engine._declarations import NO_DECLARATIONS, Declarations, Declared, as_stored, at, declare
from .._engine._errors import HookError
from .._engine._kinds import kind_of
from .._engine._layouts import (
    Container,
    Layout,
    axes,
    context_mesh,
    placed,
    put_like,
    refuse,
    refuse_reparametrised,
    refuse_unread,
)
from .._engine._paths import AbstractConverted, float_size
from ._flax import flax_transpose_spec
from ._replace import replace

Path = tuple[str, ...]

# Linen's `dot_product_attention` (the default `attention_fn` of
# `MultiHeadDotProductAttention` and `SelfAttention`, decode mode included), and models
# that write their own attention (Hugging Face's), form the weights `(..., heads, q, k)`
# with `dot_product_attention_weights`, dropout included: that call is the attention
# layer's `.weights` site.
_routes.register_weights_function(linen_attention.dot_product_attention_weights)

LINEN_KINDS: dict[type, str] = {
    nn.Dense: "linear",
    nn.DenseGeneral: "linear",
    nn.Einsum: "linear",
    nn.Conv: "conv",
    nn.ConvTranspose: "conv",
    nn.ConvLocal: "conv",
    nn.MultiHeadDotProductAttention: "attention",
    nn.LayerNorm: "norm",
    nn.RMSNorm: "norm",
    nn.BatchNorm: "norm",
    nn.GroupNorm: "norm",
    nn.InstanceNorm: "norm",
    nn.Embed: "embedding",
    nn.Dropout: "dropout",
    nn.RNNCellBase: "recurrent",
    nn.RNN: "recurrent",
    nn.Bidirectional: "recurrent",
    nn.PReLU: "activation",
    nn.Sequential: "container",
}

# Collections that hold values a call produces rather than model state.
_OUTPUT_COLLECTIONS = ("intermediates",)


def _counts(variables: Mapping[str, Any]) -> tuple[int, int]:
    trainable = float_size(variables.get("params", {}))
    other = sum(
        float_size(tree) for name, tree in variables.items()
        if name != "params" and name not in _OUTPUT_COLLECTIONS
    )
    return trainable, other


class _Definition:
    """The linen module definition as a static field. Hashed by identity: linen modules
    holding lists (`nn.Sequential`) are unhashable, and a static field must hash."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module):
        self.module = module

    def __hash__(self) -> int:
        return id(self.module)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Definition) and other.module is self.module


def _static_mutable(mutable: Any) -> Any:
    # Lists are unhashable; linen accepts any collection of names.
    if isinstance(mutable, (bool, str, nn.DenyList)):
        return mutable
    return tuple(mutable)


class LinenModule(AbstractConverted):
    """A Flax linen module with its variables as one `eqx.Module`: the module definition
    is static, the variables (every collection: `params`, `batch_stats`, `cache`, ...)
    and the rngs are pytree leaves. Build it with `px.from_linen`.

    Calling it is `module.apply(variables, *args, rngs=rngs, mutable=mutable, **kwargs)`:
    it returns the output, or `(output, updates)` when `mutable` names collections;
    carry the updates forward with `.with_variables(updates)`.
    """

    variables: PyTree
    rngs: PyTree
    definition: _Definition = eqx.field(static=True)
    mutable: Any = eqx.field(static=True)
    methods: tuple[str, ...] | None = eqx.field(static=True)
    # The variables name only the modules that hold some (`known_layers`).
    lists_every_layer: ClassVar[bool] = False

    @property
    def module(self) -> nn.Module:
        """The linen module definition (unbound)."""
        return self.definition.module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Apply the linen module.

        **Arguments:**

        - `*args`, `**kwargs`: the module's own arguments (`train=True`, ...).

        **Returns:**

        What `module.apply` returns: the output, or `(output, updates)` with `mutable`.
        """
        def apply() -> Any:
            return self.module.apply(
                self.variables, *args, rngs=self.rngs, mutable=self.mutable, **kwargs
            )

        if not _context.active():
            return apply()
        state = _Interception(self)
        patches = [
            (axes_scan, "scan", _scan_with_silent_prepass),
            (nn.Module, "apply", _nested_apply),
            *_sown.sown_patches(nn.Module, _locate),
        ]
        with _patching.patched(patches), nn.intercept_methods(state.intercept):
            _intercepting.items.append(state)
            try:
                return apply()
            finally:
                _intercepting.items.pop()

    def with_variables(self, updates: Mapping[str, Any]) -> "LinenModule":
        """The same model with some collections replaced (e.g. the `updates` a call with
        `mutable=["batch_stats"]` returned).

        **Arguments:**

        - `updates`: `{collection: variables}`.

        **Returns:**

        A copy whose other collections are unchanged.
        """
        return replace(self, variables={**self.variables, **_plain(updates)})

    def carried(self, returned: Any) -> tuple[Any, "LinenModule"]:
        """`(output, model)` from what a call with `mutable` returned: the model holding
        the call's `updates` (a decode cache one position on), as
        `apply(..., mutable=["cache"])` is carried forward."""
        if not self.mutable:
            raise HookError(
                "this linen model's calls return no state updates: convert it with "
                "px.from_linen(module, variables, mutable=['cache']) (the collections its calls update)"
            )
        output, updates = returned
        return output, self.with_variables(updates)

    def with_rngs(self, rngs: Mapping[str, PRNGKeyArray] | None) -> "LinenModule":
        """The same model with other rngs for its next calls (e.g. a new dropout key per
        step).

        **Arguments:**

        - `rngs`: `{stream name: key}`, as for `module.apply`.

        **Returns:**

        A copy using `rngs`.
        """
        return replace(self, rngs=None if rngs is None else dict(rngs))

    def layers(self) -> None:
        """`None`: linen creates compact submodules during the call, and the variables
        name only the modules that hold some (`Dropout_0`, `nn.Sequential` and `nn.RNN`
        wrappers hold none), so the layers are known from a call only (`px.summary`)."""
        return None

    def known_layers(self) -> dict[Path, None]:
        """The paths of the submodules the variables name (of every collection:
        `params`, `batch_stats`, `cache`, ...): the layers known without a call; a
        module holding none (`Dropout_0`) is known once a call has run it."""
        return {path: None for tree in self.variables.values() for path in _subtree_paths(tree)}

    def parameter_counts(self) -> tuple[int, int]:
        """`(trainable, non_trainable)`: sizes of the `params` collection, and of the
        float arrays of the other collections (`batch_stats`, ...)."""
        return _counts(self.variables)

    def layer_parameter_counts(self, module: nn.Module) -> tuple[int, int]:
        """As `parameter_counts`, for one bound submodule during its call (one step of
        an `nn.scan`)."""
        return _counts(module.variables)

    def layer_kind(self, module: nn.Module) -> str:
        """The library-independent kind (`px.KINDS`) of a linen module."""
        return kind_of(module, LINEN_KINDS)

    def read_layer(
        self, local: Path, modules: dict | None = None, declarations: Declarations = NO_DECLARATIONS
    ) -> Layout | Container:
        """The parameters (and BatchNorm statistics) of the submodule at `local` in
        named axes (`_engine/_layouts.py`); `modules` (local path -> the linen module
        seen during a call) tells what the variables alone do not (a module's class)."""
        return self.read_layers([local], modules, declarations)[local]

    def read_layers(
        self, locals_: list[Path], modules: dict | None = None, declarations: Declarations = NO_DECLARATIONS
    ) -> dict[Path, Layout | Container]:
        """`read_layer` of several submodules, the variables unboxed once."""
        unboxed = _unboxed(self.variables)
        return {local: _linen_layout(unboxed, local, modules or {}, declarations) for local in locals_}

    def detached(self, module: nn.Module) -> "nn.Module | _Mapped":
        """An unbound copy of a bound linen module (its submodule attributes too): its
        class and settings without the scope, which holds the call's variables; where it
        runs inside an `nn.map_variables`, only that (`_Mapped`): it is not transferred."""
        return _Mapped(_mapping_in_thread.items[-1]) if _mapping_in_thread.items else module.copy(parent=None)

    def write_layer(
        self, local: Path, values: dict[str, Any], modules: dict | None = None,
        declarations: Declarations = NO_DECLARATIONS,
    ) -> "LinenModule":
        """A copy with `values` (from `_layouts.fit`) in the submodule at `local`: new
        dicts along the way, the user's variables are never mutated; a variable in a
        metadata box (`nn.Partitioned`) stays in a box with the same metadata."""
        return self.write_layers({local: values}, modules, declarations)

    def write_layers(
        self, values: dict[Path, dict[str, Any]], modules: dict | None = None,
        declarations: Declarations = NO_DECLARATIONS,
    ) -> "LinenModule":
        """`write_layer` of several submodules (local path -> values), the variables
        unboxed once."""
        unboxed = _unboxed(self.variables)
        variables = self.variables
        for local, layer_values in values.items():
            places = {name: locations for name, (locations, _) in _cache_spec(unboxed, local, modules or {}).items()}
            if set(layer_values) - set(places):
                declared = _linen_spec(unboxed, local, modules or {}, declarations)
                places.update({name: tuple(map(_location, p.where)) for name, p in declared.params.items()})
            for name, value in layer_values.items():
                locations = places[name]
                parts = [value] if len(locations) == 1 else [jnp.take(value, i, axis=-2) for i in range(len(locations))]
                for (collection, relative), part in zip(locations, parts):
                    where = (collection, *local, *relative)
                    written = _written(".".join(local), _node(variables, where), part)
                    variables = _replaced(variables, where, written)
        return eqx.tree_at(lambda m: m.variables, self, variables)


# -- parameter layouts (px.transfer_params) ------------------------------------------
# linen's facts: kernels are (in, out) / (*window, in / groups, out); the projections of
# `nn.MultiHeadDotProductAttention` are `DenseGeneral`s named query/key/value with
# (in, heads, head_dim) kernels and `out` with a (heads, head_dim, out) kernel; a norm's
# shift is called `bias`; BatchNorm statistics are in the `batch_stats` collection; an
# `LSTMCell` holds one `Dense` per gate and side, named ii/if/ig/io (no bias) and
# hi/hf/hg/ho; `nn.scan`/`nn.vmap` put stack axes in front of every variable. A spec
# maps a parameter to the variables it is stacked from (one variable: the value itself)
# and its named axes. The module's class is known from a call (`modules`); without
# one, the variables' names and shapes decide where they are unambiguous.

_ATTENTION_INPUTS = ("query", "key", "value")
_LSTM_GATES = ("i", "f", "g", "o")
_LSTM_NAMES = {f"{side}{gate}" for side in "ih" for gate in _LSTM_GATES}
_GRU_NAMES = {"ir", "iz", "in", "hr", "hz", "hn"}

Location = tuple[str, Path]
Spec = dict[str, tuple[tuple[Location, ...], Any]]


def _node(tree: Any, path: Path) -> Any:
    for part in path:
        if not isinstance(tree, Mapping) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _own(tree: Any) -> dict[str, Any]:
    """A module's own variables (not its submodules')."""
    if not isinstance(tree, Mapping):
        return {}
    return {name: value for name, value in tree.items() if not isinstance(value, Mapping)}


def _location(where: str) -> Location:
    """A place of a linen layout (`StoredParam.where`): a variable of the `params`
    collection, `/` between nested names (`"ii/kernel"`), another collection's as
    `"batch_stats:mean"`."""
    collection, _, name = where.rpartition(":")
    return collection or "params", tuple(name.split("/"))


def _lstm_spec() -> Declared:
    def gates(side: str, name: str) -> tuple[str, ...]:
        return tuple(f"{side}{gate}/{name}" for gate in _LSTM_GATES)

    return declare(
        "lstm", members={"gate": _LSTM_GATES},
        input_kernel=at(gates("i", "kernel"), "in", "gate", "hidden"),
        hidden_kernel=at(gates("h", "kernel"), "recurrent", "gate", "hidden"),
        bias=at(gates("h", "bias"), "gate", "hidden"),
    )


def _is_attention(variables: Mapping[str, Any], local: Path, parent: Any, kernel: Any) -> bool:
    if parent is not None:
        return isinstance(parent, nn.MultiHeadDotProductAttention)
    # Without a call, the names tell: linen's attention always names its projections so.
    siblings = _node(variables["params"], local[:-1]) if local else {}
    return {*_ATTENTION_INPUTS, "out"} <= set(siblings) and kernel.ndim == 3


def _kernel_spec(variables: Mapping[str, Any], local: Path, module: Any, parent: Any) -> Declared | None:
    path = ".".join(local)
    own = _own(_node(variables["params"], local))
    kernel, bias = own["kernel"], own.get("bias")
    if _is_attention(variables, local, parent, kernel) and local[-1] in _ATTENTION_INPUTS:
        return declare(
            "attention_in", kernel=at("kernel", "in", "heads", "head_dim"), bias=at("bias", "heads", "head_dim")
        )
    if _is_attention(variables, local, parent, kernel) and local[-1] == "out":
        return declare("attention_out", kernel=at("kernel", "heads", "head_dim", "out"), bias=at("bias", "out"))
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
    return declared or as_stored(_own(_node(variables.get("params", {}), local)))


def _built_in(variables: Mapping[str, Any], local: Path, modules: dict) -> Declared | None:
    path = ".".join(local)
    module, parent = modules.get(local), modules.get(local[:-1]) if local else None
    params = _node(variables.get("params", {}), local)
    own = _own(params)
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
        stats = _node(variables.get("batch_stats", {}), local)
        if isinstance(module, nn.BatchNorm) or (module is None and {"mean", "var"} <= set(_own(stats))):
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
    params = _node(variables.get("params", {}), local)
    # Without a call, the names tell: linen's attention always names its projections so.
    attention = isinstance(module, nn.MultiHeadDotProductAttention) or (
        module is None and isinstance(params, Mapping) and {*_ATTENTION_INPUTS, "out"} <= set(params)
    )
    spec = {}
    for name, value in _own(_node(variables.get("cache", {}), local)).items():
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
    found = [_node(variables.get(collection, {}), (*local, *relative)) for collection, relative in locations]
    if any(value is None for value in found):
        return None
    # Several variables (one per gate) form one parameter along a gate axis.
    return found[0] if len(found) == 1 else jnp.stack(found, axis=-2)


def _linen_layout(
    variables: Mapping[str, Any], local: Path, modules: dict, declarations: Declarations
) -> Layout | Container:
    path = ".".join(local)
    params = _node(variables.get("params", {}), local)
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
    if not _own(params) and not cell:
        return Container(tuple(".".join(p) for p in _subtree_paths(params) if _own(_node(params, p))), state)
    if isinstance(modules.get(local), _Mapped):
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
    refuse_unread(path, declared.kind, "linen scope holding them", set(_own(params)), read)
    return declared.read(lambda places: _value(variables, local, tuple(map(_location, places))), state)


@dataclasses.dataclass(frozen=True)
class _Mapped:
    """What `detached` keeps of a module seen inside an `nn.map_variables`: that
    wrapper's class name."""

    wrapper: str


def _maps_variables(module: nn.Module) -> bool:
    # `nn.map_variables(Dense, ...)` is a class linen's lifted transforms name after
    # the transform and the class: `Map_variablesDense`.
    return type(module).__module__ == nn.transforms.__name__ and type(module).__name__.startswith("Map_variables")


def _reparametrising(variables: Mapping[str, Any], local: Path) -> str | None:
    """The path of the module reparametrising the parameters of the layer at `local`,
    if any: linen's `nn.WeightNorm` and `nn.SpectralNorm` keep, in their own scope (the
    layer's parent, or a sibling of the layer), variables named after the layer's
    parameters: `<layer name>/kernel/scale`, `<layer name>/kernel/sigma`."""
    if not local:
        return None
    for collection in variables.values():
        parent = _node(collection, local[:-1])
        if not isinstance(parent, Mapping):
            continue
        for name, node in [("", parent), *parent.items()]:
            if isinstance(node, Mapping) and any(
                isinstance(key, str) and key.startswith(f"{local[-1]}/") for key in node
            ):
                return ".".join((*local[:-1], name) if name else local[:-1])
    return None


# -- metadata boxes ------------------------------------------------------------------
# `nn.with_partitioning` / `nn.with_logical_partitioning` initialisers store a variable
# boxed (`nn.Partitioned`, `nn.LogicallyPartitioned`: `flax.core.meta.AxisMetadata`);
# `apply` unboxes it, applying the partitioning as a sharding constraint. Values are
# read from the box as stored, and written back into a copy of it.


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def _contents(box: Any) -> Any:
    # A Partitioned box's `unbox()` constrains its value's sharding; the stored value
    # is what is read.
    return box.value if isinstance(box, nn.Partitioned) else box.unbox()


def _unboxed(variables: Mapping[str, Any]) -> Any:
    """The variables with every metadata box replaced by the value it holds."""
    return jax.tree.map(lambda x: _contents(x) if _is_box(x) else x, variables, is_leaf=_is_box)


def _box_sharding(box: Any) -> Any:
    """The sharding a partitioning box declares on its mesh (the box's own, else the one
    of `jax.set_mesh`), logical names resolved by its rules or `nn.logical_axis_rules`;
    `None` without a mesh."""
    if not isinstance(box, nn.Partitioned):
        return None
    mesh = box.mesh if box.mesh is not None else context_mesh()
    if mesh is None:
        return None
    if isinstance(box, nn.LogicallyPartitioned):
        return logical_to_mesh_sharding(box.get_partition_spec(), mesh, box.rules)
    return box.get_sharding(mesh)


def _written(path: str, current: Any, value: Any) -> Any:
    """`value` as the destination variable `current` (an array, an abstract one, or a
    box) holds it: placed with its sharding, in a copy of its box."""
    if not _is_box(current):
        return put_like(path, value, current)
    return current.replace_boxed(put_like(path, value, _contents(current), _box_sharding(current)))


def _replaced(tree: Mapping[str, Any], path: Path, value: Any) -> dict[str, Any]:
    # New dicts along the path: the user's variables are never mutated.
    head, *rest = path
    return {**tree, head: _replaced(tree[head], tuple(rest), value) if rest else value}


def _subtree_paths(tree: Any, prefix: Path = ()) -> list[Path]:
    paths = []
    if isinstance(tree, Mapping):
        for key, child in tree.items():
            if isinstance(child, Mapping):
                path = (*prefix, str(key))
                paths.append(path)
                paths.extend(_subtree_paths(child, path))
    return paths


# -- one hooked call -----------------------------------------------------------------
def _save_linen_state() -> Callable[[], None]:
    """What a trace of linen code advances in the modules being called in this thread,
    for the engine's shape-only passes (`_engine/_shape_pass.py`):

    - their scopes' rng counts: `make_rng` folds a scope's count into its key and counts
        on; a child scope's counts hang in its parent's dict, and the scope of a lifted
        body (`nn.scan`, `nn.vmap`) shares its parent's, so each extra trace of a body
        would give the real run other dropout masks;
    - the names they gave: a submodule created in a `jax.vmap` body is named by its
        parent's cursor (`Dense_0`, then `Dense_1`), registered among its children and
        reserved in its scope.
    """
    calls = [
        (module, module.scope) for module in linen_module._context.module_stack  # pyright: ignore[reportPrivateUsage]
        if module is not None and module.scope is not None
    ]
    held: dict[int, Any] = {}
    counts = [scope.rng_counters for _, scope in calls]
    while counts:
        tree = counts.pop()
        if id(tree) not in held:
            held[id(tree)] = tree
            counts.extend(child for child in tree.values() if isinstance(child, dict))
    names = []
    for module, scope in calls:
        state = module._state  # pyright: ignore[reportPrivateUsage]
        # Leaving a lifted transform rebinds the cursor (`reimport`): bind it back too.
        names.append((state, state.autoname_cursor, state.children))
        reservations = scope.reservations
        for container in (state.autoname_cursor, state.children, reservations, *reservations.values()):
            held[id(container)] = container
    restore_containers = _shape_pass.containers(held.values())

    def restore() -> None:
        restore_containers()
        for state, cursor, children in names:
            state.autoname_cursor, state.children = cursor, children

    return restore


_shape_pass.register(_save_linen_state)

# The hooked `LinenModule` calls running in this thread, innermost last.
_intercepting = _threads.ThreadStack()
# The `nn.map_variables` wrappers whose modules are running in this thread (class names).
_mapping_in_thread = _threads.ThreadStack()


@dataclasses.dataclass(eq=False)
class _Interception:
    """One hooked call of one `LinenModule`: its interceptor."""

    owner: LinenModule
    # The modules whose hooked methods are running (the root's included), outermost
    # first, with the paths their calls got.
    running: list[tuple[nn.Module, Path]] = dataclasses.field(default_factory=list)
    # The paths of the modules `nn.map_variables` wrappers run, with the wrappers' class
    # names: their variables are mapped before they use them.
    mapped: dict[Path, str] = dataclasses.field(default_factory=dict)
    # Where the modules of the `apply` calls running inside the model sit in it
    # (`self.lm_head.apply(...)`: `("lm_head",)`), innermost last.
    applied: list[Path] = dataclasses.field(default_factory=list)

    def place(self, module: nn.Module) -> Path:
        """Where a module `apply`-ed during the call sits in the model: a bound
        submodule (`self.lm_head`, tied weights applied with their own variables) at its
        own path; one built during the call under the layer running, by its name."""
        if module.scope is not None:
            return (*(self.applied[-1] if self.applied else ()), *(str(part) for part in module.path))
        name = module.name if isinstance(module.name, str) else type(module).__name__
        return (*(self.running[-1][1] if self.running else ()), name)

    def intercept(self, next_f: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
        module = context.module
        # Lifted-transform wrappers run under other method names; nn.scan's pre-pass is
        # not a call.
        if not self._is_site(module, context.method_name) or _inner_sites.silenced.items:
            if _maps_variables(module):
                # It runs the module it wraps (a clone, under its own name) afterwards;
                # wrapping the root, every module.
                prefix = (*self.running[-1][1], str(module.name)) if self.running else ()
                self.mapped[prefix] = type(module).__name__
            return next_f(*args, **kwargs)
        local = self.path_of(module)
        wrappers = [name for prefix, name in self.mapped.items() if local[: len(prefix)] == prefix]
        self.running.append((module, local))
        _mapping_in_thread.items.extend(wrappers)
        try:
            method = None if context.method_name == "__call__" else context.method_name
            return _context.call_site(self.owner, next_f, args, kwargs, local=local, module=module, member=method)
        finally:
            del _mapping_in_thread.items[len(_mapping_in_thread.items) - len(wrappers):]
            self.running.pop()

    def _is_site(self, module: nn.Module, method: str) -> bool:
        if self.owner.methods is not None:
            return method in self.owner.methods
        return method == "__call__" or method in _methods.site_methods(type(module), nn.Module)

    def path_of(self, module: nn.Module) -> Path:
        """The module's scope path; but a module given the scope of one whose call it
        runs inside (`nn.share_scope`: a LoRA wrapper and its base, a child sharing its
        parent's parameters) is named under that one's path by its own name, as its
        own layer: one path for both would make it the same layer, its call unlogged.
        (The clones linen's lifted transforms call have scopes of their own.) Inside a
        nested `apply`, scope paths start from the applied module's place."""
        path = (*(self.applied[-1] if self.applied else ()), *(str(part) for part in module.path))
        for outer, outer_path in reversed(self.running):
            if outer.scope is module.scope and outer is not module:
                return (*outer_path, str(module.name))
        return path


def _locate(module: nn.Module) -> tuple[LinenModule, Path] | None:
    """The converted model and path of a module sowing during this thread's hooked
    call (`_engine/_sown.py`), or `None` (outside one, or in `nn.scan`'s pre-pass)."""
    if not _intercepting.items or _inner_sites.silenced.items or not _context.active():
        return None
    state = _intercepting.items[-1]
    return state.owner, state.path_of(module)


def _nested_apply(original: Callable) -> Callable:
    """`nn.Module.apply` while hooking: a module applied with its own variables inside
    the model's call (HF's tied LM head, `self.lm_head.apply({"params": ...}, h)`) runs
    on a scope of its own whose path is empty, as if it were the model itself. Its
    calls are named from where the module sits in the model instead."""

    def apply(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = _intercepting.items[-1] if _intercepting.items else None
        if state is None or not state.running:
            return original(self, *args, **kwargs)
        state.applied.append(state.place(self))
        try:
            return original(self, *args, **kwargs)
        finally:
            state.applied.pop()

    return apply


def _scan_with_silent_prepass(original: Callable) -> Callable:
    def scan(fn: Callable, *args: Any, check_constancy_invariants: bool = True, **kwargs: Any):
        if not check_constancy_invariants:
            return original(fn, *args, check_constancy_invariants=False, **kwargs)
        # With the constancy check, axes_scan traces the body once before it calls
        # jax.lax.scan: that first trace is the pre-pass.
        pending = [True]

        def body(*body_args: Any) -> Any:
            if not pending:
                return fn(*body_args)
            pending.clear()
            _inner_sites.silenced.items.append(True)
            try:
                return fn(*body_args)
            finally:
                _inner_sites.silenced.items.pop()

        scan_fn = original(body, *args, check_constancy_invariants=True, **kwargs)

        def scanned(*call_args: Any) -> Any:
            pending[:] = [True]
            return scan_fn(*call_args)

        return scanned

    setattr(scan, _patching.ORIGINAL, original)
    return scan


def from_linen(
    module: nn.Module,
    variables: Mapping[str, Any],
    *,
    rngs: Mapping[str, PRNGKeyArray] | None = None,
    mutable: bool | str | Collection[str] = False,
    methods: Sequence[str] | None = None,
) -> LinenModule:
    """Expose a Flax linen model as an `eqx.Module` that every peex_interop hook works on.

    **Arguments:**

    - `module`: the linen module (definition; unbound).
    - `variables`: what `module.init` returned: `{"params": ..., "batch_stats": ...}`
        (never mutated).
    - `rngs`: `{stream name: key}` for `module.apply` (e.g. `{"dropout": key}`); change
        them per step with `.with_rngs(...)`.
    - `mutable`: the collections a call may update, as for `module.apply`; when set, a
        call returns `(output, updates)`.
    - `methods`: the submodule methods whose calls are sites (other methods log
        under `path.method`); by default `__call__` and every method site
        (`embed.attend`: see "What is a site" in the engine docs).

    **Returns:**

    A `LinenModule` called with the module's own arguments.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"from_linen converts a flax.linen.Module, got {type(module).__module__}."
            f"{type(module).__qualname__}"
        )
    if module.scope is not None:
        raise TypeError(
            "from_linen takes the unbound module definition (the object you call "
            "`.init` on), not a bound module"
        )
    if not isinstance(variables, Mapping) or (variables and "params" not in variables):
        raise TypeError(
            "from_linen expects the variables dict that `module.init` returns "
            f"({{'params': ...}}), got {type(variables).__name__} with keys "
            f"{sorted(variables) if isinstance(variables, Mapping) else '-'}"
        )
    return LinenModule(
        variables=_plain(variables),
        rngs=None if rngs is None else dict(rngs),
        definition=_Definition(module),
        mutable=_static_mutable(mutable),
        methods=None if methods is None else tuple(method for method in methods if method not in ("__init__", "setup")),
    )


def _plain(tree: Mapping[str, Any]) -> dict[str, Any]:
    # FrozenDicts become dicts: one pytree structure whichever flax returned.
    return {key: _plain(value) if isinstance(value, Mapping) else value for key, value in tree.items()}
