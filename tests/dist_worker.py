"""Real datamodules and callbacks on 1 or 2 processes (run by test_batch_semantics_dist.py).

    python tests/dist_worker.py {grpo_math|vhgpo|graft_eval|grpo_eval} OUT_DIR --devices {1|2} [--select first|random]

``--devices 2`` runs under Lightning's ``ModelParallelStrategy`` (FSDP2, gloo on CPU; Lightning
re-launches this script for rank 1). Every rank writes what the test compares:

- ``grpo_math``: one GRPO update on reasoning-gym arithmetic with ``prompts_per_step 5``;
  ``tasks_<rank>.json`` = the task ids of the rank's rollout batch.
- ``vhgpo``: one VH-GPO update on the scripted environment (every group zero-signal, 5 tasks
  per update, ``max_groups 2``); ``relays.jsonl`` / ``relays.rank1.jsonl`` = the searched
  groups, ``metrics_<rank>.json`` = the logged metrics.
- ``graft_eval``: ``validate`` of a GRAFT pair on two benchmarks (5 + 2 problems, so the
  distributed sampler pads rank 1 with a copy of the first problem) with a verifier that
  accepts exactly the odd answers; ``metrics_<rank>.json`` = the logged metrics,
  ``gathered_<rank>.json`` = per rollout, the sampling policy and which policies are gathered.
- ``grpo_eval``: the same validation of one GRPO policy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from salvage.distributed import world  # noqa: E402
from salvage.models import PolicySpec  # noqa: E402
from salvage.rollout.config import EngineConfig  # noqa: E402
from salvage.tasks.math import MathData, Reward, RewardResult  # noqa: E402
from salvage.types import RolloutBatch  # noqa: E402


class OddAnswers(Reward):
    """A verifier whose verdict depends on the problem only (its answer is odd): evaluation
    scores are then fixed numbers, whatever the samples, so one and two processes must agree
    exactly and the expected aggregate is worked out by hand in the test."""

    def __call__(self, response: str, answer: str) -> RewardResult:
        ok = int(answer) % 2 == 1
        return RewardResult(reward=float(ok), success=ok)


class Capture(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if isinstance(batch, RolloutBatch):
            ids = [g.task_id for g in batch.groups]
            (self.out / f"tasks_{trainer.global_rank}.json").write_text(json.dumps(ids))


def _bench(path: Path, answers: list[int]) -> MathData:
    rows = [{"problem": f"What is {a - 1} + 1?", "answer": str(a)} for a in answers]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return MathData(source=str(path))


def _eval_data(out: Path, engine: Any) -> dict[str, Any]:
    """The evaluation runs' datamodule arguments (two benchmarks, odd answers rewarded)."""
    return dict(
        train=MathData(size=8, seed=0),
        val=[
            _bench(out / "bench1.jsonl", [1, 2, 3, 4, 5]),
            _bench(out / "bench2.jsonl", [6, 7]),
        ],
        prompts_per_step=2,
        group_size=2,
        engine=engine,
        val_samples=2,
        val_batch_size=2,
        reward=OddAnswers(),
    )


def record_gathered(module: Any, data: Any, out: Path) -> None:
    """Wrap ``data.rollout`` (the real one still runs) to write, per call, which policy
    samples and which of the two are gathered meanwhile, to ``OUT_DIR/gathered_<rank>.json``."""
    from salvage.distributed import is_gathered

    real = data.rollout
    seen: list[dict] = []

    def rollout(*a: Any, engine: Any = None, **kw: Any) -> Any:
        seen.append(
            {
                "sampler": "a" if engine.model is module.a.policy else "b",
                "a": is_gathered(module.a.policy),
                "b": is_gathered(module.b.policy),
            }
        )
        (out / f"gathered_{world()[0]}.json").write_text(json.dumps(seen))
        return real(*a, engine=engine, **kw)

    data.rollout = rollout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["grpo_math", "vhgpo", "graft_eval", "grpo_eval"])
    ap.add_argument("out")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--select", default="first", choices=["first", "random"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    kw: dict = {}
    if args.devices > 1:
        from lightning.pytorch.strategies import ModelParallelStrategy

        kw["strategy"] = ModelParallelStrategy(
            data_parallel_size=args.devices, tensor_parallel_size=1
        )
    callbacks: list = [Capture(out)]
    engine = EngineConfig(temperature=1.0, top_p=1.0, max_new_tokens=4)
    if args.kind == "grpo_math":
        from salvage.datamodules.rlvr import RLVRDataModule
        from salvage.modules.grpo import GRPOModule

        module = GRPOModule(policy=PolicySpec("tiny"), lr=1e-4, micro_batch_size=8)
        data = RLVRDataModule(
            train=MathData(size=40, seed=0),
            prompts_per_step=5,
            group_size=2,
            engine=engine,
            reward=OddAnswers(),
        )
    elif args.kind == "vhgpo":
        from salvage.callbacks.relay import VerifiedHandoff
        from salvage.core.agent import AgentFormat
        from salvage.core.relay import RelayConfig
        from salvage.datamodules.agent import EnvSpec
        from salvage.modules.vhgpo import VHGPOModule
        from tests.test_vhgpo import CFG, ORACLE, ScriptedAgentData

        module = VHGPOModule(policy=PolicySpec("tiny"), lr=1e-3, micro_batch_size=8)
        data = ScriptedAgentData(
            env=EnvSpec(
                name="scripted",
                kwargs={"max_steps": 8},
                train_tasks={"num_tasks": 10, "length": 5, "actions": ["a", "b", "c"]},
            ),
            agent=AgentFormat(history_k=1),
            max_turns=8,
            tasks_per_step=5,
            group_size=2,
        )
        relay = RelayConfig(**CFG, group_select=args.select)
        callbacks.append(VerifiedHandoff(relay=relay, teacher=ORACLE, seed=5))
    elif args.kind == "grpo_eval":
        from salvage.datamodules.rlvr import RLVRDataModule
        from salvage.modules.grpo import GRPOModule

        module = GRPOModule(policy=PolicySpec("tiny"), lr=1e-4, micro_batch_size=8)
        data = RLVRDataModule(**_eval_data(out, engine))
    else:
        from salvage.datamodules.graft import GraftDataModule
        from salvage.modules.graft import GRAFTModule

        module = GRAFTModule(
            policy_a=PolicySpec("tiny"),
            policy_b=PolicySpec("tiny", vocab_size=384, seed=1),
            lr=1e-4,
            micro_batch_size=8,
        )
        data = GraftDataModule(**_eval_data(out, engine))
        record_gathered(module, data, out)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(out),
        **kw,
    )
    if args.kind.endswith("_eval"):
        trainer.validate(module, datamodule=data)
    else:
        trainer.fit(module, datamodule=data)
    rank, _ = world()
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    (out / f"metrics_{rank}.json").write_text(json.dumps(metrics))
    print("done", args.kind, "rank", rank, file=sys.stderr)


if __name__ == "__main__":
    main()
