"""imagenet/train.py's inputs: the command-line checks that run before any process starts, --pretrained
weights (fetched once, with a one-line error when offline), and the Pillow data path that names unreadable files.
"""

from __future__ import annotations

import argparse
import difflib
import os
import socket
from pathlib import Path

import PIL
import torch
import torchvision

from common.checks import check_positive_ints, check_shared, finite, need
from common.errors import UserError

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's channel statistics


# ------------------------------------------------------------------ inputs (cheap checks, before any process starts)


def check_args(args: argparse.Namespace) -> None:
    check_shared(args)
    check_positive_ints(args, "train_crop_size", "val_resize_size", "val_crop_size", "lr_step_size", "nproc_per_node")
    need(min(args.dummy_sizes) >= 1, "--dummy-sizes", " ".join(map(str, args.dummy_sizes)), "must be at least 1",
         "train and val images, e.g. --dummy-sizes 1000 100")  # fmt: skip
    need(finite(args.lr_gamma) and args.lr_gamma > 0, "--lr-gamma", args.lr_gamma, "must be above 0", "e.g. 0.1")
    for flag, value in (("--mixup-alpha", args.mixup_alpha), ("--cutmix-alpha", args.cutmix_alpha)):
        need(finite(value) and value >= 0, flag, value, "must be a finite number >= 0", "0: off")
    need(0 <= args.ema < 1, "--ema", args.ema, "must be in [0, 1)", "e.g. 0.9999; 0: off")
    need(0 <= args.start_epoch < args.epochs, "--start-epoch", args.start_epoch, f"must be in 0..{args.epochs - 1}",
         "an epoch before --epochs")  # fmt: skip
    need(args.gpu is None or args.gpu >= 0, "--gpu", args.gpu, "must be 0 or more", "a GPU index")
    need(args.weights is None or args.pretrained, "--weights", args.weights, "needs --pretrained", "add --pretrained")
    archs = torchvision.models.list_models(module=torchvision.models)
    if args.arch not in archs:
        near = difflib.get_close_matches(args.arch, archs, n=3)
        raise UserError(f"unknown --arch {args.arch!r} (did you mean {', '.join(near) or 'resnet50'}?)")
    if args.gpu is not None and not torch.cuda.is_available():
        raise UserError(f"--gpu {args.gpu} but no CUDA GPU is visible (drop --gpu to run on the CPU)")
    if args.synthetic:
        return
    if not args.data:
        raise UserError("DATA is required (a folder with train/ and val/ of class folders), or pass --dummy")
    root = Path(args.data)
    if root.is_file():
        raise UserError(f"data dir {root} is a file (give the folder that holds train/ and val/)")
    if not root.is_dir():
        raise UserError(f"data dir {root} does not exist")
    classes = {}
    for split in ("val",) if args.evaluate else ("train", "val"):
        d = root / split
        if not d.is_dir():
            raise UserError(f"{root} has no {split}/ folder (expected {root}/{split}/<class>/<image>)")
        classes[split] = sorted(e.name for e in os.scandir(d) if e.is_dir())
        if not classes[split]:
            loose = any(e.is_file() for e in os.scandir(d))
            raise UserError(
                f"{d} has no class folders"
                + (" (ImageNet's val/ ships flat: sort it into class folders, e.g. with valprep.sh)" if loose else "")
            )
    if "train" in classes and classes["train"] != classes["val"]:
        diff = sorted(set(classes["train"]) ^ set(classes["val"]))
        raise UserError(
            f"{root}/train has {len(classes['train'])} classes but val has {len(classes['val'])} "
            f"(they must match; first difference: {diff[0]})"
        )


def weights_file(args: argparse.Namespace):
    """The torchvision weights --pretrained asks for and their path in the torch hub cache."""
    from torchvision.models import get_model_weights

    enum = get_model_weights(args.arch)
    name = args.weights or ("IMAGENET1K_V1" if "IMAGENET1K_V1" in enum.__members__ else "DEFAULT")
    if name not in enum.__members__:
        raise UserError(f"--weights {name}: {args.arch} has {', '.join(enum.__members__)}")
    w = enum[name]
    return w, Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(w.url)


def fetch_weights(args: argparse.Namespace) -> str | None:
    """Download --pretrained weights into the cache if missing; returns an error text instead of hanging."""
    w, path = weights_file(args)
    if path.is_file():
        return None
    hash_prefix = torch.hub.HASH_REGEX.search(path.name)
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(30)  # an offline node fails in seconds, not after minutes of retries
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.hub.download_url_to_file(w.url, str(path), hash_prefix and hash_prefix.group(1), progress=False)
        return None
    except (OSError, RuntimeError) as e:
        return (
            f"--pretrained: cannot download {w.url} ({str(e).splitlines()[0][:120]}); offline? download it "
            f"where there is network and copy it to {path} (TORCH_HOME sets the cache)"
        )
    finally:
        socket.setdefaulttimeout(old)


# ------------------------------------------------------------------ data


class CheckedImageFolder(torchvision.datasets.ImageFolder):
    """ImageFolder whose unreadable files come back as (None, message) instead of killing a worker."""

    def __getitem__(self, i):
        path, target = self.samples[i]
        try:
            return self.transform(self.loader(path)), target
        except (OSError, ValueError, SyntaxError) as e:  # PIL: unidentified, truncated, broken stream
            why = "not an image PIL can identify" if isinstance(e, PIL.UnidentifiedImageError) else str(e)
            return None, f"{path} ({why.splitlines()[0][:120]})"


def image_folder(root: Path, tf) -> CheckedImageFolder:
    """The Pillow path's dataset (--gpu-decode wraps its .samples in gpu_decode.EncodedImages)."""
    try:
        return CheckedImageFolder(str(root), transform=tf)
    except (FileNotFoundError, OSError) as e:
        raise UserError(f"bad ImageFolder {root}: {str(e).splitlines()[0][:200]}") from None


def collate(batch):
    """default_collate of the readable samples, plus the messages of the unreadable ones."""
    good = [s for s in batch if s[0] is not None]
    x, y = torch.utils.data.default_collate(good) if good else (None, None)
    return x, y, [msg for img, msg in batch if img is None]
