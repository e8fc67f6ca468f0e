#!/usr/bin/env bash
# torchrun on several machines with the c10d rendezvous: run the SAME command on every node.
#
# Usage: scripts/torchrun_multinode.sh --nnodes N --master HOST[:PORT] [options] TRAIN_SCRIPT [TRAIN_ARGS...]
#
#   --nnodes N | MIN:MAX   nodes (env NNODES; in a Slurm job: SLURM_NNODES). MIN:MAX is elastic.
#   --nproc-per-node N     processes per node (env NPROC_PER_NODE; default: the visible GPUs, or 1)
#   --master HOST[:PORT]   c10d endpoint: any one of the nodes, the same on all (env MASTER_ADDR,
#                          MASTER_PORT; default port 29500). Its PORT must be open between the nodes.
#   --rdzv-id ID           job id shared by all nodes (env RDZV_ID; default SLURM_JOB_ID, else "default")
#   --max-restarts N       restart all workers up to N times after a failure (env MAX_RESTARTS, default 0)
#   --rdzv-timeout SEC     how long the first node waits for the others (env RDZV_TIMEOUT, default 900)
#
#   node0$ scripts/torchrun_multinode.sh --nnodes 2 --nproc-per-node 8 --master node0:29500 \
#              --rdzv-id exp1 imagenet/train.py /data/imagenet
#   node1$ (the same command)
#
# Sets for each process: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
# TORCHELASTIC_RESTART_COUNT. Node ranks are assigned by the rendezvous (no --node-rank needed).
# SIGTERM and SIGUSR2 are forwarded to the workers (TORCHELASTIC_SIGNALS_TO_HANDLE), which then
# checkpoint and exit 75: rerunning the same command resumes.
# Environment: PYTHON (default: python) and the variables above.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PYTHON=${PYTHON:-python}
NNODES=${NNODES:-${SLURM_NNODES:-}}
NPROC=$(default_nproc)
MASTER=${MASTER_ADDR:-}
PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-default}}
MAX_RESTARTS=${MAX_RESTARTS:-0}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-900}
while [ $# -gt 0 ]; do
  case "$1" in
    --nnodes) need_value "$1" "$#"; NNODES=$2; shift 2 ;;
    --nproc-per-node|--nproc) need_value "$1" "$#"; NPROC=$2; shift 2 ;;
    --master|--rdzv-endpoint) need_value "$1" "$#"; MASTER=$2; shift 2 ;;
    --rdzv-id) need_value "$1" "$#"; RDZV_ID=$2; shift 2 ;;
    --max-restarts) need_value "$1" "$#"; MAX_RESTARTS=$2; shift 2 ;;
    --rdzv-timeout) need_value "$1" "$#"; RDZV_TIMEOUT=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) break ;;
  esac
done
[ -n "$NNODES" ] || usage_error "--nnodes is required (or NNODES)"
[[ "$NNODES" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] || usage_error "--nnodes must be N or MIN:MAX, got '$NNODES'"
[ -n "$MASTER" ] || usage_error "--master HOST[:PORT] is required (or MASTER_ADDR): the same node on every node"
need_int --nproc-per-node "$NPROC"
need_int --rdzv-timeout "$RDZV_TIMEOUT"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || usage_error "--max-restarts must be >= 0, got '$MAX_RESTARTS'"
check_train_script "${1:-}"
case "$MASTER" in
  *:*) ENDPOINT=$MASTER ;;
  *) ENDPOINT=$MASTER:$PORT ;;
esac

export TORCHELASTIC_SIGNALS_TO_HANDLE=${TORCHELASTIC_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2}
run_exec "$PYTHON" -m torch.distributed.run \
  "--nnodes=$NNODES" "--nproc-per-node=$NPROC" \
  --rdzv-backend=c10d "--rdzv-endpoint=$ENDPOINT" "--rdzv-id=$RDZV_ID" \
  "--rdzv-conf=join_timeout=$RDZV_TIMEOUT" "--max-restarts=$MAX_RESTARTS" \
  "$@"
