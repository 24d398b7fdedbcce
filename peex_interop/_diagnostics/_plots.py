"""Plots of recorded statistics (fastai's `plot_layer_stats` and `color_dim`).

They return matplotlib figures that pyplot does not know about: nothing is left open in
pyplot's state (no `<Figure size ...>` line, no figure shown twice, no memory held by
pyplot), and each figure shows itself as a PNG when it is the value of a notebook cell.
"""

import io

import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from ._stats import Histogram


class NotebookFigure(Figure):
    """A `matplotlib.figure.Figure` that displays itself as a PNG in notebooks."""

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", bbox_inches="tight")
        return buffer.getvalue()


def plot_layer_stats(path: str, steps: list[int], stats: dict[str, np.ndarray]) -> NotebookFigure:
    figure = NotebookFigure(figsize=(12, 3), layout="constrained")
    for axis, (name, series) in zip(figure.subplots(1, len(stats)), stats.items()):
        axis.plot(steps, series.reshape(len(steps), -1))
        axis.set_title(f"{path}: {name}")
        axis.set_xlabel("step")
    return figure


def _step_edges(steps: np.ndarray) -> np.ndarray:
    # Each record's column spans half-way to its neighbours.
    if len(steps) == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    middles = (steps[1:] + steps[:-1]) / 2
    return np.concatenate([[2 * steps[0] - middles[0]], middles, [2 * steps[-1] - middles[-1]]])


def color_dim(path: str, steps: list[int], histogram: Histogram) -> NotebookFigure:
    counts = np.asarray(histogram.counts, np.float64)
    if counts.ndim != 2:
        raise ValueError(
            f"color_dim needs one histogram per record; layer {path!r} logged histograms of "
            f"shape {counts.shape[1:]} per record (one per example or per scan step): pool "
            "them inside the step with px.pool_stats(log, num_axes=...)"
        )
    edges = np.asarray(histogram.edges, np.float64)
    outside = {"below the bins": histogram.below, "above the bins": histogram.above, "NaN": histogram.nan}
    total = np.maximum(np.asarray(histogram.total), 1)
    # Bins differ between records when the range follows the data: colour the density
    # (share of the values per unit of value), which is comparable across records.
    density = counts / total[:, None] / np.diff(edges, axis=1)
    x = _step_edges(np.asarray(steps, np.float64))
    # One rectangle per (record, bin), each at its own record's edges.
    left, right = np.broadcast_to(x[:-1, None], counts.shape), np.broadcast_to(x[1:, None], counts.shape)
    bottom, top = edges[:, :-1], edges[:, 1:]
    corners = np.stack(
        [np.stack(c, axis=-1) for c in ((left, bottom), (right, bottom), (right, top), (left, top))], axis=-2
    )
    filled = density > 0

    shown_outside = {name: count for name, count in outside.items() if np.any(count)}
    figure = NotebookFigure(figsize=(7, 4.5 if shown_outside else 3.5), layout="constrained")
    if shown_outside:
        axis, outside_axis = figure.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    else:
        axis = figure.subplots()
    cells = PolyCollection(
        list(corners[filled]), array=density[filled], cmap="viridis",
        norm=LogNorm(density[filled].min(initial=1.0), density[filled].max(initial=1.0)),
        linewidths=0, antialiaseds=False,
    )
    axis.add_collection(cells)
    # An empty bin is drawn as the lowest colour, as fastai's log1p(0) = 0.
    axis.set_facecolor(cells.cmap(0.0))
    axis.set_xlim(x[0], x[-1])
    axis.set_ylim(edges.min(), edges.max())
    axis.set_title(f"{path}: histogram over steps")
    axis.set_ylabel("value")
    # Spanning both panels keeps their step axes aligned.
    figure.colorbar(cells, ax=figure.axes, label="share of values per unit")
    if shown_outside:
        for name, count in shown_outside.items():
            outside_axis.plot(steps, 100 * count / total, label=name)
        outside_axis.set_ylabel("% outside")
        outside_axis.legend(fontsize="small")
        outside_axis.set_xlabel("step")
    else:
        axis.set_xlabel("step")
    return figure
