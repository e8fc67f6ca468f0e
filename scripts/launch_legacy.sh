#!/usr/bin/env bash
# python -m torch.distributed.launch, for older clusters and guides: one call per node with its --node_rank.
#
# Usage: scripts/launch_legacy.sh [options] TRAIN_SCRIPT [TRAIN_ARGS...]
#
#   --nnodes N            nodes (env NNODES; in a Slurm step: SLURM_NNODES; default 1)
#   --node-rank R         this node's rank, 0 on the master (env NODE_RANK; in a Slurm step: SLURM_NODEID)
#   --nproc-per-node N    processes per node (env NPROC_PER_NODE; default: the visible GPUs, or 1)
#   --master-addr HOST    node 0's address, reachable from all nodes (env MASTER_ADDR; in a Slurm
#                         job: the first node of the job; default 127.0.0.1)
#   --master-port PORT    (env MASTER_PORT; default 29500 with several nodes, a free port on one node)
#   --use-env             do not pass --local-rank to the script (it reads LOCAL_RANK instead)
#
#   node0$ scripts/launch_legacy.sh --nnodes 2 --node-rank 0 --master-addr node0 imagenet/train.py /data
#   node1$ scripts/launch_legacy.sh --nnodes 2 --node-rank 1 --master-addr node0 imagenet/train.py /data
#   Slurm, one task per node:  srun --ntasks-per-node=1 scripts/launch_legacy.sh imagenet/train.py /data
#
# Sets for each process: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and passes
# --local-rank=N (torch.distributed.launch's old contract; every train.py here accepts it).
# The module is deprecated upstream (it prints a FutureWarning); new setups should use torchrun.
# Environment: PYTHON (default: python) and the variables above.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PYTHON=${PYTHON:-python}
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
NPROC=$(default_nproc)
MASTER_ADDR=${MASTER_ADDR:-}
PORT=${MASTER_PORT:-}
USE_ENV=()
while [ $# -gt 0 ]; do
  case "$1" in
    --nnodes) need_value "$1" "$#"; NNODES=$2; shift 2 ;;
    --node-rank|--node_rank) need_value "$1" "$#"; NODE_RANK=$2; shift 2 ;;
    --nproc-per-node|--nproc_per_node) need_value "$1" "$#"; NPROC=$2; shift 2 ;;
    --master-addr|--master_addr) need_value "$1" "$#"; MASTER_ADDR=$2; shift 2 ;;
    --master-port|--master_port) need_value "$1" "$#"; PORT=$2; shift 2 ;;
    --use-env|--use_env) USE_ENV=(--use-env); shift ;;
    -h|--help) usage; exit 0 ;;
    *) break ;;
  esac
done
need_int --nnodes "$NNODES"
need_int --nproc-per-node "$NPROC"
if ! [[ "$NODE_RANK" =~ ^[0-9]+$ ]] || [ "$NODE_RANK" -ge "$NNODES" ]; then
  usage_error "--node-rank must be in 0..$((NNODES - 1)), got '$NODE_RANK'"
fi
check_train_script "${1:-}"
if [ -z "$MASTER_ADDR" ]; then
  if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  elif [ "$NNODES" -eq 1 ]; then
    MASTER_ADDR=127.0.0.1
  else
    usage_error "--master-addr is required with several nodes (node 0's address, the same on every node)"
  fi
fi
if [ -z "$PORT" ]; then
  if [ "$NNODES" -eq 1 ]; then PORT=$(free_port); else PORT=29500; fi
fi
need_int --master-port "$PORT"
if [ "$NODE_RANK" -eq 0 ]; then  # node 0 listens on the port: say so now if it is taken
  check_port_free "$PORT" "pick another --master-port / MASTER_PORT on every node"
fi

run_exec "$PYTHON" -m torch.distributed.launch "${USE_ENV[@]}" \
  "--nnodes=$NNODES" "--node-rank=$NODE_RANK" "--nproc-per-node=$NPROC" \
  "--master-addr=$MASTER_ADDR" "--master-port=$PORT" \
  "$@"
