"""salvage's GRPO loop vs TRL's ``GRPOTrainer``: rollout and update throughput, step time.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/vs_trl.py \
        [--trl-python .trl-venv/bin/python] [--models tiny smollm2-135m-instruct] [--rounds 2]

TRL lives in its own virtual environment, anywhere outside the repository (``python3 -m venv
.trl-venv``; then first ``pip install torch==2.13.0``, so that pip takes the CPU build already
installed or cached rather than fetching the CUDA one, then ``pip install trl==1.16.0
math-verify transformers==X`` with X the project venv's transformers version, then ``pip
install --no-deps -e .`` for the shared reward code); this script runs each side in a fresh
subprocess, salvage's in this interpreter and TRL's in ``--trl-python``
(``benchmarks/_trl_side.py``), alternately (salvage, TRL, TRL-compact, then TRL-compact, TRL,
salvage, ... for ``--rounds``) so that machine noise hits all sides.

"TRL with its LM-head overhead removed" (the third side, ``trl_compact``; ``--no-trl-compact``
skips it): TRL 1.16's fused LM head scores only the completion positions on a Triton device
(CUDA, XPU) but every position (prompt and padding included) elsewhere, so that its tile shapes
stay fixed; on CPU that projects and log-softmaxes the whole sequence through the vocabulary-wide head
in the forward and again in the backward's recompute. The third side runs TRL with the Triton
device's choice (``trl.trainer.utils._use_triton`` patched to true: same log-probs, entropies
and gradients at the completion positions, checked to 0.0 difference) and everything else
unchanged, including TRL's backward recompute of the head and its entropy on every scored token.

Both sides get: the same weights (``tiny`` is saved once as an HF directory; SmolLM2 is
salvage's local safetensors cache), the same prompts in the same step order (reasoning-gym
basic_arithmetic; the order salvage's ``StepBatches`` draws, handed to TRL with
``shuffle_dataset=False``), the same math-verify reward code, P prompts x G samples x <= L
new tokens, temperature 1, top-p 1, no top-k, fp32 on CPU, the same thread count,
AdamW at a constant lr (both fused: salvage's default since the profile of this benchmark
showed the for-loop kernel at 11% of an update; TRL's default ``adamw_torch_fused``;
``--trl-optim adamw_torch`` gives TRL the for-loop kernel), grad-norm clip 1.0, beta = 0 (no reference model), clip
0.2 / 0.28, token-mean loss, std-normalised group advantages, and per generation batch
the same work: K optimiser steps of P*G/K sequences in micro-batches of M (TRL:
``per_device_train_batch_size=M``, ``gradient_accumulation_steps=P*G/(K*M)``,
``steps_per_generation=P*G/M``, ``num_iterations=1``, which makes TRL compute the
old-policy log-probs with one extra forward pass, as salvage's engine does), TRL's
gradient checkpointing off (its default is on).

Timed, per RL step (one generation batch and its K optimiser steps); first step dropped:
- salvage: rollout = ``RLVRDataModule.train_rollout`` (tokenise, ``generate``, behaviour
  log-prob pass, reward, advantages); update = ``GRPOModule.update`` (rows, collation,
  forward, loss, backward, clip, AdamW, scheduler, metrics); step = wall time between
  consecutive ``on_train_batch_end``.
- TRL: see ``_trl_side.py`` (``_generate_and_score_completions``; ``on_step_begin`` ->
  ``on_step_end`` less the rollout inside it; wall time between RL-step ends).
Update tok/s = (non-pad prompt + completion tokens trained on) / update time; rollout
tok/s = generated tokens / rollout time. Not a test; compare ratios on a shared machine.

Efficiency against the machine's own limits (``benchmarks/probes.py``), probed at the end
of every salvage-side process (same threads, alternating with TRL's runs), pooled medians,
and applied to both sides:
- update efficiency: needed FLOPs per second (``salvage.core.flops.update_flops`` over each
  trained sequence, prompt + completion, LM head at the completion positions only, no
  padding, divided by the update time) over the fp32 GEMM probe at the model's layer
  shapes on (micro-batch x mean sequence length) rows.
- decode efficiency: rollout tok/s over the bandwidth floor P*G x probed bandwidth / fp32
  bytes of weights read per decode step (both sides generate the P*G sequences at once).
Both sides run on the CPU, so there is no MFU here (``throughput.py --accelerator gpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from salvage.core.flops import decode_floor_tokens_per_s, update_flops
from salvage.core.memory import Shape

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {  # P prompts x G samples x L new tokens, K minibatches, micro-batch M, RL steps (first is warm-up)
    "tiny": dict(prompts=4, n=4, new_tokens=64, minibatches=2, micro_batch=8, steps=5),
    "smollm2-135m-instruct": dict(
        prompts=2, n=4, new_tokens=32, minibatches=2, micro_batch=4, steps=6
    ),
}


# --------------------------------------------------------------------------- salvage side


def salvage_side(spec: dict, out_path: str) -> None:
    import torch

    torch.set_num_threads(int(spec["threads"]))
    import lightning as L
    from _trl_side import make_reward
    from probes import bandwidth_probe, gemm_probe

    from salvage.datamodules.rlvr import RLVRDataModule
    from salvage.memory import shape_of
    from salvage.models import PolicySpec
    from salvage.modules.grpo import GRPOModule
    from salvage.rollout.config import EngineConfig
    from salvage.tasks.math import MathData

    P, G, M = spec["prompts"], spec["n"], spec["micro_batch"]
    seed = int(spec.get("seed", 0))
    module = GRPOModule(
        policy=PolicySpec(spec["model_dir"]),
        lr=spec["lr"],
        num_minibatches=spec["minibatches"],
        micro_batch_size=M,
        kl_coef=0.0,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        loss_agg="token-mean",
        max_grad_norm=1.0,
        seed=seed,
    )
    data = RLVRDataModule(
        train=MathData(source=spec["jsonl"]),
        prompts_per_step=P,
        group_size=G,
        engine=EngineConfig(
            temperature=1.0,
            top_p=1.0,
            max_new_tokens=spec["new_tokens"],
            batch_size=P * G,
            logprob_batch_size=M,
        ),
        reward=make_reward(spec.get("reward")),
        seed=seed,
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
        "reward_mean": [],
        "success": [],
        "prompt_lens": [],
    }

    inner_rollout = data.train_rollout

    def timed_rollout(tasks):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        batch = inner_rollout(tasks)
        rec["rollout_s"].append(time.perf_counter() - t0)
        trajs = batch.trajectories
        rec["gen_tokens"].append(float(sum(t.num_response_tokens for t in trajs)))
        rec["upd_tokens"].append(
            float(
                sum(
                    len(u.prompt_ids) + len(u.response_ids)
                    for t in trajs
                    for u in t.turns
                    if u.train and u.response_ids
                )
            )
        )
        rec["resp_len"].append(rec["gen_tokens"][-1] / max(len(trajs), 1))
        turns = [u for t in trajs for u in t.turns if u.train and u.response_ids]
        rec["seq_lens"].append([len(u.prompt_ids) + len(u.response_ids) for u in turns])
        rec["resp_lens"].append([len(u.response_ids) for u in turns])
        rec["prompt_lens"].append([len(u.prompt_ids) for u in turns])
        rec["reward_mean"].append(statistics.mean(t.reward for t in trajs))
        rec["success"].append(statistics.mean(float(t.success) for t in trajs))
        return batch

    data.train_rollout = timed_rollout
    inner_update = module.update

    def timed_update(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        out = inner_update(*a, **kw)
        rec["update_s"].append(time.perf_counter() - t0)
        return out

    module.update = timed_update

    class StepEnd(L.Callback):
        def on_train_batch_end(self, *args) -> None:  # noqa: ANN002
            rec["step_end"].append(time.perf_counter())

    with tempfile.TemporaryDirectory() as d:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=spec["steps"],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[StepEnd()],
            default_root_dir=d,
        )
        t0 = time.perf_counter()
        trainer.fit(module, datamodule=data)
        rec["wall_s"] = [time.perf_counter() - t0]
    rec["params_M"] = [sum(p.numel() for p in module.policy.parameters()) / 1e6]
    if spec.get("probes", True):
        # machine-limit probes: this process, this thread count, right after the run
        lens = [x for step in rec["seq_lens"][1:] or rec["seq_lens"] for x in step]
        shape = shape_of({"name_or_path": spec["model_dir"]})
        rec["gemm_flops_s"] = [gemm_probe(shape, M * round(statistics.mean(lens)))]
        rec["bandwidth"] = [bandwidth_probe()]
    json.dump(rec, open(out_path, "w"))


# --------------------------------------------------------------------------- orchestration


def prepare(
    model: str, work: Path, steps: int, prompts: int, seed: int = 0
) -> tuple[str, Path, Path]:
    """The model directory both sides load, salvage's task file, TRL's prompts in the order
    salvage's data seed ``seed`` draws them."""
    from salvage.datamodules.base import StepBatches
    from salvage.models import PolicySpec, load_policy, smollm2_checkpoint
    from salvage.tasks.math import MathData, load_math_tasks

    if model == "tiny":
        mdir = work / "tiny"
        if not (mdir / "config.json").exists():
            m, tok = load_policy(PolicySpec("tiny"))
            m.save_pretrained(mdir)
            tok.save_pretrained(mdir)
    elif model == "smollm2-135m-instruct":
        mdir = smollm2_checkpoint()
    else:
        mdir = Path(model)
    tasks, _ = load_math_tasks(MathData(source="reasoning_gym:basic_arithmetic", size=64))
    jsonl = work / "tasks.jsonl"
    with jsonl.open("w") as f:
        for t in tasks:
            f.write(
                json.dumps({"id": t.id, "problem": t.messages[-1]["content"], "answer": t.answer})
                + "\n"
            )
    order = StepBatches(
        len(tasks), prompts, seed, SimpleNamespace(world_size=1, global_rank=0, global_step=0)
    )
    rows = [
        {"messages": tasks[i].messages, "answer": tasks[i].answer}
        for k in range(steps)
        for i in order.batch(k)
    ]
    trl_tasks = work / f"trl_tasks_{prompts}_{steps}_{seed}.json"
    trl_tasks.write_text(json.dumps(rows))
    return str(mdir), jsonl, trl_tasks


def run_side(side: str, spec: dict, work: Path, trl_python: str, tag: str) -> dict:
    spec_path, out = work / f"spec_{tag}.json", work / f"out_{tag}.json"
    spec_path.write_text(json.dumps(spec))
    th = str(spec["threads"])
    env = dict(
        os.environ,
        OMP_WAIT_POLICY="PASSIVE",
        OMP_NUM_THREADS=th,
        MKL_NUM_THREADS=th,
        TOKENIZERS_PARALLELISM="false",
        SALVAGE_PROGRESS="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="disabled",
        PYTHONWARNINGS="ignore",
    )
    if side == "salvage":
        cmd = [sys.executable, __file__, "--side", "salvage", str(spec_path), str(out)]
    else:
        if side == "trl_compact":
            spec = dict(spec, compact_head=True)
            spec_path.write_text(json.dumps(spec))
        cmd = [trl_python, str(ROOT / "benchmarks" / "_trl_side.py"), str(spec_path), str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{side} side failed ({tag}):\n{proc.stderr[-4000:]}")
    res = json.loads(out.read_text())
    res["proc_s"] = time.perf_counter() - t0
    return res


def _update_tok_s(run: dict) -> list[float]:
    """Update tok/s of each RL step of one run, the first (warm-up) step dropped."""
    n = min(len(run["rollout_s"]), len(run["update_s"]))
    return [run["upd_tokens"][k] / run["update_s"][k] for k in range(1, n)]


def summarise(runs: list[dict], shape: Shape) -> dict[str, float]:
    """Per-step figures pooled over rounds, first RL step of each run dropped; medians."""
    roll, upd, step, resp, flops = [], [], [], [], []
    for r in runs:
        n = min(len(r["rollout_s"]), len(r["update_s"]))
        for k in range(1, n):
            roll.append(r["gen_tokens"][k] / r["rollout_s"][k])
            upd.append(r["upd_tokens"][k] / r["update_s"][k])
            resp.append(r["resp_len"][k])
            needed = update_flops(shape, r["seq_lens"][k], scored_lens=r["resp_lens"][k])
            flops.append(needed / r["update_s"][k])
        ends = r["step_end"]
        step += [b - a for a, b in zip(ends, ends[1:], strict=False)]
    med = statistics.median
    return {
        "rollout_tok_s": med(roll),
        "update_tok_s": med(upd),
        "step_s": med(step),
        "resp_len": med(resp),
        "update_flops_s": med(flops),
        "params_M": runs[0]["params_M"][0],
        "n": len(upd),
        "proc_s": sum(r["proc_s"] for r in runs),
    }


def trl_versions(trl_python: str) -> list[str]:
    """trl, transformers and torch versions of the TRL interpreter."""
    return subprocess.run(
        [
            trl_python,
            "-c",
            "import trl, transformers, torch; "
            "print(trl.__version__, transformers.__version__, torch.__version__)",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", default=list(SETTINGS))
    ap.add_argument("--trl-python", default=".trl-venv/bin/python")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--raw", help="also write every run's per-step records to this JSON file")
    ap.add_argument(
        "--no-trl-compact",
        action="store_true",
        help="skip the third side: TRL with its LM head scoring completion positions only "
        "(its Triton path; on CPU it scores every position), the 'LM-head overhead removed' ratio",
    )
    ap.add_argument(
        "--trl-optim",
        default="adamw_torch_fused",
        help="TRL's optim (its default on torch >= 2.8: adamw_torch_fused; adamw_torch = the for-loop kernel)",
    )
    a = ap.parse_args()
    if a.side == "salvage":
        spec_path, out = a.args
        return salvage_side(json.loads(Path(spec_path).read_text()), out)
    if not Path(a.trl_python).exists():
        sys.exit(f"no TRL interpreter at {a.trl_python} (see the docstring for the venv)")
    trl_version = trl_versions(a.trl_python)
    from salvage.memory import shape_of

    results: dict[str, dict[str, dict[str, float]]] = {}
    limits: dict[str, dict[str, float]] = {}
    raw: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as d:
        work = Path(d)
        for model in a.models:
            s = dict(SETTINGS.get(model, SETTINGS["smollm2-135m-instruct"]))
            mdir, jsonl, trl_tasks = prepare(model, work, s["steps"], s["prompts"])
            spec = dict(
                s,
                model_dir=mdir,
                jsonl=str(jsonl),
                tasks=str(trl_tasks),
                lr=a.lr,
                threads=a.threads,
                trl_optim=a.trl_optim,
            )
            sides = ("salvage", "trl") if a.no_trl_compact else ("salvage", "trl", "trl_compact")
            runs: dict[str, list[dict]] = {side: [] for side in sides}
            for r in range(a.rounds):
                order = sides if r % 2 == 0 else sides[::-1]
                for side in order:
                    runs[side].append(run_side(side, spec, work, a.trl_python, f"{side}_{r}"))
                    print(
                        f"  {model} round {r + 1} {side}: {runs[side][-1]['proc_s']:.0f} s",
                        file=sys.stderr,
                    )
            shape = shape_of({"name_or_path": mdir})
            results[model] = {side: summarise(v, shape) for side, v in runs.items()}
            gemm = statistics.median(r["gemm_flops_s"][0] for r in runs["salvage"])
            bw = statistics.median(r["bandwidth"][0] for r in runs["salvage"])
            limits[model] = {
                "gemm": gemm,
                "bw": bw,
                "floor": decode_floor_tokens_per_s(shape, s["prompts"] * s["n"], bw),
            }
            raw[model] = runs
    if a.raw:
        Path(a.raw).write_text(json.dumps(raw, indent=1))
    print(
        f"\nsalvage GRPO vs TRL {trl_version[0]} GRPOTrainer (transformers {trl_version[1]}, torch {trl_version[2]}), "
        f"CPU fp32, {a.threads} threads, {a.rounds} alternating rounds, median over RL steps 2.. of each run; "
        f"optimiser: salvage adamw (fused), TRL {a.trl_optim}"
    )
    for model in a.models:
        s = SETTINGS.get(model, SETTINGS["smollm2-135m-instruct"])
        print(
            f"- {model}: {s['prompts']} prompts x {s['n']} samples x <= {s['new_tokens']} new tokens, "
            f"{s['minibatches']} optimiser steps of {s['prompts'] * s['n'] // s['minibatches']} seqs "
            f"(micro-batch {s['micro_batch']}) per RL step, {s['steps']} RL steps per run"
        )
        lim = limits[model]
        print(
            f"  probes: fp32 GEMM {lim['gemm'] / 1e9:.1f} GFLOP/s at its layer shapes, "
            f"bandwidth {lim['bw'] / 1e9:.1f} GB/s -> decode floor {lim['floor']:,.0f} tok/s "
            f"at batch {s['prompts'] * s['n']}"
        )
    print(
        "| model | side | rollout tok/s | update tok/s | step (s) | response len | "
        "update GFLOP/s (needed) | update eff. (/ GEMM probe) | decode eff. (/ bandwidth floor) | "
        "ratio salvage/this side (rollout / update / step time) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    names = {"salvage": "salvage", "trl": "TRL", "trl_compact": "TRL, LM head on completions only"}
    for model, res in results.items():
        sv = res["salvage"]
        lim = limits[model]
        for side, r in res.items():
            ratio = (
                f"{sv['rollout_tok_s'] / r['rollout_tok_s']:.2f}x / "
                f"{sv['update_tok_s'] / r['update_tok_s']:.2f}x / {sv['step_s'] / r['step_s']:.2f}x"
                if side != "salvage"
                else ""
            )
            print(
                f"| {model} | {names[side]} | {r['rollout_tok_s']:,.0f} | {r['update_tok_s']:,.0f} | "
                f"{r['step_s']:.2f} | {r['resp_len']:.1f} | {r['update_flops_s'] / 1e9:.2f} | "
                f"{r['update_flops_s'] / lim['gemm']:.2f} | {r['rollout_tok_s'] / lim['floor']:.3f} | "
                f"{ratio} |"
            )
    for model, res in results.items():
        sv, tr = res["salvage"], res["trl"]
        line = (
            f"{model}: update throughput salvage/TRL {sv['update_tok_s'] / tr['update_tok_s']:.2f}x"
        )
        if "trl_compact" in res:
            tc = res["trl_compact"]
            line += (
                f"; with TRL's LM-head overhead removed (TRL scoring completion positions only) "
                f"{sv['update_tok_s'] / tc['update_tok_s']:.2f}x"
            )
        line += (
            f"; step time salvage/TRL {sv['step_s'] / tr['step_s']:.2f}x (below 1: salvage faster)"
        )
        print(line)
        per_round = {
            side: [statistics.median(_update_tok_s(r)) for r in rs]
            for side, rs in raw[model].items()
        }
        print(
            "  per round (median update tok/s of each run, salvage / other side): "
            + "; ".join(
                f"{side} "
                + ", ".join(
                    f"{a_ / b_:.2f}x"
                    for a_, b_ in zip(per_round["salvage"], per_round[side], strict=True)
                )
                for side in per_round
                if side != "salvage"
            )
        )


if __name__ == "__main__":
    main()
