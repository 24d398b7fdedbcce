"""Every runnable snippet in docs/ and every example in examples/ runs."""

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_doc_snippets_run_in_order(page):
    snippets = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    namespace: dict = {}
    for snippet in snippets:
        exec(compile(snippet, str(page), "exec"), namespace)


# What an example must print: the peex README's seed numbers, for its two examples, to
# within the last digit that XLA's releases round differently (jaxlib 0.12.1 computes
# the README's 0.23334768 as 0.23334733, unhooked models included).
PRINTS = {
    "peex_forward.py": [0.23334768, 1.2571917, 1.2331474],
    "peex_backward.py": [-0.68400913, 0.4777369],
}
assert set(PRINTS) <= {example.name for example in EXAMPLES}  # no check lost to a rename


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_run(example, tmp_path, monkeypatch, capsys):
    # Run as a user would run it (`python examples/x.py`), its outputs in a temporary
    # folder. Each example is a scheduling group of its own (conftest.py), so the two
    # workers share them out.
    if example.name in PRINTS:
        out = run_in_a_process_of_its_own(example, tmp_path)
    else:
        run_in_this_process(example, tmp_path, monkeypatch)
        out = capsys.readouterr().out
    assert out
    printed = [float(number) for number in re.findall(r"-?\d+\.\d+", out)]
    for number in PRINTS.get(example.name, []):
        assert any(abs(value - number) <= 1e-6 for value in printed), (number, out)


def run_in_a_process_of_its_own(example, tmp_path):
    """Its standard output; run with XLA's default optimisations, under which the peex
    README's numbers were printed (conftest.py turns most of them off)."""
    env = dict(os.environ)
    env.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
    result = subprocess.run([sys.executable, str(example)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return result.stdout


def run_in_this_process(example, tmp_path, monkeypatch):
    """Run as `__main__` in this worker: no interpreter start and imports of its own
    (about 3 s of CPU per example), and the engine's patches, undone after each hooked
    call, are seen undone by the tests that run after it here. The examples it imports
    are forgotten afterwards, so each example runs its own."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(example)])
    monkeypatch.syspath_prepend(str(example.parent))
    try:
        runpy.run_path(str(example), run_name="__main__")
    finally:
        for name, module in list(sys.modules.items()):
            if Path(getattr(module, "__file__", None) or "/").parent == example.parent:
                del sys.modules[name]
