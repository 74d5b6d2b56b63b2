"""GRAFT overhead: the exchange (selection, receiver re-tokenisation, receiver likelihood pass) vs step time.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/graft_overhead.py [--steps 4] [--pairs tiny smollm2]

Runs ``configs/graft/math_tiny.yaml`` (its model and data settings) in-process for a few
updates, for two policy pairs: the config's two ``tiny`` models (BPE vocabularies 768 and
384), and SmolLM2-135M-Instruct as A with the config's B (``tiny``, vocabulary 384).

Random tiny models never solve the prompts, so no prompt is ever complementary and the
exchange would never run. The benchmark's datamodule keeps the real rollouts of both
models (real text, real generation log-probs) and overwrites only the verifier outcomes
with a fixed pattern, as ``tests/test_graft.py`` does: prompt q is complementary A -> B
for even q (A solves one response, B none) and B -> A for odd q, so every step transfers
half the prompts each way (2 + 2 groups of 4 with the config's 4 prompts) and the
receiver-side work runs on every step, for both receivers.

GRAFTModule records no timings of its own; the benchmark wraps, from the outside:
- ``salvage.modules.graft.select_transfers`` and ``GRAFTModule.receive`` (both directions):
  the exchange: complementary-prompt selection, re-tokenising each peer response with the
  receiver's tokenizer, the receiver's pi_old likelihood pass, weights, group replacement;
- ``salvage.modules.graft.response_logprobs`` (packed or not), called inside ``receive``:
  the receiver's likelihood pass alone (the rest of ``receive`` is mostly re-tokenisation);
- ``GraftDataModule._both`` (the two rollouts, with rewards) and
  ``GRAFTModule._update_both`` (the two GRPO updates);
- step: wall time between consecutive ``on_train_batch_end`` (the first step is warm-up).
Prints a table. Not a test; compare ratios, not absolute times, on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lightning as L  # noqa: E402
import yaml  # noqa: E402

import salvage.modules.graft as graft_mod  # noqa: E402
from salvage.core.grpo import assign_advantages  # noqa: E402
from salvage.datamodules.graft import GraftDataModule  # noqa: E402
from salvage.models import PolicySpec  # noqa: E402
from salvage.modules.graft import GRAFTModule  # noqa: E402
from salvage.rollout.config import EngineConfig  # noqa: E402
from salvage.tasks.math import MathData  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/graft/math_tiny.yaml"


class ForcedExchange(GraftDataModule):
    """Real rollouts of both models; outcomes scripted so that every step exchanges both ways."""

    def train_rollout(self, tasks):  # noqa: ANN001, ANN201
        batch = super().train_rollout(tasks)
        n = self.group_size
        for q, (ga, gb) in enumerate(zip(batch.a.groups, batch.b.groups, strict=True)):
            src, dst = (ga, gb) if q % 2 == 0 else (gb, ga)
            for g, ok in ((src, [i == q % n for i in range(n)]), (dst, [False] * n)):
                for t, s in zip(g.trajectories, ok, strict=True):
                    t.success, t.reward = s, float(s)
                assign_advantages(g, self.advantage, self.adv_eps, self.reward_tol, self.adv_tol)
        return batch


class Timers:
    def __init__(self) -> None:
        self.cur: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self.step_end: list[float] = []

    def add(self, key: str, dt: float) -> None:
        self.cur[key] = self.cur.get(key, 0.0) + dt

    def wrap(self, owner: object, name: str, key: str, count=None) -> None:  # noqa: ANN001
        inner = getattr(owner, name)

        def timed(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            out = inner(*a, **kw)
            self.add(key, time.perf_counter() - t0)
            if count is not None:
                count(self, a, kw, out)
            return out

        setattr(owner, name, timed)


def measure(pair: str, steps: int) -> dict[str, float]:
    cfg = yaml.safe_load(CONFIG.read_text())
    m_args = dict(cfg["model"]["init_args"])
    d_args = dict(cfg["data"]["init_args"])
    spec_a = PolicySpec(**m_args.pop("policy_a"))
    spec_b = PolicySpec(**m_args.pop("policy_b"))
    if pair == "smollm2":
        spec_a = PolicySpec("smollm2-135m-instruct")
    module = GRAFTModule(policy_a=spec_a, policy_b=spec_b, **m_args)
    data = ForcedExchange(
        train=MathData(**d_args.pop("train")), engine=EngineConfig(**d_args.pop("engine")), **d_args
    )
    tm = Timers()
    orig_select, orig_lp = graft_mod.select_transfers, graft_mod.response_logprobs

    def count_lp(t: Timers, a, kw, out) -> None:  # noqa: ANN001
        t.add("peer_responses", float(len(out)))

    tm.wrap(graft_mod, "select_transfers", "exchange")
    tm.wrap(graft_mod, "response_logprobs", "likelihood", count_lp)
    tm.wrap(module, "receive", "exchange")
    tm.wrap(module, "_update_both", "update")
    tm.wrap(data, "_both", "rollout")

    class StepEnd(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:  # noqa: ANN001, ANN002
            m = trainer.callback_metrics
            tm.cur["a_to_b"] = float(m.get("graft/transferred_a_to_b", 0.0))
            tm.cur["b_to_a"] = float(m.get("graft/transferred_b_to_a", 0.0))
            tm.steps.append(tm.cur)
            tm.cur = {}
            tm.step_end.append(time.perf_counter())

    try:
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
                callbacks=[StepEnd()],
                default_root_dir=d,
            )
            trainer.fit(module, datamodule=data)
    finally:
        graft_mod.select_transfers, graft_mod.response_logprobs = orig_select, orig_lp
    rows = tm.steps[1:]
    step_s = [b - a for a, b in zip(tm.step_end, tm.step_end[1:], strict=False)]
    med = statistics.median
    get = lambda k: med(r.get(k, 0.0) for r in rows)  # noqa: E731
    frac = med(r.get("exchange", 0.0) / s for r, s in zip(rows, step_s, strict=True))
    return {
        "a_to_b": get("a_to_b"),
        "b_to_a": get("b_to_a"),
        "peer_responses": get("peer_responses"),
        "step_s": med(step_s),
        "rollout_s": get("rollout"),
        "update_s": get("update"),
        "exchange_s": get("exchange"),
        "likelihood_s": get("likelihood"),
        "frac": frac,
        "sum_frac": sum(r.get("exchange", 0.0) for r in rows) / sum(step_s),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=4, help="updates per pair; the first is warm-up")
    ap.add_argument("--pairs", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    a = ap.parse_args()
    names = {"tiny": "tiny (768) + tiny (384)", "smollm2": "SmolLM2-135M + tiny (384)"}
    results = {p: measure(p, a.steps) for p in a.pairs}
    cfg = yaml.safe_load(CONFIG.read_text())["data"]["init_args"]
    print(
        f"\nGRAFT exchange overhead, configs/graft/math_tiny.yaml ({cfg['prompts_per_step']} prompts x "
        f"{cfg['group_size']} samples x <= {cfg['engine']['max_new_tokens']} new tokens), exchange forced on "
        f"every step, median of updates 2..{a.steps}"
    )
    print(
        "| pair | groups A->B / B->A | peer responses scored | step (s) | rollout (s) | update (s) | "
        "exchange (s) | of which likelihood pass (s) | exchange / step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for p, r in results.items():
        print(
            f"| {names[p]} | {r['a_to_b']:.0f} / {r['b_to_a']:.0f} | {r['peer_responses']:.0f} | {r['step_s']:.2f} | "
            f"{r['rollout_s']:.2f} | {r['update_s']:.2f} | {r['exchange_s']:.3f} | {r['likelihood_s']:.3f} | "
            f"{100 * r['frac']:.1f}% |"
        )


if __name__ == "__main__":
    main()
