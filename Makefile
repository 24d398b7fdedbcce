# Everything a fresh machine needs: `make demo`, `make test`, `make docs`, `make lint`,
# `make bench` (`make bench-check`: its smoke run); `make check-core` checks the no-extras install in a venv of its own.
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

# The first Python >= 3.12 that actually runs (pyenv shims can exist without a usable version).
FIND_PYTHON := for c in $(PYTHON) python3.13 python3.12 python3 \
	$(wildcard $(HOME)/.pyenv/versions/3.1[2-9]*/bin/python3) \
	$(wildcard /usr/local/bin/python3.1[2-9]) $(wildcard /usr/bin/python3.1[2-9]); do \
	  if $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then echo $$c; break; fi; \
	done
NEW_VENV = py=$$($(FIND_PYTHON)); \
	if [ -z "$$py" ]; then echo "error: peex_interop needs Python >= 3.12; none found (set PYTHON=/path/to/python3.12)" >&2; exit 1; fi; \
	echo "using $$py"; $$py -m venv

.PHONY: demo test docs lint bench bench-check check-core clean

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

bench: $(STAMP)
	$(PY) benchmarks/bench.py --out docs/benchmarks.md

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

clean:
	rm -rf $(VENV) $(CORE_VENV) site
