"""FSDP2 checks for a GPU node, one PASS/FAIL line each (run by ``benchmarks/gpu_check.sh``).

    python benchmarks/gpu_check_fsdp.py step OUT --devices N [--variant V] [--steps S]
        [--checkpoint] [--resume CKPT]
    python benchmarks/gpu_check_fsdp.py compare ONE TWO          # N GPUs == 1 GPU
    python benchmarks/gpu_check_fsdp.py done OUT N               # every rank reached the end
    python benchmarks/gpu_check_fsdp.py export CKPT OUT          # checkpoint -> HF == trained
    python benchmarks/gpu_check_fsdp.py config CONFIG.yaml OUT   # one update at full size

``step`` trains a random-init Qwen2-shaped model (0.5B on GPU, tiny with ``--smoke-cpu``)
with GRPO and a KL reference on a fixed global batch of 5 groups x 4 sequences, split
contiguously over the ranks (3 + 2 groups on 2 GPUs), under ``FSDP2Strategy`` with bf16
compute over fp32 master weights and TF32 off, so N GPUs must end where one GPU ends.
Variants: ``base``, ``offload`` (``fsdp.cpu_offload``), ``replicate`` (``fsdp.reference``),
``ckpt`` (activation checkpointing), ``noreshard`` (``reshard_after_forward: false``).
Rank 0 writes the initial and trained parameters; every rank writes its update's
``torch.cuda.max_memory_allocated`` and a ``done`` marker.

``config`` builds the module of a shipped GPU config with random-init models of the
config's shapes at full size (``salvage.core.memory.KNOWN_SHAPES``, Qwen2 layers), runs one
update of two micro-batches at the config's sequence length on the device count its header
states (skipped when the node has fewer GPUs) and compares the update's measured peak with
``salvage fit --print_memory``'s estimate (without the vLLM shares: vLLM is not started here;
its memory is checked by gpu_check_vllm.py).

Written without access to a GPU: first run it on yours.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
SHAPE_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)
SMOKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    tie_word_embeddings=True,
)
VARIANTS = ("base", "offload", "replicate", "ckpt", "noreshard")


def line(ok: bool, name: str, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def device() -> str:
    return "cpu" if os.environ.get("GPU_CHECK_SMOKE") == "1" else "cuda"


def precise() -> None:
    """TF32 off: N GPUs and one GPU must agree to fp32 rounding, not TF32's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def sync() -> None:
    if device() == "cuda":
        torch.cuda.synchronize()


def make_model_dir(root: Path, shape: dict, name: str) -> Path:
    """A random-init Qwen2 model of ``shape`` (bf16 on disk) with salvage's in-process tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from salvage.models import build_tiny_tokenizer

    out = root / name
    if (out / "config.json").exists():
        return out
    tok = build_tiny_tokenizer(512)
    cfg = Qwen2Config(
        **shape,
        max_position_embeddings=32768,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device()):  # random init on the GPU (7B: ~30 GB in fp32, seconds)
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    tmp = root / f".{name}.partial"
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    del model
    if device() == "cuda":
        torch.cuda.empty_cache()
    return out


def wait_for(path: Path, timeout_s: float = 600) -> None:
    t0 = time.time()
    while not path.exists():
        if time.time() - t0 > timeout_s:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(1)


def global_batch(seq: int, groups: int = 5, per: int = 4):
    """The fixed global batch: ``groups`` x ``per`` random sequences, rewards alternating."""
    from salvage.types import Group, Trajectory, Turn

    g = torch.Generator().manual_seed(1234)
    out = []
    prompt = seq // 4
    for q in range(groups):
        trajs = []
        for j in range(per):
            ids = torch.randint(10, 500, (seq,), generator=g).tolist()
            lp = (-torch.rand(seq - prompt, generator=g) * 2 - 0.5).tolist()
            adv = 1.0 if j % 2 else -1.0
            trajs.append(
                Trajectory([Turn(ids[:prompt], ids[prompt:], lp)], float(j % 2), bool(j % 2), adv)
            )
        out.append(Group(f"q{q}", trajs))
    return out


class FixedData(L.LightningDataModule):
    def __init__(self, seq: int, steps: int) -> None:
        super().__init__()
        self.seq, self.steps = seq, steps

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(self.steps)), batch_size=1, collate_fn=list)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        from salvage.distributed import rank_share, world
        from salvage.types import RolloutBatch

        rank, n = world()
        groups = global_batch(self.seq)
        a, b = rank_share(len(groups), rank, n)
        return RolloutBatch(groups=groups[a:b])


class PhaseMemory(L.Callback):
    """``max_memory_allocated`` of each update, and its wall time (GPU only)."""

    def __init__(self) -> None:
        self.peak = 0.0
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        sync()
        if device() == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sync()
        self.times.append(time.perf_counter() - self.t0)
        if device() == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated() / GB)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from salvage.distributed import is_sharded

    if not is_sharded(model):
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # clone: on one CPU rank the "gathered" tensors are the parameters themselves
    return {k: v.clone() for k, v in get_model_state_dict(model, options=opts).items()}


def trainer_for(devices: int, out: Path, steps: int, callbacks: list, checkpoint: bool):
    from salvage.strategies import FSDP2Strategy

    if checkpoint:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks = callbacks + [
            ModelCheckpoint(
                dirpath=str(out / "checkpoints"),
                save_last=True,
                save_top_k=0,
                every_n_train_steps=1,
            )
        ]
    return L.Trainer(
        accelerator="gpu" if device() == "cuda" else "cpu",
        devices=devices,
        strategy=FSDP2Strategy(),
        precision="32-true",
        max_steps=steps,
        logger=False,
        enable_checkpointing=checkpoint,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        default_root_dir=str(out),
    )


def cmd_step(args) -> None:
    from salvage.core.flops import mfu, update_flops
    from salvage.core.memory import Shape
    from salvage.distributed import FSDPConfig, world
    from salvage.models import PolicySpec
    from salvage.modules.grpo import GRPOModule

    precise()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = SMOKE if device() == "cpu" else SHAPE_05B
    models = Path(os.environ.get("GPU_CHECK_DIR", tempfile.gettempdir()))
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        make_model_dir(models, shape, "step-model")
    wait_for(models / "step-model" / "config.json")
    v = args.variant
    fsdp = FSDPConfig(
        param_dtype="bfloat16" if device() == "cuda" else None,
        reduce_dtype="float32",
        reshard_after_forward=v != "noreshard",
        activation_checkpointing=v == "ckpt",
        cpu_offload=v == "offload",
        reference="replicate" if v == "replicate" else "shard",
    )
    L.seed_everything(0, verbose=False)
    module = GRPOModule(
        policy=PolicySpec(str(models / "step-model"), dtype="float32"),
        lr=1e-5,  # fp32 master weights: every parameter moves by ~lr on the first step
        kl_coef=0.05,
        micro_batch_size=2,
        num_minibatches=1,
        shuffle_minibatches=False,
        fsdp=fsdp,
    )
    mem = PhaseMemory()
    init: dict[str, torch.Tensor] = {}

    class Initial(L.Callback):  # the parameters before the first update (a collective)
        def on_train_start(self, trainer, pl_module):
            init.update(full_state(pl_module.policy))

    trainer = trainer_for(args.devices, out, args.steps, [mem, Initial()], args.checkpoint)
    trainer.fit(module, datamodule=FixedData(args.seq, args.steps), ckpt_path=args.resume)
    rank, n = world()
    trained = full_state(module.policy)
    c = module.policy.config
    sh = Shape(
        sum(p.numel() for p in module.policy.parameters()),  # a DTensor's numel is global
        c.num_hidden_layers,
        c.hidden_size,
        c.intermediate_size,
        c.num_key_value_heads * (c.hidden_size // c.num_attention_heads),
        c.vocab_size,
    )
    # one update over all 20 sequences: forward + backward (+ recompute) + the KL reference
    flops = update_flops(sh, [args.seq] * 20, recompute=v == "ckpt", frozen_forwards=1)
    step_s = sorted(mem.times)[len(mem.times) // 2] if mem.times else float("nan")
    peak = float(os.environ.get("GPU_CHECK_PEAK_TFLOPS", "989")) * 1e12
    result = {
        "rank": rank,
        "world": n,
        "peak_gb": mem.peak,
        "step_s": step_s,
        "mfu": mfu(flops, step_s, peak, n) if device() == "cuda" else float("nan"),
        "skipped": float(module.skipped_updates),
    }
    (out / f"mem_rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        if init:
            torch.save(init, out / "init.pt")
        torch.save(trained, out / "params.pt")
        (out / "metrics.json").write_text(json.dumps(result))
    (out / f"done_rank{rank}").write_text("ok")
    print(f"step {v} rank {rank}/{n} done: {json.dumps(result)}", file=sys.stderr)


def cmd_compare(args) -> None:
    one, two = Path(args.one), Path(args.two)
    name = f"FSDP2 {args.name} equals 1 GPU"
    try:
        p1, p2 = torch.load(one / "params.pt"), torch.load(two / "params.pt")
        init = torch.load(one / "init.pt")
        m1 = json.loads((one / "metrics.json").read_text())
        m2 = json.loads((two / "metrics.json").read_text())
    except FileNotFoundError as e:
        line(False, name, f"missing output {e.filename}")
        return
    moved = min(float((p1[k].float() != init[k].float()).float().mean()) for k in p1)
    worst = max(float((p1[k].float() - p2[k].float()).abs().max()) for k in p1)
    skipped = m1["skipped"] + m2["skipped"]
    ok = worst < args.tol and moved > 0.9 and skipped == 0
    line(
        ok,
        name,
        f"max |diff| {worst:.2e} (tol {args.tol:g}), least-moved tensor {moved:.0%} of entries, "
        f"skipped updates {skipped:.0f}, peak {m2['peak_gb']:.1f} GB/GPU, MFU {m2['mfu']:.1%}",
    )


def cmd_done(args) -> None:
    out = Path(args.out)
    missing = [r for r in range(args.n) if not (out / f"done_rank{r}").exists()]
    line(
        not missing,
        f"every rank reaches the end ({args.name})",
        f"missing ranks {missing}" if missing else f"{args.n} of {args.n}",
    )


def cmd_export(args) -> None:
    from transformers import AutoModelForCausalLM

    from salvage.commands.export import export

    name = "distributed checkpoint save -> resume -> export"
    ckpt = Path(args.ckpt)
    try:
        meta = torch.load(ckpt / "meta.pt", weights_only=True)
        target = export(ckpt, Path(args.out) / "hf", overwrite=True)
        sd = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).state_dict()
        trained = torch.load(Path(args.trained) / "params.pt")
        worst = max(float((sd[k].float() - v.float()).abs().max()) for k, v in trained.items())
    except Exception as e:  # noqa: BLE001 - any failure is this check's FAIL line
        line(False, name, repr(e)[:300])
        return
    ok = worst == 0.0 and meta.get("global_step") == args.steps
    line(
        ok,
        name,
        f"global_step {meta.get('global_step')} (want {args.steps}), max |exported - trained| {worst:.2e}",
    )


def _parse(args: list[str]):
    """A config resolved by salvage's CLI parser, nothing instantiated."""
    from salvage.commands.fit import SalvageCLI

    class ParseOnly(SalvageCLI):
        def instantiate_classes(self) -> None:
            pass

    return ParseOnly(
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=False,
        auto_configure_optimizers=False,
    ).config


def cmd_config(args) -> None:
    """One update of a shipped GPU config at full size, measured against the estimate."""
    import shlex

    from salvage.core.memory import KNOWN_SHAPES, estimate
    from salvage.memory import plan_from_config

    precise()
    path = ROOT / args.config
    words = shlex.split(path.read_text().splitlines()[0].lstrip("# "))
    header = [x for i, w in enumerate(words[:-1]) if w == "--config" for x in (w, words[i + 1])]
    cfg = _parse(header or ["--config", str(path)]).as_dict()
    plan = plan_from_config(cfg)
    name = f"one update of {args.config} at full size on {plan.gpus} GPU(s)"
    have = torch.cuda.device_count() if device() == "cuda" else 1
    if device() == "cuda" and have < plan.gpus:
        print(f"SKIP {name}: this node has {have} GPU(s)")
        return
    est = estimate(plan)["update"]
    est_gb = sum(v for k, v in est.items() if "vLLM" not in k) / GB
    root = Path(os.environ.get("GPU_CHECK_DIR", tempfile.gettempdir()))
    init = cfg["model"]["init_args"]
    keys = [k for k in ("policy", "policy_a", "policy_b") if init.get(k)]
    rank0 = int(os.environ.get("LOCAL_RANK", "0")) == 0
    for k in keys:
        hub = init[k]["name_or_path"]
        s = KNOWN_SHAPES[hub] if device() == "cuda" else None
        shape = (
            SMOKE
            if s is None
            else dict(
                hidden_size=s.hidden,
                intermediate_size=s.intermediate,
                num_hidden_layers=s.layers,
                num_attention_heads=s.hidden // 128,
                num_key_value_heads=s.kv_dim // 128,
                vocab_size=s.vocab,
                tie_word_embeddings=s.tied,
            )
        )
        d = root / ("cfg-" + hub.replace("/", "_"))
        if rank0:
            make_model_dir(root, shape, d.name)
        wait_for(d / "config.json")
        init[k] = {**init[k], "name_or_path": str(d)}
    import importlib

    mod, cls = cfg["model"]["class_path"].rsplit(".", 1)
    module_cls = getattr(importlib.import_module(mod), cls)
    from salvage.distributed import FSDPConfig
    from salvage.models import PolicySpec
    from salvage.strategies import FSDP2Strategy

    kwargs = {k: v for k, v in init.items() if v is not None}
    for k in keys:
        kwargs[k] = PolicySpec(**kwargs[k])
    if "fsdp" in kwargs:
        kwargs["fsdp"] = FSDPConfig(**kwargs["fsdp"])
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    module = module_cls(**kwargs)
    seq = min(plan.update_len, 512) if device() == "cpu" else plan.update_len
    mem = PhaseMemory()
    strategy_cfg = cfg["trainer"].get("strategy")
    t = L.Trainer(
        accelerator="gpu" if device() == "cuda" else "cpu",
        devices=plan.gpus if device() == "cuda" else 1,
        strategy=FSDP2Strategy() if strategy_cfg else "auto",
        precision=cfg["trainer"].get("precision") or "32-true",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[mem],
        default_root_dir=str(root / "cfg-run"),
    )
    micro = int(init.get("micro_batch_size") or 1)

    class Data(FixedData):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            from salvage.types import Group, PairedBatch, RolloutBatch

            groups = global_batch(seq, groups=1, per=2 * micro)
            b = RolloutBatch(groups=[Group(g.task_id, g.trajectories) for g in groups])
            if len(keys) == 2:
                return PairedBatch(
                    groups=[], a=b, b=RolloutBatch(groups=global_batch(seq, 1, 2 * micro))
                )
            return b

    t.fit(module, datamodule=Data(seq, 1))
    if t.global_rank == 0:
        ok = mem.peak < 80 if device() == "cuda" else True
        line(
            ok,
            name,
            f"update peak {mem.peak:.1f} GB/GPU measured (max_memory_allocated), estimate {est_gb:.1f} GB without vLLM",
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke-cpu", action="store_true", help="tiny shapes on CPU (gloo)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("step")
    s.add_argument("out")
    s.add_argument("--devices", type=int, default=1)
    s.add_argument("--variant", choices=VARIANTS, default="base")
    s.add_argument("--steps", type=int, default=1)
    s.add_argument("--seq", type=int, default=512)
    s.add_argument("--checkpoint", action="store_true")
    s.add_argument("--resume", default=None)
    c = sub.add_parser("compare")
    c.add_argument("one")
    c.add_argument("two")
    c.add_argument("--name", default="base")
    c.add_argument("--tol", type=float, default=1e-6)
    d = sub.add_parser("done")
    d.add_argument("out")
    d.add_argument("n", type=int)
    d.add_argument("--name", default="base")
    e = sub.add_parser("export")
    e.add_argument("ckpt")
    e.add_argument("out")
    e.add_argument("trained")
    e.add_argument("--steps", type=int, default=2)
    g = sub.add_parser("config")
    g.add_argument("config")
    args = ap.parse_args()
    if args.smoke_cpu:
        os.environ["GPU_CHECK_SMOKE"] = "1"
    {
        "step": cmd_step,
        "compare": cmd_compare,
        "done": cmd_done,
        "export": cmd_export,
        "config": cmd_config,
    }[args.cmd](args)


if __name__ == "__main__":
    main()
