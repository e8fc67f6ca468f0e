"""``--gpu-decode``: DataLoader workers only read files and draw each sample's crop; decoding (one batched
``torchvision.io.decode_jpeg`` per batch, nvJPEG), crop, resize, flip and normalize run on the device, a batch ahead
of the training step, on a side stream (``Prefetched``). Files no GPU decoder takes are decoded on the CPU. Sample
``(epoch, i)`` draws its box and flip exactly as the Pillow path does; only the resize kernel differs.

    loader = DataLoader(EncodedImages(ds.samples, seed), batch_size, sampler=..., collate_fn=collate_encoded)
    for x, y, bad in Prefetched(loader, GpuTransform(device, crop_size=224)):  # bad: "PATH (why)" left out
"""

from __future__ import annotations

import contextlib
import io
import queue
import re
import threading
import warnings
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import PIL.Image
import torch
import torchvision.transforms as T
from crop_resize import crop_resize
from imagenet_data import MEAN, STD
from torchvision.io import ImageReadMode, decode_image, decode_jpeg

from common.distributed import mix_seed

Box = tuple[int, int, int, int, bool]  # top, left, height, width, flip
Batch = tuple[torch.Tensor | None, torch.Tensor | None, list[str]]  # x, y, bad: as imagenet_data.collate's
RGB = ImageReadMode.RGB  # grayscale and CMYK files come out as 3 channels, as with Pillow's convert("RGB")


class Encoded(NamedTuple):
    path: str
    label: int
    data: torch.Tensor | None  # the file's bytes, 1-D uint8; None if unreadable
    box: Box | None  # training only
    route: str  # the first decoder to try: "hw" (baseline JPEG), "cuda" (progressive JPEG) or "cpu" (see EncodedImages)
    error: str | None  # "PATH (why)" if unreadable


class EncodedImages(torch.utils.data.Dataset):
    """ImageFolder ``samples`` -> ``Encoded``: file bytes and the decoder to take them, from the header (PIL reads
    it without decoding). A key ``(epoch, i)`` also draws the crop box and flip, in the worker, seeded like
    ``SeededDataset``. PNGs named .JPEG, CMYK JPEGs and files cut short (nvJPEG decodes those silently) go to CPU."""

    def __init__(self, samples: Sequence[tuple[str, int]], seed: int = 0, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        self.samples, self.seed, self.scale, self.ratio = samples, seed, scale, ratio

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: int | tuple[int, int]) -> Encoded:
        epoch, i = key if isinstance(key, tuple) else (None, key)
        path, label = self.samples[i]
        try:
            with open(path, "rb") as f:
                data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
            with PIL.Image.open(io.BytesIO(data.numpy())) as im:
                (width, height), jpeg = im.size, im.format == "JPEG" and im.mode in ("RGB", "L")
                progressive = bool(im.info.get("progressive"))
        except (OSError, RuntimeError) as e:  # missing, unreadable, or not an image PIL can identify
            why = "not an image PIL can identify" if isinstance(e, PIL.UnidentifiedImageError) else str(e)
            return Encoded(path, label, None, None, "cpu", f"{path} ({why.splitlines()[0][:120]})")
        # EOI (FF D9) in the last KB: entropy-coded data never holds it, so a file cut short goes to the CPU
        end_marker = data[-1024:].numpy().tobytes().rfind(b"\xff\xd9") >= 0
        route = ("cuda" if progressive else "hw") if jpeg and end_marker else "cpu"
        if epoch is None:
            return Encoded(path, label, data, None, route, None)
        with torch.random.fork_rng(devices=[]):  # seeded as SeededDataset seeds the Pillow path: the same draws
            torch.manual_seed(mix_seed(self.seed, epoch, i))
            box = T.RandomResizedCrop.get_params(torch.empty(0, height, width), self.scale, self.ratio)
            flip = torch.rand(1).item() < 0.5  # RandomHorizontalFlip's draw, right after the crop's
        return Encoded(path, label, data, (*box, flip), route, None)


@dataclass
class EncodedBatch:
    data: torch.Tensor  # all files of the batch end to end: one shared-memory block per batch, not one per file
    sizes: list[int]  # bytes per file
    labels: torch.Tensor  # (n,) int64
    paths: list[str]  # to name the file when decoding fails
    routes: list[str]  # "hw", "cuda" or "cpu": Encoded.route
    boxes: list[Box | None]  # None for evaluation
    bad: list[str]  # "PATH (why)" of the files the worker could not read

    def files(self) -> list[torch.Tensor]:
        return list(self.data.split(self.sizes))  # views, no copies

    def pin_memory(self) -> EncodedBatch:
        # DataLoader(pin_memory=True): the bytes reach the GPU by a DMA on a stream (Prefetched keeps them alive)
        self.data, self.labels = self.data.pin_memory(), self.labels.pin_memory()
        return self


def collate_encoded(samples: list[Encoded]) -> EncodedBatch:
    good = [s for s in samples if s.data is not None]
    data = torch.cat([s.data for s in good]) if good else torch.empty(0, dtype=torch.uint8)
    return EncodedBatch(data, [len(s.data) for s in good], torch.tensor([s.label for s in good], dtype=torch.int64),
                        [s.path for s in good], [s.route for s in good], [s.box for s in good],
                        [s.error for s in samples if s.error is not None])  # fmt: skip


def decode(batch: EncodedBatch, device: torch.device | str, counts: Counter) -> tuple[list, list[int], list[str]]:
    """Decode to (3, H, W) uint8 images on ``device``: (images, their indices in the batch, bad); ``counts``: images
    each decoder took. One batched ``decode_jpeg`` call (one by one if the batch fails), then the CPU's
    ``decode_image`` for the rest."""
    files, device, bad = batch.files(), torch.device(device), list(batch.bad)
    images: dict[int, torch.Tensor] = {}
    with warnings.catch_warnings():  # torchvision 0.29 deprecates its codecs for TorchCodec's; they still work
        warnings.filterwarnings("ignore", "The image decoding and encoding capabilities", DeprecationWarning)
        if batched := [k for k, r in enumerate(batch.routes) if r != "cpu"]:
            try:
                images.update(zip(batched, decode_jpeg([files[k] for k in batched], device=device, mode=RGB)))
                counts["cuda" if device.type == "cuda" else "cpu"] += len(batched)
            except RuntimeError:
                pass
        for k in (k for k in range(len(files)) if k not in images):
            try:
                images[k], where = _decode_one(files[k], device, batch.routes[k] != "cpu")
                counts[where] += 1
            except RuntimeError as e:  # "decode_jpeg, /p/x.cpp:171, Image is incomplete": its last part
                why = re.sub(r"^\w+, \S+:\d+, ", "", str(e).splitlines()[0]).split(". ")[0][:120]
                bad.append(f"{batch.paths[k]} ({why})")
    keep = sorted(images)
    return [images[k] for k in keep], keep, bad


def _decode_one(data: torch.Tensor, device: torch.device, nvjpeg: bool) -> tuple[torch.Tensor, str]:
    if nvjpeg and device.type == "cuda":
        try:
            return decode_jpeg(data, device=device, mode=RGB), "cuda"
        except RuntimeError:
            pass  # the CPU decoder may still read it, or says better why not
    img = decode_image(data, mode=RGB)
    # pinned, so the copy is queued on the stream instead of waiting for it
    return (img.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else img), "cpu"


class GpuTransform:
    """Decode an ``EncodedBatch`` on ``device`` and augment it there: ``(x, y, bad)`` like train.py's ``collate``.
    Training (``resize_size=None``) crops each box and resizes it to crop_size², flipped where drawn; evaluation
    resizes the shorter side to ``resize_size`` and keeps the centre. ``counts``: images each decoder took."""

    def __init__(self, device: torch.device | str, crop_size: int, resize_size: int | None = None,
                 channels_last: bool = True):  # fmt: skip
        if resize_size is not None and resize_size < crop_size:
            raise ValueError(f"resize_size {resize_size} < crop_size {crop_size} (T.CenterCrop would pad)")
        device = torch.device(device)  # "cuda": this thread's GPU, which the decoding thread must be told
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == torch.device("cuda") else device
        self.size, self.resize_size, self.counts = crop_size, resize_size, Counter()
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        # (x / 255 - mean) / std == x * scale + shift, done by crop_resize's kernel
        self.scale, self.shift = [1 / (255 * s) for s in STD], [-m / s for m, s in zip(MEAN, STD)]

    def __call__(self, batch: EncodedBatch) -> Batch:
        train = self.resize_size is None
        if train and None in batch.boxes:
            raise ValueError("a training GpuTransform needs boxes: index EncodedImages with (epoch, i) keys")
        images, keep, bad = decode(batch, self.device, self.counts)
        if not images:
            return None, None, bad
        # training: the box, resized to size x size; evaluation: see _eval_geometry
        geometry = [(*batch.boxes[k][:4], self.size, self.size, 0, 0, batch.boxes[k][4]) if train
                    else self._eval_geometry(*img.shape[1:]) for img, k in zip(images, keep)]  # fmt: skip
        out = torch.empty((len(images), 3, self.size, self.size), device=self.device, memory_format=self.memory_format)
        crop_resize(images, geometry, out, self.scale, self.shift)
        labels = batch.labels if len(keep) == len(batch.labels) else batch.labels[keep]
        return out, labels.to(self.device, non_blocking=True), bad

    def _eval_geometry(self, h: int, w: int) -> tuple:  # known on the host without a sync, also for GPU images
        r = self.resize_size
        nh, nw = (int(r * h / w), r) if w <= h else (r, int(r * w / h))  # T.Resize(int): long side truncated
        top, left = int(round((nh - self.size) / 2.0)), int(round((nw - self.size) / 2.0))  # T.CenterCrop
        return 0, 0, h, w, nh, nw, top, left, False  # the whole image, resized to nh x nw; the centre kept


class Prefetched:
    """A loader of ``EncodedBatch``es as one of ``(x, y, bad)``: each pass yields ``transform(b) for b in loader``, in
    order, up to ``ahead`` batches early, made by a thread of its own: decoding blocks its thread until the queued
    training kernels ran, so the training loop must not call it. The thread works on a side stream; the consumer's
    stream waits for each batch's event, and a batch's pinned bytes stay referenced until the GPU has read them (the
    pinned-memory cache would hand them on at once)."""

    def __init__(self, loader: Iterable[EncodedBatch], transform: GpuTransform, ahead: int = 2):
        self.loader, self.transform, self.ahead = loader, transform, ahead

    def __iter__(self) -> Iterator[Batch]:
        q, stop, device = queue.Queue(maxsize=self.ahead), threading.Event(), self.transform.device
        main = torch.cuda.current_stream(device) if device.type == "cuda" else None
        thread = threading.Thread(target=_produce, args=(iter(self.loader), self.transform, q, stop), name="gpu-decode",
                                  daemon=True)  # fmt: skip
        thread.start()
        try:
            while (item := q.get())[0] == "batch":
                _, x, y, bad, done = item
                if done is not None:
                    main.wait_event(done)  # the consumer's next kernels wait for this batch, nothing earlier does
                    for t in (x, y):
                        if t is not None:
                            t.record_stream(main)  # made on a side stream: the allocator must not reuse it early
                yield x, y, bad
            if item[0] == "error":
                raise item[1]
        finally:  # also when the consumer stops early: let the thread finish its batch and leave the loader alone
            stop.set()
            thread.join()


def _produce(it: Iterator[EncodedBatch], transform: GpuTransform, q: queue.Queue, stop: threading.Event) -> None:
    cuda, reading = transform.device.type == "cuda", deque()  # reading: (event, batch) the GPU may still be reading
    try:
        if cuda:  # a new thread's device is cuda:0: without this, every rank would create a context on GPU 0
            torch.cuda.set_device(transform.device)
        side = torch.cuda.Stream(transform.device) if cuda else None
        with torch.cuda.stream(side):
            for b in it:
                x, y, bad = transform(b)
                done = torch.cuda.Event() if cuda else None
                if done is not None:
                    done.record(side)
                    reading.append((done, b))
                    while reading and reading[0][0].query():
                        reading.popleft()
                if not _put(q, stop, ("batch", x, y, bad, done)):
                    return
        _put(q, stop, ("end",))
    except BaseException as e:  # re-raised in the consumer, with its traceback
        _put(q, stop, ("error", e))
    finally:
        if reading:
            reading[-1][0].synchronize()  # the stream's last event: every earlier one has completed too


def _put(q: queue.Queue, stop: threading.Event, item: tuple) -> bool:  # False: the consumer is gone
    while not stop.is_set():
        with contextlib.suppress(queue.Full):
            q.put(item, timeout=0.1)
            return True
    return False
