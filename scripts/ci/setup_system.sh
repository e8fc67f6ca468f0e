#!/usr/bin/env bash
# CI machine setup for the launcher tests: the real launchers, then a single-node Slurm cluster.
#
# Usage: scripts/ci/setup_system.sh
#
#   1. apt-get installs whatever is missing of: slurm-wlm munge (Slurm), mpich (mpiexec.hydra),
#      openmpi-bin (mpirun.openmpi), shellcheck. Needs root; without root or network it warns.
#   2. scripts/ci/setup_slurm.sh starts munged, slurmctld and slurmd (SLURM_CONF=/tmp/slurm-ci/slurm.conf).
#   Python packages (accelerate, ...) come from requirements-dev.txt.
#
# It never fails the CI run by itself: a launcher that could not be installed or started makes its
# tests skip with the reason shown in pytest's summary (-ra).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

case "${1:-}" in
  "") ;;
  -h|--help) usage; exit 0 ;;
  *) usage_error "unknown argument $1" ;;
esac

need=()
command -v slurmctld >/dev/null || need+=(slurm-wlm)
command -v munged >/dev/null || need+=(munge)
command -v mpiexec.hydra >/dev/null || need+=(mpich)
command -v mpirun.openmpi >/dev/null || need+=(openmpi-bin)
command -v shellcheck >/dev/null || need+=(shellcheck)
if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing ${need[*]}"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null; } ||
      echo "warning: apt-get install ${need[*]} failed; those tests will be skipped" >&2
  else
    echo "warning: not root, cannot install ${need[*]}; those tests will be skipped" >&2
  fi
fi
"$(dirname "${BASH_SOURCE[0]}")/setup_slurm.sh" || echo "warning: Slurm did not start; the Slurm tests will be skipped" >&2
