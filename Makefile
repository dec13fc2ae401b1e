# One command each: `make test` (set up .venv if missing, lint, type-check, run every test) and `make serve`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
REPOSITORY ?= model_repository
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install lint test test-fast serve clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,fast,ray]'
	touch $@

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	scripts/install-browser.sh
	$(BIN)/pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/pytest -m "not slow" $(PYTEST_ARGS)

# The embedded default model: trained offline (scikit-learn's bundled digits) and exported, only when missing.
$(REPOSITORY)/digits:
	$(BIN)/visionserve train --out checkpoints/digits.pt
	$(BIN)/visionserve export --checkpoint checkpoints/digits.pt --name digits --repository $(REPOSITORY)

serve: $(STAMP) $(REPOSITORY)/digits
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
