"""GPU check: VH-GPO and GRAFT steps under FSDP2 in bf16, the vLLM engine if importable, MFU.

    bash benchmarks/gpu_check.sh          # all visible GPUs; no internet needed

Random-init models shaped like Qwen2.5-0.5B / 1.5B (a tokenizer trained in-process;
token ids only use its first ids, the embedding keeps the real 151,936 rows). Each
check trains ``--steps`` updates of a fixed batch of ``--rows`` sequences of
``--seq`` tokens under ``salvage.strategies.FSDP2Strategy`` (bf16 compute, fp32 master
weights and reductions) and prints generation and update tokens/s and the model FLOP
utilisation over the GPUs' bf16 peak (``--peak-tflops``, default from the device name):
model FLOPs of ``salvage.core.flops`` (no embedding lookup; causal attention; the recomputed
forward under activation checkpointing).

Not run by the test suite. Written without access to a GPU: first run it on yours.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

from salvage.core.flops import forward_flops, update_flops

SHAPES = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10": 125.0,
    "4090": 165.0,
}


SMOKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    tie_word_embeddings=True,
)
DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def peak_tflops(override: float | None) -> float:
    if override:
        return override
    if DEVICE != "cuda":
        return float("nan")
    name = torch.cuda.get_device_name(0)
    for key, val in PEAK_BF16_TFLOPS.items():
        if key in name:
            return val
    return float("nan")


def make_model_dir(shape: str, root: Path) -> tuple[Path, int]:
    """A random-init Qwen2 model of the given shape, saved with salvage's in-process tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from salvage.models import build_tiny_tokenizer

    out = root / shape
    tok = build_tiny_tokenizer(512)
    cfg = Qwen2Config(
        **(SMOKE if DEVICE == "cpu" else SHAPES[shape]),
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out, n_params


def fixed_batch(tok_vocab: int, rows: int, seq: int, rank: int, relays: bool):
    from salvage.types import Group, RelayData, RolloutBatch, SeqTarget, Trajectory, Turn

    g = torch.Generator().manual_seed(1000 + rank)
    groups = []
    prompt_len = seq // 4
    for q in range(rows // 4):
        trajs = []
        for j in range(4):
            ids = torch.randint(10, tok_vocab, (seq,), generator=g).tolist()
            lp = (-torch.rand(seq - prompt_len, generator=g) * 3).tolist()
            trajs.append(
                Trajectory(
                    turns=[Turn(ids[:prompt_len], ids[prompt_len:], lp)],
                    reward=float(j % 2),
                    success=bool(j % 2),
                    advantage=1.0 if j % 2 else -1.0,
                )
            )
        groups.append(Group(task_id=f"q{q}", trajectories=trajs))
    batch = RolloutBatch(groups=groups)
    if relays:
        t = SeqTarget(list(range(10, 10 + prompt_len)), list(range(20, 20 + seq // 8)))
        batch.relays = [RelayData(bridge=[t, t], resume=[t], pair=(t, t))]
    return batch


class FixedData(L.LightningDataModule):
    def __init__(self, rows: int, seq: int, relays: bool, steps: int) -> None:
        super().__init__()
        self.rows, self.seq, self.relays, self.steps = rows, seq, relays, steps

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(self.steps)), batch_size=1, collate_fn=list)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        from salvage.distributed import world
        from salvage.types import PairedBatch

        batch = fixed_batch(512, self.rows, self.seq, world()[0], self.relays)
        if self.trainer.lightning_module.__class__.__name__ == "GRAFTModule":
            other = fixed_batch(512, self.rows, self.seq, world()[0] + 100, False)
            return PairedBatch(groups=batch.groups, a=batch, b=other)
        return batch


class Timer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        sync()
        self.t0 = time.perf_counter()
        from salvage.types import PairedBatch

        parts = [batch.a, batch.b] if isinstance(batch, PairedBatch) else [batch]
        self.tokens = sum(
            len(t.turns[0].prompt_ids) + len(t.turns[0].response_ids)
            for b in parts
            for t in b.trajectories
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sync()
        self.times.append(time.perf_counter() - self.t0)


def run_update(kind: str, model_dir: Path, n_params: int, args) -> dict:
    from salvage.distributed import FSDPConfig
    from salvage.models import PolicySpec
    from salvage.strategies import FSDP2Strategy

    fsdp = FSDPConfig(
        param_dtype="bfloat16",
        reduce_dtype="float32",
        activation_checkpointing=args.activation_checkpointing,
    )
    spec = PolicySpec(str(model_dir), dtype="float32")
    common = dict(lr=1e-6, micro_batch_size=args.micro_batch, num_minibatches=1, fsdp=fsdp)
    if kind == "vhgpo":
        from salvage.modules.vhgpo import VHGPOModule

        module = VHGPOModule(policy=spec, **common)
    else:
        from salvage.modules.graft import GRAFTModule

        module = GRAFTModule(policy_a=spec, policy_b=spec, **common)
    timer = Timer()
    devices = torch.cuda.device_count() if DEVICE == "cuda" else 1
    trainer = L.Trainer(
        accelerator="gpu" if DEVICE == "cuda" else "cpu",
        devices=devices,
        strategy=FSDP2Strategy(),
        precision="32-true",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[timer],
        default_root_dir=tempfile.mkdtemp(),
    )
    trainer.fit(module, datamodule=FixedData(args.rows, args.seq, kind == "vhgpo", args.steps))
    t = sorted(timer.times[1:] or timer.times)[len(timer.times[1:] or timer.times) // 2]
    world = trainer.world_size
    tok_s = timer.tokens * world / t
    # model FLOPs (salvage.core.flops): matmuls without the embedding lookup, causal
    # attention, the recomputed forward under activation checkpointing; every rank's rows
    # (GRAFT: both models' rows); the relay targets' few tokens are left out
    n_rows = args.rows * (2 if kind == "graft" else 1) * world
    flops = update_flops(
        shape_of(model_dir, n_params), [args.seq] * n_rows, recompute=args.activation_checkpointing
    )
    mfu = flops / (t * peak_tflops(args.peak_tflops) * 1e12 * world)
    return {
        "check": f"{kind} update (FSDP2 bf16, {world} {DEVICE.upper()})",
        "tokens/s": tok_s,
        "step_s": t,
        "MFU": mfu,
        "rank": trainer.global_rank,
    }


def shape_of(model_dir: Path, n_params: int):
    """The ``salvage.core.memory.Shape`` of a saved model (for the FLOP count)."""
    from salvage.core.memory import Shape

    c = json.loads((model_dir / "config.json").read_text())
    kv = c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
    return Shape(
        n_params,
        c["num_hidden_layers"],
        c["hidden_size"],
        c["intermediate_size"],
        kv,
        c["vocab_size"],
    )


def run_generation(model_dir: Path, n_params: int, args) -> list[dict]:
    from salvage.models import PolicySpec, load_policy
    from salvage.rollout.config import EngineConfig, build_engine
    from salvage.rollout.vllm import vllm_available

    model, tok = load_policy(PolicySpec(str(model_dir), dtype="bfloat16"))
    model = model.to(DEVICE)
    prompts = [list(range(10, 10 + args.seq // 4))] * (args.rows // 4)
    rows = []
    ok, why = vllm_available()
    dist = torch.distributed
    if ok and dist.is_initialized() and dist.get_world_size() > 1:
        # one engine per rank joins the group (external launcher): rank 0 alone would hang;
        # the single-GPU vLLM checks are in gpu_check_vllm.py
        ok, why = False, "several ranks (this table samples on rank 0 only)"
    backends = ["hf"] + (["vllm"] if ok else [])
    for backend in backends:
        eng = build_engine(
            EngineConfig(
                backend=backend,
                max_new_tokens=args.gen_tokens,
                temperature=1.0,
                batch_size=args.rows,
            ),
            model,
            tok,
        )
        if hasattr(eng, "prepare"):
            eng.prepare()
        eng.generate(prompts[:1], n=1)  # warm-up
        sync()
        t0 = time.perf_counter()
        out = eng.generate(prompts, n=4)
        sync()
        dt = time.perf_counter() - t0
        n_tok = sum(len(s.response_ids) for g in out for s in g)
        # per generated token one forward at its context (prompt + tokens so far): the
        # matmuls without the embedding lookup plus attention over the context
        shape = shape_of(model_dir, n_params)
        ctx = len(prompts[0]) + args.gen_tokens / 2
        per_token = forward_flops(shape, 1) + 4 * shape.layers * shape.hidden * ctx
        rows.append(
            {
                "check": f"generation ({backend})",
                "tokens/s": n_tok / dt,
                "step_s": dt,
                "MFU": per_token * n_tok / dt / (peak_tflops(args.peak_tflops) * 1e12),
            }
        )
        if hasattr(eng, "release"):
            eng.release()
    if not ok:
        rows.append(
            {
                "check": f"generation (vllm): skipped, {why}",
                "tokens/s": float("nan"),
                "step_s": float("nan"),
                "MFU": float("nan"),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument(
        "--smoke-cpu", action="store_true", help="tiny shapes on CPU: checks the script, not a GPU"
    )
    ap.add_argument(
        "--out",
        default=os.environ.get("GPU_CHECK_DIR", tempfile.mkdtemp(prefix="salvage-gpu-check-")),
    )
    args = ap.parse_args()
    global DEVICE
    DEVICE = "cpu" if args.smoke_cpu else "cuda"
    if args.smoke_cpu:  # checks the script, not a machine: small enough for a busy CPU
        args.rows, args.seq, args.gen_tokens = min(args.rows, 8), min(args.seq, 128), 16
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (use --smoke-cpu to check the script on CPU)")
    root = Path(args.out)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    marker = root / "models.json"
    if rank == 0 and not marker.exists():
        info = {s: [str(p), n] for s, (p, n) in ((s, make_model_dir(s, root)) for s in SHAPES)}
        marker.write_text(json.dumps(info))
    while not marker.exists():  # other ranks (re-launched by Lightning) wait for rank 0
        time.sleep(1)
    info = json.loads(marker.read_text())
    small, large = info["qwen2.5-0.5b"], info["qwen2.5-1.5b"]
    rows = [
        run_update("vhgpo", Path(large[0]), large[1], args),
        run_update("graft", Path(small[0]), small[1], args),
    ]
    if rows[0].get("rank", 0) == 0:
        rows += run_generation(Path(small[0]), small[1], args)
        where = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "CPU smoke run"
        print(f"\n| check | tokens/s | step (s) | MFU |   ({where})")
        print("|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['check']} | {r['tokens/s']:,.0f} | {r['step_s']:.2f} | {100 * r['MFU']:.1f}% |"
            )


if __name__ == "__main__":
    main()
