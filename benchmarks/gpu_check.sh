#!/usr/bin/env bash
# GPU check (issue 7): VH-GPO and GRAFT steps under FSDP2 in bf16 on all visible GPUs, the vLLM
# engine if vllm is importable, tokens/s and MFU. No internet: random-init Qwen2.5-0.5B/1.5B shapes.
# Budget: under 8 minutes on one GPU. Extra arguments go to gpu_check.py (e.g. --peak-tflops 989).
#   bash benchmarks/gpu_check.sh            # on a GPU machine with salvage installed
#   bash benchmarks/gpu_check.sh --smoke-cpu   # tiny shapes on CPU: checks the script only
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
export OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 SALVAGE_PROGRESS=0
export VLLM_ENABLE_V1_MULTIPROCESSING=0   # the engine lives in the trainer's process (weight sync)
export GPU_CHECK_DIR=${GPU_CHECK_DIR:-$(mktemp -d -t salvage-gpu-check-XXXX)}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
timeout 480 "$PY" benchmarks/gpu_check.py "$@"
