"""Rollout and update throughput of salvage's GRPO path, for `tiny` and SmolLM2.

Runs the real training loop (GRPOModule + RLVRDataModule + HF engine) for a few updates
per model and reads the module's own `perf/*` metrics; the first update is warm-up and
is dropped. Prints a table. Not a test.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/throughput.py [--steps 3] [--models tiny smollm2-135m-instruct]

Efficiency against the machine's own limits, probed in the same process right after each
model's run (same threads; ``benchmarks/probes.py``):

- update: needed FLOPs per second (``salvage.core.flops.update_flops`` over each trained
  sequence, prompt + response, LM head at the response positions only, no padding;
  divided by the wall time of ``GRPOModule.update``) over the GEMM probe's FLOP/s at the
  model's layer shapes on (micro-batch x mean sequence length) rows.
- decode: rollout tokens/s (``perf/rollout_tokens_per_s``: sampling and the behaviour
  log-prob pass) over the bandwidth floor, B x probed bandwidth / bytes of weights read per
  decode step, B = sequences per engine call.
- ``--accelerator gpu``: bf16-mixed, the probes on the GPU in bf16 (weights read as bf16),
  and MFU = needed update FLOPs/s over the device's published dense bf16 peak.

Times on a shared 2-core machine are noisy: compare rows measured in the same run.

``--packing``: instead, one real rollout batch per model, then the same GRPO update on it
(same starting weights, a fresh optimiser each time) with prompt packing and length-aware
micro-batches off and on (``model.pack_prompts``, ``model.length_aware_micro_batches``),
alternating, ``--repeats`` times each; prints the update times, their ratio, the padding
fraction of the positions run and the tokens run relative to the unpacked update.

``--before-after``: the whole GRPO step (rollout with its behaviour log-probs, then the
update) with the settings from before the rollout and update speed-ups against today's defaults, on the same
prompts with the same seed and the same starting weights (a fresh optimiser each time),
alternating before / after ``--repeats`` times each in one process (after one warm-up
training step that also picks the prompts). "before": ``engine.hf_decode_loop: generate``,
``engine.hf_recompute_logprobs: true``, ``model.pack_prompts: false``,
``model.length_aware_micro_batches: false``, ``model.logprob_chunk_size: 0`` (unchunked, as
before the multi-GPU (FSDP2) work); "after": the defaults. Prints per-phase medians (sampling, behaviour
log-prob pass, update, step), the step-time ratio after / before, whether both variants
sampled the same token ids on every repeat (the update's work is the same only then), and
the efficiency columns: ``update_eff`` over the same needed FLOPs for both variants (each
sample's prompt + response, as above: the work asked for, not what the packed update runs),
``update_eff_run`` over the FLOPs the update ran (layers on the tokens run, LM head on the
scored positions), and ``decode_eff`` (generated tokens over the sampling time, behaviour
log-prob pass excluded, over the bandwidth floor at the engine's batch).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from probes import bandwidth_probe, gemm_probe, published_peak  # noqa: E402

from salvage.callbacks.cost import CostTracker  # noqa: E402
from salvage.core.flops import decode_floor_tokens_per_s, update_flops  # noqa: E402
from salvage.datamodules.rlvr import RLVRDataModule  # noqa: E402
from salvage.lm import set_logprob_chunk_size  # noqa: E402
from salvage.memory import shape_of  # noqa: E402
from salvage.models import PolicySpec  # noqa: E402
from salvage.modules.grpo import GRPOModule  # noqa: E402
from salvage.rollout.config import EngineConfig  # noqa: E402
from salvage.rollout.hf import HFEngine  # noqa: E402
from salvage.tasks.math import MathData  # noqa: E402


class _Grab(L.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:  # noqa: ANN001
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def measure(
    model: str, steps: int, prompts: int, n: int, new_tokens: int, accelerator: str = "cpu"
) -> dict[str, float]:
    micro_batch = 8
    module = GRPOModule(
        policy=PolicySpec(model), lr=1e-6, num_minibatches=2, micro_batch_size=micro_batch
    )
    engine = EngineConfig(max_new_tokens=new_tokens)
    data = RLVRDataModule(
        train=MathData(source="reasoning_gym:basic_arithmetic", size=200),
        prompts_per_step=prompts,
        group_size=n,
        max_prompt_tokens=256,
        engine=engine,
    )
    # the update's wall time and the sequences it trained on, per step
    upd: list[tuple[float, list[int], list[int]]] = []
    inner_update = module.update

    def timed_update(batch, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        out = inner_update(batch, *a, **kw)
        turns = [u for t in batch.trajectories for u in t.turns if u.train and u.response_ids]
        seq = [len(u.prompt_ids) + len(u.response_ids) for u in turns]
        upd.append((time.perf_counter() - t0, seq, [len(u.response_ids) for u in turns]))
        return out

    module.update = timed_update  # type: ignore[method-assign]
    grab = _Grab()
    gpu = accelerator == "gpu"
    with tempfile.TemporaryDirectory() as d:
        trainer = L.Trainer(
            accelerator=accelerator,
            precision="bf16-mixed" if gpu else "32-true",
            devices=1,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[CostTracker(), grab],
            default_root_dir=d,
        )
        t0 = time.perf_counter()
        trainer.fit(module, datamodule=data)
        wall = time.perf_counter() - t0
    rows = grab.rows[1:] or grab.rows
    med = lambda k: statistics.median(r[k] for r in rows if k in r)  # noqa: E731
    shape = shape_of({"name_or_path": model})
    kept = upd[1:] or upd
    upd_flops_s = statistics.median(
        update_flops(shape, seq, scored_lens=resp) / dt for dt, seq, resp in kept
    )
    mean_len = statistics.mean(x for _, seq, _ in kept for x in seq)
    # probes: same process, same threads, right after the run
    dev = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    gemm = gemm_probe(shape, micro_batch * round(mean_len), dev, dtype)
    bw = bandwidth_probe(dev)
    batch = min(prompts * n, engine.batch_size)
    floor = decode_floor_tokens_per_s(shape, batch, bw, weight_bytes=2 if gpu else 4)
    res = {
        "params_M": sum(p.numel() for p in module.policy.parameters()) / 1e6,
        "rollout_tok_s": med("perf/rollout_tokens_per_s"),
        "update_tok_s": med("perf/update_tokens_per_s"),
        "step_s": med("perf/step_s"),
        "resp_len": med("rollout/response_len"),
        "wall_s": wall,
        "upd_GFLOP_s": upd_flops_s / 1e9,
        "gemm_GFLOP_s": gemm / 1e9,
        "update_eff": upd_flops_s / gemm,
        "bw_GB_s": bw / 1e9,
        "floor_tok_s": floor,
        "decode_eff": med("perf/rollout_tokens_per_s") / floor,
    }
    if gpu:
        peak = published_peak(torch.cuda.get_device_name())
        res["mfu"] = upd_flops_s / peak if peak else float("nan")
    return res


class _Capture(L.Callback):
    def __init__(self) -> None:
        self.batch = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.batch = copy.deepcopy(batch)


VARIANTS = {"off": (False, False), "on": (True, True)}


def measure_packing(
    model: str, prompts: int, n: int, new_tokens: int, repeats: int
) -> dict[str, dict[str, float]]:
    """The update alone, packing + length-aware micro-batches off vs on, on one real batch."""
    micro_batch = 8
    module = GRPOModule(
        policy=PolicySpec(model), lr=1e-6, num_minibatches=2, micro_batch_size=micro_batch
    )
    data = RLVRDataModule(
        train=MathData(source="reasoning_gym:basic_arithmetic", size=200),
        prompts_per_step=prompts,
        group_size=n,
        max_prompt_tokens=256,
        engine=EngineConfig(max_new_tokens=new_tokens),
    )
    cap = _Capture()
    with tempfile.TemporaryDirectory() as d:
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[cap],
            default_root_dir=d,
        )
        trainer.fit(module, datamodule=data)
    assert cap.batch is not None
    # a detached copy of the module: the timed updates run outside the trainer
    learner = GRPOModule(
        policy=PolicySpec(model), lr=1e-6, num_minibatches=2, micro_batch_size=micro_batch
    )
    learner.configure_model()
    start = copy.deepcopy(learner.policy.state_dict())
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    out: dict[str, dict[str, float]] = {}
    for _ in range(repeats):
        for name, (pack, la) in VARIANTS.items():
            learner.policy.load_state_dict(start)
            learner.hparams.pack_prompts, learner.hparams.length_aware_micro_batches = pack, la
            opt = learner.configure_optimizers()["optimizer"]
            before = list(learner.forward_positions)
            t0 = time.perf_counter()
            values = learner.update(copy.deepcopy(cap.batch), opt, None, 0)
            times[name].append(time.perf_counter() - t0)
            now = learner.forward_positions
            run, real, scored = (now[i] - before[i] for i in range(3))
            out[name] = {
                "update_s": 0.0,
                "positions": run,
                "tokens": real,
                "scored": scored,
                "pad_frac": 1 - real / run,
                "loss": values["loss/policy"],
            }
    for name in VARIANTS:
        out[name]["update_s"] = statistics.median(times[name])
        out[name]["tokens_vs_off"] = out[name]["tokens"] / out["off"]["tokens"]
        out[name]["positions_vs_off"] = out[name]["positions"] / out["off"]["positions"]
        out[name]["time_vs_off"] = out[name]["update_s"] / statistics.median(times["off"])
    return out


def main_packing(a: argparse.Namespace) -> None:
    print(
        f"\nGRPO update, packing + length-aware micro-batches off vs on, {a.prompts} prompts x "
        f"{a.n} samples x <= {a.new_tokens} new tokens, micro-batch 8, 2 minibatches, median "
        f"of {a.repeats} alternating, threads={torch.get_num_threads()}"
    )
    cols = ["update_s", "time_vs_off", "positions", "tokens", "scored", "pad_frac"]
    cols += ["tokens_vs_off", "positions_vs_off", "loss"]
    print("| model | variant | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for m in a.models:
        res = measure_packing(m, a.prompts, a.n, a.new_tokens, a.repeats)
        for name, r in res.items():
            print(f"| {m} | {name} | " + " | ".join(f"{r[c]:.4g}" for c in cols) + " |")


BEFORE_AFTER = {
    # (engine settings, module settings)
    "before": (
        dict(hf_decode_loop="generate", hf_recompute_logprobs=True),
        dict(pack_prompts=False, length_aware_micro_batches=False, logprob_chunk_size=0),
    ),
    "after": ({}, {}),  # today's defaults
}


def measure_before_after(
    model: str, prompts: int, n: int, new_tokens: int, repeats: int, seed: int = 1234
) -> tuple[dict[str, dict[str, float]], bool]:
    """The whole GRPO step, issue-16 "before" settings vs today's defaults, alternating."""
    micro_batch = 8
    kw = dict(lr=1e-6, num_minibatches=2, micro_batch_size=micro_batch)
    module = GRPOModule(policy=PolicySpec(model), **kw)
    data = RLVRDataModule(
        train=MathData(source="reasoning_gym:basic_arithmetic", size=200),
        prompts_per_step=prompts,
        group_size=n,
        max_prompt_tokens=256,
        engine=EngineConfig(max_new_tokens=new_tokens),
    )
    picked: list = []
    inner_rollout = data.train_rollout

    def grab_tasks(tasks):  # noqa: ANN001, ANN202
        picked.append(list(tasks))
        return inner_rollout(tasks)

    data.train_rollout = grab_tasks  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as d:  # one training step: warm-up, picks the prompts
        trainer = L.Trainer(
            accelerator="cpu",
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=d,
        )
        trainer.fit(module, datamodule=data)
    tasks = picked[0]
    # a detached learner: the timed steps run outside the trainer, from the same weights
    learner = GRPOModule(policy=PolicySpec(model), **kw)
    learner.configure_model()
    start = copy.deepcopy(learner.policy.state_dict())
    defaults = {k: learner.hparams[k] for k in BEFORE_AFTER["before"][1]}
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in BEFORE_AFTER}
    same = True
    seq: list[int] = []
    resp: list[int] = []
    for _ in range(repeats):
        tokens: dict[str, list[list[int]]] = {}
        for name, (eng_kw, mod_kw) in BEFORE_AFTER.items():
            learner.policy.load_state_dict(start)
            for k, v in {**defaults, **mod_kw}.items():
                learner.hparams[k] = v
            set_logprob_chunk_size(learner.policy, learner.hparams.logprob_chunk_size)
            cfg = EngineConfig(max_new_tokens=new_tokens, **eng_kw)
            engine = HFEngine.from_config(cfg, learner.policy, learner.tokenizer)
            t0 = time.perf_counter()
            batch = data.rollout(tasks, n=n, seed=seed, engine=engine, tokenizer=learner.tokenizer)
            t1 = time.perf_counter()
            opt = learner.configure_optimizers()["optimizer"]
            before = list(learner.forward_positions)
            learner.update(batch, opt, None, 0)
            t2 = time.perf_counter()
            turns = [u for g in batch.groups for t in g.trajectories for u in t.turns]
            tokens[name] = [list(u.response_ids) for u in turns]
            seq = [len(u.prompt_ids) + len(u.response_ids) for u in turns]
            resp = [len(u.response_ids) for u in turns]
            lt = engine.last_timings
            rows[name].append(
                {
                    "sample_s": lt["sample_s"],
                    "logprob_s": lt["logprob_s"],
                    "rollout_s": t1 - t0,
                    "update_s": t2 - t1,
                    "step_s": t2 - t0,
                    "gen_tokens": float(sum(resp)),
                    "tokens_run": float(learner.forward_positions[1] - before[1]),
                }
            )
        same = same and tokens["before"] == tokens["after"]
    shape = shape_of({"name_or_path": model})
    needed = update_flops(shape, seq, scored_lens=resp)
    # what the update actually ran: the layers on the tokens run (packed: each prompt once
    # per micro-batch it appears in), the LM head on the same scored positions; attention's
    # length term taken as in the unpacked sequences (small at these lengths)
    body = update_flops(shape, seq, scored_lens=[0] * len(seq))
    gemm = gemm_probe(shape, micro_batch * round(statistics.mean(seq)), "cpu", torch.float32)
    bw = bandwidth_probe("cpu")
    floor = decode_floor_tokens_per_s(shape, min(prompts * n, EngineConfig().batch_size), bw)
    out: dict[str, dict[str, float]] = {}
    for name, rs in rows.items():
        m = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        m["update_eff"] = needed / m["update_s"] / gemm
        run = needed - body + body * m["tokens_run"] / sum(seq)
        m["update_eff_run"] = run / m["update_s"] / gemm
        m["decode_eff"] = m["gen_tokens"] / m["sample_s"] / floor
        out[name] = m
    ratios = [
        round(x["step_s"] / y["step_s"], 3)
        for x, y in zip(rows["after"], rows["before"], strict=True)
    ]
    for m in out.values():
        m["per_repeat"] = ratios  # type: ignore[assignment]
        m["step_vs_before"] = m["step_s"] / out["before"]["step_s"]
        m["update_vs_before"] = m["update_s"] / out["before"]["update_s"]
        m["rollout_vs_before"] = m["rollout_s"] / out["before"]["rollout_s"]
        m["gemm_GFLOP_s"] = gemm / 1e9
        m["floor_tok_s"] = floor
    return out, same


def main_before_after(a: argparse.Namespace) -> None:
    print(
        f"\nGRPO step, issue-16 before settings vs today's defaults, {a.prompts} prompts x "
        f"{a.n} samples x <= {a.new_tokens} new tokens, micro-batch 8, 2 minibatches, median "
        f"of {a.repeats} alternating, threads={torch.get_num_threads()}, fp32"
    )
    cols = ["step_s", "step_vs_before", "sample_s", "logprob_s", "rollout_s", "rollout_vs_before"]
    cols += ["update_s", "update_vs_before", "gen_tokens", "tokens_run", "update_eff"]
    cols += ["update_eff_run"]
    cols += ["gemm_GFLOP_s", "decode_eff", "floor_tok_s"]
    print("| model | variant | " + " | ".join(cols) + " | same tokens |")
    print("|---|---|" + "---|" * (len(cols) + 1))
    for m in a.models:
        res, same = measure_before_after(m, a.prompts, a.n, a.new_tokens, a.repeats)
        for name, r in res.items():
            line = " | ".join(f"{r[c]:.4g}" for c in cols if c in r)
            print(f"| {m} | {name} | {line} | {'yes' if same else 'NO'} |", flush=True)
        pairs = res["after"]["per_repeat"]
        print(f"{m}: step after / before per repeat: {pairs}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m-instruct"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--packing", action="store_true", help="update only: packing off vs on")
    ap.add_argument(
        "--repeats", type=int, default=2, help="--packing, --before-after: timed runs per variant"
    )
    ap.add_argument(
        "--before-after",
        action="store_true",
        help="whole GRPO step: issue-16 before settings vs today's defaults",
    )
    a = ap.parse_args()
    if a.before_after:
        main_before_after(a)
        return
    if a.packing:
        main_packing(a)
        return
    results = {
        m: measure(m, a.steps, a.prompts, a.n, a.new_tokens, a.accelerator) for m in a.models
    }
    print(
        f"\nGRPO throughput, {a.prompts} prompts x {a.n} samples x <= {a.new_tokens} new tokens, "
        f"median of updates 2..{a.steps}, threads={torch.get_num_threads()}"
    )
    cols = ["params_M", "rollout_tok_s", "update_tok_s", "step_s", "resp_len", "wall_s"]
    cols += ["upd_GFLOP_s", "gemm_GFLOP_s", "update_eff", "bw_GB_s", "floor_tok_s", "decode_eff"]
    if a.accelerator == "gpu":
        cols.append("mfu")
        name = torch.cuda.get_device_name()
        if published_peak(name) is None:
            print(f"unknown device {name!r}: no published peak, MFU not computed")
    print("| model | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for m, r in results.items():
        print(f"| {m} | " + " | ".join(f"{r[c]:.3g}" for c in cols) + " |")


if __name__ == "__main__":
    main()
