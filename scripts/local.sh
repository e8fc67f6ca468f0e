#!/usr/bin/env bash
# One process, no launcher: the plain `python train.py` run (GPU 0 or CPU).
#
# Usage: scripts/local.sh [-h] TRAIN_SCRIPT [TRAIN_ARGS...]
#        scripts/local.sh -m MODULE [ARGS...]
#
#   scripts/local.sh cifar_resnet/train.py --synthetic --epochs 1
#   CUDA_VISIBLE_DEVICES=1 scripts/local.sh imagenet/train.py /data/imagenet
#
# Environment: PYTHON (default: python).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

case "${1:-}" in
  -h|--help) usage; exit 0 ;;
esac
check_train_script "${1:-}"
run_exec "${PYTHON:-python}" "$@"
