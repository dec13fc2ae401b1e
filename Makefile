# One command each: `make test` (set up .venv if missing, lint, type-check, run every test) and `make serve`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two installs: serving needs only the core packages and the fast HTTP parser (`make serve`); the tests add the dev
# tools and Ray (`make test`). A test install also satisfies serving, so its recipe touches both stamps.
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed
PIP_INSTALL = $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt
PYTEST_ARGS ?=
REPOSITORY ?= model_repository
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install install-dev lint test test-fast test-fast-models serve clean

$(SERVE_STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[fast]'
	touch $@

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[dev,fast,ray]'
	touch $(SERVE_STAMP) $@

# What serving needs (the README's quick start); `make install-dev` for the tests' tools and Ray as well.
install: $(SERVE_STAMP)

install-dev: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	scripts/install-browser.sh
	$(BIN)/pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/pytest -m "not slow" $(PYTEST_ARGS)

# The server-level tests with every model but the trained digits served by the noop runtime (docs/testing.md):
# proves that no test depends on how long a real model takes.
test-fast-models: $(STAMP)
	VISIONSERVE_TEST_FAST_MODELS=1 $(BIN)/pytest tests/http tests/grpc tests/reliability tests/loadtest \
		tests/service/test_aoti_served.py $(PYTEST_ARGS)

# The embedded default model: trained offline (scikit-learn's bundled digits) and exported, only when missing.
$(REPOSITORY)/digits: | $(SERVE_STAMP)
	$(BIN)/visionserve train --out checkpoints/digits.pt
	$(BIN)/visionserve export --checkpoint checkpoints/digits.pt --name digits --repository $(REPOSITORY)

serve: $(SERVE_STAMP) $(REPOSITORY)/digits
	$(BIN)/visionserve serve --repository $(REPOSITORY) --host $(HOST) --port $(PORT)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis

# Every GPU path in one command (docs/gpu-check.md): `make gpu-check` on a GPU machine, `make gpu-check DRY_RUN=1`
# for the same steps on the CPU with tiny sizes. No install step: a GPU machine has no package index; what it lacks
# comes from wheels carried in .whl/.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_CHECK_ARGS ?=
.PHONY: gpu-check
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py $(if $(DRY_RUN),--dry-run) $(GPU_CHECK_ARGS)
