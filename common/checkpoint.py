"""[DDP 6] Checkpoints: rank 0 saves atomically, no collective inside; every rank loads tensors only (no code runs)."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch.utils._pytree import tree_map_only  # what torch.distributed.checkpoint maps state dicts with

from common.distributed import print0
from common.errors import UserError


@dataclass
class Position:  # where training stands: what a checkpoint records to continue exactly
    epoch: int = 0
    step: int = 0  # optimizer steps done
    batch_in_epoch: int = 0  # micro-batches of this epoch done (a multiple of --accum-steps)
    best_metric: float = 0.0
    log_lines: int = 0  # lines of metrics.jsonl written up to here
    wandb_id: str | None = None


def strip_prefixes(state_dict: dict[str, Any]) -> dict[str, Any]:  # without DDP's module., torch.compile's _orig_mod.
    return {re.sub(r"^(module\.|_orig_mod\.)+", "", k): v for k, v in state_dict.items()}


def checkpoint_state(model, optimizer, scaler, pos: Position, args, world_size: int, ema=None, **extra) -> dict:
    """The one schema of last.pt and best.pt (the weights without wrappers' prefixes); ``extra``: a script's own."""
    state = dict(model=strip_prefixes(model.state_dict()), optimizer=optimizer.state_dict(), **asdict(pos), **extra)
    state.update(scaler=scaler.state_dict(), args=vars(args), world_size=world_size)
    return state if ema is None else {**state, "ema": ema.module.state_dict()}


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """A file at ``path`` whole or not at all: a temporary file, fsynced, renamed over it; a kill leaves old or new."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike, keep_last: int = 0) -> None:
    """``state`` to ``path``, atomically; ``keep_last``: also keep the newest ``keep_last`` as ``step_<N>.pt``."""
    torch.serialization.set_crc32_options(False)  # torch.load never checks the CRC-32s: they only slow the write
    with atomic_write(path) as f:
        torch.save(state, f)
    if keep_last > 0:  # a hard link: the copy costs no second write
        step_path = Path(path).parent / f"step_{state['step']:08d}.pt"
        os.link(path, f"{step_path}.tmp")
        os.replace(f"{step_path}.tmp", step_path)
        for old in sorted(step_path.parent.glob("step_*.pt"))[:-keep_last]:
            old.unlink(missing_ok=True)


class CheckpointWriter:
    """``save_checkpoint`` on a thread, one at a time; a failure raises in ``wait``. The tensors go to host buffers
    kept from save to save, pinned for a GPU's: the copies queue behind the steps, and the thread waits for them."""

    def __init__(self) -> None:
        self.pool, self.pending, self.buffers = ThreadPoolExecutor(1, "checkpoint"), None, {}  # thread ends with Python

    def save(self, state: dict[str, Any], path: str | os.PathLike, keep_last: int = 0) -> None:
        self.wait()  # the last write is done: its buffers are free
        self.n = 0  # the state's tensors, counted in order
        state = tree_map_only(torch.Tensor, self._to_host, state)
        if torch.cuda.is_initialized():  # the thread first waits for the copies
            self.pool.submit(torch.cuda.current_stream().record_event().synchronize)
        self.pending = self.pool.submit(save_checkpoint, state, path, keep_last)

    def wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:  # the n-th tensor's buffer: one per tensor, at most
        n, self.n, layout = self.n, self.n + 1, (t.shape, t.stride(), t.dtype, t.is_cuda)
        if self.buffers.get(n, (None,))[0] != layout:
            self.buffers[n] = layout, torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)
        return self.buffers[n][1].copy_(t.detach(), non_blocking=True)


def load_model_state(model: torch.nn.Module, state_dict: dict[str, Any], path: str | os.PathLike) -> None:
    """Weights into the bare model (DDP's and torch.compile's prefixes dropped); a mismatch is one line."""
    try:
        model.load_state_dict(strip_prefixes(state_dict))
    except RuntimeError as e:
        detail = " ".join(" ".join(str(e).split("\n")[1:3]).split())[:240]
        raise UserError(f"checkpoint {path} does not fit this model (another --arch, --preset or number of "
                        f"classes?): {detail}") from None  # fmt: skip


def resolve_resume(resume: str, output_dir: Path) -> Path | None:
    """``auto``: ``<output_dir>/last.pt`` if it exists; ``none``: start fresh; else a path."""
    path = None if resume == "none" else output_dir / "last.pt" if resume == "auto" else Path(resume)
    return path if path is None or path.is_file() or resume != "auto" else None


def resume(path: Path, ckpt: dict, model, optimizer, scaler, ema=None, *, world_size: int, batch_size: int = 0,
           accum_steps: int = 1) -> Position:  # fmt: skip
    """Load ``ckpt`` into the training objects; return the position, after the same samples at another world size."""
    if model is not None:  # None: the caller loaded the weights and optimizer state itself (sharded checkpoints)
        load_model_state(model, ckpt["model"], path)
        optimizer.load_state_dict(ckpt["optimizer"])
    scaler.load_state_dict(ckpt["scaler"])
    if ema is not None and "ema" in ckpt:
        ema.module.load_state_dict(ckpt["ema"])
    pos = Position(**{k: ckpt[k] for k in asdict(Position()) if k in ckpt})
    print0(f"resumed from {path}: epoch {pos.epoch}, step {pos.step}, batch {pos.batch_in_epoch} of the epoch")
    old_micro = ckpt["args"].get("batch_size", batch_size) * ckpt["world_size"]  # samples per micro-batch, all ranks
    if batch_size and old_micro != batch_size * world_size:
        pos.batch_in_epoch = pos.batch_in_epoch * old_micro // (batch_size * world_size)
        pos.batch_in_epoch -= pos.batch_in_epoch % accum_steps
        old = f"{ckpt['world_size']} process(es) x {old_micro // ckpt['world_size']}"
        print0(f"note: checkpoint of {old} samples, now {world_size} x {batch_size}: the epoch goes on after them")
    return pos
