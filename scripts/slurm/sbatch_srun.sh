#!/usr/bin/env bash
# Slurm batch job without torchrun: srun starts one task per GPU (process); the train script reads
# SLURM_PROCID / SLURM_LOCALID / SLURM_STEP_NUM_TASKS itself.
#
# Usage: sbatch [sbatch options] scripts/slurm/sbatch_srun.sh TRAIN_SCRIPT [TRAIN_ARGS...]
#   (submit from the repository root, or set PROJECT_DIR)
#
#   sbatch -N 2 --ntasks-per-node=4 --gpus-per-node=4 -c 8 scripts/slurm/sbatch_srun.sh imagenet/train.py /data
#
# Exports MASTER_ADDR (the job's first node) and MASTER_PORT (15000 + job id % 20000 unless set);
# rank = SLURM_PROCID, local rank = SLURM_LOCALID (GPU index on the node), world = SLURM_STEP_NUM_TASKS.
# Give every task all GPUs of its node (--gpus-per-node, not --gpus-per-task with binding), so that
# local rank N can use GPU N.
# Preemption / time limit: Slurm sends SIGUSR2 to this script 180 s before the limit (--signal);
# the tasks checkpoint and stop, and the job requeues itself and resumes (see scripts/slurm/requeue.sh).
# Log: %x-%j.out in the submit directory (appended to across requeues).
# Environment: PROJECT_DIR, PYTHON (default: python), MASTER_PORT, MAX_REQUEUES.
#
#SBATCH --job-name=ddp-srun
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR2@180
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
## On GPU clusters also (or on the sbatch command line):  --gpus-per-node=4  --cpus-per-task=8
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

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-$((15000 + SLURM_JOB_ID % 20000))}
export MASTER_ADDR MASTER_PORT
run_requeueable srun --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" --kill-on-bad-exit=1 "${PYTHON:-python}" "$@"
