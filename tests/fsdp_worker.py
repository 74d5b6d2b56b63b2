"""One training step of a salvage module on a fixed batch, single-process or FSDP2 (run by test_fsdp.py).

    python tests/fsdp_worker.py {grpo|vhgpo|graft} OUT_DIR --devices {1|2} [--strategy ddp|ddp-unused] [--checkpoint]
        [--logprob-chunk N] [--every-rank-loads]

``--devices 2`` trains under Lightning's ``ModelParallelStrategy`` (FSDP2, gloo on CPU):
Lightning re-launches this script for rank 1, each rank takes its share of the global
batch (uneven on purpose: different numbers of rows, micro-batches and relays per rank).
``--devices 1`` trains one process on the whole batch. Rank 0 writes the full trained
parameters to ``OUT_DIR/params.pt`` and every rank its local shard sizes to
``OUT_DIR/shards_<rank>.json``; ``--checkpoint`` also writes ``last.ckpt`` (a
distributed checkpoint directory under FSDP).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import lightning as L  # noqa: E402
import torch  # noqa: E402

from salvage.core.grpo import assign_advantages  # noqa: E402
from salvage.distributed import FSDPConfig, world  # noqa: E402
from salvage.lm import response_logprobs  # noqa: E402
from salvage.models import PolicySpec, load_policy  # noqa: E402
from salvage.types import (  # noqa: E402
    Group,
    PairedBatch,
    RelayData,
    RolloutBatch,
    SeqTarget,
    Trajectory,
    Turn,
)

SPEC_A = PolicySpec("tiny")
SPEC_B = PolicySpec("tiny", vocab_size=384, seed=1)
# successes per group: A's and B's (GRAFT uses both; GRPO / VH-GPO use A's)
SUCC_A = [[1, 0, 0, 1], [0, 0, 1, 0], [1, 1, 0], [0, 0]]
SUCC_B = [[0, 0, 0, 0], [1, 0, 1, 0], [0, 0, 0], [1, 0]]
WORDS = ["the", "answer", "is", "boxed", "go", "north", "take", "coin", "3", "7", "+", "="]


def _texts(q: int, n: int) -> list[str]:
    g = torch.Generator().manual_seed(100 + q)
    out = []
    for _ in range(n):
        k = int(torch.randint(2, 9, (1,), generator=g))
        out.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g)))
    return out


def _groups(spec: PolicySpec, succ: list[list[int]]) -> list[Group]:
    """Real token ids of a real tokenizer; behaviour log-probs = the initial policy's, perturbed."""
    model, tok = load_policy(spec)
    model.eval()
    groups = []
    for q, pattern in enumerate(succ):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": f"What is {q} + 1?"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        p_ids = list(tok(prompt, add_special_tokens=False)["input_ids"])
        texts = _texts(q, len(pattern))
        resp = [
            list(tok(t, add_special_tokens=False)["input_ids"]) + [int(tok.eos_token_id)]
            for t in texts
        ]
        with torch.no_grad():
            lps = response_logprobs(
                model, [p_ids] * len(resp), resp, int(tok.pad_token_id), temperature=1.0
            )
        g = torch.Generator().manual_seed(7 + q)
        trajs = []
        for text, ids, lp, s in zip(texts, resp, lps, pattern, strict=True):
            noise = (torch.rand(len(lp), generator=g) - 0.5) * 0.6  # ratios away from 1: some clip
            trajs.append(
                Trajectory(
                    turns=[
                        Turn(
                            p_ids,
                            ids,
                            [float(x) for x in torch.tensor(lp) + noise],
                            response_text=text,
                        )
                    ],
                    reward=float(s),
                    success=bool(s),
                )
            )
        grp = Group(task_id=f"q{q}", trajectories=trajs, task={"id": f"q{q}"})
        assign_advantages(grp, "grpo", 1e-6, 1e-6, 1e-6)
        groups.append(grp)
    return groups


def _relays(spec: PolicySpec) -> list[RelayData]:
    _, tok = load_policy(spec)

    def tgt(text: str, ctx: str) -> SeqTarget:
        return SeqTarget(
            list(tok(ctx, add_special_tokens=False)["input_ids"]),
            list(tok(text, add_special_tokens=False)["input_ids"]),
        )

    return [
        RelayData(
            bridge=[tgt("take coin", "room a"), tgt("go north", "room b")],
            resume=[tgt("go east", "hall")],
            pair=(tgt("take coin", "room a"), tgt("go west", "room a")),
        ),
        RelayData(
            bridge=[tgt("open door", "room c")],
            resume=[tgt("take key", "room d"), tgt("go south", "room e")],
            pair=(tgt("go north", "room b"), tgt("look", "room b")),
        ),
        RelayData(bridge=[tgt("take apple", "kitchen")], resume=[], pair=None),
    ]


def _share(groups: list[Group], rank: int, world_size: int) -> list[int]:
    """Rank r's groups: a contiguous half (uneven sizes across ranks by construction)."""
    n = len(groups)
    return list(range(rank * n // world_size, (rank + 1) * n // world_size))


def build_batch(kind: str, rank: int, world_size: int) -> RolloutBatch:
    ga = _groups(SPEC_A, SUCC_A)
    mine = _share(ga, rank, world_size)
    if kind == "graft":
        gb = _groups(SPEC_B, SUCC_B)
        ra = RolloutBatch(groups=[ga[i] for i in mine])
        rb = RolloutBatch(groups=[gb[i] for i in mine])
        return PairedBatch(groups=ra.groups, a=ra, b=rb)
    batch = RolloutBatch(groups=[ga[i] for i in mine])
    # two minibatches: global {g0, g2} then {g1, g3}; each rank holds one group of each
    glob = [[0, 2], [1, 3]]
    batch.minibatch_groups = [[mine.index(i) for i in mb if i in mine] for mb in glob]
    if kind == "vhgpo":
        relays = _relays(SPEC_A)
        batch.relays = relays[rank::world_size]
    return batch


class FixedData(L.LightningDataModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def train_dataloader(self):  # one step; the index is replaced by the fixed batch
        return torch.utils.data.DataLoader([0], batch_size=1, collate_fn=list)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        rank, n = world()
        return build_batch(self.kind, rank, n)


def make_module(
    kind: str, fsdp: FSDPConfig | None = None, chunk: int | None = None
) -> L.LightningModule:
    common = dict(lr=1e-3, micro_batch_size=2, max_grad_norm=1.0, fsdp=fsdp or FSDPConfig())
    if chunk is not None:
        common["logprob_chunk_size"] = chunk
    if kind == "grpo":
        from salvage.modules.grpo import GRPOModule

        return GRPOModule(
            policy=SPEC_A, num_minibatches=2, kl_coef=0.05, shuffle_minibatches=False, **common
        )
    if kind == "vhgpo":
        from salvage.modules.vhgpo import VHGPOModule

        return VHGPOModule(
            policy=SPEC_A,
            num_minibatches=2,
            loss_agg="seq-mean-token-mean",
            beta=0.1,
            shuffle_minibatches=False,
            **common,
        )
    from salvage.modules.graft import GRAFTModule

    return GRAFTModule(
        policy_a=SPEC_A, policy_b=SPEC_B, num_minibatches=1, balance="none", **common
    )


def policies(module: L.LightningModule) -> dict[str, torch.nn.Module]:
    if hasattr(module, "a"):
        return {"a": module.a.policy, "b": module.b.policy}
    return {"policy": module.policy}


def record_gathered(module: L.LightningModule, out: Path) -> None:
    """Wrap ``module.receive`` (the real one still runs) to write, per call, the receiver and
    which of the two policies are gathered meanwhile, to ``OUT_DIR/gathered_<rank>.json``."""
    from salvage.distributed import is_gathered

    real = module.receive
    seen: list[dict] = []

    def receive(src, dst, prompts, receiver, *a, **kw):
        seen.append(
            {
                "receiver": "a" if receiver is module.a else "b",
                "a": is_gathered(module.a.policy),
                "b": is_gathered(module.b.policy),
            }
        )
        (out / f"gathered_{world()[0]}.json").write_text(json.dumps(seen))
        return real(src, dst, prompts, receiver, *a, **kw)

    module.receive = receive


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["grpo", "vhgpo", "graft"])
    ap.add_argument("out")
    ap.add_argument("--devices", type=int, default=1)
    # ddp-unused: DDP with find_unused_parameters (what co-training needs on DDP)
    ap.add_argument("--strategy", choices=["fsdp", "ddp", "ddp-unused"], default="fsdp")
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--reference", default="shard", choices=["shard", "offload", "replicate"])
    ap.add_argument("--logprob-chunk", type=int, default=None)
    ap.add_argument("--every-rank-loads", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, verbose=False)
    kw: dict = {}
    if args.devices > 1 and args.strategy == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        kw["strategy"] = ModelParallelStrategy(
            data_parallel_size=args.devices, tensor_parallel_size=1
        )
    elif args.devices > 1 and args.strategy == "ddp-unused":  # the name the refusal gives
        kw["strategy"] = "ddp_find_unused_parameters_true"
    elif args.devices > 1:
        kw["strategy"] = "ddp"
    callbacks = []
    if args.checkpoint:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(
            ModelCheckpoint(
                dirpath=str(out / "checkpoints"),
                save_last=True,
                save_top_k=0,
                every_n_train_steps=1,
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        max_steps=1,
        logger=False,
        enable_checkpointing=args.checkpoint,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=str(out),
        **kw,
    )
    module = make_module(
        args.kind,
        FSDPConfig(
            activation_checkpointing=args.activation_checkpointing,
            reference=args.reference,
            init_on_rank0=not args.every_rank_loads,
        ),
        args.logprob_chunk,
    )
    if args.kind == "graft":  # which policies are gathered while each receiver scores
        record_gathered(module, out)
    trainer.fit(module, datamodule=FixedData(args.kind))
    rank, _ = world()
    # which policies recompute their activations (HF's flag, set by shard_model)
    (out / f"checkpointing_{rank}.json").write_text(
        json.dumps(
            {
                name: bool(getattr(model, "is_activation_checkpointing", False))
                for name, model in policies(module).items()
            }
        )
    )
    shards = {}
    full = {}
    for name, model in policies(module).items():
        for pname, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            shards[f"{name}.{pname}"] = [int(local.numel()), int(p.numel()), type(p).__name__]
        if args.devices > 1 and args.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            sd = get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        else:
            sd = model.state_dict()
        full.update({f"{name}.{k}": v.detach().cpu().clone() for k, v in sd.items()})
    (out / f"shards_{rank}.json").write_text(json.dumps(shards))
    if rank == 0:
        torch.save(full, out / "params.pt")
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        (out / "metrics.json").write_text(json.dumps(metrics))
    print("done", args.kind, "rank", rank, file=sys.stderr)


if __name__ == "__main__":
    main()
