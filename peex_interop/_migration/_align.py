"""Matching the layers of two implementations of one network, and comparing them."""

import collections
import dataclasses
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._diagnostics._sites import SiteRow, find_sites
from .._diagnostics._summary import summary
from .._diagnostics._table import AbstractTabular, Table
from .._engine._declarations import NO_DECLARATIONS, Declarations
from .._engine._errors import HookError, outside_its_vmap, run_on_a_batch
from .._engine._kinds import INNER_KINDS, METHOD, PERTURBATION, SOWN
from .._engine._layouts import Container
from .._engine._paths import AbstractConverted, module_paths
from .._engine._selection import glob_to_regex
from .._hooks._backward import BackwardHook
from .._hooks._forward import ForwardHook
from .._hooks._logs import IdentityLog
from ._sides import Side

_REPEAT = re.compile(r"@\d+\Z")

DEFAULT_KINDS = ("linear", "conv", "attention", "norm", "embedding", "recurrent", "pool")


def _layers(keys: Any) -> list[str]:
    """The layers behind log keys (or tuples of them: the layers one fused layer of the
    other model holds): a repeated call `path@n` is a call of `path`."""
    flat = [part for key in keys for part in ((key,) if isinstance(key, str) else key)]
    return list(dict.fromkeys(_REPEAT.sub("", key) for key in flat))


def _label(key: str | tuple[str, ...]) -> str:
    """A comparison row's name for a mapping key: the layers of a tuple joined by ` + `."""
    return key if isinstance(key, str) else " + ".join(key)


def _first_array(value: Any) -> Any:
    return next(leaf for leaf in jax.tree.leaves(value) if hasattr(leaf, "shape"))


@dataclasses.dataclass(frozen=True, repr=False)
class Alignment(AbstractTabular):
    """`mapping` (path in model a -> path in model b) and what could not be matched;
    shows as a table (`print`, rich, notebooks).

    Every layer that holds parameters (or state) and was called is in one of
    `mapping`, `unmatched`, `ambiguous` and `unknown` (of no known layout and no
    counterpart of its class), each entry of the last three `(side, path, reason)`.
    Method sites (`embedder.attend`) are matched too, so that `px.compare` has their
    rows; `layer_mapping` gives the layers themselves, for `px.transfer_params`."""

    # Keys and values are paths; in a mapping given by hand, one side of an entry may be
    # a tuple of paths (the layers one fused layer holds).
    mapping: dict[Any, Any]
    unmatched: tuple[tuple[str, str, str], ...]
    ambiguous: tuple[tuple[str, str, str], ...]
    order_preserved: bool
    unknown: tuple[tuple[str, str, str], ...] = ()
    # The method sites among the mapping's keys and values: `<layer>.<method>`.
    methods: frozenset[str] = frozenset()
    # Layers holding parameters that no call reached, of the same class at the same path
    # in both models: matched for a transfer, with no output to compare.
    uncalled: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def layer_mapping(self) -> dict[str, str]:
        """`mapping` with each method site replaced by its layer (a layer reached through
        several methods once), and the `uncalled` layers: the layers whose weights
        `px.transfer_params` copies."""
        layers = {}
        for a, b in self.mapping.items():
            a, b = (_layer_of(p) if p in self.methods else p for p in (a, b))
            if a and b:
                layers.setdefault(a, b)
        return {**layers, **self.uncalled}

    def _table(self) -> Table:
        rows = [(a, b, "matched") for a, b in self.mapping.items()]
        for title, entries in (("unmatched", self.unmatched), ("ambiguous", self.ambiguous),
                               ("unknown layout", self.unknown)):
            for side, path, why in entries:
                rows.append((path, "", f"{title}: {why}") if side == "a" else ("", path, f"{title}: {why}"))
        rows += [(a, b, "matched, not called") for a, b in self.uncalled.items()]
        counts = len(self.mapping) + len(self.uncalled), len(self.unmatched), len(self.ambiguous), len(self.unknown)
        caption = "{} layers matched, {} unmatched, {} ambiguous, {} of unknown layout".format(*counts)
        if not self.order_preserved:
            caption += "; matched layers are called in a different order in model b"
        return Table(("model a", "model b", ""), tuple(rows), caption)


def _layer_of(method_site: str) -> str:
    return method_site.rpartition(".")[0]


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
        size = math.prod(row.lengths) * _first_array(row.output).size
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
    called = {row.path for row in rows} | {_layer_of(row.path) for row in rows if row.kind == METHOD}
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
        by_key[entry[0]][entry[1]].kind == METHOD and _layer_of(by_key[entry[0]][entry[1]].path) in called[entry[0]]
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
                first_method.setdefault(_layer_of(row.path), row.key)
        keys.append({**first_method, **called})
    entries = {}
    for key_a, key_b in mapping.items():
        paths = [[key] if isinstance(key, str) else list(key) for key in (key_a, key_b)]
        found = [[side_keys.get(_REPEAT.sub("", path)) for path in side] for side_keys, side in zip(keys, paths)]
        if any(None in side for side in found):
            continue
        renamed = [side[0] if isinstance(key, str) else tuple(side) for key, side in zip((key_a, key_b), found)]
        entries[renamed[0]] = renamed[1]
    return Alignment(entries, (), (), True)


def _difference(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Max abs / max rel difference, with b's axes permuted to a's layout (the
    permutation that fits best, when several fit), or reshaped when no permutation fits
    (e.g. attention heads split in one library and merged in the other)."""
    candidates = [
        np.transpose(b, order)
        for order in itertools.permutations(range(b.ndim))
        if tuple(b.shape[i] for i in order) == a.shape
    ] or [np.reshape(b, a.shape)]
    best = min(float(np.max(np.abs(a - c), initial=0.0)) for c in candidates)
    scale = float(np.max(np.abs(a), initial=0.0))
    return best, best / scale if scale else best


def _tree_difference(a: Any, b: Any) -> tuple[float, float, float]:
    """(max abs, max rel, max of abs / (1 + max |x|)) of one layer's outputs. Libraries
    return different structures (an LSTM cell `(h, c)` in Equinox, `((c, h), h)` in NNX;
    an Equinox BatchNorm its state too): each array of the side with fewer arrays is
    compared with its best-fitting unused array of the same size on the other side."""
    arrays_a = [np.asarray(x) for x in jax.tree.leaves(a) if hasattr(x, "shape")]
    arrays_b = [np.asarray(x) for x in jax.tree.leaves(b) if hasattr(x, "shape")]
    fewer, more = (arrays_a, arrays_b) if len(arrays_a) <= len(arrays_b) else (arrays_b, arrays_a)
    unused, worst = list(range(len(more))), (0.0, 0.0, 0.0)
    for x in fewer:
        scored = [
            ((*_difference(x, more[i]), i)) for i in unused if more[i].size == x.size
        ] or [(*_difference(fewer[0], more[0]), 0)]
        abs_error, rel_error, used = min(scored)
        if used in unused:
            unused.remove(used)
        excess = abs_error / (1 + float(np.max(np.abs(x), initial=0.0)))
        worst = max(worst, (abs_error, rel_error, excess), key=lambda row: row[2])
    return worst


def _entry_difference(log_a: Any, log_b: Any, key_a: Any, key_b: Any) -> tuple[float, float, float]:
    """`_tree_difference` of one mapping entry's logged values; an entry of several
    layers on one side is compared with the fused layer on the other as their outputs
    stacked along one axis (the axis, and a layout, that fits best)."""
    if isinstance(key_a, str) and isinstance(key_b, str):
        return _tree_difference(log_a[key_a], log_b[key_b])
    fused, parts = (log_a[key_a], [log_b[k] for k in key_b]) if isinstance(key_a, str) else (
        log_b[key_b], [log_a[k] for k in key_a]
    )
    x = np.asarray(_first_array(fused))
    arrays = [np.asarray(_first_array(part)) for part in parts]
    if len({a.shape for a in arrays}) != 1 or len(arrays) * arrays[0].size != x.size:
        return math.inf, math.inf, math.inf
    abs_error = min(_difference(x, np.stack(arrays, axis=axis))[0] for axis in range(arrays[0].ndim + 1))
    scale = float(np.max(np.abs(x), initial=0.0))
    return abs_error, abs_error / scale if scale else abs_error, abs_error / (1 + scale)


@dataclasses.dataclass(frozen=True)
class ComparisonRow:
    """One aligned layer of a `px.compare`: the largest differences of its outputs
    (and cotangents, with `cotangents=True`; else `None`), and whether it diverges."""

    path_a: str
    path_b: str
    max_abs: float
    max_rel: float
    cotangent_max_abs: float | None
    cotangent_max_rel: float | None
    diverged: bool
    # For a layer of a scanned stack: the first step at which it diverges (None if it
    # does not, or is not in a stack).
    first_step: int | None = None
    # Diverged in its cotangent only, its output agreeing: a layer upstream of a
    # wrong one receives a wrong cotangent from it, without being wrong itself.
    cotangent_only: bool = False
    # With `px.compare(..., steps=)`: the call (decode step) this row compares.
    step: int | None = None


@dataclasses.dataclass(frozen=True, repr=False)
class Comparison(AbstractTabular):
    """Per-layer differences of two implementations, in model a's call order; shows as
    a table (`print`, rich, notebooks)."""

    rows: tuple[ComparisonRow, ...]
    alignment: Alignment
    tolerance: float

    @property
    def first_divergence(self) -> ComparisonRow | None:
        """The first layer in call order whose output diverges; inside a scanned stack,
        whose layers all run at every step, the one that diverges at the earliest step
        (a layer wrong from step 0 makes the stack's first layer diverge from step 1).

        Outputs rank first: a wrong layer changes the cotangents of every layer before
        it, whose outputs agree (`ComparisonRow.cotangent_only`). Only where every
        output agrees is it a cotangent divergence: the last one in call order, where
        the backward pass (which runs in reverse call order) first goes wrong, between
        that layer and the next.
        """
        diverged = lambda row: row.diverged and not row.cotangent_only  # noqa: E731
        first = next((i for i, row in enumerate(self.rows) if diverged(row)), None)
        if first is None:
            # Calls of several steps run one after the other: the earliest step's.
            step = next((row.step for row in self.rows if row.diverged), None)
            return next((row for row in reversed(self.rows) if row.diverged and row.step == step), None)
        if self.rows[first].first_step is None:
            return self.rows[first]
        step = self.rows[first].step
        stack = itertools.takewhile(
            lambda row: row.step == step and (row.first_step is not None or not diverged(row)), self.rows[first:]
        )
        return min((row for row in stack if diverged(row)), key=lambda row: row.first_step or 0)

    @property
    def cotangent_only_rows(self) -> tuple[ComparisonRow, ...]:
        """The layers whose outputs agree and whose cotangents diverge, in call order."""
        return tuple(row for row in self.rows if row.cotangent_only)

    def _table(self) -> Table:
        first = self.first_divergence

        def mark(row: ComparisonRow) -> str:
            if row is first:
                return "<- first divergence" + (" (cotangent only)" if row.cotangent_only else "")
            return ("diverged (cotangent only)" if row.cotangent_only else "diverged") if row.diverged else ""

        steps = len({row.step for row in self.rows}) if self.rows and self.rows[0].step is not None else None
        if first is None:
            caption = f"all {len(self.rows)} layers agree within {self.tolerance:g}"
            if steps is not None:
                caption = f"all {len(self.rows) // steps} layers agree within {self.tolerance:g} at {steps} steps"
        else:
            caption = f"first divergence at {first.path_a} -> {first.path_b}"
            if first.step is not None:
                caption += f" at step {first.step}"
            if first.cotangent_only:
                caption += " (cotangent only: every output agrees)"
            elif self.cotangent_only_rows:
                caption += f"; {len(self.cotangent_only_rows)} layers diverge in their cotangents only"
        stepped = ("step",) if steps is not None else ()
        return Table(
            (*stepped, "layer (a)", "layer (b)", "max abs", "max rel", "ct max abs", "ct max rel", ""),
            tuple(
                (*((str(r.step),) if stepped else ()), r.path_a, r.path_b, f"{r.max_abs:.2e}", f"{r.max_rel:.2e}",
                 "" if r.cotangent_max_abs is None else f"{r.cotangent_max_abs:.2e}",
                 "" if r.cotangent_max_rel is None else f"{r.cotangent_max_rel:.2e}",
                 mark(r))
                for r in self.rows
            ),
            caption,
            numeric=frozenset(i + len(stepped) for i in (2, 3, 4, 5)),
        )


def _loss(output: Any) -> Any:
    return 0.5 * sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(output))


# Compiled, not eager: an eager run compiles each operation of the model on its own. Both
# models in one program: XLA compiles one program of two models faster than two (by a
# fifth to a quarter for a 50M-parameter LM on CPU).
@eqx.filter_jit
def _outputs(models: tuple, paths: tuple, args: tuple, kwargs: dict) -> tuple:
    """`(returned, log)` of each model, its log holding the outputs of its `paths`."""
    return tuple(
        ForwardHook(model, log_fn=IdentityLog(), layer_names=layers or None)(*args, **kwargs)
        for model, layers in zip(models, paths)
    )


@eqx.filter_jit
def _outputs_and_cotangents(models: tuple, paths: tuple, args: tuple, kwargs: dict, stepped: bool) -> tuple:
    """`(returned, log, cotangents)` of each model: `_outputs` and the cotangents of
    `_loss` at the same layers, from one gradient pass, the forward log its auxiliary
    output."""

    def run(model: Any, layers: list[str]) -> tuple[Any, Mapping[str, Any], dict]:
        logged = ForwardHook(model, log_fn=IdentityLog(), layer_names=layers or None)
        hooked = BackwardHook(logged, log_fn=IdentityLog(), layer_names=layers).init(*args, **kwargs)

        def loss(h: Any) -> Any:
            returned, log = h(*args, **kwargs)
            # Of a step, the output only: the state it returns is the next step's input.
            return _loss(_carried(model, returned)[0] if stepped else returned), (returned, log)

        grads, (returned, log) = eqx.filter_grad(loss, has_aux=True)(hooked)
        return returned, log, grads.log

    return tuple(run(model, layers) for model, layers in zip(models, paths))


# A comparison runs its program once per input, and on CPU compiling it takes longer
# than running it. XLA's backend (LLVM) optimisation level 0 compiles it a fifth faster
# and runs it about as fast, its matmuls being library calls (a 50M-parameter LM and
# its port: compile 0.64 -> 0.51 s, first run 0.27 s at both; with cotangents 1.55 ->
# 1.26 s, 0.58 -> 0.66 s). Both models are compiled alike; every logged value stays
# within 2e-7 relative of the default level's.
_ONE_SHOT_CPU_OPTIONS = {"xla_backend_optimization_level": 0}


def _run_once(jitted: Any, *args: Any) -> Any:
    if jax.default_backend() != "cpu":
        return jitted(*args)
    return jitted.lower(*args).compile(_ONE_SHOT_CPU_OPTIONS)(*args)


def _carried(model: Any, returned: Any) -> tuple[Any, Any]:
    if not isinstance(model, AbstractConverted):
        raise HookError(
            f"compare(..., steps=) carries each model's state from one call to the next, and a "
            f"{type(model).__name__} is called with its state as an argument (an Equinox model's eqx.nn.State): "
            "compare its calls one at a time"
        )
    return model.carried(returned)


def compare(
    model_a: Any,
    model_b: Any,
    *args: Any,
    steps: Sequence[Any] | None = None,
    tolerance: float = 1e-5,
    cotangents: bool = False,
    alignment: Alignment | None = None,
    **kwargs: Any,
) -> Comparison:
    """Run two implementations of one network on the same input and compare them layer
    by layer (outputs, and on request the cotangents of `0.5 * sum(output**2)`).

    Both models run in one compiled program; on CPU it is compiled at XLA's backend
    optimisation level 0, which compiles a program run once faster (values within 2e-7
    relative of the default level's).

    **Arguments:**

    - `model_a`, `model_b`: Equinox models or converted Haiku/NNX models.
    - `*args`, `**kwargs`: one input both models accept.
    - `steps`: instead of `*args`, the inputs of several calls of stateful models (one
        array, or a tuple of arguments, per call: the tokens of autoregressive decode
        steps), each call starting from the state the previous one left, carried as
        each model's library carries it (`.carried`: a linen model converted with
        `mutable=["cache"]`, an NNX one with `return_state=True`, a Haiku one from
        `hk.transform_with_state`). `**kwargs` go to every call.
    - `tolerance`: a layer diverges where `max abs > tolerance * (1 + max |a|)`.
    - `cotangents`: also compare the cotangents flowing back through each layer (of
        each step's output, with `steps`).
    - `alignment`: a precomputed `px.align` result (computed if not given, on the first
        step's input with `steps`).

    **Returns:**

    A `Comparison` (print it; `.first_divergence` is the first layer whose output
    diverges, at the earliest step with `steps`; `.cotangent_only_rows` the layers
    whose cotangents alone do). With `steps`, it has a row per step and layer, in step
    order (`ComparisonRow.step`).
    """
    if steps is None:
        alignment = alignment or align(model_a, model_b, *args, **kwargs)
        rows = _compare_call(model_a, model_b, args, kwargs, alignment, tolerance, cotangents)[0]
        return Comparison(tuple(rows), alignment, tolerance)
    if args:
        raise TypeError("compare takes one call's inputs as *args or several calls' as steps=, not both")
    calls = [step if isinstance(step, tuple) else (step,) for step in steps]
    if not calls:
        raise ValueError("compare: steps= names no call")
    alignment = alignment or align(model_a, model_b, *calls[0], **kwargs)
    rows = []
    for step, call in enumerate(calls):
        found, model_a, model_b = _compare_call(
            model_a, model_b, call, kwargs, alignment, tolerance, cotangents, stepped=True
        )
        rows += [dataclasses.replace(row, step=step) for row in found]
    return Comparison(tuple(rows), alignment, tolerance)


def _compare_call(
    model_a: Any,
    model_b: Any,
    args: tuple,
    kwargs: dict,
    alignment: Alignment,
    tolerance: float,
    cotangents: bool,
    stepped: bool = False,
) -> tuple[list[ComparisonRow], Any, Any]:
    """The rows of one call of both models, and (`stepped`) the models carrying the
    state that call left."""
    layers_a, layers_b = _layers(list(alignment.mapping)), _layers(list(alignment.mapping.values()))
    models, layers = (model_a, model_b), (layers_a, layers_b)
    with outside_its_vmap("px.compare", run_on_a_batch):
        if cotangents:
            (returned_a, log_a, ct_a), (returned_b, log_b, ct_b) = _run_once(
                _outputs_and_cotangents, models, layers, args, kwargs, stepped
            )
        else:
            (returned_a, log_a), (returned_b, log_b) = _run_once(_outputs, models, layers, args, kwargs)
            ct_a = ct_b = None
    # The differences are computed on the host: one transfer of every logged value, the
    # copies overlapping (on an accelerator), rather than a blocking copy per array.
    log_a, log_b, ct_a, ct_b = jax.device_get((log_a, log_b, ct_a, ct_b))
    if stepped:
        next_a, next_b = _carried(model_a, returned_a)[1], _carried(model_b, returned_b)[1]
    else:
        next_a, next_b = model_a, model_b
    rows = []
    for key_a, key_b in alignment.mapping.items():
        abs_error, rel_error, excess = _entry_difference(log_a, log_b, key_a, key_b)
        ct_abs = ct_rel = None
        output_diverged = cotangent_diverged = excess > tolerance
        if cotangents:
            ct_abs, ct_rel, ct_excess = _entry_difference(ct_a, ct_b, key_a, key_b)
            cotangent_diverged = ct_excess > tolerance
        rows.append(ComparisonRow(
            _label(key_a), _label(key_b), abs_error, rel_error, ct_abs, ct_rel,
            bool(output_diverged or cotangent_diverged),
            cotangent_only=bool(cotangent_diverged and not output_diverged),
        ))
    if any(row.diverged and not row.cotangent_only for row in rows):
        # Where layers of a scanned stack diverge: the step at which each first does
        # (in its output; a cotangent-only divergence has no such step).
        stack_axes = [_stack_axes(model, args, kwargs) for model in (model_a, model_b)]
        for i, row in enumerate(rows):
            axes = stack_axes[0].get(row.path_a), stack_axes[1].get(row.path_b)
            if row.diverged and not row.cotangent_only and None not in axes:
                first_step = _first_diverging_step(log_a[row.path_a], log_b[row.path_b], axes, tolerance)
                rows[i] = dataclasses.replace(row, first_step=first_step)
    return rows, next_a, next_b


def _stack_axes(model: Any, args: tuple, kwargs: dict) -> dict[str, tuple[int, int]]:
    """Log key -> (axis, length) of the innermost stack of layers the layer runs in."""
    return {
        row.key: (row.stacks[-1], row.lengths[row.stacks[-1]])
        for row in summary(model, *args, **kwargs).rows
        if row.stacks
    }


def _first_diverging_step(a: Any, b: Any, axes: tuple, tolerance: float) -> int | None:
    (axis_a, length), (axis_b, _) = axes

    def step(tree: Any, axis: int, i: int) -> Any:
        return jax.tree.map(lambda x: np.take(np.asarray(x), i, axis) if np.ndim(x) > axis else x, tree)

    for i in range(length):
        if _tree_difference(step(a, axis_a, i), step(b, axis_b, i))[2] > tolerance:
            return i
    return None
