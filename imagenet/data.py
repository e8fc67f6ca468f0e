"""imagenet/train.py's inputs: the command line and its checks, --pretrained weights, the Pillow data path."""

from __future__ import annotations

import argparse
import difflib
import os
import socket
import sys
from pathlib import Path

import PIL
import torch
import torchvision
import torchvision.transforms as T
from common.checks import add_run_args, check_positive_ints, check_shared, finite, need

from common.distributed import add_dist_args
from common.errors import UserError

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's channel statistics


# defaults each recipe gives to the flags left unset
# fmt: off
RECIPES = {
    # torchvision V1 / pytorch/examples
    "classic": dict(lr=0.1, momentum=0.9, weight_decay=1e-4, label_smoothing=0.0, lr_schedule="step",
                    warmup_epochs=0.0, norm_bias_decay=True),
    # NVIDIA DeepLearningExamples ResNet50 v1.5
    "modern": dict(lr=0.256, momentum=0.875, weight_decay=1 / 32768, label_smoothing=0.1, lr_schedule="cosine",
                   warmup_epochs=5.0, norm_bias_decay=False),
}
# fmt: on


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):  # no "(default: None)" on flags that --recipe or the launcher fills in
        return action.help if action.default is None else super()._get_help_string(action)


def rd(name: str) -> str:
    return "default: " + ", ".join(
        f"{r} {v[name]:.4g}" if type(v[name]) is float else f"{r} {v[name]}" for r, v in RECIPES.items()
    )  # noqa: E501


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train an ImageNet classifier (ResNet50 by default) with DistributedDataParallel.",
        formatter_class=HelpFormatter,
        epilog="Differences from pytorch/examples imagenet/main.py: -b and -j count per process (main.py divides\n"
        "them by the GPUs of a node); --lr is for 256 images and is scaled to the global batch; --resume defaults\n"
        "to auto (continue from OUTPUT_DIR/last.pt); checkpoints and metrics go to --output-dir; --seed defaults\n"
        "to 0. --world-size/--rank count nodes with --multiprocessing-distributed (as in main.py), processes\n"
        "otherwise. See imagenet/README.md.",
    )
    p.add_argument("data", metavar="DATA", nargs="?", help="ImageFolder root: train/<class>/* and val/<class>/*")
    g = p.add_argument_group("data")
    g.add_argument("-j", "--workers", type=int, default=4, help="DataLoader workers per process (main.py: per node)")
    g.add_argument(
        "--synthetic", "--dummy", dest="synthetic", action="store_true",
        help="random batches made on the device, deterministic in (seed, epoch, rank, step): the model, not the disk",
    )  # fmt: skip
    g.add_argument(
        "--dummy-sizes", type=int, nargs=2, default=(1281167, 50000), metavar=("TRAIN", "VAL"), help="--dummy images"
    )
    g.add_argument("--train-crop-size", type=int, default=224, help="RandomResizedCrop size")
    g.add_argument("--val-resize-size", type=int, default=256, help="Resize before the center crop")
    g.add_argument("--val-crop-size", type=int, default=224, help="CenterCrop size")
    g.add_argument("--skip-bad-images", action="store_true", help="skip, count and report unreadable images")
    g.add_argument("--gpu-decode", action="store_true", help="decode JPEGs (torchvision.io) and augment on the GPU")
    g = p.add_argument_group("model")
    g.add_argument("-a", "--arch", default="resnet50", help="any torchvision classification model name")
    g.add_argument("--pretrained", action="store_true", help="start from torchvision's ImageNet weights")
    g.add_argument("--weights", default=None, help="with --pretrained: IMAGENET1K_V1 (main.py's), V2, DEFAULT...")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    g.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across ranks (GPU only)")
    g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None, help="default: on with CUDA")
    g = p.add_argument_group("optimization (unset values come from --recipe)")
    g.add_argument("--recipe", choices=tuple(RECIPES), default="classic", help="classic: main.py; modern: NVIDIA-like")
    g.add_argument("--epochs", type=int, default=90, help="passes over the training set")
    g.add_argument("--start-epoch", type=int, default=0, help="start from this epoch when not resuming")
    g.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    g.add_argument(
        "-b", "--batch-size", type=int, default=256,
        help="per process (main.py: per node); global = this x world size x accum",
    )  # fmt: skip
    g.add_argument("--accum-steps", type=int, default=1, help="gradient accumulation micro-batches per step")
    g.add_argument(
        "--lr", "--learning-rate", type=float, help="for 256 images, scaled to the global batch; " + rd("lr")
    )
    g.add_argument("--momentum", type=float, help=rd("momentum"))
    g.add_argument("--wd", "--weight-decay", dest="weight_decay", type=float, help=rd("weight_decay"))
    g.add_argument("--norm-bias-decay", action=argparse.BooleanOptionalAction, help=rd("norm_bias_decay"))
    g.add_argument("--label-smoothing", type=float, help=rd("label_smoothing"))
    g.add_argument("--lr-schedule", choices=("step", "cosine"), help=rd("lr_schedule"))
    g.add_argument("--lr-step-size", type=int, default=30, help="step schedule: decay every N epochs")
    g.add_argument("--lr-gamma", type=float, default=0.1, help="step schedule: decay factor")
    g.add_argument("--warmup-epochs", type=float, help="linear warmup; " + rd("warmup_epochs"))
    g.add_argument("--mixup-alpha", type=float, default=0.0, help="mixup Beta(alpha, alpha) (0: off)")
    g.add_argument("--cutmix-alpha", type=float, default=0.0, help="cutmix Beta(alpha, alpha) (0: off)")
    g.add_argument("--ema", type=float, default=0.0, help="keep an EMA of the weights with this decay, e.g. 0.9999")
    g.add_argument(
        "--amp", choices=("auto", "bf16", "fp16", "none"), default="auto", help="auto: bf16 on GPU, off on CPU"
    )
    g.add_argument("-e", "--evaluate", action="store_true", help="evaluate --resume (or --pretrained) only")
    add_run_args(p, "runs/imagenet", print_freq=10)
    add_dist_args(p)
    g = p.add_argument_group("pytorch/examples launch mode")
    g.add_argument(
        "--multiprocessing-distributed", action="store_true",
        help="spawn --nproc-per-node processes on this node; --world-size/--rank then count NODES, and a "
        "process's global rank is rank x nproc-per-node + local rank (as in main.py)",
    )  # fmt: skip
    g.add_argument("--nproc-per-node", type=int, help="with --multiprocessing-distributed; default: GPUs, else 1")
    g.add_argument("--gpu", type=int, help="GPU id for a single process (or one per node with --dist-url)")
    return p


def apply_recipe(args: argparse.Namespace) -> argparse.Namespace:
    for k, v in RECIPES[args.recipe].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = apply_recipe(get_args_parser().parse_args(argv))
    check_args(args)
    return args


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
    from torchvision.models import get_model_weights

    enum = get_model_weights(args.arch)
    name = args.weights or ("IMAGENET1K_V1" if "IMAGENET1K_V1" in enum.__members__ else "DEFAULT")
    if name not in enum.__members__:
        raise UserError(f"--weights {name}: {args.arch} has {', '.join(enum.__members__)}")
    w = enum[name]
    return w, Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(w.url)


def fetch_weights(args: argparse.Namespace) -> str | None:
    """Download --pretrained weights into the cache if missing; an error text, not a hang, when offline."""
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
    try:
        return CheckedImageFolder(str(root), transform=tf)
    except (FileNotFoundError, OSError) as e:
        raise UserError(f"bad ImageFolder {root}: {str(e).splitlines()[0][:200]}") from None


def transforms(args: argparse.Namespace):
    normalize = [T.PILToTensor(), T.ConvertImageDtype(torch.float), T.Normalize(MEAN, STD)]
    tf_train = T.Compose([T.RandomResizedCrop(args.train_crop_size), T.RandomHorizontalFlip(), *normalize])
    tf_val = T.Compose([T.Resize(args.val_resize_size), T.CenterCrop(args.val_crop_size), *normalize])
    return tf_train, tf_val


def mixup_cutmix(args, num_classes: int):
    """--mixup-alpha/--cutmix-alpha: a transform of the device batch (None: off)."""
    from torchvision.transforms import v2

    ops = [v2.MixUp(alpha=args.mixup_alpha, num_classes=num_classes)] if args.mixup_alpha > 0 else []
    ops += [v2.CutMix(alpha=args.cutmix_alpha, num_classes=num_classes)] if args.cutmix_alpha > 0 else []
    return (ops[0] if len(ops) == 1 else v2.RandomChoice(ops)) if ops else None


def check_bad(args, rank: int, bad: list[str], split: str) -> None:
    """Unreadable images: a one-line error, or with --skip-bad-images a warning each."""
    if bad and not args.skip_bad_images:
        raise UserError(f"unreadable image {bad[0]} (fix or delete it, or pass --skip-bad-images)")
    for msg in bad:
        print(f"warning: rank {rank} skips unreadable {split} image {msg}", file=sys.stderr, flush=True)


def collate(batch):
    good = [s for s in batch if s[0] is not None]
    x, y = torch.utils.data.default_collate(good) if good else (None, None)
    return x, y, [msg for img, msg in batch if img is None]
