"""Copying weights between aligned layers of different libraries, exactly or not at all.

Each side's adapter reads its layer as a `Layout` (parameters with named axes; see
`_engine/_layouts.py`) or a `Container` (no parameters of its own); `_layouts.fit`
converts the source's parameters into the destination's axes, checking every axis
by name and size; the destination's adapter writes them. Given example inputs, the
result is then compared with the source layer by layer, and a disagreement raises an
error naming the first diverging layer instead of returning a wrong model.

State beyond parameters (decode caches, position indices) is a layer's `state` layout,
converted by `_layouts.fit_state` and written with the parameters.

Values are read through each library's metadata boxes (linen's `nn.Partitioned`) and
written into the destination's own variables and boxes, which keep their metadata; each
array is placed with the destination's sharding (`_layouts.put_like`). A destination
may be abstract (`nnx.eval_shape`, `jax.eval_shape` of an init): it is read on tracers,
for shapes only, and every one of its arrays must be written.
"""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu

from .._adapters._equinox import equinox_layout, equinox_write, states_in
from .._engine._context import HookContext, Site
from .._engine._errors import HookError, outside_its_vmap, run_on_a_batch
from .._engine._hooking import hooking
from .._engine._layouts import Container, Layout, fit, fit_state, is_abstract, refuse
from .._engine._paths import AbstractConverted, join, key_name, walk
from .._engine._selection import Selection
from ._align import _REPEAT, Alignment, compare


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
        _shape_only(run, model, inputs)
    return policy.modules


def _shape_only(fn: Any, *args: Any) -> Any:
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
class _Side:
    """One model of a transfer: where its layers are, and the Equinox `State` holding
    its BatchNorm statistics (given, or held inside the model)."""

    model: Any
    state: Any
    modules: dict[str, Any]
    held: bool = False
    # Built with `eval_shape`, in whole or in part: read for shapes only.
    abstract: bool = False
    # (model, its modules by path), walked once for every layer located in it.
    walked: tuple[Any, dict[str, Any]] | None = None

    @classmethod
    def make(cls, model: Any, state: Any, inputs: tuple | None) -> "_Side":
        held = states_in(model)
        abstract = bool(_unfilled(model, state))
        if state is None and len(held) == 1:
            return cls(model, held[0], {}, True, abstract).with_modules(inputs)
        return cls(model, state, {}, False, abstract).with_modules(inputs)

    def with_modules(self, inputs: tuple | None) -> "_Side":
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
                layouts[path] = equinox_layout(node, path, parent, field, self.state)
        # A converted model reads its layers together: its adapter may rebuild the
        # library's whole model for a read.
        for prefix, (node, paths_of) in converted.items():
            read = node.read_layers(list(paths_of), self.local_modules(prefix))
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
            new, state = equinox_write(node, path, layer_values, parent, field, self.state)
            if state is not self.state:
                if self.held:
                    self.model = eqx.tree_at(lambda m: states_in(m)[0], self.model, state)
                self.state = state
            self._replace(prefix, node, new)
        for prefix, layers in converted.items():
            node = self.locate(join(prefix, ".".join(next(iter(layers)))))[1]
            self._replace(prefix, node, node.write_layers(layers, self.local_modules(prefix)))

    def _replace(self, prefix: str, node: Any, new: Any) -> None:
        if node is self.model:
            self.model = new
        else:
            self.model = eqx.tree_at(
                lambda m: next(n for p, n in walk(m) if join(*p) == prefix and isinstance(n, eqx.Module)),
                self.model,
                new,
            )


def _read_abstractly(side: _Side, paths: list[str]) -> dict[str, Layout | Container]:
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

    shapes = _shape_only(read, side.model, side.state)
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
    side = _Side.make(model, None, None)
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


def _unfilled(model: Any, state: Any) -> list[str]:
    """The abstract leaves of a model (and its state), by pytree path."""
    leaves = jtu.tree_flatten_with_path({"model": model, "state": state})[0]
    return [".".join(key_name(k) for k in key[1:]) for key, leaf in leaves if is_abstract(leaf)]


def _check_source(path: str, layout: Layout | Container) -> None:
    held = [] if isinstance(layout, Container) else list(layout.params.values())
    held += [] if layout.state is None else list(layout.state.params.values())
    if any(is_abstract(p.value) for p in held):
        raise refuse(path, "the source is abstract (built with eval_shape): it holds no values to copy")


def _check_filled(target: _Side) -> None:
    # An abstract destination's arrays exist only where the transfer wrote them: one
    # left out would be a model that cannot run.
    unfilled = _unfilled(target.model, target.state)
    if unfilled:
        shown = ", ".join(unfilled[:8]) + (f" and {len(unfilled) - 8} more" if len(unfilled) > 8 else "")
        positions = any("cache_index" in path.split(".") for path in unfilled)
        raise HookError(
            f"transfer_params: the destination is abstract and the mapping leaves {len(unfilled)} of its arrays "
            f"without a value: {shown}. Map the layers holding them, or give them values before the transfer "
            "(a library's RNG state is not transferred: a port has no source for it)."
            + (" A module without parameters holding a decode position (a position embedding's cache_index) is "
               "no layer px.align matches: map it by its path (px.port does)." if positions else "")
        )


def _check_parts(path_src: str, path_dst: str, source: Container, target: Container, mapping: dict[str, str]) -> None:
    covered_src = {_REPEAT.sub("", p) for p in mapping}
    covered_dst = {_REPEAT.sub("", p) for p in mapping.values()}
    missing = [join(path_src, p) for p in source.parts if join(path_src, p) not in covered_src]
    missing += [join(path_dst, p) for p in target.parts if join(path_dst, p) not in covered_dst]
    if missing:
        raise refuse(
            path_dst,
            f"it holds no parameters of its own; they are in its parts, and the mapping does not cover {missing}",
        )


def transfer_params(
    src: Any,
    dst: Any,
    mapping: dict[str, str],
    *,
    inputs: Any = None,
    verify: bool = True,
    tolerance: float = 1e-5,
    src_state: eqx.nn.State | None = None,
    dst_state: eqx.nn.State | None = None,
) -> Any:
    """Copy the weights (and BatchNorm statistics, decode caches) of aligned layers from
    one model into another, across libraries, exactly or not at all.

    Every parameter is converted by its named axes (in, out, heads, head_dim, window,
    gates, stack), never reshaped by size: a layer whose layout cannot be matched raises
    an error naming it and the reason. Layers without parameters of their own
    (attention blocks, Sequential/MLP wrappers) are accepted when the mapping covers
    their parts, as `px.align`'s mapping does. An attention layer's decode cache (linen's
    `cache` collection, NNX's `nnx.Cache`s after `init_cache`) and a position
    index (`cache_index`, Haiku state too) go with their layer, by named axes; a
    destination's cache the source lacks starts afresh, and a cache the destination
    cannot hold, or of unknown layout, is an error naming it.

    **Arguments:**

    - `src`: the model to copy from (Equinox, or converted Haiku/NNX).
    - `dst`: the model to copy into (not modified). It may be abstract (built with
        `nnx.eval_shape`, or holding the `jax.eval_shape` of an init): it is filled
        with concrete values, and the mapping must cover every one of its arrays.
        Partitioning metadata (linen's `nn.Partitioned` boxes, NNX variables'
        `out_sharding`) is kept, and every array is placed with the destination's
        sharding (under `jax.set_mesh` where that sharding names mesh axes).
    - `mapping`: `{path in src: path in dst}`, e.g. `px.align(src, dst, x).mapping`
        (`path@n` entries of repeated calls name the same layer as `path`).
    - `inputs`: example input(s) both models accept (one array, or a tuple of
        arguments). The models are run abstractly to learn what stored parameters do
        not tell (a Haiku module's class), and, with `verify`, for real afterwards.
    - `verify`: with `inputs`, compare the two models layer by layer after the transfer
        (`px.compare`) and raise an error naming the first layer that diverges.
    - `tolerance`: as for `px.compare`.
    - `src_state`, `dst_state`: the `eqx.nn.State`s of Equinox models with BatchNorm,
        when the models do not hold them as a field.

    **Returns:**

    A copy of `dst` holding `src`'s weights in those layers; `(dst, dst_state)` when
    `dst_state` is given.
    """
    inputs = None if inputs is None else inputs if isinstance(inputs, tuple) else (inputs,)
    source = _Side.make(src, src_state, inputs)
    target = _Side.make(dst, dst_state, inputs)
    # Repeated calls (`path@n`) name their layer once.
    written: dict[str, str] = {}
    for path_src, path_dst in mapping.items():
        path_src, path_dst = _REPEAT.sub("", path_src), _REPEAT.sub("", path_dst)
        if written.setdefault(path_dst, path_src) != path_src:
            raise refuse(path_dst, f"the mapping gives it two sources, {written[path_dst]!r} and {path_src!r}")
    layouts_src = source.read(list(dict.fromkeys(written.values())))
    layouts_dst = target.read(list(written))
    values_by_path = {}
    for path_dst, path_src in written.items():
        layout_src, layout_dst = layouts_src[path_src], layouts_dst[path_dst]
        _check_source(path_src, layout_src)
        if isinstance(layout_src, Container) and isinstance(layout_dst, Container):
            _check_parts(path_src, path_dst, layout_src, layout_dst, mapping)
            values = {}
        elif isinstance(layout_src, Container) or isinstance(layout_dst, Container):
            what = lambda layout: "a container" if isinstance(layout, Container) else f"a {layout.kind} layer"  # noqa: E731
            raise refuse(
                path_dst,
                f"the source {path_src!r} is {what(layout_src)}, the destination {what(layout_dst)} "
                "(a Haiku module's class is only known from a call: pass inputs=)",
            )
        else:
            values = fit(path_dst, layout_src, layout_dst)
        # A decode cache's names are no parameter's: one write takes both.
        values.update(fit_state(path_dst, layout_src.state, layout_dst.state))
        if values:
            values_by_path[path_dst] = values
    target.write(values_by_path)
    if target.abstract:
        _check_filled(target)
    if inputs is not None and verify:
        with outside_its_vmap("transfer_params(..., inputs=)", run_on_a_batch):
            _verify(src, target.model, mapping, inputs, tolerance)
    return (target.model, target.state) if dst_state is not None else target.model


def _verify(src: Any, dst: Any, mapping: dict[str, str], inputs: tuple, tolerance: float) -> None:
    comparison = compare(src, dst, *inputs, tolerance=tolerance, alignment=Alignment(dict(mapping), (), (), True))
    first = comparison.first_divergence
    if first is not None:
        raise HookError(
            f"transfer_params: after the transfer the models differ first at layer "
            f"{first.path_a!r} -> {first.path_b!r} (max abs difference {first.max_abs:.3g}, "
            f"tolerance {tolerance:g}) on the example inputs: the ports compute differently "
            "there (an activation, an epsilon, a layout of the computation), or that layer's "
            "weights were not in the mapping. Compare with px.compare; verify=False skips this check."
        )
