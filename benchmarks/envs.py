"""Environment throughput and restore cost: steps/s vs workers, replay restore vs depth.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/envs.py [--episodes 8] [--steps 30]

- steps/s: ``episodes`` TextWorld-Express cookingworld episodes advanced in lockstep
  through ``EnvPool`` with 0 (in-process), 1 and 2 worker processes, random admissible
  actions; JVM start-up excluded (first reset untimed).
- restore: the universal verified replay at depth 10 and 40, for TextWorld-Express and
  (if the alfworld extra and ../shared/data/alfworld are present) ALFWorld.
Not a test. Times on a shared 2-core machine are noisy; compare rows of one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from salvage.envs import make_env
from salvage.envs.pool import EnvPool
from salvage.envs.twx import TWXEnv

ALF = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "alfworld"


def steps_per_s(workers: int, episodes: int, steps: int) -> float:
    tasks = TWXEnv.list_tasks("train", game="cookingworld", num_tasks=episodes)
    rng = random.Random(0)
    with EnvPool("twx", {"step_limit": 1000}, num_workers=workers, step_timeout_s=120) as pool:
        res = pool.reset([(i, t, 0) for i, t in enumerate(tasks)])  # warm-up: JVMs start here
        infos = {i: r.value[1] for i, r in enumerate(res)}
        pool.reset([(i, t, 0) for i, t in enumerate(tasks)])
        n = 0
        t0 = time.perf_counter()
        live = set(infos)
        for _ in range(steps):
            if not live:
                break
            items = [
                (
                    i,
                    rng.choice(
                        [a for a in infos[i]["admissible"] if "eat" not in a] or ["look around"]
                    ),
                )
                for i in sorted(live)
            ]
            for (i, _), r in zip(items, pool.step(items), strict=True):
                n += 1
                if not r.ok or r.value.done:
                    live.discard(i)
                else:
                    infos[i] = r.value.info
        return n / (time.perf_counter() - t0)


def restore_cost(
    env_name: str, task: dict, depths: list[int], repeats: int = 3, **kw
) -> dict[int, float]:
    env = make_env(env_name, **kw)
    rng = random.Random(1)
    _, info = env.reset(task, 0)
    snaps = {0: env.snapshot()}
    while env.depth < max(depths):
        safe = [
            a for a in info["admissible"] if a.startswith(("look", "inventory", "examine", "go to"))
        ]
        res = env.step(rng.choice(safe or info["admissible"]))
        info = res.info
        snaps[env.depth] = env.snapshot()
        if res.done:
            raise RuntimeError(f"episode ended at depth {env.depth} before {max(depths)}")
    fresh = make_env(env_name, **kw)
    fresh.restore(snaps[0])  # warm-up (JVM / game load)
    out = {}
    for d in depths:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fresh.restore(snaps[d])
            times.append(time.perf_counter() - t0)
        out[d] = statistics.median(times)
    env.close()
    fresh.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    print(
        f"\nEnvPool throughput, TextWorld-Express cookingworld, {a.episodes} episodes in lockstep"
    )
    print("| workers | env steps/s | vs in-process |")
    print("|---|---|---|")
    base = None
    for w in (0, 1, 2):
        s = steps_per_s(w, a.episodes, a.steps)
        base = base or s
        print(f"| {w if w else '0 (in-process)'} | {s:.0f} | {s / base:.2f}x |")
    print("\nVerified restore by replay (median of 3)")
    print("| env | depth 10 (s) | depth 40 (s) | per replayed step (ms) |")
    print("|---|---|---|---|")
    twx_task = TWXEnv.list_tasks("train", game="cookingworld", num_tasks=1)[0]
    r = restore_cost("twx", twx_task, [10, 40], step_limit=1000)
    print(f"| twx cookingworld | {r[10]:.3f} | {r[40]:.3f} | {1000 * (r[40] - r[10]) / 30:.2f} |")
    try:
        import alfworld  # noqa: F401

        if ALF.exists():
            from salvage.envs.alfworld import ALFWorldEnv

            task = ALFWorldEnv.list_tasks("val", data_path=str(ALF))[0]
            r = restore_cost("alfworld", task, [10, 40], repeats=1, max_steps=1000)
            print(
                f"| alfworld (sample game) | {r[10]:.3f} | {r[40]:.3f} | {1000 * (r[40] - r[10]) / 30:.2f} |"
            )
    except ImportError:
        print("| alfworld | (extra not installed) | | |")


if __name__ == "__main__":
    main()
