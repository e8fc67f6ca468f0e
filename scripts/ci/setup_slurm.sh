#!/usr/bin/env bash
# Start a real single-node Slurm cluster on this machine (for CI and the tests).
#
# Usage: scripts/ci/setup_slurm.sh [--stop] [--status]
#
#   Installs slurm-wlm and munge with apt-get if they are missing (needs root),
#   writes $SLURM_CI_DIR/slurm.conf (one node = this host, CPUs=$SLURM_CI_CPUS,
#   proctrack/linuxproc, task/none, SlurmUser=root) and starts munged --force,
#   slurmctld -f CONF and slurmd -f CONF. Idempotent: does nothing if the
#   cluster already answers. Afterwards use the cluster with
#       export SLURM_CONF=$SLURM_CI_DIR/slurm.conf
#   --stop   stop the daemons this script started (by their pid files)
#   --status print sinfo and exit 0 if the cluster answers, 1 if not
#
# Environment (defaults):
#   SLURM_CI_DIR=/tmp/slurm-ci  SLURM_CI_CPUS=2  SLURM_CI_CTLD_PORT=6817  SLURM_CI_D_PORT=6818
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

DIR=${SLURM_CI_DIR:-/tmp/slurm-ci}
CPUS=${SLURM_CI_CPUS:-2}
CTLD_PORT=${SLURM_CI_CTLD_PORT:-6817}
D_PORT=${SLURM_CI_D_PORT:-6818}
CONF=$DIR/slurm.conf
ACTION=start
case "${1:-}" in
  "") ;;
  --stop) ACTION=stop ;;
  --status) ACTION=status ;;
  -h|--help) usage; exit 0 ;;
  *) usage_error "unknown argument $1" ;;
esac
[ $# -le 1 ] || usage_error "one argument at most"

answers() { [ -f "$CONF" ] && SLURM_CONF=$CONF timeout 10 sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; }

if [ "$ACTION" = status ]; then
  if answers; then SLURM_CONF=$CONF sinfo; exit 0; fi
  echo "slurm at $CONF is not running" >&2; exit 1
fi

if [ "$ACTION" = stop ]; then
  for f in "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/munged.pid"; do
    if [ -s "$f" ]; then kill "$(cat "$f")" 2>/dev/null || true; rm -f "$f"; fi
  done
  exit 0
fi

if answers; then echo "slurm already running (SLURM_CONF=$CONF)"; exit 0; fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
  [ "$(id -u)" = 0 ] || { echo "error: slurm-wlm/munge are not installed and this is not root" >&2; exit 1; }
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi

HOST=$(hostname -s)
mkdir -p "$DIR/state" "$DIR/spool" /run/munge /var/lib/munge /var/log/munge
chmod 755 /run/munge
# Debian's munge package creates /etc/munge/munge.key on install; make one if it is missing.
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  chmod 400 /etc/munge/munge.key
fi

cat > "$CONF" <<CONF
# written by scripts/ci/setup_slurm.sh
ClusterName=ci
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$D_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
KillWait=10
InactiveLimit=0
MinJobAge=600
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF

if ! pgrep -x munged >/dev/null; then
  munged --force --pid-file="$DIR/munged.pid" 2>>"$DIR/munged.err" || munged --force
fi
if [ -s "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then :; else
  slurmctld -f "$CONF"
fi
if [ -s "$DIR/slurmd.pid" ] && kill -0 "$(cat "$DIR/slurmd.pid")" 2>/dev/null; then :; else
  slurmd -f "$CONF"
fi

for _ in $(seq 1 30); do
  if answers; then
    echo "slurm is up: export SLURM_CONF=$CONF"
    SLURM_CONF=$CONF sinfo
    exit 0
  fi
  sleep 1
done
echo "error: slurm did not come up; see $DIR/slurmctld.log and $DIR/slurmd.log" >&2
tail -n 5 "$DIR/slurmctld.log" "$DIR/slurmd.log" >&2 2>/dev/null || true
exit 1
