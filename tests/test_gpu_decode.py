"""imagenet/gpu_decode.py on the CPU (device="cpu" runs the same calls as CUDA), against torchvision's CPU path.

Tolerances are in normalized units; one uint8 level is 1 / (255 * std) ~ 0.017 of them. Measured: decoding
equals Pillow's exactly (the same libjpeg-turbo); the resized outputs differ by ~0.005 on average and
at most ~0.017 (one level), since Pillow rounds its antialiased resize to uint8 and torch stays in float.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
import torchvision.transforms as T
from crop_resize import crop_resize  # tests/conftest.py puts the scripts' folders on sys.path
from gpu_decode import (
    MEAN,
    STD,
    EncodedImages,
    GpuTransform,
    Prefetched,
    collate_encoded,
    decode,
)
from PIL import Image

from common.data import ResumableDistributedSampler, SeededDataset

REPO = Path(__file__).resolve().parent.parent
LEVEL = 1 / (255 * min(STD))  # one uint8 level, in normalized units
NORMALIZE = [T.PILToTensor(), T.ConvertImageDtype(torch.float), T.Normalize(MEAN, STD)]  # as imagenet/train.py


def photo(w: int, h: int, seed: int, gray: bool = False) -> Image.Image:
    """Smooth content plus sensor-like noise: closer to a photo than pure noise, which no resize kernel agrees on."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    chans = []
    for _ in range(1 if gray else 3):
        a, b, p = rng.uniform(0.05, 0.3, 3)
        chans.append(128 + 60 * np.sin(a * xx + 6 * p) * np.cos(b * yy) + 40 * (xx / w - yy / h))
    arr = np.clip(np.stack(chans, -1) + rng.normal(0, 8, (h, w, len(chans))), 0, 255).astype(np.uint8)
    return Image.fromarray(arr[..., 0] if gray else arr)


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> list[tuple[str, int]]:
    """An ImageFolder of real JPEGs: landscape, portrait, grayscale (upscaled by the eval resize), ImageNet-sized."""
    root = tmp_path_factory.mktemp("folder")
    for i, (w, h, gray) in enumerate([(60, 45, False), (50, 80, False), (40, 30, True), (500, 375, False)]):
        (root / f"class{i % 2}").mkdir(exist_ok=True)
        photo(w, h, i, gray).save(root / f"class{i % 2}" / f"{i}.jpg", quality=90)
    return torchvision.datasets.ImageFolder(str(root)).samples


def batch_of(ds: EncodedImages, keys: list) -> object:
    return collate_encoded([ds[k] for k in keys])


def test_decode_matches_pil(samples):
    counts = Counter()
    images, keep, bad = decode(batch_of(EncodedImages(samples), range(len(samples))), "cpu", counts=counts)
    assert keep == list(range(len(samples))) and bad == [] and counts == {"cpu": len(samples)}
    for img, (path, _) in zip(images, samples):
        ref = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)
        assert img.dtype == torch.uint8 and img.shape == ref.shape
        assert (img.float() - ref.float()).abs().mean() < 2  # levels; measured 0


@pytest.mark.parametrize("resize, crop", [(40, 32), (256, 224)])
def test_eval_matches_torchvision(samples, resize, crop):
    x, y, bad = GpuTransform("cpu", crop, resize_size=resize)(batch_of(EncodedImages(samples), range(len(samples))))
    cpu = T.Compose([T.Resize(resize), T.CenterCrop(crop), *NORMALIZE])
    assert bad == [] and y.tolist() == [label for _, label in samples]
    for k, (path, _) in enumerate(samples):
        diff = (x[k] - cpu(Image.open(path).convert("RGB"))).abs()
        assert diff.mean() < 0.6 * LEVEL and diff.max() < 2 * LEVEL  # measured ~0.3 and ~1 level


def test_train_equals_cpu_path_per_sample(samples):
    """Same (seed, epoch, index) -> same box and flip as SeededDataset + RandomResizedCrop + RandomHorizontalFlip,
    so the GPU path's augmentation distribution is the CPU path's by construction."""
    tf = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), *NORMALIZE])
    cpu = SeededDataset(torchvision.datasets.ImageFolder(str(Path(samples[0][0]).parent.parent), transform=tf), 5)
    keys = [(e, i) for e in range(6) for i in range(len(samples))]
    x, y, _ = GpuTransform("cpu", 32)(batch_of(EncodedImages(samples, seed=5), keys))
    for k, key in enumerate(keys):
        ref, label = cpu[key]
        assert y[k] == label
        assert (x[k] - ref).abs().mean() < 0.6 * LEVEL  # measured ~0.3 level
        assert (x[k] - ref.flip(-1)).abs().mean() > 5 * LEVEL  # a wrong flip would show (measured > 8)


def test_train_augmentation_statistics(samples):
    """Over many draws: flip rate ~0.5, boxes inside RandomResizedCrop's ranges, and box statistics matching
    independent draws of torchvision's get_params (a two-sample check of the distribution, not of equality)."""
    path, label = samples[-1]  # 500x375
    h0, w0 = 375, 500
    ds, n = EncodedImages([(path, label)], seed=1), 2000
    boxes = torch.tensor([ds[(e, 0)].box for e in range(n)], dtype=torch.float64)
    top, left, h, w, flip = boxes.unbind(1)
    assert abs(flip.mean().item() - 0.5) < 4 * 0.5 / n**0.5
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= h0).all() and (left + w <= w0).all()
    frac, log_ar = h * w / (h0 * w0), (w / h).log()
    assert frac.min() > 0.079 and frac.max() <= 1 and log_ar.abs().max() < np.log(4 / 3) + 0.01
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(12345)
        ref = torch.tensor(
            [T.RandomResizedCrop.get_params(torch.empty(3, h0, w0), [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(n)]
        )
    ref_frac, ref_log_ar = ref[:, 2] * ref[:, 3] / (h0 * w0), (ref[:, 3] / ref[:, 2]).double().log()
    for a, b in [(frac, ref_frac.double()), (log_ar, ref_log_ar)]:
        se = (a.var() / n + b.var() / n).sqrt()
        assert abs(a.mean() - b.mean()) < 4 * se


def test_train_output_format_and_determinism(samples):
    ds, keys = EncodedImages(samples, seed=3), [(0, i) for i in range(len(samples))]
    tf = GpuTransform("cpu", 32)
    x, y, bad = tf(batch_of(ds, keys))
    assert x.shape == (len(samples), 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert x.is_contiguous(memory_format=torch.channels_last) and bad == []
    assert torch.equal(x, tf(batch_of(EncodedImages(samples, seed=3), keys))[0])  # a fresh dataset, same numbers
    assert not torch.equal(x, tf(batch_of(ds, [(1, i) for i in range(len(samples))]))[0])  # next epoch differs
    x_nchw = GpuTransform("cpu", 32, channels_last=False)(batch_of(ds, keys))[0]
    assert x_nchw.is_contiguous() and torch.equal(x_nchw, x)


def test_dataloader_workers(samples):
    """Through real worker processes (pickling), with the sampler train.py uses."""
    sampler = ResumableDistributedSampler(len(samples), seed=0)
    sampler.set_epoch(2)
    loader = torch.utils.data.DataLoader(
        EncodedImages(samples, seed=0), batch_size=2, sampler=sampler, num_workers=1, collate_fn=collate_encoded
    )
    xs = [GpuTransform("cpu", 32)(b)[0] for b in loader]
    direct = GpuTransform("cpu", 32)(batch_of(EncodedImages(samples, seed=0), list(sampler)))[0]
    assert torch.equal(torch.cat(xs), direct)


def test_bad_files_are_named_and_left_out(samples, tmp_path):
    good = Path(samples[0][0]).read_bytes()
    (tmp_path / "garbage.jpg").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "truncated.jpg").write_bytes(good[: len(good) // 2])  # header intact, scan data cut short
    photo(30, 20, 9).save(tmp_path / "png_named.jpg", "PNG")  # ImageNet has one
    photo(30, 20, 9).convert("CMYK").save(tmp_path / "cmyk.jpg", quality=90)  # and some of these
    photo(30, 20, 9).save(tmp_path / "progressive.jpg", quality=90, progressive=True)
    names = ("garbage.jpg", "truncated.jpg", "png_named.jpg", "cmyk.jpg", "progressive.jpg")
    files = [samples[0][0], *(str(tmp_path / n) for n in names)]
    ds = EncodedImages([(f, k) for k, f in enumerate(files)], seed=0)
    # nvJPEG gets the baseline JPEG ("hw") and the progressive one ("cuda", which the JPEG engines reject); PNG
    # and CMYK go to the CPU, and so does a truncated file, which nvJPEG would decode without an error
    assert [ds[k].route for k in range(6)] == ["hw", "cpu", "cpu", "cpu", "cpu", "cuda"]
    for tf, keys in [(GpuTransform("cpu", 16), [(0, k) for k in range(6)]), (GpuTransform("cpu", 16, 20), range(6))]:
        x, y, bad = tf(batch_of(ds, list(keys)))
        assert y.tolist() == [0, 3, 4, 5] and x.shape[0] == 4
        assert bad == [f"{files[1]} (not an image PIL can identify)", f"{files[2]} (Image is incomplete or truncated)"]
        assert tf.counts == {"cpu": 4}  # on a CPU device every decoder is libjpeg/libpng
    x, y, bad = GpuTransform("cpu", 16, 20)(batch_of(ds, [1, 2]))
    assert x is None and y is None and len(bad) == 2


def test_encoded_batch_layout(samples):
    """One shared-memory block per batch: the files end to end, split back into views of their exact bytes."""
    ds = EncodedImages(samples, seed=0)
    batch = collate_encoded([ds[(0, i)] for i in range(len(samples))])
    assert (
        batch.data.dtype == torch.uint8 and batch.data.dim() == 1 and batch.sizes == [len(ds[i].data) for i in range(4)]
    )
    for f, (path, _) in zip(batch.files(), samples):
        assert f.numpy().tobytes() == Path(path).read_bytes() and f.data_ptr() >= batch.data.data_ptr()
    assert batch.routes == ["hw"] * 4 and batch.labels.tolist() == [label for _, label in samples]
    assert batch.boxes == [ds[(0, i)].box for i in range(4)]


def test_prefetch(samples):
    """The same batches as calling the transform, in order, also when one takes longer; errors reach the consumer;
    stopping early ends the thread. Each pass over a Prefetched loader is a new pass over the loader."""
    ds, tf = EncodedImages(samples, seed=0), GpuTransform("cpu", 16)
    batches = [batch_of(ds, [(e, i) for i in range(len(samples))]) for e in range(7)]

    class Uneven(GpuTransform):  # batch 0 takes longest
        def __call__(self, b):
            time.sleep(0.5 if b is batches[0] else 0)
            return super().__call__(b)

    prefetched = Prefetched(batches, Uneven("cpu", 16))
    got = list(prefetched)
    assert [torch.equal(x, y) for (x, _, _), (y, _, _) in zip(got, prefetched, strict=True)] == [True] * len(batches)
    assert len(got) == len(batches)
    for (x, y, bad), b in zip(got, batches, strict=True):
        ref = tf(b)
        assert torch.equal(x, ref[0]) and torch.equal(y, ref[1]) and bad == ref[2] == []
    with pytest.raises(ValueError, match="needs boxes"):  # evaluation batches given to a training transform
        list(Prefetched([batch_of(ds, range(len(samples)))], tf))
    it = iter(Prefetched(iter(batches * 100), tf, ahead=1))
    next(it)
    it.close()
    assert not any(t.name == "gpu-decode" for t in threading.enumerate())


def test_a_failed_start_of_the_decoding_thread_reaches_the_consumer(samples, monkeypatch):
    """The decoding thread cannot take its device (here: set_device fails): the error is raised where the batches are
    asked for, instead of a wait for batches that never come."""
    tf = GpuTransform("cpu", 16)
    tf.device = torch.device("cuda", 0)

    def no_device(device):
        raise RuntimeError(f"cannot use {device}")

    monkeypatch.setattr(torch.cuda, "set_device", no_device)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: None)
    errors = []

    def consume():
        try:
            list(Prefetched([batch_of(EncodedImages(samples), range(len(samples)))], tf))
        except RuntimeError as e:
            errors.append(str(e))

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer.join(60)
    assert errors == ["cannot use cuda:0"]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_crop_resize_kernel_equals_torch_per_image(device):
    """The batched Triton kernel (on the CPU: Triton's interpreter) against torch's antialiased resize per image,
    on every geometry GpuTransform makes: training boxes shrunk (up to ~3x) or enlarged, flipped or not, thin
    boxes, and evaluation resizes with a centre window; both memory layouts."""
    g, size = torch.Generator().manual_seed(0), 16
    shapes = [(3, 45, 60), (3, 9, 50), (3, 30, 12)]
    images = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=g) for shape in shapes]
    geometry = [(3, 5, 40, 48, size, size, 0, 0, True), (0, 1, 9, 47, size, size, 0, 0, False),
                (2, 0, 7, 12, size, size, 0, 0, True),  # enlarged
                (0, 0, 45, 60, 20, 26, 2, 5, False), (0, 0, 9, 50, 20, 111, 2, 47, False)]  # fmt: skip
    images = [images[0], images[1], images[2], images[0], images[1]]
    scale, shift = [1 / (255 * s) for s in STD], [-m / s for m, s in zip(MEAN, STD)]
    ref = crop_resize(images, geometry, torch.empty(5, 3, size, size), scale, shift, kernel=False)
    for layout in (torch.channels_last, torch.contiguous_format):
        out = torch.empty(5, 3, size, size, device=device, memory_format=layout)
        crop_resize([img.to(device) for img in images], geometry, out, scale, shift, kernel=True)
        assert (out.cpu() - ref).abs().max() < 1e-4  # float rounding: measured ~1e-6
    assert (ref[0] - ref[0].flip(-1)).abs().mean() > 10 * LEVEL  # the flips are visible


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu(samples):
    ds, keys = EncodedImages(samples, seed=0), [(0, i) for i in range(len(samples))]
    batch = batch_of(ds, keys).pin_memory()
    ref, _, _ = GpuTransform("cpu", 32)(batch)
    tf = GpuTransform("cuda", 32)  # copies its constants to the device: a sync, once
    list(Prefetched([batch], tf))  # warm up the decoders and the kernels
    torch.cuda.set_sync_debug_mode("error")  # no sync that torch can see (nvJPEG's own waits are invisible to it)
    try:
        (x, y, bad), *_ = list(Prefetched([batch, batch], tf))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bad == [] and x.is_cuda and y.is_cuda and x.is_contiguous(memory_format=torch.channels_last)
    assert (x.cpu() - ref).abs().mean() < 2 * LEVEL  # nvJPEG's IDCT and upsampling differ slightly from libjpeg's


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_decoding_for_a_second_gpu_leaves_gpu_0_alone(samples):
    """A rank on cuda:1 must never make a CUDA context on GPU 0: each costs GPU 0 memory, and a prefetch thread
    leaving its stream context on cuda:0 makes one with the GIL held (about a second on an H200). A fresh process,
    as a torchrun rank: set_device(1), then a whole prefetch (its threads start, decode, end), then ask the driver."""
    code = f"""
import sys, torch
sys.path[:0] = [{str(REPO / "imagenet")!r}, {str(REPO)!r}]
from gpu_decode import EncodedImages, GpuTransform, Prefetched, collate_encoded
torch.cuda.set_device(1)
ds = EncodedImages({samples!r}, seed=0)
batches = [collate_encoded([ds[(e, i)] for i in range({len(samples)})]).pin_memory() for e in range(3)]
out = list(Prefetched(batches, GpuTransform("cuda:1", 32)))
torch.cuda.synchronize()
print(len(out), out[0][0].device, torch._C._cuda_hasPrimaryContext(0), torch._C._cuda_hasPrimaryContext(1))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["3", "cuda:1", "False", "True"], run.stdout


def test_torchvision_deprecation_is_silenced_where_it_arises_only(samples):
    """torchvision 0.29 warns at each call of its image codecs (deprecated for TorchCodec's; they still work):
    decoding says nothing, and importing gpu_decode leaves the process's warnings filters as they were (a fresh
    interpreter, its sibling modules imported first)."""
    ds = EncodedImages(samples, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GpuTransform("cpu", 16)(batch_of(ds, [(0, i) for i in range(len(samples))]))
        GpuTransform("cpu", 16, 20)(batch_of(ds, range(len(samples))))
    assert [w for w in caught if issubclass(w.category, DeprecationWarning)] == []
    code = (f"import sys, warnings; sys.path[:0] = [{str(REPO / 'imagenet')!r}, {str(REPO)!r}]; "
            "import crop_resize, imagenet_data; before = list(warnings.filters); import gpu_decode; "
            "print(warnings.filters == before)")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.split() == ["True"], p.stderr[-2000:]
