# One command each: `make test` (set up .venv if missing, lint, type-check, run every test) and `make serve`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two installs. `make serve` builds .venv-serve with what serving an ONNX model needs and nothing of torch (the core
# and `fast`, with onnxruntime's CPU build, or its CUDA build where an NVIDIA device exists): ~20 s, ~360 MB.
# `make install` / `make test` build .venv with everything a developer uses (`dev`: torch, training, export, the
# command-line tools and the tests' tools, and Ray). onnxruntime and onnxruntime-gpu are one module: one per venv.
SERVE_VENV := .venv-serve
SERVE_BIN := $(SERVE_VENV)/bin
SERVE_EXTRAS ?= $(if $(wildcard /dev/nvidia0),gpu,cpu),fast
SERVE_STAMP := $(SERVE_VENV)/.installed
STAMP := $(VENV)/.installed
PIP = python -m pip install --quiet --disable-pip-version-check -c constraints.txt
PIP_INSTALL = $(BIN)/$(PIP)
PYTEST_ARGS ?=
REPOSITORY ?= model_repository
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: install install-dev install-serve lint test test-slow test-fast test-fast-models test-serve-only serve default-model clean

$(SERVE_STAMP): pyproject.toml constraints.txt
	test -x $(SERVE_BIN)/python || $(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_BIN)/$(PIP) -e '.[$(SERVE_EXTRAS)]'
	touch $@

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[dev,fast,ray]'
	touch $@

# Everything a developer uses (train, export, bench, loadtest, tune, the tests' tools); `make install-serve` for
# the serving install alone.
install: $(STAMP)

install-dev: $(STAMP)

install-serve: $(SERVE_STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Everything: lint, types, the whole suite in .venv (scripts/test-suite.sh: the tests that only wait on processes
# side by side in TEST_WORKERS processes, then the tests that judge timing or load alone), then the serving install
# built from scratch and used as a user would (test-serve-only).
TEST_WORKERS ?= 2
test: lint
	scripts/install-browser.sh
	scripts/install-video.sh
	BIN=$(BIN) TEST_WORKERS=$(TEST_WORKERS) scripts/test-suite.sh $(PYTEST_ARGS)
	$(MAKE) test-serve-only

# The whole suite as a machine about half as fast runs it (docs/testing.md, "On a slower machine"): every process of
# both phases pinned to one core (SLOW_CPUS, a taskset list), the workers and the servers sharing it. SLOW_HOGS=N
# adds N busy loops on the same cores for the run, each taking about an equal share of them (one: half again).
SLOW_CPUS ?= 0
SLOW_HOGS ?= 0
test-slow: lint
	scripts/install-browser.sh
	scripts/install-video.sh
	hogs=""; for i in $$(seq 1 $(SLOW_HOGS)); do taskset -c $(SLOW_CPUS) sh -c 'while :; do :; done' & \
		hogs="$$hogs $$!"; done; \
	BIN=$(BIN) TEST_WORKERS=$(TEST_WORKERS) taskset -c $(SLOW_CPUS) scripts/test-suite.sh $(PYTEST_ARGS); \
	status=$$?; [ -z "$$hogs" ] || kill $$hogs; exit $$status

test-fast: $(STAMP)
	$(BIN)/pytest -m "not slow" $(PYTEST_ARGS)

# The server-level tests with every model but the trained digits served by the noop runtime (docs/testing.md):
# proves that no test depends on how long a real model takes.
test-fast-models: $(STAMP)
	VISIONSERVE_TEST_FAST_MODELS=1 $(BIN)/pytest tests/http tests/grpc tests/reliability tests/loadtest \
		tests/service/test_aoti_served.py $(PYTEST_ARGS)

# The embedded default models ship exported (examples/model_repository/digits, the classifier, digits-detect, the
# detector, and digits-segment, the segmenter: model.onnx, spec.json, config.toml and its training record); `make
# serve` copies each into the repository when that has none of that name yet.
$(REPOSITORY)/digits $(REPOSITORY)/digits-detect $(REPOSITORY)/digits-segment:
	mkdir -p $(REPOSITORY)
	cp -R examples/model_repository/$(notdir $@) $@

serve: $(SERVE_STAMP) $(REPOSITORY)/digits $(REPOSITORY)/digits-detect $(REPOSITORY)/digits-segment
	$(SERVE_BIN)/visionserve serve --repository $(REPOSITORY) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# Make the shipped default models again with the project's own train and export (needs `make install`);
# scripts/default_model.py --check holds the shipped one to a fresh run (a test runs it).
default-model: $(STAMP)
	$(BIN)/python scripts/default_model.py

# The serving install from scratch, and what a user does with it (tests/serve_only.py; no pytest there).
test-serve-only:
	rm -rf $(SERVE_VENV)
	$(MAKE) install-serve
	$(SERVE_BIN)/python tests/serve_only.py

clean:
	rm -rf $(VENV) $(SERVE_VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis

# Every GPU path in one command (docs/gpu-check.md): `make gpu-check` on a GPU machine, `make gpu-check DRY_RUN=1`
# for the same steps on the CPU with tiny sizes. No install step: a GPU machine has no package index; what it lacks
# comes from wheels carried in .whl/.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_CHECK_ARGS ?=
.PHONY: gpu-check
gpu-check:
	$(GPU_PYTHON) -m service.bench.gpu_check $(if $(DRY_RUN),--dry-run) $(GPU_CHECK_ARGS)

# The GPU's own speed figures in one command of at most 8 minutes (docs/gpu-check.md, "make gpu-speed"): resnet50
# served from JPEG bytes beside its in-process limit and LitServe; `make gpu-speed DRY_RUN=1` on the CPU.
GPU_SPEED_ARGS ?=
.PHONY: gpu-speed
gpu-speed:
	$(GPU_PYTHON) -m service.bench.gpu_speed $(if $(DRY_RUN),--dry-run) $(GPU_SPEED_ARGS)

# The wheels the GPU machine lacks, for its Python (GPU_PY_VERSION), into .whl/ (kept out of git): the list is
# service/bench/wheels.py's, which tests/test_gpu_check.py checks against every import of the serving path.
GPU_PY_VERSION ?= 3.12
.PHONY: gpu-wheels
gpu-wheels:
	grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
	$$($(GPU_PYTHON) -m service.bench.gpu_check --list-wheels $(GPU_PY_VERSION))
