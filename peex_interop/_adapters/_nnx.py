"""The Flax NNX adapter: an NNX module as an `eqx.Module`, its submodule calls as call
sites.

`from_nnx` splits a module into a static graph definition and a state whose arrays are
the pytree leaves. Every call merges a *copy* (`nnx.merge(..., copy=True)`), so the
user's module is never mutated, and runs it. While a hooking context is active in the
calling thread, `__call__` of every NNX module class of the model is replaced for the
duration of the call by one that hands the call to `_context.call_site`, named by the
submodule's NNX path. A submodule is named, in this order:

1. by the path it carries: for the duration of the call every module of the merged
   graph holds its path as a static attribute, which NNX's transforms copy into the
   fresh module objects they hand their bodies (`nnx.vmap`, `nnx.jit`, `nnx.remat`,
   ...), whatever those hold: the same arrays as another layer, no arrays at all, or
   arrays the transform made (split RNG keys, a previous transform's outputs);
2. as a descendant of the module whose call is running (a module attached during the
   call);
3. by its arrays, for a module built during the call from the model's Variables:
   `_context.origin` maps body tracers back to the merged module's arrays, whose NNX
   paths are known, and arrays shared by two layers name neither.
"""

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from flax import nnx
from flax.nnx import bridge
from flax.nnx.nn import attention as nnx_attention  # its `dot_product_attention_weights`
from flax.nnx.spmd import get_var_pspec
from jaxtyping import PyTree

from .._engine import _context, _methods, _patching, _routes, _sown, _threads
from .._engine._declarations import NO_DECLARATIONS, Declarations, Declared, as_stored, at, declare
from .._engine._errors import HookError
from .._engine._kinds import kind_of
from .._engine._layouts import (
    AS_STORED,
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

Path = tuple[str, ...]

# NNX's `dot_product_attention` (the default `attention_fn` of `MultiHeadAttention`)
# forms the weights `(..., heads, q, k)` with its module's
# `dot_product_attention_weights` when it has dropout or sows them, else it calls
# `jax.nn.dot_product_attention` (whose weights site is the engine's, `_attention.py`).
_routes.register_weights_function(nnx_attention.dot_product_attention_weights)

NNX_KINDS: dict[type, str] = {
    nnx.Linear: "linear",
    nnx.LinearGeneral: "linear",
    nnx.Einsum: "linear",
    nnx.Conv: "conv",
    nnx.ConvTranspose: "conv",
    nnx.MultiHeadAttention: "attention",
    nnx.LayerNorm: "norm",
    nnx.BatchNorm: "norm",
    nnx.GroupNorm: "norm",
    nnx.RMSNorm: "norm",
    nnx.InstanceNorm: "norm",
    nnx.Embed: "embedding",
    nnx.Dropout: "dropout",
    nnx.RNNCellBase: "recurrent",
    nnx.RNN: "recurrent",
    nnx.Bidirectional: "recurrent",
    nnx.PReLU: "activation",
    nnx.Sequential: "container",
    nnx.List: "container",
}


class NnxModule(AbstractConverted):
    """A Flax NNX module as an `eqx.Module`: the graph definition is static, the state
    (parameters, batch statistics, RNG keys and counts) is the pytree's leaves. Build
    it with `px.from_nnx`; get a live NNX module back with `px.to_nnx`.

    Calling it calls the NNX module with the same arguments on a copy of the state.
    With `return_state=True` the call returns `(output, updated)`, where `updated` is
    this `NnxModule` holding the state the call left behind (BatchNorm statistics,
    advanced RNG counts); otherwise state updates are dropped, as in any pure function.
    """

    graphdef: nnx.GraphDef = eqx.field(static=True)
    state: nnx.State
    return_state: bool = eqx.field(static=True, default=False)
    sows: ClassVar[bool] = True

    def __call__(self, *args: Any, **kwargs: Any) -> PyTree:
        """Run the NNX module on a copy of this state.

        **Arguments:**

        - `*args`, `**kwargs`: the NNX module's own arguments.

        **Returns:**

        The module's output; with `return_state=True`, `(output, updated)`.
        """
        module = self._merged()
        with _routing(self, module):
            output = module(*args, **kwargs)
        if not self.return_state:
            return output
        return output, self._updated(module)

    def layers(self) -> dict[Path, nnx.Module]:
        """NNX path -> submodule, for `where=` validation and `px.module_paths`.

        **Returns:**

        Every callable submodule of the NNX module (containers such as `nnx.List`
        are not layers), by path (tuple of str); the root is not included.
        """
        return {
            path: module
            for path, module in _paths(self._merged())
            if path and _patching.defines(type(module), "__call__")
        }

    def method_paths(self) -> tuple[Path, ...]:
        """The local paths of the method sites of every submodule (`("embedder",
        "attend")`), the root's included (`("encode",)`)."""
        paths = _paths(self._merged())
        with_methods = set(_with_methods(type(module) for _, module in paths))
        return tuple(
            (*path, name) for path, module in paths if type(module) in with_methods
            for name in _methods.site_methods(type(module), nnx.Module)
        )

    def parameter_counts(self) -> tuple[int, int]:
        """`(trainable, non_trainable)`: sizes of the `nnx.Param` arrays, and of the
        other float arrays (BatchNorm statistics); RNG keys and counts are not counted."""
        return _parameter_counts(self.state)

    def layer_parameter_counts(self, module: nnx.Module) -> tuple[int, int]:
        """As `parameter_counts`, for one submodule during its call (one layer of a
        scanned stack)."""
        return _parameter_counts(nnx.state(module))

    def layer_kind(self, module: nnx.Module) -> str:
        """The library-independent kind (`px.KINDS`) of an NNX submodule."""
        return kind_of(module, NNX_KINDS)

    def read_layer(
        self, local: Path, modules: dict | None = None, declarations: Declarations = NO_DECLARATIONS
    ) -> Layout | Container:
        """The parameters (and BatchNorm statistics) of the submodule at `local`, in
        named axes (`_engine/_layouts.py`). NNX modules exist outside calls: `modules`
        adds nothing."""
        return self.read_layers([local], None, declarations)[local]

    def read_layers(
        self, locals_: list[Path], modules: dict | None = None, declarations: Declarations = NO_DECLARATIONS
    ) -> dict[Path, Layout | Container]:
        """`read_layer` of several submodules, from one merged module."""
        found = dict(_paths(self._merged()))
        return {local: _nnx_layout(found, local, declarations) for local in locals_}

    # NNX modules exist outside calls: their classes and settings are in the graph.
    layouts_need_calls = False

    def detached(self, module: nnx.Module) -> None:
        """`None`: `read_layer` reads the NNX modules themselves, and a module seen
        during a call holds that call's arrays."""
        return None

    def write_layer(
        self, local: Path, values: dict[str, Any], modules: dict | None = None,
        declarations: Declarations = NO_DECLARATIONS,
    ) -> "NnxModule":
        """A copy with `values` (from `_layouts.fit`) in the submodule at `local`."""
        return self.write_layers({local: values}, None, declarations)

    def write_layers(
        self, values: dict[Path, dict[str, Any]], modules: dict | None = None,
        declarations: Declarations = NO_DECLARATIONS,
    ) -> "NnxModule":
        """`write_layer` of several submodules (local path -> values), into one merged
        module split once: merging and splitting walk the whole graph."""
        module = self._merged()
        found = dict(_paths(module))
        for local, layer_values in values.items():
            _nnx_write(found, local, layer_values, declarations)
        return self._updated(module)

    def carried(self, returned: Any) -> tuple[Any, "NnxModule"]:
        """`(output, model)` from what a call with `return_state=True` returned: the
        model holding the variables the call left (a decode cache one position on), as
        a live NNX module carries them in place."""
        if not self.return_state:
            raise HookError(
                "this NNX model's calls drop their state updates: convert it with "
                "px.from_nnx(module, return_state=True)"
            )
        return returned

    def train(self, **attributes: Any) -> "NnxModule":
        """The NNX `module.train()`, functionally.

        **Arguments:**

        - `**attributes`: further attributes to set, as for `nnx.Module.train`.

        **Returns:**

        A copy with `deterministic=False` and `use_running_average=False` wherever a
        submodule has them (Dropout and BatchNorm in training mode).
        """
        return self._in_mode("train", attributes)

    def eval(self, **attributes: Any) -> "NnxModule":
        """The NNX `module.eval()`, functionally.

        **Arguments:**

        - `**attributes`: further attributes to set, as for `nnx.Module.eval`.

        **Returns:**

        A copy with `deterministic=True` and `use_running_average=True` wherever a
        submodule has them.
        """
        return self._in_mode("eval", attributes)

    def _in_mode(self, mode: str, attributes: dict[str, Any]) -> "NnxModule":
        module = self._merged()
        getattr(module, mode)(**attributes)
        return self._updated(module)

    def _updated(self, module: nnx.Module) -> "NnxModule":
        return _convert(module, self.return_state, self.graphdef)

    def _merged(self) -> nnx.Module:
        # Without copy=True the merged module would share Variable objects with this
        # state: eager calls would mutate it, traced ones raise TraceContextError.
        return nnx.merge(self.graphdef, self.state, copy=True)


def _parameter_counts(state: nnx.State) -> tuple[int, int]:
    trainable = other = 0
    for variable in jtu.tree_leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        # What a call sows (`Module.sow`: an `nnx.Intermediate` holding a tuple of the
        # values sown; `perturb`'s probes) is an output, not a parameter: as linen's
        # `intermediates` collection, not counted.
        if isinstance(variable, nnx.Intermediate):
            continue
        # A variable's value may be any pytree: its floating-point arrays count.
        size = float_size(variable.get_value())
        if isinstance(variable, nnx.Param):
            trainable += size
        else:
            other += size
    return trainable, other


def _convert(module: nnx.Module, return_state: bool, previous: nnx.GraphDef | None = None) -> NnxModule:
    graphdef, state = nnx.split(module)
    # jit compares a call's static fields with the cached call's by `==`, and GraphDef
    # equality walks the whole graph (tens of µs per call): a module updated by a call
    # (`return_state=True`, BatchNorm training) keeps the very GraphDef it came with,
    # so every later call compares it by identity.
    if previous is not None and graphdef == previous:
        graphdef = previous
    # split returns the module's own Variable objects; rebuilding the tree gives new
    # ones, so later changes to the live module cannot reach the converted one.
    return NnxModule(graphdef, jtu.tree_map(lambda x: x, state), return_state)


def from_nnx(module: nnx.Module, *, return_state: bool = False) -> NnxModule:
    """Convert a Flax NNX module into an `eqx.Module` that every hook wrapper accepts.

    **Arguments:**

    - `module`: the NNX module (it is copied and never mutated).
    - `return_state`: if `True`, calls return `(output, updated)` so that state updates
        (BatchNorm statistics, RNG counts) can be carried forward.

    **Returns:**

    An `NnxModule` called with the module's own arguments. Its layers are the NNX
    submodules, by dotted NNX path (`blocks.0.lin`).
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"from_nnx converts a flax.nnx.Module, got {type(module).__module__}."
            f"{type(module).__qualname__}"
        )
    return _convert(module, return_state)


def to_nnx(converted: NnxModule) -> nnx.Module:
    """A live NNX module holding the converted module's current state (e.g. after
    training it with `eqx.filter_grad` and optax).

    **Arguments:**

    - `converted`: an `NnxModule`.

    **Returns:**

    A new NNX module; it shares no Variable with `converted` or with the module it was
    converted from.
    """
    return converted._merged()


# -- naming submodules during a call -------------------------------------------------
def _paths(root: nnx.Module) -> list[tuple[Path, nnx.Module]]:
    # iter_modules yields a shared module once, under its first path.
    return [(_as_path(path), module) for path, module in nnx.iter_modules(root)]


def _as_path(parts: Iterable[Any]) -> Path:
    return tuple(str(part) for part in parts)


def _variables(node: nnx.Module) -> Iterable[tuple[Path, Any]]:
    for path, value in nnx.graph.iter_graph(node):
        if isinstance(value, nnx.Variable):
            yield _as_path(path), value.get_value()


# The static attribute by which a module of a hooked call carries its NNX path through
# NNX's transforms: they split their module arguments into a graph definition, which
# holds static attributes by value, and merge fresh objects from it inside the body.
# One attribute per depth of nested calls, so that a module of an enclosing call is no
# module of this one; the name and value stay the same from call to call, so that
# JAX's caches keyed on graph definitions keep hitting.
_PATH = "_peex_interop_path_{depth}"


@dataclasses.dataclass(eq=False)
class _Call:
    """One hooked call of one `NnxModule`: how its submodules are named."""

    owner: NnxModule
    root: nnx.Module
    # The merged modules by id, held so that no id is reused during the call.
    merged: dict[int, nnx.Module]
    attribute: str
    running: list[tuple[nnx.Module, Path]] = dataclasses.field(default_factory=list)
    arrays: dict[int, tuple[Any, list[Path]]] = dataclasses.field(default_factory=dict)

    def path_of(self, module: nnx.Module) -> Path:
        path = vars(module).get(self.attribute)
        if path is not None:
            if self.merged.get(id(module)) is not module and not self._traced_back(module):
                # A copy whose arrays do not come from the model through a threaded
                # transform: one that an unthreaded transform (a while_loop carry)
                # received must not run unhooked.
                self._refuse_if_passed_through(module)
            return path
        path = self._as_descendant(module)
        if path is None:
            path = self._by_arrays(module)
        if path is None:
            self._refuse_if_passed_through(module)
            raise HookError(self._unnamed(module))
        return path

    def _as_descendant(self, module: nnx.Module) -> Path | None:
        if not self.running:
            return None
        parent, parent_path = self.running[-1]
        for relative, node in nnx.graph.iter_graph(parent):
            if node is module:
                return parent_path + _as_path(relative)
        return None

    def _traced_back(self, module: nnx.Module) -> bool:
        return any(self._array_paths(_context.origin(value)) for _, value in _variables(module))

    def _by_arrays(self, module: nnx.Module) -> Path | None:
        # Every array that comes from the model must place the module at one path.
        candidates: set[Path] | None = None
        for relative, value in _variables(module):
            found = {
                path[: -len(relative)]
                for path in self._array_paths(_context.origin(value))
                if path[-len(relative) :] == relative
            }
            if found:
                candidates = found if candidates is None else candidates & found
        if not candidates:
            return None
        if len(candidates) > 1:
            paths = ", ".join(sorted(repr(".".join(path)) for path in candidates))
            raise HookError(
                f"cannot name the {type(module).__name__} called from NNX path {self._caller()!r}: "
                f"it was built during the call from arrays that the layers {paths} all hold, "
                "so it could be any of them. Call the model's own submodules, or give each "
                "layer its own arrays."
            )
        return candidates.pop()

    def _array_paths(self, array: Any) -> list[Path]:
        # Eager calls replace arrays as they go (BatchNorm statistics, RNG counts):
        # index the root's current values again before giving up. The index holds the
        # values, so that a replaced array's id cannot name a new one.
        if self.arrays.get(id(array), (None,))[0] is not array:
            self.arrays = {}
            for path, value in _variables(self.root):
                self.arrays.setdefault(id(value), (value, []))[1].append(path)
        return self.arrays.get(id(array), (None, []))[1]

    def _refuse_if_passed_through(self, module: nnx.Module) -> None:
        _context.refuse_if_passed_through(type(module).__name__, [v for _, v in _variables(module)])

    def _caller(self) -> str:
        return ".".join(self.running[-1][1]) if self.running else ""

    def _unnamed(self, module: nnx.Module) -> str:
        return (
            f"cannot name the {type(module).__name__} called from NNX path {self._caller()!r}: "
            "it is not a submodule of the converted model, and none of its arrays "
            "comes from the model's state through a transform peex_interop threads "
            "(a module created during the call, or an NNX transform built before "
            "hooking began, e.g. nnx.vmap/nnx.remat applied at import time). Create "
            "submodules in __init__ and apply NNX transforms inside __call__."
        )


# The NNX calls in progress in this thread, innermost last.
_calls = _threads.ThreadStack()


def _route(original: Callable, module: nnx.Module, args: tuple, kwargs: dict) -> Any:
    return _route_method(original, module, None, args, kwargs)


def _route_method(original: Callable, module: nnx.Module, method: str | None, args: tuple, kwargs: dict) -> Any:
    calls = _calls.items
    if not calls or not _context.active():
        return original(module, *args, **kwargs)
    call = calls[-1]
    path = call.path_of(module)
    call.running.append((module, path))
    try:
        return _context.call_site(
            call.owner, functools.partial(original, module), args, kwargs,
            local=path, module=module, member=method,
        )
    finally:
        call.running.pop()


def _locate(module: nnx.Module) -> tuple[NnxModule, Path] | None:
    """The converted model and path of a module sowing during this thread's hooked
    call (`_engine/_sown.py`), or `None` outside one."""
    calls = _calls.items
    if not calls or not _context.active():
        return None
    return calls[-1].owner, calls[-1].path_of(module)


def _with_methods(types: Iterable[type]) -> list[type]:
    # `nnx.List` and `nnx.Dict` are containers: `append` and `get` are not computations.
    return [cls for cls in types if not issubclass(cls, (nnx.List, nnx.Dict))]


@contextlib.contextmanager
def _routing(owner: NnxModule, root: nnx.Module) -> Iterator[None]:
    """While hooking is active in this thread, route the NNX submodule calls of one
    `NnxModule` call to call sites; otherwise a plain call costs nothing."""
    if not _context.active():
        yield
        return
    paths = _paths(root)
    calls = _calls.items
    call = _Call(owner, root, {id(module): module for _, module in paths}, _PATH.format(depth=len(calls)))
    types = {type(module) for _, module in paths}
    try:
        for path, module in paths:
            # `bridge.ToNNX` reads every attribute of its own as a linen variable: it is
            # named as a descendant of the module calling it instead.
            if not isinstance(module, bridge.ToNNX):
                setattr(module, call.attribute, path)
        patches = [
            *_patching.call_patches(types, _route),
            *_methods.method_call_patches(_with_methods(types), nnx.Module, _route_method),
            *_sown.sown_patches(nnx.Module, _locate),
        ]
        with _patching.patched(patches):
            calls.append(call)
            try:
                yield
            finally:
                calls.remove(call)
    finally:
        # The path leaves with the call: the module's graph definition (what
        # `return_state=True` and `px.to_nnx` split again) is the model's own. A
        # transform may have put new module objects in the graph.
        for module in [*call.merged.values(), *(module for _, module in nnx.iter_modules(root))]:
            if call.attribute in vars(module):
                delattr(module, call.attribute)


# -- parameter layouts (px.transfer_params) ------------------------------------------
# NNX's facts: kernels are (in, out) / (*window, in / groups, out); attention
# projections are `LinearGeneral`s with (in, heads, head_dim) and (heads, head_dim, out)
# kernels; a norm's shift is called `bias`; BatchNorm statistics are `BatchStat`s on
# the module; an `LSTMCell` holds one `Linear` per gate and side (input projections
# without bias), a `GRUCell` one per side with gates (r, z, n) and no recurrent bias.
# Each layer's layout is a `Declared` (`_engine/_declarations.py`), as a user's own:
# each parameter is read from the attributes it is stacked from (one attribute: the
# value itself).

_ATTENTION_INPUTS = ("query", "key", "value")
_LSTM_GATES = ("i", "f", "g", "o")


def _lstm_attributes(side: str, name: str) -> tuple[str, ...]:
    # NNX names the forget gate `if_` / `hf` (`if` is a keyword).
    return tuple(f"{side}{gate}{'_' if side == 'i' and gate == 'f' else ''}.{name}" for gate in "ifgo")


def _built_in(layer: nnx.Module, parent: nnx.Module | None, attr: str) -> Declared | None:
    """The layout of one of NNX's own layers, `None` for another."""
    if isinstance(layer, nnx.LinearGeneral) and isinstance(parent, nnx.MultiHeadAttention):
        if attr in _ATTENTION_INPUTS:
            return declare(
                "attention_in", kernel=at("kernel", "in", "heads", "head_dim"), bias=at("bias", "heads", "head_dim")
            )
        if attr == "out":
            return declare("attention_out", kernel=at("kernel", "heads", "head_dim", "out"), bias=at("bias", "out"))
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
            "lstm", members={"gate": _LSTM_GATES},
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


def _nnx_layout(modules: dict[Path, nnx.Module], local: Path, declarations: Declarations) -> Layout | Container:
    path = ".".join(local)
    layer, parent = _find(modules, local)
    cache = _cache_spec(layer, path)
    state = None
    if cache:
        state = Layout("decode_cache", {name: placed(_value(layer, a), ax) for name, (a, ax) in cache.items()})
    if not _own_arrays(layer, cache) and not isinstance(layer, (nnx.LSTMCell, nnx.GRUCell)):
        parts = [".".join(p) for p, m in _paths(layer) if p and any(isinstance(v, nnx.Param) for v in vars(m).values())]
        if parts or state is not None:
            return Container(tuple(parts), state)
    if isinstance(parent, (nnx.WeightNorm, nnx.SpectralNorm)):
        # Scaled to unit norm, or divided by its spectral norm.
        wrapper = type(parent).__name__
        raise refuse_reparametrised(path, f"its parameters are reparametrised by the {wrapper} holding it")
    declared = _nnx_spec(layer, parent, local[-1] if local else "", path, declarations)
    # An nnx.LoRALinear is a Linear whose `lora` adds to its output; a layer read as
    # stored holds its own arrays, its submodules being layers of their own.
    below = _paths(layer) if declared.kind != AS_STORED else [((), layer)]
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


def _nnx_write(
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
