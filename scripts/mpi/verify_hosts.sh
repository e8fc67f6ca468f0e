#!/usr/bin/env bash
# Check that MPI reaches every host of a hostfile: runs `hostname` once per host.
#
# Usage: scripts/mpi/verify_hosts.sh [-f HOSTFILE]
#
#   -f, --hostfile FILE   (env HOSTFILE, default ./hostfile)
#
# Runs: mpiexec.hydra -ppn 1 -f HOSTFILE -n <hosts> hostname
# Prints one hostname per host and exits nonzero if a host did not answer. If this hangs or fails,
# fix passwordless ssh between the hosts (or the hostfile) before launching training.
# Environment: MPIEXEC (default: mpiexec.hydra).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
# shellcheck source-path=SCRIPTDIR source=hostfile.sh
source "$(dirname "${BASH_SOURCE[0]}")/hostfile.sh"

HOSTFILE=${HOSTFILE:-hostfile}
MPIEXEC=${MPIEXEC:-mpiexec.hydra}
while [ $# -gt 0 ]; do
  case "$1" in
    -f|--hostfile) need_value "$1" "$#"; HOSTFILE=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage_error "unknown argument $1" ;;
  esac
done
read_hostfile "$HOSTFILE"
command -v "$MPIEXEC" >/dev/null || die "$MPIEXEC: command not found (Intel MPI: source /opt/intel/oneapi/setvars.sh \
or 'module load intel-mpi'; MPICH: apt-get install mpich or 'module load mpich')"

echo "+ $MPIEXEC -ppn 1 -f $HOSTFILE -n ${#HOSTS[@]} hostname" >&2
OUT=$("$MPIEXEC" -ppn 1 -f "$HOSTFILE" -n "${#HOSTS[@]}" hostname)
echo "$OUT"
GOT=$(echo "$OUT" | grep -c .)
[ "$GOT" -eq "${#HOSTS[@]}" ] || die "expected ${#HOSTS[@]} answers (one per host in $HOSTFILE), got $GOT"
echo "ok: ${#HOSTS[@]} host(s) answered; master (first line): ${HOSTS[0]}"
