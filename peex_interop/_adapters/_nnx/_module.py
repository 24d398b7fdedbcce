"""`NnxModule`: an NNX module as an `eqx.Module`, its graph definition static and its
state the pytree's leaves; `from_nnx` and `to_nnx` convert to and from it."""

from typing import Any, ClassVar

import equinox as eqx
import jax.tree_util as jtu
from flax import nnx
from jaxtyping import PyTree

from ..._engine import (
    NO_DECLARATIONS,
    AbstractConverted,
    Container,
    Declarations,
    Layout,
    defines,
    float_size,
    kind_of,
    site_methods,
)
from ..._errors import HookError
from ._graph import Path, modules_by_path
from ._layouts import nnx_layout, nnx_write
from ._routing import routing, with_method_sites

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
        with routing(self, module):
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
            for path, module in modules_by_path(self._merged())
            if path and defines(type(module), "__call__")
        }

    def method_paths(self) -> tuple[Path, ...]:
        """The local paths of the method sites of every submodule (`("embedder",
        "attend")`), the root's included (`("encode",)`)."""
        paths = modules_by_path(self._merged())
        with_methods = set(with_method_sites(type(module) for _, module in paths))
        return tuple(
            (*path, name) for path, module in paths if type(module) in with_methods
            for name in site_methods(type(module), nnx.Module)
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
        found = dict(modules_by_path(self._merged()))
        return {local: nnx_layout(found, local, declarations) for local in locals_}

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
        found = dict(modules_by_path(module))
        for local, layer_values in values.items():
            nnx_write(found, local, layer_values, declarations)
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
