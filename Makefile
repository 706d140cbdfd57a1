# Two entry points for a fresh machine: `make demo` (set up + quickstart) and `make test` (set up + tests).
# torch is installed first, pinned, so pip never pulls a multi-GB CUDA build onto a CPU machine.
# Override for a GPU machine, e.g.:
#   make demo TUNELAB_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TUNELAB_TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install $(TUNELAB_TORCH)
	$(BIN)/python -m pip install -e ".[test]"
	$(BIN)/python scripts/build_deepspeed_ops.py
	touch $@

demo: setup
	$(BIN)/tunelab train examples/quickstart.yaml overwrite_output_dir=true

# pytest-xdist: one worker per core (at most 4), whole test files per worker (their shared fixtures stay together),
# in tests/conftest.py's order (the files of end-to-end tests first); it gives each worker one torch thread.
# A plain `pytest` runs serially.
PYTEST_PARALLEL ?= -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

test: setup
	$(BIN)/python -m pytest $(PYTEST_PARALLEL)

# No subprocess, no training run beyond a few steps: the inner loop.
test-fast: setup
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m "not slow"

# The peer comparison (docs/benchmarks.md): the peers' venvs once (~5 min, idempotent), then every
# workload on the proxy models, 3 repeats of 30 steps (~45 min on 2 cores), then the real model, SmolLM2-135M-Instruct
# (bench/real_model.sh, ~3 h: fp32, and bf16 on a CPU that has it; GRPO against TRL). Arguments for bench/run.py:
# make bench BENCH_ARGS="..."; only the real model: bash bench/real_model.sh
bench: setup
	bash bench/peers/setup.sh
	$(BIN)/python bench/run.py $(BENCH_ARGS)
	bash bench/real_model.sh

clean:
	rm -rf $(VENV) saves outputs .pytest_cache
