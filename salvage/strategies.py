"""Training strategies: FSDP2 as Lightning's ``ModelParallelStrategy`` with a data-parallel-only mesh.

``ModelParallelStrategy`` defaults to tensor parallelism across the processes of a node
(``tensor_parallel_size="auto"``). salvage shards with FSDP2 only, so ``FSDP2Strategy``
puts every process on the data-parallel dimension; the modules' ``configure_model``
applies ``fully_shard`` per decoder layer (``salvage.distributed.shard_model``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 over all processes (``trainer.devices`` x ``trainer.num_nodes``).

    Args:
        save_distributed_checkpoint: each rank writes its shard (a checkpoint directory);
            False gathers a single-file checkpoint on rank 0 (needs the memory for it).
        **kwargs: other ``ModelParallelStrategy`` arguments (``process_group_backend``: default
            ``cpu:gloo,cuda:nccl`` on GPUs, see ``default_backend``; ``timeout``).
    """

    def __init__(self, save_distributed_checkpoint: bool = True, **kwargs: Any) -> None:
        for key in ("data_parallel_size", "tensor_parallel_size"):
            if key in kwargs:
                raise ValueError(
                    f"trainer.strategy.init_args.{key}: FSDP2Strategy sets it (all processes shard "
                    "data-parallel); use ModelParallelStrategy directly to choose the mesh"
                )
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            **kwargs,
        )

    def setup_environment(self) -> None:
        self._data_parallel_size = self.world_size
        super().setup_environment()

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or default_backend(self.root_device.type)

    def model_to_device(self) -> None:
        # CPU-offloaded shards (model.fsdp.cpu_offload) stay in CPU memory (salvage.distributed)
        from salvage.distributed import to_device

        assert self.model is not None
        to_device(self.model, self.root_device)


def default_backend(device_type: str) -> str:
    """The process group's backends when the config names none.

    On GPUs both: NCCL for CUDA tensors and gloo for CPU ones, since CPU-offloaded shards
    (``model.fsdp.cpu_offload``, a ``reference: offload``) are reduced for gradient clipping
    and gathered with ``full_tensor()`` for the vLLM weight sync on the CPU; an NCCL-only group
    fails there ("No backend type associated with device type cpu").
    """
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
