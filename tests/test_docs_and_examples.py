"""Every runnable snippet in docs/ and every example in examples/ runs."""

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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


@pytest.fixture(scope="module", autouse=True)
def example_runs(tmp_path_factory):
    """Every example, run as a user would run it (outputs in a temporary folder), started
    when this module starts: as many at a time as there are cores, in the background of
    the snippet tests, since each mostly waits on its own imports and XLA compiles."""

    # Created here, once: the threads below would race to create the session's base
    # folder (FileExistsError, or one thread's cleanup removing another's folder).
    tmp_path_factory.getbasetemp()

    def run(example):
        cwd = tmp_path_factory.mktemp(example.stem)
        command = [sys.executable, str(example)]
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        yield {example: pool.submit(run, example) for example in EXAMPLES}
        pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_run(example, example_runs):
    result = example_runs[example].result()
    assert result.returncode == 0, result.stderr
    assert result.stdout
    for number in PRINTS.get(example.name, []):
        assert number in result.stdout
