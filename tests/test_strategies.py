"""FSDP2Strategy choices that need no GPU to check."""

from __future__ import annotations

import torch


def test_gpu_process_groups_carry_a_cpu_backend_for_offloaded_shards():
    from salvage.strategies import FSDP2Strategy, default_backend

    assert default_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert default_backend("cpu") == "gloo"
    s = FSDP2Strategy()
    s._parallel_devices = [torch.device("cpu")]
    assert s._get_process_group_backend() == "gloo"
    assert FSDP2Strategy(process_group_backend="nccl")._get_process_group_backend() == "nccl"
