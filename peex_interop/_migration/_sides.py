"""Each model of a transfer as a `Side`: where its layers are, how each adapter reads
their parameters in named axes (`_engine/_layouts.py`, with the user's declarations,
`_engine/_declarations.py`) and writes converted values back, on arrays or, for an
abstract model, on shapes alone."""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu

from .._adapters import equinox_layout, equinox_write, states_in
from .._engine import (
    NO_DECLARATIONS,
    AbstractConverted,
    Container,
    Declarations,
    HookContext,
    Layout,
    Selection,
    Site,
    hooking,
    is_abstract,
    join,
    key_name,
    walk,
)
from .._errors import HookError, outside_its_vmap, run_on_a_batch


class _Modules:
    """A policy that records the module object behind every call site's path of a
    converted model, as its adapter keeps it (`AbstractConverted.detached`)."""

    selection = Selection()

    def __init__(self):
        self.modules: dict[str, Any] = {}

    def run_site(self, context: HookContext, site: Site) -> Any:
        # Only a converted model's modules tell what its stored parameters do not (an
        # Equinox layer is read from the model itself), and the abstract run's modules
        # hold its tracers: kept as they are past the run, they would leak.
        converted = isinstance(site.owner, AbstractConverted) and site.owner is not site.module
        if converted and site.path not in self.modules:
            module = site.owner.detached(site.module)
            if module is not None:
                self.modules[site.path] = module
        return site.call(*site.args, **site.kwargs)


def _called_modules(model: Any, inputs: tuple) -> dict[str, Any]:
    policy = _Modules()

    def run(model, inputs):
        with hooking(model, policy) as context:
            return context.root(*inputs)

    with outside_its_vmap("transfer_params(..., inputs=)", run_on_a_batch):
        shape_only(run, model, inputs)
    return policy.modules


def shape_only(fn: Any, *args: Any) -> Any:
    """`eqx.filter_eval_shape(fn, *args)` for arguments that may be abstract: their
    `jax.ShapeDtypeStruct` leaves are traced as the arrays they stand for, not kept as
    constants that no library can compute with."""
    is_dynamic = lambda x: eqx.is_array(x) or is_abstract(x)  # noqa: E731
    dynamic, static = eqx.partition(args, is_dynamic)
    kept = []

    def run(dynamic: Any) -> Any:
        out_dynamic, out_static = eqx.partition(fn(*eqx.combine(dynamic, static)), eqx.is_array)
        kept.append(out_static)
        return out_dynamic

    shapes = jax.eval_shape(run, dynamic)
    return eqx.combine(shapes, kept[0])


@dataclasses.dataclass
class Side:
    """One model of a transfer: where its layers are, and the Equinox `State` holding
    its BatchNorm statistics (given, or held inside the model)."""

    model: Any
    state: Any
    modules: dict[str, Any]
    declarations: Declarations
    held: bool = False
    # Built with `eval_shape`, in whole or in part: read for shapes only.
    abstract: bool = False
    # (model, its modules by path), walked once for every layer located in it.
    walked: tuple[Any, dict[str, Any]] | None = None

    @classmethod
    def make(
        cls, model: Any, state: Any, inputs: tuple | None, declarations: Declarations = NO_DECLARATIONS
    ) -> "Side":
        held = states_in(model)
        abstract = bool(unfilled(model, state))
        if state is None and len(held) == 1:
            return cls(model, held[0], {}, declarations, True, abstract).with_modules(inputs)
        return cls(model, state, {}, declarations, False, abstract).with_modules(inputs)

    def with_modules(self, inputs: tuple | None) -> "Side":
        # Only converted models keep facts outside their layers' objects, and not all.
        converted = any(
            isinstance(node, AbstractConverted) and node.layouts_need_calls for _, node in walk(self.model)
        )
        self.modules = _called_modules(self.model, inputs) if inputs is not None and converted else {}
        return self

    def locate(self, path: str) -> tuple[str, Any, tuple[str, ...], Any, str | None]:
        """(prefix, node, local, parent, field): the Equinox layer at `path` (local
        `()`, with the module holding it), or the converted model holding it."""
        if self.walked is None or self.walked[0] is not self.model:
            found = {join(*key_path): node for key_path, node in walk(self.model) if isinstance(node, eqx.Module)}
            self.walked = (self.model, found)
        nodes = self.walked[1]
        for prefix, node in nodes.items():
            if isinstance(node, AbstractConverted) and (not prefix or path.startswith(prefix + ".")):
                return prefix, node, tuple(path.removeprefix(prefix).lstrip(".").split(".")), None, None
        if path not in nodes or not path:
            raise HookError(f"transfer_params: no layer {path!r} in {type(self.model).__name__}")
        above = [p for p in nodes if p != path and (not p or path.startswith(p + "."))]
        parent = max(above, key=len) if above else None
        field = path.removeprefix(parent).lstrip(".").split(".")[0] if parent is not None else None
        return path, nodes[path], (), None if parent is None else nodes[parent], field

    def local_modules(self, prefix: str) -> dict[tuple[str, ...], Any]:
        if not prefix:
            return {tuple(p.split(".")): m for p, m in self.modules.items()}
        return {
            tuple(p[len(prefix) + 1 :].split(".")): m for p, m in self.modules.items() if p.startswith(prefix + ".")
        }

    def read(self, paths: list[str]) -> dict[str, Layout | Container]:
        """The `Layout` (or `Container`) of the layer at each of `paths`; of an abstract
        model, with `jax.ShapeDtypeStruct` values."""
        return _read_abstractly(self, paths) if self.abstract else self._read(paths)

    def _read(self, paths: list[str]) -> dict[str, Layout | Container]:
        layouts, converted = {}, {}
        for path in paths:
            prefix, node, local, parent, field = self.locate(path)
            if local:
                converted.setdefault(prefix, (node, {}))[1][local] = path
            else:
                layouts[path] = equinox_layout(node, path, parent, field, self.state, self.declarations)
        # A converted model reads its layers together: its adapter may rebuild the
        # library's whole model for a read.
        for prefix, (node, paths_of) in converted.items():
            read = node.read_layers(list(paths_of), self.local_modules(prefix), self.declarations.under(prefix))
            layouts.update({paths_of[local]: layout for local, layout in read.items()})
        return {path: layouts[path] for path in paths}

    def write(self, values: dict[str, dict[str, Any]]) -> None:
        """Write `values` (layer path -> `fit`'s values) into the model, each converted
        model's layers in one write."""
        converted: dict[str, dict[tuple[str, ...], dict[str, Any]]] = {}
        for path, layer_values in values.items():
            prefix, node, local, parent, field = self.locate(path)
            if local:
                converted.setdefault(prefix, {})[local] = layer_values
                continue
            new, state = equinox_write(node, path, layer_values, parent, field, self.state, self.declarations)
            if state is not self.state:
                if self.held:
                    self.model = eqx.tree_at(lambda m: states_in(m)[0], self.model, state)
                self.state = state
            self._replace(prefix, node, new)
        for prefix, layers in converted.items():
            node = self.locate(join(prefix, ".".join(next(iter(layers)))))[1]
            written = node.write_layers(layers, self.local_modules(prefix), self.declarations.under(prefix))
            self._replace(prefix, node, written)

    def _replace(self, prefix: str, node: Any, new: Any) -> None:
        if node is self.model:
            self.model = new
        else:
            self.model = eqx.tree_at(
                lambda m: next(n for p, n in walk(m) if join(*p) == prefix and isinstance(n, eqx.Module)),
                self.model,
                new,
            )


def _read_abstractly(side: Side, paths: list[str]) -> dict[str, Layout | Container]:
    # On tracers every adapter's reading works as on arrays (an LSTM's kernel sliced
    # into its gates, gates stacked): only the shapes and dtypes come back. One shape
    # pass reads every layer: each pass flattens and traces the whole model.
    read_layouts = []

    def values(layout: Layout | None) -> dict[str, Any]:
        return {} if layout is None else {name: p.value for name, p in layout.params.items()}

    def read(model: Any, state: Any) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
        layouts = dataclasses.replace(side, model=model, state=state)._read(paths)
        read_layouts.append(layouts)
        return {
            path: (values(None if isinstance(layout, Container) else layout), values(layout.state))
            for path, layout in layouts.items()
        }

    def filled(layout: Layout | None, shapes: dict[str, Any]) -> Any:
        if layout is None:
            return None
        params = {name: dataclasses.replace(p, value=shapes[name]) for name, p in layout.params.items()}
        return dataclasses.replace(layout, params=params)

    shapes = shape_only(read, side.model, side.state)
    filled_layouts = {}
    for path, layout in read_layouts[0].items():
        params, state = shapes[path]
        if isinstance(layout, Container):
            filled_layouts[path] = dataclasses.replace(layout, state=filled(layout.state, state))
        else:
            filled_layouts[path] = dataclasses.replace(filled(layout, params), state=filled(layout.state, state))
    return filled_layouts


def state_only(model: Any, paths: list[str]) -> list[str]:
    """The layers among `paths` that hold state and no parameters (a position
    embedding's decode index): of no layer kind `px.align` matches, `px.port` carries
    them by path."""
    side = Side.make(model, None, None)
    found = []
    for path in paths:
        # Read as stored, not in a shape pass: a layer without parameters has nothing
        # to slice or stack, and an abstract one reads as its `ShapeDtypeStruct`s.
        try:
            layout = side._read([path])[path]
        except HookError:
            # A layer no adapter reads (an activation, a dropout with its RNG streams)
            # holds nothing a transfer carries.
            continue
        if isinstance(layout, Container) and not layout.parts and layout.state is not None:
            found.append(path)
    return found


def unfilled(model: Any, state: Any) -> list[str]:
    """The abstract leaves of a model (and its state), by pytree path."""
    leaves = jtu.tree_flatten_with_path({"model": model, "state": state})[0]
    return [".".join(key_name(k) for k in key[1:]) for key, leaf in leaves if is_abstract(leaf)]
