"""Every figure in README.md and BENCHMARKS.md, computed from the run logs committed in docs/runs (stdlib only).

    python bench/report.py            # print every generated block as Markdown
    python bench/report.py --write    # rewrite the blocks in README.md and BENCHMARKS.md
    python bench/report.py --check    # exit 1 naming each block that differs from what the logs give (CI runs it)

A generated block sits between ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->`` in README.md or
BENCHMARKS.md; its text is ``BLOCKS[NAME]`` with each ``{figure:format}`` filled from ``FIGURES``. Prose outside
the markers is written by hand and holds no figure.

Adding a figure (say a new log docs/runs/tr_base_packed_1xh100.jsonl):
1. commit the log under docs/runs, named workload_configuration_hardware (``tr_base_packed_1xh100.jsonl``);
2. add one line to FIGURES: ``"tr_packed_1": lambda f: median("tr_base_packed_1xh100.jsonl", "tok_per_s"),``
   with a reader below (median, val, last_val, best, row, grab, since_start), or from other figures through ``f``
   (``lambda f: eff(f, "tr_packed_4", "tr_packed_1", 4)``); ``per()`` makes one figure per seed or GPU count;
3. put ``{tr_packed_1:,.0f}`` and ``[[tr_base_packed_1xh100.jsonl]]`` (a link to the log) into a template in
   BLOCKS: a new table row, or a new block, whose two markers you then put where it belongs in README.md or
   BENCHMARKS.md. Templates can also name the constants (``{H100}``, ``{BLEU_CMD}``) and link ``[text](@LOG)``;
4. run ``python bench/report.py --write`` and commit the log, this file and the regenerated docs together.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNS = REPO / "docs" / "runs"
DOCS = ("README.md", "BENCHMARKS.md")


# Readers: each takes a file name in docs/runs and returns one number.
@cache
def text(log: str) -> str:
    return (RUNS / log).read_text()


def records(log: str, split: str = "train") -> list[dict]:
    """The metrics.jsonl records of a split (a trace summary may hold the records among its other lines)."""
    return [
        r for r in (json.loads(x) for x in text(log).splitlines() if x.startswith('{"split"')) if r["split"] == split
    ]


def median(log: str, key: str, skip: int = 2, drop: tuple[int, ...] = ()) -> float:
    """Median of the train windows after the first ``skip`` (warm-up, compilation), leaving out steps ``drop``."""
    return statistics.median(r[key] for r in records(log)[skip:] if r["step"] not in drop)


def val(log: str, key: str, epoch: int) -> float:
    """An evaluation's metric at one epoch."""
    return found(log, f"evaluation at epoch {epoch}", [r[key] for r in records(log, "val") if r["epoch"] == epoch])


def last_val(log: str, key: str) -> float:
    return records(log, "val")[-1][key]


def best(log: str, key: str) -> float:
    return max(r[key] for r in records(log, "val"))


def row(log: str, what: str, key: str) -> float:
    """A value of the results.json row (bench/benchmark.py) whose description is exactly ``what``."""
    return found(log, f"row {what!r}", [r[key] for r in json.loads(text(log))["rows"] if r["what"] == what])


def found(log: str, what: str, values: list):
    if not values:
        raise LookupError(f"{log} has no {what}")
    return values[0]


def grab(log: str, pattern: str) -> float:
    """The first group of a regular expression in a console log (thousands commas allowed)."""
    return float(found(log, f"match for {pattern!r}", re.findall(pattern, text(log))).replace(",", ""))


def since_start(log: str, tag: str) -> float:
    """A training script's own wall time (``done: ... wall Ns since start``) for the command that holds ``tag``."""
    return grab(log, r"wall ([\d.]+)s since start\n\[\d+ s wall\] [^\n]*" + re.escape(tag))


def eff(f, many: str, one: str, n: int) -> float:
    """Per-GPU weak-scaling efficiency in %: throughput on n GPUs against n times one GPU's."""
    return 100 * f[many] / (n * f[one])


def per(keys, name: str, read) -> dict:
    """One figure per key: ``name.format(key)`` is ``read(key)``."""
    return {name.format(k): (lambda f, k=k: read(k)) for k in keys}


class Figures(dict):
    """Figures computed on first use; a lambda reads logs, or other figures through its argument. The constants
    (hardware, commands, log names) are there too, so a template names them the same way."""

    def __init__(self):
        super().__init__({k: v for k, v in globals().items() if k.isupper() and isinstance(v, str)})

    def __missing__(self, name: str) -> float:
        self[name] = FIGURES[name](self)
        return self[name]


# Hardware of the runs, in the words every table uses.
H200 = "1× H200, 16 CPU cores, torch 2.11, CUDA 13.0"
H100 = "H100 80GB HBM3 (a 4-GPU host, 64 CPU cores), torch 2.11, CUDA 13.0"
PROFILE = "bare step base, 65536 tokens as 2730x24, bf16"
R50_SCRIPT = "imagenet/train.py --dummy, fp32 (TF32 convs, eager)"
TR_SCRIPT = "transformer/train.py base, 65536 tok/GPU, 1 GPU(s), bf16, compile"
LOOP = "baseline loop, base, pad 350, fp32, batch 8"
Q200 = "console_rn50_cifar_imagefolder_ende_1xh200.log"
Q100 = "console_rn50_jpeg_cifar_bleu_4xh100.log"
TR1 = "tr_base_compile_script_bare_baseline_1xh100.json"
BLEU1 = "tr_small_deen_bleu_1xh100.jsonl"

FIGURES = {
    # ResNet-50
    "rn50_fp32_bare": lambda f: grab(Q200, r"\| bare step, fp32 \(TF32 convs, eager\) \| 256 \| ([\d,]+)"),
    "rn50_fp32_script": lambda f: grab(Q200, re.escape(R50_SCRIPT) + r" \| 256 \| ([\d,]+)"),
    "rn50_fp32_ratio": lambda f: 100 * f["rn50_fp32_script"] / f["rn50_fp32_bare"],
    "rn50_e1": lambda f: median("rn50_bf16_cl_eager_1xh100.jsonl", "img_per_s"),
    "rn50_e2": lambda f: median("rn50_bf16_cl_eager_2xh100.jsonl", "img_per_s"),
    "rn50_e4": lambda f: median("rn50_bf16_cl_eager_4xh100.jsonl", "img_per_s"),
    "rn50_e22": lambda f: median("rn50_bf16_cl_eager_2agents_4xh100.jsonl", "img_per_s"),
    "rn50_c1": lambda f: median("rn50_bf16_cl_compile_1xh100.jsonl", "img_per_s"),
    "rn50_c4": lambda f: median("rn50_bf16_cl_compile_4xh100.jsonl", "img_per_s"),
    "rn50_e2_eff": lambda f: eff(f, "rn50_e2", "rn50_e1", 2),
    "rn50_e4_eff": lambda f: eff(f, "rn50_e4", "rn50_e1", 4),
    "rn50_e22_eff": lambda f: eff(f, "rn50_e22", "rn50_e1", 4),
    "rn50_c4_eff": lambda f: eff(f, "rn50_c4", "rn50_c1", 4),
    "jpeg_pil": lambda f: grab(Q100, r"Pillow DataLoader \| 256 \| ([\d,]+)"),
    "jpeg_gpu": lambda f: grab(Q100, r"--gpu-decode \| 256 \| ([\d,]+)"),
    "jpeg_pil_s": lambda f: grab(Q100, r"Pillow DataLoader \| 256 \| [\d,]+ \| (\d+)s"),
    "jpeg_gpu_s": lambda f: grab(Q100, r"--gpu-decode \| 256 \| [\d,]+ \| (\d+)s"),
    "jpeg_share": lambda f: 100 * f["jpeg_gpu"] / f["rn50_c1"],
    "ckpt_tr_s": lambda f: grab("tr_base_m8_trace_eager_4xh100.txt", r"([\d.]+) ms  boundary: save_checkpoint") / 1e3,
    # CIFAR-10 ResNet-18, the 80-epoch recipe
    **per(range(3), "c200_{}", lambda s: last_val(f"cifar_r18_e80_seed{s}_1xh200.jsonl", "acc1")),
    **per(range(3), "c200_{}_s", lambda s: since_start(Q200, f"--seed {s} ")),
    **per(range(3), "c200_{}_ips", lambda s: median(f"cifar_r18_e80_seed{s}_1xh200.jsonl", "img_per_s", 0)),
    **per(range(3), "c2_{}", lambda s: last_val(f"cifar_r18_e80_seed{s}_2xh100.jsonl", "acc1")),
    **per(range(3), "c2_{}_s", lambda s: since_start(Q100, f"/tmp/c2_seed{s} ")),
    **per(range(3), "c2_{}_ips", lambda s: median(f"cifar_r18_e80_seed{s}_2xh100.jsonl", "img_per_s", 0)),
    "c200_mean": lambda f: statistics.mean(f[f"c200_{s}"] for s in range(3)),
    "c200_std": lambda f: statistics.stdev(f[f"c200_{s}"] for s in range(3)),
    "c2_mean": lambda f: statistics.mean(f[f"c2_{s}"] for s in range(3)),
    "c2_std": lambda f: statistics.stdev(f[f"c2_{s}"] for s in range(3)),
    "c1": lambda f: last_val("cifar_r18_e80_seed0_1xh100.jsonl", "acc1"),
    "c1_s": lambda f: since_start(Q100, "/tmp/c1_seed0_cold "),
    "c1_ips": lambda f: median("cifar_r18_e80_seed0_1xh100.jsonl", "img_per_s", 0),
    "c4": lambda f: last_val("cifar_r18_e80_seed0_4xh100.jsonl", "acc1"),
    "c4_s": lambda f: since_start(Q100, "/tmp/c4_seed0 "),
    "c4_ips": lambda f: median("cifar_r18_e80_seed0_4xh100.jsonl", "img_per_s", 0),
    **per((5, 10, 20), "cg_{}", lambda e: val("cifar_r18_e20_gpudata_1xh100.jsonl", "acc1", e)),
    **per((5, 10, 20), "cl_{}", lambda e: val("cifar_r18_e20_dataloader_1xh100.jsonl", "acc1", e)),
    "cg_s": lambda f: since_start(Q100, "/tmp/c1_e20_gpudata "),
    "cl_s": lambda f: since_start("console_tr_base_compile_cudnn_cifar_dataloader_1xh100.log", "/tmp/c1_e20_loader "),
    "cg_ips": lambda f: median("cifar_r18_e20_gpudata_1xh100.jsonl", "img_per_s", 0),
    "cl_ips": lambda f: median("cifar_r18_e20_dataloader_1xh100.jsonl", "img_per_s", 0),
    "if_acc": lambda f: last_val("imagefolder_r18_cifar64px_1xh200.jsonl", "acc1"),
    "if_s": lambda f: grab(Q200, r"\[(\d+) s wall\] python3 imagenet/train.py /tmp/inet"),
    "if_ips": lambda f: median("imagefolder_r18_cifar64px_1xh200.jsonl", "img_per_s", 0),
    # Transformer
    "tr_loop": lambda f: row(TR1, LOOP, "tok_per_s"),
    "tr_c1": lambda f: row(TR1, TR_SCRIPT, "tok_per_s"),
    "tr_c1_mfu": lambda f: 100 * row(TR1, TR_SCRIPT, "mfu"),
    "tr_c1_x": lambda f: f["tr_c1"] / f["tr_loop"],
    "tr_whole": lambda f: row(TR1, f"{PROFILE}, model and loss compiled together", "tok_per_s"),
    "tr_whole_mfu": lambda f: 100 * row(TR1, f"{PROFILE}, model and loss compiled together", "mfu"),
    "tr_layer": lambda f: row(TR1, f"{PROFILE}, each layer and the loss compiled apart", "tok_per_s"),
    "tr_layer_mfu": lambda f: 100 * row(TR1, f"{PROFILE}, each layer and the loss compiled apart", "mfu"),
    "tr_layer_cost": lambda f: 100 * (1 - f["tr_layer"] / f["tr_whole"]),
    "tr_c1_wall": lambda f: float(row(TR1, TR_SCRIPT, "wall").rstrip("s")),
    "tr_whole_wall": lambda f: float(row("tr_base_compile_whole_cudnn_1xh100.json", TR_SCRIPT, "wall").rstrip("s")),
    **per((1, 2, 4), "tr_e{}", lambda n: median(f"tr_base_m8_eager_{n}xh100.jsonl", "tok_per_s")),
    **per((1, 2, 4), "tr_m{}", lambda n: median(f"tr_base_m8_compile_{n}xh100.jsonl", "tok_per_s")),
    "tr_e2_eff": lambda f: eff(f, "tr_e2", "tr_e1", 2),
    "tr_e4_eff": lambda f: eff(f, "tr_e4", "tr_e1", 4),
    "tr_m2_eff": lambda f: eff(f, "tr_m2", "tr_m1", 2),
    "tr_m4_eff": lambda f: eff(f, "tr_m4", "tr_m1", 4),
    # --balance-steps: traced runs, the profiled window left out of each median (steps 11-20 on 4, 31-40 on 2)
    "tr_b1": lambda f: median("tr_base_m8_compile_1xh100_run2.jsonl", "tok_per_s"),
    "tr_t4": lambda f: median("tr_base_m8_trace_compile_4xh100.txt", "tok_per_s"),
    "tr_b4": lambda f: median("tr_base_m8_trace_compile_balance_4xh100.txt", "tok_per_s"),
    "tr_b2": lambda f: median("tr_base_m8_trace_compile_balance_2xh100.txt", "tok_per_s", 1, drop=(40,)),
    "tr_t4_eff": lambda f: eff(f, "tr_t4", "tr_b1", 4),
    "tr_b4_eff": lambda f: eff(f, "tr_b4", "tr_b1", 4),
    "tr_b2_eff": lambda f: eff(f, "tr_b2", "tr_b1", 2),
    "bleu_mix_10": lambda f: val("tr_small_deen_bleu_2xh100.jsonl", "bleu", 10),
    "bleu_bal_10": lambda f: val("tr_small_deen_bleu_balance_steps_2xh100.jsonl", "bleu", 10),
    "bleu_mix_60": lambda f: val("tr_small_deen_bleu_2xh100.jsonl", "bleu", 60),
    "bleu_bal_60": lambda f: val("tr_small_deen_bleu_balance_steps_2xh100.jsonl", "bleu", 60),
    "bleu_mix_best": lambda f: best("tr_small_deen_bleu_2xh100.jsonl", "bleu"),
    "bleu_bal_best": lambda f: best("tr_small_deen_bleu_balance_steps_2xh100.jsonl", "bleu"),
    # cuDNN attention: eager, 40 steps on Multi30k x 8 (every batch shape new), median after the first window
    "cudnn_on": lambda f: median("tr_base_m8_eager_cudnn_1xh100.jsonl", "tok_per_s", 1),
    "cudnn_off": lambda f: median("tr_base_m8_eager_nocudnn_1xh100.jsonl", "tok_per_s", 1),
    "cudnn_x": lambda f: f["cudnn_off"] / f["cudnn_on"],
    "bare_cudnn": lambda f: row(
        "tr_base_bare_attention_cudnn_1xh100.json", f"{PROFILE}, model and loss compiled together", "tok_per_s"
    ),
    "bare_flash": lambda f: row(
        "tr_base_bare_attention_flash_1xh100.json",
        f"{PROFILE}, model and loss compiled together, attention: flash",
        "tok_per_s",
    ),
    "prof_wall": lambda f: grab("tr_base_bare_profile_1xh100.txt", r"^wall ([\d.]+) ms/step"),
    "prof_attn": lambda f: grab("tr_base_bare_profile_1xh100.txt", r"attention \(SDPA\): ([\d.]+) ms"),
    "prof_mm_peak": lambda f: 100 * 6 * 48.2e6 * 2730 * 24 / (f["prof_mm"] / 1e3) / 989e12,  # 6 x params x tokens
    "prof_mm": lambda f: grab("tr_base_bare_profile_1xh100.txt", r"matmul: ([\d.]+) ms"),
    "prof_ew": lambda f: grab("tr_base_bare_profile_1xh100.txt", r"fused elementwise/norm \(Triton\): ([\d.]+) ms"),
    # Multi30k BLEU (small preset, greedy, 1,014 validation sentences)
    "deen_20": lambda f: val(BLEU1, "bleu", 20),
    "deen_60": lambda f: val(BLEU1, "bleu", 60),
    "deen_best": lambda f: best(BLEU1, "bleu"),
    "deen_s": lambda f: grab(Q100, r"best val BLEU [\d.]+, wall ([\d.]+)s"),
    "deen_tps": lambda f: median(BLEU1, "tok_per_s"),
    "ende_40": lambda f: val("tr_small_ende_bleu_1xh200.jsonl", "bleu", 40),
    "ende_s": lambda f: grab(Q200, r"best val BLEU [\d.]+, wall ([\d.]+)s"),
}

CIFAR_CMD = (
    "cifar_resnet/train.py --data-dir /tmp/c --val-split 5000 --gpu-data --compile -b B --lr 0.4 -j 16 --tta "
    "--epochs 80 --eval-every 10 -p 1000 --seed S"
)
M8_CMD = (
    "transformer/train.py --data /tmp/m8 --lang-src de --lang-tgt en --preset base --max-tokens 65536 --max-steps 70 "
    "-p 10 --eval-every 0 -j 4 --vocab-size 8000 --resume none"
)
BLEU_CMD = (
    "transformer/train.py --data .data/multi30k --lang-src de --lang-tgt en --preset small --max-tokens 8192 "
    "--lr 1e-3 --warmup-steps 1000 --epochs 60 --eval-every 5 -p 100 --samples 0"
)

BLOCKS = {
    "readme-results": """\
| task | command (exact one in BENCHMARKS.md) | hardware | wall | result |
|---|---|---|---|---|
| CIFAR-10 ResNet-18, 80 epochs, 5,000 held-out JPEGs | `cifar_resnet/train.py --gpu-data --compile -b 512 --lr 0.4 --tta --epochs 80` | 1× H200 | {c200_1_s:.0f}–{c200_0_s:.0f} s | val top-1 **{c200_mean:.2f} ± {c200_std:.2f}%** (3 seeds) |
| the same recipe, global batch 512 | `torchrun --nproc_per_node=2 ... -b 256` | 2× H100 | {c2_2_s:.0f}–{c2_0_s:.0f} s | val top-1 **{c2_mean:.2f} ± {c2_std:.2f}%** (3 seeds) |
| the same recipe, global batch 512 | `torchrun --nproc_per_node=4 ... -b 128` | 4× H100 | {c4_s:.0f} s | val top-1 {c4:.2f}% (1 seed) |
| `imagenet/train.py` on the CIFAR JPEGs as an ImageFolder, 64 px | `imagenet/train.py DIR -a resnet18 --recipe modern --epochs 10 ...` | 1× H200 | {if_s:.0f} s | val top-1 {if_acc:.2f}% (1 seed) |
| Multi30k de→en, `small` | `transformer/train.py --preset small --max-tokens 8192 --lr 1e-3 --epochs 60` | 1× H100 | {deen_s:.0f} s | sacreBLEU {deen_20:.1f} at epoch 20, best {deen_best:.1f} (greedy, 1 seed) |
| Multi30k en→de, `small` | the same, `--lang-src en --lang-tgt de --epochs 40` | 1× H200 | {ende_s:.0f} s | sacreBLEU {ende_40:.1f} at epoch 40 (greedy, 1 seed) |

Headline speed (each against a baseline measured in the same run where one is named):
- **ResNet-50 weak scaling**, batch 256 per GPU, bf16 + channels_last: {rn50_e2_eff:.1f}% per GPU on 2 H100s and
  {rn50_e4_eff:.1f}% on 4 (eager); {rn50_c4_eff:.1f}% on 4 with `--compile` ({rn50_c4:,.0f} img/s). On one H200 in fp32
  the script runs at {rn50_fp32_ratio:.0f}% of a bare training step ({rn50_fp32_script:,.0f} img/s).
- **Real JPEGs**, one H100, 16 CPU workers: `--gpu-decode` trains ResNet-50 at **{jpeg_gpu:,.0f} img/s** against
  {jpeg_pil:,.0f} for the Pillow DataLoader on the same files.
- **CIFAR-10**, one H100: `--gpu-data` reaches {cg_20:.1f}% in {cg_s:.1f} s (20 epochs), the DataLoader path
  {cl_20:.1f}% in {cl_s:.1f} s.
- **Transformer `base`**, one H100: `--compile` trains at {tr_c1:,.0f} target tokens/s ({tr_c1_mfu:.1f}% MFU),
  **{tr_c1_x:.0f}×** a tutorial-style padded fp32 loop in the same run. Weak scaling {tr_e2_eff:.1f}% per GPU on 2
  H100s and {tr_e4_eff:.1f}% on 4 (eager, the default).
""",
    "rn50-dummy": """\
| what | bare training step | `imagenet/train.py --dummy` | script / bare | hardware | log |
|---|---|---|---|---|---|
| ResNet-50, fp32 weights, TF32 convolutions, eager, batch 256 | {rn50_fp32_bare:,.0f} img/s | {rn50_fp32_script:,.0f} img/s | {rn50_fp32_ratio:.1f}% | {H200} | [[{Q200}]] |

Command: `python3 bench/benchmark.py --only resnet50 --rn50-configs fp32 --iters 30 --script-steps 60 --out /tmp/rn`.
""",
    "rn50-scaling": """\
Hardware: {H100}. Command: `torchrun --standalone --nproc_per_node=N imagenet/train.py --dummy -a resnet50 -b 256
--max-steps 60 -p 10 --resume none --amp bf16 --channels-last [--compile]`; the two-agent row starts
`scripts/torchrun_multinode.sh --nnodes 2 --nproc-per-node 2 --master 127.0.0.1:29700 --rdzv-id two2 ...` twice,
with `CUDA_VISIBLE_DEVICES=0,1` and `2,3` (one world of 4). The baseline is the 1-GPU row of the same configuration.

| configuration | GPUs | img/s (all GPUs) | per-GPU efficiency | log |
|---|---|---|---|---|
| bf16 + channels_last, eager | 1 | {rn50_e1:,.0f} | — | [[rn50_bf16_cl_eager_1xh100.jsonl]] |
| bf16 + channels_last, eager | 2 | {rn50_e2:,.0f} | {rn50_e2_eff:.1f}% | [[rn50_bf16_cl_eager_2xh100.jsonl]] |
| bf16 + channels_last, eager | 4 | {rn50_e4:,.0f} | {rn50_e4_eff:.1f}% | [[rn50_bf16_cl_eager_4xh100.jsonl]] |
| bf16 + channels_last, eager, 2 agents × 2 GPUs | 4 | {rn50_e22:,.0f} | {rn50_e22_eff:.1f}% | [[rn50_bf16_cl_eager_2agents_4xh100.jsonl]] |
| bf16 + channels_last + `--compile` | 1 | {rn50_c1:,.0f} | — | [[rn50_bf16_cl_compile_1xh100.jsonl]] |
| bf16 + channels_last + `--compile` | 4 | {rn50_c4:,.0f} | {rn50_c4_eff:.1f}% | [[rn50_bf16_cl_compile_4xh100.jsonl]] |
""",
    "rn50-jpeg": """\
Hardware: 1× {H100}, the loader pinned to 17 cores. Command: `python3 bench/benchmark.py --only jpeg --cifar-dir /tmp/c
--out /tmp/jpeg`, which writes 25,600 + 512 CIFAR JPEGs upscaled to 500×375 (quality 90, 17 KB on average) and
trains one epoch of ResNet-50 on them (`imagenet/train.py -b 256 --epochs 1 -j 16 --amp bf16 --channels-last
--compile`, plus `--gpu-decode` on the second row). Log: [[{Q100}]].

| data path | img/s | whole run |
|---|---|---|
| Pillow DataLoader (decode, RandomResizedCrop, flip on 16 CPU workers): the baseline | {jpeg_pil:,.0f} | {jpeg_pil_s:.0f} s |
| `--gpu-decode` (file bytes from 16 workers, batched `decode_jpeg(device="cuda")`, augmentation on the GPU) | **{jpeg_gpu:,.0f}** | {jpeg_gpu_s:.0f} s |

`--gpu-decode` runs at {jpeg_share:.0f}% of the `--dummy` rate with `--compile` on this host ({rn50_c1:,.0f} img/s,
table above, another run). The upscaled files are smoother than ImageNet's (~110 KB), so entropy decoding is
lighter; the pixel count per image (187,500) is above ImageNet's average.
""",
    "checkpoint": """\
- Transformer `base` (48.2M parameters; weights and AdamW's two moments, about 580 MB), 4× {H100}: rank 0 writes `last.pt` in
  {ckpt_tr_s:.2f} s at an epoch end while the other ranks wait
  ([[tr_base_m8_trace_eager_4xh100.txt]], from `bench/trace_boundary.py`).
""",
    "cifar-accuracy": """\
Command: `[torchrun --standalone --nproc_per_node=N] {CIFAR_CMD}` with the global batch held at 512 (`-b 512` on 1
GPU, `-b 256` on 2, `-b 128` on 4). Accuracy is the last evaluation (epoch 80, flip TTA) on the 5,000 held-out
images; wall is the script's own, process start to end; img/s is the median of the logged 1,000-step windows.
Hardware: {H200}; 1, 2 or 4 × {H100}.

| hardware | seed | val top-1 | wall | img/s (all GPUs) | log |
|---|---|---|---|---|---|
| 1× H200 | 0 (empty compile cache) | {c200_0:.2f} | {c200_0_s:.1f} s | {c200_0_ips:,.0f} | [[cifar_r18_e80_seed0_1xh200.jsonl]] |
| 1× H200 | 1 | {c200_1:.2f} | {c200_1_s:.1f} s | {c200_1_ips:,.0f} | [[cifar_r18_e80_seed1_1xh200.jsonl]] |
| 1× H200 | 2 | {c200_2:.2f} | {c200_2_s:.1f} s | {c200_2_ips:,.0f} | [[cifar_r18_e80_seed2_1xh200.jsonl]] |
| | **mean ± std** | **{c200_mean:.2f} ± {c200_std:.2f}** | | | console: [[{Q200}]] |
| 1× H100 | 0 | {c1:.2f} | {c1_s:.1f} s | {c1_ips:,.0f} | [[cifar_r18_e80_seed0_1xh100.jsonl]] |
| 2× H100 | 0 | {c2_0:.2f} | {c2_0_s:.1f} s | {c2_0_ips:,.0f} | [[cifar_r18_e80_seed0_2xh100.jsonl]] |
| 2× H100 | 1 | {c2_1:.2f} | {c2_1_s:.1f} s | {c2_1_ips:,.0f} | [[cifar_r18_e80_seed1_2xh100.jsonl]] |
| 2× H100 | 2 | {c2_2:.2f} | {c2_2_s:.1f} s | {c2_2_ips:,.0f} | [[cifar_r18_e80_seed2_2xh100.jsonl]] |
| | **mean ± std** | **{c2_mean:.2f} ± {c2_std:.2f}** | | | console: [[{Q100}]] |
| 4× H100 | 0 | {c4:.2f} | {c4_s:.1f} s | {c4_ips:,.0f} | [[cifar_r18_e80_seed0_4xh100.jsonl]] |
""",
    "cifar-gpu-data": """\
**Why `--gpu-data`.** The same recipe for 20 epochs (`--epochs 20 --eval-every 5`) on 1× {H100}, each data path:

| data path | val top-1 at epoch 5 / 10 / 20 | wall | img/s | log |
|---|---|---|---|---|
| DataLoader, Pillow decode and augmentation on 16 workers | {cl_5:.2f} / {cl_10:.2f} / {cl_20:.2f} | {cl_s:.1f} s | {cl_ips:,.0f} | [[cifar_r18_e20_dataloader_1xh100.jsonl]] |
| `--gpu-data` (uint8 dataset on the GPU, crop and flip there) | {cg_5:.2f} / {cg_10:.2f} / {cg_20:.2f} | {cg_s:.1f} s | {cg_ips:,.0f} | [[cifar_r18_e20_gpudata_1xh100.jsonl]] |

The two ran on two hosts of the same type. The DataLoader path is bound by JPEG decoding on the CPU.
""",
    "tr-throughput": """\
Hardware: 1× {H100}. Command: `python3 bench/benchmark.py --only transformer --multi30k .data/multi30k --tr-configs
base:65536:compile,base:65536:bare:lossc,base:65536:bare:regional --tr-nprocs 1 --tr-steps 40`; all rows come from
this one run ([[{TR1}]]). MFU = 6 × 48.2M × target tokens/s ÷ 989 TFLOP/s (dense bf16), target tokens
only, attention left out.

| what | target tokens/s | MFU | × baseline |
|---|---|---|---|
| baseline: the tutorial's loop, every sentence padded to 350 tokens, fp32, batch 8 | {tr_loop:,.0f} | — | 1 |
| `transformer/train.py --preset base --max-tokens 65536 --compile`, Multi30k | **{tr_c1:,.0f}** | {tr_c1_mfu:.1f}% | **{tr_c1_x:.0f}** |
| bare step, 2,730 × 24 tokens, no padding, model and loss compiled whole | {tr_whole:,.0f} | {tr_whole_mfu:.1f}% | — |
| bare step, each layer and the loss compiled apart (what `--compile` does) | {tr_layer:,.0f} | {tr_layer_mfu:.1f}% | — |

**Why the MFU is low.** A `torch.profiler` trace of the bare step, with cuDNN attention as PyTorch picks it
([[tr_base_bare_profile_1xh100.txt]]), gives per {prof_wall:.1f} ms step:
matmuls {prof_mm:.1f} ms ({prof_mm_peak:.0f}% of the GPU's peak already), attention {prof_attn:.1f} ms on 24-token rows
(under 1% of peak; the kernels' tiles are mostly empty) and {prof_ew:.1f} ms of fused LayerNorm, dropout and
residual work, which at width 512 is memory traffic of the same order as the matmuls.

**Why `--compile` compiles each layer apart.** The six encoder layers share one compiled graph and the six
decoder layers another, so DDP needs no graph splitting and compilation is short: a 40-step run of the script
took {tr_c1_wall:.0f} s, against {tr_whole_wall:.0f} s when the whole model was compiled
([log](@tr_base_compile_whole_cudnn_1xh100.json), with cuDNN attention then). It costs {tr_layer_cost:.1f}%
on the bare step.
""",
    "tr-scaling": """\
Hardware: {H100}. Corpus: Multi30k × 8 (232,000 pairs: 60 steps an epoch on 1 GPU, 30 on 2, 15 on 4), built by
`bench/reproduce.sh scaling`. Command: `torchrun --standalone --nproc_per_node=N {M8_CMD} [--compile]`.
Throughput is the median of the 10-step windows 21–70; the baseline is the 1-GPU run of the same configuration.

| configuration | GPUs | target tokens/s | per-GPU efficiency | log |
|---|---|---|---|---|
| eager (the default) | 1 | {tr_e1:,.0f} | — | [[tr_base_m8_eager_1xh100.jsonl]] |
| eager | 2 | {tr_e2:,.0f} | **{tr_e2_eff:.1f}%** | [[tr_base_m8_eager_2xh100.jsonl]] |
| eager | 4 | {tr_e4:,.0f} | **{tr_e4_eff:.1f}%** | [[tr_base_m8_eager_4xh100.jsonl]] |
| `--compile` | 1 | {tr_m1:,.0f} | — | [[tr_base_m8_compile_1xh100.jsonl]] |
| `--compile` | 2 | {tr_m2:,.0f} | {tr_m2_eff:.1f}% | [[tr_base_m8_compile_2xh100.jsonl]] |
| `--compile` | 4 | {tr_m4:,.0f} | {tr_m4_eff:.1f}% | [[tr_base_m8_compile_4xh100.jsonl]] |

Console output of these runs: [[console_tr_base_m8_scaling_4xh100.log]].
""",
    "tr-balance": """\
**Why `--balance-steps` exists, and why it is off.** Under DDP every rank waits for the slowest, and a batch's
time grows with its row count (sentences), which differs between ranks although each holds 65,536 padded
tokens. `--balance-steps` gives each step's ranks batches of neighbouring row counts. Compiled, traced with
`bench/trace_boundary.py` (the profiled window left out of each median), against a 1-GPU compiled run of the same
configuration ({tr_b1:,.0f} tok/s, [log](@tr_base_m8_compile_1xh100_run2.jsonl)):

| run | target tokens/s | per-GPU efficiency | log |
|---|---|---|---|
| `--compile`, 4 GPUs | {tr_t4:,.0f} | {tr_t4_eff:.1f}% | [[tr_base_m8_trace_compile_4xh100.txt]] |
| `--compile --balance-steps`, 4 GPUs | {tr_b4:,.0f} | {tr_b4_eff:.1f}% | [[tr_base_m8_trace_compile_balance_4xh100.txt]] |
| `--compile --balance-steps`, 2 GPUs | {tr_b2:,.0f} | {tr_b2_eff:.1f}% | [[tr_base_m8_trace_compile_balance_2xh100.txt]] |

Console output of these runs: [[console_tr_base_m8_compile_balance_4xh100.log]].

It costs early quality: the de→en recipe on 2× {H100} (`torchrun --nproc_per_node=2 {BLEU_CMD}
[--balance-steps]`) reached sacreBLEU {bleu_bal_10:.1f} at epoch 10 with it against {bleu_mix_10:.1f} without, and
{bleu_bal_60:.2f} / {bleu_mix_60:.2f} at epoch 60 (best {bleu_bal_best:.2f} / {bleu_mix_best:.2f}; one seed each:
[with](@tr_small_deen_bleu_balance_steps_2xh100.jsonl), [without](@tr_small_deen_bleu_2xh100.jsonl)).
So it stays off by default; it pays on several GPUs when step time matters more than the first epochs.
""",
    "tr-cudnn": """\
**Why cuDNN attention is off** (`--cudnn-attention` turns it on). PyTorch picks cuDNN's SDPA kernels on H100, and
with them every new batch shape costs time; token-budget batches bring a new (rows, source length, target length)
almost every step. Eager `base` on Multi30k × 8 (every shape new within 40 steps), 1× {H100}: {cudnn_on:,.0f}
target tokens/s with cuDNN against **{cudnn_off:,.0f}** without, {cudnn_x:.1f}× ([with](@tr_base_m8_eager_cudnn_1xh100.jsonl),
[without](@tr_base_m8_eager_nocudnn_1xh100.jsonl)). On one fixed shape the kernels without cuDNN are also
faster: {bare_flash:,.0f} against {bare_cudnn:,.0f} tok/s for the bare step
([without](@tr_base_bare_attention_flash_1xh100.json), [with](@tr_base_bare_attention_cudnn_1xh100.json); commands
in [[console_tr_base_bare_attention_flash_1xh100.log]] and [[console_tr_base_bare_attention_cudnn_1xh100.log]]).
""",
    "tr-bleu": """\
sacreBLEU `nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0`, greedy decoding, detokenized and cased,
over all 1,014 validation sentences; one seed each. Wall is the script's own, process start to end.

| direction | hardware | command | BLEU | wall | log |
|---|---|---|---|---|---|
| de→en | 1× {H100} | `python3 {BLEU_CMD}` | {deen_20:.2f} at epoch 20, {deen_60:.2f} at 60, best **{deen_best:.2f}** | {deen_s:.1f} s | [[{BLEU1}]] |
| en→de | {H200} | the same with `--lang-src en --lang-tgt de --epochs 40 -p 1000` | **{ende_40:.2f}** at epoch 40 | {ende_s:.1f} s | [[tr_small_ende_bleu_1xh200.jsonl]] |

The de→en run trained at a median {deen_tps:,.0f} target tokens/s with other jobs on the host's other GPUs.
""",
    "imagefolder": """\
`imagenet/train.py` on the 50,000 CIFAR JPEGs as an ImageFolder (45,000 train, every tenth file as val), ResNet-18
at 64 px, {H200}: `python3 imagenet/train.py /tmp/inet -a resnet18 --recipe modern --epochs 10 -b 256 --amp bf16
-j 16 --train-crop-size 64 --val-resize-size 64 --val-crop-size 64 -p 1000` reached val top-1 **{if_acc:.2f}%** in
{if_s:.0f} s at {if_ips:,.0f} img/s ([[imagefolder_r18_cifar64px_1xh200.jsonl]]).
It shows the ImageFolder path learns; with the ImageNet stem on 64 px inputs it is not a CIFAR recipe.
""",
}

MARK = re.compile(r"<!-- report:([\w-]+) -->\n(.*?)<!-- /report:\1 -->", re.S)


def links(md: str) -> str:
    """``[[NAME]]`` and ``[text](@NAME)`` link to docs/runs/NAME, which must exist."""
    for wiki, inline in re.findall(r"\[\[([^\]]+)\]\]|\]\(@([^)]+)\)", md):
        name = wiki or inline
        if not (RUNS / name).is_file():
            raise FileNotFoundError(f"docs/runs/{name} (linked from a block)")
    md = re.sub(r"\[\[([^\]]+)\]\]", r"[\1](docs/runs/\1)", md)
    return md.replace("](@", "](docs/runs/")


def render() -> dict[str, str]:
    f = Figures()
    return {name: links(tpl.format_map(f)) for name, tpl in BLOCKS.items()}


def update(doc: str, blocks: dict[str, str]) -> tuple[str, list[str]]:
    """The document with its blocks regenerated, and the names of the blocks that changed."""
    changed = []

    def sub(m: re.Match) -> str:
        new = blocks[m.group(1)]
        if m.group(2) != new:
            changed.append(m.group(1))
        return f"<!-- report:{m.group(1)} -->\n{new}<!-- /report:{m.group(1)} -->"

    return MARK.sub(sub, doc), changed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="rewrite the generated blocks in README.md and BENCHMARKS.md")
    g.add_argument("--check", action="store_true", help="exit 1 if a generated block differs from the logs")
    args = p.parse_args()
    try:
        blocks = render()
    except (OSError, LookupError) as e:  # a log missing, renamed, or without the record a figure reads
        print(f"error: {e} (docs/runs and FIGURES in bench/report.py disagree)", file=sys.stderr)
        return 2
    if not (args.write or args.check):
        for name, md in blocks.items():
            print(f"<!-- report:{name} -->\n{md}")
        return 0
    seen, bad = set(), []
    for doc in DOCS:
        path = REPO / doc
        old = path.read_text()
        names = {m[0] for m in MARK.findall(old)}
        if names - blocks.keys():
            print(f"error: {doc} marks blocks {sorted(names - blocks.keys())} that BLOCKS lacks", file=sys.stderr)
            return 2
        new, changed = update(old, blocks)
        seen |= names
        if args.write and new != old:
            path.write_text(new)
        bad += [f"{doc}: block {name!r} differs from the logs" for name in changed]
    missing = blocks.keys() - seen
    bad += [f"block {name!r} has no <!-- report:{name} --> markers in {' or '.join(DOCS)}" for name in missing]
    if args.check and bad:
        print("\n".join(bad) + "\n(python bench/report.py --write regenerates them)", file=sys.stderr)
        return 1
    if missing:  # --write: the blocks it could not place
        print("\n".join(bad[-len(missing) :]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
