"""`LinenModule`: a linen module definition and its variables as one `eqx.Module`, and
`from_linen`, which builds it."""

from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

import equinox as eqx
import flax.linen as nn
from jaxtyping import PRNGKeyArray, PyTree

from ..._engine import NO_DECLARATIONS, AbstractConverted, Container, Declarations, Layout, active, float_size, kind_of
from ..._errors import HookError
from .._replace import replace
from ._interception import intercepted, mapping_in_thread
from ._layouts import Mapped, linen_layout, linen_write
from ._variables import Path, plain, subtree_paths, unboxed

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

        if not active():
            return apply()
        return intercepted(self, self.methods, apply)

    def with_variables(self, updates: Mapping[str, Any]) -> "LinenModule":
        """The same model with some collections replaced (e.g. the `updates` a call with
        `mutable=["batch_stats"]` returned).

        **Arguments:**

        - `updates`: `{collection: variables}`.

        **Returns:**

        A copy whose other collections are unchanged.
        """
        return replace(self, variables={**self.variables, **plain(updates)})

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
        return {path: None for tree in self.variables.values() for path in subtree_paths(tree)}

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
        variables = unboxed(self.variables)
        return {local: linen_layout(variables, local, modules or {}, declarations) for local in locals_}

    def detached(self, module: nn.Module) -> "nn.Module | Mapped":
        """An unbound copy of a bound linen module (its submodule attributes too): its
        class and settings without the scope, which holds the call's variables; where it
        runs inside an `nn.map_variables`, only that (`Mapped`): it is not transferred."""
        return Mapped(mapping_in_thread.items[-1]) if mapping_in_thread.items else module.copy(parent=None)

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
        variables = linen_write(self.variables, values, modules or {}, declarations)
        return eqx.tree_at(lambda m: m.variables, self, variables)


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
        variables=plain(variables),
        rngs=None if rngs is None else dict(rngs),
        definition=_Definition(module),
        mutable=_static_mutable(mutable),
        methods=None if methods is None else tuple(method for method in methods if method not in ("__init__", "setup")),
    )
