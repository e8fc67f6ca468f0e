"""GPU JPEG data path for ImageFolder training (``--gpu-decode``).

Pillow decodes about 150-300 images/s per CPU core, so 16 cores feed a GPU less than it trains. Here the
DataLoader workers only read files and draw each sample's random crop; decoding (nvJPEG, through
``torchvision.io.decode_jpeg``), crop, resize, flip and normalize run batched on the device:

    loader = DataLoader(EncodedImages(ds.samples, seed), batch_size, sampler=..., collate_fn=collate_encoded)
    to_device = GpuTransform(device, crop_size=224)  # evaluation: GpuTransform(device, 224, resize_size=256)
    for x, y, bad in prefetch(loader, to_device):  # bad: ["PATH (why)", ...], files left out of x and y
        ...

The augmentation equals the CPU path's sample by sample, not only in distribution: sample ``(epoch, i)`` draws
its box and flip from a generator seeded with ``mix_seed(seed, epoch, i)``, with the same calls in the same
order as ``SeededDataset`` + ``RandomResizedCrop`` + ``RandomHorizontalFlip``. Only the resize kernel differs
(torch's antialiased bilinear against Pillow's; tests/test_gpu_decode.py measures the difference).
"""

from __future__ import annotations

import io
import math
import queue
import re
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import PIL.Image
import torch
import torch.nn.functional as F
import torchvision
from torchvision.io import ImageReadMode, decode_image, decode_jpeg

from common.distributed import mix_seed
from imagenet.data import MEAN, STD

Box = tuple[int, int, int, int, bool]  # top, left, height, width, flip
Batch = tuple[torch.Tensor | None, torch.Tensor | None, list[str]]  # x, y, bad: as imagenet/train.py's collate
RGB = ImageReadMode.RGB  # grayscale and CMYK files come out as 3 channels, as with Pillow's convert("RGB")
# torchvision 0.29 deprecates its image codecs in favour of TorchCodec; they still work, so keep logs clean.
warnings.filterwarnings("ignore", "The image decoding and encoding capabilities of TorchVision", DeprecationWarning)


def random_resized_crop_box(
    height: int, width: int, g: torch.Generator, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)
) -> tuple[int, int, int, int]:
    """``T.RandomResizedCrop.get_params`` drawing from ``g`` instead of the global RNG. The same torch calls in
    the same order (float32 log/exp included), so the same generator state gives the same box."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=g).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=g)).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,), generator=g).item())
            left = int(torch.randint(0, width - w + 1, size=(1,), generator=g).item())
            return top, left, h, w
    in_ratio = width / height  # ten misses: the centre crop, clamped to the ratio range
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class Encoded(NamedTuple):
    path: str
    label: int
    data: torch.Tensor | None  # the file's bytes, 1-D uint8; None if unreadable
    box: Box | None  # training only
    nvjpeg: bool  # for nvJPEG, else for the CPU decoder (see EncodedImages)
    error: str | None  # "PATH (why)" if unreadable


class EncodedImages(torch.utils.data.Dataset):
    """ImageFolder ``samples`` -> ``Encoded`` samples: file bytes, and what the worker learnt from the header.

    A key ``(epoch, i)`` (from ``ResumableDistributedSampler``) also draws sample i's crop box and flip, seeded
    like ``common.data.SeededDataset``; a plain index (evaluation) draws nothing. The workers draw, not the
    training process: the ~15 small torch calls (40-70 us) per sample would otherwise cost 10-18 ms per batch
    of 256 on the one Python thread that drives the GPU.

    PIL reads the header without decoding: the size, and whether nvJPEG can take the file. A PNG under a
    .JPEG name and CMYK JPEGs (ImageNet has both) go to the CPU decoder rather than failing nvJPEG's batch,
    and so does a JPEG without its end marker, because nvJPEG decodes a file cut short without a word.
    """

    def __init__(self, samples: Sequence[tuple[str, int]], seed: int = 0, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        self.samples, self.seed, self.scale, self.ratio = samples, seed, scale, ratio

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: int | tuple[int, int]) -> Encoded:
        epoch, i = key if isinstance(key, tuple) else (None, key)
        path, label = self.samples[i]
        try:
            data = torchvision.io.read_file(path)
            with PIL.Image.open(io.BytesIO(data.numpy())) as im:
                (width, height), nvjpeg = im.size, im.format == "JPEG" and im.mode in ("RGB", "L")
        except (OSError, RuntimeError) as e:  # missing, unreadable, or not an image PIL can identify
            why = "not an image PIL can identify" if isinstance(e, PIL.UnidentifiedImageError) else str(e)
            return Encoded(path, label, None, None, False, f"{path} ({why.splitlines()[0][:120]})")
        nvjpeg = nvjpeg and _has_end_marker(data)
        if epoch is None:
            return Encoded(path, label, data, None, nvjpeg, None)
        g = torch.Generator().manual_seed(mix_seed(self.seed, epoch, i))
        box = random_resized_crop_box(height, width, g, self.scale, self.ratio)
        flip = torch.rand(1, generator=g).item() < 0.5  # RandomHorizontalFlip's draw, right after the crop's
        return Encoded(path, label, data, (*box, flip), nvjpeg, None)


def _has_end_marker(data: torch.Tensor) -> bool:
    # EOI (FF D9) in the last KB: entropy-coded data never holds it (an FF there is followed by 00 or a
    # restart marker), so a file cut short fails this while one with a few trailing bytes passes
    return data[-1024:].numpy().tobytes().rfind(b"\xff\xd9") >= 0


@dataclass
class EncodedBatch:
    data: torch.Tensor  # all files of the batch end to end: one shared-memory block per batch, not one per file
    sizes: list[int]  # bytes per file
    labels: torch.Tensor  # (n,) int64
    paths: list[str]  # to name the file when decoding fails
    nvjpeg: list[bool]  # for nvJPEG; the others decode on the CPU
    boxes: list[Box | None]  # None for evaluation
    bad: list[str]  # "PATH (why)" of the files the worker could not read

    def files(self) -> list[torch.Tensor]:
        return list(self.data.split(self.sizes))  # views, no copies

    def pin_memory(self) -> EncodedBatch:
        # DataLoader(pin_memory=True) calls this. Pinned labels reach the GPU without a stream sync; the file
        # bytes stay pageable, since nvJPEG parses them on the host anyway.
        self.labels = self.labels.pin_memory()
        return self


def collate_encoded(samples: list[Encoded]) -> EncodedBatch:
    good = [s for s in samples if s.data is not None]
    return EncodedBatch(
        data=torch.cat([s.data for s in good]) if good else torch.empty(0, dtype=torch.uint8),
        sizes=[len(s.data) for s in good],
        labels=torch.tensor([s.label for s in good], dtype=torch.int64),
        paths=[s.path for s in good],
        nvjpeg=[s.nvjpeg for s in good],
        boxes=[s.box for s in good],
        bad=[s.error for s in samples if s.error is not None],
    )


def _why(e: Exception) -> str:
    # "decode_jpeg, /path/to/decode_jpeg.cpp:171, Image is incomplete or truncated" -> its last part, first sentence
    return re.sub(r"^\w+, \S+:\d+, ", "", str(e).splitlines()[0]).split(". ")[0][:120]


def decode(batch: EncodedBatch, device: torch.device | str) -> tuple[list[torch.Tensor], list[int], list[str]]:
    """Decode to (3, H, W) uint8 images on ``device``; returns (images, their indices in the batch, bad).

    The files nvJPEG can take go to one batched ``decode_jpeg`` call, the rest to the CPU's ``decode_image``
    (libjpeg, libpng). If the batched call fails, its files are decoded one by one to find the bad one, on
    the CPU where the device refuses a file; what fails there too is "PATH (why)" in ``bad``.
    """
    files, device, bad = batch.files(), torch.device(device), list(batch.bad)
    images: dict[int, torch.Tensor] = {}
    batched = [k for k, ok in enumerate(batch.nvjpeg) if ok]
    if batched:
        try:
            images.update(zip(batched, decode_jpeg([files[k] for k in batched], device=device, mode=RGB)))
        except RuntimeError:
            pass
    for k in (k for k in range(len(files)) if k not in images):
        try:
            images[k] = _decode_one(files[k], device, batch.nvjpeg[k])
        except RuntimeError as e:
            bad.append(f"{batch.paths[k]} ({_why(e)})")
    keep = sorted(images)
    return [images[k] for k in keep], keep, bad


def _decode_one(data: torch.Tensor, device: torch.device, nvjpeg: bool) -> torch.Tensor:
    if nvjpeg and device.type == "cuda":
        try:
            return decode_jpeg(data, device=device, mode=RGB)
        except RuntimeError:
            pass  # the CPU decoder may still read it, or says better why not
    img = decode_image(data, mode=RGB)
    # pinned, so the copy is queued on the stream instead of waiting for it
    return img.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else img


class GpuTransform:
    """Decode an ``EncodedBatch`` on ``device`` and augment it there. Returns ``(x, y, bad)`` like
    imagenet/train.py's ``collate``: x (n, 3, S, S) normalized float32 (channels_last if asked) and y (n,) on
    the device, without the files listed in ``bad``; x and y are None when no file is left.

    Training (``resize_size=None``): crop each image to its box, resize to crop_size², flip where drawn.
    Evaluation: resize the shorter side to ``resize_size``, keep the centre crop_size² (T.Resize + T.CenterCrop).
    Per batch it copies no constants and makes no host sync of its own, but nvJPEG's decode waits for the
    device to be idle: call it through ``prefetch``.
    """

    def __init__(
        self,
        device: torch.device | str,
        crop_size: int,
        resize_size: int | None = None,
        channels_last: bool = True,
        mean: Sequence[float] = MEAN,
        std: Sequence[float] = STD,
    ):
        if resize_size is not None and resize_size < crop_size:
            raise ValueError(f"resize_size {resize_size} < crop_size {crop_size} (T.CenterCrop would pad)")
        self.device, self.size, self.resize_size = torch.device(device), crop_size, resize_size
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        # (x / 255 - mean) / std == x * scale + shift: one fused kernel, constants copied to the device once
        mean_t, std_t = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
        self.scale = (1 / (255 * std_t)).to(self.device)
        self.shift = (-mean_t / std_t).to(self.device)

    def __call__(self, batch: EncodedBatch) -> Batch:
        images, keep, bad = decode(batch, self.device)
        if not images:
            return None, None, bad
        if self.resize_size is None:
            crops = [self._train_crop(img, batch.boxes[k]) for img, k in zip(images, keep)]
        else:
            crops = [self._eval_crop(img) for img in images]
        x = torch.cat(crops)  # float, 0..255
        out = torch.empty(x.shape, device=self.device, memory_format=self.memory_format)
        torch.addcmul(self.shift, x, self.scale, out=out)  # normalize and change layout in one pass
        labels = batch.labels if len(keep) == len(batch.labels) else batch.labels[keep]
        return out, labels.to(self.device, non_blocking=True), bad

    def _resize(self, img: torch.Tensor, h: int, w: int) -> torch.Tensor:
        # antialias=True is torch's port of Pillow's filter; Pillow rounds to uint8 after it, we stay in float
        return F.interpolate(img[None].float(), size=(h, w), mode="bilinear", antialias=True, align_corners=False)

    def _train_crop(self, img: torch.Tensor, box: Box | None) -> torch.Tensor:
        if box is None:
            raise ValueError("a training GpuTransform needs boxes: index EncodedImages with (epoch, i) keys")
        top, left, h, w, flip = box
        out = self._resize(img[:, top : top + h, left : left + w], self.size, self.size)
        return out.flip(-1) if flip else out

    def _eval_crop(self, img: torch.Tensor) -> torch.Tensor:
        h, w = img.shape[-2:]  # known on the host without a sync, also for images decoded on the GPU
        r = self.resize_size
        nh, nw = (int(r * h / w), r) if w <= h else (r, int(r * w / h))  # T.Resize(int): long side truncated
        top, left = int(round((nh - self.size) / 2.0)), int(round((nw - self.size) / 2.0))  # T.CenterCrop
        return self._resize(img, nh, nw)[..., top : top + self.size, left : left + self.size]


def prefetch(batches: Iterable[EncodedBatch], transform: GpuTransform, ahead: int = 2) -> Iterator[Batch]:
    """``transform(b) for b in batches``, computed up to ``ahead`` batches early in a thread.

    Why a thread: torchvision's CUDA ``decode_jpeg`` returns only when the whole device is idle (on an H200,
    queued behind 430 ms of matmuls, on the same stream or another, it returned after 433 ms). Called from the
    training loop, it stalls the host at every step, and the GPU with it: an eager bf16 ResNet50 trained at
    3,200-3,600 img/s that way, 4,100-4,300 through this thread, 4,700 with the batch already on the GPU (one
    H200, batch 256). The thread queues on a side stream, so the crops and resizes run beside the training.
    """
    q: queue.Queue = queue.Queue(maxsize=ahead)
    stop = threading.Event()
    cuda = transform.device.type == "cuda"
    side = torch.cuda.Stream(transform.device) if cuda else None
    main = torch.cuda.current_stream(transform.device) if cuda else None

    def put(item: object) -> None:
        while not stop.is_set():
            try:
                return q.put(item, timeout=0.1)
            except queue.Full:
                pass

    def produce() -> None:
        try:
            with torch.cuda.stream(side):  # also sets the thread's CUDA device (per thread, else cuda:0)
                for b in batches:
                    x, y, bad = transform(b)
                    done = torch.cuda.Event() if cuda else None
                    if done is not None:
                        done.record(side)
                    put((x, y, bad, done))
                    if stop.is_set():
                        return
            put(None)
        except BaseException as e:  # re-raised in the consumer, with its traceback
            put(e)

    thread = threading.Thread(target=produce, name="gpu-decode", daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            x, y, bad, done = item
            if done is not None and main is not None:
                main.wait_event(done)  # the consumer's next kernels wait for this batch, nothing earlier does
                for t in (x, y):
                    if t is not None:
                        t.record_stream(main)  # made on the side stream: the allocator must not reuse it early
            yield x, y, bad
    finally:  # also when the consumer stops early: let the thread finish its batch and leave the loader alone
        stop.set()
        thread.join()
