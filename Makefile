# Everything a fresh machine needs: `make demo`, `make test`, `make bench`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The first Python >= 3.12 that actually runs (pyenv shims can exist without a usable version).
FIND_PYTHON := for c in $(PYTHON) python3.13 python3.12 python3 \
	$(wildcard $(HOME)/.pyenv/versions/3.1[2-9]*/bin/python3) \
	$(wildcard /usr/local/bin/python3.1[2-9]) $(wildcard /usr/bin/python3.1[2-9]); do \
	  if $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then echo $$c; break; fi; \
	done

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	@py=$$($(FIND_PYTHON)); \
	if [ -z "$$py" ]; then echo "error: peex_interop needs Python >= 3.12; none found (set PYTHON=/path/to/python3.12)" >&2; exit 1; fi; \
	echo "using $$py"; $$py -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,demo,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) benchmarks/bench.py --out docs/benchmarks.md

clean:
	rm -rf $(VENV)
