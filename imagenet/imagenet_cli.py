"""imagenet/train.py's command line, pytorch/examples main.py's: its flags, the recipes that fill those left unset, the
checks of the data folder, and main.py's launch modes: ``--multiprocessing-distributed`` (a process per GPU of this
node, ``--nproc-per-node`` on CPUs; ``--world-size``, ``--rank`` count nodes), ``--gpu N`` (one process on GPU N)."""

from __future__ import annotations

import argparse
import difflib
import functools
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torchvision

from common.args import ABOVE_0, AT_LEAST_0, COUNT, FRACTION, POSITIVE, add_shared_args
from common.distributed import DistInfo, cleanup_distributed, detect_launcher
from common.errors import UserError

# fmt: off
RECIPES = {  # the defaults each recipe gives the flags left unset
    # torchvision V1 / pytorch/examples
    "classic": dict(lr=0.1, momentum=0.9, weight_decay=1e-4, label_smoothing=0.0, lr_schedule="step",
                    warmup_epochs=0.0, norm_bias_decay=True),
    # NVIDIA DeepLearningExamples ResNet50 v1.5
    "modern": dict(lr=0.256, momentum=0.875, weight_decay=1 / 32768, label_smoothing=0.1, lr_schedule="cosine",
                   warmup_epochs=5.0, norm_bias_decay=False),
}
# fmt: on
EPILOG = """Differences from pytorch/examples imagenet/main.py: -b and -j count per process (main.py divides them by
the GPUs of a node); --lr is for 256 images and is scaled to the global batch; --resume defaults to auto (continue
from OUTPUT_DIR/last.pt); checkpoints and metrics go to --output-dir; --seed defaults to 0. --world-size/--rank count
nodes with --multiprocessing-distributed (as in main.py), processes otherwise. See imagenet/README.md."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):  # no "(default: None)" on flags that --recipe or the launcher fills in
        return action.help if action.default is None else super()._get_help_string(action)


def rd(name: str) -> str:  # the recipes' defaults of a flag, for its help
    return "default: " + ", ".join(f"{r} {v[name]:.4g}" if type(v[name]) is float else f"{r} {v[name]}"
                                   for r, v in RECIPES.items())  # fmt: skip


def arch(name: str) -> str:  # a type=: the name of a torchvision classifier
    if name not in (names := torchvision.models.list_models(module=torchvision.models)):
        near = ", ".join(difflib.get_close_matches(name, names, n=3)) or "resnet50"
        raise argparse.ArgumentTypeError(f"{name!r} is not a torchvision classifier (did you mean {near}?)")
    return name


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train an ImageNet classifier (ResNet-50 by default) with DDP.",
                                formatter_class=HelpFormatter, epilog=EPILOG)  # fmt: skip
    p.add_argument("data", metavar="DATA", nargs="?", help="ImageFolder root: train/<class>/* and val/<class>/*")
    g = p.add_argument_group("data")
    g.add_argument("-j", "--workers", type=COUNT, default=4, help="DataLoader workers per process (main.py: per node)")
    g.add_argument("--synthetic", "--dummy", dest="synthetic", action="store_true",
                   help="random batches made on the device, deterministic in (seed, epoch, rank, step): the model, "
                   "not the disk")  # fmt: skip
    g.add_argument("--dummy-sizes", type=POSITIVE, nargs=2, default=(1281167, 50000), metavar=("TRAIN", "VAL"),
                   help="--dummy images")  # fmt: skip
    g.add_argument("--train-crop-size", type=POSITIVE, default=224, help="RandomResizedCrop size")
    g.add_argument("--val-resize-size", type=POSITIVE, default=256, help="Resize before the center crop")
    g.add_argument("--val-crop-size", type=POSITIVE, default=224, help="CenterCrop size")
    g.add_argument("--skip-bad-images", action="store_true", help="skip, count and report unreadable images")
    g.add_argument("--gpu-decode", action="store_true", help="decode JPEGs (torchvision.io) and augment on the GPU")
    add_shared_args(p, "runs/imagenet", epochs=90)
    p.set_defaults(print_freq=10)  # main.py's
    g = p.add_argument_group("architecture")
    g.add_argument("-a", "--arch", type=arch, default="resnet50", help="any torchvision classification model name")
    g.add_argument("--pretrained", nargs="?", const=True, default=False, metavar="FILE",
                   help="start from ImageNet weights: torchvision's, or FILE's; other classes: a new head")  # fmt: skip
    g.add_argument("--weights", default=None, help="with --pretrained: IMAGENET1K_V1 (main.py's), V2, DEFAULT...")
    g = p.add_argument_group("optimization (unset values come from --recipe)")
    g.add_argument("--recipe", choices=tuple(RECIPES), default="classic", help="classic: main.py; modern: NVIDIA-like")
    g.add_argument("--start-epoch", type=COUNT, default=0, help="start from this epoch when not resuming")
    g.add_argument("-b", "--batch-size", type=POSITIVE, default=256,
                   help="per process (main.py: per node); global = this x world size x accum")  # fmt: skip
    g.add_argument("--lr", "--learning-rate", type=ABOVE_0, help="for 256 images, scaled to the global batch; "
                   + rd("lr"))  # fmt: skip
    g.add_argument("--momentum", type=FRACTION, help=rd("momentum"))
    g.add_argument("--wd", "--weight-decay", dest="weight_decay", type=AT_LEAST_0, help=rd("weight_decay"))
    g.add_argument("--norm-bias-decay", action=argparse.BooleanOptionalAction, help=rd("norm_bias_decay"))
    g.add_argument("--label-smoothing", type=FRACTION, help=rd("label_smoothing"))
    g.add_argument("--lr-schedule", choices=("step", "cosine"), help=rd("lr_schedule"))
    g.add_argument("--lr-step-size", type=POSITIVE, default=30, help="step schedule: decay every N epochs")
    g.add_argument("--lr-gamma", type=ABOVE_0, default=0.1, help="step schedule: decay factor")
    g.add_argument("--warmup-epochs", type=AT_LEAST_0, help="linear warmup; " + rd("warmup_epochs"))
    g.add_argument("--mixup-alpha", type=AT_LEAST_0, default=0.0, help="mixup Beta(alpha, alpha) (0: off)")
    g.add_argument("--cutmix-alpha", type=AT_LEAST_0, default=0.0, help="cutmix Beta(alpha, alpha) (0: off)")
    g.add_argument("--ema", type=FRACTION, default=0.0, help="evaluate an average of the weights, this decay (0: off)")
    g.add_argument("-e", "--evaluate", action="store_true", help="evaluate --resume (or --pretrained) only")
    g = p.add_argument_group("pytorch/examples launch mode")
    g.add_argument("--multiprocessing-distributed", action="store_true",
                   help="spawn --nproc-per-node processes on this node; --world-size/--rank then count NODES, and a "
                   "process's global rank is rank x nproc-per-node + local rank (as in main.py)")  # fmt: skip
    g.add_argument("--nproc-per-node", type=POSITIVE, help="with --multiprocessing-distributed; default: GPUs, else 1")
    g.add_argument("--gpu", type=COUNT, help="GPU id for a single process (or one per node with --dist-url)")
    return p


def apply_recipe(args: argparse.Namespace) -> None:  # the flags left unset take --recipe's values
    vars(args).update({k: v for k, v in RECIPES[args.recipe].items() if getattr(args, k) is None})
    if args.data is None and args.pretrained not in (True, False) and os.path.isdir(args.pretrained):  # main.py's
        args.data, args.pretrained = args.pretrained, True  # `--pretrained DATA`: the folder is DATA, not weights


def check_args(args: argparse.Namespace) -> None:
    """What no type= can check: flags against each other, the GPU, the data folder's layout and classes."""
    if args.start_epoch >= args.epochs:
        raise UserError(f"--start-epoch {args.start_epoch} must be in 0..{args.epochs - 1} (an epoch before --epochs)")
    if args.weights is not None and args.pretrained is not True:
        raise UserError(f"--weights {args.weights} needs --pretrained (without FILE: it names torchvision's file)")
    if args.gpu is not None and not torch.cuda.is_available():
        raise UserError(f"--gpu {args.gpu} but no CUDA GPU is visible (drop --gpu to run on the CPU)")
    if args.synthetic:
        return
    if not args.data:
        raise UserError("DATA is required (a folder with train/ and val/ of class folders), or pass --dummy")
    root = Path(args.data)
    if not root.is_dir():
        raise UserError(f"data dir {root} is a file (give the folder that holds train/ and val/)" if root.is_file()
                        else f"data dir {root} does not exist")  # fmt: skip
    classes = {}
    for split in ("val",) if args.evaluate else ("train", "val"):
        d = root / split
        if not d.is_dir():
            raise UserError(f"{root} has no {split}/ folder (expected {root}/{split}/<class>/<image>)")
        classes[split] = sorted(e.name for e in os.scandir(d) if e.is_dir())
        if not classes[split]:
            flat = any(e.is_file() for e in os.scandir(d))
            raise UserError(f"{d} has no class folders" + (" (ImageNet's val/ ships flat: sort it into class "
                            "folders, e.g. with valprep.sh)" if flat else ""))  # fmt: skip
    if "train" in classes and classes["train"] != classes["val"]:
        diff = sorted(set(classes["train"]) ^ set(classes["val"]))
        raise UserError(f"{root}/train has {len(classes['train'])} classes but val has {len(classes['val'])} (they "
                        f"must match; first difference: {diff[0]})")  # fmt: skip


def gpu_launch(args: argparse.Namespace) -> DistInfo | None:
    """--gpu N: this process on GPU N (one process, or one per node with --dist-url); None without --gpu."""
    if args.gpu is None:
        return None
    launch = detect_launcher(os.environ, args)
    if launch.launcher not in ("single", "dist-url"):
        raise UserError(f"--gpu picks one process's GPU; under {launch.launcher} each rank uses its local rank")
    return replace(launch, local_rank=args.gpu)


def _worker(local_rank: int, main: Callable, args, nprocs: int, node_rank: int, world: int, url: str, errors):
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nprocs))  # CPU ranks share the cores
    try:
        main(args, DistInfo(node_rank * nprocs + local_rank, local_rank, world, launcher="mp.spawn", init_method=url))
    except UserError as e:
        errors.put(str(e))  # the parent prints each distinct error once
        sys.exit(2)
    finally:
        cleanup_distributed()


def _forward(ctx, signum: int, frame) -> None:  # preemption: every worker checkpoints at its next step, exits 75
    for p in ctx.processes:
        if p.is_alive():
            os.kill(p.pid, signum)


def spawn(main: Callable[[argparse.Namespace, DistInfo], None], args: argparse.Namespace) -> None:
    """Run ``main(args, launch)`` in --nproc-per-node processes on this node; forward SIGTERM/SIGUSR2 to them."""
    import torch.multiprocessing as mp

    if "TORCHELASTIC_RUN_ID" in os.environ:
        raise UserError("--multiprocessing-distributed starts its own processes: drop it under torchrun")
    if args.dist_url == "env://":  # main.py reads the node count and node rank from the environment
        args.world_size = args.world_size if args.world_size > 0 else int(os.environ.get("WORLD_SIZE", 1))
        args.rank = args.rank if args.rank >= 0 else int(os.environ.get("RANK", 0))
    nodes, node_rank = max(args.world_size, 1), max(args.rank, 0)
    if nodes > 1 and (args.rank < 0 or not args.dist_url):
        raise UserError("several nodes need --dist-url tcp://NODE0_ADDR:PORT and --rank NODE_RANK on every node")
    if node_rank >= nodes:
        raise UserError(f"--rank {args.rank} is a node rank and must be below --world-size {nodes} (nodes)")
    if not args.dist_url:  # one node: any free local port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.dist_url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    nprocs = args.nproc_per_node or torch.cuda.device_count() or 1
    errors = mp.get_context("spawn").SimpleQueue()
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # no "Terminating process" noise
    ctx = mp.spawn(_worker, args=(main, args, nprocs, node_rank, nodes * nprocs, args.dist_url, errors),
                   nprocs=nprocs, join=False)  # fmt: skip
    for sig in (signal.SIGTERM, signal.SIGUSR2):
        signal.signal(sig, functools.partial(_forward, ctx))
    try:
        while not ctx.join():
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        if msgs := [errors.get() for _ in range(nprocs) if not errors.empty()]:  # one a worker at most
            raise UserError("\nerror: ".join(dict.fromkeys(msgs))) from None
        if isinstance(e, mp.ProcessRaisedException):
            raise  # a bug: shows the worker's traceback
        if e.exit_code != 75:  # 75: the ranks stopped on a signal after a checkpoint, and rank 0 said so
            print(f"{os.path.basename(sys.argv[0])}: {e}", file=sys.stderr, flush=True)  # e.g. killed by a signal
        sys.exit(e.exit_code if e.exit_code > 0 else 1)
