"""Summaries and parameter counts (fastai's `summary`, `total_params`, `model_sizes`,
`num_features`) for Equinox models and converted Haiku/NNX models alike."""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu

from .._engine._context import HookContext, Site
from .._engine._hooking import hooking
from .._engine._paths import AbstractConverted
from .._engine._selection import Selection
from ._table import AbstractTabular, Table


def _counts(tree: Any) -> tuple[int, int]:
    # Equinox keeps running statistics (BatchNorm) as the initial values of StateIndex
    # fields: they are not trained, so they are counted apart.
    trainable = other = 0
    for leaf in jtu.tree_leaves(tree, is_leaf=lambda x: isinstance(x, (eqx.nn.StateIndex, AbstractConverted))):
        if isinstance(leaf, AbstractConverted):
            t, o = leaf.parameter_counts()
            trainable, other = trainable + t, other + o
        elif isinstance(leaf, eqx.nn.StateIndex):
            other += sum(x.size for x in jtu.tree_leaves(leaf) if eqx.is_inexact_array(x))
        elif eqx.is_inexact_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            trainable += leaf.size
    return trainable, other


def total_params(model: Any) -> tuple[int, int]:
    """Numbers of parameters of a model of any of the three libraries.

    **Arguments:**

    - `model`: an `eqx.Module`, or a model from `px.from_haiku` / `px.from_nnx`.

    **Returns:**

    `(trainable, non_trainable)`: e.g. `(352, 0)` for a linear layer 10 -> 32, `(40, 40)`
    for a BatchNorm over 20 features (its running mean and variance are not trained).
    """
    return _counts(model)


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One call site of a summary."""

    path: str
    module_type: str
    kind: str
    trainable: int
    non_trainable: int
    output_shapes: tuple[tuple[int, ...], ...]


class _SiteFacts:
    """A policy that records static facts of every call site (shapes, types, counts)."""

    selection = Selection()
    observes_values = False  # only shapes, types and counts: fine under any transform

    def __init__(self):
        self.rows: list[LayerRow] = []

    def run_site(self, context: HookContext, site: Site) -> Any:
        output = site.call(*site.args, **site.kwargs)
        if isinstance(site.owner, AbstractConverted) and site.owner is not site.module:
            trainable, other = site.owner.layer_parameter_counts(site.module)
        else:
            trainable, other = _counts(site.module)
        shapes = tuple(tuple(leaf.shape) for leaf in jtu.tree_leaves(output) if hasattr(leaf, "shape"))
        self.rows.append(LayerRow(site.key, type(site.module).__name__, site.kind, trainable, other, shapes))
        return output


@dataclasses.dataclass(frozen=True, repr=False)
class Summary(AbstractTabular):
    """The rows of `px.summary`, in the order the calls *returned* (a container after its
    children); shows as a table in the terminal (`print`, rich) and in notebooks."""

    model_type: str
    rows: tuple[LayerRow, ...]
    total: tuple[int, int]

    def _table(self) -> Table:
        return Table(
            ("path", "type", "kind", "params", "non-trainable", "output shape(s)"),
            tuple(
                (r.path, r.module_type, r.kind, f"{r.trainable:,}", f"{r.non_trainable:,}",
                 ", ".join(str(s) for s in r.output_shapes))
                for r in self.rows
            ),
            f"{self.model_type}: {self.total[0]:,} trainable parameters, {self.total[1]:,} non-trainable",
            numeric=frozenset({3, 4}),
        )


def summary(model: Any, *args: Any, **kwargs: Any) -> Summary:
    """One row per call site: path, module type, kind, parameters, output shape(s).

    Runs the model abstractly (`eqx.filter_eval_shape`): nothing is computed. Layers
    inside a vmap/scan body report the shapes of one example/step, and a scanned layer
    stack reports the parameters of one layer.

    **Arguments:**

    - `model`: an `eqx.Module`, or a model from `px.from_haiku` / `px.from_nnx`.
    - `*args`, `**kwargs`: example arguments.

    **Returns:**

    A `Summary` (print it, or read `.rows`).
    """
    facts = _SiteFacts()

    def run(model, args, kwargs):
        with hooking(model, facts) as context:
            return context.root(*args, **kwargs)

    eqx.filter_eval_shape(run, model, args, kwargs)
    return Summary(type(model).__name__, tuple(facts.rows), total_params(model))


def model_sizes(model: Any, *args: Any, **kwargs: Any) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Output shape(s) of every call site for these arguments (fastai's `model_sizes`).

    **Arguments:**

    - `model`, `*args`, `**kwargs`: as for `px.summary`.

    **Returns:**

    `{path: output shapes}` in the order the calls returned.
    """
    return {row.path: row.output_shapes for row in summary(model, *args, **kwargs).rows}


def num_features(model: Any, *args: Any, **kwargs: Any) -> int:
    """Number of output features of the model (fastai's `num_features_model`): the
    channel axis of its output: axis 0 of an Equinox (channels-first, unbatched) conv
    output, the last axis otherwise.

    **Arguments:**

    - `model`, `*args`, `**kwargs`: as for `px.summary`.

    **Returns:**

    The number of features.
    """
    rows = summary(model, *args, **kwargs).rows
    last = next(r for r in reversed(rows) if r.kind != "container")
    channels_first = last.kind == "conv" and not isinstance(model, AbstractConverted)
    return last.output_shapes[0][0 if channels_first else -1]
