# The two commands a new user needs: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEMO   ?= .cache/models/demo

.PHONY: run test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: its CPU wheel lies on disk; a range would pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0

$(VENV)/.installed: $(PY) pyproject.toml
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e '.[test]'
	touch $@

$(DEMO)/config.json: | $(VENV)/.installed
	$(VENV)/bin/poise make-model $(DEMO) --size small

run: $(VENV)/.installed $(DEMO)/config.json
	$(VENV)/bin/poise generate --model $(DEMO) --max-tokens 48

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports

test: lint
	$(VENV)/bin/pytest -q

bench: $(VENV)/.installed-test
	$(PY) benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) .cache
