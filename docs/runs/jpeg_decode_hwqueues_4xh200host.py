"""Why does a --gpu-decode batch wait for the training kernels queued before it? Per decoder, the host time of one
GpuTransform call (256 files of 100 KB) on an idle GPU and behind 180 queued matmuls, queued on the default stream
or on a non-blocking one, and the step time of a compiled bf16 ResNet-50 fed by prefetch (1 or 2 threads) with the
training on either stream, against the same step on a resident batch. Run it from the repository root, once per
CUDA_DEVICE_MAX_CONNECTIONS value (the number of hardware queues that CUDA streams share; 8 by default)."""

import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision

sys.path.insert(0, os.getcwd())
from bench.benchmark import make_jpeg_folder  # noqa: E402
from common.data import ResumableDistributedSampler  # noqa: E402
from imagenet.gpu_decode import EncodedImages, GpuTransform, collate_encoded, prefetch  # noqa: E402

root = Path("/tmp/js")
print("CUDA_DEVICE_MAX_CONNECTIONS", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), flush=True)
t0 = time.time()
if not (root / "train" / "class099").exists():
    kb = make_jpeg_folder(root, 4096, 0, workers=16) / 1e3
    print(f"made 4096 JPEGs, {kb:.0f} KB mean, in {time.time() - t0:.0f}s", flush=True)
dev = torch.device("cuda")
ds = torchvision.datasets.ImageFolder(str(root / "train"))
loader = torch.utils.data.DataLoader(
    EncodedImages(ds.samples, 0), 256, sampler=ResumableDistributedSampler(len(ds), seed=0), num_workers=8,
    collate_fn=collate_encoded, pin_memory=True, drop_last=True, persistent_workers=True,
)  # fmt: skip
model = torchvision.models.resnet50(num_classes=100).to(dev, memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
fwd = torch.compile(model)


def step(x, y):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        F.cross_entropy(fwd(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


ts = torch.cuda.Stream(dev)  # a pool stream: created non-blocking
streams = {"default": torch.cuda.default_stream(dev), "nonblocking": ts}
res = {}
x = torch.randn(256, 3, 224, 224, device=dev).contiguous(memory_format=torch.channels_last)
y = torch.randint(0, 100, (256,), device=dev)
for name, s in streams.items():
    with torch.cuda.stream(s):
        for _ in range(3):
            step(x, y)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            step(x, y)
        torch.cuda.synchronize()
        res[f"resident ms, training on {name}"] = round((time.perf_counter() - t0) / 20 * 1e3, 2)
print(res, flush=True)


def fed(batches, n: int) -> float:
    for i in range(3 + n):
        if i == 3:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        x, y, _ = next(batches)
        step(x, y)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


batch = next(iter(loader))
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
for decoder in ("torchvision", "nvimgcodec"):
    try:
        tf, side = GpuTransform(dev, 224, decoder=decoder), torch.cuda.Stream(dev)
        for name, s in streams.items():
            host = {"idle": [], "busy": []}
            for busy in (False, True) * 3:
                torch.cuda.synchronize()
                with torch.cuda.stream(s):
                    for _ in range(180 if busy else 0):
                        a @ a
                t0 = time.perf_counter()
                with torch.cuda.stream(side):
                    tf(batch)
                host["busy" if busy else "idle"].append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            for k, v in host.items():
                res[f"{decoder}: transform host ms, {k}, matmuls on {name}"] = round(statistics.median(v), 1)
            for threads in (1, 2):
                with torch.cuda.stream(s):
                    batches = prefetch(itertools.chain.from_iterable(itertools.repeat(loader)), tf, threads=threads)
                    ms = fed(batches, 24) * 1e3
                    batches.close()
                res[f"{decoder}: fed ms/step, training on {name}, {threads} thread(s)"] = round(ms, 2)
            print(json.dumps(res, indent=1), flush=True)
    except Exception as e:
        print(f"{decoder} FAILED: {e!r}", flush=True)
print("FINAL " + json.dumps(res), flush=True)
