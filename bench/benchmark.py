"""One benchmark entry point: bare training-step baselines and the scripts, measured side by side.

    python bench/benchmark.py --out bench_out                 # on a GPU machine: everything that fits
    python bench/benchmark.py --only resnet50,cifar --out o   # a subset
    python bench/benchmark.py --tiny --out o                  # CPU smoke mode (CI runs this so it cannot rot)

All parts together take more than 10 minutes on one GPU: run them separately (--only); bench/reproduce.sh runs
them as BENCHMARKS.md reports them.

Writes ``OUT/results.json`` and ``OUT/results.md``: device, GPU count, torch/CUDA versions, and for every row the
exact command (script rows) or the baseline it is (bare rows). Each script row is measured in the same run as
the bare loop it is compared with. Throughput is the median over timed windows after warm-up.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
# The scripts' modules by name, as each script imports the ones beside it, and common/ from the repository root
sys.path[:0] = [str(REPO / d) for d in ("cifar_resnet", "imagenet", "transformer")] + [str(REPO)]


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and every process below it, e.g. its DataLoader workers."""
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return float("nan")
    total = 0.0
    for q in procs:
        try:
            c = q.cpu_times()
            total += c.user + c.system
        except psutil.Error:  # a worker that just left
            pass
    return total


def timed(step, iters: int, warmup: int, items_per_iter: int, device: torch.device) -> float:
    """Items/s of ``step()``: warm up (compilation happens here), then the median of 5 timed windows."""
    for _ in range(warmup):
        step()
    rates = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(max(1, iters // 5)):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates.append(items_per_iter * max(1, iters // 5) / (time.perf_counter() - t0))
    return statistics.median(rates)


def bare_vision_step(
    model: nn.Module,
    batch: int,
    size: int,
    classes: int,
    dtype,
    channels_last: bool,
    compile_: bool,
    device: torch.device,
):
    """The fewest lines that train a vision model: GPU-resident data, SGD, optional bf16/channels_last/compile."""
    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, size, size, device=device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (batch,), device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    fwd = torch.compile(model) if compile_ else model

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(fwd(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


class Monitor:
    """Samples a process tree's CPU time and the GPU's utilisation every ``every`` s while a command runs, so
    a steady window of the run can be summarised: CPU cores busy (CPU seconds of the process and its children,
    the DataLoader workers, per wall second), SM utilisation (NVML's GPM SM_UTIL on Hopper: the share of SMs
    busy; else NVML's coarser "a kernel was running" figure), and the JPEG engines' utilisation."""

    def __init__(self, pid: int, every: float = 0.5):
        self.pid, self.every, self.samples, self.stop = pid, every, [], False
        self.nvml = self.gpm = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
            if pynvml.nvmlGpmQueryDeviceSupport(self.handle).isSupportedDevice:
                self.gpm = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
                pynvml.nvmlGpmSampleGet(self.handle, self.gpm[0])
        except Exception:  # no pynvml, no GPU or no GPM: the figures it gives are left out
            pass
        import threading

        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            rec = {"t": time.time(), "cpu_s": cpu_seconds(self.pid)}
            if self.nvml is not None:
                n, h = self.nvml, self.handle
                try:
                    rec["gpu_util"] = n.nvmlDeviceGetUtilizationRates(h).gpu
                    rec["jpg_util"] = n.nvmlDeviceGetJpgUtilization(h)[0]
                    if self.gpm is not None:
                        n.nvmlGpmSampleGet(h, self.gpm[1])
                        m = n.c_nvmlGpmMetricsGet_t()
                        m.version, m.numMetrics = n.NVML_GPM_METRICS_GET_VERSION, 1
                        m.sample1, m.sample2 = self.gpm[0], self.gpm[1]
                        m.metrics[0].metricId = n.NVML_GPM_METRIC_SM_UTIL
                        n.nvmlGpmMetricsGet(m)
                        rec["sm_util"] = m.metrics[0].value  # over the interval since the last sample
                        self.gpm.reverse()
                except Exception:
                    pass
            self.samples.append(rec)
            time.sleep(self.every)

    def window(self, t0: float, t1: float) -> dict:
        """Averages over the samples taken between t0 and t1 (unix time)."""
        self.stop = True
        self.thread.join()
        inside = [r for r in self.samples if t0 <= r["t"] <= t1]
        if len(inside) < 2:
            return {}
        out = {"cpu_cores": (inside[-1]["cpu_s"] - inside[0]["cpu_s"]) / (inside[-1]["t"] - inside[0]["t"])}
        for k in ("sm_util", "gpu_util", "jpg_util"):
            vals = [r[k] for r in inside[1:] if k in r]
            if vals:
                out[k] = sum(vals) / len(vals)
        return out


def script_rate(
    cmd: list[str], out: Path, key: str, skip: int = 2, monitor: bool = False, env: dict | None = None
) -> tuple[float, str, dict]:
    """Run a train.py command (``env``: variables to add); return the median of its logged ``key`` over whole log
    windows (after ``skip`` warm-up ones), the wall time, and with ``monitor`` the CPU cores and GPU utilisation over
    the windows it took the median of."""
    t0 = time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    mon = Monitor(p.pid) if monitor else None
    stdout, stderr = p.communicate()
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    every = json.loads((out / "config.json").read_text())["print_freq"]
    train = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r.get("split") == "train" and key in r]
    # Whole windows only: print_freq steps since the last record, in one epoch. The scripts also log at each epoch end
    # (a shorter window), and the window after it holds that epoch's evaluation and checkpoint.
    recs = [r for q, r in zip([{"step": 0, "epoch": 0}, *train], train)
            if r["step"] - q["step"] == every and r["epoch"] == q["epoch"]]  # fmt: skip
    if len(recs) <= skip:
        raise RuntimeError(f"no {key} records in {out}/metrics.jsonl")
    extra = mon.window(recs[skip - 1]["time"], recs[-1]["time"]) if mon is not None and skip > 0 else {}
    (out / "stdout.txt").write_text(stdout + stderr)
    return statistics.median(r[key] for r in recs[skip:]), f"{time.time() - t0:.0f}s", extra


def cmd_str(cmd: list[str]) -> str:
    return " ".join(str(c) for c in cmd).replace(sys.executable, "python3")


def script_row(
    bench: str, what: str, cmd: list[str], out: Path, key: str, skip: int = 2, monitor: bool = False,
    env: dict | None = None, **extra,
) -> dict:  # fmt: skip
    """Run a train.py command and return its results row: the median ``key``, wall time and exact command.
    A failed run becomes a FAILED row, so one broken configuration does not lose the measurements after it."""
    try:
        rate, wall, usage = script_rate(cmd, out, key, skip, monitor, env)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return {"bench": bench, "what": f"FAILED: {what}"}
    prefix = "".join(f"{k}={v} " for k, v in (env or {}).items())  # the command as a shell would take it
    return {"bench": bench, "what": what, **extra, key: rate, **usage, "wall": wall, "cmd": prefix + cmd_str(cmd)}


# ------------------------------------------------------------------ measurements

# name -> (description, autocast dtype, channels_last, compile, the same as imagenet/train.py flags)
RN50_CONFIGS = {
    "fp32": ("fp32 (TF32 convs, eager)", None, False, False, ["--amp", "none", "--no-channels-last"]),
    "bf16cl": ("bf16 + channels_last", torch.bfloat16, True, False, ["--amp", "bf16", "--channels-last"]),
    "compile": ("bf16 + channels_last + compile", torch.bfloat16, True, True,
                ["--amp", "bf16", "--channels-last", "--compile"]),
}  # fmt: skip


def bench_resnet50(args, device, rows):
    """ResNet-50 bare steps vs imagenet/train.py --dummy (the target: >= 6,500 img/s bf16+cl+compile on 1 GPU)."""
    import torchvision

    b, size, iters = (args.rn50_batch, 224, args.iters) if not args.tiny else (4, 64, 2)
    torch.backends.cudnn.benchmark = True
    wanted = ["fp32"] if args.tiny else args.rn50_configs.split(",")
    configs = [c for k, c in RN50_CONFIGS.items() if k in wanted]
    for name, dtype, cl, comp, _ in configs:
        torch.manual_seed(0)
        step = bare_vision_step(torchvision.models.resnet50(), b, size, 1000, dtype, cl, comp, device)
        rate = timed(step, iters, 10 if not args.tiny else 1, b, device)
        rows.append({"bench": "resnet50", "what": f"bare step, {name}", "batch": b, "img_per_s": rate})
        del step
        torch.cuda.empty_cache() if device.type == "cuda" else None
    for name, *_, flags in configs:
        out = Path(args.out) / f"rn50_{len(rows)}"
        cmd = [sys.executable, "imagenet/train.py", "--dummy", "-a", "resnet50", "-b", str(b),
               "--max-steps", str(args.script_steps if not args.tiny else 3), "-p", "10" if not args.tiny else "1",
               "--output-dir", str(out), "--resume", "none", "--overwrite", *flags]  # fmt: skip
        if args.tiny:
            cmd += ["--train-crop-size", "64", "--val-crop-size", "64", "--val-resize-size", "72", "-j", "0"]
            cmd += ["--dummy-sizes", "64", "16"]  # the end-of-run evaluation would otherwise see 50,000 images
        rows.append(script_row("resnet50", f"imagenet/train.py --dummy, {name}", cmd, out, "img_per_s", batch=b))


def cifar_bare_epoch(args, device, n: int, arch: str) -> float:
    """Seconds per epoch of n images for a bare loop of the script's model (CIFAR stem) with GPU-resident data."""
    from cifar_resnet.train import build_model

    b = 512 if not args.tiny else 8
    cuda = device.type == "cuda"
    step = bare_vision_step(
        build_model(arch), b, 32, 10, torch.bfloat16 if cuda else None, cuda, cuda and not args.tiny, device
    )
    rate = timed(step, args.iters if not args.tiny else 2, 10 if not args.tiny else 1, b, device)
    return n / rate


def bench_cifar(args, device, rows):
    """CIFAR ResNets: the bare loop's epoch vs the fast recipe's (--gpu-data) and the DataLoader path's, same flags."""
    n = 45000 if not args.tiny else 64
    data = ["--data-dir", args.cifar_dir, "--val-split", "5000"] if args.cifar_dir else ["--synthetic"]
    if args.tiny:  # 64 + 16 JPEGs: --synthetic's 1,000 validation images would take a CPU most of the time
        make_jpeg_folder(Path(args.out) / "cifar32", n, 16, (32, 32), classes=10, workers=1)
        data = ["--data-dir", str(Path(args.out) / "cifar32")]
    for arch in args.cifar_archs.split(","):
        bare_s = cifar_bare_epoch(args, device, n, arch)
        what = f"bare step {arch}, b 512, bf16+cl+compile, resident data"
        rows.append({"bench": "cifar", "what": what, "img_per_s": n / bare_s, "epoch_s": bare_s})
        # The fast recipe's flags (bench/reproduce.sh cifar), and the same on the DataLoader path.
        recipe = ["-a", arch, "-b", "512", "--lr", "0.4", "--tta", "--amp", "bf16", "--channels-last", "--compile"]
        if args.tiny:  # CPU smoke: small batch, eager, fp32, a few steps
            recipe = ["-a", arch, "-b", "8", "--lr", "0.4", "--tta", "--amp", "none", "--no-channels-last"]
        paths = [("--gpu-data", ["--gpu-data"]), ("DataLoader (Pillow)", ["-j", str(args.workers)])]
        if not args.tiny:  # CUDA graphs: the same step with its kernel launches replayed
            paths.insert(1, ("--gpu-data, CUDA graphs", ["--gpu-data", "--compile-mode", "reduce-overhead"]))
        else:  # one row runs this code; the DataLoader path is the same row with other flags
            paths = paths[:1]
        for name, flags in paths:
            out = Path(args.out) / f"cifar_{len(rows)}"
            cmd = [sys.executable, "cifar_resnet/train.py", *data, *recipe, "--epochs", "3", "-p", "20",
                   "--output-dir", str(out), "--resume", "none", "--overwrite", *flags]  # fmt: skip
            if args.tiny:
                cmd += ["--epochs", "1", "-p", "1", "--max-steps", "3", "-j", "0"]
            row = script_row(
                "cifar", f"cifar_resnet/train.py {arch} {name}", cmd, out, "img_per_s", 1 if args.tiny else 3
            )
            if "img_per_s" in row:
                row = {**row, "epoch_s": n / row["img_per_s"], "vs_bare": n / row["img_per_s"] / bare_s}
            rows.append(row)


# Photo-like texture: noise at several feature sizes (px) and amplitudes (levels), each smoothed by a bicubic
# upscale, mostly luminance with some colour. Its detail at every scale gives JPEGs of ImageNet's byte size at
# quality 90 (about 100 KB at 500x375) where smooth upscales of small images give 17 KB.
TEXTURE_SCALES = ((96, 50), (32, 34), (12, 26), (5, 22), (2, 18), (1, 10))


def _texture_fields(seed: int, size: int = 1024) -> list:
    import numpy as np
    import PIL.Image

    rng, fields = np.random.default_rng(seed), []
    for scale, amp in TEXTURE_SCALES:
        n = size // scale + 4
        small = 0.35 * rng.standard_normal((n, n, 3)) + rng.standard_normal((n, n, 1))
        up = np.stack(
            [np.asarray(PIL.Image.fromarray(small[..., c].astype(np.float32), "F").resize((n * scale,) * 2, 3))
             for c in range(3)], -1,
        )[:size, :size]  # fmt: skip
        fields.append((amp * up / up.std()).astype(np.float32))
    return fields


def _write_photos(job: tuple[int, list[tuple[str, int, int]]]) -> list[int]:
    """Write one worker's share of the JPEGs: each a sum of random crops (some mirrored) of the texture fields."""
    import numpy as np
    import PIL.Image

    seed, files = job
    fields, rng, sizes = _texture_fields(seed, max(1024, *(max(w, h) + 64 for _, w, h in files))), None, []
    rng = np.random.default_rng(seed + 1)
    for path, w, h in files:
        img = np.full((h, w, 3), 128.0, np.float32)
        for f in fields:
            y, x = rng.integers(0, f.shape[0] - h), rng.integers(0, f.shape[1] - w)
            img += f[y : y + h, x : x + w] if rng.random() < 0.5 else f[y : y + h, x : x + w][:, ::-1]
        PIL.Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(path, quality=90)
        sizes.append(os.path.getsize(path))
    return sizes


def make_jpeg_folder(root: Path, n_train: int, n_val: int, size=(500, 375), classes: int = 100, workers: int = 16):
    """train/ and val/ ImageFolders of photo-like `size` JPEGs at quality 90; returns their mean size in bytes."""
    from multiprocessing import Pool

    files = []
    for k in range(n_train + n_val):
        d = root / ("train" if k < n_train else "val") / f"class{k % classes:03d}"
        d.mkdir(parents=True, exist_ok=True)
        files.append((str(d / f"{k}.jpg"), *size))
    with Pool(workers) as pool:
        sizes = sum(pool.map(_write_photos, [(i, files[i::workers]) for i in range(workers)]), [])
    return sum(sizes) / len(sizes)


def pixel_check(root: Path, device: torch.device, tmp: Path) -> dict:
    """Decode files as ``GpuTransform`` does and compare with Pillow (mean absolute difference, 8-bit
    levels): 32 of the benchmark's files plus one each of progressive, grayscale, CMYK and PNG-named-.jpg, which
    take the fallback decoders. Returns the worst difference and the images each decoder took."""
    import numpy as np
    import PIL.Image
    from gpu_decode import EncodedImages, GpuTransform, collate_encoded, decode

    files = sorted(str(f) for f in (root / "train").glob("*/*.jpg"))[:32]
    base = PIL.Image.open(files[0])
    specials = [
        ("progressive.jpg", base, {"progressive": True, "quality": 90}),
        ("png_named.jpg", base, {"format": "PNG"}),
        ("gray.jpg", base.convert("L"), {"quality": 90}),
        ("cmyk.jpg", base.convert("CMYK"), {"quality": 90}),
    ]
    for name, im, kw in specials:
        im.save(tmp / name, **kw)
        files.append(str(tmp / name))
    tf = GpuTransform(device, 224)
    ds = EncodedImages([(f, 0) for f in files])
    pillow = [torch.from_numpy(np.array(PIL.Image.open(f).convert("RGB"))).permute(2, 0, 1).float() for f in files]
    images, keep, bad = decode(collate_encoded([ds[i] for i in range(len(files))]), device, tf.counts)
    mads = [(img.cpu().float() - pillow[k]).abs().mean().item() for img, k in zip(images, keep)]
    return {"max_mad_vs_pillow": max(mads), "decoded": len(images), "of": len(files), "bad": bad, **tf.counts}


def bench_jpeg(args, device, rows):
    """ResNet-50 on real JPEG files, ImageNet-sized (500x375, ~100 KB at quality 90, photo-like texture), every data
    path in the same run: --dummy (no data path), the Pillow DataLoader, --gpu-decode (with CUDA graphs, without
    them, and with CUDA's default 8 hardware queues), and the pytorch/examples main.py configuration (Pillow, fp32,
    eager) as the user's baseline. Each row also reports CPU cores busy and GPU SM utilisation."""
    root, n_train, n_val, size = Path(args.out) / "jpeg500", args.jpeg_images, 512, (500, 375)
    if args.tiny:
        n_train, n_val, size = 16, 8, (40, 30)
    t0 = time.time()
    mean_bytes = make_jpeg_folder(root, n_train, n_val, size, classes=100 if not args.tiny else 2, workers=args.workers)
    what = f"{n_train} JPEGs of {size[0]}x{size[1]} q90 ({mean_bytes / 1e3:.0f} KB)"
    print(f"[jpeg] {what} + {n_val} for val in {time.time() - t0:.0f}s", file=sys.stderr)
    cuda = device.type == "cuda"
    check = pixel_check(root, device, Path(args.out))
    print(f"[jpeg] pixel check against Pillow: {check}", file=sys.stderr)
    b, j, jg = (args.rn50_batch, str(args.workers), str(args.gpu_decode_workers)) if not args.tiny else (4, "0", "0")
    fast = ["--amp", "bf16", "--channels-last", "--compile"] if cuda and not args.tiny else []
    graphs = [*fast, "--compile-mode", "reduce-overhead"] if fast else []  # CUDA graphs: launching costs ~no host time
    queues = {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}  # as imagenet/README.md tells a user to run --gpu-decode
    gpu = ("--gpu-decode", ["--gpu-decode", "-j", jg, *graphs], queues)
    dummy = ["--dummy", "--dummy-sizes", str(n_train), str(n_val), "-j", j]
    examples = ["-j", j, "--amp", "none", "--no-channels-last"]
    configs = [  # most telling first, so that a run stopped by a time limit keeps them (Results writes every row)
        ("--dummy (no data path)", [*dummy, *graphs], {}),
        gpu,
        ("pytorch/examples main.py configuration: Pillow, fp32, eager", examples, {}),
        # with CUDA's default 8 hardware queues the decode waits behind graph replays
        ("--gpu-decode, 8 hardware queues", gpu[1], {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}),
        ("--gpu-decode", ["--gpu-decode", "-j", jg, *fast], queues),  # without CUDA graphs: the
        ("--dummy (no data path)", [*dummy, *fast], {}),  # host launches every kernel, beside the decoding threads
        ("Pillow DataLoader", ["-j", j, *fast], {}),
    ]  # fmt: skip
    if args.tiny:  # one row runs this loop, its decoder part included; the others are the same with other flags
        configs = [gpu]
    for name, flags, env in configs:
        out = Path(args.out) / f"jpeg_{len(rows)}"
        data = [] if "--dummy" in flags else [str(root)]
        cmd = [sys.executable, "imagenet/train.py", *data, "-a", "resnet50", "-b", str(b), "--epochs", "1",
               "-p", "10", "--output-dir", str(out), "--resume", "none", "--overwrite", *flags]  # fmt: skip
        if args.tiny:
            cmd += ["--max-steps", "3", "-p", "1", "--train-crop-size", "32", "--val-resize-size", "36",
                    "--val-crop-size", "32"]  # fmt: skip
        what_run = (
            f"imagenet/train.py ResNet-50, {what}, {name}"
            + (", bf16 + channels_last + compile" * ("--compile" in flags))
            + (" + CUDA graphs" * ("reduce-overhead" in flags))
        )
        row = script_row("jpeg", what_run, cmd, out, "img_per_s", 2 if not args.tiny else 1, True, env, batch=b)
        if "--gpu-decode" in flags:
            row["pixel_check"] = check
            stdout = (out / "stdout.txt").read_text() if (out / "stdout.txt").exists() else ""
            row["decoded"] = next((ln for ln in stdout.splitlines() if " decoded (rank 0): " in ln), "")
        rows.append(row)


def build_transformer(preset: str, vocab: int) -> nn.Module:
    from seq2seq import PRESETS, ModelConfig, Transformer

    return Transformer(ModelConfig(vocab_size=vocab, **PRESETS[preset]))


def transformer_params(preset: str, vocab: int) -> int:
    return sum(p.numel() for p in build_transformer(preset, vocab).parameters())


def baseline_transformer_step(preset: str, vocab: int, pad_to: int, batch: int, device):
    """The tutorial's loop on the same model: every sentence padded to `pad_to`, fp32, loss over the padded
    length. Returns (step, real target tokens per step)."""
    g = torch.Generator().manual_seed(0)
    model = build_transformer(preset, vocab).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    lengths = torch.randint(8, 24, (batch,), generator=g)  # Multi30k-like sentence lengths (mean about 15)
    src = torch.zeros(batch, pad_to, dtype=torch.long)
    tgt = torch.zeros(batch, pad_to + 1, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        src[i, :n] = torch.randint(4, vocab, (n,), generator=g)
        tgt[i, : n + 1] = torch.randint(4, vocab, (n + 1,), generator=g)
    src, tgt = src.to(device), tgt.to(device)

    def step():
        logits = model(src, tgt[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), tgt[:, 1:].reshape(-1), ignore_index=0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, int(lengths.sum())


def bare_transformer_step(preset: str, vocab: int, tokens: int, length: int, device, opts: list[str]):
    """The ceiling: the same model on `tokens` target tokens per step, bf16 autocast, fused AdamW. Without "packed"
    in opts: a full batch of `tokens // length` pairs of equal length (no padding), the unpacked model path. With
    "packed": rows of `length` tokens packed with pairs of Multi30k-like lengths (8-23 tokens a side, drawn
    independently), document masks (FlexAttention), as transformer/train.py trains; only real target tokens count.
    opts: "compile" compiles the model, "lossc" compiles model and loss together (the cross-entropy over the
    vocabulary fuses too), "regional" compiles each layer and the loss apart, "cudagraphs" adds
    mode="reduce-overhead" to "compile"/"lossc"; "cudnn"
    (bare_transformer_row) lets attention use cuDNN.
    Returns (step, target tokens per step)."""
    model = build_transformer(preset, vocab).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(0)
    if "packed" in opts:
        from text import PackedRows, ParallelDataset, pack_rows

        rows, n = max(1, tokens // length), 4 * tokens // 15  # more pairs than the rows can take
        src_lens, tgt_lens = torch.randint(8, 24, (2, n), generator=g).tolist()
        sizes = pack_rows([s + 1 for s in src_lens], [t + 1 for t in tgt_lens], length - 1)[:rows]
        pairs = ParallelDataset(*([torch.randint(4, vocab, (k,), generator=g).tolist() for k in lens]
                                  for lens in (src_lens, tgt_lens)))  # fmt: skip
        bounds = [0, *itertools.accumulate(sizes)]
        batch = torch.stack([PackedRows(pairs, length)[list(range(a, b))] for a, b in zip(bounds, bounds[1:])], 1)
        src, tgt_in, tgt_out, src_doc, tgt_doc = (t.to(device) for t in batch)
        inputs, per_step = (src, tgt_in, src_doc, tgt_doc), int((tgt_out != 0).sum())
    else:
        b = max(1, tokens // length)
        src = torch.randint(4, vocab, (b, length), generator=g).to(device)
        tgt = torch.randint(4, vocab, (b, length + 1), generator=g).to(device)
        inputs, tgt_out, per_step = (src, tgt[:, :-1]), tgt[:, 1:], b * length

    def token_loss(logits, tgt_out):
        return F.cross_entropy(logits.flatten(0, 1).float(), tgt_out.flatten(), ignore_index=0, label_smoothing=0.1)

    def loss_fn(inputs, tgt_out):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(*inputs)
        return token_loss(logits, tgt_out)

    mode = "reduce-overhead" if "cudagraphs" in opts else None
    if "lossc" in opts:
        loss_fn = torch.compile(loss_fn, mode=mode)
    elif "compile" in opts:
        model = torch.compile(model, mode=mode)
    elif "regional" in opts:  # each layer on its own, and the loss
        for layer in (*model.encoder, *model.decoder):
            layer.compile()
        token_loss = torch.compile(token_loss)  # loss_fn looks the name up at call time

    def step():
        loss_fn(inputs, tgt_out).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.inputs = inputs
    return step, per_step


def mask_build_ms(src_doc, tgt_doc) -> dict:
    """Milliseconds to build a packed batch's three block masks: eagerly, and compiled on its own."""
    from seq2seq import document_masks

    out = {}
    for name, fn in (("eager", document_masks), ("compiled", torch.compile(document_masks))):
        for _ in range(3):
            fn(src_doc, tgt_doc)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn(src_doc, tgt_doc)
        torch.cuda.synchronize()
        out[f"mask_ms_{name}"] = round((time.perf_counter() - t0) * 100, 3)
    return out


KERNEL_KINDS = [  # (kind, substrings of CUDA kernel names), first match wins
    ("attention (SDPA)", ("fmha", "flash", "attention", "efficient", "cudnn")),  # the model's only cuDNN use
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "sm80_")),
    ("optimizer", ("multi_tensor", "adam")),
    ("fused elementwise/norm (Triton)", ("triton",)),
    ("loss (eager)", ("softmax", "nll", "cross_entropy")),
]


def profile_step(step, path: Path, steps: int = 5) -> dict:
    """Profile ``steps`` calls of a warmed-up ``step``: GPU kernel time by kind, per step, against the wall time.
    Writes the top kernels to ``path``. A kernel total well under the wall time means the GPU waits on the host."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    us = {e.key: e.self_device_time_total / steps for e in kernels}  # microseconds per step
    kinds: dict[str, float] = {}
    for name, t in us.items():
        kind = next((k for k, subs in KERNEL_KINDS if any(x in name.lower() for x in subs)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + t / 1e3
    top = sorted(us.items(), key=lambda kv: -kv[1])[:30]
    lines = [f"wall {wall * 1e3:.2f} ms/step, GPU kernels {sum(us.values()) / 1e3:.2f} ms/step"]
    lines += [f"  {k}: {v:.2f} ms" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])]
    lines += ["top kernels (ms/step, name):"] + [f"  {t / 1e3:8.3f}  {n[:150]}" for n, t in top]
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[: 2 + len(kinds)]), file=sys.stderr)
    return {"wall_ms": wall * 1e3, "kernel_ms": sum(us.values()) / 1e3, **{k: round(v, 2) for k, v in kinds.items()}}


def bare_transformer_row(args, preset: str, vocab: int, tokens: int, opts: list[str], mfu_per_tok: float, device):
    """Time (and with "profile" in opts, profile) the bare step of one --tr-configs entry; returns its row."""
    torch.backends.cuda.enable_cudnn_sdp("cudnn" in opts)  # as transformer/train.py: no cuDNN attention unless asked
    length = args.pack_len if "packed" in opts else 24
    t0 = time.perf_counter()
    step, per_step = bare_transformer_step(preset, vocab, tokens, length, device, opts)
    step()  # the first step compiles
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    rate = timed(step, args.iters, 10, per_step, device)
    extra = ", compile" * ("compile" in opts) + ", model and loss compiled together" * ("lossc" in opts)
    extra += ", each layer and the loss compiled apart" * ("regional" in opts)
    extra += ", CUDA graphs" * ("cudagraphs" in opts)
    extra += ", cuDNN attention" * ("cudnn" in opts)
    shape = f"packed {tokens // length}x{length} rows, {per_step} real target tokens" if "packed" in opts else (
        f"{tokens} tokens as {per_step // 24}x24")  # fmt: skip
    what = f"bare step {preset}, {shape}, bf16{extra}"
    row = {"bench": "transformer", "what": what, "tok_per_s": rate, "mfu": mfu_per_tok * rate}
    row["first_step_s"] = round(first_s, 1)
    if "packed" in opts and device.type == "cuda":
        row.update(mask_build_ms(*step.inputs[2:]))
    if "profile" in opts:
        try:
            row["profile"] = profile_step(step, Path(args.out) / f"profile_{'_'.join([preset, *opts])}.txt")
        except Exception as e:  # the profile is extra: keep the timing row
            row["profile"] = f"FAILED: {e}"
    return row


def bench_transformer(args, device, rows):
    """Target tokens/s: the tutorial-style loop (every sentence padded to 350, fp32, batch 8) vs transformer/train.py
    (packed rows, bf16) on Multi30k, and bare compiled steps on packed rows and on unpadded batches as the
    ceilings. MFU = 6 * params * target tokens/s / peak: conservative, since the encoder's FLOPs follow the
    source tokens (German has about 10% more than English) and attention (under 2% at ~15-token sentences) is
    left out."""
    vocab = 8000
    peak = args.peak_tflops * 1e12
    configs = [c.split(":") for c in args.tr_configs.split(",")] if not args.tiny else [["tiny", "256", "cudnn"]]
    for preset in dict.fromkeys(c[0] for c in configs):  # the baseline once per preset
        pad_to, batch = (350, 8) if not args.tiny else (40, 2)
        step, real = baseline_transformer_step(preset, vocab, pad_to, batch, device)
        rate = timed(step, args.iters if not args.tiny else 2, 5 if not args.tiny else 1, real, device)
        what = f"baseline loop, {preset}, pad {pad_to}, fp32, batch {batch}"
        rows.append({"bench": "transformer", "what": what, "tok_per_s": rate})
        del step
    data = ["--data", args.multi30k, "--lang-src", "de", "--lang-tgt", "en"] if args.multi30k else ["--synthetic"]
    nprocs = [n for n in map(int, args.tr_nprocs.split(",")) if n == 1 or n <= torch.cuda.device_count()]
    for preset, tokens, *opts in configs:
        n_params = transformer_params(preset, vocab)
        if device.type == "cuda" and "bare" in opts:
            rows.append(bare_transformer_row(args, preset, vocab, int(tokens), opts, n_params * 6 / peak, device))
            torch.cuda.empty_cache()
            continue
        for nproc in nprocs:
            out = Path(args.out) / f"tr_{preset}_{tokens}_{'_'.join(opts)}_{nproc}"
            launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                          f"--nproc_per_node={nproc}"]  # fmt: skip
            cmd = [*launch, "transformer/train.py", *data, "--preset", preset, "--max-tokens", tokens,
                   "--max-steps", str(args.tr_steps) if not args.tiny else "3", "-p", "10" if not args.tiny else "1",
                   "--eval-every", "0", "-j", str(args.tr_workers) if not args.tiny else "0",
                   "--output-dir", str(out), "--resume", "none", "--overwrite"]  # fmt: skip
            cmd += ["--compile"] if "compile" in opts else []
            cmd += ["--compile-mode", "reduce-overhead"] if "cudagraphs" in opts else []
            cmd += ["--cudnn-attention"] if "cudnn" in opts else []
            cmd += ["--vocab-size", str(vocab)] if not args.tiny else []
            compiled = ", compile" * ("compile" in opts) + ", CUDA graphs" * ("cudagraphs" in opts)
            compiled += ", cuDNN attention" * ("cudnn" in opts)
            what = f"transformer/train.py {preset}, {tokens} tok/GPU, {nproc} GPU(s), bf16{compiled}"
            row = script_row("transformer", what, cmd, out, "tok_per_s", 3 if not args.tiny else 1)
            if "tok_per_s" in row and device.type == "cuda":
                row["mfu"] = 6 * n_params * row["tok_per_s"] / (peak * nproc)
            rows.append(row)


BENCHES = {"resnet50": bench_resnet50, "jpeg": bench_jpeg, "cifar": bench_cifar, "transformer": bench_transformer}


def environment(device: torch.device) -> dict:
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "device": str(device),
        "gpu_count": torch.cuda.device_count(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


class Results(list):
    """The rows measured so far. Every append rewrites results.json and results.md, so a run stopped by a time
    limit still leaves each finished measurement on disk."""

    def __init__(self, out: Path, env: dict):
        super().__init__()
        self.out, self.env = out, env

    def append(self, row: dict) -> None:
        super().append(row)
        (self.out / "results.json").write_text(json.dumps({"env": self.env, "rows": self}, indent=2))
        (self.out / "results.md").write_text(to_markdown(self.env, self))


def to_markdown(env: dict, rows: list[dict]) -> str:
    lines = [f"Device: {env.get('gpu', 'CPU')} x{env['gpu_count']}; torch {env['torch']}, CUDA {env['cuda']}", ""]
    cols = ["bench", "what", "batch", "img_per_s", "tok_per_s", "epoch_s", "mfu", "cpu_cores", "sm_util", "gpu_util",
            "jpg_util", "first_step_s", "wall", "cmd"]  # fmt: skip
    cols = [c for c in cols if any(c in r for r in rows)]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(cell(c, r.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def cell(col: str, v) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if v > 100 else f"{v:.3g}"
    return "" if v is None else f"`{v}`" if col == "cmd" and v else str(v)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--only", default="", help="comma-separated subset of: " + ",".join(BENCHES))
    p.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny sizes, no timings worth reading")
    p.add_argument("--iters", type=int, default=30, help="timed iterations per bare measurement")
    p.add_argument("--script-steps", type=int, default=60, help="--max-steps for script measurements")
    p.add_argument("--rn50-batch", type=int, default=256)
    p.add_argument("--rn50-configs", default="fp32,bf16cl,compile", help="ResNet-50 subset of: fp32,bf16cl,compile")
    p.add_argument("--jpeg-images", type=int, default=20480, help="training JPEGs for the jpeg benchmark")
    p.add_argument("--gpu-decode-workers", type=int, default=8, help="-j of the jpeg benchmark's --gpu-decode rows")
    p.add_argument("--cifar-archs", default="resnet18", help="comma-separated: resnet18,resnet50")
    p.add_argument("--cifar-dir", default=None, help="CIFAR ImageFolder (train/<class>/*.jpg); default: --synthetic")
    p.add_argument("--multi30k", default=None, help="Multi30k dir ({split}.{lang}.gz); default: --synthetic")
    p.add_argument(
        "--tr-configs",
        default="small:8192,base:65536:compile:bare,base:65536:compile",
        help="transformer runs, comma-separated PRESET:TOKENS_PER_GPU[:compile][:bare[:lossc|:regional]"
        "[:profile][:packed][:cudagraphs]][:cudnn] "
        "(bare: the bare step only; see bare_transformer_step)",
    )
    p.add_argument("--pack-len", type=int, default=1024, help="row length of the packed bare transformer steps")
    p.add_argument("--tr-steps", type=int, default=60, help="--max-steps of each transformer script run")
    p.add_argument("--tr-nprocs", default="1,2,4", help="GPU counts of the transformer script runs (those present)")
    p.add_argument("--tr-workers", type=int, default=4, help="-j of each transformer script run")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU for MFU (H100/H200 SXM)")
    p.add_argument("-j", "--workers", type=int, default=min(16, os.cpu_count() or 1))
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default for convolutions
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = Results(Path(args.out), environment(device))
    for name in args.only.split(",") if args.only else BENCHES:
        t0 = time.time()
        try:
            BENCHES[name](args, device, rows)
        except Exception as e:  # keep going: one broken measurement must not lose the others
            rows.append({"bench": name, "what": f"FAILED: {str(e).splitlines()[0][:200]}"})
            print(e, file=sys.stderr)
        print(f"[{name}] {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    print(to_markdown(rows.env, rows))


if __name__ == "__main__":
    main()
