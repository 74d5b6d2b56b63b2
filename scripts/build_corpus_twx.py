"""Build ``salvage/data/corpus_twx.txt``: the text the ``small`` students' TextWorld-Express
tokenizer is fit to (``policy.corpus: twx``).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/build_corpus_twx.py [--games 48] [--out PATH]

Held out by construction: only games of the engine's TRAIN fold (seeds 0-999) are played;
validation and test folds (dev 10000-, test 20000-) never enter the corpus, and neither do
the train seeds the shipped studies hold out for in-distribution validation and test
(256-1000): seeds 0-255 only. For each game family and difficulty below, ``--games`` games
are played twice, once by the oracle (the planner's shortest plan) and once by a seeded
random policy over the admissible actions, for at most 12 actions; every state is rendered
as the agent prompt (``salvage.core.agent.render_prompt`` with the default template and
history_k 2) followed by the well-formed response for the action taken. Lines are
deduplicated, order kept, so the file is deterministic for a given engine version.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from salvage.core.agent import AgentFormat, format_action, render_prompt

FAMILIES = [
    ("coin", "numLocations=1,includeDoors=0,numDistractorItems=0"),
    ("coin", "numLocations=3,includeDoors=0,numDistractorItems=0"),
    ("coin", "numLocations=6,includeDoors=0,numDistractorItems=0"),
    ("twc", "numLocations=1,numItemsToPutAway=1"),
    ("twc", "numLocations=1,numItemsToPutAway=2"),
    ("twc", "numLocations=1,numItemsToPutAway=3"),
    ("twc", "numLocations=2,numItemsToPutAway=2"),
]
MAX_ACTIONS = 12
TRAIN_SEEDS = 256
"""Train-fold seeds the corpus may use (the studies hold out 256 onwards)."""


def play(env, task: dict, policy: str, rng: random.Random, fmt: AgentFormat) -> list[str]:
    obs, info = env.reset(task, 0)
    history: list[tuple[str, str]] = []
    out = []
    for step in range(MAX_ACTIONS):
        adm = list(info.get("admissible", []))
        if not adm:
            break
        action = env.oracle_action() if policy == "oracle" else rng.choice(adm)
        if action is None:
            action = rng.choice(adm)
        prompt = render_prompt(
            fmt, info.get("task_description", ""), history, obs, adm, step, MAX_ACTIONS - step
        )
        out.append(prompt + "\n" + format_action(action, fmt))
        res = env.step(action)
        history.append((obs, action))
        obs, info = res.observation, res.info
        if res.done:
            out.append(obs)
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--games", type=int, default=48, help="games per family (train seeds)")
    ap.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parent.parent / "salvage" / "data" / "corpus_twx.txt"),
        help="where to write the corpus",
    )
    args = ap.parse_args()
    if not 1 <= args.games <= TRAIN_SEEDS:
        raise SystemExit(f"--games must be in 1..{TRAIN_SEEDS}, got {args.games}")
    from salvage.envs.twx import TWXEnv

    fmt = AgentFormat(history_k=2)
    env = TWXEnv(plan_max_nodes=3000)
    rng = random.Random(0)
    lines: dict[str, None] = {}
    try:
        for game, params in FAMILIES:
            tasks = TWXEnv.list_tasks("train", game=game, params=params, num_tasks=args.games)
            for task in tasks:
                for policy in ("oracle", "random"):
                    for text in play(env, task, policy, rng, fmt):
                        for line in text.splitlines():
                            if line.strip():
                                lines.setdefault(line.rstrip(), None)
            print(f"{game} {params}: {len(lines)} distinct lines so far", flush=True)
    finally:
        env.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    size = Path(args.out).stat().st_size
    print(f"wrote {args.out}: {len(lines)} lines, {size} bytes")


if __name__ == "__main__":
    main()
