#!/usr/bin/env bash
# Reproduce the measurements in BENCHMARKS.md on N GPUs of one host. Run from the repository root:
#
#   bash bench/reproduce.sh WORKLOAD [--gpus N] [--out DIR]
#
#   rn50         ResNet-50 --dummy: bare step against the script (fp32), weak scaling eager and compiled
#   jpeg         ResNet-50 on ImageNet-sized JPEGs: --dummy and --gpu-decode (with and without CUDA graphs), Pillow,
#                the pytorch/examples setup; then jpeg-scaling
#   jpeg-scaling --gpu-decode (torchvision) and --dummy, CUDA graphs, on 1, 2, 4 ... GPUs, 20,480 JPEGs (2 GPUs: ~6 min)
#   cifar        CIFAR-10 recipes ($CIFAR_SEEDS seeds, default 3; one run per GPU, in rounds): fast and full ResNet-18,
#                full ResNet-50 on 1 GPU and on 2; then each data path for 20 epochs
#   cifar-paper  the paper's CIFAR ResNets (cifar_resnet/resnets.py): ResNet-20 and ResNet-56 with the fast recipe,
#                $CIFAR_SEEDS seeds, one run per GPU, in rounds
#   transformer  1 GPU: transformer base, the bare step against the script on Multi30k x 8 (--compile); the small
#                preset's script with --compile and with CUDA graphs, and its bare step
#   scaling      transformer base weak scaling on Multi30k x 8, --compile: 1, 2, ... GPUs side by side
#   fsdp         transformer base and 1b (or $FSDP_PRESETS), DDP against --fsdp, on N GPUs (Multi30k x 8, --compile)
#   fsdp-large   the same, eager, with the 1b preset deepened until DDP's 16 bytes a parameter exceed a GPU's memory
#   bleu         Multi30k de->en and en->de (small preset, --compile, 1 GPU)
#   nccl         all_reduce bus bandwidth (scripts.doctor)
#
# --gpus N (default: every visible GPU) runs the multi-GPU parts on 1, 2, 4, ... up to N GPUs. Data: the CIFAR-10
# JPEGs as $CIFAR_TAR (default .data/train.tar.xz), Multi30k as $MULTI30K (default .data/multi30k: train.de.gz,
# train.en.gz, val.de.gz, val.en.gz). Console output and every metrics.jsonl / results.json land in --out (default
# runs/reproduce), named like the logs in docs/runs; commit them there and `python bench/report.py` checks the docs.
set -euo pipefail

usage() {
  sed -n '2,25s/^# \{0,1\}//p' "$0" >&2
  exit 2
}
[ $# -ge 1 ] || usage
workload=$1
shift
case $workload in rn50 | jpeg | jpeg-scaling | cifar | cifar-paper | transformer | scaling | fsdp | fsdp-large | bleu | nccl) ;; *) usage ;; esac
gpus=$({ nvidia-smi -L 2>/dev/null || true; } | wc -l)
out=runs/reproduce
while [ $# -gt 0 ]; do
  case $1 in
  --gpus)
    gpus=${2:?--gpus needs a number}
    shift 2
    ;;
  --out)
    out=${2:?--out needs a directory}
    shift 2
    ;;
  *) usage ;;
  esac
done
[[ $gpus =~ ^[1-9][0-9]*$ ]] || {
  echo "error: --gpus needs a GPU count of 1 or more, and none was found (pass --gpus N on a GPU host)" >&2
  exit 2
}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
CIFAR_TAR=${CIFAR_TAR:-.data/train.tar.xz}
MULTI30K=${MULTI30K:-.data/multi30k}
mkdir -p "$out"
hw=$({ nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo "- gpu"; } | head -1 | awk '{print tolower($2)}')
counts=() # 1 2 4 ... N
for ((n = 1; n < gpus; n *= 2)); do counts+=("$n"); done
counts+=("$gpus")

launch() { # launch N SCRIPT ARGS...: plain python on one GPU, torchrun on several
  local n=$1
  shift
  if [ "$n" -eq 1 ]; then python3 "$@"; else torchrun --standalone --nproc_per_node="$n" "$@"; fi
}
keep() { # keep RUN_DIR NAME: the run's metrics as $out/NAME<gpu>.jsonl (NAME ends in the GPU count, "4x")
  cp "$1/metrics.jsonl" "$out/$2$hw.jsonl"
}
cifar_data() { # the 50,000 CIFAR-10 training JPEGs in /tmp/c/train/<class>/
  [ -d /tmp/c/train ] || { mkdir -p /tmp/c && tar -xJf "$CIFAR_TAR" -C /tmp/c; }
}
C=(cifar_resnet/train.py --data-dir /tmp/c --val-split 5000 --gpu-data --compile -b 512 -j 16 --tta -p 1000)
G=(--compile-mode reduce-overhead)           # CUDA graphs
FAST=(--lr 0.4 --epochs 80 --eval-every 10) # the fast recipe
slot=0
on_gpu() { # on_gpu NAME ARGS...: one single-GPU CIFAR run, on the next free GPU once all are busy
  local g=$((slot++ % gpus))
  [ "$g" -gt 0 ] || wait
  (CUDA_VISIBLE_DEVICES=$g python3 "${C[@]}" "${G[@]}" "${@:2}" --output-dir "/tmp/$1" 2>&1 | tee "$out/$1$hw.log" &&
    keep "/tmp/$1" "$1") &
}
m8_data() { # Multi30k x 8 in /tmp/m8 (232,000 pairs), so that an epoch holds enough steps to time
  [ -f /tmp/m8/train.en ] && return
  mkdir -p /tmp/m8
  for l in de en; do
    for _ in 1 2 3 4 5 6 7 8; do zcat "$MULTI30K/train.$l.gz"; done >"/tmp/m8/train.$l"
    cp "$MULTI30K/val.$l.gz" /tmp/m8/
  done
}

jpeg_scaling() { # --gpu-decode (torchvision) and --dummy on 1, 2, 4 ... GPUs, CUDA graphs: the same 20,480 JPEGs
  [ -d /tmp/jpeg_scaling/train ] || python3 -c 'import os, sys; sys.path.insert(0, "bench"); from pathlib import Path
from benchmark import make_jpeg_folder; make_jpeg_folder(Path("/tmp/jpeg_scaling"), 20480, 512, workers=min(32, os.cpu_count()))'
  J=(imagenet/train.py -a resnet50 -b 256 -p 10 --resume none --overwrite -j 8 --amp bf16 --channels-last --compile
    --compile-mode reduce-overhead)
  for n in "${counts[@]}"; do # n + 1 epochs: 160 steps on 1 GPU, 120 per GPU on 2, epoch starts included
    CUDA_DEVICE_MAX_CONNECTIONS=32 launch "$n" "${J[@]}" --epochs $((n + 1)) /tmp/jpeg_scaling --gpu-decode \
      --output-dir "/tmp/jpeg_tv$n" 2>&1 |
      tee "$out/jpeg_gpu_decode_${n}x$hw.log" && keep "/tmp/jpeg_tv$n" "jpeg_gpu_decode_${n}x"
    launch "$n" "${J[@]}" --epochs $((n + 1)) --dummy --dummy-sizes 20480 512 --output-dir "/tmp/jpeg_dm$n" 2>&1 |
      tee "$out/jpeg_dummy_${n}x$hw.log" && keep "/tmp/jpeg_dm$n" "jpeg_dummy_${n}x"
  done
}

case $workload in
rn50)
  python3 bench/benchmark.py --only resnet50 --rn50-configs fp32 --iters 30 --script-steps 60 --out "$out/rn50_fp32"
  R=(imagenet/train.py --dummy -a resnet50 -b 256 --max-steps 60 -p 10 --resume none --overwrite --amp bf16 --channels-last)
  for n in "${counts[@]}"; do
    launch "$n" "${R[@]}" --output-dir "/tmp/rn50_e$n" && keep "/tmp/rn50_e$n" "rn50_bf16_cl_eager_${n}x"
    launch "$n" "${R[@]}" --compile --output-dir "/tmp/rn50_c$n" && keep "/tmp/rn50_c$n" "rn50_bf16_cl_compile_${n}x"
  done
  ;;
jpeg)
  python3 bench/benchmark.py --only jpeg --out "$out/jpeg"
  jpeg_scaling
  ;;
jpeg-scaling)
  jpeg_scaling
  ;;
cifar)
  cifar_data
  R18=(--lr 0.4 --epochs 200 --random-erasing 0.5 --ema 0.999 --eval-every 20)     # full ResNet-18
  R50=(-a resnet50 --lr 0.4 --epochs 200 --random-erasing 0.5 --ema 0.999 --eval-every 10) # full ResNet-50
  seeds=${CIFAR_SEEDS:-3}
  # The first run decodes the JPEGs into the cache next to them (in its wall time); the others read the cache.
  rm -f /tmp/c/.decoded-*.npz
  python3 "${C[@]}" "${G[@]}" "${FAST[@]}" --seed 0 --output-dir /tmp/cfast_0 && keep /tmp/cfast_0 cifar_r18_fast_seed0_1x
  for ((s = 1; s < seeds; s++)); do on_gpu "cifar_r18_fast_seed${s}_1x" "${FAST[@]}" --seed "$s"; done
  for ((s = 0; s < seeds; s++)); do
    on_gpu "cifar_r18_full_seed${s}_1x" "${R18[@]}" --seed "$s"
    on_gpu "cifar_r50_full_seed${s}_1x" "${R50[@]}" --seed "$s"
  done
  wait
  if [ "$gpus" -ge 2 ]; then # ResNet-50 on 2 GPUs, the global batch unchanged
    for ((s = 0; s < seeds; s++)); do
      launch 2 "${C[@]}" "${G[@]}" "${R50[@]}" -b 256 --seed "$s" --output-dir "/tmp/cr50_2_$s" &&
        keep "/tmp/cr50_2_$s" "cifar_r50_full_seed${s}_2x"
    done
  fi
  python3 "${C[@]}" --lr 0.4 --epochs 20 --eval-every 5 --seed 0 --output-dir /tmp/c20_gpu &&
    keep /tmp/c20_gpu cifar_r18_e20_gpudata_1x
  python3 "${C[@]:0:5}" "${C[@]:6}" --lr 0.4 --epochs 20 --eval-every 5 --seed 0 --output-dir /tmp/c20_loader &&
    keep /tmp/c20_loader cifar_r18_e20_dataloader_1x
  ;;
cifar-paper)
  cifar_data
  seeds=${CIFAR_SEEDS:-3}
  rm -f /tmp/c/.decoded-*.npz # the first run decodes the JPEGs into the cache alone (in its wall time), then the rest
  on_gpu cifar_r20_fast_seed0_1x -a resnet20 "${FAST[@]}" --seed 0
  wait
  slot=0
  for ((s = 1; s < seeds; s++)); do on_gpu "cifar_r20_fast_seed${s}_1x" -a resnet20 "${FAST[@]}" --seed "$s"; done
  for ((s = 0; s < seeds; s++)); do on_gpu "cifar_r56_fast_seed${s}_1x" -a resnet56 "${FAST[@]}" --seed "$s"; done
  wait
  ;;
transformer)
  m8_data
  python3 bench/benchmark.py --only transformer --multi30k /tmp/m8 --tr-nprocs 1 --tr-steps 70 \
    --tr-configs base:65536:compile:bare:lossc:packed,base:65536:compile --out "$out/tr_base_m8_1x"
  python3 bench/benchmark.py --only transformer --multi30k "$MULTI30K" --tr-nprocs 1 --tr-steps 150 \
    --tr-configs small:8192:compile,small:8192:compile:cudagraphs,small:8192:compile:bare:lossc:packed:cudagraphs \
    --out "$out/tr_small_1x"
  ;;
scaling) # the runs side by side, each on its own GPUs (1 + 2 + ... of them; one after the other if too few)
  m8_data
  M8=(transformer/train.py --data /tmp/m8 --lang-src de --lang-tgt en --preset base --max-tokens 65536 --max-steps 70
    -p 10 --eval-every 0 -j 4 --vocab-size 8000 --resume none --overwrite --compile)
  total=0 # GPUs for all the runs at once
  for n in "${counts[@]}"; do total=$((total + n)); done
  visible=$({ nvidia-smi -L 2>/dev/null || true; } | wc -l)
  first=0
  for n in "${counts[@]}"; do
    (CUDA_VISIBLE_DEVICES=$(seq -s, $first $((first + n - 1))) launch "$n" "${M8[@]}" --output-dir "/tmp/m8c_$n" \
      >"$out/console_tr_base_m8_compile_${n}x$hw.log" 2>&1 &&
      keep "/tmp/m8c_$n" "tr_base_m8_compile_${n}x") &
    if [ "$total" -le "$visible" ]; then first=$((first + n)); else wait; fi
  done
  wait
  tail -n 3 "$out"/console_tr_base_m8_compile_*.log
  ;;
fsdp | fsdp-large)
  [ "$gpus" -gt 1 ] || { echo "error: $workload needs --gpus 2 or more" >&2; exit 2; }
  m8_data
  F=(transformer/train.py --data /tmp/m8 --lang-src de --lang-tgt en -p 5 --eval-every 0 -j 4 --vocab-size 8000
    --resume none --overwrite)
  runs=() # PRESET ARGS:MODES, the modes ddp, fsdp (--fsdp: a unit a layer), fsdpmodel (--fsdp model: one unit)
  for p in ${FSDP_PRESETS:-base 1b}; do # FSDP_PRESETS: a subset of "base 1b"
    case $p in
    base) runs+=("base --max-tokens 65536 --max-steps 60 --compile:ddp fsdp fsdpmodel") ;;
    1b) runs+=("1b --max-tokens 16384 --max-steps 40 --compile:ddp fsdp fsdpmodel") ;;
    *) usage ;;
    esac
  done
  if [ "$workload" = fsdp-large ]; then # 117.4M parameters a 1b layer pair: as many pairs as make DDP's 16 bytes
    # each exceed one GPU's memory; eager (compiling unrolls every layer); FSDP first, as DDP runs out of memory
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    runs=("1b --layers $((mib * 1048576 / (16 * 117400000) + 2)) --max-tokens 2048 --max-steps 10 -p 2:fsdp ddp")
  fi
  for r in "${runs[@]}"; do
    read -ra a <<<"${r%%:*}"
    read -ra modes <<<"${r#*:}"
    for mode in "${modes[@]}"; do
      name="tr_${a[0]}"
      [ "${a[1]}" = --layers ] && name+="_l${a[2]}"
      name+="_m8_${mode}_${gpus}x"
      case $mode in ddp) flag=() ;; fsdp) flag=(--fsdp) ;; fsdpmodel) flag=(--fsdp model) ;; esac
      OMP_NUM_THREADS=8 launch "$gpus" "${F[@]}" --preset "${a[@]}" "${flag[@]}" --output-dir "/tmp/$name" \
        >"$out/console_$name$hw.log" 2>&1 && keep "/tmp/$name" "$name" || echo "$name: exit $?"
      tail -n 2 "$out/console_$name$hw.log"
      rm -rf "/tmp/$name"
    done
  done
  ;;
bleu)
  B=(transformer/train.py --data "$MULTI30K" --preset small --max-tokens 8192 --lr 1e-3 --warmup-epochs 17.62
    --eval-every 5 -p 100 --samples 0 --compile)
  python3 "${B[@]}" --lang-src de --lang-tgt en --epochs 60 --output-dir /tmp/deen && keep /tmp/deen tr_small_deen_bleu_1x
  python3 "${B[@]}" --lang-src en --lang-tgt de --epochs 40 --output-dir /tmp/ende && keep /tmp/ende tr_small_ende_bleu_1x
  ;;
nccl)
  for n in "${counts[@]}"; do
    if [ "$n" -gt 1 ]; then torchrun --standalone --nproc_per_node="$n" -m scripts.doctor --size-mb 256 --iters 20; fi
  done
  ;;
esac 2>&1 | tee -a "$out/console_$workload.log"
