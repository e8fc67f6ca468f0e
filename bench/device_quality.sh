#!/usr/bin/env bash
# The 1-GPU quality runs recorded in BENCHMARKS.md §6 (run from the repo root on a GPU machine; CIFAR JPEGs in
# .data/train.tar.xz, Multi30k in .data/multi30k). Logs and metrics land in $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor  # an empty cache: seed 0 is a cold start
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/c && tar -xJf .data/train.tar.xz -C /tmp/c
nvidia-smi -L
t() { local s=$SECONDS; "$@"; echo "[$(( SECONDS - s )) s wall] $*"; }
echo "== ResNet-50 --dummy fp32: bare loop and script in the same run"
t python3 bench/benchmark.py --only resnet50 --rn50-configs fp32 --iters 30 --script-steps 60 --out /tmp/rn 2>&1 | grep "^|"
echo "== CIFAR-10 ResNet-18, 80 epochs + TTA, seeds 0 1 2"
for s in 0 1 2; do
  t python3 cifar_resnet/train.py --data-dir /tmp/c --val-split 5000 --gpu-data --compile -b 512 --lr 0.4 -j 16 --tta \
    --epochs 80 --eval-every 10 --seed "$s" -p 1000 --output-dir "/tmp/c80_$s" 2>&1 | grep -E "^done|val|error"
  cp "/tmp/c80_$s/metrics.jsonl" "$OUT/cifar_e80_seed$s.jsonl"
done
echo "== imagenet/train.py learns from an ImageFolder: CIFAR JPEGs (5,000 held out) at 64 px, ResNet-18"
python3 - <<'PY'
import os, pathlib
src = sorted(pathlib.Path("/tmp/c/train").glob("*/*.jpg"))
for k, f in enumerate(src):
    d = pathlib.Path("/tmp/inet") / ("val" if k % 10 == 0 else "train") / f.parent.name
    d.mkdir(parents=True, exist_ok=True)
    os.symlink(f, d / f.name)
PY
t python3 imagenet/train.py /tmp/inet -a resnet18 --recipe modern --epochs 10 -b 256 --amp bf16 -j 16 \
  --train-crop-size 64 --val-resize-size 64 --val-crop-size 64 -p 1000 --output-dir /tmp/inet_run 2>&1 | grep -E "^done|val|error|Acc"
cp /tmp/inet_run/metrics.jsonl "$OUT/imagefolder_cifar64_resnet18.jsonl"
echo "== Multi30k en->de, small preset"
t python3 transformer/train.py --data .data/multi30k --lang-src en --lang-tgt de --preset small --max-tokens 8192 \
  --lr 1e-3 --warmup-steps 1000 --epochs 40 --eval-every 5 -p 1000 --samples 0 --output-dir /tmp/ende 2>&1 | grep -E "^done|val:|error"
cp /tmp/ende/metrics.jsonl "$OUT/multi30k_ende_small.jsonl"
