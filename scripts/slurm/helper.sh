#!/usr/bin/env bash
# Run torchrun on this node of a multi-node job (the Palmetto guide's helper.sh). Start it once per node.
#
# Usage: scripts/slurm/helper.sh MASTER_HOST PROJECT_DIR NODES GPUS_PER_NODE EPOCHS [TRAIN_SCRIPT [TRAIN_ARGS...]]
#
#   MASTER_HOST     the job's first node (c10d endpoint MASTER_HOST:MASTER_PORT, port default 29500)
#   PROJECT_DIR     the repository root on the shared filesystem (the script cd's there)
#   NODES           number of nodes; GPUS_PER_NODE: processes per node
#   EPOCHS          passed to the train script as --epochs EPOCHS
#   TRAIN_SCRIPT    relative to PROJECT_DIR (default: cifar_resnet/train.py); TRAIN_ARGS follow it
#
#   salloc -N 2 --gpus-per-node=2 --ntasks-per-node=1 -c 16
#   srun scripts/slurm/helper.sh "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)" "$PWD" 2 2 30
#
# Environment: MASTER_PORT (29500), RDZV_ID (default SLURM_JOB_ID, else "helper"), PYTHON.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

case "${1:-}" in -h|--help) usage; exit 0 ;; esac
[ $# -ge 5 ] || usage_error "expected MASTER_HOST PROJECT_DIR NODES GPUS_PER_NODE EPOCHS, got $# argument(s)"
MASTER_HOST=$1 PROJECT_DIR=$2 NODES=$3 GPUS=$4 EPOCHS=$5
shift 5
need_int NODES "$NODES"
need_int GPUS_PER_NODE "$GPUS"
need_int EPOCHS "$EPOCHS"
[ -d "$PROJECT_DIR" ] || die "PROJECT_DIR $PROJECT_DIR is not a directory on $(hostname)"
cd "$PROJECT_DIR"
[ $# -gt 0 ] || set -- cifar_resnet/train.py

exec scripts/torchrun_multinode.sh --nnodes "$NODES" --nproc-per-node "$GPUS" \
  --master "$MASTER_HOST:${MASTER_PORT:-29500}" --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-helper}}" \
  "$@" --epochs "$EPOCHS"
