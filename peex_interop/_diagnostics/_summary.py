"""Summaries and parameter counts (fastai's `summary`, `total_params`, `model_sizes`,
`num_features`) for Equinox models and converted Haiku/NNX models alike."""

import dataclasses
from typing import Any

import equinox as eqx

from .._engine import AbstractConverted
from ._sites import SiteRow, find_sites, parameter_counts, state_among
from ._table import AbstractTabular, Table


def total_params(model: Any, state: eqx.nn.State | None = None) -> tuple[int, int]:
    """Numbers of parameters of a model of any of the three libraries.

    **Arguments:**

    - `model`: an `eqx.Module`, or a model from `px.from_haiku` / `px.from_nnx`.
    - `state`: the `eqx.nn.State` of an Equinox model built by `eqx.nn.make_with_state`,
        which keeps its stateful layers' values (running statistics): required for such
        a model (else a `px.HookError` names the layer).

    **Returns:**

    `(trainable, non_trainable)`: e.g. `(352, 0)` for a linear layer 10 -> 32, `(40, 40)`
    for a BatchNorm over 20 features (its running mean and variance are not trained).
    """
    return parameter_counts(model, state)


def _shapes(shapes: tuple[tuple[int, ...], ...]) -> str:
    return ", ".join(str(s) for s in shapes)


@dataclasses.dataclass(frozen=True, repr=False)
class Summary(AbstractTabular):
    """The rows of `px.summary` (`px.SiteRow`s, as `px.sites` lists them), in the order
    the calls *returned* (a container after its children); shows as a table in the
    terminal (`print`, rich) and in notebooks.

    A layer of a stack of `N` layers (`row.stack_length`) is one row marked `xN`, whose
    parameter columns count the whole stack, so that the rows of the top-level layers add
    up to the model's total. `unhookable` lists the calls that no hook can reach.
    """

    model_type: str
    rows: tuple[SiteRow, ...]
    total: tuple[int, int]

    @property
    def unhookable(self) -> tuple[str, ...]:
        """Keys of the calls that run under a transform peex_interop does not thread."""
        return tuple(row.key for row in self.rows if not row.hookable)

    def _table(self) -> Table:
        caption = f"{self.model_type}: {self.total[0]:,} trainable parameters, {self.total[1]:,} non-trainable"
        if self.unhookable:
            caption += (
                f"; not hookable (under a transform peex_interop does not thread): {', '.join(self.unhookable)}"
            )
        return Table(
            ("path", "type", "kind", "stack", "input shape(s)", "output shape(s)", "params", "non-trainable"),
            tuple(
                (
                    r.key, r.module_type, r.kind, f"x{r.stack_length}" if r.stacks else "",
                    _shapes(r.input_shapes), _shapes(r.output_shapes),
                    f"{r.trainable * r.stack_length:,}", f"{r.non_trainable * r.stack_length:,}",
                )
                for r in self.rows
            ),
            caption,
            numeric=frozenset({3, 6, 7}),
        )


def summary(model: Any, *args: Any, inner: bool = False, **kwargs: Any) -> Summary:
    """One row per call site: path, module type, kind, stack length, input and output
    shape(s), parameters.

    Builds on `px.sites`: runs the model abstractly (`jax.eval_shape`), so nothing is
    computed. Shapes are those of one call: layers inside a vmap/scan body report the
    shapes of one example/step. A scanned stack of `N` layers shows one row per layer
    of the stack marked `xN`, with the parameters of all `N`.

    **Arguments:**

    - `model`: an `eqx.Module`, or a model from `px.from_haiku`, `px.from_nnx`,
        `px.from_linen` or `px.from_function` (anything else raises a `TypeError`
        that says how to convert it).
    - `*args`, `**kwargs`: example arguments (other than `inner`).
    - `inner`: also list the sites inside layers (attention weights and scores,
        functions named with `px.function_sites`), as `px.sites(..., inner=True)` does.

    **Returns:**

    A `Summary` (print it, or read `.rows`).
    """
    rows = find_sites(model, args, kwargs, "px.summary", inner)
    return Summary(type(model).__name__, rows, parameter_counts(model, state_among((args, kwargs)), "px.summary"))


def model_sizes(model: Any, *args: Any, **kwargs: Any) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Output shape(s) of every call site for these arguments (fastai's `model_sizes`).

    **Arguments:**

    - `model`, `*args`, `**kwargs`: as for `px.summary`.

    **Returns:**

    `{path: output shapes}` in the order the calls returned.
    """
    return {row.key: row.output_shapes for row in summary(model, *args, **kwargs).rows}


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
