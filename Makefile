# Set-up, the default training run, and the test suite. Each target creates the virtual
# environment on first use, so `make run` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch 2.13.0, the version tested: the CPU build where pip's index serves one (the project's
# CI machines); PyPI's own Linux wheel is the multi-GB CUDA build, so elsewhere add
# TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU one. For a GPU:
# make run TORCH_SPEC="torch" ; the library itself only asks for torch>=2.4.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: setup run test lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	$(BIN)/python scripts/build_host_kernel.py  # the host kernels' C++ (host_adamw, host_tiered), built once here
	touch $(STAMP)

run: setup
	WANDB_MODE=$${WANDB_MODE:-offline} $(BIN)/moestack-train $(ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python scripts/lint_imports.py

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The suite in PYTEST_JOBS processes (pytest-xdist; each test file whole in one of them, so a
# module's fixtures are built once): its tests mostly wait on one core each (imports, small
# tensors, launched processes). PYTEST_JOBS=0 runs it in this process alone.
PYTEST_JOBS ?= 2

test: lint
	$(BIN)/python -m pytest -q -n $(PYTEST_JOBS) --dist loadfile --durations=25 $(PYTEST_ARGS)  # the slowest 25 listed: the suite must stay under 15 min on 2 cores

bench: setup
	$(BIN)/python scripts/bench_moe.py

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache .ruff_cache
