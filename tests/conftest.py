import gc
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import pytest

# Tests compare against float64-free independent computations; keep CPU defaults.
jax.config.update("jax_platforms", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

# Tests retrace the same computations many times (a fresh hooked wrapper, a fresh
# closure): XLA's persistent cache, kept for this session only, compiles each distinct
# program once. Executables are identical either way, so results are too.
_COMPILATION_CACHE = tempfile.mkdtemp(prefix="peex_interop_tests_xla_")
jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    shutil.rmtree(_COMPILATION_CACHE, ignore_errors=True)


@pytest.fixture(scope="module")
def thawed_after_module():
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def frozen_heap(thawed_after_module):
    """`jax.checking_leaks()` runs a full `gc.collect()` per trace; freezing the heap
    built before each test (imports, caches, models) keeps those collections to the
    objects the test creates, tracers included, so leaks are still found. (It halves
    the transform matrices' time.)"""
    gc.collect()
    gc.freeze()
