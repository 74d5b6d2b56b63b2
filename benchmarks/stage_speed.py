"""Per-stage seconds per update, before and after a change, side by side in one run.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/stage_speed.py [--steps 3] [--rounds 1]
        [--config configs/vhgpo/twx_tiny.yaml] [--shape 16x8]
        [--before-arg ARG ...] [--after-arg ARG ...]

Runs ``salvage fit`` on ``--config`` (each run in its own process, the same seed and warm
start) with the ``--before-arg`` arguments and with the ``--after-arg`` ones, alternately
(before, after, then after, before, ... for ``--rounds``) so that machine noise hits both,
and prints each stage's mean seconds per update (phases of ``benchmarks/vhgpo_overhead.py``:
step, root rollout, the verified-handoff search and its parts, the update) with the ratio
before / after, and the oracle teacher's seconds per attempt
(``cost/time_rescue_teacher_policy`` / ``relay/teacher_attempts``).

Default (issue 45 item 4): VH-GPO on TextWorld-Express (``configs/vhgpo/twx_tiny.yaml``) at
the source's batch shape, 16 tasks x 8 rollouts, with the oracle teacher's search before the
transition cache (``planner: reference``) and with it (``planner: cached``, the default).
``--shape 8x4`` keeps the config's own shape; ``--before-arg`` / ``--after-arg`` replace
the two sides (e.g. the rollout and update speed-ups' switches of ``vhgpo_overhead.py
--before``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from vhgpo_overhead import CONFIG, PHASES, phase, run

PLANNER = "--data.init_args.env.kwargs"


def per_update(rows: list[dict[str, str]], key: str | None, skip: int) -> float:
    """Mean seconds per update of ``key`` over the updates after the first ``skip``."""
    kept = rows[skip:]
    return phase(kept, key) / max(1, len(kept))


def teacher_per_attempt(rows: list[dict[str, str]], skip: int) -> float:
    kept = rows[skip:]
    attempts = sum(float(r.get("relay/teacher_attempts") or 0.0) for r in kept)
    return phase(kept, "cost/time_rescue_teacher_policy") / attempts if attempts else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default=str(CONFIG), help="the fit's config (VH-GPO on TWX)")
    ap.add_argument("--steps", type=int, default=3, help="updates per run")
    ap.add_argument("--rounds", type=int, default=1, help="before/after pairs of runs")
    ap.add_argument("--skip", type=int, default=0, help="leave the first K updates out")
    ap.add_argument(
        "--shape", default="16x8", help="TASKSxG an update (the source's 16x8); 'config' keeps it"
    )
    ap.add_argument("--before-arg", action="append", default=None, help="a fit argument (repeat)")
    ap.add_argument("--after-arg", action="append", default=None, help="a fit argument (repeat)")
    ap.add_argument("--label-before", default="before (planner: reference)")
    ap.add_argument("--label-after", default="after (planner: cached)")
    a = ap.parse_args()
    shape: list[str] = []
    if a.shape != "config":
        tasks, group = a.shape.lower().split("x")
        shape = ["--data.init_args.tasks_per_step", tasks, "--data.init_args.group_size", group]
    before = a.before_arg if a.before_arg is not None else [PLANNER, '{"planner": "reference"}']
    after = a.after_arg if a.after_arg is not None else [PLANNER, '{"planner": "cached"}']
    sides = {"before": before, "after": after}
    got: dict[str, list[list[dict[str, str]]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for side in order:
                root = Path(d) / f"{side}{r}"
                rows = run(a.steps, [*shape, *sides[side]], root, config=a.config)
                got[side].append(rows)

    def mean_of(side: str, f) -> float:  # noqa: ANN001
        vals = [f(rows) for rows in got[side]]
        return statistics.mean(vals)

    print(
        f"\nPer-stage seconds per update, {Path(a.config).name}, shape {a.shape}, {a.steps} "
        f"updates x {a.rounds} round(s) a side{f', first {a.skip} left out' if a.skip else ''}"
    )
    print(f"before: {a.label_before} {' '.join(before)}")
    print(f"after:  {a.label_after} {' '.join(after)}\n")
    print("| stage | before (s) | after (s) | before / after |")
    print("|---|---|---|---|")
    for name, key in PHASES:
        b = mean_of("before", lambda rows, k=key: per_update(rows, k, a.skip))
        x = mean_of("after", lambda rows, k=key: per_update(rows, k, a.skip))
        ratio = f"{b / x:.1f}x" if x > 0 else "-"
        print(f"| {name} | {b:.2f} | {x:.2f} | {ratio} |")
    b = mean_of("before", lambda rows: teacher_per_attempt(rows, a.skip))
    x = mean_of("after", lambda rows: teacher_per_attempt(rows, a.skip))
    n = mean_of(
        "after",
        lambda rows: statistics.mean(float(r.get("relay/teacher_attempts") or 0) for r in rows),
    )
    print(
        f"| oracle teacher s / attempt ({n:.1f} attempts an update) | {b:.3f} | {x:.3f} | "
        f"{b / x:.1f}x |"
    )


if __name__ == "__main__":
    main()
