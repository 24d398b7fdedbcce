"""`benchmarks/bench.py --quick` (small models, a few repetitions) runs end to end and
writes a complete page: every section and library, a status for every row, and every
hooked variant's output equal to its raw one."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("Equinox", "Haiku", "NNX", "linen")


@pytest.mark.bench
def test_quick_bench_writes_the_page(tmp_path):
    out = tmp_path / "benchmarks.md"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--quick", "--out", str(out)],
        check=True, capture_output=True, text=True, timeout=600,
    )
    lines = out.read_text().splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
    rows = [c for c in cells if len(c) == 9 and c[0] != "section"]
    for section in ("log-everything", "dispatch", "statistics", "compile"):
        assert any(r[0] == section for r in rows), section
    for library in LIBRARIES:
        for model in ("MLP", "transformer"):
            assert any(r[0] == "log-everything" and r[2] == f"{library} {model}" for r in rows)
        assert any(r[0] == "statistics" and r[2] == f"{library} MLP" for r in rows)
    for r in rows:
        assert r[7] in ("ok", "report") or re.fullmatch(r"over by [\d.]+(%| µs)", r[7]), r
    for library in LIBRARIES:
        assert any(r[1].startswith("A/A") and r[2] == f"{library} MLP" for r in rows), library
    # The statistics at each width: both ways of batching, each row with its spread.
    for width in (16, 32):
        model = f"Equinox MLP {width} (12 x Linear, batch 8, SGD)"
        labels = {r[1] for r in rows if r[2] == model}
        for idiom in ("your vmap", "the model's own vmap"):
            for statistic in ("mean/std/near-zero", "activation_stats() with histogram"):
                assert f"train step, {idiom}, {statistic} / plain" in labels, (model, idiom, statistic)
        assert all(re.match(r"rounds: min [\d.]+, max [\d.]+ over \d+", r[8]) for r in rows if r[2] == model)
    # The kernels the statistics add, counted in the compiled steps: reductions among
    # them, and more with the histogram than without.
    (kernels,) = [line for line in lines if line.startswith("- **Kernels the statistics add**")]
    added = [int(n) for n in re.findall(r": ([+-]\d+) \([\d.]+ per layer\)", kernels)]
    assert len(added) == 2 and 0 < added[0] < added[1], kernels
    assert re.search(r"YNNPACK reduce \+(\d+)", kernels) or re.search(r"XLA reduce \+(\d+)", kernels), kernels
    # The tiny models' jax.jit dispatch is explained by its floor, measured in the run.
    for library in LIBRARIES[1:]:
        label = "unhooked converted, jax.jit / raw jitted call"
        (jit,) = [r for r in rows if r[1] == label and r[2] == f"{library} tiny"]
        assert jit[8].startswith("the floor: a bare eqx.Module"), jit
    outputs = lines.index("## Outputs of the hooked variants against raw")
    end = next(i for i in range(outputs + 1, len(lines)) if lines[i].startswith("## "))
    diffs = [[c.strip() for c in line.strip("|").split("|")] for line in lines[outputs:end] if line.startswith("| ")]
    diffs = [d for d in diffs if d[0] not in ("model", "---")]
    assert {d[0].split()[0] for d in diffs} == set(LIBRARIES)
    for model, variant, diff, scale in diffs:
        assert float(scale) > 0 and float(diff) <= 1e-5 * float(scale), (model, variant, diff)
    assert any(line.startswith("- **Targets missed:") for line in lines)


@pytest.mark.bench
def test_quick_transformer_lens_bench_writes_its_page(tmp_path):
    """`--only transformer-lens --quick`: px's sweeps and TransformerLens's on a tiny
    GPT-2, every variant's row with its times, each px table equal to TransformerLens's
    (the run fails otherwise). Skipped, saying why, without build/tl-venv."""
    sys.path.insert(0, str(ROOT / "tests"))
    import transformer_lens_harness

    transformer_lens_harness.skip_unless_available()
    out = tmp_path / "benchmarks_transformer_lens.md"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--only", "transformer-lens", "--quick",
         "--out", str(out)],
        check=True, capture_output=True, text=True, timeout=600,
    )
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| sweep")]
    assert {(r[0], r[1]) for r in rows} == {
        (sweep, variant) for sweep in ("resid_pre", "head out")
        for variant in ("TransformerLens", "px", "px, metric of ln_f")
    }
    for r in rows:
        diff, scale = re.fullmatch(r"(\S+) \((\S+)\)", r[5]).groups()
        assert float(scale) > 0 and float(diff) <= 1e-5 * float(scale), r
