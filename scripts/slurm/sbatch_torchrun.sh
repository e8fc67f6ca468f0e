#!/usr/bin/env bash
# Slurm batch job: one srun task per node, each running torchrun (c10d) with one process per GPU.
#
# Usage: sbatch [sbatch options] scripts/slurm/sbatch_torchrun.sh TRAIN_SCRIPT [TRAIN_ARGS...]
#   (submit from the repository root, or set PROJECT_DIR)
#
#   sbatch -N 2 --gpus-per-node=4 -c 32 scripts/slurm/sbatch_torchrun.sh imagenet/train.py /data/imagenet
#
# Per node: torchrun --nnodes=$SLURM_JOB_NUM_NODES --nproc-per-node=NPROC_PER_NODE with the c10d
# endpoint on the job's first node, port 15000 + job id % 20000 (MASTER_PORT overrides), and
# --rdzv-id=$SLURM_JOB_ID. NPROC_PER_NODE defaults to SLURM_GPUS_ON_NODE, else the visible GPUs, else 1.
# Preemption / time limit: Slurm sends SIGUSR2 to this script 180 s before the limit (--signal);
# the tasks checkpoint and stop, and the job requeues itself and resumes (see scripts/slurm/requeue.sh).
# Log: %x-%j.out in the submit directory (appended to across requeues).
# Environment: PROJECT_DIR, PYTHON, NPROC_PER_NODE, MASTER_PORT, MAX_RESTARTS (torchrun restarts), MAX_REQUEUES.
#
#SBATCH --job-name=ddp-torchrun
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR2@180
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
## On GPU clusters also (or on the sbatch command line):  --gpus-per-node=4  --cpus-per-task=32
set -euo pipefail

PROJECT_DIR=${PROJECT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
if [ ! -f "$PROJECT_DIR/scripts/lib.sh" ]; then
  echo "error: $PROJECT_DIR is not the repository root (submit from it, or set PROJECT_DIR)" >&2
  exit 2
fi
# shellcheck source=scripts/lib.sh
source "$PROJECT_DIR/scripts/lib.sh"
# shellcheck source=scripts/slurm/requeue.sh
source "$PROJECT_DIR/scripts/slurm/requeue.sh"
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
[ -n "${SLURM_JOB_ID:-}" ] || usage_error "not inside a Slurm job: submit this script with sbatch"
cd "$PROJECT_DIR"
check_train_script "${1:-}"

NPROC=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-$(default_nproc)}}
MASTER=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${MASTER_PORT:-$((15000 + SLURM_JOB_ID % 20000))}
run_requeueable srun --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" --kill-on-bad-exit=1 \
  scripts/torchrun_multinode.sh --nnodes "$SLURM_JOB_NUM_NODES" --nproc-per-node "$NPROC" \
  --master "$MASTER:$PORT" --rdzv-id "$SLURM_JOB_ID" --max-restarts "${MAX_RESTARTS:-0}" "$@"
