# Everything a newcomer needs: `make demo` and `make test` install from scratch on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# pip also looks here for torch: PyTorch's CPU builds, so a CPU-only box gets the CPU wheel (about
# 200 MB) instead of PyPI's CUDA build (several GB). A GPU box names its CUDA build instead:
#   make TORCH_INDEX=https://download.pytorch.org/whl/cu128 demo
# (Where that host is unreachable, pip says so and goes on with its usual index: CI's disk holds the CPU wheel.)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.installed
# llama.cpp for the CPU engine, built from the sdist pinned in pyproject.toml: the library only, with
# its own thread pool (no second OpenMP runtime beside torch's), tuned to this machine's CPU; never a
# cached wheel, which may have been built with other flags.
LLAMA_CPP := $(shell grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml)
LLAMA_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=OFF

.PHONY: install models demo test test-fast protos clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@echo "installing $(TORCH), from $(TORCH_INDEX) where reachable"
	$(BIN)/pip install --progress-bar on "$(TORCH)" --extra-index-url "$(TORCH_INDEX)"
	@$(BIN)/python -c "import torch; print('  torch', torch.__version__, 'with CUDA' if torch.version.cuda else '(CPU build)')"
	@echo "compiling $(LLAMA_CPP): a few minutes; every 25th of llama.cpp's build steps is shown (full log: $(VENV)/llama-cpp-build.log)"
	bash -o pipefail -c 'CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install -v --no-cache-dir "$(LLAMA_CPP)" 2>&1 \
		| tee $(VENV)/llama-cpp-build.log | { grep --line-buffered -oE "^\s*\[[0-9]*(25|50|75|00)/[0-9]+\]" || true; }' \
		|| { tail -25 $(VENV)/llama-cpp-build.log; exit 1; }
	@echo "  llama.cpp built"
	@echo "installing hybridspec and its dependencies (ray, transformers, grpcio, …; each download is listed)"
	@# PYTHONWARNINGS: setuptools warns at every editable install that a folder named like a package could shadow it.
	bash -o pipefail -c 'PYTHONWARNINGS=ignore $(BIN)/pip install -e ".[dev]" 2>&1 \
		| { grep --line-buffered -E "^ *(Downloading|Successfully installed|ERROR|WARNING)" | cut -c1-150 || true; }'
	touch $(STAMP)

models: install
	$(BIN)/hybridspec models pull

demo: models
	$(BIN)/hybridspec demo

# The full tier (what CI runs): every test. The fast tier, before every commit: every package's core
# behaviour in a few minutes, without the tests marked slow (Ray clusters, subprocess pipelines,
# statistical tests of many thousand draws).
test: models
	$(BIN)/python -m pytest

test-fast: models
	$(BIN)/python -m pytest -m "not slow"

protos: install
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
