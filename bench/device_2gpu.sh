#!/usr/bin/env bash
# The 2-GPU checks recorded in BENCHMARKS.md (run from the repo root on a machine with 2 GPUs).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHON=python3
OUT=${OUT:-/tmp/out}
med() { python3 -c "import json,sys,statistics as s; r=[json.loads(l) for l in open(sys.argv[1]) if '\"train\"' in l]; print('median img/s', round(s.median(x['img_per_s'] for x in r[2:])))" "$1"; }
nvidia-smi -L
echo "== doctor"; torchrun --standalone --nproc_per_node=2 -m common.doctor --size-mb 256 --iters 20 2>&1 | tail -4
echo "== two torchrun agents, one GPU each"
for n in 0 1; do CUDA_VISIBLE_DEVICES=$n scripts/torchrun_multinode.sh --nnodes 2 --nproc-per-node 1 --master 127.0.0.1:29700 --rdzv-id twonode cifar_resnet/train.py --synthetic --gpu-data -b 256 --epochs 2 -p 10 --output-dir /tmp/mn > /tmp/mn$n.log 2>&1 & done; wait
grep -h "process(es)\|done" /tmp/mn0.log /tmp/mn1.log; python3 -c "import json;c=json.load(open('/tmp/mn/config.json'));print('world', c['world_size'], c['launcher'], c['backend'])"
I=(imagenet/train.py --dummy -a resnet50 -b 256 --max-steps 60 -p 10 --resume none)
rn50() {  # rn50 TAG AMP-FLAGS...: 1 GPU, then 2 GPUs
  local tag=$1; shift
  echo "== resnet50 --dummy 1 GPU $tag"; CUDA_VISIBLE_DEVICES=0 python3 "${I[@]}" "$@" --output-dir "/tmp/i1$tag" > "/tmp/i1$tag.log" 2>&1; med "/tmp/i1$tag/metrics.jsonl"
  echo "== resnet50 --dummy 2 GPUs $tag"; torchrun --standalone --nproc_per_node=2 "${I[@]}" "$@" --output-dir "/tmp/i2$tag" > "/tmp/i2$tag.log" 2>&1; med "/tmp/i2$tag/metrics.jsonl"
  cp "/tmp/i1$tag/metrics.jsonl" "$OUT/i1$tag.jsonl"; cp "/tmp/i2$tag/metrics.jsonl" "$OUT/i2$tag.jsonl"
}
rn50 bf16cl --amp bf16 --channels-last
echo "== kill and restart (NCCL)"; python3 bench/kill_restart.py --nproc 2 --out /tmp/kr 2>&1 | tail -14
rn50 fp32 --amp none --no-channels-last
echo "== transformer"; python3 bench/benchmark.py --only transformer --multi30k .data/multi30k --out "$OUT/tr" 2>&1 | tail -6
