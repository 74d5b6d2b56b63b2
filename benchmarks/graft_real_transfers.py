"""GRAFT with real transfers on CPU: a warm-started `tiny` A teaches a fresh `tiny` B.

Random `tiny` models never solve a prompt, so a plain CPU GRAFT run transfers nothing.
Here model A is first fine-tuned (plain next-token SFT, in this script) on one-digit
arithmetic answers written as ``\\boxed{N}``, saved as an HF directory, and then paired
with a fresh `tiny` B of another tokenizer in ``configs/graft/math_tiny.yaml`` settings on
the same task family. Every reward is verified by math-verify on real rollouts; when B's
group fails and A's has successes, A's group is re-tokenised into B and trained on.
Prints SFT accuracy, then per GRAFT step: transfers per direction, admitted fraction,
mean weight, each model's rollout success.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/graft_real_transfers.py   # ~3-6 min, 2 cores
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def sft_model_a(out: Path, steps: int, seed: int) -> float:
    """Fine-tune tiny A on '\\boxed{answer}' completions; returns its greedy accuracy on the train prompts."""
    from salvage.lm import pad_right, token_logprobs
    from salvage.models import PolicySpec, load_policy
    from salvage.rollout.hf import HFEngine
    from salvage.tasks.math import MathData, MathVerifyReward, load_math_tasks

    spec = PolicySpec("tiny", vocab_size=768, seed=0)
    model, tok = load_policy(spec)
    tasks, _ = load_math_tasks(
        MathData(source="reasoning_gym:basic_arithmetic", size=200, seed=0, rg_kwargs=RG)
    )
    pairs = []
    for t in tasks:
        text = tok.apply_chat_template(t.messages, tokenize=False, add_generation_prompt=True)
        p = list(tok(text, add_special_tokens=False)["input_ids"])
        r = list(tok(f"\\boxed{{{t.answer}}}", add_special_tokens=False)["input_ids"]) + [
            int(tok.eos_token_id)
        ]
        pairs.append((p, r))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    model.train()
    for step in range(steps):
        batch = rng.sample(pairs, 32)
        ids, mask = pad_right([p + r for p, r in batch], int(tok.pad_token_id), "cpu")
        lp = token_logprobs(model, ids, mask, 1.0)
        count = torch.zeros_like(lp)
        for i, (p, r) in enumerate(batch):
            count[i, len(p) - 1 : len(p) - 1 + len(r)] = 1.0
        loss = -(lp * count).sum() / count.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            print(f"  sft step {step}: loss {float(loss):.3f}", flush=True)
    model.eval()
    eng = HFEngine(model, tok, temperature=0.0, max_new_tokens=12)
    outs = eng.generate([p for p, _ in pairs], n=1)
    reward = MathVerifyReward()
    acc = sum(reward(o[0].text, t.answer).success for o, t in zip(outs, tasks, strict=True)) / len(
        tasks
    )
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return acc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sft-steps", type=int, default=250)
    ap.add_argument("--graft-steps", type=int, default=4)
    ap.add_argument("--no-gate", action="store_true", help="GRAFT's no-gate variant (w = 1)")
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="salvage-graft-real-"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    out = Path(args.out)
    a_dir = out / "model_a"
    acc = sft_model_a(a_dir, args.sft_steps, 0)
    print(f"model A after SFT: greedy accuracy {acc:.3f} on the 200 train prompts")
    run = out / "run"
    cmd = [
        sys.executable,
        "-m",
        "salvage",
        "fit",
        "--config",
        str(ROOT / "configs/graft/math_tiny.yaml"),
        "--model.init_args.policy_a",
        f"{{name_or_path: {a_dir}}}",
        "--data.init_args.train",
        "{source: 'reasoning_gym:basic_arithmetic', size: 200, seed: 0, "
        "rg_kwargs: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}",
        "--data.init_args.engine.max_new_tokens",
        "12",
        "--model.init_args.gate",
        str(not args.no_gate).lower(),
        "--trainer.max_steps",
        str(args.graft_steps),
        "--trainer.default_root_dir",
        str(run),
        "--trainer.enable_progress_bar",
        "false",
    ]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", SALVAGE_PROGRESS="0")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    rows = list(csv.DictReader(next(run.glob("version_0/metrics.csv")).open()))
    keys = [
        "graft/transferred_a_to_b",
        "graft/transferred_b_to_a",
        "graft/complementary_a_to_b",
        "graft/admitted_frac",
        "graft/weight_mean",
        "a/rollout/success_rate",
        "b/rollout/success_rate",
        "b/loss/peer_clip_frac",
    ]
    print(
        "\n| step | A->B | B->A | complementary A->B | admitted | weight mean | A success | B success |"
        " B peer clip |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        vals = [r.get(k, "") for k in keys]
        print(f"| {i} | " + " | ".join(f"{float(v):.3g}" if v else "-" for v in vals) + " |")
    print(f"\nrun directory: {run} (exchange.jsonl holds every transfer and weight)")


if __name__ == "__main__":
    main()
