"""Every runnable snippet in docs/ and every example in examples/ runs."""

import os
import re
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


# What an example must print: the peex README's seed numbers, for its two examples.
PRINTS = {
    "peex_forward.py": ["0.23334768", "1.2571917", "1.2331474"],
    "peex_backward.py": ["-0.68400913", "0.4777369"],
}
assert set(PRINTS) <= {example.name for example in EXAMPLES}  # no check lost to a rename


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_run(example, tmp_path):
    # Run as a user would run it, its outputs in a temporary folder. Each example is a
    # scheduling group of its own (conftest.py), so the two workers share them out.
    command = [sys.executable, str(example)]
    env = dict(os.environ)
    if example.name in PRINTS:
        # Numbers printed by XLA compiled with its default optimisations (conftest.py).
        env.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout
    for number in PRINTS.get(example.name, []):
        assert number in result.stdout
