#!/usr/bin/env bash
# `accelerate launch` with the sample config; the train script runs unchanged (it reads torchrun's variables).
#
# Usage: scripts/accelerate_launch.sh [options] TRAIN_SCRIPT [TRAIN_ARGS...]
#
#   --config FILE        accelerate config (env ACCELERATE_CONFIG, default scripts/accelerate/config.yaml)
#   --nproc N            processes per machine (env NPROC_PER_NODE; default: the visible GPUs, or 1)
#   --num-machines N     machines (env NNODES, default 1)
#   --machine-rank R     this machine's rank (env NODE_RANK, default 0)
#   --main-process-ip A  machine 0's address (env MASTER_ADDR, default 127.0.0.1)
#   --main-process-port P  (env MASTER_PORT; default: a free port on one machine, 29500 on several)
#
#   scripts/accelerate_launch.sh --nproc 2 cifar_resnet/train.py --synthetic --epochs 1
#
# Runs: accelerate launch --config_file FILE --num_processes MACHINES*N --num_machines ...
#       --machine_rank R --main_process_ip A --main_process_port P TRAIN_SCRIPT TRAIN_ARGS
# Sets for each process (through torchrun): RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
# ACCELERATE_*. Environment: ACCELERATE (default: accelerate) and the variables above.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CONFIG=${ACCELERATE_CONFIG:-$(dirname "${BASH_SOURCE[0]}")/accelerate/config.yaml}
NPROC=$(default_nproc)
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
ADDR=${MASTER_ADDR:-127.0.0.1}
PORT=${MASTER_PORT:-}
ACCELERATE=${ACCELERATE:-accelerate}
while [ $# -gt 0 ]; do
  case "$1" in
    --config) need_value "$1" "$#"; CONFIG=$2; shift 2 ;;
    --nproc|--nproc-per-node) need_value "$1" "$#"; NPROC=$2; shift 2 ;;
    --num-machines) need_value "$1" "$#"; NNODES=$2; shift 2 ;;
    --machine-rank) need_value "$1" "$#"; NODE_RANK=$2; shift 2 ;;
    --main-process-ip) need_value "$1" "$#"; ADDR=$2; shift 2 ;;
    --main-process-port) need_value "$1" "$#"; PORT=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) break ;;
  esac
done
need_int --nproc "$NPROC"
need_int --num-machines "$NNODES"
if ! [[ "$NODE_RANK" =~ ^[0-9]+$ ]] || [ "$NODE_RANK" -ge "$NNODES" ]; then
  usage_error "--machine-rank must be in 0..$((NNODES - 1)), got '$NODE_RANK'"
fi
[ -f "$CONFIG" ] || usage_error "accelerate config $CONFIG not found"
check_train_script "${1:-}"
command -v "$ACCELERATE" >/dev/null || die "$ACCELERATE: command not found (pip install accelerate)"
if [ -z "$PORT" ]; then
  if [ "$NNODES" -eq 1 ]; then PORT=$(free_port); else PORT=29500; fi
fi
need_int --main-process-port "$PORT"
if [ "$NODE_RANK" -eq 0 ]; then
  check_port_free "$PORT" "pick another --main-process-port / MASTER_PORT on every machine"
fi

run_exec "$ACCELERATE" launch --config_file "$CONFIG" --num_processes "$((NNODES * NPROC))" \
  --num_machines "$NNODES" --machine_rank "$NODE_RANK" \
  --main_process_ip "$ADDR" --main_process_port "$PORT" "$@"
