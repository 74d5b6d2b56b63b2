#!/bin/bash
# salvage fit on N nodes with torchrun: run this once on every node, the same command but NODE_RANK.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash scripts/torchrun_fit.sh --config configs/vhgpo/alfworld_7b.yaml
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash scripts/torchrun_fit.sh --config configs/vhgpo/alfworld_7b.yaml
#
# GPUS_PER_NODE (default 8) processes per node, one per GPU; it is passed as --trainer.devices, so it
# replaces the config's trainer.devices (the GPUs of one node: 8 for alfworld_7b, 4 for
# graft/math_pair1, 2 for grpo/graft_pair1_smollm3). FSDP2 shards over NNODES x GPUS_PER_NODE GPUs:
#   salvage fit --config CONFIG --trainer.num_nodes N --print_memory true
# prints the plan. MASTER_ADDR: an address of node 0 every node reaches; MASTER_PORT (default 29500)
# free there. Lightning detects torchrun (TorchElasticEnvironment: RANK, LOCAL_RANK, WORLD_SIZE).
set -euo pipefail
: "${NNODES:?set NNODES (the number of nodes)}"
: "${NODE_RANK:?set NODE_RANK (this node: 0 .. NNODES-1)}"
: "${MASTER_ADDR:?set MASTER_ADDR (the address of node 0)}"
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# TORCHRUN: the launcher (default `torchrun`, e.g. "python -m torch.distributed.run")
# shellcheck disable=SC2086
exec ${TORCHRUN:-torchrun} --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE" \
    --node-rank="$NODE_RANK" --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
    -m salvage fit "$@" --trainer.num_nodes "$NNODES" --trainer.devices "$GPUS_PER_NODE"
