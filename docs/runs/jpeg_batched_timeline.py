"""Where does a fed step lose time to the resident one, with the batched crop-resize kernel? A compiled bf16
ResNet-50 fed by the real pipeline (GpuTransform, prefetch, 8 DataLoader workers), per decoder and prefetch
configuration (threads, side-stream priority; -1 is high): the fed step time (two repetitions, 40 steps each), then
an 8-step torch.profiler window of the default configuration, read back from its trace: how long the training
loop waits for each batch (the "wait" span around next(batches)), how long each GpuTransform call spends in its
decode and crop_resize spans, and how much of the window the training stream is busy. Run from the repository
root once per CUDA_DEVICE_MAX_CONNECTIONS value (8 is CUDA's default)."""

import gzip
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
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.getcwd())
from bench.benchmark import make_jpeg_folder  # noqa: E402
from common.data import ResumableDistributedSampler  # noqa: E402
from imagenet.gpu_decode import EncodedImages, GpuTransform, collate_encoded, prefetch  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp"))
conn = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")
print("CUDA_DEVICE_MAX_CONNECTIONS", conn, flush=True)
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
        with record_function("wait"):
            x, y, _ = next(batches)
        step(x, y)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def summarize(trace: dict) -> dict:
    spans, kernels = {}, {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "user_annotation" and e["name"] in ("wait", "gpu_decode.decode", "gpu_decode.crop_resize"):
            spans.setdefault(e["name"], []).append(e["dur"] / 1e3)
        elif e.get("cat") == "kernel":
            kernels.setdefault(e["args"].get("stream"), []).append((e["ts"], e["ts"] + e["dur"]))
    main = max(kernels.values(), key=len)  # the training stream launches by far the most kernels
    t0, t1 = min(a for a, _ in main), max(b for _, b in main)
    busy, end = 0.0, t0
    for a, b in sorted(main):
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    out = {
        f"{k} ms (median, max, n)": [round(statistics.median(v), 2), round(max(v), 2), len(v)] for k, v in spans.items()
    }
    out["training stream busy fraction"] = round(busy / (t1 - t0), 3)
    return out


x = torch.randn(256, 3, 224, 224, device=dev).contiguous(memory_format=torch.channels_last)
y = torch.randint(0, 100, (256,), device=dev)
for _ in range(3):
    step(x, y)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(20):
    step(x, y)
torch.cuda.synchronize()
res = {"resident ms": round((time.perf_counter() - t0) / 20 * 1e3, 2)}
forever = itertools.chain.from_iterable(itertools.repeat(loader))
for decoder in ("torchvision", "nvimgcodec"):
    tf = GpuTransform(dev, 224, decoder=decoder)
    for rep, (threads, priority) in itertools.product(range(2), ((1, 0), (2, 0), (2, -1))):
        batches = prefetch(forever, tf, threads=threads, priority=priority)
        ms = fed(batches, 40) * 1e3
        batches.close()
        res.setdefault(f"{decoder}: fed ms/step, threads {threads}, priority {priority}", []).append(round(ms, 2))
    batches = prefetch(forever, tf)
    fed(batches, 3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        res[f"{decoder}: profiled fed ms/step (default prefetch)"] = round(fed(batches, 8) * 1e3, 2)
    batches.close()
    path = OUT / f"trace_{decoder}_conn{conn}.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    res[f"{decoder}: profiled window"] = summarize(trace)
    with gzip.open(str(path) + ".gz", "wt") as f:
        json.dump(trace, f)
    path.unlink()
    print(json.dumps(res), flush=True)
print("FINAL " + json.dumps(res), flush=True)
