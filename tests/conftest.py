import functools
import gc
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import pytest

# Tests compare against float64-free independent computations; keep CPU defaults.
jax.config.update("jax_platforms", "cpu")
# Random draws with JAX's older threefry lowering: other bits, and ~40% less time to
# compile each draw (random initialisation compiles one program per shape: ~300 in the
# suite, ~60 s of its CPU time; two heavy files 87 -> 73 s, interleaved). Tests compare
# against independent computations on the same draws, whatever their bits; the numbers
# printed in peex's README are drawn with JAX's default (test_peex_compat.py).
jax.config.update("jax_threefry_partitionable", False)
# XLA's backend optimisations off: most of the suite's time is XLA compiling tiny
# programs, each run a few times (an example's whole run: 24 -> 14 s of CPU). Results
# are compared with independent computations compiled the same way.
jax.config.update("jax_disable_most_optimizations", True)
os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # read by jax in the examples' subprocesses
sys.path.insert(0, str(Path(__file__).parent))

# Tests retrace the same computations many times (a fresh hooked wrapper, a fresh
# closure): XLA's persistent cache, kept for this session only, compiles each distinct
# program once. Executables are identical either way, so results are too. One cache for
# the session: made by the first process (pytest's own), passed in the environment to
# the xdist workers and to the examples' subprocesses, which then skip the programs
# another process compiled (random draws of the same shapes, the same small models):
# ~600 of ~4,900 compiles in the suite. Two processes may write one entry at once; a
# reader that finds it half-written warns and compiles the program itself.
_OWNS_CACHE = "PEEX_INTEROP_TESTS_XLA_CACHE" not in os.environ
if _OWNS_CACHE:
    os.environ["PEEX_INTEROP_TESTS_XLA_CACHE"] = tempfile.mkdtemp(prefix="peex_interop_tests_xla_")
_CACHE_SETTINGS = {
    "jax_compilation_cache_dir": os.environ["PEEX_INTEROP_TESTS_XLA_CACHE"],
    "jax_persistent_cache_min_compile_time_secs": 0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
}
for name, value in _CACHE_SETTINGS.items():
    jax.config.update(name, value)
    os.environ[name.upper()] = str(value)  # read by jax in the examples' subprocesses


def pytest_unconfigure(config):
    if _OWNS_CACHE:
        shutil.rmtree(os.environ["PEEX_INTEROP_TESTS_XLA_CACHE"], ignore_errors=True)


@pytest.fixture(autouse=True)
def frozen_heap():
    """`jax.checking_leaks()` runs a full `gc.collect()` per trace; freezing the heap
    built before each test (imports, caches, models) keeps those collections to the
    objects the test creates, tracers included, so leaks are still found. (It halves
    the transform matrices' time.) The heap is never thawed: collecting the whole heap
    thawed took ~1.2 s each time a worker moved to another file (~45 s of each
    worker's run, measured); what stays frozen is only cyclic garbage of objects that
    outlived a test (module fixtures): objects without cycles are still freed by their
    reference counts (peak memory of a worker: 3.2 GB)."""
    gc.collect()
    gc.freeze()


# Each docs page and each example is one long test (tens of seconds): run together in
# one worker, they made that worker the suite's critical path. Every other file is one
# group, run by one worker (its module fixtures built once); the long tests are groups of
# their own. Groups are handed out by decreasing size, so that the two workers finish
# together: a group's size is the bytes of the code it runs (a test file's, an example's,
# a page's Python snippets), which tracks its time (correlation ~0.9 over the suite's
# groups; a file's number of tests, used before, left one worker 30 s behind).
#
# The groups are xdist's scopes, given by a scheduler of our own: pytest 9.2 ids nodes
# by a structured NodeId, so xdist 3.8's `xdist_group` markers (which rename
# `item._nodeid`) no longer group anything, and every test was scheduled alone: a
# file's module fixtures were built in both workers, the notebook's kernel twice.
_ONE_GROUP_PER_TEST = {"test_docs_and_examples.py"}


def _group(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return nodeid if Path(path).name in _ONE_GROUP_PER_TEST else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ByGroup(config, log)


@functools.cache
def _code_bytes(path: Path) -> int:
    text = path.read_text()
    if path.suffix == ".md":
        return sum(map(len, re.findall(r"```python\n(.*?)```", text, flags=re.S)))
    return len(text)


def pytest_collection_modifyitems(config, items):
    sizes: dict[str, int] = {}
    for item in items:
        target = item.path.name in _ONE_GROUP_PER_TEST and (
            item.callspec.params.get("page") or item.callspec.params.get("example")
        )
        sizes[item.nodeid] = _code_bytes(Path(target) if target else item.path)
    # Stable: a file's tests stay in their order, one after the other.
    items.sort(key=lambda item: -sizes[item.nodeid])


@pytest.fixture(scope="session")
def tl_gpt2():
    """A tiny HF Flax GPT-2 in px and TransformerLens's results on its weights, computed
    once per session (tests/transformer_lens_harness.py); skips, saying `make tl-venv`,
    where build/tl-venv is absent."""
    import transformer_lens_harness

    transformer_lens_harness.skip_unless_available()
    return transformer_lens_harness.tiny_gpt2_case()
