"""Run records: config.json, metrics.jsonl, progress lines and optional wandb; no-ops on ranks other than 0."""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from common.checkpoint import atomic_write
from common.distributed import DistInfo, all_reduce_sum, at_cleanup, broadcast_object, is_dist
from common.errors import UserError
from common.utils import check_finite_loss


def _git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def prepare_output_dir(output_dir: str | os.PathLike) -> Path:
    """Create the output dir, check it is writable, and make this job its only writer (rank 0 holds ``.lock``; a
    second job stops on every rank with one line). Call on every rank, after setup_distributed."""
    out = Path(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_test_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"output dir {out} is not writable ({e.strerror}; pick another --output-dir)") from None
    holder = broadcast_object(_lock(out) if not is_dist() or dist.get_rank() == 0 else None)
    if holder:
        raise UserError(
            f"output dir {out} is in use by another job: {holder} (wait for it to end or stop it, "
            "or pick another --output-dir)"
        )
    return out


_LOCKS: dict[Path, IO[str]] = {}


def _lock(out: Path) -> str | None:
    """An exclusive flock on ``out/.lock``, holding this host and pid: None once held, else the holder's text. The
    kernel releases it however the process ends, so a restarted or requeued job takes it over."""
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
    at_cleanup(lambda: _LOCKS.pop(path).close())
    return None


class MetricsLogger:
    """Writes ``config.json`` and appends JSON lines to ``metrics.jsonl`` (rank 0 only)."""

    def __init__(self, output_dir: str | os.PathLike, info: DistInfo, use_wandb: bool = False):
        self.info, self.enabled = info, info.is_main
        self.path = Path(output_dir) / "metrics.jsonl"
        self.output_dir = Path(output_dir)
        self.wandb, self.use_wandb = None, use_wandb and self.enabled  # the package was checked (checks.check_wandb)

    def start(self, args: Any, project: str, run_id: str | None, extra: dict[str, Any]) -> str | None:
        """Write config.json, and start a wandb run (or resume the checkpoint's ``run_id``); returns the run's id."""
        i = self.info
        gpu = torch.cuda.get_device_name(i.device) if i.device.type == "cuda" else None
        cfg = dict(vars(args), world_size=i.world_size, launcher=i.launcher, backend=i.backend, device=str(i.device),
                   torch=torch.__version__, cuda=torch.version.cuda, gpu=gpu, git_commit=_git_commit(), argv=sys.argv,
                   **extra)  # fmt: skip
        if self.enabled:
            (self.output_dir / "config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")
        if not self.use_wandb:
            return run_id
        import wandb

        try:
            self.wandb = wandb.init(project=project, config=cfg, id=run_id, resume="allow", dir=str(self.output_dir))
        except wandb.errors.Error as e:  # no key, no network: the user's to fix
            raise UserError(f"--wandb: {str(e).splitlines()[0][:200]} (or set WANDB_MODE=offline)") from None
        return self.wandb.id

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {**record, "time": round(time.time(), 3)}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            nums = {f"{record.get('split', 'train')}/{k}": v for k, v in record.items() if isinstance(v, (int, float))}
            self.wandb.log(nums, step=record.get("step"))

    def rewind(self, step: int, eval_step: int) -> None:
        """On a resume at ``step``: keep only the records the checkpoint accounts for (training up to ``step``,
        evaluations up to ``eval_step``), so that the file reads as an uninterrupted run's."""
        if not self.enabled or not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            at = r.get("step")
            if at is not None and (at < step or (at == step and (r.get("split") == "train" or at == eval_step))):
                kept.append(line + "\n")
        with atomic_write(self.path) as f:
            f.write("".join(kept).encode())

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


class LossWindow:
    """This rank's training loss summed since the last log line, over ``n`` units (micro-batches or tokens). Its
    ``state`` goes into last.pt, so that the first log line after a resume is an uninterrupted run's."""

    def __init__(self, info: DistInfo, step: int, state: dict[str, Any] | None = None):
        self.rank, self.world = info.rank, info.world_size
        self.sum = torch.zeros((), device=info.device)
        self.reset(step)
        if state and len(state["sums"]) == self.world:  # another world size starts a new window
            self.sum.copy_(state["sums"][self.rank])
            self.n, self.step0, self.t0 = state["n"], state["step0"], self.t0 - state["seconds"]

    def reset(self, step: int) -> None:
        self.sum.zero_()
        self.n, self.step0, self.t0 = 0, step, time.time()

    def mean(self, step: int) -> float:
        """The mean over every rank (a log point's one host sync); a NaN or infinite loss stops the run."""
        loss = all_reduce_sum(self.sum.clone()).item() / (self.n * self.world)
        check_finite_loss(loss, step)
        return loss

    def state(self, step: int) -> dict[str, Any]:
        """Every rank's sum (every rank calls it); a NaN or infinite loss stops the run before a save."""
        sums = torch.zeros(self.world, device=self.sum.device)
        sums[self.rank] = self.sum  # the others' entries stay 0: the sum gathers each rank's value bit for bit
        sums = all_reduce_sum(sums)
        check_finite_loss(sums.sum(), step)
        return {"sums": sums, "n": self.n, "step0": self.step0, "seconds": time.time() - self.t0}


class Progress:
    """Rank-0 progress lines with the time left: one format on a terminal and in a log (CI, Slurm)."""

    def __init__(self, info: DistInfo, total: int, initial: int = 0):
        self.enabled, self.total = info.is_main, total
        self.start, self.start_step = time.time(), initial

    def update(self, step: int, text: str) -> None:
        if self.enabled:
            done, left = step - self.start_step, self.total - step
            eta = str(datetime.timedelta(seconds=int((time.time() - self.start) / done * left))) if done > 0 else "?"
            print(f"step {step}/{self.total} {text} eta {eta}", flush=True)
