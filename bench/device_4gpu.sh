#!/usr/bin/env bash
# The 4-GPU sessions recorded in BENCHMARKS.md §7 (phases 1-3) and §8 (phases 4-5). Run from the repo root on one
# host with 4 GPUs and 64 cores, with the CIFAR JPEGs in .data/train.tar.xz and Multi30k in .data/multi30k. Logs
# land in $OUT, every metrics.jsonl and results.json in $OUT/runs.tgz (re-packed after each run, so a run cut short
# still returns what finished).
#   bash bench/device_4gpu.sh phase1   # quality queues side by side, one per GPU (pinned CPU sets); ~8 min
#   bash bench/device_4gpu.sh phase2   # timed, one at a time: ResNet-50 1/2/4 GPUs and 2 agents x 2; CIFAR on 4
#   bash bench/device_4gpu.sh phase3   # timed: transformer base 1/2/4 GPUs (TR_NPROCS="1 2" for a subset)
#   bash bench/device_4gpu.sh phase4   # fourth session: cuDNN attention or not (bare + script), CIFAR DataLoader
#   bash bench/device_4gpu.sh phase5   # fourth session: eager weak scaling on Multi30k x 8, cuDNN attention or not
#   bash bench/device_4gpu.sh phase6   # fifth session: profile of the epoch boundary, eager on 4, 1 and 2 GPUs
#   bash bench/device_4gpu.sh phase7   # fifth session, after the fixes: boundary, eager and compiled scaling
#   bash bench/device_4gpu.sh phase8   # fifth session: compiled scaling traced, and with balanced steps
#   bash bench/device_4gpu.sh phase9   # fifth session: the BLEU recipe on 2 GPUs with and without balanced steps
# shellcheck disable=SC2030,SC2031  # each queue sets its own CUDA_VISIBLE_DEVICES in its subshell, on purpose
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
t() { local s=$SECONDS; "$@"; echo "[$((SECONDS - s)) s wall] $*"; }
med() { # med METRICS.jsonl KEY: median of the train records after the first two
  python3 -c "import json,sys,statistics as s; r=[json.loads(l) for l in open(sys.argv[1]) if '\"train\"' in l]
print(sys.argv[1], sys.argv[2], round(s.median(x[sys.argv[2]] for x in r[2:])))" "$1" "$2"
}
CIFAR=(cifar_resnet/train.py --data-dir /tmp/c --val-split 5000 --compile --lr 0.4 -j 16 --tta --epochs 80
  --eval-every 10 -p 1000)
cifar() { # cifar NAME NPROC PER-GPU-BATCH SEED [FLAGS...]: the 80-epoch recipe; metrics copied to $OUT
  local name=$1 n=$2 b=$3 seed=$4
  shift 4
  local launch=(python3)
  [ "$n" -gt 1 ] && launch=(torchrun --standalone --nproc_per_node="$n")
  t "${launch[@]}" "${CIFAR[@]}" -b "$b" --seed "$seed" --output-dir "/tmp/$name" "$@" >"/tmp/$name.log" 2>&1
  grep -E "^done|rror|\[.* s wall\]" "/tmp/$name.log" | tail -3
  keep "/tmp/$name/metrics.jsonl" "$name.jsonl"
}
# shellcheck disable=SC2016  # $1 expands in the inner shell
keep() { # keep FILE NAME: into the returned archive (under a lock: queues side by side keep files too)
  mkdir -p /tmp/keep && cp "$1" "/tmp/keep/$2" &&
    flock /tmp/keep.lock sh -c 'tar -czf "$1.tmp" -C /tmp/keep . && mv "$1.tmp" "$1"' _ "$OUT/runs.tgz"
}
pin() { taskset -cp "$1" "$BASHPID" >/dev/null; } # this queue and its children on these cores
cifar_data() { # the CIFAR JPEGs in /tmp/c (once per machine); /tmp/c.done marks a finished extraction
  [ -f /tmp/c.done ] || { mkdir -p /tmp/c && tar -xJf .data/train.tar.xz -C /tmp/c && touch /tmp/c.done; }
}
wait_cifar() { until [ -f /tmp/c.done ]; do sleep 2; done; }
tr_bench() { # tr_bench NAME NPROCS CONFIGS: one benchmark call (its own same-run baseline loop), kept as NAME.json
  t python3 bench/benchmark.py --only transformer --multi30k .data/multi30k --tr-configs "$3" --tr-nprocs "$2" \
    --tr-steps 40 --out "/tmp/$1" >"/tmp/$1.log" 2>&1
  grep -E "^\||FAILED|wall|ms$" "/tmp/$1.log"
  keep "/tmp/$1/results.json" "$1.json"
  for f in /tmp/"$1"/profile_*.txt; do [ -f "$f" ] && keep "$f" "$1_$(basename "$f")"; done
}
m8_data() { # Multi30k x 8 in /tmp/m8 (232,000 pairs): enough steps per epoch to time steps between boundaries
  mkdir -p /tmp/m8
  for l in de en; do
    for _ in 1 2 3 4 5 6 7 8; do zcat ".data/multi30k/train.$l.gz"; done >"/tmp/m8/train.$l"
    cp ".data/multi30k/val.$l.gz" /tmp/m8/
  done
}
M8=(--data /tmp/m8 --lang-src de --lang-tgt en --preset base --max-tokens 65536 --max-steps 70 -p 10 --eval-every 0
  -j 4 --vocab-size 8000 --resume none)
m8() { # m8 NPROC NAME [FLAGS...]: transformer/train.py on Multi30k x 8, per-window tok/s printed, metrics kept
  local n=$1 name=$2
  shift 2
  t timeout "${M8_TIMEOUT:-300}" torchrun --standalone --nproc_per_node="$n" transformer/train.py "${M8[@]}" \
    --output-dir "/tmp/$name" "$@" >"/tmp/$name.log" 2>&1
  grep -o '"step": [0-9]*\|"tok_per_s": [0-9]*\|"time": [0-9.]*' "/tmp/$name/metrics.jsonl" | paste -sd' '
  keep "/tmp/$name/metrics.jsonl" "$name.jsonl"
}
tb() { # tb NPROC NAME [WRAPPER FLAGS...] [-- TRAIN FLAGS...]: bench/trace_boundary.py on Multi30k x 8; $OUT/NAME.tgz
  local n=$1 name=$2 wrap=()
  shift 2
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    wrap+=("$1")
    shift
  done
  [ $# -gt 0 ] && shift
  t timeout "${M8_TIMEOUT:-300}" torchrun --standalone --nproc_per_node="$n" bench/trace_boundary.py \
    --out "/tmp/$name" "${wrap[@]}" -- "${M8[@]}" --output-dir "/tmp/${name}_run" "$@" >"/tmp/$name.log" 2>&1
  grep -E "rror|^done" "/tmp/$name.log" | tail -3
  grep -o '"step": [0-9]*\|"tok_per_s": [0-9]*' "/tmp/${name}_run/metrics.jsonl" | paste -sd' '
  python3 bench/trace_boundary.py --out "/tmp/$name" --summarize
  cp "/tmp/${name}_run/metrics.jsonl" "/tmp/$name.log" "/tmp/$name/"
  tar -czf "$OUT/$name.tgz" -C /tmp "$name"
}
nvidia-smi -L

case ${1:-} in
phase1)
  cifar_data
  nvidia-smi dmon -s pc -d 5 >"$OUT/dmon_phase1.txt" 2>&1 &
  dmon=$!
  ( # GPU 0, cores 0-16: the 1-GPU CIFAR recipe from a cold compile cache, then real JPEGs (Pillow vs GPU decode)
    pin 0-16
    export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_CACHE_DIR=/tmp/ind0
    cifar c1_seed0_cold 1 512 0 --gpu-data
    python3 bench/benchmark.py --only jpeg --cifar-dir /tmp/c --out /tmp/jpeg >/tmp/jpeg.log 2>&1
    grep -E "^\||\[jpeg\]|FAILED" /tmp/jpeg.log
    keep /tmp/jpeg/results.json jpeg_results.json
    cifar c1_seed0_warm 1 512 0 --gpu-data
  ) >"$OUT/q0.log" 2>&1 &
  q0=$!
  ( # GPU 1, cores 17-31: the documented BLEU recipe (new length order), then the transformer bare-step profile
    pin 17-31
    export CUDA_VISIBLE_DEVICES=1
    t python3 transformer/train.py --data .data/multi30k --lang-src de --lang-tgt en --preset small \
      --max-tokens 8192 --lr 1e-3 --warmup-steps 1000 --epochs 60 --eval-every 5 -p 100 --samples 0 \
      --output-dir /tmp/deen >/tmp/deen.log 2>&1
    grep -E "^done|val:|rror" /tmp/deen.log
    keep /tmp/deen/metrics.jsonl multi30k_deen_small.jsonl
    python3 bench/benchmark.py --only transformer --tr-nprocs 1 --out /tmp/prof \
      --tr-configs base:65536:compile:bare:profile,base:65536:bare:lossc:profile,base:65536:compile:bare:nodrop \
      >/tmp/prof.log 2>&1
    grep -E "^\||wall|ms$|FAILED" /tmp/prof.log
    keep /tmp/prof/results.json profile_results.json
    cat /tmp/prof/profile_*.txt >"$OUT/profiles.txt"
  ) >"$OUT/q1.log" 2>&1 &
  q1=$!
  ( # GPUs 2-3, cores 32-63: the recipe on 2 GPUs (same global batch 512), 3 seeds; then GPU data vs DataLoader
    pin 32-63
    export CUDA_VISIBLE_DEVICES=2,3
    for s in 0 1 2; do cifar "c2_seed$s" 2 256 "$s" --gpu-data; done
    export CUDA_VISIBLE_DEVICES=2 # time to accuracy: a 20-epoch recipe through each data path
    cifar c1_e20_gpudata 1 512 0 --gpu-data --epochs 20 --eval-every 5
    cifar c1_e20_loader 1 512 0 --epochs 20 --eval-every 5
  ) >"$OUT/q2.log" 2>&1 &
  q2=$!
  wait "$q0" "$q1" "$q2"
  kill "$dmon"
  ;;
phase2)
  cifar_data
  R=(imagenet/train.py --dummy -a resnet50 -b 256 --max-steps 60 -p 10 --resume none --amp bf16 --channels-last)
  for n in 1 2 4; do
    t torchrun --standalone --nproc_per_node=$n "${R[@]}" --output-dir /tmp/r$n >/tmp/r$n.log 2>&1
    med /tmp/r$n/metrics.jsonl img_per_s
    keep /tmp/r$n/metrics.jsonl "rn50_bf16cl_${n}gpu.jsonl"
  done
  echo "== two torchrun agents x 2 GPUs"
  for k in 0 1; do
    CUDA_VISIBLE_DEVICES=$((2 * k)),$((2 * k + 1)) scripts/torchrun_multinode.sh --nnodes 2 --nproc-per-node 2 \
      --master 127.0.0.1:29700 --rdzv-id two2 "${R[@]}" --output-dir /tmp/r22 >"/tmp/r22_$k.log" 2>&1 &
  done
  wait
  med /tmp/r22/metrics.jsonl img_per_s
  python3 -c "import json;c=json.load(open('/tmp/r22/config.json'));print('world', c['world_size'], c['launcher'])"
  keep /tmp/r22/metrics.jsonl rn50_bf16cl_2x2agents.jsonl
  for n in 1 4; do
    t torchrun --standalone --nproc_per_node=$n "${R[@]}" --compile --output-dir /tmp/rc$n >/tmp/rc$n.log 2>&1
    med /tmp/rc$n/metrics.jsonl img_per_s
    keep /tmp/rc$n/metrics.jsonl "rn50_compile_${n}gpu.jsonl"
  done
  echo "== CIFAR recipe on 4 GPUs (128 per GPU: global batch 512)"
  for s in ${CIFAR4_SEEDS:-0 1 2}; do cifar "c4_seed$s" 4 128 "$s" --gpu-data; done
  ;;
phase3) # one GPU count per call of the benchmark (each with its own same-run baseline loop): a compiled base
  # run takes about 3 min, and all three in one benchmark call ran past a 500 s limit with nothing kept
  for n in ${TR_NPROCS:-1 2 4}; do
    t python3 bench/benchmark.py --only transformer --multi30k .data/multi30k --tr-configs base:65536:compile \
      --tr-nprocs "$n" --tr-steps 40 --out "/tmp/tr3_$n" >"/tmp/tr3_$n.log" 2>&1
    grep -E "^\||FAILED" "/tmp/tr3_$n.log"
    keep "/tmp/tr3_$n/results.json" "transformer_${n}gpu.json"
  done
  ;;
phase4) # fourth session (BENCHMARKS.md §8), one call: queues side by side, one GPU and 16 pinned cores each.
  # What ran was phase5 of commit c25cf24 (git show c25cf24:bench/device_4gpu.sh), in its --attention flag:
  # its default (auto) is :cudnn here, its "flash" is today's default; its "math" rows (which still ran cuDNN
  # kernels under compile) are left out.
  cifar_data &
  ( # GPU 0: the bare base step with and without cuDNN attention, and without dropout
    pin 0-15
    export CUDA_VISIBLE_DEVICES=0
    tr_bench attn 1 base:65536:bare:lossc:cudnn,base:65536:bare:lossc:profile,base:65536:bare:lossc:nodrop
  ) >"$OUT/q0.log" 2>&1 &
  q0=$!
  ( # GPU 1: the compiled script on 1 GPU with cuDNN attention (PyTorch's pick); then CIFAR through the DataLoader
    pin 16-31
    export CUDA_VISIBLE_DEVICES=1
    tr_bench tr_cudnn_1 1 base:65536:compile:cudnn
    wait_cifar
    cifar c1_e20_loader 1 512 0 --epochs 20 --eval-every 5
  ) >"$OUT/q1.log" 2>&1 &
  q1=$!
  ( # GPU 2: the same without cuDNN attention (the default); then the GPU-resident twin of q1's CIFAR run
    pin 32-47
    export CUDA_VISIBLE_DEVICES=2
    tr_bench tr_default_1 1 base:65536:compile
    wait_cifar
    cifar c1_e20_gpudata 1 512 0 --gpu-data --epochs 20 --eval-every 5
  ) >"$OUT/q2.log" 2>&1 &
  q2=$!
  wait "$q0" "$q1" "$q2"
  ;;
phase5) # fourth session: eager weak scaling on Multi30k x 8 (232,000 pairs: 60 steps per epoch on 1 GPU, so
  # few epoch boundaries), with and without cuDNN attention; per-window tok/s printed, metrics kept
  m8_data
  m8 1 m8_cudnn_1 --cudnn-attention
  m8 4 m8_cudnn_4 --cudnn-attention
  for n in 1 2 4; do m8 "$n" "m8_default_$n"; done
  ;;
phase6) # fifth session: where an epoch boundary's time goes (bench/trace_boundary.py: step times and a profile
  # across the first boundary on every rank), eager on 4, 1 and 2 GPUs; 4 GPUs also with no checkpoint. It ran at
  # commit 219aece, before the fix: the sampler then planned each epoch in set_epoch (a named range of its own)
  m8_data
  for run in ${TB_RUNS:-4:tb4 4:tb4_nockpt:--no-checkpoint 1:tb1 2:tb2}; do
    IFS=: read -r n name flags <<<"$run"
    # shellcheck disable=SC2086  # flags: empty or one word
    tb "$n" "$name" $flags
  done
  ;;
phase7) # fifth session, after the fixes (one DataLoader iterator per run; each layer compiled on its own): the
  # boundary trace again; weak scaling eager and compiled on 1/2/4 GPUs (the compiled runs share one compile
  # cache, so only the first compiles from scratch); then the benchmark's compiled 1-GPU script row with its
  # baseline loop and the bare step compiled whole and per layer, in what is left of the call
  m8_data
  tb 4 tb4_after
  for n in 1 2 4; do m8 "$n" "m8e_$n"; done
  for n in 1 2 4; do m8 "$n" "m8c_$n" --compile; done
  tr_bench tr_c1 1 base:65536:compile,base:65536:bare:lossc,base:65536:bare:regional
  ;;
phase8) # fifth session: compiled weak scaling, traced (which rank do the others wait for?): the 1-GPU baseline,
  # 4 GPUs as the sampler deals steps by default, then with --balance-steps (each step's batches of similar row
  # counts), then 2 GPUs balanced; one compile cache for all. What ran (commit fe4276b) balanced the steps with a
  # patch in bench/trace_boundary.py that became train.py's --balance-steps (the same grouping; another shuffle)
  m8_data
  m8 1 m8c_1b --compile
  tb 4 tbc4 --before 3 --after 5 -- --compile
  tb 4 tbc4_bal --before 3 --after 5 -- --compile --balance-steps
  tb 2 tbc2_bal --before 3 --after 5 -- --compile --balance-steps
  ;;
phase9) # fifth session: does --balance-steps cost quality? The documented de->en recipe on 2 GPUs, with and
  # without it, side by side (GPUs 0-1 and 2-3, 32 pinned cores each)
  for v in mixed balanced; do
    (
      extra=()
      if [ $v = mixed ]; then
        pin 0-31
        export CUDA_VISIBLE_DEVICES=0,1
      else
        pin 32-63
        export CUDA_VISIBLE_DEVICES=2,3
        extra=(--balance-steps)
      fi
      t torchrun --standalone --nproc_per_node=2 transformer/train.py --data .data/multi30k --lang-src de \
        --lang-tgt en --preset small --max-tokens 8192 --lr 1e-3 --warmup-steps 1000 --epochs 60 --eval-every 5 \
        -p 100 --samples 0 --output-dir "/tmp/deen2_$v" "${extra[@]}" >"/tmp/deen2_$v.log" 2>&1
      grep -E "^done|val:|rror|s wall" "/tmp/deen2_$v.log"
      keep "/tmp/deen2_$v/metrics.jsonl" "deen_2gpu_$v.jsonl"
    ) >"$OUT/q_$v.log" 2>&1 &
  done
  wait
  ;;
*)
  echo "usage: $0 phase1|phase2|phase3|phase4|phase5|phase6|phase7|phase8|phase9" >&2
  exit 2
  ;;
esac
