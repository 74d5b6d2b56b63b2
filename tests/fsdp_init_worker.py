"""Build a GRPO module (policy + reference) sharded with FSDP2 on 2 gloo processes (run by
test_fsdp.py, one process per rank: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set).

    python tests/fsdp_init_worker.py OUT_DIR [--every-rank-loads]

Every rank writes ``OUT_DIR/rank<r>.pt``: the full parameters (``full_tensor()``) and the
buffers of both models, their trainable flags, whether the LM head is still tied, and how
many times this rank read real weights (``load_model``) or built a meta model.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import salvage.modules.grpo as grpo  # noqa: E402
from salvage.distributed import FSDPConfig, is_sharded  # noqa: E402
from salvage.models import PolicySpec  # noqa: E402

SPEC = PolicySpec("tiny", dtype="bfloat16", trainable_layers=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--every-rank-loads", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("data_parallel",))
    calls = {"load_model": 0, "build_empty_model": 0}
    for name in calls:  # count the calls, the real functions still run
        real = getattr(grpo, name, None)
        if real is None:
            continue

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        setattr(grpo, name, counted)
    fsdp = FSDPConfig(init_on_rank0=False) if args.every_rank_loads else FSDPConfig()
    module = grpo.GRPOModule(policy=SPEC, kl_coef=0.05, fsdp=fsdp)
    module.build(mesh)
    out: dict = {"calls": calls}
    for key, model in (("policy", module.policy), ("ref", module.ref_model)):
        assert model is not None and is_sharded(model)
        params = {}
        for n, p in model.named_parameters():
            params[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        out[key] = {
            "params": params,
            "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
            "trainable": {n: p.requires_grad for n, p in model.named_parameters()},
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "training": model.training,
        }
    torch.save(out, Path(args.out) / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
