"""imagenet/train.py's inputs besides the command line: ImageFolders whose unreadable files are reported instead of
killing a worker, the transforms, mixup/cutmix on the device, and --pretrained's weights (a file, or the hub cache)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import PIL
import torch
import torchvision
import torchvision.transforms as T

from common.checkpoint import strip_prefixes
from common.distributed import all_reduce_sum
from common.errors import UserError

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's channel statistics


class CheckedImageFolder(torchvision.datasets.ImageFolder):
    """ImageFolder whose unreadable files come back as (None, message) instead of killing a worker."""

    def __getitem__(self, i):
        path, target = self.samples[i]
        try:
            if not os.path.isfile(path):  # a FIFO would block this worker
                raise OSError("not a regular file: a dangling symlink, a FIFO?")
            return self.transform(self.loader(path)), target
        except (OSError, ValueError, SyntaxError) as e:  # PIL: unidentified, truncated, broken stream
            why = "not an image PIL can identify" if isinstance(e, PIL.UnidentifiedImageError) else str(e)
            return None, f"{path} ({why.splitlines()[0][:120]})"


def image_folder(root: Path, tf) -> CheckedImageFolder:
    try:
        found = CheckedImageFolder(str(root), transform=tf)
    except (OSError, RecursionError) as e:  # os.walk recurses: nesting past Python's limit ends it
        raise UserError(f"bad ImageFolder {root}: {str(e).splitlines()[0][:200]}") from None
    dirs = {os.path.dirname(p) for p, _ in found.samples}  # ImageFolder follows symlinks, back into the tree too
    if len({os.path.realpath(d) for d in dirs}) < len(dirs):
        raise UserError(f"{root} lists a folder twice, through a symlink into itself (remove the link)")
    return found


def transforms(args):
    normalize = [T.PILToTensor(), T.ConvertImageDtype(torch.float), T.Normalize(MEAN, STD)]
    return (T.Compose([T.RandomResizedCrop(args.train_crop_size), T.RandomHorizontalFlip(), *normalize]),  # train
            T.Compose([T.Resize(args.val_resize_size), T.CenterCrop(args.val_crop_size), *normalize]))  # fmt: skip


def collate(batch):
    """(x, y, bad): the readable images of a batch, and "PATH (why)" for each unreadable one."""
    good = [s for s in batch if s[0] is not None]
    x, y = torch.utils.data.default_collate(good) if good else (None, None)
    return x, y, [msg for img, msg in batch if img is None]


def check_bad(args, rank: int, bad: list[str], split: str) -> None:
    """Unreadable images: a one-line error, or with --skip-bad-images a warning each."""
    if bad and not args.skip_bad_images:
        raise UserError(f"unreadable image {bad[0]} (fix or delete it, or pass --skip-bad-images)")
    for msg in bad:
        print(f"warning: rank {rank} skips unreadable {split} image {msg}", file=sys.stderr, flush=True)


def mixup_cutmix(args, num_classes: int):
    """--mixup-alpha/--cutmix-alpha: a transform of the device batch (None: off)."""
    from torchvision.transforms import v2

    ops = [v2.MixUp(alpha=args.mixup_alpha, num_classes=num_classes)] if args.mixup_alpha > 0 else []
    ops += [v2.CutMix(alpha=args.cutmix_alpha, num_classes=num_classes)] if args.cutmix_alpha > 0 else []
    return (ops[0] if len(ops) == 1 else v2.RandomChoice(ops)) if ops else None


def pretrained_weights(args, num_classes: int, local_rank: int, device: torch.device):
    """(weights, name) of --pretrained: FILE's state_dict (a checkpoint's model), or torchvision's entry (a state_dict
    for other than 1000 classes) downloaded once per node into the hub cache (offline: one line naming the path)."""
    if not args.pretrained:
        return None, None
    if args.pretrained is not True:  # a file, read as tensors only: it runs no code
        try:
            state = torch.load(args.pretrained, map_location="cpu", weights_only=True)
        except Exception as e:  # no such file, not one torch.save wrote, pickled code
            why = (str(e) or type(e).__name__).splitlines()[0][:160]
            raise UserError(f"--pretrained {args.pretrained}: cannot load it ({why})") from None
        state = state.get("model", state) if isinstance(state, dict) else {}  # a checkpoint: its model
        return strip_prefixes(state), args.pretrained
    enum = torchvision.models.get_model_weights(args.arch)
    name = args.weights or ("IMAGENET1K_V1" if "IMAGENET1K_V1" in enum.__members__ else "DEFAULT")
    if name not in enum.__members__:
        raise UserError(f"--weights {name}: {args.arch} has {', '.join(enum.__members__)}")
    w, err = enum[name], None
    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(w.url)
    if local_rank == 0 and not path.is_file():
        old = socket.getdefaulttimeout()
        socket.setdefaulttimeout(30)  # an offline node fails in seconds, not after minutes of retries
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            hash_prefix = torch.hub.HASH_REGEX.search(path.name)
            torch.hub.download_url_to_file(w.url, str(path), hash_prefix and hash_prefix.group(1), progress=False)
        except (OSError, RuntimeError) as e:
            err = (f"--pretrained: cannot download {w.url} ({str(e).splitlines()[0][:120]}); offline? download it "
                   f"where there is network and copy it to {path} (TORCH_HOME sets the cache)")  # fmt: skip
        finally:
            socket.setdefaulttimeout(old)
    if all_reduce_sum(torch.tensor([float(err is not None)], device=device)).item():  # a barrier before the read
        raise UserError(err or "--pretrained: downloading the weights failed on another node")
    return (w if num_classes == 1000 else w.get_state_dict(progress=False, weights_only=True)), w
