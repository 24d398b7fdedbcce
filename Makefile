# Everything a fresh machine needs: `make demo`, `make test`, `make docs`, `make lint`,
# `make bench` (`make bench-check`: its smoke run); `make check-core` checks the no-extras install in a venv of its own;
# `make test-floor` tests the oldest supported releases in another.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CORE_VENV := build/core-venv
# The Equinox-only test modules, and the adapters' (which skip without their library).
CORE_TESTS := tests/test_backward.py tests/test_depth.py tests/test_matrix_equinox.py \
	tests/test_property_architectures.py \
	tests/test_peex_compat.py tests/test_safety.py tests/test_selection.py \
	tests/test_transforms.py tests/test_packaging.py tests/test_haiku.py tests/test_nnx.py \
	tests/test_linen.py
FLOOR_VENV := build/floor-venv
FLOOR_STAMP := $(FLOOR_VENV)/.installed
# What `make test-floor` leaves out (about 30% of the suite's time): tests that add no
# version-dependent path to the ones it runs, which cover every transform, adapter,
# layout, hook and `_engine/_jax.py` item. What they exercise beyond those is documents,
# third-party models, jax.numpy arithmetic or plain Python, the same at every release:
# - the docs' snippets, the examples and the notebook: small models through the public
#   API, the kept tests' calls (and a check that the docs match the code);
# - Hugging Face's GPT-2/BERT and a Gemma-like NNX model (test_real_models): third-party
#   code (transformers pinned alike) through the linen/NNX adapters and attention sites
#   that test_linen, test_nnx and test_attention_sites check;
# - TransformerLens's numbers on HF's GPT-2 (test_transformer_lens): that model again,
#   through `px.cache` and `px.patch`, against a reference in a venv of its own;
# - statistics, their packing and their pytrees (test_diagnostics,
#   test_custom_pytree_stats, test_packing): jax.numpy arithmetic on logged values;
# - the lm1b port (test_port_lm1b): the reads and writes of test_port_metadata and
#   test_migration_matrix, composed;
# - packaging, the API reference and the path grammar (test_packaging, test_selection):
#   no JAX at all.
# TransformerLens, the reference of tests/test_transformer_lens.py (issue 48): the
# `transformer-lens` extra of pyproject.toml alone (not px) in a Python 3.11 venv, since
# the CPU torch wheel is for 3.11. Rebuilt when the extra's requirements change (the
# stamp holds them). Without a CPU torch wheel at hand (pip's find-links), pass
# TL_PIP_ARGS='--extra-index-url https://download.pytorch.org/whl/cpu', or pip fetches
# the CUDA build from PyPI.
TL_VENV := build/tl-venv
TL_STAMP := $(TL_VENV)/.installed
TL_PIP_ARGS ?=
FIND_PYTHON311 := for c in $(PYTHON311) python3.11 python3 \
	$(wildcard $(HOME)/.pyenv/versions/3.11*/bin/python3) \
	$(wildcard /usr/local/bin/python3.11) $(wildcard /usr/bin/python3.11); do \
	  if $$c -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' >/dev/null 2>&1; then echo $$c; break; fi; \
	done
TL_EXTRA := import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["transformer-lens"])
FLOOR_LEFT_OUT := tests/test_docs_and_examples.py tests/test_notebook.py tests/test_real_models.py \
	tests/test_transformer_lens.py \
	tests/test_diagnostics.py tests/test_custom_pytree_stats.py tests/test_packing.py \
	tests/test_port_lm1b.py tests/test_packaging.py tests/test_selection.py

# The first Python >= 3.12 that actually runs (pyenv shims can exist without a usable version).
FIND_PYTHON := for c in $(PYTHON) python3.13 python3.12 python3 \
	$(wildcard $(HOME)/.pyenv/versions/3.1[2-9]*/bin/python3) \
	$(wildcard /usr/local/bin/python3.1[2-9]) $(wildcard /usr/bin/python3.1[2-9]); do \
	  if $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then echo $$c; break; fi; \
	done
NEW_VENV = py=$$($(FIND_PYTHON)); \
	if [ -z "$$py" ]; then echo "error: peex_interop needs Python >= 3.12; none found (set PYTHON=/path/to/python3.12)" >&2; exit 1; fi; \
	echo "using $$py"; $$py -m venv

.PHONY: demo test docs lint bench bench-tl bench-check check-core test-floor tl-venv clean

$(STAMP): pyproject.toml
	@$(NEW_VENV) $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,demo,bench,docs,lint]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest

# The site goes to site/; --strict turns every warning (a broken link or reference) into a failure.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: $(STAMP)
	$(VENV)/bin/ruff check peex_interop tests examples benchmarks
	$(VENV)/bin/pyright peex_interop
	$(VENV)/bin/lint-imports

bench: $(STAMP)
	$(PY) benchmarks/bench.py --out docs/benchmarks.md

# px's patching sweeps against TransformerLens's, its own page (needs `make tl-venv`).
bench-tl: $(STAMP)
	$(PY) benchmarks/bench.py --only transformer-lens --out docs/benchmarks_transformer_lens.md

# The bench's smoke run (`--quick`: small models, a few repetitions) writes a complete page.
bench-check: $(STAMP)
	$(PY) -m pytest -m bench -n 0 tests/test_bench.py

# `pip install .` with no extras, in a fresh venv: only the core dependencies, no Haiku or
# Flax on import, then the Equinox tests there (test tools installed after the check).
check-core:
	rm -rf $(CORE_VENV)
	@$(NEW_VENV) $(CORE_VENV)
	$(CORE_VENV)/bin/python -m pip install --quiet .
	$(CORE_VENV)/bin/python .ci/check_core_install.py
	$(CORE_VENV)/bin/python -m pip install --quiet pytest pytest-xdist hypothesis peex==0.0.3
	$(CORE_VENV)/bin/python -m pytest -p no:cacheprovider $(CORE_TESTS)

# The test suite, less FLOOR_LEFT_OUT, at the oldest supported releases: the test extra
# installed with .ci/floor.txt as constraints (the floors `pyproject.toml` declares;
# everything else resolves to its newest release that fits them).
$(FLOOR_STAMP): pyproject.toml .ci/floor.txt
	rm -rf $(FLOOR_VENV)
	@$(NEW_VENV) $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install --quiet -c .ci/floor.txt -e '.[test]'
	touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP)
	$(FLOOR_VENV)/bin/python -m pytest -p no:cacheprovider -rs $(addprefix --ignore=,$(FLOOR_LEFT_OUT))

# Not a prerequisite of `make test`: without it, the TransformerLens comparisons skip.
tl-venv:
	@py=$$($(FIND_PYTHON311)); \
	if [ -z "$$py" ]; then echo "error: the TransformerLens venv needs Python 3.11; none found (set PYTHON311=/path/to/python3.11)" >&2; exit 1; fi; \
	reqs=$$($$py -c '$(TL_EXTRA)'); \
	if [ -f $(TL_STAMP) ] && [ "$$(cat $(TL_STAMP))" = "$$reqs" ]; then echo "$(TL_VENV) is up to date ($$reqs)"; exit 0; fi; \
	echo "using $$py: $$reqs"; \
	rm -rf $(TL_VENV) && $$py -m venv $(TL_VENV) && \
	$(TL_VENV)/bin/python -m pip install --quiet --upgrade pip && \
	$(TL_VENV)/bin/python -m pip install --quiet $(TL_PIP_ARGS) $$reqs && \
	echo "$$reqs" > $(TL_STAMP)

clean:
	rm -rf $(VENV) $(CORE_VENV) $(FLOOR_VENV) $(TL_VENV) site
