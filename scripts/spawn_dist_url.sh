#!/usr/bin/env bash
# The pytorch/examples style: no launcher, every process gets --dist-url tcp://HOST:PORT --world-size --rank.
#
# Usage: scripts/spawn_dist_url.sh [options] TRAIN_SCRIPT [TRAIN_ARGS...]
#
#   --nproc N             processes on this node (env NPROC_PER_NODE; default: the visible GPUs, or 1)
#   --nnodes N            nodes (env NNODES, default 1)
#   --node-rank R         this node's rank, 0 on the master (env NODE_RANK, default 0)
#   --dist-url URL        tcp://NODE0_ADDR:PORT, the same on every node (env DIST_URL). Default on one
#                         node: tcp://127.0.0.1:<a free port>. Required with several nodes.
#   --multiprocessing-distributed
#                         start ONE python per node and let the script spawn its processes, exactly as
#                         pytorch/examples' main.py: it gets --world-size NODES --rank NODE_RANK
#                         (imagenet/train.py supports this; cifar_resnet and transformer do not).
#
# Default mode: this script starts the N processes of the node itself, process i with
#   --dist-url URL --world-size NNODES*N --rank NODE_RANK*N+i --local-rank i
# appended to TRAIN_ARGS. It forwards SIGINT/SIGTERM/SIGUSR2 to them, stops the others when one
# fails, and exits with the first failure's code (75: stopped after a checkpoint, rerun to resume).
#
#   scripts/spawn_dist_url.sh --nproc 2 cifar_resnet/train.py --synthetic --epochs 1
#   node0$ scripts/spawn_dist_url.sh --nnodes 2 --node-rank 0 --dist-url tcp://node0:23456 \
#              --multiprocessing-distributed imagenet/train.py /data/imagenet
#   node1$ (the same with --node-rank 1)
# Environment: PYTHON (default: python) and the variables above.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PYTHON=${PYTHON:-python}
NPROC=$(default_nproc)
NPROC_SET=${NPROC_PER_NODE:+1}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
DIST_URL=${DIST_URL:-}
MPD=0
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc|--nproc-per-node) need_value "$1" "$#"; NPROC=$2; NPROC_SET=1; shift 2 ;;
    --nnodes) need_value "$1" "$#"; NNODES=$2; shift 2 ;;
    --node-rank) need_value "$1" "$#"; NODE_RANK=$2; shift 2 ;;
    --dist-url) need_value "$1" "$#"; DIST_URL=$2; shift 2 ;;
    --multiprocessing-distributed) MPD=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) break ;;
  esac
done
need_int --nproc "$NPROC"
need_int --nnodes "$NNODES"
if ! [[ "$NODE_RANK" =~ ^[0-9]+$ ]] || [ "$NODE_RANK" -ge "$NNODES" ]; then
  usage_error "--node-rank must be in 0..$((NNODES - 1)), got '$NODE_RANK'"
fi
check_train_script "${1:-}"
if [ -z "$DIST_URL" ]; then
  [ "$NNODES" -eq 1 ] || usage_error "--dist-url tcp://NODE0_ADDR:PORT is required with several nodes"
  DIST_URL=tcp://127.0.0.1:$(free_port)
fi
[[ "$DIST_URL" =~ ^tcp://[^:/]+:([0-9]+)$ ]] || usage_error "--dist-url must look like tcp://HOST:PORT, got '$DIST_URL'"
PORT=${BASH_REMATCH[1]}
if [ "$NODE_RANK" -eq 0 ]; then  # rank 0 listens on the port
  check_port_free "$PORT" "pick another port in --dist-url on every node"
fi

if [ "$MPD" -eq 1 ]; then
  EXTRA=()
  if [ -n "$NPROC_SET" ]; then EXTRA=(--nproc-per-node "$NPROC"); fi
  run_exec "$PYTHON" "$@" --dist-url "$DIST_URL" --world-size "$NNODES" --rank "$NODE_RANK" \
    --multiprocessing-distributed "${EXTRA[@]}"
fi

WORLD=$((NNODES * NPROC))
PIDS=()
for ((i = 0; i < NPROC; i++)); do
  RANK=$((NODE_RANK * NPROC + i))
  [ "$i" -gt 0 ] || echo "+ $PYTHON $* --dist-url $DIST_URL --world-size $WORLD --rank {$RANK..$((RANK + NPROC - 1))} --local-rank {0..$((NPROC - 1))}" >&2
  "$PYTHON" "$@" --dist-url "$DIST_URL" --world-size "$WORLD" --rank "$RANK" --local-rank "$i" &
  PIDS+=("$!")
done
forward() { kill "-$1" "${PIDS[@]}" 2>/dev/null || true; }
trap 'forward INT' INT
trap 'forward TERM' TERM
trap 'forward USR2' USR2

RC=0
while [ "${#PIDS[@]}" -gt 0 ]; do
  LEFT=()
  for pid in "${PIDS[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then LEFT+=("$pid"); continue; fi
    CODE=0
    wait "$pid" || CODE=$?
    if [ "$CODE" -ne 0 ] && [ "$RC" -eq 0 ]; then
      RC=$CODE
      if [ "$CODE" -ne 75 ]; then  # 75: stopped on a signal after a checkpoint; the others are stopping too
        echo "spawn_dist_url.sh: a process exited with code $CODE; stopping the others" >&2
        forward TERM
      fi
    fi
  done
  PIDS=("${LEFT[@]+"${LEFT[@]}"}")
  [ "${#PIDS[@]}" -eq 0 ] || sleep 0.5
done
exit "$RC"
