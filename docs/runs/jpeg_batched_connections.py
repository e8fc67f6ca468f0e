"""With the batched crop-resize kernel, the GPU idles between steps while the next batch is decoded: does the decode
still wait behind the queued training kernels (CUDA maps streams onto CUDA_DEVICE_MAX_CONNECTIONS hardware queues,
8 by default)? Per decoder and number of prefetch threads, the step time of a compiled bf16 ResNet-50 fed by the
real pipeline (GpuTransform, prefetch, 8 DataLoader workers), three repetitions interleaved, against the same step
on a resident batch. Run from the repository root once per value:
    CUDA_DEVICE_MAX_CONNECTIONS=8 python3 docs/runs/jpeg_batched_connections.py
    CUDA_DEVICE_MAX_CONNECTIONS=32 python3 docs/runs/jpeg_batched_connections.py"""

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

print("CUDA_DEVICE_MAX_CONNECTIONS", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), flush=True)
root = Path("/tmp/js")
if not (root / "train" / "class099").exists():
    make_jpeg_folder(root, 4096, 0, workers=16)
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


def fed(batches, n: int) -> float:
    for i in range(3 + n):
        if i == 3:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        x, y, _ = next(batches)
        step(x, y)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


x = torch.randn(256, 3, 224, 224, device=dev).contiguous(memory_format=torch.channels_last)
y = torch.randint(0, 100, (256,), device=dev)
for _ in range(3):
    step(x, y)
res = {}
forever = itertools.chain.from_iterable(itertools.repeat(loader))
transforms = {d: GpuTransform(dev, 224, decoder=d) for d in ("torchvision", "nvimgcodec")}
for rep in range(3):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        step(x, y)
    torch.cuda.synchronize()
    res.setdefault("resident ms", []).append(round((time.perf_counter() - t0) / 20 * 1e3, 2))
    for (decoder, tf), threads in itertools.product(transforms.items(), (1, 2, 3)):
        batches = prefetch(forever, tf, threads=threads)
        res.setdefault(f"{decoder}: fed ms/step, {threads} thread(s)", []).append(round(fed(batches, 40) * 1e3, 2))
        batches.close()
    print(json.dumps(res), flush=True)
res = {k: {"median": statistics.median(v), "runs": v} for k, v in res.items()}
print("FINAL " + json.dumps(res), flush=True)
