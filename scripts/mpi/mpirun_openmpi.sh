#!/usr/bin/env bash
# MPI launch with Open MPI's mpirun and a hostfile whose FIRST line is the master.
#
# Usage: scripts/mpi/mpirun_openmpi.sh [--hostfile FILE] [--ppn N] [--dist-backend B] TRAIN_SCRIPT [TRAIN_ARGS...]
#
#   --hostfile FILE   "host slots=N" lines (or plain "host"); the first host is MASTER_ADDR
#                     (env HOSTFILE, default ./hostfile)
#   --ppn N           processes per node (env PPN; default: the visible GPUs, or 1)
#   --dist-backend B  passed to the train script
#
#   scripts/mpi/mpirun_openmpi.sh --hostfile hostfile --ppn 4 imagenet/train.py /data/imagenet
#
# Runs: mpirun -np HOSTS*PPN --hostfile FILE --map-by ppr:PPN:node --bind-to none
#       -x MASTER_ADDR=<first host> -x MASTER_PORT -x PATH [-x PYTHONPATH] PYTHON TRAIN_SCRIPT TRAIN_ARGS
# Each process reads OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK (common/distributed.py).
# As root, Open MPI also wants OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.
# Environment: MASTER_PORT (29500), PYTHON (made absolute), MPIRUN (default: mpirun.openmpi if
# installed next to another MPI, else mpirun).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
# shellcheck source-path=SCRIPTDIR source=hostfile.sh
source "$(dirname "${BASH_SOURCE[0]}")/hostfile.sh"

HOSTFILE=${HOSTFILE:-hostfile}
PPN=$(NPROC_PER_NODE=${PPN:-${NPROC_PER_NODE:-}} default_nproc)
MPIRUN=${MPIRUN:-$(command -v mpirun.openmpi || echo mpirun)}
BACKEND=()
while [ $# -gt 0 ]; do
  case "$1" in
    --hostfile|-f) need_value "$1" "$#"; HOSTFILE=$2; shift 2 ;;
    --ppn) need_value "$1" "$#"; PPN=$2; shift 2 ;;
    --dist-backend) need_value "$1" "$#"; BACKEND=(--dist-backend "$2"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) break ;;
  esac
done
need_int --ppn "$PPN"
check_train_script "${1:-}"
read_hostfile "$HOSTFILE"
command -v "$MPIRUN" >/dev/null || die "$MPIRUN: command not found (apt-get install openmpi-bin, or 'module load openmpi')"
"$MPIRUN" --version 2>&1 | grep -q "Open MPI\|OpenRTE" ||
  die "$MPIRUN is not Open MPI's mpirun (MPICH / Intel MPI: use scripts/mpi/mpiexec_hydra.sh, or set MPIRUN)"
PYTHON=$("${PYTHON:-python}" -c "import sys; print(sys.executable)") || die "${PYTHON:-python} does not run (set PYTHON)"

export MASTER_PORT=${MASTER_PORT:-29500}
run_exec "$MPIRUN" -np "$((${#HOSTS[@]} * PPN))" --hostfile "$HOSTFILE" --map-by "ppr:$PPN:node" --bind-to none \
  -x "MASTER_ADDR=${HOSTS[0]}" -x MASTER_PORT -x PATH ${PYTHONPATH:+-x PYTHONPATH} \
  "$PYTHON" "$@" "${BACKEND[@]}"
