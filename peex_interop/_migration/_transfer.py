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

from collections.abc import Mapping
from typing import Any

import equinox as eqx

from .._engine import (
    Container,
    Declarations,
    Layout,
    fit,
    fit_state,
    is_abstract,
    join,
    member_axis,
    member_of,
    merged_members,
    refuse,
)
from .._errors import HookError, outside_its_vmap, run_on_a_batch
from .._optional import needs
from ._align import called_alignment
from ._alignment import REPEAT
from ._compare import compare
from ._sides import Side, unfilled


def _check_source(path: str, layout: Layout | Container) -> None:
    held = [] if isinstance(layout, Container) else list(layout.params.values())
    held += [] if layout.state is None else list(layout.state.params.values())
    if any(is_abstract(p.value) for p in held):
        raise refuse(path, "the source is abstract (built with eval_shape): it holds no values to copy")


def _check_filled(target: Side, whole: bool) -> None:
    # An abstract destination's arrays exist only where the transfer wrote them: one
    # left out would be a model that cannot run. A whole port (`whole`: its destination
    # marked abstract) must write every array: one left out keeps the destination's own
    # weights, and the port would not be the source.
    empty = unfilled(target.model, target.state)
    if empty:
        shown = ", ".join(empty[:8]) + (f" and {len(empty) - 8} more" if len(empty) > 8 else "")
        positions = any("cache_index" in path.split(".") for path in empty)
        what = (
            "px.port: the mapping leaves {} of the destination's arrays without the source's values"
            if whole else "transfer_params: the destination is abstract and the mapping leaves {} of its arrays "
            "without a value"
        ).format(len(empty))
        raise HookError(
            f"{what}: {shown}. Map the layers holding them, or give them values before the transfer "
            "(a library's RNG state is not transferred: a port has no source for it)."
            + (" A module without parameters holding a decode position (a position embedding's cache_index) is "
               "no layer px.align matches: map it by its path (px.port does)." if positions else "")
        )


def _check_parts(path_src: str, path_dst: str, source: Container, target: Container, mapping: dict) -> None:
    covered_src, covered_dst = flat_paths(mapping)
    missing = [join(path_src, p) for p in source.parts if join(path_src, p) not in covered_src]
    missing += [join(path_dst, p) for p in target.parts if join(path_dst, p) not in covered_dst]
    missing = list(dict.fromkeys(missing))
    if missing:
        raise refuse(
            path_dst,
            f"it holds no parameters of its own; they are in its parts, and the mapping does not cover {missing}",
        )


MappingKey = str | tuple[str, ...]


def entries(mapping: dict[MappingKey, MappingKey]) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """`(source paths, destination paths)` of each entry of a mapping, `path@n` of a
    repeated call naming its layer: one path each, or several on one side (the layers
    one fused layer of the other side holds)."""
    found, sources_of = [], {}
    for key, value in mapping.items():
        paths_src = tuple(REPEAT.sub("", p) for p in ((key,) if isinstance(key, str) else key))
        paths_dst = tuple(REPEAT.sub("", p) for p in ((value,) if isinstance(value, str) else value))
        if not paths_src or not paths_dst or (len(paths_src) > 1 and len(paths_dst) > 1):
            raise HookError(
                f"transfer_params: the mapping entry {key!r}: {value!r} maps {len(paths_src)} layers to "
                f"{len(paths_dst)}: an entry maps one layer to one, or one fused layer to several (a tuple of paths)"
            )
        for path_dst in paths_dst:
            if sources_of.setdefault(path_dst, paths_src) != paths_src:
                raise refuse(path_dst, f"the mapping gives it two sources, {sources_of[path_dst]!r} and {paths_src!r}")
        if (paths_src, paths_dst) not in found:
            found.append((paths_src, paths_dst))
    return found


def flat_paths(mapping: dict[MappingKey, MappingKey]) -> tuple[set[str], set[str]]:
    """Every layer of the source and of the destination the mapping names."""
    pairs = entries(mapping)
    return {p for ps, _ in pairs for p in ps}, {p for _, ps in pairs for p in ps}


def transfer_params(
    src: Any,
    dst: Any,
    mapping: dict[MappingKey, MappingKey],
    *,
    inputs: Any = None,
    verify: bool = True,
    tolerance: float = 1e-5,
    src_state: eqx.nn.State | None = None,
    dst_state: eqx.nn.State | None = None,
    layouts: Mapping[Any, Any] | None = None,
    progress: bool = False,
) -> Any:
    """Copy the weights (and BatchNorm statistics, decode caches) of aligned layers from
    one model into another, across libraries, exactly or not at all.

    Every parameter is converted by its named axes (in, out, heads, head_dim, window,
    gates, stack), never reshaped by size: a layer whose layout cannot be matched raises
    an error naming it and the reason. A layer of no known layout (a model's own layer
    class) is copied array by array into one holding the same names and shapes (another
    instance of its class), and refused otherwise, unless `layouts=` declares its axes.
    Layers without parameters of their own (attention blocks, Sequential/MLP wrappers)
    are accepted when the mapping covers their parts, as `px.align`'s mapping does. An
    attention layer's decode cache (linen's `cache` collection, NNX's `nnx.Cache`s
    after `init_cache`) and a position index (`cache_index`, Haiku state too) go with
    their layer, by named axes; a destination's cache the source lacks starts afresh,
    and a cache the destination cannot hold, or of unknown layout, is an error naming
    it.

    **Arguments:**

    - `src`: the model to copy from (Equinox, or converted Haiku/NNX).
    - `dst`: the model to copy into (not modified). It may be abstract (built with
        `nnx.eval_shape`, or holding the `jax.eval_shape` of an init): it is filled
        with concrete values, and the mapping must cover every one of its arrays.
        Partitioning metadata (linen's `nn.Partitioned` boxes, NNX variables'
        `out_sharding`) is kept, and every array is placed with the destination's
        sharding (under `jax.set_mesh` where that sharding names mesh axes).
    - `mapping`: `{path in src: path in dst}`, e.g. `px.align(src, dst, x).mapping`
        (`path@n` entries of repeated calls name the same layer as `path`). One side of
        an entry may be a tuple of paths: the layers one fused layer of the other model
        holds, in the order of the members of its declared axis (`{("q_proj",
        "k_proj", "v_proj"): "qkv_einsum"}`, with `members={"qkv": ("q", "k", "v")}`).
    - `inputs`: example input(s) both models accept (one array, or a tuple of
        arguments). The models are run abstractly to learn what stored parameters do
        not tell (a Haiku module's class), and, with `verify`, for real afterwards.
    - `verify`: with `inputs`, compare the two models layer by layer after the transfer
        (`px.compare`) and raise an error naming the first layer that diverges.
    - `tolerance`: as for `px.compare`.
    - `src_state`, `dst_state`: the `eqx.nn.State`s of Equinox models with BatchNorm,
        when the models do not hold them as a field.
    - `layouts`: the layouts of layers the libraries do not know, `{class or path
        pattern: px.declare(...)}` or a function of the layer returning one (or `None`
        for the library's own); they apply to both models, before the libraries' own.
    - `progress`: show a tqdm progress bar over the layers converted (needs `tqdm`).

    **Returns:**

    A copy of `dst` holding `src`'s weights in those layers; `(dst, dst_state)` when
    `dst_state` is given. `dst` itself is never modified, also when the transfer is
    interrupted.
    """
    inputs = None if inputs is None else inputs if isinstance(inputs, tuple) else (inputs,)
    target = ported_side(src, dst, mapping, inputs, src_state, dst_state, Declarations.of(layouts), progress)
    if inputs is not None and verify:
        with outside_its_vmap("transfer_params(..., inputs=)", run_on_a_batch):
            _verify(src, target.model, mapping, inputs, tolerance)
    return (target.model, target.state) if dst_state is not None else target.model


def ported_side(
    src: Any,
    dst: Any,
    mapping: dict[MappingKey, MappingKey],
    inputs: tuple | None,
    src_state: Any,
    dst_state: Any,
    declarations: Declarations,
    progress: bool,
    whole: bool = False,
) -> Side:
    """The destination side after the transfer (`transfer_params` without its check).
    An abstract destination must have every array written: `whole`, a port's, whose
    destination is marked abstract for that (`px.port`)."""
    source = Side.make(src, src_state, inputs, declarations)
    target = Side.make(dst, dst_state, inputs, declarations)
    pairs = entries(mapping)
    layouts_src = source.read(list(dict.fromkeys(p for paths, _ in pairs for p in paths)))
    layouts_dst = target.read(list(dict.fromkeys(p for _, paths in pairs for p in paths)))
    values_by_path = {}
    for paths_src, paths_dst in _progress(pairs, progress):
        for path_src in paths_src:
            _check_source(path_src, layouts_src[path_src])
        if len(paths_src) == len(paths_dst) == 1:
            values_by_path[paths_dst[0]] = _one_to_one(
                paths_src[0], paths_dst[0], layouts_src[paths_src[0]], layouts_dst[paths_dst[0]], mapping
            )
        elif len(paths_dst) > 1:
            layout_src = _parameters(paths_src[0], layouts_src[paths_src[0]])
            atom = member_axis(paths_src[0], layout_src, len(paths_dst), "source")
            for i, path_dst in enumerate(paths_dst):
                part = member_of(layout_src, atom, i)
                values_by_path[path_dst] = fit(
                    path_dst, part, _parameters(path_dst, layouts_dst[path_dst]), paths_src[0]
                )
        else:
            path_dst = paths_dst[0]
            layout_dst = _parameters(path_dst, layouts_dst[path_dst])
            atom = member_axis(path_dst, layout_dst, len(paths_src), "destination")
            parts = [
                fit(path_dst, _parameters(path_src, layouts_src[path_src]), member_of(layout_dst, atom, i), path_src)
                for i, path_src in enumerate(paths_src)
            ]
            values_by_path[path_dst] = merged_members(layout_dst, atom, parts)
    target.write({path: values for path, values in values_by_path.items() if values})
    if target.abstract:
        _check_filled(target, whole)
    return target


def _one_to_one(
    path_src: str, path_dst: str, layout_src: Layout | Container, layout_dst: Layout | Container, mapping: dict
) -> dict[str, Any]:
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
        values = fit(path_dst, layout_src, layout_dst, path_src)
    # A decode cache's names are no parameter's: one write takes both.
    values.update(fit_state(path_dst, layout_src.state, layout_dst.state))
    return values


def _parameters(path: str, layout: Layout | Container) -> Layout:
    """The layout of one of several layers mapped to or from one: a layer with
    parameters and no decode cache."""
    if isinstance(layout, Container) or layout.state is not None:
        held = "holds no parameters of its own" if isinstance(layout, Container) else "holds a decode cache"
        raise refuse(path, f"it {held}: only layers of parameters are split or merged along a named axis")
    return layout


def _progress(pairs: list, shown: bool) -> Any:
    if not shown:
        return pairs
    with needs("transfer_params(progress=True)", "tqdm"):
        from tqdm.auto import tqdm
    return tqdm(pairs, desc="layers", unit="layer")


def _verify(src: Any, dst: Any, mapping: dict, inputs: tuple, tolerance: float) -> None:
    alignment = called_alignment(src, dst, mapping, inputs, {}, "transfer_params(..., inputs=)")
    comparison = compare(src, dst, *inputs, tolerance=tolerance, alignment=alignment)
    first = comparison.first_divergence
    if first is not None:
        raise HookError(
            f"transfer_params: after the transfer the models differ first at layer "
            f"{first.path_a!r} -> {first.path_b!r} (max abs difference {first.max_abs:.3g}, "
            f"tolerance {tolerance:g}) on the example inputs: the ports compute differently "
            "there (an activation, an epsilon, a layout of the computation), or that layer's "
            "weights were not in the mapping. Compare with px.compare; verify=False skips this check."
        )
