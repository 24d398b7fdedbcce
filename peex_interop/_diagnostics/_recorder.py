"""A host-side recorder of training-loop logs (fastai's `ActivationStats`, the JAX way).

The statistics are computed inside the compiled step (see `px.activation_stats`); the
recorder only fetches the step's log every `every` steps and keeps it on the host.
"""

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np


class Recorder:
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
    """

    def __init__(self, every: int = 1, *, tensorboard_dir: str | Path | None = None, progress: bool = False):
        """**Arguments:**

        - `every`: record one step in `every`.
        - `tensorboard_dir`: if given, also write every scalar of every record as a
            TensorBoard scalar (`path/statistic`) there (needs `tensorboardX`).
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
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(str(tensorboard_dir))

    def due(self, step: int) -> bool:
        """Whether `record(step, ...)` will keep this step: pass it to a step function
        as a static flag to skip computing statistics on the other steps."""
        return step % self.every == 0

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
            for key_path, value in jtu.tree_flatten_with_path(host)[0]:
                if np.ndim(value) == 0:
                    tag = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in key_path)
                    self._writer.add_scalar(tag, float(value), step)
        return True

    def track(self, steps: Iterable[int]) -> Iterator[int]:
        """Iterate over `steps`, with a tqdm progress bar if `progress=True`."""
        if not self.progress:
            return iter(steps)
        from tqdm.auto import tqdm

        return iter(tqdm(steps))

    def close(self) -> None:
        """Flush and close the TensorBoard writer, if any."""
        if self._writer is not None:
            self._writer.close()

    def _series(self, path: str, statistic: str) -> np.ndarray:
        if not self.records:
            raise ValueError("nothing recorded yet")
        if path not in self.records[0]:
            raise KeyError(f"no layer {path!r} in the records; recorded: {sorted(self.records[0])}")
        value = self.records[0][path]
        if not isinstance(value, dict) or statistic not in value:
            raise KeyError(
                f"layer {path!r} has no {statistic!r} statistic: log it with "
                "px.activation_stats() (or a px.StatsLog with that key)"
            )
        return np.stack([np.asarray(record[path][statistic]) for record in self.records])

    def layer_stats(self, path: str) -> dict[str, np.ndarray]:
        """`{"mean", "std", "near_zero"}` of layer `path`, one entry per record."""
        return {name: self._series(path, name) for name in ("mean", "std", "near_zero")}

    def hist(self, path: str) -> np.ndarray:
        """Histogram counts of layer `path`: shape `(records, bins)`."""
        return self._series(path, "hist")

    def plot_layer_stats(self, path: str, file: str | Path | None = None) -> Any:
        """Mean, std and near-zero fraction of layer `path` over the records.

        **Arguments:**

        - `path`: the layer.
        - `file`: if given, the figure is saved there (PNG by extension).

        **Returns:**

        The matplotlib `Figure`.
        """
        from matplotlib.figure import Figure

        stats = self.layer_stats(path)
        figure = Figure(figsize=(12, 3))
        for axis, (name, series) in zip(figure.subplots(1, 3), stats.items()):
            axis.plot(self.steps, series.reshape(len(self.steps), -1))
            axis.set_title(f"{path}: {name}")
            axis.set_xlabel("step")
        figure.tight_layout()
        if file is not None:
            figure.savefig(file)
        return figure

    def color_dim(self, path: str, file: str | Path | None = None) -> Any:
        """fastai's "colorful dimension" plot of layer `path`: the histogram of its
        activations over the records, as an image (log scale).

        **Arguments:**

        - `path`: the layer.
        - `file`: if given, the figure is saved there.

        **Returns:**

        The matplotlib `Figure`.
        """
        from matplotlib.figure import Figure

        counts = self.hist(path).reshape(len(self.steps), -1)
        figure = Figure(figsize=(6, 3))
        axis = figure.subplots()
        axis.imshow(np.log1p(counts.T), origin="lower", aspect="auto")
        axis.set_title(f"{path}: activation histogram over records")
        axis.set_xlabel("record")
        axis.set_ylabel("bin")
        figure.tight_layout()
        if file is not None:
            figure.savefig(file)
        return figure
