#!/usr/bin/env bash
# MPI launch with Intel MPI's or MPICH's mpiexec.hydra and a hostfile whose FIRST line is the master.
#
# Usage: scripts/mpi/mpiexec_hydra.sh [-f HOSTFILE] [--ppn N] [--dist-backend B] TRAIN_SCRIPT [TRAIN_ARGS...]
#
#   -f, --hostfile FILE   one host per line ("host" or "host:slots"); the first host is MASTER_ADDR
#                         (env HOSTFILE, default ./hostfile). Check it with scripts/mpi/verify_hosts.sh.
#   --ppn N               processes per node (env PPN; default: the visible GPUs, or 1)
#   --dist-backend B      passed to the train script; "ccl" (Intel oneCCL, for Intel CPUs/GPUs) is
#                         checked first: it needs the oneccl_bindings_for_pytorch package
#
#   scripts/mpi/mpiexec_hydra.sh -f hostfile --ppn 2 --dist-backend ccl cifar_resnet/train.py --synthetic
#
# Runs: mpiexec.hydra -f HOSTFILE -ppn PPN -n HOSTS*PPN -genv MASTER_ADDR <first host>
#       -genv MASTER_PORT $MASTER_PORT PYTHON TRAIN_SCRIPT TRAIN_ARGS
# Each process reads its rank from PMI_RANK / PMI_SIZE / MPI_LOCALRANKID (common/distributed.py).
# Environment: MASTER_PORT (29500; open between the hosts), PYTHON (default: python, resolved to an
# absolute path so every host runs the same interpreter), MPIEXEC (default: mpiexec.hydra).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
# shellcheck source-path=SCRIPTDIR source=hostfile.sh
source "$(dirname "${BASH_SOURCE[0]}")/hostfile.sh"

HOSTFILE=${HOSTFILE:-hostfile}
PPN=$(NPROC_PER_NODE=${PPN:-${NPROC_PER_NODE:-}} default_nproc)
MPIEXEC=${MPIEXEC:-mpiexec.hydra}
BACKEND=()
while [ $# -gt 0 ]; do
  case "$1" in
    -f|--hostfile) need_value "$1" "$#"; HOSTFILE=$2; shift 2 ;;
    --ppn) need_value "$1" "$#"; PPN=$2; shift 2 ;;
    --dist-backend) need_value "$1" "$#"; BACKEND=(--dist-backend "$2"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) break ;;
  esac
done
need_int --ppn "$PPN"
check_train_script "${1:-}"
read_hostfile "$HOSTFILE"
command -v "$MPIEXEC" >/dev/null || die "$MPIEXEC: command not found (Intel MPI: source /opt/intel/oneapi/setvars.sh \
or 'module load intel-mpi'; MPICH: apt-get install mpich or 'module load mpich')"
PYTHON=$("${PYTHON:-python}" -c "import sys; print(sys.executable)") || die "${PYTHON:-python} does not run (set PYTHON)"
if [ "${BACKEND[1]:-}" = ccl ]; then
  "$PYTHON" -c "import oneccl_bindings_for_pytorch" 2>/dev/null ||
    die "--dist-backend ccl needs Intel's oneCCL bindings for PyTorch, which $PYTHON cannot import \
(pip install oneccl_bind_pt from Intel's wheel index, and source oneAPI's setvars.sh); use gloo otherwise"
fi

run_exec "$MPIEXEC" -f "$HOSTFILE" -ppn "$PPN" -n "$((${#HOSTS[@]} * PPN))" \
  -genv MASTER_ADDR "${HOSTS[0]}" -genv MASTER_PORT "${MASTER_PORT:-29500}" \
  "$PYTHON" "$@" "${BACKEND[@]}"
