"""Run records: config.json, metrics.jsonl, progress lines and optional wandb.

Everything here is a no-op on ranks other than 0, so scripts call it
unconditionally and never print one line per rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common.distributed import DistInfo
from common.errors import UserError


def _git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def prepare_output_dir(output_dir: str | os.PathLike) -> Path:
    """Create the output dir and check it is writable (a one-line error, not a late crash)."""
    out = Path(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_test_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"output dir {out} is not writable ({e.strerror}; pick another --output-dir)") from None
    return out


def check_wandb() -> None:
    """--wandb: the package is there, and a run can start (offline or disabled mode, or an API key)."""
    try:
        import wandb
    except ImportError:
        raise UserError("--wandb needs the wandb package (pip install wandb), or drop --wandb") from None
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return
    if not os.environ.get("WANDB_API_KEY") and not wandb.login(prompt=False, verify=False):
        raise UserError("--wandb: not logged in to Weights & Biases (run `wandb login`, set WANDB_API_KEY, "
                        "or WANDB_MODE=offline to log locally)")  # fmt: skip


class MetricsLogger:
    """Writes ``config.json`` and appends JSON lines to ``metrics.jsonl`` (rank 0 only)."""

    def __init__(self, output_dir: str | os.PathLike, info: DistInfo, use_wandb: bool = False):
        self.info, self.enabled = info, info.is_main
        self.path = Path(output_dir) / "metrics.jsonl"
        self.output_dir = Path(output_dir)
        self.wandb = None
        self.use_wandb = use_wandb and self.enabled
        if use_wandb:
            try:
                import wandb  # noqa: F401  (checked on every rank so all fail alike)
            except ImportError:
                raise UserError("--wandb needs the wandb package (pip install wandb), or drop --wandb") from None

    def write_config(self, args: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        cfg = dict(vars(args)) if not isinstance(args, dict) else dict(args)
        cfg.update(
            world_size=self.info.world_size,
            launcher=self.info.launcher,
            backend=self.info.backend,
            device=str(self.info.device),
            torch=torch.__version__,
            cuda=torch.version.cuda,
            gpu=torch.cuda.get_device_name(self.info.device) if self.info.device.type == "cuda" else None,
            git_commit=_git_commit(),
            argv=sys.argv,
            **(extra or {}),
        )
        if self.enabled:
            (self.output_dir / "config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")
        return cfg

    def start_wandb(self, project: str, config: dict[str, Any], run_id: str | None) -> str | None:
        """Start (or resume, with the run id from the checkpoint) a wandb run; returns its id."""
        if not self.use_wandb:
            return run_id
        import wandb

        try:
            self.wandb = wandb.init(project=project, config=config, id=run_id, resume="allow", dir=str(self.output_dir))
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
            split = record.get("split", "train")
            self.wandb.log(
                {f"{split}/{k}": v for k, v in record.items() if isinstance(v, (int, float))}, step=record.get("step")
            )

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


class Progress:
    """Rank-0 progress: tqdm on a terminal, plain periodic lines otherwise (CI, Slurm logs)."""

    def __init__(self, info: DistInfo, total: int, initial: int = 0, unit: str = "img"):
        self.enabled, self.total, self.unit = info.is_main, total, unit
        self.bar = None
        self.start, self.start_step = time.time(), initial
        if self.enabled and sys.stderr.isatty() and os.environ.get("CI") is None:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, text: str) -> None:
        """Called every print-freq steps with a short status text."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(text, refresh=True)
            return
        done = step - self.start_step
        elapsed = time.time() - self.start
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        print(f"step {step}/{self.total} {text} eta {_fmt(eta)}", flush=True)

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fmt(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h:d}:{m:02d}:{s:02d}"
