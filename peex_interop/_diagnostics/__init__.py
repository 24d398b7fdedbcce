"""Diagnostics built on the hooks: the call sites a model has, summaries of its layers,
statistics logs, packed logs, the recorder, and the tables that show them."""

from ._packing import PackedLog as PackedLog
from ._recorder import Recorder as Recorder
from ._sites import SiteRow as SiteRow, find_sites as find_sites, sites as sites
from ._stats import (
    AbsMaxLog as AbsMaxLog,
    Histogram as Histogram,
    HistogramLog as HistogramLog,
    L2NormLog as L2NormLog,
    NearZeroLog as NearZeroLog,
    Stats as Stats,
    StatsLog as StatsLog,
    StdLog as StdLog,
    activation_stats as activation_stats,
    pool_stats as pool_stats,
)
from ._summary import (
    Summary as Summary,
    model_sizes as model_sizes,
    num_features as num_features,
    summary as summary,
    total_params as total_params,
)
from ._table import AbstractTabular as AbstractTabular, Table as Table
