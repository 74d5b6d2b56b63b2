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
        **kwargs: other ``ModelParallelStrategy`` arguments (``process_group_backend``, ``timeout``).
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
