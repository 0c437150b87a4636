# Everything a newcomer needs: `make demo` and `make test` install from scratch on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of this torch lies on the CI machines' disk; on a GPU box pick your CUDA build here.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install models demo test protos clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

models: install
	$(BIN)/hybridspec models pull

demo: models
	$(BIN)/hybridspec demo

test: models
	$(BIN)/python -m pytest

protos: install
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
