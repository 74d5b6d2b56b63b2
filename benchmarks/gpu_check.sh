#!/usr/bin/env bash
# GPU check: VH-GPO and GRAFT steps under FSDP2 in bf16 on all visible GPUs, tokens/s and MFU
# (gpu_check.py), then the vLLM engine checks, one PASS/FAIL line each (gpu_check_vllm.py:
# vLLM's log-probs against the policy's, seeded sampling, weight sync through sleep/wake, three
# engines in one process, 3 updates of GRPO, VH-GPO and GRAFT with backend vllm). No internet:
# random-init models. Budget: under 8 minutes on one GPU (200 s + 280 s; override with
# GPU_CHECK_UPDATE_S / GPU_CHECK_VLLM_S). Extra arguments go to gpu_check.py (e.g.
# --peak-tflops 989); --smoke-cpu goes to all three.
# Then the FSDP2 checks (gpu_check_fsdp.py), one PASS/FAIL line each: N GPUs equal one GPU (TF32
# off; parameters moved; no skipped update; every rank reaches the end), the same with CPU
# offload, a replicated reference, activation checkpointing and reshard_after_forward false;
# distributed checkpoint save -> resume -> export; one update of every shipped GPU config at
# full size (random init) with its measured peak against the --print_memory estimate (SKIP where
# the node has fewer GPUs than the config's header states). Budget: GPU_CHECK_FSDP_S per run
# (120 s); GPU_CHECK_CONFIGS=0 skips the config updates. Never run on a GPU yet.
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

# ---- FSDP2 checks (PASS/FAIL lines; a FAIL line makes the exit status 1)
D="$GPU_CHECK_DIR/fsdp"
T=${GPU_CHECK_FSDP_S:-120}
F=("$PY" benchmarks/gpu_check_fsdp.py ${SMOKE[@]+"${SMOKE[@]}"})
if [ ${#SMOKE[@]} -gt 0 ]; then
  N=2; T=${GPU_CHECK_FSDP_S:-900}; VARIANTS="replicate ckpt noreshard"   # no offload on CPU
  CONFIGS="configs/grpo/graft_pair1_qwen3.yaml"
else
  N=$("$PY" -c "import torch; print(torch.cuda.device_count())"); VARIANTS="offload replicate ckpt noreshard"
  CONFIGS=$(cd configs && grep -rlE "^\s+accelerator: (auto|gpu)" --include=*.yaml . | sed 's|^\./|configs/|' | grep -v '^configs/trainer/' | sort)
fi
fsdp_out="$GPU_CHECK_DIR/fsdp.log"
run() { timeout "$T" "${F[@]}" "$@" >>"$fsdp_out" 2>&1 || echo "FAIL gpu_check_fsdp.py $*: exit $? (see $fsdp_out)"; }
judge() { "${F[@]}" "$@" 2>>"$fsdp_out" || echo "FAIL gpu_check_fsdp.py $*: exit $? (see $fsdp_out)"; }
{
  run step "$D/one" --devices 1
  run step "$D/base" --devices "$N"
  judge compare "$D/one" "$D/base" --name "on $N GPU(s)"
  judge done "$D/base" "$N" --name "base"
  for v in $VARIANTS; do
    run step "$D/$v" --devices "$N" --variant "$v"
    judge compare "$D/one" "$D/$v" --name "$v on $N GPU(s)"
    judge done "$D/$v" "$N" --name "$v"
  done
  run step "$D/ck1" --devices "$N" --checkpoint --steps 1
  run step "$D/ck2" --devices "$N" --checkpoint --steps 2 --resume "$D/ck1/checkpoints/last.ckpt"
  judge export "$D/ck2/checkpoints/last.ckpt" "$D/ck2" "$D/ck2" --steps 2
  if [ "${GPU_CHECK_CONFIGS:-1}" != 0 ]; then
    for c in $CONFIGS; do run config "$c"; { grep -hE "^(PASS|FAIL|SKIP) one update of $c" "$fsdp_out" || true; } | tail -1; done
  fi
} | tee "$GPU_CHECK_DIR/fsdp_checks.txt"
grep -q '^FAIL' "$GPU_CHECK_DIR/fsdp_checks.txt" && rc=1
exit $rc
