"""Does salvage's GRPO learn as TRL's ``GRPOTrainer`` does? Training-reward curves over seeds.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/learning_vs_trl.py \\
        [--trl-python .trl-venv/bin/python] [--model tiny] [--seeds 5] [--steps 12] \\
        [--lr 1e-2] [--prompts 4] [--group 8] [--max-new-tokens 8] [--reward digit_share] [--k 3]

TRL's virtual environment is the one of ``vs_trl.py`` (see its docstring: outside the
repository, ``torch==2.13.0`` installed first, then ``trl==1.16.0 math-verify
transformers==X``, then ``pip install --no-deps -e .``). Not a test and not in CI: about 11 s
a run with ``tiny`` (process start included), 10 runs (2 min) at the defaults.

Each seed runs once on each side, every run a fresh subprocess (salvage's through
``vs_trl.py --side salvage``, TRL's through ``_trl_side.py`` in ``--trl-python``), the sides
alternating (seed 0: salvage then TRL, seed 1: TRL then salvage, ...) so that machine noise
falls on both. Per seed both sides get the same:
- start weights: ``tiny`` is saved once as an HF directory and both load it (SmolLM2:
  salvage's local checkpoint), so the seed changes sampling, not the model;
- prompts in the same order: reasoning-gym basic_arithmetic, the order salvage's data seed
  draws, handed to TRL with ``shuffle_dataset=False``; checked after the runs (the prompt
  token lengths of every update must agree, printed as "same prompts");
- reward code: a salvage ``Reward`` class imported on both sides (``_trl_side.make_reward``):
  ``digit_share`` = the share of digit characters in the response, success = more than
  half (the reward of ``tests/test_learning.py``, which the untrained ``tiny`` can climb), or
  ``math`` = math-verify on the last ``\\boxed{}`` (salvage's default);
- settings: P prompts x G samples x <= L new tokens, temperature 1, top-p 1, no top-k; advantage
  (r - mean) / std per group (unbiased std); K optimiser steps of P*G/K sequences per update,
  each one micro-batch (TRL: ``per_device_train_batch_size=P*G/K``,
  ``gradient_accumulation_steps=1``, ``steps_per_generation=K``); token-mean loss over each
  minibatch (TRL ``loss_type="bnpo"``, which with one micro-batch per optimiser step is the
  same sum; TRL's ``dapo`` divides by the generation batch's mean tokens per step instead);
  clip 0.2 / 0.28, beta 0 (no reference model), one iteration (TRL ``num_iterations=1``),
  fused AdamW at a constant lr (TRL: ``lr_scheduler_type="constant"``, its default is a
  linear decay), grad-norm clip 1.0, fp32 on CPU, the same thread count. Known differences:
  the advantage's epsilon (salvage 1e-6, TRL 1e-4) and the RNG streams (a seed does not draw
  the same samples on both sides, so the seeds are not paired).

Measured per run: the mean training reward and success share of every update's rollout batch
(update 1 = the untrained policy's samples), recorded inside each side's reward call
(``_trl_side.py``) or rollout (``vs_trl.salvage_side``). Printed: the mean curve over seeds per
update with its 95% t half-width; per side the gain of each seed (mean of the last k updates
minus the first k) with its mean and sd; and the difference of mean gains salvage - TRL with a
95% **Welch t interval** (unequal variances, Welch-Satterthwaite degrees of freedom, seeds as
independent samples on each side).

Last output (2026-12-07 11:36-11:38 UTC, 2-core CPU VM shared with other jobs, load average
4.0-5.5; ``OMP_NUM_THREADS=1``, ``nice -n 10``; the command above with its defaults, 123 s in
all; a run of the same settings minutes before gave the same rewards to the last digit, only
the times moved):

    salvage GRPO vs TRL 1.16.0 GRPOTrainer (transformers 5.25.0, torch 2.13.0+cpu), CPU fp32, 1 thread(s)
    - tiny (0.107M params), reward digit_share, lr 0.01 constant, 4 prompts x 8 samples x <= 8 new tokens,
      2 optimiser steps of 16 sequences per update, 12 updates, seeds 0..4, one run a side each, alternating
    - same prompts at every update on both sides: yes

    Mean over seeds of each update's training batch (update 1: the untrained policy's
    samples) ± the 95% t half-width over seeds:

    | update | salvage reward | TRL reward | salvage success | TRL success |
    |---|---|---|---|---|
    | 1 | 0.271 ± 0.050 | 0.273 ± 0.035 | 0.094 ± 0.103 | 0.094 ± 0.027 |
    | 2 | 0.266 ± 0.026 | 0.251 ± 0.027 | 0.075 ± 0.059 | 0.050 ± 0.044 |
    | 3 | 0.306 ± 0.030 | 0.300 ± 0.052 | 0.075 ± 0.044 | 0.138 ± 0.089 |
    | 4 | 0.328 ± 0.058 | 0.325 ± 0.047 | 0.163 ± 0.108 | 0.131 ± 0.088 |
    | 5 | 0.414 ± 0.078 | 0.382 ± 0.068 | 0.319 ± 0.159 | 0.231 ± 0.125 |
    | 6 | 0.441 ± 0.059 | 0.425 ± 0.098 | 0.306 ± 0.151 | 0.344 ± 0.231 |
    | 7 | 0.542 ± 0.053 | 0.536 ± 0.049 | 0.550 ± 0.128 | 0.525 ± 0.075 |
    | 8 | 0.618 ± 0.094 | 0.600 ± 0.113 | 0.756 ± 0.159 | 0.700 ± 0.232 |
    | 9 | 0.709 ± 0.066 | 0.677 ± 0.098 | 0.875 ± 0.082 | 0.844 ± 0.137 |
    | 10 | 0.807 ± 0.053 | 0.775 ± 0.100 | 0.969 ± 0.027 | 0.956 ± 0.044 |
    | 11 | 0.868 ± 0.059 | 0.834 ± 0.054 | 0.988 ± 0.021 | 0.975 ± 0.051 |
    | 12 | 0.924 ± 0.036 | 0.891 ± 0.054 | 0.994 ± 0.017 | 0.988 ± 0.035 |

    Gain = mean of the last 3 updates - mean of the first 3, per seed:

    | side | reward gain per seed | mean | sd | success gain mean (sd) | update s (median) | run s (mean) |
    |---|---|---|---|---|---|---|
    | salvage | +0.561, +0.607, +0.543, +0.611, +0.603 | +0.585 | 0.031 | +0.902 (0.024) | 0.08 | 10 |
    | TRL | +0.570, +0.604, +0.498, +0.559, +0.562 | +0.559 | 0.039 | +0.879 (0.009) | 0.17 | 12 |

    reward gain, salvage - TRL: +0.026, 95% Welch t interval [-0.025, +0.078] (df 7.6, 5 seeds a side)
    success gain, salvage - TRL: +0.023, 95% Welch t interval [-0.006, +0.052] (df 5.2, 5 seeds a side)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

from vs_trl import prepare, run_side, trl_versions

from salvage.core.stats import ci95, mean, sample_std, t_quantile
from salvage.tasks.math import Reward, RewardResult

REWARDS = {
    "digit_share": "learning_vs_trl:DigitShare",
    "math": "salvage.tasks.math:MathVerifyReward",
}
DEFAULT_LR = {"tiny": 1e-2, "smollm2-135m-instruct": 1e-5}  # FACTS.md's parity runs
SIDES = ("salvage", "trl")
NAMES = {"salvage": "salvage", "trl": "TRL"}


class DigitShare(Reward):
    """Reward = share of digit characters in the response; success = more than half
    (``tests/test_learning.py``'s reward: the untrained ``tiny`` starts near 0.2 and climbs)."""

    def __call__(self, response: str, answer: str) -> RewardResult:
        frac = sum(c.isdigit() for c in response) / max(1, len(response))
        return RewardResult(frac, frac > 0.5)


def gain(curve: list[float], k: int) -> float:
    """Mean of the last ``k`` updates minus the mean of the first ``k``."""
    return mean(curve[-k:]) - mean(curve[:k])


def welch(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """mean(a) - mean(b), the half-width of its two-sided 95% Welch t interval, and the
    Welch-Satterthwaite degrees of freedom (NaN half-width when undefined)."""
    diff = mean(a) - mean(b)
    va, vb = sample_std(a) ** 2 / len(a), sample_std(b) ** 2 / len(b)
    se2 = va + vb
    if not math.isfinite(se2) or se2 <= 0:
        return diff, math.nan, math.nan
    df = se2**2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return diff, t_quantile(0.975, df) * math.sqrt(se2), df  # t_cdf takes a fractional df


def same_prompts(x: dict, y: dict) -> bool:
    """Whether two runs trained on prompts of the same token lengths at every update."""
    return len(x["prompt_lens"]) == len(y["prompt_lens"]) and all(
        sorted(p) == sorted(q) for p, q in zip(x["prompt_lens"], y["prompt_lens"], strict=True)
    )


def report(runs: dict[str, list[dict]], a: argparse.Namespace, header: str) -> None:
    """Print the curves, the per-seed gains and the difference of mean gains."""
    steps, k = a.steps, a.k
    print(header)
    print()
    print(
        "Mean over seeds of each update's training batch (update 1: the untrained policy's\n"
        "samples) ± the 95% t half-width over seeds:"
    )
    print()
    print("| update | salvage reward | TRL reward | salvage success | TRL success |")
    print("|---|---|---|---|---|")
    for u in range(steps):
        cells = [
            ci95([r[m][u] for r in runs[side]]).fmt()
            for m in ("reward_mean", "success")
            for side in SIDES
        ]
        print(f"| {u + 1} | " + " | ".join(cells) + " |")
    print()
    print(f"Gain = mean of the last {k} updates - mean of the first {k}, per seed:")
    print()
    print(
        "| side | reward gain per seed | mean | sd | success gain mean (sd) | "
        "update s (median) | run s (mean) |"
    )
    print("|---|---|---|---|---|---|---|")
    gains = {}
    for side in SIDES:
        g = [gain(r["reward_mean"], k) for r in runs[side]]
        sg = [gain(r["success"], k) for r in runs[side]]
        gains[side] = (g, sg)
        upd = statistics.median(x for r in runs[side] for x in r["update_s"][1:])
        print(
            f"| {NAMES[side]} | {', '.join(f'{x:+.3f}' for x in g)} | {mean(g):+.3f} | "
            f"{sample_std(g):.3f} | {mean(sg):+.3f} ({sample_std(sg):.3f}) | {upd:.2f} | "
            f"{mean([r['proc_s'] for r in runs[side]]):.0f} |"
        )
    print()
    for i, metric in enumerate(("reward", "success")):
        diff, half, df = welch(gains["salvage"][i], gains["trl"][i])
        interval = (
            f"[{diff - half:+.3f}, {diff + half:+.3f}] (df {df:.1f}"
            if math.isfinite(half)
            else "undefined (it needs 2+ seeds a side and some spread"
        )
        print(
            f"{metric} gain, salvage - TRL: {diff:+.3f}, 95% Welch t interval {interval}, "
            f"{len(runs['trl'])} seeds a side)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trl-python", default=".trl-venv/bin/python")
    ap.add_argument(
        "--model", default="tiny", help="tiny, smollm2-135m-instruct (slow) or an HF model dir"
    )
    ap.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1, one run a side each")
    ap.add_argument("--steps", type=int, default=12, help="updates (rollout batches) a run")
    ap.add_argument("--lr", type=float, help="default: 1e-2 for tiny, 1e-5 otherwise")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per update")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--minibatches", type=int, default=2, help="optimiser steps per update")
    ap.add_argument("--reward", choices=sorted(REWARDS), default="digit_share")
    ap.add_argument("--k", type=int, default=3, help="updates averaged at each end for the gain")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--raw", help="also write every run's records to this JSON file")
    a = ap.parse_args()
    per_update = a.prompts * a.group
    if per_update % a.minibatches:
        sys.exit(f"--prompts x --group = {per_update} must split into {a.minibatches} minibatches")
    if not 1 <= a.k <= a.steps // 2:
        sys.exit(f"--k must be in 1..{a.steps // 2} (half of --steps)")
    if not Path(a.trl_python).exists():
        sys.exit(f"no TRL interpreter at {a.trl_python} (see vs_trl.py's docstring for the venv)")
    versions = trl_versions(a.trl_python)
    lr = a.lr if a.lr is not None else DEFAULT_LR.get(a.model, 1e-5)
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="learning-vs-trl-") as d:
        work = Path(d)
        for seed in range(a.seeds):
            mdir, jsonl, trl_tasks = prepare(a.model, work, a.steps, a.prompts, seed)
            spec = dict(
                prompts=a.prompts,
                n=a.group,
                new_tokens=a.max_new_tokens,
                minibatches=a.minibatches,
                micro_batch=per_update // a.minibatches,  # one micro-batch per optimiser step
                steps=a.steps,
                model_dir=mdir,
                jsonl=str(jsonl),
                tasks=str(trl_tasks),
                lr=lr,
                threads=a.threads,
                trl_optim="adamw_torch_fused",
                loss_type="bnpo",
                reward=REWARDS[a.reward],
                seed=seed,
                probes=False,
            )
            for side in SIDES if seed % 2 == 0 else SIDES[::-1]:
                runs[side].append(run_side(side, spec, work, a.trl_python, f"{side}_{seed}"))
                r = runs[side][-1]
                print(
                    f"  seed {seed} {side}: {r['proc_s']:.0f} s, reward "
                    f"{r['reward_mean'][0]:.3f} -> {r['reward_mean'][-1]:.3f}",
                    file=sys.stderr,
                )
    if a.raw:
        Path(a.raw).write_text(json.dumps(runs, indent=1))
    for side in SIDES:
        for seed, r in enumerate(runs[side]):
            if len(r["reward_mean"]) != a.steps:
                sys.exit(f"{side} seed {seed}: {len(r['reward_mean'])} updates, not {a.steps}")
    same = all(same_prompts(x, y) for x, y in zip(runs["salvage"], runs["trl"], strict=True))
    params = runs["salvage"][0]["params_M"][0]
    header = (
        f"salvage GRPO vs TRL {versions[0]} GRPOTrainer (transformers {versions[1]}, "
        f"torch {versions[2]}), CPU fp32, {a.threads} thread(s)\n"
        f"- {a.model} ({params:.3f}M params), reward {a.reward}, lr {lr:g} constant, "
        f"{a.prompts} prompts x {a.group} samples x <= {a.max_new_tokens} new tokens,\n"
        f"  {a.minibatches} optimiser steps of {per_update // a.minibatches} sequences per "
        f"update, {a.steps} updates, seeds 0..{a.seeds - 1}, one run a side each, alternating\n"
        f"- same prompts at every update on both sides: {'yes' if same else 'NO'}"
    )
    report(runs, a, header)


if __name__ == "__main__":
    main()
