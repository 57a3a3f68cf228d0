# One-command setup: every target that needs Python first makes sure .venv is installed.
# The venv is (re)built only when one of its inputs changed, so a second run spends no time on setup.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test test-fast lint format quickstart clean

$(STAMP): setup.py requirements/*.txt tools/install_venv.sh
	bash tools/install_venv.sh $(VENV)
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The CI command: lint, then every test that does not need a GPU.
test: lint
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

# The inner loop: skip tests marked slow.
test-fast: lint
	$(PY) -m pytest -m "not gpu and not slow" $(PYTEST_ARGS)

quickstart: $(STAMP)
	$(PY) -m userrl_megatron train --config configs/quickstart.yaml

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
