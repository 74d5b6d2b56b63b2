"""VH-GPO overhead on TextWorld-Express: extra output tokens and extra wall time vs GRPO.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/vhgpo_overhead.py [--steps 3] [--source-rate]

``--source-rate``: the source's batch shape and rescue cap (16 tasks x 8 rollouts per
update, at most 2 rescued groups), so the extra-token ratio is measured at its rescue rate.
``--before``: both runs with the switches of the rollout and update speed-ups off (``generate`` decode,
recomputed behaviour log-probs, no prompt packing, no length order, full logits), to compare
the ratio with and without them.

Runs ``configs/vhgpo/twx_tiny.yaml`` twice in one process, same seed and SFT warm start:
with the ``VerifiedHandoff`` rescue stage and with none (plain GRPO), and prints
extra output tokens / root rollout output tokens (teacher, search, confirmation; failed and
discarded work included) and the step-time ratio. The source reports 1.77% extra tokens on
ALFWorld with at most 2 rescued groups per update (oracle teachers here generate no tokens,
so all extra tokens are student search and confirmation).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/vhgpo/twx_tiny.yaml"


def run(
    steps: int, extra: list[str], root: Path, config: str | Path = CONFIG
) -> list[dict[str, str]]:
    """``salvage fit --config config *extra`` for ``steps`` updates; its metrics.csv rows."""
    cmd = [
        sys.executable,
        "-m",
        "salvage",
        "fit",
        "--config",
        str(config),
        *extra,
        "--trainer.max_steps",
        str(steps),
        "--trainer.default_root_dir",
        str(root),
        "--trainer.enable_progress_bar",
        "false",
    ]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", SALVAGE_PROGRESS="0")
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    return list(csv.DictReader(next(root.glob("version_0/metrics.csv")).open()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--source-rate",
        action="store_true",
        help="16 tasks x 8 rollouts, <= 2 rescued groups per update",
    )
    ap.add_argument(
        "--before", action="store_true", help="the rollout and update speed-ups' switches off"
    )
    ap.add_argument(
        "--teacher-policy",
        default=None,
        help="an HF model directory: VH-GPO's teacher is this frozen LM (the paper's setting, "
        "sampled by the same engine) instead of the environment oracle; e.g. a warm start "
        "made by studies/agent_peers_twx.yaml's prepare steps",
    )
    ap.add_argument(
        "--compile-decode",
        action="store_true",
        help="both runs with engine.hf_compile_decode (the teacher's engine too)",
    )
    ap.add_argument(
        "--warmup-updates",
        type=int,
        default=0,
        help="leave the first K updates out of the time sums (e.g. 1 with --compile-decode, "
        "whose first calls compile); token and group counts stay cumulative",
    )
    a = ap.parse_args()
    shape = (
        ["--data.init_args.tasks_per_step", "16", "--data.init_args.group_size", "8"]
        if a.source_rate
        else []
    )
    if a.before:
        shape += [
            "--model.init_args.pack_prompts=false",
            "--model.init_args.length_aware_micro_batches=false",
            "--model.init_args.logprob_chunk_size=0",
            "--data.init_args.engine.hf_decode_loop=generate",
            "--data.init_args.engine.hf_recompute_logprobs=true",
        ]
    if a.compile_decode:
        shape += ["--data.init_args.engine.hf_compile_decode=true"]
    teacher = (
        [
            "--rescue.init_args.teacher",
            f'{{"kind": "lm", "policy": {{"name_or_path": "{a.teacher_policy}"}}}}',
        ]
        if a.teacher_policy
        else []
    )
    with tempfile.TemporaryDirectory() as d:
        vh = run(a.steps, [*shape, *teacher], Path(d) / "vhgpo")
        base = run(
            a.steps,
            ["--config", str(ROOT / "configs/vhgpo/ablations/grpo_baseline.yaml"), *shape],
            Path(d) / "grpo",
        )
    last = vh[-1]
    vh, base = vh[a.warmup_updates :], base[a.warmup_updates :]
    step = lambda rows: sum(float(r["perf/step_s"]) for r in rows)  # noqa: E731
    where = (
        "16 tasks x 8 rollouts, <= 2 rescued groups" if a.source_rate else "8 tasks x 4 rollouts"
    )
    who = f"LM teacher {a.teacher_policy}" if a.teacher_policy else "oracle teacher"
    print(
        f"\nVH-GPO overhead, configs/vhgpo/twx_tiny.yaml ({where}, {who}"
        f"{', speed-up switches off' if a.before else ''}"
        f"{', compiled decode steps' if a.compile_decode else ''}), {a.steps} updates"
        f"{f', times from update {a.warmup_updates + 1} on' if a.warmup_updates else ''}"
    )
    print("| metric | value |")
    print("|---|---|")
    print(
        f"| zero-signal groups / selected / retained | {last['relay/zero_signal_groups_cum']} / "
        f"{last['relay/selected_cum']} / {last['relay/retained_cum']} |"
    )
    print(
        f"| extra output tokens / root output tokens | {100 * float(last['cost/extra_token_ratio']):.2f}% |"
    )
    print(f"| summed step time VH-GPO / GRPO | {step(vh) / step(base):.2f}x |")
    parts = {
        k: float(last.get(f"cost/extra_tokens_{k}") or 0.0)
        for k in ("teacher", "search", "confirm", "student")
    }
    total, ratio = sum(parts.values()), float(last["cost/extra_token_ratio"])
    for k, v in parts.items():  # each part's share of the root tokens
        print(
            f"| of which {k} / root output tokens | {100 * ratio * v / total if total else 0.0:.2f}% |"
        )
    print(
        f"\nSummed over updates {a.warmup_updates + 1}-{a.steps}, seconds "
        "(update = step - rollout - rescue)"
    )
    print("| phase | VH-GPO | GRPO |")
    print("|---|---|---|")
    for name, key in PHASES:
        print(f"| {name} | {phase(vh, key):.2f} | {phase(base, key):.2f} |")
    # engine seconds per 1,000 generated tokens: root rollouts vs the search's student calls
    root = lambda rows: sum(  # noqa: E731
        float(r.get("perf/rollout_tokens_per_s") or 0) * float(r.get("cost/time_generate") or 0)
        for r in rows
    )
    searched = parts["search"] + parts["confirm"]
    print(f"| root rollout tokens | {root(vh):.0f} | {root(base):.0f} |")
    print(f"| search student tokens (discovery + confirmation) | {searched:.0f} | - |")
    print(
        f"| root rollout engine s / 1k tokens | {1e3 * phase(vh, 'cost/time_generate') / root(vh):.3f}"
        f" | {1e3 * phase(base, 'cost/time_generate') / root(base):.3f} |"
    )
    if searched:
        print(
            "| search student engine s / 1k tokens | "
            f"{1e3 * phase(vh, 'cost/time_rescue_policy') / searched:.3f} | - |"
        )


PHASES = (
    ("step", "perf/step_s"),
    ("rollout (root)", "cost/time_rollout"),
    ("  of which policy", "cost/time_generate"),
    ("rescue search", "cost/time_rescue"),
    ("  teacher rollouts", "cost/time_rescue_teacher"),
    (
        "    of which teacher policy (LM engine, or oracle planning)",
        "cost/time_rescue_teacher_policy",
    ),
    ("  discovery rollouts", "cost/time_rescue_discovery"),
    ("  confirmation rollouts", "cost/time_rescue_confirm"),
    ("  replay", "cost/time_rescue_replay"),
    ("  student policy (engine, discovery + confirmation)", "cost/time_rescue_policy"),
    ("  student and replay env / prompts", "cost/time_rescue_env"),
    ("update", None),
    ("  of which auxiliary terms", "cost/time_aux"),
)


def phase(rows: list[dict[str, str]], key: str | None) -> float:
    """``key`` summed over the updates (None: step - rollout - rescue)."""
    if key is None:
        return (
            phase(rows, "perf/step_s")
            - phase(rows, "cost/time_rollout")
            - phase(rows, "cost/time_rescue")
        )
    return sum(float(r.get(key) or 0.0) for r in rows)


if __name__ == "__main__":
    main()
