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


def test_model_to_device_leaves_cpu_offloaded_shards_on_the_cpu():
    """Lightning moves the whole module to the GPU after ``configure_model``; FSDP2 with CPU
    offloading refuses shards found off the CPU at its first forward. The offloaded model's
    parameters stay, its buffers (rotary frequencies) and everything else move ("meta"
    stands in for the GPU here)."""
    from salvage.strategies import FSDP2Strategy

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.policy = torch.nn.Linear(2, 2)
            self.offloaded = torch.nn.Linear(2, 2)
            self.offloaded.register_buffer("freq", torch.ones(2), persistent=False)
            self.offloaded._salvage_offloaded = True  # what shard_model marks

    net = Net()
    s = FSDP2Strategy()
    s._parallel_devices = [torch.device("meta")]
    s.model = net
    s.model_to_device()
    assert net.policy.weight.device.type == "meta"
    assert net.offloaded.weight.device.type == "cpu" and net.offloaded.bias.device.type == "cpu"
    assert net.offloaded.freq.device.type == "meta"
