"""One benchmark entry point: bare training-step baselines and the scripts, measured side by side.

    python bench/benchmark.py --out bench_out                 # on a GPU machine: everything that fits
    python bench/benchmark.py --only resnet50,cifar --out o   # a subset
    python bench/benchmark.py --tiny --out o                  # CPU smoke mode (CI runs this so it cannot rot)

All parts together take longer than one 10-minute slot: on one H200 the two compiled ResNet-50 rows took about
3 min and the transformer part about 4 min; on an H100 the jpeg part took 161 s. A compiled transformer `base`
script run compiles for about 35 s on an H100 since `--compile` compiles each layer on its own (it took 368 s
when the whole model was compiled). Run the parts separately (--only).

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
sys.path.insert(0, str(REPO))


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


def script_rate(cmd: list[str], out: Path, key: str, skip: int = 2) -> tuple[float, str]:
    """Run a train.py command; return the median of its logged ``key`` (after ``skip`` warm-up records)."""
    t0 = time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    vals = [r[key] for r in recs if r.get("split") == "train" and key in r][skip:]
    if not vals:
        raise RuntimeError(f"no {key} records in {out}/metrics.jsonl")
    return statistics.median(vals), f"{time.time() - t0:.0f}s"


def cmd_str(cmd: list[str]) -> str:
    return " ".join(str(c) for c in cmd).replace(sys.executable, "python3")


def script_row(bench: str, what: str, cmd: list[str], out: Path, key: str, skip: int = 2, **extra) -> dict:
    """Run a train.py command and return its results row: the median ``key``, wall time and exact command.
    A failed run becomes a FAILED row, so one broken configuration does not lose the measurements after it."""
    try:
        rate, wall = script_rate(cmd, out, key, skip)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return {"bench": bench, "what": f"FAILED: {what}"}
    return {"bench": bench, "what": what, **extra, key: rate, "wall": wall, "cmd": cmd_str(cmd)}


# ------------------------------------------------------------------ measurements

# name -> (description, autocast dtype, channels_last, compile, the same as imagenet/train.py flags)
RN50_CONFIGS = {
    "fp32": ("fp32 (TF32 convs, eager)", None, False, False, ["--amp", "none", "--no-channels-last"]),
    "bf16cl": ("bf16 + channels_last", torch.bfloat16, True, False, ["--amp", "bf16", "--channels-last"]),
    "compile": ("bf16 + channels_last + compile", torch.bfloat16, True, True,
                ["--amp", "bf16", "--channels-last", "--compile"]),
}  # fmt: skip


def bench_resnet50(args, device, rows):
    """ResNet-50 bare steps vs imagenet/train.py --dummy (issue: >= 6,500 img/s bf16+cl+compile on 1 GPU)."""
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
               "--output-dir", str(out), "--resume", "none", *flags]  # fmt: skip
        if args.tiny:
            cmd += ["--train-crop-size", "64", "--val-crop-size", "64", "--val-resize-size", "72", "-j", "0"]
            cmd += ["--dummy-sizes", "64", "16"]  # the end-of-run evaluation would otherwise see 50,000 images
        rows.append(script_row("resnet50", f"imagenet/train.py --dummy, {name}", cmd, out, "img_per_s", batch=b))


def cifar_bare_epoch(args, device, n: int) -> float:
    """Seconds per epoch of n images for a bare ResNet-18 (CIFAR stem) loop with GPU-resident data."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    b = 512 if not args.tiny else 8
    step = bare_vision_step(
        model,
        b,
        32,
        10,
        torch.bfloat16 if device.type == "cuda" else None,
        device.type == "cuda",
        device.type == "cuda" and not args.tiny,
        device,
    )
    rate = timed(step, args.iters if not args.tiny else 2, 10 if not args.tiny else 1, b, device)
    return n / rate


def bench_cifar(args, device, rows):
    """CIFAR ResNet-18: bare loop epoch vs cifar_resnet/train.py --gpu-data epoch (issue: <= 1.0 s/epoch)."""
    n = 45000 if not args.tiny else 64
    epoch_s = cifar_bare_epoch(args, device, n)
    what = "bare step ResNet-18, bf16+cl+compile, resident data"
    rows.append({"bench": "cifar", "what": what, "img_per_s": n / epoch_s, "epoch_s": epoch_s})
    data = ["--data-dir", args.cifar_dir, "--val-split", "5000"] if args.cifar_dir else ["--synthetic"]
    for name, flags in [("--gpu-data", ["--gpu-data"]), ("DataLoader (Pillow)", ["-j", str(args.workers)])]:
        out = Path(args.out) / f"cifar_{len(rows)}"
        cmd = [sys.executable, "cifar_resnet/train.py", *data, "-b", "512" if not args.tiny else "8",
               "--epochs", "3" if not args.tiny else "1", "-p", "20" if not args.tiny else "1",
               "--output-dir", str(out), "--resume", "none", *flags]  # fmt: skip
        if not args.tiny:
            cmd.append("--compile")
        else:
            cmd += ["--max-steps", "3", "-j", "0"]
        row = script_row("cifar", f"cifar_resnet/train.py {name}", cmd, out, "img_per_s", 1 if args.tiny else 3)
        rows.append({**row, "epoch_s": n / row["img_per_s"]} if "img_per_s" in row else row)


def _upscale(job: tuple[str, str, int, int]) -> int:
    """Resize one JPEG to (width, height), re-encode at quality 90; returns the new file's size in bytes."""
    import PIL.Image

    src, dst, w, h = job
    PIL.Image.open(src).convert("RGB").resize((w, h), PIL.Image.BICUBIC).save(dst, quality=90)
    return os.path.getsize(dst)


def make_jpeg_folder(cifar_dir: str, root: Path, n_train: int, n_val: int, size=(500, 375), workers: int = 16):
    """ImageNet-sized JPEGs from the CIFAR ones: train/ and val/ ImageFolders of `size` images at quality 90."""
    from multiprocessing import Pool

    files = sorted(Path(cifar_dir, "train").glob("*/*.jpg"))
    if len(files) < n_train + n_val:
        raise RuntimeError(f"{cifar_dir}/train has {len(files)} JPEGs, need {n_train + n_val}")
    picks = [files[i] for i in torch.randperm(len(files), generator=torch.Generator().manual_seed(0)).tolist()]
    jobs = []
    for k, f in enumerate(picks[: n_train + n_val]):
        d = root / ("train" if k < n_train else "val") / f.parent.name
        d.mkdir(parents=True, exist_ok=True)
        jobs.append((str(f), str(d / f.name), *size))
    with Pool(workers) as pool:
        sizes = pool.map(_upscale, jobs, chunksize=64)
    return sum(sizes) / len(sizes)


def bench_jpeg(args, device, rows):
    """ResNet-50 on real JPEG files (issue: >= 4,500 img/s per GPU): the Pillow DataLoader path vs --gpu-decode
    on the same ImageFolder of CIFAR images upscaled to 500x375 and re-encoded at quality 90."""
    if not args.cifar_dir and not args.tiny:
        raise RuntimeError("--only jpeg needs --cifar-dir (the CIFAR JPEG ImageFolder to upscale)")
    root = Path(args.out) / "jpeg500"
    cifar_dir, n_train, n_val, size = args.cifar_dir, args.jpeg_images, 512, (500, 375)
    if args.tiny:  # a few made-up 32 px JPEGs in the CIFAR layout stand in for the real ones
        import PIL.Image

        cifar_dir, n_train, n_val, size = str(Path(args.out) / "cifar"), 16, 8, (40, 30)
        for i in range(24):
            d = Path(cifar_dir, "train", f"class{i % 2}")
            d.mkdir(parents=True, exist_ok=True)
            PIL.Image.new("RGB", (32, 32), (40 * i % 256, 200 * (i % 2), 90)).save(d / f"{i}.jpg", quality=90)
    t0 = time.time()
    mean_bytes = make_jpeg_folder(cifar_dir, root, n_train, n_val, size, workers=args.workers)
    what = f"{n_train} JPEGs of {size[0]}x{size[1]} q90 ({mean_bytes / 1e3:.0f} KB)"
    print(f"[jpeg] {what} + {n_val} for val in {time.time() - t0:.0f}s", file=sys.stderr)
    b = args.rn50_batch if not args.tiny else 4
    for name, flags in [("Pillow DataLoader", []), ("--gpu-decode", ["--gpu-decode"])]:
        out = Path(args.out) / f"jpeg_{len(rows)}"
        cmd = [sys.executable, "imagenet/train.py", str(root), "-a", "resnet50", "-b", str(b), "--epochs", "1",
               "-p", "10", "-j", str(args.workers), "--output-dir", str(out), "--resume", "none", *flags]  # fmt: skip
        if args.tiny:
            cmd += ["--max-steps", "3", "-p", "1", "-j", "0", "--train-crop-size", "32", "--val-resize-size", "36",
                    "--val-crop-size", "32"]  # fmt: skip
        else:
            cmd += ["--amp", "bf16", "--channels-last", "--compile"]
        what_run = f"imagenet/train.py ResNet-50, {what}, {name}"
        rows.append(script_row("jpeg", what_run, cmd, out, "img_per_s", 2 if not args.tiny else 1, batch=b))


def build_transformer(preset: str, vocab: int, dropout: float | None = None) -> nn.Module:
    from transformer.model import PRESETS, ModelConfig, Transformer

    cfg = {**PRESETS[preset], **({} if dropout is None else {"dropout": dropout})}
    return Transformer(ModelConfig(vocab_size=vocab, **cfg))


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
    mode="reduce-overhead" to "compile"/"lossc", "nodrop" sets dropout to 0 (what dropout costs); "cudnn"
    (bare_transformer_row) lets attention use cuDNN.
    Returns (step, target tokens per step)."""
    model = build_transformer(preset, vocab, dropout=0.0 if "nodrop" in opts else None).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(0)
    if "packed" in opts:
        from transformer.data import PackedRows, ParallelDataset, pack_rows

        rows, n = max(1, tokens // length), 4 * tokens // 15  # more pairs than the rows can take
        src_lens, tgt_lens = torch.randint(8, 24, (2, n), generator=g).tolist()
        sizes = pack_rows([s + 1 for s in src_lens], [t + 1 for t in tgt_lens], length - 1)[:rows]
        pairs = ParallelDataset(*([torch.randint(4, vocab, (k,), generator=g).tolist() for k in lens]
                                  for lens in (src_lens, tgt_lens)))  # fmt: skip
        bounds = [0, *itertools.accumulate(sizes)]
        batch = torch.utils.data.default_collate([PackedRows(pairs, length)[list(range(a, b))]
                                                  for a, b in zip(bounds, bounds[1:])])  # fmt: skip
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
    from transformer.model import document_masks

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
    from transformer.model import allow_cudnn_attention

    allow_cudnn_attention("cudnn" in opts)  # as transformer/train.py: no cuDNN attention unless asked for
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
    extra += ", dropout 0" * ("nodrop" in opts) + ", cuDNN attention" * ("cudnn" in opts)
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
    (token-budget batches, dynamic padding, bf16) on Multi30k, and a bare compiled step on unpadded batches as
    the ceiling. MFU = 6 * params * target tokens/s / peak: conservative, since the encoder's FLOPs follow the
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
                   "--output-dir", str(out), "--resume", "none"]  # fmt: skip
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
    limit still leaves each finished measurement on disk (a third-session device call lost 8 minutes of
    transformer runs because the file was written only at the end of the part)."""

    def __init__(self, out: Path, env: dict):
        super().__init__()
        self.out, self.env = out, env

    def append(self, row: dict) -> None:
        super().append(row)
        (self.out / "results.json").write_text(json.dumps({"env": self.env, "rows": self}, indent=2))
        (self.out / "results.md").write_text(to_markdown(self.env, self))


def to_markdown(env: dict, rows: list[dict]) -> str:
    lines = [f"Device: {env.get('gpu', 'CPU')} x{env['gpu_count']}; torch {env['torch']}, CUDA {env['cuda']}", ""]
    cols = ["bench", "what", "batch", "img_per_s", "tok_per_s", "epoch_s", "mfu", "first_step_s", "wall", "cmd"]
    cols = [c for c in cols if any(c in r for r in rows)]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            v = "" if v is None else v
            cells.append(
                f"{v:,.0f}"
                if isinstance(v, float) and v > 100
                else f"{v:.3g}"
                if isinstance(v, float)
                else f"`{v}`"
                if c == "cmd" and v
                else str(v)
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--only", default="", help="comma-separated subset of: " + ",".join(BENCHES))
    p.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny sizes, no timings worth reading")
    p.add_argument("--iters", type=int, default=30, help="timed iterations per bare measurement")
    p.add_argument("--script-steps", type=int, default=60, help="--max-steps for script measurements")
    p.add_argument("--rn50-batch", type=int, default=256)
    p.add_argument("--rn50-configs", default="fp32,bf16cl,compile", help="ResNet-50 subset of: fp32,bf16cl,compile")
    p.add_argument("--jpeg-images", type=int, default=25600, help="training JPEGs for the jpeg benchmark")
    p.add_argument("--cifar-dir", default=None, help="CIFAR ImageFolder (train/<class>/*.jpg); default: --synthetic")
    p.add_argument("--multi30k", default=None, help="Multi30k dir ({split}.{lang}.gz); default: --synthetic")
    p.add_argument(
        "--tr-configs",
        default="small:8192,base:65536:compile:bare,base:65536:compile",
        help="transformer runs, comma-separated PRESET:TOKENS_PER_GPU[:compile][:bare[:lossc|:regional][:nodrop]"
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
