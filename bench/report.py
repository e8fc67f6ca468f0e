"""``python bench/report.py``: exit 1 unless every figure README.md, BENCHMARKS.md and each folder's README.md quote
from a log in docs/runs is what the log gives.

Each figure is one entry of ``figures()``: (doc, the text as the doc prints it with ``{}`` fields, the values read
from the logs), found in the doc exactly as often as listed (bold markers belong to the text). Every number with %,
img/s or tok(en)s/s in a doc must lie inside a checked figure or be in ``NOT_FROM_LOGS``; every link into docs/runs
must exist. A new figure: commit its log, write it into the doc, add its entry.
"""

from __future__ import annotations

import json
import re
import sys
from functools import cache
from pathlib import Path
from statistics import mean, stdev
from statistics import median as med

REPO = Path(__file__).resolve().parent.parent
RUNS = REPO / "docs" / "runs"
B, IN, CI, TR = "BENCHMARKS.md", "imagenet/README.md", "cifar_resnet/README.md", "transformer/README.md"
DOCS = ["README.md", B, *sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("[!.]*/README.md"))]
# figures a doc quotes from elsewhere (papers, constants of a table)
NOT_FROM_LOGS = {B: ["100%"] * 3 + ["91.25%", "93.03%"], IN: ["77.1%", "76.13%"], TR: ["10%"]}
UNIT = re.compile(r"\d[\d,.]*\s?(?:%|img/s|tok/s|tokens/s)")


# fmt: off
# Readers: a log's name in docs/runs -> one number (or a list of them).
@cache
def text(log: str) -> str: return (RUNS / log).read_text()
def records(log: str, split: str = "train") -> list[dict]:  # metrics.jsonl records: "train", "val", "time" (the wall-time parts in docs/runs' CIFAR logs)
    return [r for r in (json.loads(x) for x in text(log).splitlines() if x.startswith('{"split"')) if r["split"] == split]
def first(log: str, what: str, values: list):
    if not values:
        raise LookupError(f"docs/runs/{log} has no {what}")
    return values[0]
def windows(log: str, key: str = "img_per_s", skip: int = 2, drop: tuple = ()) -> list:  # train windows after warm-up, without steps `drop`
    return [r[key] for r in records(log)[skip:] if r["step"] not in drop]
def median(log: str, key: str = "img_per_s", skip: int = 2, drop: tuple = ()) -> float: return med(windows(log, key, skip, drop))
def val(log: str, key: str, epoch: int) -> float: return first(log, f"evaluation at epoch {epoch}", [r[key] for r in records(log, "val") if r["epoch"] == epoch])
def last(log: str, key: str = "acc1") -> float: return records(log, "val")[-1][key]
def best(log: str, key: str = "bleu") -> float: return max(r[key] for r in records(log, "val"))
def timing(log: str, part: str = "wall") -> float: return first(log, "time record", [r[f"{part}_s"] for r in records(log, "time")])
def row(log: str, what: str, key: str = "img_per_s"):  # the bench/benchmark.py results row whose description is `what`
    return first(log, f"row {what!r}", [r[key] for r in json.loads(text(log))["rows"] if r["what"] == what])
def grab(log: str, pattern: str) -> float:  # the first group of a regular expression in a console log
    return float(first(log, f"match for {pattern!r}", re.findall(pattern, text(log))).replace(",", ""))
def since_start(log: str, tag: str) -> float:  # a script's own wall time for the console command that holds `tag`
    return grab(log, r"wall ([\d.]+)s since start\n\[\d+ s wall\] [^\n]*" + re.escape(tag))
def seeds(name: str, hw: str = "1xh200") -> list[str]: return [f"cifar_{name.format(s)}_{hw}.jsonl" for s in range(3)]
def accs(logs: list[str]) -> list[float]: return [last(x) for x in logs]
def walls(logs: list[str], part: str = "wall") -> list[float]: return [timing(x, part) for x in logs]
def jpeg(what: str, key: str = "img_per_s"):  # a row of the one bench run of every JPEG data path
    return row("jpeg_decode_paths_1xh200.json", "imagenet/train.py ResNet-50, 20480 JPEGs of 500x375 q90 (100 KB), " + what, key)
def eff(many: float, one: float, n: int) -> float: return 100 * many / (n * one)  # per-GPU weak-scaling efficiency, %
def ms(values: list) -> tuple[float, float]: return mean(values), stdev(values)
def chaos(script: str, logs: str = "chaos") -> tuple:  # bench/chaos.py's runs of a script, summed: survived/thrown per kind, endings alike
    lines = [json.loads(x) for p in sorted(RUNS.glob(f"{logs}_{script}_*cpu.jsonl")) for x in text(p.name).splitlines()]
    runs = first(f"{logs}_{script}_*cpu.jsonl", "summary", [[r["summary"] for r in lines if "summary" in r]])
    add = lambda key, kind="": sum(r[key][kind] if kind else r[key] for r in runs)  # noqa: E731
    kinds = [f"{add('survived', k)}/{add('thrown', k)}" for k in runs[0]["thrown"]]
    kinds[3] += f" ({sum(r['saved_exit_75'] for r in lines if r.get('fault') == 'term agent')} saved)"  # exit 75 after a save
    cells = [script, sum(add("thrown", k) for k in runs[0]["thrown"]), *kinds, *(f"{add(k)}/{add('endings')}" for k in ("bit_identical", "records_equal"))]
    return (B, "| " + " | ".join(["{}"] * len(cells)) + " |", *cells)


def figures() -> list[tuple]:
    """(doc, text, values...) of every figure, in the docs' order."""
    q200, q100 = "console_rn50_cifar_imagefolder_ende_1xh200.log", "console_rn50_jpeg_cifar_bleu_4xh100.log"
    fast, full18, r20, r56 = seeds("r18_fast_seed{}"), seeds("r18_full_seed{}"), seeds("r20_fast_seed{}"), seeds("r56_fast_seed{}")
    r50, r50x2, r50a = seeds("r50_full_seed{}"), seeds("r50_full_seed{}", "2xh200"), seeds("r50_full_e100_nographs_seed{}")
    c1, c2, c4 = "cifar_r18_e80_seed0_1xh100.jsonl", seeds("r18_e80_seed{}", "2xh100"), "cifar_r18_e80_seed0_4xh100.jsonl"
    c1_s, c4_s, c2_s = since_start(q100, "/tmp/c1_seed0_cold "), since_start(q100, "/tmp/c4_seed0 "), [since_start(q100, f"/tmp/c2_seed{s} ") for s in range(3)]
    cg, cl, cg_s, cl_s = "cifar_r18_e20_gpudata_1xh100.jsonl", "cifar_r18_e20_dataloader_1xh100.jsonl", since_start(q100, "/tmp/c1_e20_gpudata "), since_start("console_tr_base_compile_cudnn_cifar_dataloader_1xh100.log", "/tmp/c1_e20_loader ")
    r50_ips, r50x2_ips = (med(median(x, skip=1) for x in logs) for logs in (r50, r50x2))
    imf, if_s = "imagefolder_r18_cifar64px_1xh200.jsonl", grab(q200, r"\[(\d+) s wall\] python3 imagenet/train.py /tmp/inet")
    bleu1, bleu2 = "tr_small_deen_bleu_1xh200.jsonl", "tr_small_ende_bleu_1xh200.jsonl"
    rn = {k: median(f"rn50_bf16_cl_{k}xh100.jsonl") for k in ("eager_1", "eager_2", "eager_4", "eager_2agents_4", "compile_1", "compile_4")}
    rn_bare = grab(q200, r"\| bare step, fp32 \(TF32 convs, eager\) \| 256 \| ([\d,]+)")
    rn_script = grab(q200, re.escape("imagenet/train.py --dummy, fp32 (TF32 convs, eager)") + r" \| 256 \| ([\d,]+)")
    dm, tv = "--dummy (no data path), bf16 + channels_last + compile", "--gpu-decode --gpu-decoder torchvision, bf16 + channels_last + compile"
    j = {"dg": dm + " + CUDA graphs", "tg": tv + " + CUDA graphs", "t8": tv.replace("torchvision,", "torchvision, 8 hardware queues,") + " + CUDA graphs",
         "dm": dm, "tv": tv, "pl": "Pillow DataLoader, bf16 + channels_last + compile", "ex": "pytorch/examples main.py configuration: Pillow, fp32, eager"}
    ji = {k: jpeg(w) for k, w in j.items()}

    def jpeg_row(k: str) -> tuple:  # img/s, share of --dummy (with CUDA graphs or without, as the row), CPU cores, SM, JPEG engines
        cells = ["**{:,.0f}**", "**{:.1f}%**"] if k == "tg" else ["{:,.0f}", "{:.1f}%" if k == "tv" else "{:.0f}%"]
        values = [ji[k], 100 * ji[k] / ji["dg" if k in ("dg", "tg", "t8") else "dm"], jpeg(j[k], "cpu_cores"), jpeg(j[k], "sm_util")]
        last_cell = [jpeg(j[k], "jpg_util")] if k[0] == "t" else []
        return (B, "| " + " | ".join([*cells, "{:.1f}", "{:.0f}%", "{:.0f}%" if last_cell else "—"]) + " |", *values, *last_cell)

    js = {f"{k}{n}": median(f"jpeg_{k}_{n}xh200.jsonl") for k in ("dummy", "gpu_decode") for n in (1, 2)}
    tv_steady = [median("jpeg_gpu_decode_1xh200.jsonl", drop=(90,)), median("jpeg_gpu_decode_2xh200.jsonl", drop=(50, 90))]
    cb = {k: row("cifar_script_bare_1xh200.json", w) for k, w in (("bare", "bare step resnet18, b 512, bf16+cl+compile, resident data"),
          ("script", "cifar_resnet/train.py resnet18 --gpu-data"), ("graphs", "cifar_resnet/train.py resnet18 --gpu-data, CUDA graphs"),
          ("loader", "cifar_resnet/train.py resnet18 DataLoader (Pillow)"))}
    trn, trs, pk = "tr_base_m8_script_bare_1xh200.json", "tr_small_script_cudagraphs_bare_1xh200.json", "transformer_base_packed_bare_1xh100.json"
    pks = "bare step base, packed 64x1024 rows, 63775 real target tokens, bf16, compile, "
    unpacked = "bare step base, 65536 tokens as 2730x24, bf16, compile, model and loss compiled together"
    sms, sm_eager = "transformer/train.py small, 8192 tok/GPU, 1 GPU(s), bf16", "transformer_small_unpacked_script_eager_1xh100.json"
    smb = "bare step small, packed 8x1024 rows, 8080 real target tokens, bf16, compile, model and loss compiled together, CUDA graphs"
    tr_script = "transformer/train.py base, 65536 tok/GPU, 1 GPU(s), bf16, compile"
    tr_loop, tr_c1, tr_bare = (row(trn, w, "tok_per_s") for w in ("baseline loop, base, pad 350, fp32, batch 8", tr_script, pks + "model and loss compiled together"))
    sm_pad, sm_c, sm_g, sm_bare = (row(x, w, "tok_per_s") for x, w in ((sm_eager, sms), (trs, sms + ", compile"), (trs, sms + ", compile, CUDA graphs"), (trs, smb)))
    mfu = lambda log, what: 100 * row(log, what, "mfu")  # noqa: E731
    bare = lambda log, what: (row(log, what, "tok_per_s"), mfu(log, what), row(log, what, "first_step_s"))  # noqa: E731
    trl, prof, prof_mm = "tr_base_m8_small_scripts_1xh100.log", "transformer_base_packed_bare_profile_1xh100.txt", grab("transformer_base_packed_bare_profile_1xh100.txt", r"matmul: ([\d.]+) ms")
    m8 = [median(f"tr_base_m8_compile_{n}xh200.jsonl", "tok_per_s") for n in (1, 2)]
    fs = lambda p, n, m: f"tr_{p}_m8_{m}_{n}xh200.jsonl"  # noqa: E731
    peak = lambda log: max(r["max_mem_gib"] for r in records(log))  # noqa: E731
    big = grab("console_tr_1b_l82_m8_fsdp_4xh200.log", r"\(([\d.]+)M params")  # the deepened 1b, millions of parameters
    fsdp = {(p, n): [(median(fs(p, n, m), "tok_per_s"), peak(fs(p, n, m))) for m in ("ddp", "fsdp", "fsdpmodel")] for p in ("base", "1b") for n in (2, 4)}
    return [
        # cifar_resnet/README.md and transformer/README.md: the recipes
        *[(CI, "| {:.2f} ± {:.2f}% | {:.0f}–{:.0f} s", *ms(accs(x)), min(walls(x)), max(walls(x))) for x in (fast, full18, r50, r50x2, r20, r56)],
        *[(TR, f"sacreBLEU {{:.2f}} at epoch {e}, best {{:.2f}} (greedy, 1 seed) | {{:.0f}} s", val(x, "bleu", e), best(x), grab(x.replace("jsonl", "log"), r"wall ([\d.]+)s(?![\s\S]*wall [\d.]+s)")) for x, e in ((bleu1, 60), (bleu2, 40))],
        # BENCHMARKS.md, ResNet-50
        (B, "| {:,.0f} img/s | {:,.0f} img/s | {:.1f}% |", rn_bare, rn_script, 100 * rn_script / rn_bare),
        *[(B, f"| {n} | {{:,.0f}} | {'—' if n == 1 else '{:.1f}%'} | [log](docs/runs/rn50_bf16_cl_{k}_{n}x", rn[f"{k}_{n}"], *([eff(rn[f"{k}_{n}"], rn[k.split("_")[0] + "_1"], n)] if n > 1 else []))
          for k, n in (("eager", 1), ("eager", 2), ("eager", 4), ("eager_2agents", 4), ("compile", 1), ("compile", 4))],
        *[jpeg_row(k) for k in j],
        (B, "is {:.2f}× this script", ji["tg"] / ji["ex"]), (B, "is\n{:.2f}× the Pillow DataLoader", ji["tv"] / ji["pl"]), (B, "`--dummy` is {:.2f}× the last row", ji["dg"] / ji["ex"]),
        (B, "over 36 files: {:.1f} levels", jpeg(j["tg"], "pixel_check")["max_mad_vs_pillow"]), (B, "remaining {:.0f}%", 100 - 100 * ji["tg"] / ji["dg"]),
        (B, "| `--dummy` | {:,.0f} | {:,.0f} | {:.1f}% |", js["dummy1"], js["dummy2"], eff(js["dummy2"], js["dummy1"], 2)),
        (B, "| {:,.0f} ({:.0f}% of `--dummy`) | {:,.0f} ({:.0f}%) | {:.1f}% |", js["gpu_decode1"], 100 * js["gpu_decode1"] / js["dummy1"], js["gpu_decode2"], 100 * js["gpu_decode2"] / js["dummy2"], eff(js["gpu_decode2"], js["gpu_decode1"], 2)),
        (B, "windows ({:,.0f} img/s at the lowest; `--dummy`'s lowest: {:,.0f})", *(min(windows(f"jpeg_{k}_2xh200.jsonl")) for k in ("gpu_decode", "dummy"))),
        (B, "scales at {:.1f}% per GPU", eff(tv_steady[1], tv_steady[0], 2)),
        (B, "**{:.2f}%** in\n{:.0f} s at {:,.0f} img/s", last(imf), if_s, median(imf, skip=0)),
        # BENCHMARKS.md, CIFAR-10
        *[(B, "{:.2f} ({:.1f} s", a, w) for a, w in zip(accs(fast + r20), walls(fast + r20))],
        *[(B, "{:.2f} ({:.0f} s", a, w) for a, w in zip(accs(full18 + r56 + r50 + r50x2 + r50a), walls(full18 + r56 + r50 + r50x2 + r50a))],
        *[(B, "**{:.2f} ± {:.2f}**", *ms(accs(x))) for x in (fast, full18, r20, r56, r50, r50x2, c2)], (B, "| {:.2f} ± {:.2f} |", *ms(accs(r50a))),
        (B, "({:+.2f} against 1 GPU)", mean(accs(r50x2)) - mean(accs(r50))), (B, "reach {:.2f}% (ResNet-20) and {:.2f}% (ResNet-56)", mean(accs(r20)), mean(accs(r56))),
        (B, "accuracies, {:.2f}, {:.2f} and {:.2f}, in {:.0f}–{:.0f} s", *accs(seeds("r18_fast_nographs_seed{}")), *walls(seeds("r18_fast_nographs_seed{}"))[::2]),
        (B, "gave\n  {:.2f} and {:.2f} for seeds 0 and 1", *accs(seeds("r18_full_nographs_seed{}")[:2])),
        (B, "start {:.1f} s, data {:.1f} s, compile\n  {:.1f} s, train {:.1f} s, eval {:.1f} s, checkpoint {:.1f} s",
         *(timing(fast[0], k) for k in ("start", "data", "compile", "train", "eval", "checkpoint"))),
        (B, "decode ({:.0f} s for full", timing(full18[0], "data")), (B, "cold compile ({:.0f} s there)", timing(full18[0], "compile")),
        *[(B, f"{{:.0f}}–{{:.0f}} s{end}", min(walls(r50, k)), max(walls(r50, k))) for k, end in (("data", ")"), ("compile", ")"), ("train", " at"), ("checkpoint", ":"))],
        (B, "at {:,.0f} img/s; the rest", r50_ips), (B, "stop at {:.2f}%:", mean(accs(r50a))), (B, "accuracy ({:.2f}% against\n  {:.2f}%)", mean(accs(r50x2)), mean(accs(r50))),
        (B, "only {:.2f}× faster\n  ({:,.0f} img/s against {:,.0f}, {:.0f}–{:.0f} s of training", r50x2_ips / r50_ips, r50x2_ips, r50_ips,
         min(walls(r50x2, "train")), max(walls(r50x2, "train"))),
        *[(B, f"| {w} | {{:,.0f}} | {{:.1f}} ms | {{:.0f}}%", cb[k], 1e3 * 512 / cb[k], 100 * cb[k] / cb["bare"]) for k, w in (("bare", "bare loop"), ("script", "`train.py --gpu-data`"))],
        (B, "| **{:,.0f}** | {:.1f} ms | **{:.0f}%**", cb["graphs"], 1e3 * 512 / cb["graphs"], 100 * cb["graphs"] / cb["bare"]), (B, "| {:,.0f} | — | {:.0f}%", cb["loader"], 100 * cb["loader"] / cb["bare"]),
        (B, "a step takes {:.2f} ms\nof host time for {:.2f} ms of GPU kernels", *(grab("cifar_step_ablation_4xh200host.log", x) for x in (r"host loop ([\d.]+) ms/step", r"GPU kernel time ([\d.]+) ms/step"))),
        *[(B, "| {:.2f} | {:.1f} s | {:,.0f} |", last(x), s, median(x, skip=0)) for x, s in zip([c1, *c2, c4], [c1_s, *c2_s, c4_s])],
        *[(B, "| {:.2f} / {:.2f} / {:.2f} | {:.1f} s | {:,.0f} |", *(val(x, "acc1", e) for e in (5, 10, 20)), s, median(x, skip=0)) for x, s in ((cl, cl_s), (cg, cg_s))],
        # BENCHMARKS.md, Transformer
        (B, "{:.1f} steps an epoch", grab(trl, r"on 232000 pairs [^\n]* ([\d.]+) steps/epoch")), (B, "| {:,.0f} | — | — |", tr_loop),
        (B, "**{:,.0f}** ({:.0f}× the baseline, **{:.1f}%** of the bare step) | {:.1f}%", tr_c1, tr_c1 / tr_loop, 100 * tr_c1 / tr_bare, mfu(trn, tr_script)),
        *[(B, "| {:,.0f} | {:.1f}% | {:.0f} s |", *bare(x, pks + w)) for x, w in ((trn, "model and loss compiled together"), (pk, "model and loss compiled together"), (pk, "each layer and the loss compiled apart"))],
        (B, "| {:,.0f} | {:.1f}% | — |", row(pk, unpacked, "tok_per_s"), mfu(pk, unpacked)), (B, "| {:,.0f} | {:.1f}% | — |", sm_pad, mfu(sm_eager, sms)),
        (B, "| {:,.0f} | {:.1f}%", sm_c, mfu(trs, sms + ", compile")),
        (B, "**{:,.0f}** (**{:.0f}%** of the bare step) | {:.1f}%", sm_g, 100 * sm_g / sm_bare, mfu(trs, sms + ", compile, CUDA graphs")),
        (B, "| {:,.0f} | {:.1f}% | {:.0f} s |", *bare(trs, smb)), (B, "fills {:.1f}%.", grab(trl, r"small \(19.9M params\) on 29000 pairs [^\n]*per step, ([\d.]+)% of them real")),
        (B, "{:.1f}% of the script's `base` positions hold real tokens, as in the bare step ({:.1f}%)", grab(trl, r"on 232000 pairs [^\n]*per step, ([\d.]+)% of them real"), 100 * 63775 / 65536),
        (B, "takes {:.1f} ms (8 rows", 1e3 * 8080 / sm_bare), (B, "trains at {:,.0f} tokens/s.", sm_c), (B, "replays them: {:.1f}× faster", sm_g / sm_c),
        (B, "take {:.0f} ms to build eagerly and {:.2f} ms\ncompiled", *(row(pk, pks + "model and loss compiled together", f"mask_ms_{k}") for k in ("eager", "compiled"))),
        (B, "per {:.1f} ms\nstep: matmuls {:.1f} ms ({:.0f}% of the GPU's peak already), attention {:.1f} ms and\n{:.1f} ms", grab(prof, r"^wall ([\d.]+) ms/step"), prof_mm,
         100 * 6 * 48.2e6 * 63775 / (prof_mm / 1e3) / 989e12, grab(prof, r"attention \(SDPA\): ([\d.]+) ms"), grab(prof, r"fused elementwise/norm \(Triton\): ([\d.]+) ms")),
        (B, "| 1 | {:,.0f} | — |", m8[0]), (B, "| 2 | {:,.0f} | **{:.1f}%** |", m8[1], eff(m8[1], m8[0], 2)),
        *[(B, f"| `{p}`, {size} | {{}} | {{:,.0f}} | {{:,.0f}} ({{:.1f}}%) | **{{:,.0f}} ({{:.1f}}%)** | {{:.1f}}, {{:.1f}}, {{:.1f}} |", n, d, f, 100 * f / d, m, 100 * m / d, md, mf, mm)
          for p, size in (("base", "48.2M"), ("1b", "1.07B")) for n in (2, 4) for (d, md), (f, mf), (m, mm) in [fsdp[p, n]]],
        (B, "waiting: {:.0f}–{:.0f}% of the throughput lost", *sorted(100 * (1 - fsdp["base", n][1][0] / fsdp["base", n][0][0]) for n in (2, 4))),
        (B, "brings `base` within {:.0f}% of DDP", max(100 * (1 - fsdp["base", n][2][0] / fsdp["base", n][0][0]) for n in (2, 4))),
        (B, "DDP's 16 bytes a parameter, {:.1f} GiB.", 16 * 1073.9e6 / 2**30),
        (B, "of `1b` on 2 and 4 GPUs: {:.1f}% and {:.1f}% under DDP, {:.1f}% and {:.1f}% with\n`--fsdp model`;",  # 6 x params x tok/s / peak, a GPU
         *(100 * 6 * 1073.9e6 * fsdp["1b", n][k][0] / (989e12 * n) for k in (0, 2) for n in (2, 4))),
        (B, "16,384 tokens): {:.1f}%.", mfu("tr_1b_bare_1xh200.json", "bare step 1b, packed 16x1024 rows, 16071 real target tokens, bf16, compile, model and loss compiled together")),
        (B, "layers, {:.2f}B parameters", big / 1e3), (B, "alone would take {:.1f} GiB a GPU", 16 * big * 1e6 / 2**30),
        (B, "slow `--fsdp model` from {:,.0f} to {:,.0f} tokens/s", *(median(f"tr_base_m8_fsdpmodel_{m}_2xh200.jsonl", "tok_per_s") for m in ("compile", "cudagraphs"))),
        (B, "4 H200s: {:,.0f} tokens/s, {:.1f} GiB a GPU at peak", median("tr_1b_l82_m8_fsdp_4xh200.jsonl", "tok_per_s"), peak("tr_1b_l82_m8_fsdp_4xh200.jsonl")),
        *[(B, f"| {{:.2f}} at epoch 20, {{:.2f}} at {e}, best **{{:.2f}}** |", val(x, "bleu", 20), val(x, "bleu", e), best(x)) for x, e in ((bleu1, 60), (bleu2, 40))],
        (B, "a best BLEU of **{:.2f}** at 0.4", best("tr_small_deen_bleu_packed_d04_t8k_1xh100.jsonl")), (B, "and {:.2f} at 0.3", best("multi30k_deen_small_packed_compile_1xh100.jsonl")),
        # imagenet/README.md: 90 epochs of ImageNet at the speed measured (modern: 8 GPUs at 8x the per-GPU speed on 2; classic: 1 GPU)
        (IN, "about {:.0f} min, estimated", 90 * 1281167 / (4 * js["gpu_decode2"]) / 60), (IN, "about {:.1f} h, estimated", 90 * 1281167 / ji["ex"] / 3600),
        (IN, "{:,.0f} img/s,\n{:.1f}% of `--dummy`", ji["tg"], 100 * ji["tg"] / ji["dg"]),
        # BENCHMARKS.md, random faults (bench/chaos.py)
        *[chaos(s) for s in ("cifar", "transformer", "transformer-fsdp", "imagenet")],
        *[chaos(s, "chaos-startup") for s in ("cifar", "transformer")],
    ]
# fmt: on


def occurrences(doc: str, figure: str) -> list[tuple[int, int]]:
    """Where ``figure`` stands in ``doc`` as a whole: not inside a longer number or a bold figure."""
    pattern = r"(?<![\d.,*])" + re.escape(figure) + r"(?![\d*]|[.,]\d)"
    return [m.span() for m in re.finditer(pattern, doc)]


def check(docs: dict[str, str], table: list[tuple], literals: dict = NOT_FROM_LOGS) -> list[str]:
    """What is wrong: each figure found another number of times than listed, each unchecked figure, each dead link."""
    listed: dict[tuple[str, str], int] = {}
    for doc, fmt, *values in table:
        key = (doc, fmt.format(*values))
        listed[key] = listed.get(key, 0) + 1
    for doc, texts in literals.items():
        for figure in texts:
            listed[doc, figure] = listed.get((doc, figure), 0) + 1
    bad, covered = [], {doc: [] for doc in docs}
    for (doc, figure), n in listed.items():
        spans = occurrences(docs[doc], figure)
        covered[doc] += spans
        if len(spans) != n:
            bad.append(f"{doc}: {figure!r} appears {len(spans)} time(s), the logs give it {n} time(s)")
    for doc, md in docs.items():
        prose = re.sub(r"```.*?```", lambda m: " " * len(m.group()), md, flags=re.S)  # console examples are no figures
        for m in UNIT.finditer(prose):
            if not any(a <= m.start() and m.end() <= b for a, b in covered[doc]):
                bad.append(f"{doc}: {m.group()!r} is no figure of bench/report.py")
        for link in re.findall(r"\]\((?:\.\./)?(docs/runs/[^)#]+)\)", md):
            if not (REPO / link).is_file():
                bad.append(f"{doc}: link to {link}, which does not exist")
    return bad


def main() -> int:
    try:
        table = figures()
    except (OSError, LookupError) as e:  # a log missing, renamed, or without the record a figure reads
        print(f"error: {e} (docs/runs and bench/report.py disagree)", file=sys.stderr)
        return 1
    docs = {doc: (REPO / doc).read_text() for doc in DOCS}
    bad = check(docs, table)
    print("\n".join(bad) or f"{len(table)} figures match their logs", file=sys.stderr if bad else sys.stdout)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
