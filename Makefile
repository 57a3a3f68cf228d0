# One-command setup: every target that needs Python first makes sure .venv is installed.
# The venv is (re)built only when one of its inputs changed, so a second run spends no time on setup.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Test processes (pytest-xdist): two use the two cores of the reference machine better than one, whose tests wait
# on servers and ranks for a third of the time. Each runs whole files on its own share of the cores, and so does
# everything it starts (tests/conftest.py). TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder
# Dotted overrides for `make quickstart`, e.g. ARGS="run.seed=1 run.name=quickstart-seed1".
ARGS ?=
# The real SGLang server's own interpreter (its wheel pins a CUDA-only torch, so it cannot share .venv).
SGLANG_VENV ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed

.PHONY: install sglang test test-under-load test-fast lint format quickstart sft-quickstart gpu-check clean

$(STAMP): setup.py requirements/runtime.txt requirements/dev.txt requirements/models.txt requirements/grammar.txt \
		tools/install_venv.sh tools/venv_torch.sh
	bash tools/install_venv.sh $(VENV)
	touch $(STAMP)

install: $(STAMP)

$(SGLANG_STAMP): requirements/sglang-cpu.txt requirements/sglang-nodeps.txt tools/install_sglang_venv.sh tools/venv_torch.sh
	bash tools/install_sglang_venv.sh $(SGLANG_VENV)
	touch $(SGLANG_STAMP)

sglang: $(SGLANG_STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The CI command: lint, then every test that does not need a GPU (the conformance suite also runs real SGLang).
# The 25 slowest tests close the report: the suite's budget is 45 minutes on 2 cores.
test: lint $(SGLANG_STAMP)
	$(PY) -m pytest -m "not gpu" $(XDIST) --durations=25 $(PYTEST_ARGS)

# The same suite while one busy process a core competes for the CPU (tools/under_load.py starts and stops them):
# a test that passes only on an idle machine fails here. LOAD_WORKERS sets how many (default: one a core).
LOAD_WORKERS ?=
test-under-load: lint $(SGLANG_STAMP)
	$(PY) tools/under_load.py $(if $(LOAD_WORKERS),--workers $(LOAD_WORKERS)) -- $(PY) -m pytest -m "not gpu" $(XDIST) $(PYTEST_ARGS)

# The inner loop: skip tests marked slow.
test-fast: lint $(SGLANG_STAMP)
	$(PY) -m pytest -m "not gpu and not slow" $(XDIST) $(PYTEST_ARGS)

quickstart: $(STAMP)
	$(PY) -m userrl_megatron train --config configs/quickstart.yaml $(ARGS)

# SFT on expert FunctionGym episodes, then GRPO from the SFT checkpoint, then GRPO from the base model to compare.
sft-quickstart: $(STAMP)
	$(PY) -m userrl_megatron sft --config configs/sft_quickstart.yaml $(ARGS)
	$(PY) -m userrl_megatron train --config configs/sft_quickstart.yaml run.name=sft_quickstart_grpo \
		checkpoint.resume=runs/sft_quickstart/checkpoints $(ARGS)
	$(PY) -m userrl_megatron train --config configs/sft_quickstart.yaml run.name=sft_quickstart_base_grpo $(ARGS)

# The single-GPU check (docs/gpu.md): a smoke sequence and tests/gpu, printed as a table and written as JSON
# (runs/gpu_check/report.json). It builds no venv (a lent GPU machine has no network): .venv's python when there is
# one, else python3. ARGS passes its flags, e.g. ARGS="--device cpu" (the CI size) or ARGS="--out DIR/report.json".
GPU_CHECK_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_CHECK_PY) tools/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) $(SGLANG_VENV) runs .pytest_cache .ruff_cache
