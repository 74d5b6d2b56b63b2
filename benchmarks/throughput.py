"""Rollout and update throughput of salvage's GRPO path, for `tiny` and SmolLM2.

Runs the real training loop (GRPOModule + RLVRDataModule + HF engine) for a few updates
per model and reads the module's own `perf/*` metrics; the first update is warm-up and
is dropped. Prints a table. Not a test.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/throughput.py [--steps 3] [--models tiny smollm2-135m-instruct]

Times on a shared 2-core machine are noisy: compare rows measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lightning as L  # noqa: E402

from salvage.callbacks.cost import CostTracker  # noqa: E402
from salvage.datamodules.rlvr import RLVRDataModule  # noqa: E402
from salvage.models import PolicySpec  # noqa: E402
from salvage.modules.grpo import GRPOModule  # noqa: E402
from salvage.rollout.config import EngineConfig  # noqa: E402
from salvage.tasks.math import MathData  # noqa: E402


class _Grab(L.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:  # noqa: ANN001
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def measure(model: str, steps: int, prompts: int, n: int, new_tokens: int) -> dict[str, float]:
    module = GRPOModule(policy=PolicySpec(model), lr=1e-6, num_minibatches=2, micro_batch_size=8)
    data = RLVRDataModule(
        train=MathData(source="reasoning_gym:basic_arithmetic", size=200),
        prompts_per_step=prompts,
        group_size=n,
        max_prompt_tokens=256,
        engine=EngineConfig(max_new_tokens=new_tokens),
    )
    grab = _Grab()
    with tempfile.TemporaryDirectory() as d:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[CostTracker(), grab],
            default_root_dir=d,
        )
        t0 = time.perf_counter()
        trainer.fit(module, datamodule=data)
        wall = time.perf_counter() - t0
    rows = grab.rows[1:] or grab.rows
    med = lambda k: statistics.median(r[k] for r in rows if k in r)  # noqa: E731
    return {
        "params_M": sum(p.numel() for p in module.policy.parameters()) / 1e6,
        "rollout_tok_s": med("perf/rollout_tokens_per_s"),
        "update_tok_s": med("perf/update_tokens_per_s"),
        "step_s": med("perf/step_s"),
        "resp_len": med("rollout/response_len"),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m-instruct"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    results = {m: measure(m, a.steps, a.prompts, a.n, a.new_tokens) for m in a.models}
    print(
        f"\nGRPO throughput, {a.prompts} prompts x {a.n} samples x <= {a.new_tokens} new tokens, "
        f"median of updates 2..{a.steps}, threads={os.environ.get('OMP_NUM_THREADS', 'default')}"
    )
    cols = ["params_M", "rollout_tok_s", "update_tok_s", "step_s", "resp_len", "wall_s"]
    print("| model | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for m, r in results.items():
        print(f"| {m} | " + " | ".join(f"{r[c]:.3g}" for c in cols) + " |")


if __name__ == "__main__":
    main()
