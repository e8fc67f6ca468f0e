"""The flags every train.py shares, defined once, and ``type=`` checks: a bad value is argparse's one error line."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from common.errors import UserError


def checked(kind: type, ok: Callable[[float], bool], what: str) -> Callable[[str], float]:
    """A ``type=``: the text as ``kind`` if it is finite and ``ok`` holds for it, else ``<text> <what>``."""

    def parse(text: str) -> float:
        value = kind(text)  # not a number: argparse's own "invalid int value: 'x'"
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"{text} {what}")
        return value

    parse.__name__ = kind.__name__
    return parse


POSITIVE = checked(int, lambda v: v >= 1, "must be at least 1")
COUNT = checked(int, lambda v: v >= 0, "must be 0 or more")
ABOVE_0 = checked(float, lambda v: v > 0, "must be a finite number above 0")
AT_LEAST_0 = checked(float, lambda v: v >= 0, "must be a finite number >= 0")
FRACTION = checked(float, lambda v: 0 <= v < 1, "must be in [0, 1)")
PROBABILITY = checked(float, lambda v: 0 <= v <= 1, "must be in [0, 1]")


def add_shared_args(p: argparse.ArgumentParser, output_dir: str, epochs: int, vision: bool = True) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--compile", action="store_true", help="torch.compile the training model")
    g.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    g.add_argument("--amp", choices=("auto", "bf16", "fp16", "none"), default="auto", help="auto: bf16 on GPU only")
    if vision:
        g.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across ranks (GPU only)")
        g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, help="NHWC (default: with CUDA)")
    g = p.add_argument_group("run")
    g.add_argument("--output-dir", default=output_dir, help="config.json, metrics.jsonl and checkpoints")
    g.add_argument("--resume", default="auto", help="auto (continue from output-dir/last.pt if present) | PATH | none")
    g.add_argument("--overwrite", action="store_true", help="with --resume none: start over where a run saved")
    g.add_argument("--epochs", type=POSITIVE, default=epochs, help="passes over the training set")
    g.add_argument("--max-steps", type=COUNT, default=0, help="stop after this many optimizer steps (0: no limit)")
    g.add_argument("--accum-steps", type=POSITIVE, default=1, help="gradient accumulation micro-batches per step")
    g.add_argument("--save-every-steps", type=COUNT, default=0, help="also checkpoint every N steps (0: epoch ends)")
    g.add_argument("--keep-last", type=COUNT, default=0, help="keep the N newest step_*.pt copies (0: none)")
    g.add_argument("--eval-every", type=COUNT, default=1, help="evaluate every N epochs and at the end (0: never)")
    g.add_argument("--seed", type=checked(int, lambda v: 0 <= v < 2**63, "must be in 0..2**63-1"), default=0,
                   help="data order, augmentation and initialization")  # fmt: skip
    g.add_argument("-p", "--print-freq", type=POSITIVE, default=50, help="log every N steps")
    g.add_argument("--wandb", action="store_true", help="log to Weights & Biases from rank 0 (honours WANDB_MODE)")
    add_dist_args(p)


def add_dist_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distributed")
    g.add_argument("--dist-backend", default=None, help="nccl | gloo | xccl (default: nccl with CUDA, else gloo)")
    g.add_argument("--dist-url", default=None, help="init method, e.g. tcp://HOST:PORT (only without a launcher)")
    g.add_argument("--world-size", type=POSITIVE, default=-1, help="number of processes (with --dist-url)")
    g.add_argument("--rank", type=COUNT, default=-1, help="global rank of this process (with --dist-url)")
    # torch.distributed.launch passes --local-rank (torch>=2.0) or --local_rank (older)
    g.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--dist-timeout", type=ABOVE_0, default=600.0, help="seconds before a rendezvous, collective fails")
    g.add_argument("--stall-timeout", type=AT_LEAST_0, default=1200.0,
                   help="seconds without progress before a rank dumps its stacks and exits 124 (0: off)")  # fmt: skip


def from_checkpoint(p: argparse.ArgumentParser, args, saved: dict, model: tuple, evaluation: tuple) -> None:
    """-e: the ``model`` and ``evaluation`` flags the command line leaves out take the checkpoint's (``saved``)."""
    unset = object()  # in a namespace holding it for every flag, a parse replaces only the flags given
    given = vars(p.parse_known_args(namespace=argparse.Namespace(**dict.fromkeys(vars(args), unset)))[0])
    for k in model + evaluation:
        if given[k] is unset:
            setattr(args, k, saved.get(k, getattr(args, k)))
        elif k in model and saved.get(k) not in (None, given[k]):
            raise UserError(f"--{k.replace('_', '-')} {given[k]} contradicts the checkpoint's {saved[k]} (drop it)")
