"""Interventions: hooks that change what a layer returns (ablations, activation
patching from a cache) and the cache they read."""

from ._ablation import MeanAblation as MeanAblation, ZeroAblation as ZeroAblation
from ._cache import cache as cache
from ._patch import CachePatch as CachePatch, Patched as Patched, patch as patch
