#!/usr/bin/env bash
# GPU check: VH-GPO and GRAFT steps under FSDP2 in bf16 on all visible GPUs, tokens/s and MFU
# (gpu_check.py), then the vLLM engine checks, one PASS/FAIL line each (gpu_check_vllm.py:
# vLLM's log-probs against the policy's, seeded sampling, weight sync through sleep/wake, three
# engines in one process, 3 updates of GRPO, VH-GPO and GRAFT with backend vllm). No internet:
# random-init models. Budget: under 8 minutes on one GPU (200 s + 280 s; override with
# GPU_CHECK_UPDATE_S / GPU_CHECK_VLLM_S). Extra arguments go to gpu_check.py (e.g.
# --peak-tflops 989); --smoke-cpu goes to both.
#   bash benchmarks/gpu_check.sh            # on a GPU machine with salvage[gpu] installed
#   bash benchmarks/gpu_check.sh --smoke-cpu   # tiny shapes on CPU: checks the scripts only
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
export OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 SALVAGE_PROGRESS=0
export VLLM_ENABLE_V1_MULTIPROCESSING=0   # the engine lives in the trainer's process (weight sync)
export GPU_CHECK_DIR=${GPU_CHECK_DIR:-$(mktemp -d -t salvage-gpu-check-XXXX)}
SMOKE=()
for a in "$@"; do [ "$a" = "--smoke-cpu" ] && SMOKE=(--smoke-cpu); done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
rc=0
timeout "${GPU_CHECK_UPDATE_S:-200}" "$PY" benchmarks/gpu_check.py "$@" || rc=$?
timeout "${GPU_CHECK_VLLM_S:-280}" "$PY" benchmarks/gpu_check_vllm.py ${SMOKE[@]+"${SMOKE[@]}"} || rc=$?
exit $rc
