"""Matching the layers of two implementations of one network (`px.align`): by the
signature of each call site, in call order."""

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .._diagnostics import SiteRow, find_sites
from .._engine import (
    INNER_KINDS,
    METHOD,
    NO_DECLARATIONS,
    PERTURBATION,
    SOWN,
    AbstractConverted,
    Container,
    Declarations,
    glob_to_regex,
    module_paths,
)
from .._errors import HookError
from ._alignment import REPEAT, Alignment, layer_of
from ._differences import first_array
from ._sides import Side

DEFAULT_KINDS = ("linear", "conv", "attention", "norm", "embedding", "recurrent", "pool")


def _own_counts(rows: Sequence[SiteRow]) -> dict[str, int]:
    """Path -> the parameters (and state) a layer holds itself, not in layers below it
    that have calls of their own."""
    totals: dict[str, int] = {}
    for row in rows:
        if row.kind not in INNER_KINDS:
            totals.setdefault(row.path, row.trainable + row.non_trainable)
    own = dict(totals)
    for path, total in totals.items():
        parent = path.rpartition(".")[0]
        while parent and parent not in totals:
            parent = parent.rpartition(".")[0]
        if parent and parent != path:
            own[parent] -= total
    return own


def _sites(rows: Sequence[SiteRow], kinds: tuple[str, ...]) -> list[tuple[str, tuple]]:
    """(path, signature) of every call site to match, in call-return order: a layer of
    `kinds` by its kind and the number of output values, which do not depend on layout
    (channels first or last, heads split or merged) or on whether a batch is vmapped; a
    layer of another kind holding parameters itself (a model's own `Einsum`), and a
    method site, by its class (and method) too: they match their own kind only."""
    own = _own_counts(rows)
    found = []
    for row in rows:
        # A layer's log holds one output per call of its enclosing vmaps/scans (`lengths`).
        size = math.prod(row.lengths) * first_array(row.output).size
        if row.kind in kinds:
            found.append((row.key, (row.kind, size)))
        elif row.kind == METHOD:
            found.append((row.key, (row.kind, row.module_type, row.path.rpartition(".")[2], size)))
        elif row.kind not in INNER_KINDS and row.kind not in (SOWN, PERTURBATION) and own.get(row.path, 0) > 0:
            found.append((row.key, (row.kind, row.module_type, size)))
    return found


def _declared(declarations: Declarations, row: SiteRow) -> bool:
    """Whether the user's layouts name the layer (by path, or by its class's name: the
    rows know the class by name only)."""
    for key in declarations.table:
        if isinstance(key, str) and glob_to_regex(key).match(row.path):
            return True
        if isinstance(key, type) and key.__name__ == row.module_type:
            return True
    return False


def align(
    model_a: Any,
    model_b: Any,
    *args: Any,
    kinds: tuple[str, ...] = DEFAULT_KINDS,
    layouts: Mapping[Any, Any] | None = None,
    **kwargs: Any,
) -> Alignment:
    """Match the layers of two implementations of the same network (any two libraries).

    Layers are matched by kind (`px.KINDS`) and output size, in call order: the k-th
    layer of a signature in model a with the k-th of that signature in model b. Where a
    signature occurs a different number of times in the two models, which layers
    correspond is not decidable from calls: all of them are reported as ambiguous,
    never guessed. A layer of another kind that holds parameters (a model's own layer
    class: an `Einsum`, an `RMSNorm`) and a method site (`embedder.attend`) match only a
    layer of the same class (and method): two instances of one model align completely;
    across implementations such a layer is reported, never dropped.

    **Arguments:**

    - `model_a`, `model_b`: Equinox models or converted Haiku/NNX models.
    - `*args`, `**kwargs`: one input both models accept.
    - `kinds`: the layer kinds to match by kind (containers and activations are not
        layers).
    - `layouts`: declared layouts (as for `px.transfer_params`): a layer they name is
        of a known layout, reported as unmatched rather than of unknown layout.

    **Returns:**

    An `Alignment`: `.mapping`, `.unmatched`, `.ambiguous`, `.unknown` (each entry:
    side, path, reason); its table's caption counts all four.
    """
    rows = [find_sites(model, args, kwargs, "px.align") for model in (model_a, model_b)]
    declarations = Declarations.of(layouts)
    alignment = align_rows(rows[0], rows[1], kinds, declarations)
    return with_uncalled(alignment, (model_a, model_b), rows, declarations)


def _uncalled_holders(model: Any, rows: Sequence[SiteRow], declarations: Declarations) -> dict[str, tuple]:
    """Path -> (class name, parameters) of each layer that holds parameters and that no
    call (of its own, or of its methods) reached on the inputs: a layer whose parent
    reads its arrays, one of another mode (a decode-only layer)."""
    called = {row.path for row in rows} | {layer_of(row.path) for row in rows if row.kind == METHOD}
    modules = module_paths(model)
    candidates = [
        path for path, module in modules.items()
        if path and path not in called and not isinstance(module, AbstractConverted)
    ]
    if not candidates:
        return {}
    side = Side.make(model, None, None, declarations)
    found = {}
    for path in candidates:
        try:
            layout = side.read([path])[path]
        except HookError:
            continue  # no layer of parameters: an activation, a wrapper
        if isinstance(layout, Container):
            continue
        held = tuple((name, tuple(p.value.shape)) for name, p in layout.params.items() if p.value is not None)
        if held:
            found[path] = ("layer" if modules[path] is None else type(modules[path]).__name__, held)
    return found


def with_uncalled(
    alignment: Alignment, models: tuple[Any, Any], rows: Sequence[Sequence[SiteRow]], declarations: Declarations
) -> Alignment:
    """`alignment` completed with the layers holding parameters that no call reached:
    matched where both models hold one of the same class and parameters at the same path
    (two instances of one model), reported unmatched otherwise."""
    holders = [_uncalled_holders(model, side_rows, declarations) for model, side_rows in zip(models, rows)]
    uncalled, unmatched = {}, list(alignment.unmatched)
    for path, held in holders[0].items():
        if holders[1].get(path) == held:
            uncalled[path] = path
    for side, found in zip("ab", holders):
        for path, (cls, params) in found.items():
            if path not in uncalled:
                names = ", ".join(f"{name} {shape}" for name, shape in params)
                unmatched.append((side, path, (
                    f"a {cls} holding {names}, not called on these inputs: map it by hand if the other model has it"
                )))
    return dataclasses.replace(alignment, unmatched=tuple(sorted(unmatched)), uncalled=uncalled)


def align_rows(
    rows_a: Sequence[SiteRow], rows_b: Sequence[SiteRow], kinds: tuple[str, ...],
    declarations: Declarations = NO_DECLARATIONS,
) -> Alignment:
    """`align` of two models' call sites (`px.summary(...).rows`)."""
    sites = {"a": _sites(rows_a, kinds), "b": _sites(rows_b, kinds)}
    by_key = {"a": {row.key: row for row in rows_a}, "b": {row.key: row for row in rows_b}}
    by_signature = {
        side: collections.defaultdict(list) for side in sites
    }
    for side, entries in sites.items():
        for path, signature in entries:
            by_signature[side][signature].append(path)
    mapping, unmatched, ambiguous, unknown = {}, [], [], []
    for signature in {*by_signature["a"], *by_signature["b"]}:
        paths_a, paths_b = by_signature["a"][signature], by_signature["b"][signature]
        kind, size = signature[0], signature[-1]
        what = f"{kind} layer" if len(signature) == 2 else f"{signature[1]} ({kind})"
        if signature[0] == METHOD:
            what = f"{signature[1]}.{signature[2]} method site"
        if len(paths_a) == len(paths_b):
            mapping.update(zip(paths_a, paths_b))
        elif not paths_a or not paths_b:
            side, paths = ("a", paths_a) if paths_a else ("b", paths_b)
            for path in paths:
                row = by_key[side][path]
                if len(signature) == 3 and not _declared(declarations, row):
                    held = row.trainable + row.non_trainable
                    unknown.append((side, path, (
                        f"a {row.module_type} holding {held} parameters, of no known layout and with no "
                        f"{row.module_type} in the other model: declare its layout (layouts=) and map it"
                    )))
                else:
                    unmatched.append((side, path, f"no {what} with {size} output values in the other model"))
        else:
            why = f"{len(paths_a)} {what}s with {size} output values in model a, {len(paths_b)} in model b"
            ambiguous += [("a", p, why) for p in paths_a] + [("b", p, why) for p in paths_b]
    # A method site of a layer called itself (an LSTM cell's `initialize_carry`) is
    # compared where the other model has it; its layer's weights are the call's.
    called = {side: {row.path for row in rows if row.kind != METHOD} for side, rows in (("a", rows_a), ("b", rows_b))}
    reported = lambda entry: not (  # noqa: E731
        by_key[entry[0]][entry[1]].kind == METHOD and layer_of(by_key[entry[0]][entry[1]].path) in called[entry[0]]
    )
    unmatched, ambiguous = list(filter(reported, unmatched)), list(filter(reported, ambiguous))
    order_a = [path for path, _ in sites["a"] if path in mapping]
    position_b = {path: i for i, (path, _) in enumerate(sites["b"])}
    positions = [position_b[mapping[path]] for path in order_a]
    methods = frozenset(
        row.key for rows in (rows_a, rows_b) for row in rows if row.kind == METHOD
    )
    return Alignment(
        {path: mapping[path] for path in order_a},
        tuple(sorted(unmatched)), tuple(sorted(ambiguous)), positions == sorted(positions),
        tuple(sorted(unknown)), methods,
    )


def called_alignment(model_a: Any, model_b: Any, mapping: dict, args: tuple, kwargs: dict, caller: str) -> Alignment:
    """An alignment of a mapping of layers (`px.transfer_params`'), whose entries name
    what a comparison logs: a layer called only through its methods (an `Embedder`'s
    `encode` and `decode`) by its first method site; an entry of a layer that never
    runs on these inputs is left out (the models' outputs still show its weights)."""
    rows = [find_sites(model, args, kwargs, caller) for model in (model_a, model_b)]
    keys = []
    for side_rows in rows:
        called = {row.path: row.key for row in side_rows if row.call == 0}
        first_method = {}
        for row in side_rows:
            if row.kind == METHOD and row.call == 0:
                first_method.setdefault(layer_of(row.path), row.key)
        keys.append({**first_method, **called})
    entries = {}
    for key_a, key_b in mapping.items():
        paths = [[key] if isinstance(key, str) else list(key) for key in (key_a, key_b)]
        found = [[side_keys.get(REPEAT.sub("", path)) for path in side] for side_keys, side in zip(keys, paths)]
        if any(None in side for side in found):
            continue
        renamed = [side[0] if isinstance(key, str) else tuple(side) for key, side in zip((key_a, key_b), found)]
        entries[renamed[0]] = renamed[1]
    return Alignment(entries, (), (), True)
