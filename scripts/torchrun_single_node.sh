#!/usr/bin/env bash
# torchrun on one machine: N processes (default: one per GPU, else 1).
#
# Usage: scripts/torchrun_single_node.sh [--nproc N] [--port PORT] [-h] TRAIN_SCRIPT [TRAIN_ARGS...]
#
#   --nproc N     processes (env NPROC_PER_NODE; default: the visible GPUs, or 1 without GPUs)
#   --port PORT   rendezvous port (env MASTER_PORT). Default: torchrun --standalone, which
#                 picks a free port itself, so two runs on one machine never collide.
#
#   scripts/torchrun_single_node.sh --nproc 8 imagenet/train.py /data/imagenet
#   scripts/torchrun_single_node.sh --nproc 2 cifar_resnet/train.py --synthetic --epochs 1
#   scripts/torchrun_single_node.sh --nproc 2 -m scripts.doctor
#
# Sets for each process: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
# Environment: PYTHON (default: python), NPROC_PER_NODE, MASTER_PORT, OMP_NUM_THREADS (torchrun's default: 1).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PYTHON=${PYTHON:-python}
NPROC=$(default_nproc)
PORT=${MASTER_PORT:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc|--nproc-per-node) need_value "$1" "$#"; NPROC=$2; shift 2 ;;
    --port) need_value "$1" "$#"; PORT=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) break ;;
  esac
done
need_int --nproc "$NPROC"
check_train_script "${1:-}"

if [ -z "$PORT" ]; then
  RDZV=(--standalone)
else
  need_int --port "$PORT"
  check_port_free "$PORT" "pick another --port / MASTER_PORT, or leave it out to get a free one"
  RDZV=(--nnodes=1 --rdzv-backend=c10d "--rdzv-endpoint=127.0.0.1:$PORT")
fi
run_exec "$PYTHON" -m torch.distributed.run "${RDZV[@]}" "--nproc-per-node=$NPROC" "$@"
