"""Checks of the shared flags that a ``type=`` cannot make (they look at files, the environment or torch), the
checkpoint to resume from, and the output directory's lock: each mistake is one line before anything starts."""

from __future__ import annotations

import argparse
import errno
import os
import re
import socket
from pathlib import Path
from typing import IO

import torch

from common.distributed import broadcast_object
from common.errors import UserError

WRITTEN = (".lock", "config.json", "metrics.jsonl", "last.pt", "best.pt")  # what every run writes in --output-dir

# the entries of a checkpoint, and their types: a file that holds others is not one of ours
ENTRIES = {"model": dict, "optimizer": dict, "scaler": dict, "args": dict, "epoch": int, "step": int,
           "batch_in_epoch": int, "log_lines": int, "world_size": int, "best_metric": (int, float), "window": dict,
           "tokenizer": str, "model_config": dict, "shards": str, "ema": dict}  # fmt: skip


def check_shared(args: argparse.Namespace, writes: tuple[str, ...] = ()) -> None:
    """--compile-mode, --wandb, --output-dir and --resume; ``writes``: a script's files in --output-dir beyond
    every run's (they must not be directories)."""
    if mode := args.compile_mode:
        from torch._inductor import list_mode_options  # what torch.compile accepts, in this torch

        if not args.compile:
            raise UserError(f"--compile-mode {mode} needs --compile (add --compile, or drop it)")
        if mode not in (modes := list_mode_options()):
            raise UserError(f"--compile-mode {mode!r} is unknown (choose from {', '.join(modes)})")
    if args.wandb:
        check_wandb()
    if not str(args.output_dir).strip():
        raise UserError("--output-dir '' is empty (name a directory, e.g. runs/NAME)")
    for path in (args.output_dir, args.resume, getattr(args, "data_dir", None), getattr(args, "data", None)):
        check_path(path)
    out = Path(args.output_dir)
    p = next(p for p in (out, *out.parents) if p.exists())  # the filesystem root always does
    if not p.is_dir():
        raise UserError(f"--output-dir {args.output_dir} {f'is under the file {p}' if p != out else 'is a file'} "
                        "(give a directory)")  # fmt: skip
    if odd := [n for n in (*WRITTEN, *writes) if (out / n).exists() and not (out / n).is_file()]:  # a dir, a FIFO
        raise UserError(f"{out / odd[0]} is not a file, and a run writes its {odd[0]} there (move it away, or pick "
                        "another --output-dir)")  # fmt: skip
    found = [n for n in ("last.pt", "best.pt") if (out / n).is_file()]
    if args.resume == "none" and found and not args.overwrite and not args.evaluate:
        raise UserError(f"--resume none would overwrite the run in {out} ({', '.join(found)}) (pass --overwrite to "
                        "start over there, --resume auto to continue it, or another --output-dir)")  # fmt: skip
    if args.resume not in ("auto", "none") and not Path(args.resume).is_file():
        raise UserError(f"--resume {args.resume}: no such file (auto, none, or a checkpoint's path)")
    resume = out / "last.pt" if args.resume == "auto" else Path(args.resume)
    if args.resume != "none" and resume.is_file():
        check_checkpoint(resume)


def check_path(path: str | None) -> None:  # a name over 255 bytes, a symlink loop, a folder not to be entered
    try:
        os.stat(path or "")
    except OSError as e:
        if not isinstance(e, (FileNotFoundError, NotADirectoryError)):
            raise UserError(f"cannot look up {path}: {e.strerror} (fix the path)") from None


FULL = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "over the disk quota", errno.EFBIG: "over the file-size limit"}


def explain(e: Exception) -> str | None:
    """The one line of an exception that is no bug (``run_cli``'s ``SEAMS.explain``): a write that found the disk full
    or a file too big (torch.save's RuntimeError holds that OSError as its context), memory that ran out, a peer that
    ended (its own line says why); None for the rest, which stays a traceback."""
    cause = next((c for c in (e, e.__context__) if isinstance(c, OSError) and c.errno in (*FULL, errno.EPIPE)), None)
    if cause is not None:  # stdout may be the file that failed: nothing more is written to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        what = f"{FULL.get(cause.errno, 'nothing reads it')}; the last checkpoint is intact"
        return f"a write{f' to {cause.filename}' if cause.filename else ''} failed: {cause.strerror} ({what})"
    oom = re.search(r"(\w+ out of memory|can't allocate memory)[^\n]{,160}", str(e))  # a DataLoader worker's too
    if isinstance(e, MemoryError) or oom:
        hint = "lower the batch, model or image size; the last checkpoint is intact"
        return f"out of memory: {oom[0] if oom else 'a MemoryError'} ({hint})"
    peer = re.search(r"Connection (closed|reset) by peer[^\n.]{,80}", str(e))
    return f"a peer process ended ({peer[0]}); its own output says why" if peer else None


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


def check_checkpoint(path: Path) -> None:
    """``path`` is a checkpoint a run of this collection wrote: not text, not empty, not pickled code, its entries
    of the types the scripts expect. Memory-mapped: its tensors are not read."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise UserError(f"cannot read checkpoint {path}: {e.strerror}") from None
    if head != b"PK\x03\x04" and head[:1] != b"\x80":  # torch.save's zip archive, or its legacy pickle
        what = "an empty file" if not head else "not a file torch.save wrote"
        raise UserError(f"{path} is not a checkpoint ({what}; pass a last.pt or best.pt that a training run wrote)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=head == b"PK\x03\x04")
    except Exception as e:  # the unpickler's, zipfile's, the OS's
        first = (str(e).strip() or type(e).__name__).splitlines()[0][:160]
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            raise UserError(f"refusing to load {path}: it holds pickled code or objects, not only tensors ({first}); "
                            "only load checkpoints you trust, and re-save them as plain tensors") from None  # fmt: skip
        raise UserError(f"cannot read checkpoint {path}: corrupt or truncated ({first})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise UserError(f"{path} is not a checkpoint of this collection (no 'model' entry)")
    wrong = next((k for k, t in ENTRIES.items() if k in ckpt and not isinstance(ckpt[k], t)), None)
    wrong = wrong or next((k for k, t in ENTRIES.items() if t is int and not 0 <= ckpt.get(k, 0) < 2**62), None)
    if wrong is not None:  # a file that loads, but whose entries the scripts would trip over
        raise UserError(f"{path} is not a checkpoint of this collection: its '{wrong}' entry is {ckpt[wrong]!r:.24} "
                        f"({type(ckpt[wrong]).__name__}) (pass a last.pt or best.pt a training run wrote)")  # fmt: skip


def claim_output_dir(out: Path, is_main: bool) -> None:
    """On every rank, once the group is up: the output dir is writable, this job its only writer (rank 0 holds
    ``.lock``; a second job stops on every rank, one line), and no temporary file of a write a kill cut short."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        (probe := out / f".write_test_{os.getpid()}").write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"output dir {out} is not writable ({e.strerror}; pick another --output-dir)") from None
    holder = broadcast_object(_lock(out) if is_main else None)
    if holder:
        raise UserError(f"output dir {out} is in use by another job: {holder} (wait for it to end or stop it, or "
                        "pick another --output-dir)")  # fmt: skip
    if is_main:
        for tmp in [*out.glob(".*.tmp"), *out.glob("step_*.pt.tmp")]:
            tmp.unlink(missing_ok=True)


_LOCKS: dict[Path, IO[str]] = {}


def _lock(out: Path) -> str | None:
    """An exclusive flock on ``out/.lock`` (host, pid): None once held, else the holder's text. The kernel releases it
    however the process ends, so a restarted or requeued job takes it over."""
    path = (out / ".lock").resolve()
    if path in _LOCKS:  # this process holds it (a second run in one process, as tests do)
        return None
    f = open(path, "a+")
    try:
        import fcntl

        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a job that is starting"
        f.close()
        return holder
    except (ImportError, OSError):  # no flock here (Windows, a filesystem without locks): no lock
        f.close()
        return None
    f.truncate(0)
    f.write(f"host {socket.gethostname()}, pid {os.getpid()}\n")
    f.flush()
    _LOCKS[path] = f
    return None


def release_locks() -> None:
    while _LOCKS:
        _LOCKS.popitem()[1].close()
