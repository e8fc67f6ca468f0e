"""CIFAR-10 for train.py: three sources (synthetic, torchvision's files, an ImageFolder decoded once into a cache),
each as uint8 arrays; augmented one PIL image at a time, or with ``--gpu-data`` a batch at a time on the device."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torchvision.transforms as T

from common.checkpoint import atomic_write
from common.distributed import broadcast_object, mix_seed, print0
from common.errors import UserError

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
ERASE_SCALE, ERASE_RATIO, ERASE_TRIES = (0.02, 0.33), (0.3, 3.3), 10  # torchvision RandomErasing's defaults


class CIFARArrays(torch.utils.data.Dataset):
    """Decoded images (uint8 NHWC) and labels. With a transform: PIL image -> transform; without: uint8 CHW."""

    def __init__(self, data: np.ndarray, targets, transform=None):
        self.data, self.targets, self.transform = data, list(targets), transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        if self.transform is None:
            return torch.from_numpy(self.data[i]).permute(2, 0, 1), self.targets[i]
        from PIL import Image

        return self.transform(Image.fromarray(self.data[i])), self.targets[i]


# what CIFAR-10 batches hold (Python 2/3, numpy 1/2 names): a pickle naming anything else is refused before it runs
SAFE_GLOBALS = {
    ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
    *((f"numpy.{core}.multiarray", "_reconstruct") for core in ("core", "_core")),
    *((f"numpy.{core}.numeric", "_frombuffer") for core in ("core", "_core")),
}  # fmt: skip


def load_batch(path: Path) -> dict:
    """One CIFAR-10 batch file, through an unpickler that admits only the types such a file holds."""
    import pickle
    import warnings

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            if (module, name) not in SAFE_GLOBALS:
                raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR-10 batch never holds")
            with warnings.catch_warnings():  # numpy 2 warns about its numpy.core alias
                warnings.simplefilter("ignore")
                return super().find_class(module, name)

    try:
        with open(path, "rb") as f:
            entry = Unpickler(f, encoding="latin1").load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as e:
        raise UserError(f"cannot read CIFAR-10 batch {path}: {e} (download it again with --download)") from None
    data, labels = (entry.get("data"), entry.get("labels")) if isinstance(entry, dict) else (None, None)
    good = isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2 and data.shape[1] == 3072
    good = good and isinstance(labels, list) and len(labels) == len(data)
    if not (good and all(type(y) is int and 0 <= y < 10 for y in labels)):
        raise UserError(f"{path} is not a CIFAR-10 batch (expected uint8 data of N x 3072 and N labels in 0..9)")
    return entry


def synthetic(n: int, seed: int, transform) -> CIFARArrays:
    """Image i is a fixed function of (seed, i): deterministic, no disk."""
    gens = (torch.Generator().manual_seed(mix_seed(seed, i)) for i in range(n))
    images = [torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=g).permute(1, 2, 0) for g in gens]
    return CIFARArrays(torch.stack(images).numpy(), [i % 10 for i in range(n)], transform)


def read_pickles(folder: Path, train: bool) -> CIFARArrays:
    """torchvision's CIFAR-10 files (cifar-10-batches-py/), without MD5 checks so that copies work."""
    data, targets = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]:
        entry = load_batch(folder / name)
        data.append(entry["data"])
        targets += entry["labels"]
    return CIFARArrays(np.concatenate(data).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1).copy(), targets)


def _decode(paths: list[str]) -> np.ndarray:
    from PIL import Image

    out = []
    for p in paths:
        try:
            with Image.open(p) as im:
                out.append(np.asarray(im.convert("RGB")))  # what ImageFolder's default loader gives
        except (OSError, ValueError, SyntaxError) as e:  # PIL: unidentified, truncated, broken stream
            raise UserError(f"unreadable image {p} ({str(e).splitlines()[0][:120]}) (fix or delete it)") from None
    if len(shapes := {a.shape for a in out}) > 1:
        raise ValueError(f"images of several sizes {sorted(shapes)[:3]} (the decode cache needs one size)")
    return np.stack(out) if out else np.zeros((0, 32, 32, 3), np.uint8)


def folder_fingerprint(samples: list[tuple[str, int]]) -> str:
    """Hash of the (path, label, size, mtime) list: any added, removed or rewritten file changes it."""
    h = hashlib.sha256()
    for path, label in sorted(samples):
        st = os.stat(path)
        h.update(f"{path}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode(errors="surrogateescape"))
    return h.hexdigest()[:16]


def decode_folder(folder: Path, cache_dirs: tuple[Path, ...], workers: int, writer: bool, classes=None) -> CIFARArrays:
    """An ImageFolder decoded once into ``.decoded-<split>-<hash>.npz`` in the first writable cache dir: ``writer``
    (one rank per host) decodes with ``workers`` processes and writes it atomically. Call on every rank (a barrier).
    ``classes``: the training set's class names, which label this folder by name, so a class it lacks shifts none."""
    from torchvision.datasets import ImageFolder

    try:
        found = ImageFolder(str(folder))
    except (OSError, RecursionError) as e:  # os.walk recurses: nesting past Python's limit ends it
        raise UserError(f"bad ImageFolder {folder}: {e}") from None
    samples, classes = found.samples, classes or found.classes
    dirs = {os.path.dirname(p) for p, _ in samples}  # ImageFolder follows symlinks, back into the tree too
    if len({os.path.realpath(d) for d in dirs}) < len(dirs):
        raise UserError(f"{folder} lists a folder twice, through a symlink into itself (remove the link)")
    if odd := next((p for p, _ in samples if not os.path.isfile(p)), None):  # a FIFO would block its reader
        raise UserError(f"unreadable image {odd} (not a regular file: a dangling symlink, a FIFO?) (fix or delete it)")
    if unknown := sorted(set(found.classes) - set(classes)):
        raise UserError(f"{folder} has class folders that train/ lacks: {', '.join(unknown[:5])} (name them alike)")
    samples = [(p, classes.index(found.classes[t])) for p, t in samples]
    name = f".decoded-{folder.name}-{folder_fingerprint(samples)}.npz"
    cache_dir = next((d for d in cache_dirs if os.access(d, os.W_OK)), cache_dirs[-1])
    if cache_dir != cache_dirs[0]:
        print0(f"note: {cache_dirs[0]} is not writable; the decoded images are cached in {cache_dir}")
    path = cache_dir / name
    if writer and not path.exists():
        paths = [p for p, _ in samples]
        chunks = [paths[i : i + 1000] for i in range(0, len(paths), 1000)]
        try:
            if workers < 1 or len(chunks) == 1:
                data = _decode(paths)
            else:  # processes from a fork server: a fork of this process, with gloo's threads, can hang
                import multiprocessing
                from concurrent.futures import ProcessPoolExecutor

                ctx = multiprocessing.get_context("forkserver" if sys.platform == "linux" else "spawn")
                with ProcessPoolExecutor(min(workers, len(chunks)), mp_context=ctx) as pool:
                    data = np.concatenate(list(pool.map(_decode, chunks)))
        except (OSError, ValueError) as e:
            raise UserError(f"cannot decode {folder}: {e}") from None
        with atomic_write(path) as f:
            np.savez(f, data=data, targets=np.array([t for _, t in samples], dtype=np.int64))
        for old in set(cache_dir.glob(f".decoded-{folder.name}-*.npz")) - {path}:  # of older versions of the folder
            old.unlink(missing_ok=True)
        print0(f"decoded {len(paths)} images of {folder} into {path}")
    broadcast_object(None)  # a collective: the other ranks wait here for the file
    with np.load(path) as z:
        out = CIFARArrays(z["data"], z["targets"].tolist())
    out.classes = classes
    return out


def download(root: Path) -> str | None:
    """torchvision's CIFAR-10 files fetched and MD5-checked into ``root``; why not, if they could not be."""
    from torchvision import datasets

    try:
        datasets.CIFAR10(str(root), download=True)
    except (OSError, RuntimeError) as e:  # no network, a proxy, a failed checksum
        return (f"--download: cannot fetch CIFAR-10 into {root} ({str(e)[:160]}) (check the network, or put "
                "cifar-10-batches-py/ there by hand)")  # fmt: skip


def load_splits(args, cache_dir: Path, writer: bool, is_main: bool):
    """(train, eval, eval_name) datasets for the chosen source, with their transforms (none with --gpu-data)."""
    tf_eval = None if args.gpu_data else T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    tf_train = None if args.gpu_data else train_transform(args, tf_eval)
    if args.synthetic:
        return synthetic(5000, args.seed, tf_train), synthetic(1000, args.seed + 1, tf_eval), "val"
    root = Path(args.data_dir)
    if args.download or (root / "cifar-10-batches-py").is_dir():
        if args.download and (error := broadcast_object(download(root) if is_main else None)):  # rank 0 fetches it
            raise UserError(error)
        train = read_pickles(root / "cifar-10-batches-py", train=True)
        test, eval_name = read_pickles(root / "cifar-10-batches-py", train=False), "test"
    elif (root / "train").is_dir():
        test_dir = next((root / s for s in ("test", "val") if (root / s).is_dir()), None)
        if test_dir is None and args.val_split <= 0:
            raise UserError(f"{root} has train/ but no test/ or val/ (pass --val-split 5000 to hold out part of train)")
        decode = lambda d, classes=None: decode_folder(d, (root, cache_dir), args.workers, writer, classes)  # noqa: E731
        train = decode(root / "train")
        test = decode(test_dir, train.classes) if test_dir else None
        eval_name = test_dir.name if test_dir else "val"
        for folder, ds, exact in ((root / "train", train, True), (test_dir, test, False)):
            n = len(set(ds.targets)) if ds is not None else 10
            if n > 10 or (exact and n != 10):  # more: labels past the model's 10 outputs, an IndexError in the loss
                raise UserError(f"{folder} has {n} class folders but the model has 10 outputs (CIFAR-10: one "
                                "folder per class, 10 of them)")  # fmt: skip
    else:
        raise UserError(f"no CIFAR-10 at {root} (expected cifar-10-batches-py/ or train/<class>/*.jpg; use "
                        "--download, --data-dir DIR or --synthetic)")  # fmt: skip
    if len(set(train.targets)) == 1:
        print0(f"warning: every training image of {root} has label {train.targets[0]}: one class trains to a loss "
               "of 0 and learns nothing (check the data)", file=sys.stderr)  # fmt: skip
    if args.val_split > 0:  # seeded hold-out: identical on every rank and rerun; never seen in training
        n = len(train)
        if args.val_split >= n:
            raise UserError(f"--val-split {args.val_split} leaves no training images (train has {n})")
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(mix_seed(args.seed, 12345))).numpy()
        held, kept = perm[: args.val_split], perm[args.val_split :]
        y = np.asarray(train.targets)
        train, test, eval_name = CIFARArrays(train.data[kept], y[kept]), CIFARArrays(train.data[held], y[held]), "val"
    train.transform, test.transform = tf_train, tf_eval
    return train, test, eval_name


def train_transform(args, tf_eval):
    tfs = [T.RandomCrop(32, padding=4, padding_mode="reflect"), T.RandomHorizontalFlip(), tf_eval]
    if args.random_erasing > 0:
        tfs.append(T.RandomErasing(args.random_erasing, scale=ERASE_SCALE, ratio=ERASE_RATIO, value=0))
    return T.Compose(tfs)


class DeviceData:
    """--gpu-data: the uint8 dataset on the device (padded once for the crop), augmented a batch at a time with a
    generator seeded per batch, so that a resume mid-epoch is exact."""

    def __init__(self, train_ds, eval_ds, device: torch.device):
        import torch.nn.functional as F

        (train_x, self.train_y), (self.eval_x, self.eval_y) = [  # uint8 NHWC images, their labels
            (torch.from_numpy(d.data).to(device), torch.tensor(d.targets, device=device)) for d in (train_ds, eval_ds)
        ]
        self.train_x = F.pad(train_x.permute(0, 3, 1, 2), (4, 4, 4, 4), mode="reflect").permute(0, 2, 3, 1).contiguous()

    def train_batches(self, indices: list[int], batch_size: int, erasing: float, seed: int, epoch: int, rank: int,
                      start: int):  # fmt: skip
        gen = torch.Generator(self.train_x.device)
        idx = torch.tensor(indices, device=self.train_x.device, dtype=torch.long)
        # no indices: resumed at the epoch's last step, where split() would still give one empty batch
        for i, b in enumerate(idx.split(batch_size) if indices else (), start=start):
            gen.manual_seed(mix_seed(seed, epoch, rank, i))
            x = normalize(gpu_crop_flip(self.train_x[b], gen))
            yield (gpu_random_erasing(x, erasing, gen) if erasing else x), self.train_y[b]

    def eval_batches(self, rank: int, world_size: int):
        for b in torch.arange(rank, len(self.eval_y), world_size, device=self.eval_y.device).split(512):
            yield normalize(self.eval_x[b]), self.eval_y[b]


_MEAN_STD: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def normalize(x_uint8_nhwc: torch.Tensor) -> torch.Tensor:
    """uint8 NHWC -> normalized float NCHW (a channels_last view)."""
    dev = x_uint8_nhwc.device
    if dev not in _MEAN_STD:  # made once per device: a host->device copy inside the loop would sync every step
        _MEAN_STD[dev] = torch.tensor(MEAN, device=dev) * 255, torch.tensor(STD, device=dev) * 255
    mean, std = _MEAN_STD[dev]
    return ((x_uint8_nhwc.float() - mean) / std).permute(0, 3, 1, 2)


def gpu_crop_flip(x_padded: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random 32x32 crop of 40x40 padded uint8 NHWC images plus random flip, in one gather."""
    b, dev = x_padded.shape[0], x_padded.device
    dx, dy = torch.randint(0, 9, (2, b), device=dev, generator=gen)
    flip = torch.rand(b, device=dev, generator=gen) < 0.5
    ar = torch.arange(32, device=dev)
    rows = dy[:, None] + ar
    cols = dx[:, None] + torch.where(flip[:, None], 31 - ar, ar)
    return x_padded[torch.arange(b, device=dev)[:, None, None], rows[:, :, None], cols[:, None, :]]


def gpu_random_erasing(x: torch.Tensor, p: float, gen: torch.Generator) -> torch.Tensor:
    """torchvision's RandomErasing(p, value=0) on each image of a normalized batch, without a loop: up to 10 tries
    of an area and aspect ratio, the first that fits is erased."""
    n, _, h, w = x.shape
    dev = x.device
    u = torch.rand(5, n, ERASE_TRIES, device=dev, generator=gen)
    area = h * w * (ERASE_SCALE[0] + (ERASE_SCALE[1] - ERASE_SCALE[0]) * u[0])
    lo, hi = np.log(ERASE_RATIO[0]), np.log(ERASE_RATIO[1])
    aspect = torch.exp(lo + (hi - lo) * u[1])
    eh, ew = torch.sqrt(area * aspect).round().long(), torch.sqrt(area / aspect).round().long()
    fits = (eh < h) & (ew < w)
    first = torch.where(fits, torch.arange(ERASE_TRIES, device=dev), ERASE_TRIES).min(dim=1).values  # first fit
    pick = first.clamp(max=ERASE_TRIES - 1)[:, None]
    eh, ew = eh.gather(1, pick)[:, 0], ew.gather(1, pick)[:, 0]
    top = (u[2].gather(1, pick)[:, 0] * (h - eh + 1)).long()  # uniform in [0, h - eh]
    left = (u[3].gather(1, pick)[:, 0] * (w - ew + 1)).long()
    on = (torch.rand(n, device=dev, generator=gen) < p) & (first < ERASE_TRIES)
    ar_h, ar_w = torch.arange(h, device=dev), torch.arange(w, device=dev)
    rows = (ar_h >= top[:, None]) & (ar_h < (top + eh)[:, None])
    cols = (ar_w >= left[:, None]) & (ar_w < (left + ew)[:, None])
    mask = rows[:, :, None] & cols[:, None, :] & on[:, None, None]
    return x.masked_fill(mask[:, None], 0.0)
