"""Interventions: hooks that change what a layer returns (ablations, activation
patching from a cache) and the cache they read."""

from ._ablation import MeanAblation as MeanAblation, ZeroAblation as ZeroAblation
from ._cache import cache as cache
from ._cells import AbstractCells as AbstractCells, Along as Along, Groups as Groups, Whole as Whole
from ._component import Component as Component, sweep_rows as sweep_rows
from ._patch import CachePatch as CachePatch, Patched as Patched, patch as patch
from ._path_patching import path_patch as path_patch, path_patch_sweep as path_patch_sweep
from ._sweep import patch_sweep as patch_sweep
