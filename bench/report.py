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


def windows(log: str, key: str, skip: int = 2, drop: tuple[int, ...] = ()) -> list[float]:
    """``key`` of the train windows after the first ``skip`` (warm-up, compilation), leaving out steps ``drop``."""
    return [r[key] for r in records(log)[skip:] if r["step"] not in drop]


def median(log: str, key: str, skip: int = 2, drop: tuple[int, ...] = ()) -> float:
    """The median of those windows."""
    return statistics.median(windows(log, key, skip, drop))


def val(log: str, key: str, epoch: int) -> float:
    """An evaluation's metric at one epoch."""
    return found(log, f"evaluation at epoch {epoch}", [r[key] for r in records(log, "val") if r["epoch"] == epoch])


def last_val(log: str, key: str) -> float:
    return records(log, "val")[-1][key]


def timing(log: str, key: str) -> float:
    """A part of the wall time a CIFAR run reports on its last line (``"split": "time"``): start, data, compile, ..."""
    return found(log, "time record", [r[f"{key}_s"] for r in records(log, "time")])


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
    return float(grab_text(log, pattern).replace(",", ""))


def grab_text(log: str, pattern: str):
    """The first match of a regular expression in a log: its group, or the tuple of its groups."""
    return found(log, f"match for {pattern!r}", re.findall(pattern, text(log)))


def since_start(log: str, tag: str) -> float:
    """A training script's own wall time (``done: ... wall Ns since start``) for the command that holds ``tag``."""
    return grab(log, r"wall ([\d.]+)s since start\n\[\d+ s wall\] [^\n]*" + re.escape(tag))


def per_step(log: str, what: str) -> list[float]:
    """docs/runs/jpeg_profile_window.py's per-step list (``what``: "wall" or "batch wait"), in ms, of rank 0."""
    return [float(x) for x in grab_text(log, rf"\[steps rank 0\] {what} ms: ([\d ]+)").split()]


def profiled(log: str, trace: str, what: str) -> float:
    """A trace's ms per step (``what``: "wall", "busy" or "idle" of the training stream) as
    docs/runs/jpeg_profile_window_gaps.py prints it."""
    pattern = (
        rf"{re.escape(trace)}: \d+ steps[^\n]*\n  wall ([\d.]+) ms/step; training stream busy ([\d.]+), idle ([\d.]+)"
    )
    return float(grab_text(log, pattern)[("wall", "busy", "idle").index(what)])


def startup(script: str, mode: str, key: str) -> float:
    """bench/startup.py's median for a script's directory (``cifar_resnet``, ``imagenet``, ``transformer``) and a
    mode (``gc on``, ``gc off, frozen``): ``cpu_median_s`` or ``collect_ms_median``."""
    rows = json.loads(text(STARTUP))["rows"]
    return found(
        STARTUP, f"{script} {mode}", [r[key] for r in rows if (r["script"], r["mode"]) == (script + "/train.py", mode)]
    )


def chaos_row(script: str) -> str:
    """A BENCHMARKS row from bench/chaos.py's logs of a script (summed over its runs): faults survived / thrown per
    kind (SIGTERM of the agent: also how many times the ranks saved and exited 75), endings alike."""
    logs = sorted(p.name for p in RUNS.glob(f"chaos_{script}_*16cpu.jsonl"))
    lines = [json.loads(x) for log in logs for x in text(log).splitlines()]
    runs = [r["summary"] for r in lines if "summary" in r]
    found(f"chaos_{script}_*16cpu.jsonl", "summary", runs)
    add = lambda key, kind: sum(r[key][kind] for r in runs)  # noqa: E731
    saved = sum(r["saved_exit_75"] for r in lines if r.get("fault") == "term agent")
    kinds = [f"{add('survived', k)}/{add('thrown', k)}" for k in runs[0]["thrown"]]
    kinds[3] += f" ({saved} saved)"
    ends = {k: sum(r[k] for r in runs) for k in ("endings", "bit_identical", "records_equal")}
    return (f"| {script} | {sum(add('thrown', k) for k in runs[0]['thrown'])} | {' | '.join(kinds)} | "
            f"{ends['bit_identical']}/{ends['endings']} | {ends['records_equal']}/{ends['endings']} | "
            + ", ".join(f"[[{log}]]" for log in logs) + " |")  # fmt: skip


def eff(f, many: str, one: str, n: int) -> float:
    """Per-GPU weak-scaling efficiency in %: throughput on n GPUs against n times one GPU's."""
    return 100 * f[many] / (n * f[one])


PW, SGD, ES = "jpeg_profile_window_1xh200.log", "jpeg_sgd_fused_1xh200.log", "jpeg_epoch_start_profile_1xh200.log"
JPEG_ROWS = {  # key -> the bench row (after JPEG_ROW) in JPEG
    "dm": "--dummy (no data path), bf16 + channels_last + compile",
    "tv": "--gpu-decode --gpu-decoder torchvision, bf16 + channels_last + compile",
    "dg": "--dummy (no data path), bf16 + channels_last + compile + CUDA graphs",
    "tg": "--gpu-decode --gpu-decoder torchvision, bf16 + channels_last + compile + CUDA graphs",
    "ng": "--gpu-decode --gpu-decoder nvimgcodec, bf16 + channels_last + compile + CUDA graphs",
    "ex": "pytorch/examples main.py configuration: Pillow, fp32, eager",
    "pl": "Pillow DataLoader, bf16 + channels_last + compile",
    "t8": "--gpu-decode --gpu-decoder torchvision, 8 hardware queues, bf16 + channels_last + compile + CUDA graphs",
}
JPEG_GRAPHS = ("dg", "tg", "ng", "t8")  # their share is of --dummy with CUDA graphs, the others' of --dummy without
HWQ = "jpeg_decode_hwqueues_4xh200host.log"  # two runs: CUDA_DEVICE_MAX_CONNECTIONS=8, then 32
CROPS = "torchvision: crop+resize+flip+normalize of 256 decoded images"


@cache
def final(log: str, second: bool = False) -> dict:
    """The FINAL record of an in-process experiment's log (the second one where the log holds two runs)."""
    return json.loads(text(log).split("FINAL ")[1 + second].splitlines()[0])


def span(values) -> str:
    """'lo–hi' of some seconds, rounded."""
    v = sorted(values)
    return f"{v[0]:.0f}–{v[-1]:.0f}"


def per(keys, name: str, read) -> dict:
    """One figure per key: ``name.format(key)`` is ``read(key)``."""
    return {name.format(k): (lambda f, k=k: read(k)) for k in keys}


def per_f(keys, name: str, read) -> dict:
    """``per`` for figures computed from other figures: ``read(figures, key)``."""
    return {name.format(k): (lambda f, k=k: read(f, k)) for k in keys}


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
H100_16 = "1× H100 80GB HBM3, 16 CPU cores, torch 2.11, CUDA 13.0"
PROFILE = "bare step base, 65536 tokens as 2730x24, bf16"
R50_SCRIPT = "imagenet/train.py --dummy, fp32 (TF32 convs, eager)"
TR_SCRIPT = "transformer/train.py base, 65536 tok/GPU, 1 GPU(s), bf16, compile"
LOOP = "baseline loop, base, pad 350, fp32, batch 8"
Q200 = "console_rn50_cifar_imagefolder_ende_1xh200.log"
Q100 = "console_rn50_jpeg_cifar_bleu_4xh100.log"
TR1 = "tr_base_compile_script_bare_baseline_1xh100.json"
BLEU1 = "tr_small_deen_bleu_packed_d04_t8k_1xh100.jsonl"
JPEG = "jpeg_decode_paths_1xh200.json"
PK = "transformer_base_packed_bare_1xh100.json"
TRN = "tr_base_m8_script_bare_1xh100.json"
TRS = "tr_small_script_cudagraphs_bare_1xh100.json"
TR_LOG = "tr_base_m8_small_scripts_1xh100.log"
SM_UNPACKED = "transformer_small_unpacked_script_eager_1xh100.json"
SM_SCRIPT = "transformer/train.py small, 8192 tok/GPU, 1 GPU(s), bf16"
SM_BARE = (
    "bare step small, packed 8x1024 rows, 8080 real target tokens, bf16, compile, model and loss compiled together, "
)
PK_PROF = "transformer_base_packed_bare_profile_1xh100.txt"
JPEG_ROW = "imagenet/train.py ResNet-50, 20480 JPEGs of 500x375 q90 (100 KB), "
BR = "jpeg_batched_resize_1xh200.log"
BC = "jpeg_batched_connections_1xh200.log"
BT = "jpeg_batched_timeline_1xh200.log"
SW = "jpeg_switch_interval_1xh200.log"
PK_STEP = "bare step base, packed 64x1024 rows, 63775 real target tokens, bf16, compile, "

STARTUP = "startup_gc_2core.json"  # bench/startup.py on the 2-core development machine
STARTUP_SCRIPTS = ("cifar_resnet", "imagenet", "transformer")
CB = "cifar_script_bare_1xh200.json"
ABL = "cifar_step_ablation_4xh200host.log"
CIFAR_PARTS = ("start", "data", "compile", "train", "eval", "checkpoint", "wall")
CIFAR_FULL18 = ("seed0", "seed1", "seed2")
CIFAR_BENCH = {
    "bare": "bare step resnet18, b 512, bf16+cl+compile, resident data",
    "script": "cifar_resnet/train.py resnet18 --gpu-data",
    "graphs": "cifar_resnet/train.py resnet18 --gpu-data, CUDA graphs",
    "loader": "cifar_resnet/train.py resnet18 DataLoader (Pillow)",
}

FIGURES = {
    **per(("cifar", "transformer", "imagenet"), "chaos_{}", chaos_row),  # bench/chaos.py, random faults
    # Process start-up with and without the cyclic GC during the imports (bench/startup.py)
    **per(STARTUP_SCRIPTS, "start_{}_on", lambda k: startup(k, "gc on", "cpu_median_s")),
    **per(STARTUP_SCRIPTS, "start_{}_off", lambda k: startup(k, "gc off, frozen", "cpu_median_s")),
    **per(STARTUP_SCRIPTS, "start_{}_gc_on", lambda k: startup(k, "gc on", "collect_ms_median")),
    **per(STARTUP_SCRIPTS, "start_{}_gc_off", lambda k: startup(k, "gc off, frozen", "collect_ms_median")),
    **per_f(STARTUP_SCRIPTS, "start_{}_less", lambda f, k: 100 * (1 - f[f"start_{k}_off"] / f[f"start_{k}_on"])),
    # Real JPEGs: every data path in one bench run (JPEG), then in-process experiments (BR, BC, BT, HWQ)
    **{
        f"jpeg_{k}_{col}": (lambda f, k=k, col=col: row(JPEG, JPEG_ROW + JPEG_ROWS[k], col))
        for k in JPEG_ROWS
        for col in ("img_per_s", "cpu_cores", "sm_util", "jpg_util")
    },
    **per_f(
        JPEG_ROWS,
        "jpeg_{}_share",
        lambda f, k: (
            100 * f[f"jpeg_{k}_img_per_s"] / f["jpeg_dg_img_per_s" if k in JPEG_GRAPHS else "jpeg_dm_img_per_s"]
        ),
    ),
    **per_f(JPEG_ROWS, "jpeg_{}_x", lambda f, k: f[f"jpeg_{k}_img_per_s"] / f["jpeg_ex_img_per_s"]),
    "jpeg_tg_gap": lambda f: 100 - f["jpeg_tg_share"],
    # the GIL switch interval and CUDA graphs with 32 queues, imagenet/train.py rows on another H200 host
    **{
        f"sw_{k}": (lambda f, name=name: final(SW)[name])
        for k, name in (
            ("5", "--gpu-decode, switch interval 5 ms (default)"),
            ("1", "--gpu-decode, switch interval 1 ms"),
            ("01", "--gpu-decode, switch interval 0.1 ms"),
            ("g32", "--gpu-decode + CUDA graphs, 32 hardware queues"),
            ("dm", "--dummy"),
        )
    },
    # --gpu-decode and --dummy (CUDA graphs) on 1 and 2 GPUs of one host (bench/reproduce.sh jpeg-scaling)
    **{
        f"js_{k}_{n}": (lambda f, name=name, n=n: median(f"jpeg_{name}_{n}xh200.jsonl", "img_per_s"))
        for k, name in (("tv", "gpu_decode"), ("dm", "dummy"))
        for n in (1, 2)
    },
    **per_f(("tv", "dm"), "js_{}_eff", lambda f, k: eff(f, f"js_{k}_2", f"js_{k}_1", 2)),
    **per_f((1, 2), "js_share_{}", lambda f, n: 100 * f[f"js_tv_{n}"] / f[f"js_dm_{n}"]),
    "js_tv_2_min": lambda f: min(windows("jpeg_gpu_decode_2xh200.jsonl", "img_per_s")),
    "js_tv_2_max": lambda f: max(windows("jpeg_gpu_decode_2xh200.jsonl", "img_per_s")),
    "js_dm_2_min": lambda f: min(windows("jpeg_dummy_2xh200.jsonl", "img_per_s")),
    "js_dm_loss": lambda f: 100 - f["js_dm_eff"],
    # the same medians without the slow windows the text names: steps 50 and 90 end the first windows of later epochs
    # (90 on 1 GPU)
    "js_tv_steady_1": lambda f: median("jpeg_gpu_decode_1xh200.jsonl", "img_per_s", drop=(90,)),
    "js_tv_steady_2": lambda f: median("jpeg_gpu_decode_2xh200.jsonl", "img_per_s", drop=(50, 90)),
    "js_tv_steady_eff": lambda f: eff(f, "js_tv_steady_2", "js_tv_steady_1", 2),
    # imagenet/train.py profiled with CUDA graphs (docs/runs/jpeg_profile_window.py), --dummy then --gpu-decode
    **{
        f"pw_{k}_{what}": (lambda f, k=k, what=what: profiled(PW, f"trace_{k}_1gpu_rank0.json.gz", what))
        for k in ("dummy", "tv")
        for what in ("wall", "busy", "idle")
    },
    "pw_tv_host": lambda f: grab(PW, r"(?s)trace_tv_1gpu.*idle gaps > 0\.1 ms: [^\n]*host ([\d.]+) ms/step"),
    "pw_tv_device": lambda f: grab(PW, r"(?s)trace_tv_1gpu.*idle gaps > 0\.1 ms: [^\n]*device ([\d.]+) ms/step"),
    "pw_tv_crops": lambda f: grab(PW, r"(?s)trace_tv_1gpu.*?stream 13: ([\d.]+) ms/step"),
    "pw_slower": lambda f: f["pw_tv_busy"] - f["pw_dummy_busy"],
    "pw_extra": lambda f: f["pw_tv_wall"] - f["pw_dummy_wall"],
    "pw_extra_pct": lambda f: 100 * f["pw_extra"] / f["pw_tv_wall"],
    # the first ten steps of the second epoch, profiled: the host's wait for the epoch's first batch, then the steps
    "es_first_wait": lambda f: per_step(ES, "batch wait")[80],
    "es_next_wait": lambda f: max(per_step(ES, "batch wait")[81:90]),
    **{
        f"es_{what}": (lambda f, what=what: profiled(ES, "trace_tv_epoch1_rank0.json.gz", what))
        for what in ("wall", "busy")
    },
    # foreach against fused SGD, and a 1 ms GIL switch interval: 160 steps each, median of the steady windows
    **{
        f"sgd_{k}": (lambda f, run=run: grab(SGD, rf"/tmp/{run} windows [^\n]* median of steady windows (\d+)"))
        for k, run in (
            ("dm_foreach", "d_foreach"),
            ("dm_fused", "d_fused"),
            ("tv_foreach", "t_foreach"),
            ("tv_fused", "t_fused"),
            ("tv_sw1", "t_fsw"),
        )
    },
    # each decoder's pixel check rides on its CUDA-graphs row
    "px_tv": lambda f: row(JPEG, JPEG_ROW + JPEG_ROWS["tg"], "pixel_check")["max_mad_vs_pillow"],
    "px_nv": lambda f: row(JPEG, JPEG_ROW + JPEG_ROWS["ng"], "pixel_check")["max_mad_vs_pillow"],
    **{
        f"br_tv_{k.replace('-', '_')}_{u.split()[0].lower()}": (lambda f, k=k, u=u: final(BR)[f"{CROPS}, {k}: {u}"])
        for k in ("batched", "per-image")
        for u in ("GPU ms", "host ms")
    },
    "br_diff": lambda f: final(BR)["torchvision: batched vs per-image, max abs diff"],
    "br_resident": lambda f: final(BR)["resident ms"],
    "br_tv_stream": lambda f: final(BR)["torchvision: kernel ms/step by stream, batched"]["7"],
    "br_tv_other": lambda f: (
        sum(final(BR)["torchvision: kernel ms/step by stream, batched"].values()) - f["br_tv_stream"]
    ),
    "br_tv_other_share": lambda f: 100 * f["br_tv_other"] / f["br_resident"],
    # fed step with 8 or 32 hardware queues (medians of three repetitions), and the profiled window (8 queues)
    **{
        f"bc{q}_{k}_{t}": (lambda f, q=q, d=d, t=t: final(BC, q == 32)[f"{d}: fed ms/step, {t} thread(s)"]["median"])
        for q in (8, 32)
        for k, d in (("tv", "torchvision"), ("nv", "nvimgcodec"))
        for t in (1, 2)
    },
    "bc8_resident": lambda f: final(BC)["resident ms"]["median"],
    "bt8_tv_wait": lambda f: final(BT)["torchvision: profiled window"]["wait ms (median, max, n)"][0],
    "bt8_tv_idle": lambda f: 100 - 100 * final(BT)["torchvision: profiled window"]["training stream busy fraction"],
    # one GpuTransform call (per-image crops then) on an idle GPU and behind 180 queued matmuls
    "hq8_tv_idle": lambda f: final(HWQ)["torchvision: transform host ms, idle, matmuls on default"],
    "hq8_tv_busy": lambda f: final(HWQ)["torchvision: transform host ms, busy, matmuls on default"],
    "hq32_tv_busy": lambda f: final(HWQ, True)["torchvision: transform host ms, busy, matmuls on default"],
    # Transformer, packed rows
    "tr_loop": lambda f: row(TRN, "baseline loop, base, pad 350, fp32, batch 8", "tok_per_s"),
    "tr_c1": lambda f: row(TRN, TR_SCRIPT, "tok_per_s"),
    "tr_c1_mfu": lambda f: 100 * row(TRN, TR_SCRIPT, "mfu"),
    "tr_bare": lambda f: row(TRN, PK_STEP + "model and loss compiled together", "tok_per_s"),
    "tr_bare_mfu": lambda f: 100 * row(TRN, PK_STEP + "model and loss compiled together", "mfu"),
    "tr_bare_first": lambda f: row(TRN, PK_STEP + "model and loss compiled together", "first_step_s"),
    "tr_fill": lambda f: grab(TR_LOG, r"on 232000 pairs [^\n]*per step, ([\d.]+)% of them real"),
    "tr_spe": lambda f: grab(TR_LOG, r"on 232000 pairs [^\n]* ([\d.]+) steps/epoch"),
    "tr_bare_fill": lambda f: 100 * 63775 / 65536,
    "tr_c1_x": lambda f: f["tr_c1"] / f["tr_loop"],
    "tr_whole": lambda f: row(PK, PK_STEP + "model and loss compiled together", "tok_per_s"),
    "tr_whole_mfu": lambda f: 100 * row(PK, PK_STEP + "model and loss compiled together", "mfu"),
    "tr_whole_first": lambda f: row(PK, PK_STEP + "model and loss compiled together", "first_step_s"),
    "tr_layer": lambda f: row(PK, PK_STEP + "each layer and the loss compiled apart", "tok_per_s"),
    "tr_layer_mfu": lambda f: 100 * row(PK, PK_STEP + "each layer and the loss compiled apart", "mfu"),
    "tr_layer_first": lambda f: row(PK, PK_STEP + "each layer and the loss compiled apart", "first_step_s"),
    "tr_pad": lambda f: row(PK, f"{PROFILE}, compile, model and loss compiled together", "tok_per_s"),
    "tr_pad_mfu": lambda f: 100 * row(PK, f"{PROFILE}, compile, model and loss compiled together", "mfu"),
    "tr_c1_share": lambda f: 100 * f["tr_c1"] / f["tr_bare"],
    # Transformer small, packed rows, CUDA graphs; the padded eager script before packing as the baseline
    "sm_pad": lambda f: row(SM_UNPACKED, SM_SCRIPT, "tok_per_s"),
    "sm_pad_mfu": lambda f: 100 * row(SM_UNPACKED, SM_SCRIPT, "mfu"),
    "sm_loop": lambda f: row(TRS, "baseline loop, small, pad 350, fp32, batch 8", "tok_per_s"),
    "sm_c": lambda f: row(TRS, SM_SCRIPT + ", compile", "tok_per_s"),
    "sm_c_mfu": lambda f: 100 * row(TRS, SM_SCRIPT + ", compile", "mfu"),
    "sm_g": lambda f: row(TRS, SM_SCRIPT + ", compile, CUDA graphs", "tok_per_s"),
    "sm_g_mfu": lambda f: 100 * row(TRS, SM_SCRIPT + ", compile, CUDA graphs", "mfu"),
    "sm_bare": lambda f: row(TRS, SM_BARE + "CUDA graphs", "tok_per_s"),
    "sm_bare_mfu": lambda f: 100 * row(TRS, SM_BARE + "CUDA graphs", "mfu"),
    "sm_bare_first": lambda f: row(TRS, SM_BARE + "CUDA graphs", "first_step_s"),
    "sm_bare_ms": lambda f: 1e3 * 8080 / f["sm_bare"],
    "sm_c_x": lambda f: f["sm_c"] / f["sm_pad"],
    "sm_g_x": lambda f: f["sm_g"] / f["sm_pad"],
    "sm_g_c": lambda f: f["sm_g"] / f["sm_c"],
    "sm_g_share": lambda f: 100 * f["sm_g"] / f["sm_bare"],
    "sm_fill": lambda f: grab(TR_LOG, r"small \(19.9M params\) on 29000 pairs [^\n]*per step, ([\d.]+)% of them real"),
    # Transformer base weak scaling on Multi30k x 8 (bench/reproduce.sh scaling): the logs of whichever GPU type ran it
    **per((1, 2), "m8_{}", lambda n: median(f"tr_base_m8_compile_{n}x{M8_HW}.jsonl", "tok_per_s")),
    "m8_2_eff": lambda f: eff(f, "m8_2", "m8_1", 2),
    # CIFAR-10 recipes (console_cifar_recipes_h200.log): fast and full ResNet-18, full ResNet-50
    **per(range(3), "fast_{}", lambda s: last_val(f"cifar_r18_fast_seed{s}_1xh200.jsonl", "acc1")),
    **per(range(3), "fast_{}_s", lambda s: timing(f"cifar_r18_fast_seed{s}_1xh200.jsonl", "wall")),
    **per(range(3), "fast_{}_train", lambda s: timing(f"cifar_r18_fast_seed{s}_1xh200.jsonl", "train")),
    **per(range(3), "fastng_{}", lambda s: last_val(f"cifar_r18_fast_nographs_seed{s}_1xh200.jsonl", "acc1")),
    **per(range(3), "fastng_{}_s", lambda s: timing(f"cifar_r18_fast_nographs_seed{s}_1xh200.jsonl", "wall")),
    **per(range(3), "fastng_{}_train", lambda s: timing(f"cifar_r18_fast_nographs_seed{s}_1xh200.jsonl", "train")),
    "fast_mean": lambda f: statistics.mean(f[f"fast_{s}"] for s in range(3)),
    "fast_std": lambda f: statistics.stdev(f[f"fast_{s}"] for s in range(3)),
    **per(CIFAR_PARTS, "fast0_{}", lambda k: timing("cifar_r18_fast_seed0_1xh200.jsonl", k)),
    # the paper's CIFAR ResNets with the fast recipe (bench/reproduce.sh cifar-paper, console_cifar_paper_h200.log)
    **per(range(3), "r20_{}", lambda s: last_val(f"cifar_r20_fast_seed{s}_1xh200.jsonl", "acc1")),
    **per(range(3), "r20_{}_s", lambda s: timing(f"cifar_r20_fast_seed{s}_1xh200.jsonl", "wall")),
    **per(range(3), "r56_{}", lambda s: last_val(f"cifar_r56_fast_seed{s}_1xh200.jsonl", "acc1")),
    **per(range(3), "r56_{}_s", lambda s: timing(f"cifar_r56_fast_seed{s}_1xh200.jsonl", "wall")),
    "r20_mean": lambda f: statistics.mean(f[f"r20_{s}"] for s in range(3)),
    "r20_std": lambda f: statistics.stdev(f[f"r20_{s}"] for s in range(3)),
    "r56_mean": lambda f: statistics.mean(f[f"r56_{s}"] for s in range(3)),
    "r56_std": lambda f: statistics.stdev(f[f"r56_{s}"] for s in range(3)),
    **per(CIFAR_FULL18, "full18_{}", lambda n: last_val(f"cifar_r18_full_{n}_1xh200.jsonl", "acc1")),
    **per(CIFAR_FULL18, "full18_{}_s", lambda n: timing(f"cifar_r18_full_{n}_1xh200.jsonl", "wall")),
    **per(CIFAR_FULL18, "full18_{}_train", lambda n: timing(f"cifar_r18_full_{n}_1xh200.jsonl", "train")),
    **per(CIFAR_FULL18, "full18_{}_data", lambda n: timing(f"cifar_r18_full_{n}_1xh200.jsonl", "data")),
    **per(CIFAR_FULL18, "full18_{}_compile", lambda n: timing(f"cifar_r18_full_{n}_1xh200.jsonl", "compile")),
    "full18_mean": lambda f: statistics.mean(f[f"full18_{n}"] for n in CIFAR_FULL18),
    "full18_std": lambda f: statistics.stdev(f[f"full18_{n}"] for n in CIFAR_FULL18),
    **per((0, 1), "full18ng_{}", lambda s: last_val(f"cifar_r18_full_nographs_seed{s}_1xh200.jsonl", "acc1")),
    **per(range(3), "r50a_{}", lambda s: last_val(f"cifar_r50_full_e100_nographs_seed{s}_1xh200.jsonl", "acc1")),
    **per(range(3), "r50a_{}_s", lambda s: timing(f"cifar_r50_full_e100_nographs_seed{s}_1xh200.jsonl", "wall")),
    "r50a_mean": lambda f: statistics.mean(f[f"r50a_{s}"] for s in range(3)),
    "r50a_std": lambda f: statistics.stdev(f[f"r50a_{s}"] for s in range(3)),
    **per(range(3), "r50_{}", lambda s: last_val(f"cifar_r50_full_seed{s}_1xh200.jsonl", "acc1")),
    **per(range(3), "r50_{}_s", lambda s: timing(f"cifar_r50_full_seed{s}_1xh200.jsonl", "wall")),
    "r50_train": lambda f: span(timing(f"cifar_r50_full_seed{s}_1xh200.jsonl", "train") for s in range(3)),
    "r50_compile": lambda f: span(timing(f"cifar_r50_full_seed{s}_1xh200.jsonl", "compile") for s in range(3)),
    "r50_wall": lambda f: span(timing(f"cifar_r50_full_seed{s}_1xh200.jsonl", "wall") for s in range(3)),
    "r50_data": lambda f: span(timing(f"cifar_r50_full_seed{s}_1xh200.jsonl", "data") for s in range(3)),
    "r50_ckpt": lambda f: span(timing(f"cifar_r50_full_seed{s}_1xh200.jsonl", "checkpoint") for s in range(3)),
    "r50_mean": lambda f: statistics.mean(f[f"r50_{s}"] for s in range(3)),
    "r50_std": lambda f: statistics.stdev(f[f"r50_{s}"] for s in range(3)),
    **per(range(3), "r50x2_{}", lambda s: last_val(f"cifar_r50_full_seed{s}_2xh200.jsonl", "acc1")),
    **per(range(3), "r50x2_{}_s", lambda s: timing(f"cifar_r50_full_seed{s}_2xh200.jsonl", "wall")),
    "r50x2_mean": lambda f: statistics.mean(f[f"r50x2_{s}"] for s in range(3)),
    "r50x2_std": lambda f: statistics.stdev(f[f"r50x2_{s}"] for s in range(3)),
    "r50x2_train": lambda f: span(timing(f"cifar_r50_full_seed{s}_2xh200.jsonl", "train") for s in range(3)),
    "r50x2_ips": lambda f: statistics.median(
        median(f"cifar_r50_full_seed{s}_2xh200.jsonl", "img_per_s", 1) for s in range(3)
    ),
    "r50_ips": lambda f: statistics.median(
        median(f"cifar_r50_full_seed{s}_1xh200.jsonl", "img_per_s", 1) for s in range(3)
    ),
    "r50x2_diff": lambda f: f["r50x2_mean"] - f["r50_mean"],
    "r50x2_speedup": lambda f: f["r50x2_ips"] / f["r50_ips"],
    # CIFAR-10: the script against a bare loop of the same model (bench/benchmark.py --only cifar), same GPU
    **per(CIFAR_BENCH, "cb_{}", lambda k: row(CB, CIFAR_BENCH[k], "img_per_s")),
    "cb_script_pct": lambda f: 100 * f["cb_script"] / f["cb_bare"],
    "cb_graphs_pct": lambda f: 100 * f["cb_graphs"] / f["cb_bare"],
    "cb_loader_pct": lambda f: 100 * f["cb_loader"] / f["cb_bare"],
    "cb_bare_ms": lambda f: 1e3 * 512 / f["cb_bare"],
    "cb_script_ms": lambda f: 1e3 * 512 / f["cb_script"],
    "cb_graphs_ms": lambda f: 1e3 * 512 / f["cb_graphs"],
    "abl_gpu_ms": lambda f: grab(ABL, r"Self CUDA time total: ([\d.]+)ms") / 20,
    "abl_host_ms": lambda f: grab(ABL, r"host loop ([\d.]+) ms/step"),
    "tr_mask_eager": lambda f: row(PK, PK_STEP + "model and loss compiled together", "mask_ms_eager"),
    "tr_mask_comp": lambda f: row(PK, PK_STEP + "model and loss compiled together", "mask_ms_compiled"),
    "prof_wall": lambda f: grab(PK_PROF, r"^wall ([\d.]+) ms/step"),
    "prof_attn": lambda f: grab(PK_PROF, r"attention \(SDPA\): ([\d.]+) ms"),
    "prof_mm": lambda f: grab(PK_PROF, r"matmul: ([\d.]+) ms"),
    "prof_ew": lambda f: grab(PK_PROF, r"fused elementwise/norm \(Triton\): ([\d.]+) ms"),
    "prof_mm_peak": lambda f: 100 * 6 * 48.2e6 * 63775 / (f["prof_mm"] / 1e3) / 989e12,  # 6 x params x tokens
    **per(
        ("d04_t8k", "d04_t6k", "d03_t6k", "d03_t4k"),
        "bleu_{}",
        lambda k: best(f"tr_small_deen_bleu_packed_{k}_1xh100.jsonl", "bleu"),
    ),
    **per(
        ("d04_t8k", "d04_t6k", "d03_t6k", "d03_t4k"),
        "bleu60_{}",
        lambda k: val(f"tr_small_deen_bleu_packed_{k}_1xh100.jsonl", "bleu", 60),
    ),
    "bleu_d03_t8k": lambda f: best("multi30k_deen_small_packed_compile_1xh100.jsonl", "bleu"),
    "bleu60_d03_t8k": lambda f: val("multi30k_deen_small_packed_compile_1xh100.jsonl", "bleu", 60),
    "bleu_pad": lambda f: best("tr_small_deen_bleu_1xh100.jsonl", "bleu"),
    "bleu60_pad": lambda f: val("tr_small_deen_bleu_1xh100.jsonl", "bleu", 60),
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
    "ckpt_tr_s": lambda f: grab("tr_base_m8_trace_eager_4xh100.txt", r"([\d.]+) ms  boundary: save_checkpoint") / 1e3,
    # CIFAR-10 ResNet-18, the 80-epoch recipe
    **per(range(3), "c2_{}", lambda s: last_val(f"cifar_r18_e80_seed{s}_2xh100.jsonl", "acc1")),
    **per(range(3), "c2_{}_s", lambda s: since_start(Q100, f"/tmp/c2_seed{s} ")),
    **per(range(3), "c2_{}_ips", lambda s: median(f"cifar_r18_e80_seed{s}_2xh100.jsonl", "img_per_s", 0)),
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
    # Multi30k BLEU (small preset, greedy, 1,014 validation sentences)
    "deen_20": lambda f: val(BLEU1, "bleu", 20),
    "deen_60": lambda f: val(BLEU1, "bleu", 60),
    "deen_best": lambda f: best(BLEU1, "bleu"),
    "ende_40": lambda f: val("tr_small_ende_bleu_1xh200.jsonl", "bleu", 40),
    "ende_s": lambda f: grab(Q200, r"best val BLEU [\d.]+, wall ([\d.]+)s"),
}

M8_HW = next((hw for hw in ("h100", "h200") if (RUNS / f"tr_base_m8_compile_2x{hw}.jsonl").is_file()), "")
M8_HOST = {
    "h100": H100,
    "h200": "H200 (a 4-GPU host, 64 CPU cores; its fourth GPU trained a CIFAR-10 ResNet-50 meanwhile), torch 2.11, CUDA 13.0",
}.get(M8_HW, "")
TR_SCALING = (
    """\
Hardware: {M8_HOST}. Command: `bash bench/reproduce.sh scaling --gpus 2`, which builds Multi30k × 8 (232,000 pairs)
and runs `{M8_CMD} --compile` on 1 GPU and, under `torchrun --standalone --nproc_per_node=2`, on 2 others at the same
time: 65,536 tokens per GPU per step. Target tokens/s is the median of the logged 10-step windows after the first
two (compilation).

| GPUs | target tokens/s (all GPUs) | per-GPU efficiency | log |
|---|---|---|---|
| 1 | {m8_1:,.0f} | — | [[tr_base_m8_compile_1x{M8_HW}.jsonl]] |
| 2 | {m8_2:,.0f} | **{m8_2_eff:.1f}%** | [[tr_base_m8_compile_2x{M8_HW}.jsonl]] |
"""
    if M8_HW
    else """\
`bash bench/reproduce.sh scaling --gpus 2` measures it: Multi30k × 8 (232,000 pairs), `{M8_CMD} --compile` on 1 GPU
and, under `torchrun --standalone --nproc_per_node=2`, on 2 others at the same time (65,536 tokens per GPU per step).
Its logs, `tr_base_m8_compile_{{1,2}}xGPU.jsonl`, fill this table once they are in docs/runs; none is yet.
"""
)

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
| CIFAR-10 ResNet-18, fast recipe (80 epochs), 5,000 held-out JPEGs | `cifar_resnet/train.py --gpu-data --compile --compile-mode reduce-overhead -b 512 --lr 0.4 --tta --epochs 80` | 1× H200 | {fast_0_s:.0f}–{fast_2_s:.0f} s | val top-1 **{fast_mean:.2f} ± {fast_std:.2f}%** (3 seeds) |
| CIFAR-10 ResNet-18, full recipe (200 epochs, random erasing, weight EMA) | the same with `--epochs 200 --random-erasing 0.5 --ema 0.999` | 1× H200 | {full18_seed2_s:.0f}–{full18_seed1_s:.0f} s | val top-1 **{full18_mean:.2f} ± {full18_std:.2f}%** (3 seeds) |
| CIFAR-10 ResNet-50, full recipe (200 epochs) | the same with `-a resnet50 --eval-every 10` | 1× H200 | {r50_wall} s, cold caches | val top-1 **{r50_mean:.2f} ± {r50_std:.2f}%** (3 seeds); on 2 GPUs, global batch 512: {r50x2_mean:.2f} ± {r50x2_std:.2f}% (3 seeds) |
| the fast recipe without `--compile-mode`, global batch 512 | `torchrun --nproc_per_node=2 ... -b 256` | 2× H100 | {c2_2_s:.0f}–{c2_0_s:.0f} s | val top-1 **{c2_mean:.2f} ± {c2_std:.2f}%** (3 seeds) |
| the same, global batch 512 | `torchrun --nproc_per_node=4 ... -b 128` | 4× H100 | {c4_s:.0f} s | val top-1 {c4:.2f}% (1 seed) |
| `imagenet/train.py` on the CIFAR JPEGs as an ImageFolder, 64 px | `imagenet/train.py DIR -a resnet18 --recipe modern --epochs 10 ...` | 1× H200 | {if_s:.0f} s | val top-1 {if_acc:.2f}% (1 seed) |
| Multi30k de→en, `small` | `transformer/train.py --preset small --max-tokens 8192 --lr 1e-3 --epochs 60` | 1× H100 | — | sacreBLEU {deen_20:.1f} at epoch 20, best {deen_best:.1f} (greedy, 1 seed) |
| Multi30k en→de, `small` | the same, `--lang-src en --lang-tgt de --epochs 40` | 1× H200 | {ende_s:.0f} s | sacreBLEU {ende_40:.1f} at epoch 40 (greedy, 1 seed) |

Headline speed (each against a baseline measured in the same run where one is named):
- **ResNet-50 weak scaling**, batch 256 per GPU, bf16 + channels_last: {rn50_e2_eff:.1f}% per GPU on 2 H100s and
  {rn50_e4_eff:.1f}% on 4 (eager); {rn50_c4_eff:.1f}% on 4 with `--compile` ({rn50_c4:,.0f} img/s). On one H200 in fp32
  the script runs at {rn50_fp32_ratio:.0f}% of a bare training step ({rn50_fp32_script:,.0f} img/s).
- **Real JPEGs**, ImageNet-sized, one H200: `--gpu-decode` with CUDA graphs trains ResNet-50 at
  **{jpeg_tg_img_per_s:,.0f} img/s** ({jpeg_tg_share:.0f}% of `--dummy`), {jpeg_tg_x:.1f}× the pytorch/examples configuration on
  the same files; on 2 GPUs {js_tv_eff:.0f}% per GPU (`--dummy`: {js_dm_eff:.0f}%).
- **CIFAR-10**, one H100: `--gpu-data` reaches {cg_20:.1f}% in {cg_s:.1f} s (20 epochs), the DataLoader path
  {cl_20:.1f}% in {cl_s:.1f} s.
- **Transformer `base`**, one H100, packed rows: `--compile` trains at {tr_c1:,.0f} target tokens/s
  ({tr_c1_mfu:.1f}% MFU, {tr_c1_share:.0f}% of a bare training step), **{tr_c1_x:.0f}×** a tutorial-style padded fp32
  loop in the same run; `small` with CUDA graphs at {sm_g:,.0f} ({sm_g_x:.1f}× its padded eager script).
  Weak scaling of `base --compile`: {m8_2_eff:.1f}% per GPU on 2 H200s.
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
Hardware: {H200}. Command: `python3 bench/benchmark.py --only jpeg --no-jpeg-profile --out /tmp/jb`, which writes
20,480 + 512 ImageNet-sized JPEGs (500×375, quality 90, texture at six scales, 100 KB on average) and trains one
epoch of ResNet-50 (80 steps of 256, bf16, channels_last, `--compile`) with each data path, one after the other in
the same run. img/s is the median of the 10-step windows after the first two; the exact command of each row is in
[[{JPEG}]] (console [[jpeg_decode_paths_1xh200.log]]). The share of a CUDA-graphs row is of `--dummy` with CUDA
graphs, the others' of `--dummy` without. CPU cores busy is the processes' CPU time over wall time; SM and JPEG-engine use are NVML's, sampled
during the run.

| data path | img/s | of `--dummy` | CPU cores busy | SM busy | JPEG engines busy |
|---|---|---|---|---|---|
| `--dummy` (no data path), CUDA graphs (`--compile-mode reduce-overhead`): the ceiling | {jpeg_dg_img_per_s:,.0f} | 100% | {jpeg_dg_cpu_cores:.1f} | {jpeg_dg_sm_util:.0f}% | — |
| **`--gpu-decode`** (torchvision `decode_jpeg(device="cuda")`, the default), `-j 8`, CUDA graphs | **{jpeg_tg_img_per_s:,.0f}** | **{jpeg_tg_share:.1f}%** | {jpeg_tg_cpu_cores:.1f} | {jpeg_tg_sm_util:.0f}% | {jpeg_tg_jpg_util:.0f}% |
| `--gpu-decode --gpu-decoder nvimgcodec` (hardware decoders), CUDA graphs | {jpeg_ng_img_per_s:,.0f} | {jpeg_ng_share:.0f}% | {jpeg_ng_cpu_cores:.1f} | {jpeg_ng_sm_util:.0f}% | {jpeg_ng_jpg_util:.0f}% |
| `--gpu-decode`, CUDA graphs, with CUDA's default 8 hardware queues (`CUDA_DEVICE_MAX_CONNECTIONS=8`) | {jpeg_t8_img_per_s:,.0f} | {jpeg_t8_share:.0f}% | {jpeg_t8_cpu_cores:.1f} | {jpeg_t8_sm_util:.0f}% | {jpeg_t8_jpg_util:.0f}% |
| `--dummy`, without CUDA graphs | {jpeg_dm_img_per_s:,.0f} | 100% | {jpeg_dm_cpu_cores:.1f} | {jpeg_dm_sm_util:.0f}% | — |
| `--gpu-decode`, without CUDA graphs | {jpeg_tv_img_per_s:,.0f} | {jpeg_tv_share:.1f}% | {jpeg_tv_cpu_cores:.1f} | {jpeg_tv_sm_util:.0f}% | {jpeg_tv_jpg_util:.0f}% |
| Pillow DataLoader, 16 workers, without CUDA graphs | {jpeg_pl_img_per_s:,.0f} | {jpeg_pl_share:.0f}% | {jpeg_pl_cpu_cores:.1f} | {jpeg_pl_sm_util:.0f}% | — |
| pytorch/examples `main.py` configuration: Pillow on 16 workers, fp32, eager: the user's baseline | {jpeg_ex_img_per_s:,.0f} | {jpeg_ex_share:.0f}% | {jpeg_ex_cpu_cores:.1f} | {jpeg_ex_sm_util:.0f}% | — |

`--gpu-decode` with CUDA graphs is {jpeg_tg_x:.2f}× the pytorch/examples configuration on the same files; `--dummy`
itself is {jpeg_dg_x:.2f}× it, the most any data path can reach on this GPU. Both decoders' pixels match Pillow's
(largest mean absolute difference over 36 files: torchvision {px_tv:.1f} levels, nvImageCodec {px_nv:.2f}).

**32 hardware queues.** CUDA runs the streams of a process on 8 hardware queues by default, so the decode's side
stream shares one with the training stream, and work queued there holds it up: one `GpuTransform` call took
{hq8_tv_busy:.0f} ms behind 180 queued matmuls instead of {hq8_tv_idle:.0f} ms on an idle GPU, and {hq32_tv_busy:.0f} ms with
`CUDA_DEVICE_MAX_CONNECTIONS=32` ([[jpeg_decode_hwqueues_4xh200host.log]]). A CUDA graph replay is one long piece
of queued work: with 8 queues, `--gpu-decode` with CUDA graphs reaches only {jpeg_t8_share:.0f}% of `--dummy` (the table's
8-queue row), against {jpeg_tg_share:.0f}% with 32.
`imagenet/train.py --gpu-decode` therefore sets `CUDA_DEVICE_MAX_CONNECTIONS=32` before CUDA starts, unless the
variable is already set. On another H200 host ([[jpeg_switch_interval_1xh200.log]], script
[[jpeg_switch_interval.py]]), graphs with 32 queues gave {sw_g32:,.0f} img/s against {sw_dm:,.0f} for `--dummy` without graphs.

**The crops.** `GpuTransform` crops, resizes (antialiased bilinear), flips and normalizes a whole batch in one
Triton kernel (`imagenet/crop_resize.py`). In-process on the same kind of GPU ([[jpeg_batched_resize_1xh200.log]],
script [[jpeg_batched_resize.py]]), that stage takes {br_tv_batched_gpu:.1f} ms of GPU time and {br_tv_batched_host:.1f} ms of host
time per batch of 256 decoded images, against {br_tv_per_image_gpu:.1f} and {br_tv_per_image_host:.1f} ms for torch's resize called per
image (two or three kernels each), with outputs equal within {br_diff:.0e} (the fed step's top kernels:
[[jpeg_batched_resize_profile_torchvision_1xh200.txt]], [[jpeg_batched_resize_profile_nvimgcodec_1xh200.txt]]). While it trains on fed batches, the
training stream runs {br_tv_stream:.1f} ms of kernels per step, as on a resident batch ({br_resident:.1f} ms wall).

**Where the remaining {jpeg_tg_gap:.0f}% goes.** [[jpeg_profile_window.py]] runs `imagenet/train.py` unchanged under
torch.profiler for steps 40–49 of a one-epoch run with CUDA graphs, once with `--dummy` and once with `--gpu-decode`
(one H200 of a host with 2 H200s and 32 CPU cores; [[jpeg_profile_window_1xh200.log]], read by
[[jpeg_profile_window_gaps.py]]). A step takes {pw_dummy_wall:.2f} ms with `--dummy`, of which the training stream is
busy for {pw_dummy_busy:.2f}, and {pw_tv_wall:.2f} ms with `--gpu-decode`, busy for {pw_tv_busy:.2f}: the training kernels run only
{pw_slower:.2f} ms slower beside the data path's kernels ({pw_tv_crops:.2f} ms per step of crops on the side stream, and
nvJPEG's per-image copies and colour conversions on streams of its own), so nearly all of the {pw_extra:.1f} ms ({pw_extra_pct:.0f}% of the
step) is the training stream waiting. In idle gaps over 0.1 ms it waits {pw_tv_host:.2f} ms per step for the host (between graph
replays the main thread launches the optimizer's kernels, and they start late while the decode thread makes about
1,000 CUDA calls per step, a quarter of them waits on events) and {pw_tv_device:.2f} ms for the batch's event. Fewer
launches do not help: fused SGD (one kernel per parameter group) gave {sgd_tv_fused:,.0f} img/s against {sgd_tv_foreach:,.0f} with the
default foreach SGD, and fused SGD with a 1 ms GIL switch interval {sgd_tv_sw1:,.0f} (`--dummy`: {sgd_dm_foreach:,.0f} foreach,
{sgd_dm_fused:,.0f} fused; 160 steps each, [[jpeg_sgd_fused_1xh200.log]]). Without graphs the host launches every kernel,
and the training stream also waits for the Python threads that launch them ([[jpeg_batched_timeline_gaps_1xh200.log]],
script [[jpeg_batched_timeline_gaps.py]]), while the loop waits only {bt8_tv_wait:.1f} ms (median) for each batch
([[jpeg_batched_timeline_1xh200.log]], script [[jpeg_batched_timeline.py]]).
Many of the longest gaps last 5–7 ms, about CPython's 5 ms GIL switch interval, but a shorter interval did not help
reliably ({sw_5:,.0f} img/s at 5 ms, {sw_1:,.0f} at 1 ms, {sw_01:,.0f} at 0.1 ms, one run each, 8 queues;
[[jpeg_switch_interval_1xh200.log]]).

**Two GPUs.** `bash bench/reproduce.sh jpeg-scaling --gpus 2` on one host with 2 H200s and 32 CPU cores (torch
2.11, CUDA 13.0): both paths with CUDA graphs, `-j 8` per GPU, the same 20,480 JPEGs, 2 epochs on 1 GPU and 3 on 2
(160 and 120 steps per GPU), the median of the 10-step windows after the first two
([[console_jpeg_scaling_2xh200.log]]).

| data path | 1 GPU | 2 GPUs | per-GPU efficiency | logs |
|---|---|---|---|---|
| `--dummy` | {js_dm_1:,.0f} | {js_dm_2:,.0f} | {js_dm_eff:.1f}% | [[jpeg_dummy_1xh200.jsonl]], [[jpeg_dummy_2xh200.jsonl]] |
| `--gpu-decode` | {js_tv_1:,.0f} ({js_share_1:.0f}% of `--dummy`) | {js_tv_2:,.0f} ({js_share_2:.0f}%) | {js_tv_eff:.1f}% | [[jpeg_gpu_decode_1xh200.jsonl]], [[jpeg_gpu_decode_2xh200.jsonl]] |

`--dummy` itself loses {js_dm_loss:.0f}% per GPU on 2 GPUs with `--compile` (the last gradient bucket's all-reduce cannot
overlap the backward pass; see the weak-scaling table above). `--gpu-decode`'s 2-GPU windows range from
{js_tv_2_min:,.0f} to {js_tv_2_max:,.0f} img/s (`--dummy`'s lowest: {js_dm_2_min:,.0f}). The slow ones are the first window of the
second and third epochs (the timer restarts after the evaluation, so this is the training loader's workers and the
decode thread starting the epoch's first batches). Profiled on one GPU ([[jpeg_epoch_start_profile_1xh200.log]]), the
second epoch's first step waits {es_first_wait:.0f} ms for its batch while the DataLoader's workers start the epoch, the next nine
at most {es_next_wait:.0f} ms, and those nine train as in mid-epoch ({es_wall:.2f} ms per step under the profiler, the training stream
busy for {es_busy:.2f}). With 40 steps per epoch they weigh far more than in an ImageNet epoch (2,502 steps per GPU on 2 GPUs). Without
them (and without the 1-GPU run's first window of its second epoch), `--gpu-decode` gives {js_tv_steady_1:,.0f} img/s on 1 GPU
and {js_tv_steady_2:,.0f} on 2: {js_tv_steady_eff:.1f}% per GPU.

Each decode thread first makes its rank's GPU its CUDA device: a new thread's device is `cuda:0`, and leaving its
`torch.cuda.stream()` context made it current, which created a CUDA context on GPU 0 inside every other rank, with the
GIL held. On 2 GPUs that stopped rank 1 for about a second at the end of the first epoch while rank 0 waited for it in
the all-reduces (profile [[jpeg_stall_profile_2xh200.log]], every thread's stack [[jpeg_stall_stacks_2xh200.log]]);
`tests/test_gpu_decode.py` checks that a rank on `cuda:1` leaves no context on GPU 0.

**nvImageCodec** decodes on the JPEG engines, yet it is slower than torchvision's decode in every comparison: in
the table, and in-process without graphs ({bc8_nv_1:.1f} ms per fed step with one prefetch thread, {bc8_nv_2:.1f} with two, against
{bc8_tv_1:.1f} for torchvision; [[jpeg_batched_connections_1xh200.log]], script [[jpeg_batched_connections.py]]). Its
region-of-interest decode (only each crop's box) sent every image to the CPU decoder in an earlier test
([[jpeg_decode_overlap_variants_1xh100.log]]), so crops are decoded whole.
""",
    "cifar-recipes": """\
Each recipe runs `C="cifar_resnet/train.py --data-dir /tmp/c --val-split 5000 --gpu-data --compile -b 512 -j
16 --tta -p 1000"`: SGD with Nesterov momentum, lr 0.4 for the global batch of 512, weight decay 5e-4, label
smoothing 0.1, one warmup epoch then cosine; accuracy is the last evaluation (flip TTA, averaged weights where
`--ema` is on) on the 5,000 held-out training JPEGs; wall is the script's own, process start to end. Commands,
hosts and every run's console: [[console_cifar_recipes_h200.log]], and for ResNet-20 and ResNet-56
[[console_cifar_paper_h200.log]].

| recipe | command | hardware | seed: val top-1 (wall) | mean ± std |
|---|---|---|---|---|
| fast ResNet-18 | `python $C --lr 0.4 --epochs 80 --eval-every 10 --compile-mode reduce-overhead` | {H200} | 0: {fast_0:.2f} ({fast_0_s:.1f} s), 1: {fast_1:.2f} ({fast_1_s:.1f} s), 2: {fast_2:.2f} ({fast_2_s:.1f} s) ([[cifar_r18_fast_seed0_1xh200.log]], [[cifar_r18_fast_seed1_1xh200.log]], [[cifar_r18_fast_seed2_1xh200.log]]) | **{fast_mean:.2f} ± {fast_std:.2f}** |
| full ResNet-18 | `python $C --lr 0.4 --epochs 200 --random-erasing 0.5 --ema 0.999 --eval-every 20 --compile-mode reduce-overhead` | seed 2: {H200}; seeds 0 and 1: one H200 of a 4-GPU host (64 CPU cores) | 0: {full18_seed0:.2f} ({full18_seed0_s:.0f} s, the host's first run), 1: {full18_seed1:.2f} ({full18_seed1_s:.0f} s), 2: {full18_seed2:.2f} ({full18_seed2_s:.0f} s) ([[cifar_r18_full_seed0_1xh200.log]], [[cifar_r18_full_seed1_1xh200.log]], [[cifar_r18_full_seed2_1xh200.log]]) | **{full18_mean:.2f} ± {full18_std:.2f}** |
| fast ResNet-20 (He et al. 2016, 0.27M parameters) | `python $C -a resnet20 --lr 0.4 --epochs 80 --eval-every 10 --compile-mode reduce-overhead` | one H200 each of a 4-GPU host (64 CPU cores); seed 0 alone, seeds 1 and 2 beside two ResNet-56 runs | 0: {r20_0:.2f} ({r20_0_s:.1f} s, the host's first run), 1: {r20_1:.2f} ({r20_1_s:.1f} s), 2: {r20_2:.2f} ({r20_2_s:.1f} s) ([[cifar_r20_fast_seed0_1xh200.log]], [[cifar_r20_fast_seed1_1xh200.log]], [[cifar_r20_fast_seed2_1xh200.log]]) | **{r20_mean:.2f} ± {r20_std:.2f}** |
| fast ResNet-56 (0.85M parameters) | the same with `-a resnet56` | the same host; seeds 0 and 1 beside the ResNet-20 runs, each compiling from a cold cache, seed 2 alone | 0: {r56_0:.2f} ({r56_0_s:.0f} s), 1: {r56_1:.2f} ({r56_1_s:.0f} s), 2: {r56_2:.2f} ({r56_2_s:.0f} s) ([[cifar_r56_fast_seed0_1xh200.jsonl]], [[cifar_r56_fast_seed1_1xh200.jsonl]], [[cifar_r56_fast_seed2_1xh200.jsonl]]) | **{r56_mean:.2f} ± {r56_std:.2f}** |
| full ResNet-50 | `python $C -a resnet50 --lr 0.4 --epochs 200 --random-erasing 0.5 --ema 0.999 --eval-every 10 --compile-mode reduce-overhead` | one H200 each of a 4-GPU host (64 CPU cores), the three seeds at once | 0: {r50_0:.2f} ({r50_0_s:.0f} s), 1: {r50_1:.2f} ({r50_1_s:.0f} s), 2: {r50_2:.2f} ({r50_2_s:.0f} s) ([[cifar_r50_full_seed0_1xh200.log]], [[cifar_r50_full_seed1_1xh200.log]], [[cifar_r50_full_seed2_1xh200.log]]) | **{r50_mean:.2f} ± {r50_std:.2f}** |
| full ResNet-50 on 2 GPUs, global batch 512 | `torchrun --standalone --nproc_per_node=2 $C -a resnet50 --lr 0.4 --epochs 200 --random-erasing 0.5 --ema 0.999 --eval-every 10 --compile-mode reduce-overhead -b 256` | 2 H200s each, seed 0 on one 4-GPU host (64 CPU cores), seeds 1 and 2 at once on another | 0: {r50x2_0:.2f} ({r50x2_0_s:.0f} s), 1: {r50x2_1:.2f} ({r50x2_1_s:.0f} s), 2: {r50x2_2:.2f} ({r50x2_2_s:.0f} s) ([[cifar_r50_full_seed0_2xh200.log]], [[cifar_r50_full_seed1_2xh200.log]], [[cifar_r50_full_seed2_2xh200.log]]) | **{r50x2_mean:.2f} ± {r50x2_std:.2f}** ({r50x2_diff:+.2f} against 1 GPU) |
| full ResNet-50, 100 epochs, without `--compile-mode` | `python $C -a resnet50 --lr 0.4 --epochs 100 --random-erasing 0.5 --ema 0.999 --eval-every 10` | one H200 each of a 4-GPU host (64 CPU cores) | 0: {r50a_0:.2f} ({r50a_0_s:.0f} s), 1: {r50a_1:.2f} ({r50a_1_s:.0f} s), 2: {r50a_2:.2f} ({r50a_2_s:.0f} s) ([[cifar_r50_full_e100_nographs_seed0_1xh200.log]], [[cifar_r50_full_e100_nographs_seed1_1xh200.log]], [[cifar_r50_full_e100_nographs_seed2_1xh200.log]]) | {r50a_mean:.2f} ± {r50a_std:.2f} |

- **The paper's CIFAR ResNets** (`-a resnet20|32|44|56|110`, [cifar_resnet/model.py](cifar_resnet/model.py)) reach
  {r20_mean:.2f}% (ResNet-20) and {r56_mean:.2f}% (ResNet-56) with the fast recipe's 80 epochs. He et al. report
  91.25% and 93.03% on the real test set after 164 epochs (step decay, batch 128); the JPEG copy costs about
  2.5–3.5 points. The longer schedule of the full recipe was not run for them.
- **CUDA graphs change the speed, not the result.** The fast recipe without `--compile-mode` on another 4-GPU host
  gave the same three accuracies, {fastng_0:.2f}, {fastng_1:.2f} and {fastng_2:.2f}, in {fastng_0_s:.0f}–{fastng_2_s:.0f} s
  ([[cifar_r18_fast_nographs_seed0_1xh200.log]] and seeds 1, 2), and the full ResNet-18 recipe without it gave
  {full18ng_0:.2f} and {full18ng_1:.2f} for seeds 0 and 1 ([[cifar_r18_full_nographs_seed0_1xh200.log]],
  [[cifar_r18_full_nographs_seed1_1xh200.log]]).
- **Wall time of the fast recipe, seed 0:** start {fast0_start:.1f} s, data {fast0_data:.1f} s, compile
  {fast0_compile:.1f} s, train {fast0_train:.1f} s, eval {fast0_eval:.1f} s, checkpoint {fast0_checkpoint:.1f} s. The
  data and compile parts are those of a second run on the machine: the decode cache and torch.compile's cache were
  there. A first run adds the JPEG decode ({full18_seed0_data:.0f} s for full ResNet-18 seed 0, beside a 2-GPU
  run decoding on the same host) and a cold compile ({full18_seed0_compile:.0f} s there).
- **Full ResNet-50 fits 10 minutes from a cold start:** each of the three runs decoded the JPEGs
  ({r50_data} s) and compiled from an empty cache ({r50_compile} s), then trained for
  {r50_train} s at {r50_ips:,.0f} img/s; the rest is checkpoints ({r50_ckpt} s: three runs
  writing 200 checkpoints each to one disk) and evaluation. The 100-epoch schedule stops at {r50a_mean:.2f}%:
  ResNet-50 needs the longer one.
- **ResNet-50 on 2 GPUs** keeps the global batch (`-b 256` per GPU) and the accuracy ({r50x2_mean:.2f}% against
  {r50_mean:.2f}% on one GPU, 3 seeds each), with CUDA graphs under DDP. It is only {r50x2_speedup:.2f}× faster
  ({r50x2_ips:,.0f} img/s against {r50_ips:,.0f}, {r50x2_train} s of training; medians over the seeds): a step of 256 images of 32 px is too short to hide the
  gradient all-reduce, as for ResNet-18 in [Several GPUs](cifar_resnet/README.md#several-gpus).
""",
    "cifar-speed": """\
`python bench/benchmark.py --only cifar --cifar-archs resnet18 --cifar-dir /tmp/c` on {H200}: a bare loop of the
script's ResNet-18 (batch 512, bf16, channels_last, `torch.compile`, one fixed batch on the GPU, SGD, no logging),
then `cifar_resnet/train.py` for 3 epochs with the fast recipe's flags on each data path, median of its logged
windows ([[{CB}]], [[cifar_script_bare_1xh200.log]]).

| what | img/s | step | of the bare loop |
|---|---|---|---|
| bare loop | {cb_bare:,.0f} | {cb_bare_ms:.1f} ms | 100% |
| `train.py --gpu-data` | {cb_script:,.0f} | {cb_script_ms:.1f} ms | {cb_script_pct:.0f}% |
| `train.py --gpu-data --compile-mode reduce-overhead` (CUDA graphs) | **{cb_graphs:,.0f}** | {cb_graphs_ms:.1f} ms | **{cb_graphs_pct:.0f}%** |
| `train.py` DataLoader (Pillow decode and augmentation, 16 workers) | {cb_loader:,.0f} | — | {cb_loader_pct:.0f}% |

**Why CUDA graphs.** A ResNet-18 step on 32-px images is too short for the host to launch its kernels faster than
the GPU runs them. A `torch.profiler` trace of a step with the script's parts (its optimizer with two parameter
groups, label smoothing, LR schedule, loss sum and the GPU crop, flip and normalisation) holds {abl_gpu_ms:.1f} ms of
GPU kernels per step ([[{ABL}]]: the table's "Self CUDA time total" over 20 steps), less than either loop's step.
So every operation the script adds to the bare loop costs host time, and the ablation in that log, on a host
whose other three GPUs were training, moved by up to 20% between variants without a consistent pattern. Replaying the
compiled forward and backward as CUDA graphs takes the launches off the host: the script then runs faster than the
bare loop, which launches every kernel.
""",
    "startup": """\
`python bench/startup.py --reps 8` on the 2-core development machine (Python 3.11.7, torch 2.14.1, CPU only): each
script's `--help` (every import, the argument parser, the interpreter's exit) in fresh processes, the two modes
alternating; process CPU is user + system time, median of 8. "gc on" is the same script with its `gc` calls made
no-ops. The last column is one full collection right after the imports: what every later full collection of the
process spends on the objects the imports made.

| script | CPU, gc on | CPU, gc off during the imports, then frozen | less | a full collection after: on / frozen |
|---|---|---|---|---|
| `cifar_resnet/train.py` | {start_cifar_resnet_on:.2f} s | {start_cifar_resnet_off:.2f} s | {start_cifar_resnet_less:.0f}% | {start_cifar_resnet_gc_on:.0f} / {start_cifar_resnet_gc_off:.1f} ms |
| `imagenet/train.py` | {start_imagenet_on:.2f} s | {start_imagenet_off:.2f} s | {start_imagenet_less:.0f}% | {start_imagenet_gc_on:.0f} / {start_imagenet_gc_off:.1f} ms |
| `transformer/train.py` | {start_transformer_on:.2f} s | {start_transformer_off:.2f} s | {start_transformer_less:.0f}% | {start_transformer_gc_on:.0f} / {start_transformer_gc_off:.1f} ms |

Log: [[startup_gc_2core.json]] (the table as printed: [[startup_gc_2core.txt]]).
""",
    "chaos": """\
Random faults thrown at 2-process CPU runs (gloo) under torchrun, each followed by the same command again until the
run ends: `python3 bench/chaos.py SCRIPT --faults 50 --seed S --budget-s 450 --log LOG`, on 16 CPU cores of an
H200 host, torch 2.11, Python 3.12 (seed 0 of the three scripts at once, then seeds 1 to 3 of each, nine at once).
CIFAR (ResNet-20 on 40 JPEGs, 60 steps), imagenet (ResNet-18 on an ImageFolder of 64 JPEGs, 64 steps) and the
transformer (`--preset tiny`, 81 steps) load with a DataLoader worker per rank. A fault survived when no rank
outlived the job and nothing hung;
an ending is bit-identical when every tensor of `last.pt` (weights, optimizer, EMA, scheduler) and the position
equal the uninterrupted run's, and metrics.jsonl holds the same records, each step once.

| script | faults | SIGKILL of a rank | SIGKILL of rank 0 mid-write | SIGKILL of the agent | SIGTERM of the agent | SIGSTOP, SIGCONT of a rank | endings bit-identical | metrics.jsonl alike | logs |
|---|---|---|---|---|---|---|---|---|---|
{chaos_cifar}
{chaos_transformer}
{chaos_imagenet}
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
Hardware: 1, 2 or 4 × {H100}. This is the fast recipe without `--compile-mode reduce-overhead`.

| hardware | seed | val top-1 | wall | img/s (all GPUs) | log |
|---|---|---|---|---|---|
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
Hardware: {H100_16}. Command: `bash bench/reproduce.sh transformer`: two `bench/benchmark.py` runs, one after the
other on the same GPU: `base` on Multi30k × 8 (232,000 pairs, {tr_spe:.1f} steps an epoch at 65,536 tokens a step;
`--tr-steps 70`) and `small` on Multi30k (`--tr-steps 150`); results [[{TRN}]] and [[{TRS}]], console and each
script's output, metrics and config [[{TR_LOG}]]. Script rows are the median of their logged 10-step windows after
the first three. MFU = 6 × parameters (48.2M `base`, 19.9M `small`) × real target tokens/s ÷ 989 TFLOP/s (dense
bf16), attention left out.

| what | real target tokens/s | MFU | first step (compile) |
|---|---|---|---|
| baseline: the tutorial's loop, `base`, every sentence padded to 350 tokens, fp32, batch 8 | {tr_loop:,.0f} | — | — |
| `transformer/train.py --preset base --max-tokens 65536 --compile`, Multi30k × 8 | **{tr_c1:,.0f}** ({tr_c1_x:.0f}× the baseline, **{tr_c1_share:.1f}%** of the bare step) | {tr_c1_mfu:.1f}% | — |
| bare step `base`, 64 packed rows of 1,024 tokens, model and loss compiled whole (what `--compile` does) | {tr_bare:,.0f} | {tr_bare_mfu:.1f}% | {tr_bare_first:.0f} s |
| the same bare step, another run ([[{PK}]]) | {tr_whole:,.0f} | {tr_whole_mfu:.1f}% | {tr_whole_first:.0f} s |
| bare step, packed, each layer and the loss compiled apart (same run as the row above) | {tr_layer:,.0f} | {tr_layer_mfu:.1f}% | {tr_layer_first:.0f} s |
| bare step, 2,730 unpadded rows of 24 tokens, the best a padded batch can do (same run) | {tr_pad:,.0f} | {tr_pad_mfu:.1f}% | — |
| `transformer/train.py --preset small --max-tokens 8192`, eager, padded batches (before packing; another run, [[{SM_UNPACKED}]]) | {sm_pad:,.0f} | {sm_pad_mfu:.1f}% | — |
| the same, packed rows, `--compile`, Multi30k | {sm_c:,.0f} ({sm_c_x:.1f}× the padded eager script) | {sm_c_mfu:.1f}% | — |
| the same, `--compile --compile-mode reduce-overhead` (CUDA graphs) | **{sm_g:,.0f}** ({sm_g_x:.1f}× the padded eager script, {sm_g_share:.0f}% of the bare step) | {sm_g_mfu:.1f}% | — |
| bare step `small`, 8 packed rows of 1,024 tokens, model and loss compiled whole, CUDA graphs | {sm_bare:,.0f} | {sm_bare_mfu:.1f}% | {sm_bare_first:.0f} s |

**The script against the bare step.** Every step of a run is full: an epoch whose rows do not fill its last step
tops it up with the next epoch's first rows, and only the run's very last step gets empty rows. {tr_fill:.1f}% of the
script's positions hold real tokens, as in the bare step ({tr_bare_fill:.1f}%), and `small` on Multi30k itself
fills {sm_fill:.1f}%. Per step the script also does what the bare step leaves out: it takes a batch from the
DataLoader and copies it to the GPU, runs the loss compiled apart from the model, clips gradients and steps the LR.

**CUDA graphs for `small`.** A bare `small` step with CUDA graphs takes {sm_bare_ms:.1f} ms (8 rows of 1,024 tokens):
too short to hide the host's kernel launches, and compiled without graphs the script trains at {sm_c:,.0f} tokens/s.
Every packed batch has one shape, so `--compile-mode reduce-overhead` records the compiled forward and backward once
as CUDA graphs and replays them: {sm_g_c:.1f}× faster, with the same losses (within 1e-5, relative) at every logged
step. The optimizer, clipping and the loss stay outside the graphs, and its 10-step windows (about 0.1 s each) vary
more than the `base` ones.

The three block masks of a packed batch take {tr_mask_eager:.0f} ms to build eagerly and {tr_mask_comp:.2f} ms
compiled; `train.py` builds them compiled.

**Why the MFU is low.** A `torch.profiler` trace of the packed bare step ([[{PK_PROF}]]) gives per {prof_wall:.1f} ms
step: matmuls {prof_mm:.1f} ms ({prof_mm_peak:.0f}% of the GPU's peak already), FlexAttention {prof_attn:.1f} ms and
{prof_ew:.1f} ms of fused LayerNorm, dropout and residual work, which at width 512 is memory traffic of the same order
as the matmuls. Packing removed most of the attention time of 24-token rows; the elementwise work is what is left.
""",
    "tr-scaling": TR_SCALING,
    "tr-bleu": """\
sacreBLEU `nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0`, greedy decoding, detokenized and cased,
over all 1,014 validation sentences; one seed each.

| direction | hardware | command | BLEU | log |
|---|---|---|---|---|
| de→en | {H100_16} | `python3 {BLEU_CMD} --compile` | {deen_20:.2f} at epoch 20, {deen_60:.2f} at 60, best **{deen_best:.2f}** | [[{BLEU1}]] |
| en→de | {H200} | the same with `--lang-src en --lang-tgt de --epochs 40 -p 1000`, padded batches, dropout 0.3 with attention dropout | **{ende_40:.2f}** at epoch 40 | [[tr_small_ende_bleu_1xh200.jsonl]] |

**Why the `small` preset's dropout is 0.4.** FlexAttention has no dropout on the attention probabilities. At the
old 0.3 the packed model overfit after epoch 30; the de→en recipe with `--compile` (`--eval-every 5`), four
variants at once on one H100 (their speed is not comparable), and the two earlier runs alone on one:

| dropout | `--max-tokens` | best BLEU | BLEU at epoch 60 | log |
|---|---|---|---|---|
| 0.4 (the default) | 8,192 | **{bleu_d04_t8k:.2f}** | {bleu60_d04_t8k:.2f} | [[tr_small_deen_bleu_packed_d04_t8k_1xh100.jsonl]] |
| 0.4 | 6,144 | {bleu_d04_t6k:.2f} | {bleu60_d04_t6k:.2f} | [[tr_small_deen_bleu_packed_d04_t6k_1xh100.jsonl]] |
| 0.3 | 8,192 | {bleu_d03_t8k:.2f} | {bleu60_d03_t8k:.2f} | [[multi30k_deen_small_packed_compile_1xh100.jsonl]] |
| 0.3 | 6,144 | {bleu_d03_t6k:.2f} | {bleu60_d03_t6k:.2f} | [[tr_small_deen_bleu_packed_d03_t6k_1xh100.jsonl]] |
| 0.3 | 4,096 | {bleu_d03_t4k:.2f} | {bleu60_d03_t4k:.2f} | [[tr_small_deen_bleu_packed_d03_t4k_1xh100.jsonl]] |
| 0.3 with attention dropout, padded batches (before packing) | 8,192 | {bleu_pad:.2f} | {bleu60_pad:.2f} | [[tr_small_deen_bleu_1xh100.jsonl]] |
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
