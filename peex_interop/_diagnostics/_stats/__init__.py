"""Statistics logs: reduce activations (or cotangents) on the device, inside the step.

Each log maps every floating-point array leaf of what it receives to a statistic, so it
works on layers with several outputs; non-float leaves (ints, keys) are not logged. The
statistics keep the tuples, lists, dicts and namedtuples around them, never the user's
own pytree classes (`plain_containers`).

Inside a `px.StatsLog` (and `px.activation_stats`) every statistic is kept in a form that
pools exactly (`AbstractPooled`): the sums behind a mean or a variance (divided where the
statistic is read, or where a packed log pools), a maximum, a norm, a histogram. So the
vmaps a model runs inside itself pool them (see `_engine/_pooling.py`) and
`px.pool_stats` pools the vmap around the model, and the log keeps one statistic per
layer whatever the batch and sequence length.

Where each part lives:

- `_pooled.py`: one statistic of one array in the form that pools (a mean's sums, a
    spread's, a maximum, a norm), and how each is read and pooled.
- `_sums.py`: the sums over an array that its means, spreads and fractions share.
- `_when_due.py`: how a statistic is computed: as one compiled program, and only on the
    steps that are recorded (`computed_when`).
- `_statistic_logs.py`: the logs of one statistic (`px.StdLog`, `px.NearZeroLog`,
    `px.AbsMaxLog`, `px.L2NormLog`).
- `_histogram.py`: `px.Histogram`, and when histograms may be added up.
- `_histogram_log.py`: `px.HistogramLog`, which bins every value exactly as numpy does.
- `_stats_log.py`: `px.StatsLog` (several statistics in one `px.Stats`) and
    `px.activation_stats`.
- `_pool_stats.py`: `px.pool_stats`, which pools the vmap around the model.
"""

from ._histogram import Histogram as Histogram
from ._histogram_log import HistogramLog as HistogramLog
from ._pool_stats import pool_stats as pool_stats
from ._statistic_logs import (
    AbsMaxLog as AbsMaxLog,
    L2NormLog as L2NormLog,
    NearZeroLog as NearZeroLog,
    StdLog as StdLog,
)
from ._stats_log import Stats as Stats, StatsLog as StatsLog, activation_stats as activation_stats
from ._when_due import computed_when as computed_when
