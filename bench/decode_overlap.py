"""How well each --gpu-decode pipeline hides behind a compiled ResNet-50 step, in one process (one compile).

    python bench/decode_overlap.py --data DIR --out OUT     # DIR: an ImageFolder (bench/benchmark.py's jpeg500)
    python bench/decode_overlap.py --tiny --out OUT         # CPU smoke test: tiny images, torchvision only

For each pipeline (decoder; pinned or pageable file bytes; prefetch threads; side stream priority; training on
the default stream or another) it trains ``--steps`` steps fed by the real
pipeline (DataLoader of file bytes -> GpuTransform -> prefetch) and reports wall ms per step, against the
same step on one resident batch, and the CPU cores the process and its workers kept busy. Then it times one
``GpuTransform`` call alone, on an idle GPU and behind 200 ms of queued matmuls, to show whether decoding
waits for the device. Writes OUT/decode_overlap.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from benchmark import cpu_seconds, make_jpeg_folder  # noqa: E402

from common.data import ResumableDistributedSampler  # noqa: E402
from imagenet.gpu_decode import EncodedImages, GpuTransform, collate_encoded, nvimgcodec_decoders, prefetch  # noqa: E402

# name: (decoder, pinned file bytes, prefetch threads, side stream priority, train on a non-default stream)
VARIANTS = {
    "torchvision": ("torchvision", True, 1, 0, False),
    "torchvision_t2": ("torchvision", True, 2, 0, False),
    "torchvision_trainstream": ("torchvision", True, 1, 0, True),
    "nv_pageable_t1": ("nvimgcodec", False, 1, 0, False),
    "nv_pinned_t1": ("nvimgcodec", True, 1, 0, False),
    "nv_pinned_t2": ("nvimgcodec", True, 2, 0, False),
    "nv_pinned_t2_high": ("nvimgcodec", True, 2, -1, False),
    "nv_pinned_t3": ("nvimgcodec", True, 3, 0, False),
    "nv_pinned_t2_trainstream": ("nvimgcodec", True, 2, 0, True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", help="ImageFolder root with train/")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("-b", "--batch-size", type=int, default=256)
    p.add_argument("-j", "--workers", type=int, default=8)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--tiny", action="store_true", help="CPU smoke test")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    cuda = device.type == "cuda"
    if args.tiny:
        args.data = str(out / "tiny")
        make_jpeg_folder(Path(args.data), 48, 0, (40, 30), classes=2, workers=2)
        args.batch_size, args.workers, args.steps, args.warmup, size = 8, 1, 2, 1, 32
        args.variants = "torchvision,torchvision_trainstream"
    else:
        size = 224
    ds = torchvision.datasets.ImageFolder(str(Path(args.data) / "train"))
    sampler = ResumableDistributedSampler(len(ds), seed=0)
    loaders = {
        pinned: torch.utils.data.DataLoader(
            EncodedImages(ds.samples, 0), args.batch_size, sampler=sampler, num_workers=args.workers,
            collate_fn=collate_encoded, pin_memory=pinned and cuda, drop_last=True, persistent_workers=args.workers > 0,
        )
        for pinned in (True, False)
    }  # fmt: skip
    model = torchvision.models.resnet50(num_classes=len(ds.classes)).to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fwd = torch.compile(model) if cuda else model

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            F.cross_entropy(fwd(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    results: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__}
    x = torch.randn(args.batch_size, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, len(ds.classes), (args.batch_size,), device=device)
    t0 = time.time()
    for _ in range(3):
        step(x, y)
    sync()
    print(f"compile and warm-up {time.time() - t0:.0f}s", flush=True)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(x, y)
    sync()
    results["resident_ms"] = round((time.perf_counter() - t0) / args.steps * 1e3, 2)
    print(f"resident batch: {results['resident_ms']} ms/step", flush=True)

    if cuda:
        for slot in range(3):
            t0 = time.perf_counter()
            nvimgcodec_decoders(device, slot)
            results[f"nvimgcodec_decoders_{slot}_s"] = round(time.perf_counter() - t0, 2)
        print({k: v for k, v in results.items() if k.startswith("nvimgcodec_decoders")}, flush=True)

    epoch = 0
    for name in args.variants.split(","):
        decoder, pinned, threads, priority, own_stream = VARIANTS[name]
        epoch += 1
        sampler.set_epoch(epoch)
        tf = GpuTransform(device, size, decoder=decoder)
        train_stream = torch.cuda.Stream(device) if own_stream and cuda else None
        with torch.cuda.stream(train_stream) if train_stream is not None else contextlib.nullcontext():
            batches = prefetch(loaders[pinned], tf, threads=threads, priority=priority)
            try:
                for _ in range(args.warmup):
                    x, y, _ = next(batches)
                    step(x, y)
                sync()
                t0, c0 = time.perf_counter(), cpu_seconds(os.getpid())
                for _ in range(args.steps):
                    x, y, _ = next(batches)
                    step(x, y)
                sync()
                wall, cores = time.perf_counter() - t0, (cpu_seconds(os.getpid()) - c0)
            finally:
                batches.close()
        ms = wall / args.steps * 1e3
        results[name] = {"ms_per_step": round(ms, 2), "img_per_s": round(args.batch_size / ms * 1e3),
                         "vs_resident": round(results["resident_ms"] / ms, 3), "cpu_cores": round(cores / wall, 2),
                         "counts": dict(tf.counts)}  # fmt: skip
        print(f"{name}: {results[name]}", flush=True)

    # one transform call alone: does it wait for the device?
    for decoder in ("nvimgcodec", "torchvision") if cuda else ():
        tf = GpuTransform(device, size, decoder=decoder)
        sampler.set_epoch(99)
        batch = next(iter(loaders[True]))
        side = torch.cuda.Stream(device)
        times = {}
        for busy in (False, True, False, True, False, True):
            a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
            sync()
            if busy:  # ~200 ms of matmuls on the default stream (about 1.1 ms each on an H100)
                for _ in range(180):
                    a @ a
            t0 = time.perf_counter()
            with torch.cuda.stream(side):
                tf(batch)
            times.setdefault("busy" if busy else "idle", []).append((time.perf_counter() - t0) * 1e3)
            t1 = time.perf_counter()
            sync()
            times.setdefault("busy_rest" if busy else "idle_rest", []).append((time.perf_counter() - t1) * 1e3)
        results[f"transform_host_ms_{decoder}"] = {k: round(statistics.median(v), 1) for k, v in times.items()}
        print(f"transform_host_ms_{decoder}: {results[f'transform_host_ms_{decoder}']}", flush=True)
    (out / "decode_overlap.json").write_text(json.dumps(results, indent=1))
    os._exit(0)  # skip the persistent workers' and decoders' teardown


if __name__ == "__main__":
    main()
