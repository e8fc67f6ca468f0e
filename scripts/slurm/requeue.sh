# Requeue-on-preemption logic shared by the sbatch scripts (sourced, not run).
#
# run_requeueable CMD...  runs CMD (an srun step) and waits for it. When the batch shell gets
# SIGUSR2 -- from `#SBATCH --signal=B:USR2@SECONDS` before the time limit, or by hand with
# `scancel --batch --signal=USR2 JOBID` -- it sends SIGTERM to the tasks of the job's steps
# (`scancel --signal=TERM JOBID`: torchrun forwards it to its workers; the train scripts save a
# checkpoint at the next step and exit 75), waits for them, then runs `scontrol requeue JOBID`.
# (SIGTERM rather than SIGUSR2 because every torchrun forwards SIGTERM to its workers, while only
# torch >= 2.9 can forward SIGUSR2. slurmstepd logs "*** STEP N.0 ON host CANCELLED ***" for it:
# that is only the signal, the tasks keep running until they have saved.)
# A step whose tasks stopped on their own after saving (someone signalled them) is requeued the
# same way. What arrives from such a step: srun's exit code is its tasks' (75) when they are the
# train scripts, but torchrun's (1) under sbatch_torchrun.sh, as torchrun exits 1 when it got the
# signal too, whatever its workers did; so each rank that saved and stopped also creates the file
# $PREEMPTED_MARKER, which this script exports, in the submit directory (where the job's log goes: normally a file
# system that every node sees, so a step without the batch script's node still leaves it there). The requeued job runs
# the same script again and `--resume auto` continues from last.pt.
# Needs `#SBATCH --requeue` (and `--open-mode=append` to keep one log). Slurm holds a requeued
# job for about two minutes before it can start again (Reason=BeginTime).
# Environment: MAX_REQUEUES (default 20) stops a job that keeps getting requeued.
# shellcheck shell=bash

PREEMPTED_EXIT_CODE=75

_on_usr2() {
  echo "[$(date '+%F %T')] SIGUSR2: asking the tasks of job $SLURM_JOB_ID to checkpoint and stop" >&2
  REQUEUE=1
  scancel --signal=TERM "$SLURM_JOB_ID" || true
}

run_requeueable() {
  REQUEUE=0
  echo "[$(date '+%F %T')] job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST:-?}: $*" >&2
  export PREEMPTED_MARKER="${SLURM_SUBMIT_DIR:-${TMPDIR:-/tmp}}/.preempted-$SLURM_JOB_ID"
  rm -f "$PREEMPTED_MARKER"
  trap _on_usr2 USR2
  "$@" &
  local pid=$! rc=0
  while kill -0 "$pid" 2>/dev/null; do
    wait "$pid" || true  # returns early when a trapped signal arrives; keep waiting for the step
  done
  wait "$pid" || rc=$?
  trap - USR2
  echo "[$(date '+%F %T')] step exited with code $rc" >&2
  if [ -e "$PREEMPTED_MARKER" ]; then
    rm -f "$PREEMPTED_MARKER"
    echo "[$(date '+%F %T')] the tasks saved a checkpoint and stopped on a signal" >&2
    REQUEUE=1
  fi
  if [ "$REQUEUE" = 1 ] || [ "$rc" = "$PREEMPTED_EXIT_CODE" ]; then
    if [ "${SLURM_RESTART_COUNT:-0}" -ge "${MAX_REQUEUES:-20}" ]; then
      echo "not requeueing: already restarted ${SLURM_RESTART_COUNT} times (MAX_REQUEUES)" >&2
      return "$rc"
    fi
    echo "[$(date '+%F %T')] requeueing job $SLURM_JOB_ID; it resumes from its last checkpoint" >&2
    scontrol requeue "$SLURM_JOB_ID"
    return 0
  fi
  return "$rc"
}
