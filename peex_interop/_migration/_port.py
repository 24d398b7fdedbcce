"""A port in one call: align, transfer, verify, and refuse what does not compute the same.

`px.port` is `px.align` + `px.transfer_params` + `px.compare` with one addition: the
models' outputs are compared too, as a last row. Layer by layer the comparison sees only
aligned layers; what runs after the last of them (a final activation, logits computed by
a tied embedding's `attend`, which is not a layer call) would otherwise go unchecked.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PyTree

from .._diagnostics import SiteRow, find_sites
from .._engine import INNER_KINDS, Declarations, check_model, join
from .._errors import HookError, PortError
from ._align import DEFAULT_KINDS, align_rows, called_alignment, with_uncalled
from ._alignment import REPEAT, Alignment
from ._compare import compare
from ._comparison import Comparison, ComparisonRow
from ._sides import state_only
from ._transfer import MappingKey, ported_side

# The comparison row of the models' outputs: not a layer path.
OUTPUT = "(output)"


class _Whole(eqx.Module):
    """A model whose output is a call site of its own (`output`), so that one hooked run
    logs its layers (under `model.`) and what it returns."""

    model: Any
    output: eqx.nn.Identity

    def __call__(self, *args: Any) -> Any:
        return self.output(self.model(*args))


def _inside(key: "str | tuple[str, ...]") -> "str | tuple[str, ...]":
    return join("model", key) if isinstance(key, str) else tuple(join("model", path) for path in key)


def _outside(label: str) -> str:
    # A row's label; several layers' (`a + b`) each renamed.
    if label == "output":
        return OUTPUT
    return " + ".join("" if path == "model" else path.removeprefix("model.") for path in label.split(" + "))


def _blocking(alignment: Alignment) -> list[tuple[str, str, str]]:
    """The entries of the alignment that leave a layer unported: every one but method
    sites, whose layers are ported where anything maps them (`embedder` of
    `embedder.attend`), and otherwise found unwritten by the port's own check."""
    entries = [*alignment.unmatched, *alignment.ambiguous, *alignment.unknown]
    return [entry for entry in entries if entry[1] not in alignment.methods]


def _unmatched_error(alignment: Alignment, entries: list[tuple[str, str, str]]) -> HookError:
    side_names = {"a": "source", "b": "destination"}
    shown = "; ".join(f"{side_names[side]} {path!r}: {why}" for side, path, why in entries[:6])
    more = f" and {len(entries) - 6} more" if len(entries) > 6 else ""
    return HookError(
        f"px.port: px.align matches {len(alignment.mapping)} layers and leaves {len(entries)} unmatched, "
        f"ambiguous or of unknown layout: {shown}{more}. A layer left out would keep the destination's own "
        "weights: pass mapping= (px.align(source, destination, *inputs).layer_mapping, completed by hand) to "
        "say which layers correspond, and layouts= to declare the layout of a layer class of your own."
    )


def _without(alignment: Alignment, unchecked: Sequence[str]) -> Alignment:
    """The alignment less the entries of the source layers `unchecked` (or of their
    method sites)."""
    known = {REPEAT.sub("", key) for key in alignment.mapping if isinstance(key, str)}
    missing = [path for path in unchecked if path not in known and not any(k.startswith(path + ".") for k in known)]
    if missing:
        raise HookError(f"px.port: unchecked= names {missing}, which the mapping does not map from the source")
    unchecked_key = lambda key: isinstance(key, str) and any(  # noqa: E731
        REPEAT.sub("", key) == path or key.startswith(path + ".") for path in unchecked
    )
    kept = {a: b for a, b in alignment.mapping.items() if not unchecked_key(a)}
    return dataclasses.replace(alignment, mapping=kept)


def _marked(model: Any) -> Any:
    """`model` with every floating-point array replaced by its shape, dtype and placement:
    a port writes each of them or is refused naming those it did not."""

    def mark(x: Any) -> Any:
        if not eqx.is_inexact_array(x):
            return x
        committed = isinstance(x, jax.Array) and x.committed
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if committed else None)

    return jax.tree.map(mark, model)


def _divergence_error(first: ComparisonRow, comparison: Comparison) -> PortError:
    if first.path_a == OUTPUT:
        where = (
            f"in the models' outputs, every aligned layer agreeing (max abs difference {first.max_abs:.3g}, "
            f"max rel {first.max_rel:.3g}): what runs after the last aligned layer computes differently "
            "(an activation, a final projection that is not a layer call)"
        )
    elif first.cotangent_only:
        where = (
            f"at layer {first.path_a!r} -> {first.path_b!r} in its cotangent only (max abs difference "
            f"{first.cotangent_max_abs:.3g}, max rel {first.cotangent_max_rel:.3g}; every output agrees): "
            "the backward passes differ between that layer and the next"
        )
    else:
        step = "" if first.first_step is None else f" from step {first.first_step} of its stack"
        where = (
            f"at layer {first.path_a!r} -> {first.path_b!r}{step} (max abs difference {first.max_abs:.3g}, "
            f"max rel {first.max_rel:.3g}): that layer computes differently (an activation before it, an "
            "epsilon, a layout of the computation), or its weights are not the source's"
        )
    return PortError(
        f"px.port: the port differs from its source first {where}; tolerance {comparison.tolerance:g} "
        "(a row diverges where max abs > tolerance * (1 + max |source|)). The error's .comparison holds "
        "every layer's row.",
        comparison,
    )


def port(
    source: PyTree,
    destination: PyTree,
    *inputs: PyTree,
    mapping: dict[MappingKey, MappingKey] | None = None,
    cotangents: bool = False,
    tolerance: float = 1e-5,
    layouts: Mapping[Any, Any] | None = None,
    unchecked: Sequence[str] = (),
    progress: bool = False,
) -> tuple[PyTree, Comparison]:
    """Port a model's weights into another implementation of the same network, and prove
    it: align the layers, transfer the weights exactly, compare the two models layer by
    layer and their outputs on the example inputs, and refuse a port that differs.

    **Arguments:**

    - `source`: the model to copy from: an Equinox model or a converted one
        (`px.from_haiku`, `px.from_nnx`, `px.from_linen`, `px.from_function`).
    - `destination`: the model to copy into (not modified), likewise; it may be
        abstract (`px.from_nnx(nnx.eval_shape(...))`, linen or Haiku variables from
        `jax.eval_shape` of an init): it is filled with the source's values, never
        initialised. Its partitioning metadata is kept, as by `px.transfer_params`.
    - `*inputs`: example input(s) both models accept, as positional arguments.
    - `mapping`: `{layer path in source: layer path in destination}` (one side may be a
        tuple of the layers one fused layer holds, as for `px.transfer_params`); by
        default `px.align(source, destination, *inputs).layer_mapping`, which must then
        match every layer (a layer it leaves unmatched, ambiguous or of unknown layout
        is refused, naming it), and each layer of the destination holding state and no
        parameters (a position embedding's decode index) from the source's layer at
        the same path. Either way every array of the destination must receive the
        source's values: one left out is refused, naming it.
    - `cotangents`: also compare the cotangents of `0.5 * sum(output**2)` flowing back
        through every layer: a port to be trained (or differentiated) is then checked
        in its backward pass too, at about the cost of one more first-call gradient of
        each model.
    - `tolerance`: a layer (or the output) diverges where its max abs difference
        exceeds `tolerance * (1 + max |source output|)`: an absolute tolerance near
        zero, a relative one for large values. The default suits float32 ports that
        compute the same operations in a different order; a different epsilon of a
        norm (1e-6 in NNX, 1e-5 in Haiku and Equinox) shows at 1e-5.
    - `layouts`: the layouts of layers of your own classes (`{class or path pattern:
        px.declare(...)}`), as for `px.transfer_params`.
    - `unchecked`: layers of the source ported without a comparison row of their own,
        where two implementations split the same computation differently around the
        same weights (Hugging Face's Gemma scales its embedding by sqrt(width) after
        the embedding layer, tunix's `Embedder.encode` inside it): the layers after
        them and the models' outputs still check their weights.
    - `progress`: show a tqdm progress bar over the layers converted (needs `tqdm`).

    **Returns:**

    `(ported, comparison)`: a copy of `destination` holding the source's weights, and
    the `px.Comparison` of the two (its last row, `(output)`, compares the models'
    outputs).

    **Raises:**

    `px.PortError` naming the first diverging layer (or the outputs) and by how much,
    with the comparison as its `.comparison`; `px.HookError` where a layer cannot be
    transferred exactly (naming it, expected and got) or the alignment is incomplete.
    """
    check_model(source, "px.port")
    check_model(destination, "px.port")
    if not inputs:
        raise HookError(
            "px.port: no example inputs. They are what the layers are aligned and the port verified on: "
            "px.port(source, destination, x)."
        )
    declarations = Declarations.of(layouts)
    if mapping is None:
        # The call sites of both models, found once: what px.align matches and what
        # holds state without parameters.
        rows_src, rows_dst = (find_sites(model, inputs, {}, "px.port") for model in (source, destination))
        alignment = with_uncalled(
            align_rows(rows_src, rows_dst, DEFAULT_KINDS, declarations), (source, destination), (rows_src, rows_dst),
            declarations,
        )
        blocking = _blocking(alignment)
        if blocking or not alignment.mapping:
            raise _unmatched_error(alignment, blocking)
        carried = _state_only_layers(destination, rows_src, rows_dst, alignment.layer_mapping)
        transferred: dict[Any, Any] = {**alignment.layer_mapping, **carried}
    else:
        transferred = mapping
    ported = ported_side(
        source, _marked(destination), transferred, inputs, None, None, declarations, progress, whole=True
    ).model
    if mapping is not None:
        alignment = called_alignment(source, ported, mapping, inputs, {}, "px.port")
    if unchecked:
        alignment = _without(alignment, unchecked)
    comparison = _compare(source, ported, inputs, alignment, cotangents, tolerance)
    first = comparison.first_divergence
    if first is not None:
        raise _divergence_error(first, comparison)
    return ported, comparison


def _state_only_layers(
    destination: Any, rows_src: tuple[SiteRow, ...], rows_dst: tuple[SiteRow, ...], mapping: dict[str, str]
) -> dict[str, str]:
    """The destination's layers holding state and no parameters (a position
    embedding's decode index), each mapped from the source's layer at its path: they
    are of no kind `px.align` matches, and left out they would keep the destination's
    position (or, abstract, none)."""
    covered = {REPEAT.sub("", path) for path in mapping.values()}
    candidates = [
        row.path for row in rows_dst
        if row.path and row.trainable == 0 and row.kind not in INNER_KINDS and row.path not in covered
    ]
    found = state_only(destination, list(dict.fromkeys(candidates)))
    called = {row.path for row in rows_src}
    missing = [path for path in found if path not in called]
    if missing:
        raise HookError(
            f"px.port: the destination's layers {missing} hold state and no parameters (a decode position) and "
            "the source has no layer at that path to carry it from: pass mapping= (px.align(source, destination, "
            "*inputs).mapping with those layers added, {path in source: path in destination})."
        )
    return {path: path for path in found}


def _compare(
    source: Any, ported: Any, inputs: tuple, alignment: Alignment, cotangents: bool, tolerance: float
) -> Comparison:
    # Both models run once each, hooked, with their outputs as one more site.
    whole = Alignment(
        {**{_inside(a): _inside(b) for a, b in alignment.mapping.items()}, "output": "output"},
        (), (), alignment.order_preserved,
    )
    wrap = lambda model: _Whole(model, eqx.nn.Identity())  # noqa: E731
    compared = compare(wrap(source), wrap(ported), *inputs, tolerance=tolerance, cotangents=cotangents,
                       alignment=whole)
    rows = tuple(
        dataclasses.replace(row, path_a=_outside(row.path_a), path_b=_outside(row.path_b)) for row in compared.rows
    )
    return Comparison(rows, alignment, tolerance)
