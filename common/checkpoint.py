"""Checkpoints: atomic save on rank 0, safe load, ``--resume auto|PATH|none``. A checkpoint is a plain dict of
tensors and Python primitives, so it loads with ``weights_only=True``: an untrusted file can never run code."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import tempfile
import threading
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch

from common.distributed import print0
from common.errors import UserError


def strip_prefixes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Remove DDP's ``module.`` and torch.compile's ``_orig_mod.`` in any order and nesting."""
    return {re.sub(r"^(module\.|_orig_mod\.)+", "", k): v for k, v in state_dict.items()}


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare model under DDP (``.module``) and torch.compile (``._orig_mod``)."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = model.module if hasattr(model, "module") else model._orig_mod
    return model


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """A binary file that appears at ``path`` whole or not at all: a crash at any moment leaves the old or the new."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike, keep_last: int = 0) -> None:
    """Write ``state`` atomically; with ``keep_last > 0`` also keep the newest ``keep_last`` as ``step_<N>.pt``."""
    path = Path(path)
    with atomic_write(path) as f:
        torch.save(state, f)
    if keep_last > 0:  # a hard link: the copy costs no second write
        step_path = path.parent / f"step_{state['step']:08d}.pt"
        os.link(path, f"{step_path}.tmp")
        os.replace(f"{step_path}.tmp", step_path)
        for old in sorted(path.parent.glob("step_*.pt"))[:-keep_last]:
            old.unlink(missing_ok=True)


def _to_host(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return obj


class CheckpointWriter:
    """save_checkpoint on a background thread, one write at a time: ``save`` waits only for the copy to host memory
    (training changes the device tensors right after). A failed write raises in the next ``save`` or ``wait``. The
    writing rank passes ``output_dir``, whose temporaries left by killed writes are removed first."""

    def __init__(self, output_dir: str | os.PathLike | None = None) -> None:
        self._thread, self._error = None, None  # the write in flight; the exception of a failed one
        if output_dir is not None:
            for tmp in [*Path(output_dir).glob(".*.tmp"), *Path(output_dir).glob("step_*.pt.tmp")]:
                tmp.unlink(missing_ok=True)

    def save(self, state: dict[str, Any], path: str | os.PathLike, keep_last: int = 0) -> None:
        snapshot = _to_host(state)
        self.wait()
        self._thread = threading.Thread(target=self._write, args=(snapshot, path, keep_last), name="checkpoint")
        self._thread.start()  # not a daemon: an interpreter that exits still finishes the write

    def _write(self, state: dict[str, Any], path: str | os.PathLike, keep_last: int) -> None:
        try:
            save_checkpoint(state, path, keep_last)
        except BaseException as e:  # handed to the training thread
            self._error = e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


# the entries of checkpoint_state, and their types: a file that holds others is not one of ours
_ENTRIES = {"model": dict, "optimizer": dict, "scheduler": dict, "scaler": dict, "args": dict, "epoch": int,
            "step": int, "batch_in_epoch": int, "eval_step": int, "world_size": int, "best_metric": (int, float),
            "loss_window": dict, "tokenizer": str, "model_config": dict, "shards": str, "ema": dict}  # fmt: skip


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint safely onto the CPU, or raise a one-line UserError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint not found: {path}")
    # torch.save writes a zip archive (or, in the legacy format, a pickle's PROTO opcode): anything else (text,
    # JSON, an empty file) is not a checkpoint, whatever the unpickler would make of it
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise UserError(f"cannot read checkpoint {path}: {e.strerror}") from None
    if head[:4] != b"PK\x03\x04" and head[:1] != b"\x80":
        what = "an empty file" if not head else "not a file torch.save wrote"
        raise UserError(f"{path} is not a checkpoint ({what}; pass a last.pt or best.pt that a training run wrote)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, IndexError,
            KeyError) as e:  # fmt: skip
        first = (str(e).strip() or type(e).__name__).splitlines()[0][:160]
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            raise UserError(
                f"refusing to load {path}: it contains pickled code or objects, not only tensors "
                f"({first}); only load checkpoints you trust, and re-save them as plain tensors"
            ) from None
        what = "not a checkpoint" if isinstance(e, pickle.UnpicklingError) else "truncated"
        raise UserError(f"cannot read checkpoint {path}: corrupt or {what} ({first})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise UserError(f"{path} is not a checkpoint of this collection (no 'model' entry)")
    wrong = next((k for k, t in _ENTRIES.items() if k in ckpt and not isinstance(ckpt[k], t)), None)
    wrong = wrong or next((k for k, t in _ENTRIES.items() if t is int and not 0 <= ckpt.get(k, 0) < 2**62), None)
    if wrong is not None:  # a file that loads, but whose entries the scripts would trip over
        raise UserError(f"{path} is not a checkpoint of this collection: its '{wrong}' entry is {ckpt[wrong]!r:.24} "
                        f"({type(ckpt[wrong]).__name__}) (pass a last.pt or best.pt a training run wrote)")  # fmt: skip
    return ckpt


def load_model_state(model: torch.nn.Module, state_dict: dict[str, Any], path: str | os.PathLike) -> None:
    """Load weights into the bare model; a mismatch is a UserError naming the file."""
    try:
        unwrap(model).load_state_dict(strip_prefixes(state_dict))
    except RuntimeError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        detail = re.sub(r"\s+", " ", " ".join(lines[1:3]))[:240]
        hint = "another --arch, --preset or number of classes?"
        raise UserError(f"checkpoint {path} does not fit this model ({hint}): {detail}") from None


def resolve_resume(resume: str, output_dir: str | os.PathLike) -> Path | None:
    """``auto``: ``<output_dir>/last.pt`` if it exists; ``none``: start fresh; else a path."""
    if resume in ("none", "", None):
        return None
    if resume == "auto":
        last = Path(output_dir) / "last.pt"
        return last if last.is_file() else None
    p = Path(resume)
    if not p.is_file():
        raise UserError(f"--resume {resume}: no such file")
    return p


def checkpoint_state(model, optimizer, scheduler, scaler, pos: Position, args, world_size: int, ema=None, **extra):
    """The one schema of last.pt and best.pt (DESIGN.md); ``extra``: a script's own entries (tokenizer, loss window)."""
    state = {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(), **asdict(pos), **extra}
    state.update(scheduler=scheduler.state_dict(), scaler=scaler.state_dict(), args=vars(args), world_size=world_size)
    if ema is not None:
        state["ema"] = ema.module.state_dict()
    return state


@dataclass
class Position:  # where training stands: what a checkpoint must record to continue exactly
    epoch: int = 0
    step: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch already done (a multiple of --accum-steps)
    best_metric: float = 0.0
    wandb_id: str | None = None
    eval_step: int = 0  # the step of the last evaluation whose results are recorded (or of the start)

    def eval_due(self, every: int, epochs: int, max_steps: int) -> bool:
        """After every ``every``-th epoch, the last one and the last step; never twice at one step. A function of the
        position alone, so that a run stopped before or during an evaluation does it on resume."""
        if every <= 0 or self.step == self.eval_step:
            return False
        end_of_epoch = self.batch_in_epoch == 0 and self.epoch > 0
        return (end_of_epoch and (self.epoch % every == 0 or self.epoch == epochs)) or self.step >= max_steps


def restore_training(
    path: Path,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    scaler: Any,
    *,
    world_size: int,
    batch_size: int | None = None,
    accum_steps: int = 1,
    ema: Any = None,
    ckpt: dict[str, Any] | None = None,
) -> tuple[Position, dict[str, Any]]:
    """Load ``checkpoint_state``'s keys (``ckpt`` if already loaded) into the training objects and ``ema``. If the
    world size or batch changed, the epoch continues after the same samples (``batch_size=None``: the caller's
    batches hold no fixed number of samples, and it decides)."""
    ckpt = load_checkpoint(path) if ckpt is None else ckpt
    if model is not None:  # None: the caller loaded weights and optimizer state itself (sharded checkpoints)
        load_model_state(model, ckpt["model"], path)
    try:
        if optimizer is not None:
            optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        if ema is not None and "ema" in ckpt:
            ema.module.load_state_dict(ckpt["ema"])
    except (KeyError, ValueError, RuntimeError) as e:
        raise UserError(f"checkpoint {path} has no usable optimizer state ({str(e)[:200]})") from None
    pos = Position(ckpt["epoch"], ckpt["step"], ckpt["batch_in_epoch"], ckpt["best_metric"], ckpt.get("wandb_id"),
                   ckpt.get("eval_step", ckpt["step"]))  # fmt: skip
    print0(f"resumed from {path}: epoch {pos.epoch}, step {pos.step}, batch {pos.batch_in_epoch} of the epoch")
    if batch_size is None:
        return pos, ckpt
    old_world, old_args = ckpt.get("world_size", world_size), ckpt.get("args", {})
    old_micro = old_args.get("batch_size", batch_size) * old_world  # samples per micro-batch
    if old_micro != batch_size * world_size:
        pos.batch_in_epoch = pos.batch_in_epoch * old_micro // (batch_size * world_size)
        pos.batch_in_epoch -= pos.batch_in_epoch % accum_steps
        print0(
            f"note: checkpoint written by {old_world} process(es) x {old_micro // old_world} samples, now "
            f"{world_size} x {batch_size}; the epoch continues after the same samples, the LR follows the new "
            "global batch, and the data order differs from an uninterrupted run"
        )
    return pos, ckpt


def set_schedule_position(scheduler: Any, step: int, peak_lr: float) -> None:
    """Put a LambdaLR at optimizer step ``step`` with this run's peak LR: after a resume with another global batch,
    the saved base LR is stale."""
    if step == scheduler.last_epoch and all(b == peak_lr for b in scheduler.base_lrs):
        return  # already there: a further step() would count one the uninterrupted run never took (_step_count)
    scheduler.base_lrs = [peak_lr] * len(scheduler.base_lrs)
    scheduler.last_epoch = step - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": intended here
        scheduler.step()
