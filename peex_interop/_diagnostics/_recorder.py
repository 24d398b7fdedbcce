"""A host-side recorder of training-loop logs (fastai's `ActivationStats`, the JAX way).

The statistics are computed inside the compiled step (see `px.activation_stats`); the
recorder only fetches the step's log every `every` steps and keeps it on the host.
"""

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from .._optional import needs
from ._stats import Histogram, computed_when
from ._table import AbstractTabular, Table


def _tag(key_path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in key_path)


def _named(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """`(tag, value)` of every array and every `px.Histogram` in a record, named by
    the keys users read them by (a `px.Stats` by its statistics' names)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _named(item, f"{prefix}/{key}" if prefix else str(key))
        return
    for key_path, leaf in jtu.tree_flatten_with_path(value, is_leaf=lambda v: isinstance(v, Histogram))[0]:
        yield "/".join(filter(None, (prefix, _tag(key_path)))), leaf


def _outside_share(histogram: Histogram) -> float:
    return float(histogram.outside) / max(int(histogram.total), 1)


def _cell(value: Any) -> str:
    if isinstance(value, Histogram):
        if np.ndim(value.low):
            return f"{np.shape(value.counts)[:-1]} histograms"
        return f"[{float(value.low):.3g}, {float(value.high):.3g}], {_outside_share(value):.1%} outside"
    if np.ndim(value) == 0:
        return f"{float(value):.4g}"
    return f"shape {np.shape(value)}"


def _write_events(writer: Any, step: int, host: dict[str, Any]) -> None:
    """Every scalar as a TensorBoard scalar; every histogram of one layer (pooled) as a
    TensorBoard histogram, with the share of its values outside the bins as a scalar."""
    for tag, value in _named(host):
        if isinstance(value, Histogram) and np.ndim(value.low) == 0:
            counts, edges = np.asarray(value.counts), np.asarray(value.edges, np.float64)
            centres = (edges[1:] + edges[:-1]) / 2
            # TensorBoard draws the buckets only; its sum and sum of squares are
            # estimated from the bin centres (the histogram does not keep them).
            writer.add_histogram_raw(
                tag, float(value.low), float(value.high), int(counts.sum()),
                float(counts @ centres), float(counts @ centres**2), edges[1:].tolist(),
                counts.tolist(), step,
            )
            writer.add_scalar(f"{tag}/outside", _outside_share(value), step)
        elif not isinstance(value, Histogram) and np.ndim(value) == 0:
            writer.add_scalar(tag, float(value), step)


class Recorder(AbstractTabular):
    """Collects logs every `every` steps: `n` steps give `ceil(n / every)` records (steps
    0, every, 2 * every, ...).

    !!! Example

        ```python
        recorder = px.Recorder(every=10)
        for step in recorder.track(range(num_steps)):
            model, opt_state, log = train_step(model, opt_state, batch)
            recorder.record(step, log)
        recorder.plot_layer_stats("layers.0", "layer0.png")
        ```

    In a notebook (or `print`, or rich) a recorder shows as a table of its last record.
    """

    def __init__(self, every: int = 1, *, tensorboard_dir: str | Path | None = None, progress: bool = False):
        """**Arguments:**

        - `every`: record one step in `every`.
        - `tensorboard_dir`: if given, also write every record there for TensorBoard
            (needs `tensorboardX`): every scalar as a scalar (`path/statistic`), every
            `px.Histogram` of one layer (pooled over the examples) as a histogram with
            the share of its values outside the bins as a scalar (`path/hist/outside`).
        - `progress`: show a tqdm progress bar in `track` (needs `tqdm`).
        """
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every
        self.progress = progress
        self.steps: list[int] = []
        self.records: list[dict[str, Any]] = []
        self._writer = None
        if tensorboard_dir is not None:
            with needs("px.Recorder(tensorboard_dir=...)", "tensorboardX"):
                from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(str(tensorboard_dir))

    def due(self, step: int) -> bool:
        """Whether `record(step, ...)` will keep this step: pass it to a step function
        as a static flag to skip computing statistics on the other steps."""
        return step % self.every == 0

    def when_due(self, step: Any) -> contextlib.AbstractContextManager[None]:
        """Inside a compiled step, compute the statistics only on due steps: the
        statistics logs (`px.StatsLog`, `px.activation_stats`, `px.HistogramLog`, ...)
        called inside the block run under `jax.lax.cond(step % every == 0, ...)` and log
        zeros on the other steps, which `record` ignores. One compiled step serves
        every step: pass `step` as an array (`jnp.asarray(i)`), not a Python int
        (static under `eqx.filter_jit`, so one compilation per step).

        **Arguments:**

        - `step`: the step number, counted from 0 (an integer array, traced).

        **Returns:**

        A context manager.
        """
        return computed_when(self.due(step))

    def when(self, due: bool) -> contextlib.AbstractContextManager[None]:
        """Compute the statistics only if `due`, decided on the host: pass
        `recorder.due(i)` to the compiled step as a static flag (`eqx.filter_jit` treats
        a Python bool as static), which then compiles twice, a step with statistics and
        one without. The statistics logs called inside the block log zeros when not
        `due`, so both steps return a log of the same structure. Cheaper per step than
        `when_due` on CPU (no `lax.cond` per layer; see `docs/benchmarks.md`).

        **Arguments:**

        - `due`: whether this step's statistics are recorded (a Python bool).

        **Returns:**

        A context manager.
        """
        if not isinstance(due, bool):
            raise TypeError(
                f"Recorder.when takes a Python bool (recorder.due(i)), got {type(due).__name__}; "
                "for a step number inside the compiled step use recorder.when_due(i)"
            )
        return computed_when(due)

    def record(self, step: int, log: dict[str, Any]) -> bool:
        """Keep `log` (fetched to the host) if `step` is due.

        **Arguments:**

        - `step`: the step number, counted from 0.
        - `log`: the log the compiled step returned.

        **Returns:**

        Whether the log was recorded.
        """
        if not self.due(step):
            return False
        host = jax.device_get(log)
        self.steps.append(step)
        self.records.append(host)
        if self._writer is not None:
            _write_events(self._writer, step, host)
        return True

    def track(self, steps: Iterable[int]) -> Iterator[int]:
        """Iterate over `steps`, with a tqdm progress bar if `progress=True`."""
        if not self.progress:
            return iter(steps)
        with needs("px.Recorder(progress=True)", "tqdm"):
            from tqdm.auto import tqdm

        return iter(tqdm(steps))

    def close(self) -> None:
        """Flush and close the TensorBoard writer, if any."""
        if self._writer is not None:
            self._writer.close()

    def _series(self, path: str, statistic: str) -> Any:
        if not self.records:
            raise ValueError("nothing recorded yet")
        if path not in self.records[0]:
            raise KeyError(f"no layer {path!r} in the records; recorded: {sorted(self.records[0])}")
        value = self.records[0][path]
        if not isinstance(value, Mapping) or statistic not in value:
            raise KeyError(
                f"layer {path!r} has no {statistic!r} statistic: log it with "
                "px.activation_stats() (or a px.StatsLog with that key)"
            )
        return jtu.tree_map(lambda *values: np.stack(values), *(record[path][statistic] for record in self.records))

    def layer_stats(self, path: str) -> dict[str, np.ndarray]:
        """`{"mean", "std", "near_zero"}` of layer `path`, one entry per record."""
        return {name: self._series(path, name) for name in ("mean", "std", "near_zero")}

    def hist(self, path: str) -> Histogram:
        """The histograms of layer `path`: a `px.Histogram` whose fields have one entry
        per record (`counts` of shape `(records, bins)` once pooled)."""
        return self._series(path, "hist")

    def plot_layer_stats(self, path: str, file: str | Path | None = None) -> Any:
        """Mean, std and near-zero fraction of layer `path` against the step.

        **Arguments:**

        - `path`: the layer.
        - `file`: if given, the figure is saved there (PNG by extension).

        **Returns:**

        A matplotlib `Figure`, not registered with pyplot, that displays itself in a
        notebook.
        """
        with needs("px.Recorder.plot_layer_stats", "matplotlib"):
            from ._plots import plot_layer_stats

        return self._saved(plot_layer_stats(path, self.steps, self.layer_stats(path)), file)

    def color_dim(self, path: str, file: str | Path | None = None) -> Any:
        """fastai's "colorful dimension" plot of layer `path`: its histogram at every
        recorded step (x: step, y: value, colour: share of the values per unit of value,
        log scale, with a colorbar). Values outside the bins (an explicit range, NaN) are
        plotted below it as percentages, when there are any.

        **Arguments:**

        - `path`: the layer (its histograms pooled to one per record, see
            `px.pool_stats`).
        - `file`: if given, the figure is saved there.

        **Returns:**

        A matplotlib `Figure`, not registered with pyplot, that displays itself in a
        notebook.
        """
        with needs("px.Recorder.color_dim", "matplotlib"):
            from ._plots import color_dim

        histogram = self.hist(path)
        # A "hist" entry of the user's own (a StatsLog of jnp.histogram counts) has no
        # edges or outside counts to plot against.
        if not isinstance(histogram, Histogram):
            got = type(histogram).__name__ + (f" of shape {np.shape(histogram)}" if hasattr(histogram, "shape") else "")
            raise TypeError(
                f"Recorder.color_dim needs the 'hist' statistic of layer {path!r} to be a px.Histogram, "
                f"as logged by px.HistogramLog or px.activation_stats(); got a {got}"
            )
        return self._saved(color_dim(path, self.steps, histogram), file)

    @staticmethod
    def _saved(figure: Any, file: str | Path | None) -> Any:
        if file is not None:
            figure.savefig(file)
        return figure

    def _table(self) -> Table:
        if not self.records:
            return Table(("layer",), (), "nothing recorded yet")
        last = self.records[-1]
        # The statistics in the order they were logged (dict.fromkeys keeps it).
        names = list(dict.fromkeys(name for value in last.values() if isinstance(value, Mapping) for name in value))
        rows = tuple(
            (path, *(_cell(value[name]) if name in value else "" for name in names))
            if isinstance(value, Mapping) else (path, _cell(value), *[""] * (len(names) - 1))
            for path, value in last.items()
        )
        caption = (
            f"{len(self.records)} records (steps {self.steps[0]} to {self.steps[-1]}, every {self.every}); "
            "last record shown"
        )
        return Table(("layer", *names), rows, caption)
