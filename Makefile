# Everything a newcomer needs: `make demo` and `make test` install from scratch on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of this torch lies on the CI machines' disk; on a GPU box pick your CUDA build here.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
# llama.cpp for the CPU engine, built from the sdist pinned in pyproject.toml: the library only, with
# its own thread pool (no second OpenMP runtime beside torch's), tuned to this machine's CPU; never a
# cached wheel, which may have been built with other flags.
LLAMA_CPP := $(shell grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml)
LLAMA_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=OFF

.PHONY: install models demo test protos clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	@echo "compiling $(LLAMA_CPP): a few minutes; every 25th of llama.cpp's build steps is shown (full log: $(VENV)/llama-cpp-build.log)"
	bash -o pipefail -c 'CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install -v --no-cache-dir "$(LLAMA_CPP)" 2>&1 \
		| tee $(VENV)/llama-cpp-build.log | { grep --line-buffered -oE "^\s*\[[0-9]*(25|50|75|00)/[0-9]+\]" || true; }' \
		|| { tail -25 $(VENV)/llama-cpp-build.log; exit 1; }
	@echo "  llama.cpp built"
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
