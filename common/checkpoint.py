"""Checkpoints: atomic save on rank 0, safe load, ``--resume auto|PATH|none``.

A checkpoint is a plain dict of tensors and Python primitives, so it loads with
``torch.load(weights_only=True)``: an untrusted file can never run code.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from common.errors import UserError

_PREFIXES = ("module.", "_orig_mod.")


def strip_prefixes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Remove DDP's ``module.`` and torch.compile's ``_orig_mod.`` in any order/nesting."""
    out = {}
    for k, v in state_dict.items():
        changed = True
        while changed:
            changed = False
            for p in _PREFIXES:
                if k.startswith(p):
                    k, changed = k[len(p) :], True
        out[k] = v
    return out


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare model under DDP (``.module``) and torch.compile (``._orig_mod``)."""
    while True:
        if hasattr(model, "module"):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def rng_state() -> dict[str, Any]:
    """Torch/CUDA/python RNG states as tensors and primitives (weights_only-safe)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    v, s, g = state["python"]
    random.setstate((v, tuple(s), g))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike, keep_last: int = 0) -> None:
    """Write ``state`` to ``path`` atomically: temp file, fsync, rename.

    A crash at any moment leaves either the old file or the new one, never a
    torn one. Call on global rank 0 only. With ``keep_last > 0`` a copy named
    ``step_<N>.pt`` is also kept and only the newest ``keep_last`` survive.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        if keep_last > 0 and "step" in state:
            os.link(tmp, path.parent / f"step_{state['step']:08d}.pt.tmp")
            os.replace(path.parent / f"step_{state['step']:08d}.pt.tmp", path.parent / f"step_{state['step']:08d}.pt")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if keep_last > 0:
        olds = sorted(path.parent.glob("step_*.pt"))
        for old in olds[:-keep_last]:
            old.unlink(missing_ok=True)


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint safely onto the CPU, or raise a one-line UserError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            raise UserError(
                f"refusing to load {path}: it contains pickled code or objects, not only tensors "
                f"({first[:160]}); only load checkpoints you trust, and re-save them as plain tensors"
            ) from None
        raise UserError(f"cannot read checkpoint {path}: corrupt or not a checkpoint ({first[:160]})") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot read checkpoint {path}: corrupt or truncated ({first[:160]})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise UserError(f"{path} is not a checkpoint of this collection (no 'model' entry)")
    return ckpt


def load_model_state(model: torch.nn.Module, state_dict: dict[str, Any], path: str | os.PathLike) -> None:
    """Load weights into the bare model; a mismatch is a UserError naming the file."""
    try:
        unwrap(model).load_state_dict(strip_prefixes(state_dict))
    except RuntimeError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        detail = re.sub(r"\s+", " ", " ".join(lines[1:3]))[:240]
        raise UserError(f"checkpoint {path} does not fit this model (different arch or classes?): {detail}") from None


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
