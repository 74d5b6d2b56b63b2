"""TRL side of ``benchmarks/vs_trl.py`` and ``learning_vs_trl.py``: a few GRPO steps of TRL's
``GRPOTrainer``, timed, with the training reward of every generation batch.

Runs in TRL's own virtual environment (``.trl-venv``), started by ``vs_trl.py`` with
a JSON spec; writes one JSON result. Not meant to be run by hand.

    .trl-venv/bin/python benchmarks/_trl_side.py SPEC.json OUT.json

What is timed (one "RL step" = one generation batch of P prompts x G completions and the
optimiser steps TRL takes on it, ``steps_per_generation`` of them):

- rollout: ``GRPOTrainer._generate_and_score_completions`` (wrapped on the instance):
  chat template + tokenisation, ``model.generate``, decoding, the reward function
  (salvage's ``MathVerifyReward``, the same code the salvage side uses), group advantages,
  and the ``old_per_token_logps`` forward pass TRL runs when the policy changes inside a
  generation batch (``steps_per_generation > gradient_accumulation_steps``).
- update: for each optimiser step, ``on_step_begin`` -> ``on_step_end`` (a TrainerCallback):
  forward, loss, backward of every micro-batch, gradient clipping, ``optimizer.step``,
  scheduler step, ``zero_grad``; minus the rollout time that fell inside it (TRL generates
  lazily inside the first ``training_step`` of a generation batch).
- step: wall time between the ends of consecutive RL steps (everything: data loading,
  rollout, update, TRL's logging).
- ``compact_head`` in the spec: TRL's fused LM head scores only the completion positions, as it
  does on a Triton device (on CPU it scores every position); ``vs_trl.py`` runs this as the
  "TRL, LM-head overhead removed" side.
- update tokens: non-pad prompt + completion tokens of the generation batch (each row is
  trained on once per RL step: ``num_iterations=1``); per row (``seq_lens``, ``resp_lens``)
  for the needed FLOPs of the update.
- reward: the mean reward and success share of each generation batch, recorded inside the
  reward function TRL calls once per batch (``reward_mean``, ``success``).

Optional spec keys (defaults: what ``vs_trl.py`` measures): ``reward`` (``module:Class`` of a
salvage ``Reward``, built by ``make_reward`` on both sides; salvage's math-verify reward),
``seed`` (0), ``loss_type`` (``dapo``).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import time
from typing import Any

DEFAULT_REWARD = "salvage.tasks.math:MathVerifyReward"


def make_reward(path: str | None) -> Any:
    """The reward both sides score with: a salvage ``Reward`` class named ``module:Class``
    (importable from ``benchmarks/`` too), built without arguments."""
    module, _, name = (path or DEFAULT_REWARD).partition(":")
    return getattr(importlib.import_module(module), name)()


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    out_path = sys.argv[2]
    threads = int(spec["threads"])
    import torch

    torch.set_num_threads(threads)
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if spec.get("compact_head"):
        # TRL's GPU path of its fused LM head: project and score only the positions with a label
        # (the completion tokens). Off Triton, TRL 1.16 scores every position (prompt and padding
        # included) to keep tile shapes fixed; this flag stands in for "TRL without that CPU-only
        # cost". The tile fold stays the torch one; the values are the same at the kept positions.
        import trl.trainer.utils as trl_utils

        if not hasattr(trl_utils, "_use_triton"):
            sys.exit(f"compact_head: trl {trl.__version__} has no trl.trainer.utils._use_triton")
        trl_utils._use_triton = lambda device: True

    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    if tok.pad_token_id is None:  # as salvage.models does
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    verifier = make_reward(spec.get("reward"))
    scored: dict[str, list[float]] = {"reward_mean": [], "success": []}

    def math_reward(completions, answer, **_kw):  # noqa: ANN001, ANN202
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        results = [verifier(t, a) for t, a in zip(texts, answer, strict=True)]
        scored["reward_mean"].append(sum(r.reward for r in results) / len(results))
        scored["success"].append(sum(float(r.success) for r in results) / len(results))
        return [r.reward for r in results]

    rows = json.load(open(spec["tasks"]))  # prompts in the salvage side's step order
    ds = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])

    P, G, M, K = spec["prompts"], spec["n"], spec["micro_batch"], spec["minibatches"]
    per_gen = P * G
    assert per_gen % K == 0 and (per_gen // K) % M == 0, (
        "minibatch must be a whole number of micro-batches"
    )
    ga = per_gen // K // M  # micro-batches per optimiser step (= one salvage minibatch)
    spg = per_gen // M  # micro-batches per generation batch
    with tempfile.TemporaryDirectory() as d:
        cfg = GRPOConfig(
            output_dir=d,
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,  # TRL's default is True; salvage does not recompute
            per_device_train_batch_size=M,
            gradient_accumulation_steps=ga,
            steps_per_generation=spg,
            num_generations=G,
            num_iterations=1,
            max_completion_length=spec["new_tokens"],
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            learning_rate=spec["lr"],
            lr_scheduler_type="constant",
            warmup_steps=0,
            optim=spec.get("trl_optim", "adamw_torch_fused"),  # TRL's default on torch >= 2.8
            weight_decay=0.0,
            max_grad_norm=1.0,
            beta=0.0,
            epsilon=0.2,
            epsilon_high=0.28,
            # dapo: token-mean over the generation batch's tokens / K; bnpo: over each
            # micro-batch's own tokens (salvage's per-minibatch token-mean when a minibatch
            # is one micro-batch)
            loss_type=spec.get("loss_type", "dapo"),
            scale_rewards="group",
            mask_truncated_completions=False,
            shuffle_dataset=False,
            max_steps=spec["steps"] * (spg // ga),
            logging_steps=1,
            report_to="none",
            disable_tqdm=True,
            save_strategy="no",
            log_completions=False,
            dataloader_num_workers=0,
            seed=int(spec.get("seed", 0)),
        )
        rec: dict[str, list[float]] = {
            "rollout_s": [],
            "gen_tokens": [],
            "upd_tokens": [],
            "update_s": [],
            "step_end": [],
            "resp_len": [],
            "seq_lens": [],
            "resp_lens": [],
            "prompt_lens": [],
        }
        state = {"gen_in_step": 0.0, "upd_acc": 0.0, "t_begin": 0.0}

        class Timer(TrainerCallback):
            def on_step_begin(self, args, st, control, **kw):  # noqa: ANN001, ANN201
                state["t_begin"] = time.perf_counter()
                state["gen_in_step"] = 0.0

            def on_step_end(self, args, st, control, **kw):  # noqa: ANN001, ANN201
                now = time.perf_counter()
                state["upd_acc"] += now - state["t_begin"] - state["gen_in_step"]
                if (
                    st.global_step % (spg // ga) == 0
                ):  # last optimiser step of this generation batch
                    rec["update_s"].append(state["upd_acc"])
                    rec["step_end"].append(now)
                    state["upd_acc"] = 0.0

        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[math_reward],
            args=cfg,
            train_dataset=ds,
            processing_class=tok,
            callbacks=[Timer()],
        )
        inner = trainer._generate_and_score_completions

        def timed(inputs):  # noqa: ANN001, ANN202
            t0 = time.perf_counter()
            out = inner(inputs)
            dt = time.perf_counter() - t0
            state["gen_in_step"] += dt
            rec["rollout_s"].append(dt)
            cm, pm = out["completion_mask"], out["prompt_mask"]
            rec["gen_tokens"].append(float(cm.sum()))
            rec["upd_tokens"].append(float(cm.sum() + pm.sum()))
            rec["resp_len"].append(float(cm.sum()) / cm.shape[0])
            rec["seq_lens"].append((cm.sum(1) + pm.sum(1)).tolist())
            rec["resp_lens"].append(cm.sum(1).tolist())
            rec["prompt_lens"].append(pm.sum(1).tolist())
            return out

        trainer._generate_and_score_completions = timed
        t0 = time.perf_counter()
        trainer.train()
        rec["wall_s"] = [time.perf_counter() - t0]
    rec.update(scored)
    rec["version"] = [trl.__version__]  # type: ignore[list-item]
    rec["params_M"] = [sum(p.numel() for p in model.parameters()) / 1e6]
    json.dump(rec, open(out_path, "w"))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
