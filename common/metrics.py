"""Run records, written by rank 0 (the other ranks' calls do nothing): ``config.json``, ``metrics.jsonl``, progress."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common.checkpoint import Position
from common.distributed import DistInfo


class MetricsLogger:
    """``keep``: the lines of ``metrics.jsonl`` to keep (a resume's ``pos.log_lines``; 0: a fresh run); None appends."""

    def __init__(self, out: Path, info: DistInfo, pos: Position, keep: int | None = None, total: int = 0):
        self.out, self.enabled, self.pos, self.wandb = out, info.is_main, pos, None
        self.t0, self.step0, self.total = time.time(), pos.step, total
        if self.enabled and keep is not None:
            path = out / "metrics.jsonl"
            lines = path.read_bytes().splitlines(True)[:keep] if keep and path.is_file() else []  # any bytes
            path.write_bytes(b"".join(lines))
            pos.log_lines = len(lines)
            if not keep:  # a fresh run: the best of the run it replaces is not its own
                (out / "best.pt").unlink(missing_ok=True)

    def start(self, args: Any, info: DistInfo, project: str, **extra: Any) -> None:
        """Write config.json (arguments, world, versions); start or resume the wandb run (its id: ``pos.wandb_id``)."""
        gpu = torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else None
        cfg = dict(vars(args), world_size=info.world_size, launcher=info.launcher, backend=info.backend,
                   device=str(info.device), torch=torch.__version__, cuda=torch.version.cuda, gpu=gpu,
                   git_commit=_git_commit(), argv=sys.argv, **extra)  # fmt: skip
        if not self.enabled:
            return
        (self.out / "config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")
        if args.wandb:  # WANDB_MODE=offline logs locally; `wandb sync` uploads later
            import wandb

            self.wandb = wandb.init(project=project, config=cfg, id=self.pos.wandb_id, resume="allow", dir=self.out)
            self.pos.wandb_id = self.wandb.id

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")
        self.pos.log_lines += 1
        if self.wandb is not None:
            nums = {f"{record['split']}/{k}": v for k, v in record.items() if isinstance(v, (int, float))}
            self.wandb.log(nums, step=record.get("step"))

    def progress(self, step: int, text: str) -> None:  # step N/TOTAL <text> eta H:MM:SS, on a terminal and in a log
        if self.enabled:
            done, left = step - self.step0, self.total - step
            eta = str(datetime.timedelta(seconds=int((time.time() - self.t0) / done * left))) if done > 0 else "?"
            print(f"step {step}/{self.total} {text} eta {eta}", flush=True)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


class LossWindow:
    """The training loss since the last log line, each rank's in its own entry of ``sums``: one all-reduce, exact."""

    def __init__(self, info: DistInfo, saved: dict[str, Any] | None = None):
        self.rank, self.sums = info.rank, torch.zeros(info.world_size, device=info.device)
        self.sum = self.sums[self.rank]  # this rank's entry, a view: ``sum +=`` adds in place, one kernel
        self.reset()
        if saved and len(saved["sums"]) == info.world_size:  # another world size starts a new window
            self.sums[self.rank], self.n = saved["sums"][self.rank], saved["n"]

    def reset(self) -> None:
        self.sums.zero_()
        self.n, self.t0 = 0, time.time()  # n: optimizer steps


def _git_commit() -> str | None:
    try:  # the code's commit, where it is a git checkout
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True).stdout.strip() or None  # fmt: skip
    except OSError:
        return None
