# The two commands a new user needs: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEMO   ?= .cache/models/demo
HOST   ?= 127.0.0.1
PORT   ?= 8000

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

# The demo model is trained here once (about 3 minutes on the CPU), then reused.
$(DEMO)/training.json: | $(VENV)/.installed
	$(VENV)/bin/poise make-model $(DEMO) --train

run: $(VENV)/.installed $(DEMO)/training.json
	$(VENV)/bin/poise up --model $(DEMO) --replicas 2 --host $(HOST) --port $(PORT)

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports

test: lint
	$(VENV)/bin/pytest -q

bench: $(VENV)/.installed-test
	$(PY) benchmarks/engine_throughput.py
	$(PY) benchmarks/serve_overload.py

clean:
	rm -rf $(VENV) .cache
