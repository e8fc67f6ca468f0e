"""Does one batched crop-resize kernel per batch (imagenet/crop_resize.py) feed ResNet-50 faster than torch's
resize per image? Per decoder, in one process on one GPU, interleaved: the step time of a compiled bf16 ResNet-50
fed by prefetch (1 and 2 threads) with GpuTransform (the batched kernel) and with PerImage (the transform as it was
before: per image a float copy of the crop and torch's antialiased resize, then the flips and the normalization
over the batch), against the same step on a resident batch. Also, on an idle GPU: the GPU time of the crop/resize
part alone for one decoded batch, and the host time of a whole transform call. Then a short torch.profiler window
of the fed step with the batched kernel: kernel time per CUDA stream and the top kernels.
Run from the repository root: python3 docs/runs/jpeg_batched_resize.py"""

import itertools
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.getcwd())
from bench.benchmark import make_jpeg_folder  # noqa: E402
from common.data import ResumableDistributedSampler  # noqa: E402
from imagenet.crop_resize import crop_resize  # noqa: E402
from imagenet.gpu_decode import (  # noqa: E402
    EncodedImages,
    GpuTransform,
    collate_encoded,
    decode,
    nvimgcodec_decoders,
    prefetch,
)

OUT = Path(os.environ.get("OUT", "/tmp"))


class PerImage(GpuTransform):
    """GpuTransform's training path before crop_resize: two kernels per image launched from Python, then three for
    the flips and one for the normalization."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.scale_t = torch.tensor(self.scale, device=self.device).view(1, 3, 1, 1)
        self.shift_t = torch.tensor(self.shift, device=self.device).view(1, 3, 1, 1)

    def __call__(self, batch, slot=0):
        nvdec = nvimgcodec_decoders(self.device, slot) if self.nvdec is not None else None
        images, keep, bad = decode(batch, self.device, nvdec, Counter())
        return self.crops(images, [batch.boxes[k] for k in keep]), batch.labels.to(self.device, non_blocking=True), bad

    def crops(self, images, boxes):
        x = torch.empty((len(images), 3, self.size, self.size), device=self.device)
        aa = torch.ops.aten._upsample_bilinear2d_aa
        for img, (top, left, h, w, _), row in zip(images, boxes, x.split(1)):
            aa.out(img[None, :, top : top + h, left : left + w].float(), (self.size, self.size), False, out=row)
        if flip := [i for i, b in enumerate(boxes) if b[4]]:
            idx = torch.tensor(flip).pin_memory().to(self.device, non_blocking=True)
            x.index_copy_(0, idx, x.index_select(0, idx).flip(-1))
        out = torch.empty(x.shape, device=self.device, memory_format=torch.channels_last)
        return torch.addcmul(self.shift_t, x, self.scale_t, out=out)


def batched_crops(tf, images, boxes):
    out = torch.empty((len(images), 3, tf.size, tf.size), device=tf.device, memory_format=torch.channels_last)
    return crop_resize(images, [tf._train_geometry(*b) for b in boxes], out, tf.scale, tf.shift)


root = Path("/tmp/js")
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


def fed(batches, n: int) -> float:
    for i in range(3 + n):
        if i == 3:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        x, y, _ = next(batches)
        step(x, y)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


res = {}
x = torch.randn(256, 3, 224, 224, device=dev).contiguous(memory_format=torch.channels_last)
y = torch.randint(0, 100, (256,), device=dev)
for _ in range(3):
    step(x, y)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(20):
    step(x, y)
torch.cuda.synchronize()
res["resident ms"] = round((time.perf_counter() - t0) / 20 * 1e3, 2)
print(res, flush=True)

batch = next(iter(loader))
forever = itertools.chain.from_iterable(itertools.repeat(loader))
for decoder in ("torchvision", "nvimgcodec"):
    try:
        transforms = {
            "batched": GpuTransform(dev, 224, decoder=decoder),
            "per-image": PerImage(dev, 224, decoder=decoder),
        }
        new = transforms["batched"]
        images, keep, _ = decode(batch, dev, new.nvdec, Counter())
        boxes = [batch.boxes[k] for k in keep]
        for name, crops in (("batched", lambda: batched_crops(new, images, boxes)),
                            ("per-image", lambda: transforms["per-image"].crops(images, boxes))):  # fmt: skip
            gpu, host = [], []
            for _ in range(7):
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                a.record()
                out = crops()
                b.record()
                host.append((time.perf_counter() - t0) * 1e3)
                torch.cuda.synchronize()
                gpu.append(a.elapsed_time(b))
            res[f"{decoder}: crop+resize+flip+normalize of 256 decoded images, {name}: GPU ms"] = round(
                statistics.median(gpu[2:]), 3
            )
            res[f"{decoder}: crop+resize+flip+normalize of 256 decoded images, {name}: host ms"] = round(
                statistics.median(host[2:]), 2
            )
        ref = transforms["per-image"].crops(images, boxes)
        res[f"{decoder}: batched vs per-image, max abs diff"] = float(
            (batched_crops(new, images, boxes) - ref).abs().max()
        )
        for name, tf in transforms.items():
            host = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                tf(batch)
                host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            res[f"{decoder}: whole transform call on an idle GPU, {name}: host ms"] = round(
                statistics.median(host[1:]), 1
            )
        for threads, rep in itertools.product((1, 2), range(2)):
            for name, tf in transforms.items():
                batches = prefetch(forever, tf, threads=threads)
                ms = fed(batches, 24) * 1e3
                batches.close()
                res.setdefault(f"{decoder}: fed ms/step, {name}, {threads} thread(s)", []).append(round(ms, 2))
        print(json.dumps(res, indent=1), flush=True)
        batches = prefetch(forever, new)
        fed(batches, 3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = fed(batches, 8)
        batches.close()
        trace = OUT / f"trace_batched_{decoder}.json"
        prof.export_chrome_trace(str(trace))
        per_stream = Counter()
        for e in json.loads(trace.read_text())["traceEvents"]:
            if e.get("cat") == "kernel":
                per_stream[str(e["args"].get("stream"))] += e["dur"] / 1e3 / 11
        res[f"{decoder}: profiled fed ms/step, batched"] = round(wall * 1e3, 2)
        res[f"{decoder}: kernel ms/step by stream, batched"] = {k: round(v, 2) for k, v in per_stream.most_common(8)}
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)
        (OUT / f"profile_batched_{decoder}.txt").write_text(table)
        trace.unlink()
    except Exception as e:
        print(f"{decoder} FAILED: {e!r}", flush=True)
    print(json.dumps(res, indent=1), flush=True)
print("FINAL " + json.dumps(res), flush=True)
