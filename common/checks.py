"""The run flags every script shares (``add_run_args``), and checks that make each bad value one line before any
process group, dataset or model exists: ``check_shared`` for the shared flags, ``need`` for a script's own."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from common.errors import UserError


def need(ok: bool, flag: str, value: object, what: str, hint: str) -> None:
    """Raise ``<flag> <value> <what> (<hint>)`` unless ``ok``."""
    if not ok:
        raise UserError(f"{flag} {value} {what} ({hint})")


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# (attribute, flag, test, what it must be, hint) for the flags the scripts share
_RULES: list[tuple[str, str, Callable[[float], bool], str, str]] = [
    ("batch_size", "--batch-size", lambda v: v >= 1, "must be at least 1", "images per process, e.g. -b 32"),
    ("accum_steps", "--accum-steps", lambda v: v >= 1, "must be at least 1", "1: no accumulation"),
    ("workers", "-j/--workers", lambda v: v >= 0, "must be 0 or more", "0 loads in the main process"),
    ("lr", "--lr", lambda v: finite(v) and v > 0, "must be a finite number above 0", "e.g. --lr 0.1"),
    ("momentum", "--momentum", lambda v: finite(v) and 0 <= v < 1, "must be in [0, 1)", "e.g. --momentum 0.9"),
    ("weight_decay", "--wd", lambda v: finite(v) and v >= 0, "must be a finite number >= 0", "e.g. --wd 5e-4"),
    ("label_smoothing", "--label-smoothing", lambda v: finite(v) and 0 <= v < 1, "must be in [0, 1)", "e.g. 0.1"),
    ("print_freq", "-p/--print-freq", lambda v: v >= 1, "must be at least 1", "log every N steps"),
    ("epochs", "--epochs", lambda v: v >= 1, "must be at least 1", "the number of passes over the data"),
    ("max_steps", "--max-steps", lambda v: v >= 0, "must be 0 or more", "0: no limit"),
    ("save_every_steps", "--save-every-steps", lambda v: v >= 0, "must be 0 or more", "0: only at epoch ends"),
    ("keep_last", "--keep-last", lambda v: v >= 0, "must be 0 or more", "0: keep no step_*.pt copies"),
    ("eval_every", "--eval-every", lambda v: v >= 0, "must be 0 or more", "0: never evaluate"),
    ("seed", "--seed", lambda v: 0 <= v < 2**63, "must be in 0..2**63-1", "e.g. --seed 0"),
    ("dist_timeout", "--dist-timeout", lambda v: finite(v) and v > 0, "must be a number of seconds above 0", "600"),
    ("stall_timeout", "--stall-timeout", lambda v: finite(v) and v >= 0, "must be seconds >= 0", "0 turns it off"),
    ("world_size", "--world-size", lambda v: v == -1 or v >= 1, "must be at least 1", "the number of processes"),
    ("rank", "--rank", lambda v: v >= -1, "must be 0 or more", "this process's global rank"),
    ("warmup_epochs", "--warmup-epochs", lambda v: finite(v) and v >= 0, "must be a finite number >= 0", "0: none"),
]


def check_dist_url(url: str | None) -> None:
    """``--dist-url``: tcp://HOST:PORT, env:// or file:///PATH."""
    if url is None:
        return
    parts = urlsplit(url)
    need(parts.scheme in ("tcp", "env", "file"), "--dist-url", url, "has an unknown scheme",
         "use tcp://HOST:PORT, env:// or file:///shared/path")  # fmt: skip
    if parts.scheme == "tcp":
        check_host_port(url[len("tcp://") :], f"--dist-url {url}")
    if parts.scheme == "file":  # torch's FileStore waits forever, past --dist-timeout, for a directory that is missing
        folder = Path(parts.path).parent
        need(folder.is_dir(), "--dist-url", url, f"names a file in {folder}, which is not a directory",
             "give a path on a filesystem that every process shares")  # fmt: skip


def check_host_port(host_port: str, where: str) -> None:
    """HOST:PORT with a host and a port in 1..65535."""
    host, _, port = host_port.rpartition(":")
    if not host.strip("[]"):
        raise UserError(f"{where} names no host (use tcp://HOST:PORT)")
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise UserError(f"{where} has no valid port (a number in 1..65535, e.g. tcp://{host}:29500)")


def check_output_dir(args: argparse.Namespace, writes: tuple[str, ...] = ()) -> None:
    """--output-dir can be a directory; --resume none does not overwrite a run without --overwrite."""
    need(str(args.output_dir).strip(), "--output-dir", "''", "is empty", "name a directory, e.g. runs/NAME")
    out = Path(args.output_dir)
    p = next(p for p in (out, *out.parents) if p.exists())  # the filesystem root always does
    need(p.is_dir(), "--output-dir", args.output_dir, f"is under the file {p}" if p != out else "is a file",
         "give a directory")  # fmt: skip
    written = (".lock", "config.json", "metrics.jsonl", "last.pt", "best.pt", *writes)  # by a run, in --output-dir
    odd = [n for n in written if (out / n).exists() and not (out / n).is_file()]
    if odd:  # a directory (or a FIFO) there would fail the run's first write, or the last checkpoint's rename
        raise UserError(f"{out / odd[0]} is not a file, and a run writes its {odd[0]} there (move it away, or pick "
                        "another --output-dir)")  # fmt: skip
    found = [n for n in ("last.pt", "best.pt") if (out / n).is_file()]
    writes = not getattr(args, "evaluate", False) and not getattr(args, "overwrite", True)
    if writes and args.resume == "none" and found:
        raise UserError(
            f"--resume none would overwrite the run in {out} ({', '.join(found)}) (pass --overwrite to start over "
            "there, --resume auto to continue it, or another --output-dir)"
        )
    if args.resume not in ("auto", "none", "", None) and not Path(args.resume).is_file():
        raise UserError(f"--resume {args.resume}: no such file (auto, none, or a checkpoint's path)")


def check_wandb() -> None:
    """--wandb: the package is there, and a run can start (offline mode, or an API key)."""
    try:
        import wandb
    except ImportError:
        raise UserError("--wandb needs the wandb package (pip install wandb), or drop --wandb") from None
    mode, modes = os.environ.get("WANDB_MODE"), ("online", "offline", "shared", "disabled", "dryrun", "run")
    if mode is not None and mode not in modes:  # wandb.init's own check is a traceback, once training has begun
        raise UserError(f"WANDB_MODE={mode!r} is not a wandb mode (use one of {', '.join(modes)}, or unset it)")
    if mode in ("offline", "disabled", "dryrun"):
        return
    if not os.environ.get("WANDB_API_KEY") and not wandb.login(prompt=False, verify=False):
        raise UserError("--wandb: not logged in to Weights & Biases (run `wandb login`, set WANDB_API_KEY, "
                        "or WANDB_MODE=offline to log locally)")  # fmt: skip


def add_run_args(parser: argparse.ArgumentParser, output_dir: str, print_freq: int = 50) -> None:
    g = parser.add_argument_group("run")
    g.add_argument("--output-dir", default=output_dir, help="config.json, metrics.jsonl and checkpoints")
    g.add_argument("--resume", default="auto", help="auto (continue from output-dir/last.pt if present) | PATH | none")
    g.add_argument("--overwrite", action="store_true", help="with --resume none: start over where a run saved")
    g.add_argument("--save-every-steps", type=int, default=0, help="also checkpoint every N steps (0: at epoch end)")
    g.add_argument("--keep-last", type=int, default=0, help="keep the N newest step_*.pt copies (0: none)")
    g.add_argument("--eval-every", type=int, default=1, help="evaluate every N epochs and at the end (0: never)")
    g.add_argument("--seed", type=int, default=0, help="data order, augmentation and initialization")
    g.add_argument("-p", "--print-freq", type=int, default=print_freq, help="log every N steps")
    g.add_argument("--wandb", action="store_true", help="log to Weights & Biases from rank 0 (honours WANDB_MODE)")


def check_shared(args: argparse.Namespace, writes: tuple[str, ...] = ()) -> None:
    """The flags every train.py shares (a rule for a flag a script lacks is skipped), --compile-mode and --wandb;
    ``writes``: the files a script writes in --output-dir beyond every run's (they must not be directories)."""
    for attr, flag, ok, what, hint in _RULES:
        value = getattr(args, attr, None)
        if value is not None:
            need(ok(value), flag, value, what, hint)
    if mode := getattr(args, "compile_mode", None):
        from torch._inductor import list_mode_options  # what torch.compile accepts, in this torch

        need(getattr(args, "compile", False), "--compile-mode", mode, "needs --compile", "add --compile, or drop it")
        modes = list_mode_options()
        need(mode in modes, "--compile-mode", repr(mode), "is unknown", f"choose from {', '.join(modes)}")
    check_dist_url(getattr(args, "dist_url", None))
    if hasattr(args, "output_dir"):
        check_output_dir(args, writes)
    if getattr(args, "wandb", False):
        check_wandb()


def check_positive_ints(args: argparse.Namespace, *attrs: str) -> None:
    """Each attribute (flag --attr-name) is an int >= 1 when set."""
    for attr in attrs:
        value = getattr(args, attr)
        if value is not None:
            need(value >= 1, "--" + attr.replace("_", "-"), value, "must be at least 1", "a positive whole number")
