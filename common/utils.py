"""Small training helpers shared by the scripts: precision, LR shape, stop signals."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import signal
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.distributed import STOP_SIGNALS, all_reduce_sum, is_dist, print0
from common.errors import UserError

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "stopped on a signal after saving; rerun the same command"


def amp_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """``--amp auto|bf16|fp16|none`` -> autocast dtype (None: full precision); auto is bf16 on GPU."""
    if amp == "auto":
        amp = "bf16" if device.type == "cuda" else "none"
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}[amp]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


def lr_lambda(args: Any, steps_per_epoch: int) -> Callable[[int], float]:
    """``--lr-schedule`` as an LR multiplier, a pure function of the optimizer step: cosine after a linear warmup;
    onecycle, linear up to the peak at 25% and down to 0; step, x ``--lr-gamma`` every ``--lr-step-size`` epochs."""
    warmup, total = round(args.warmup_epochs * steps_per_epoch), args.epochs * steps_per_epoch
    if args.lr_schedule == "cosine":
        span = max(1, total - warmup)
        return lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * min(1, (s - warmup) / span)))
    if args.lr_schedule == "onecycle":
        peak = max(1, int(0.25 * total))
        return lambda s: min((s + 1) / peak, max(0.0, (total - s) / (total - peak)))
    every = args.lr_step_size * steps_per_epoch
    return lambda s: min(1.0, (s + 1) / warmup if warmup else 1.0) * args.lr_gamma ** (s // every)


def param_groups(model: torch.nn.Module, weight_decay: float, skip_norm_bias: bool = True) -> list[dict[str, Any]]:
    """Weight decay on weights only, none on norm layers and biases (1-d params) if asked."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if skip_norm_bias and p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def evaluate_classifier(
    model: torch.nn.Module, batches: Iterable, device: torch.device, dtype: torch.dtype | None, tta: bool = False
) -> dict[str, float]:
    """Exact metrics of this rank's ``(x, y)`` batches, sums all-reduced: every sample counted once. Pass the bare
    model (not DDP): ranks may hold different numbers of batches."""
    model.eval()
    sums = torch.zeros(4, device=device, dtype=torch.float64)  # loss, correct1, correct5, count
    for x, y in batches:
        with autocast(device, dtype):
            logits = model(x).float()
            if tta:  # average with the mirrored image
                logits = (logits + model(torch.flip(x, dims=[3])).float()) / 2
        hit = logits.topk(min(5, logits.shape[1]), dim=1).indices == y[:, None]  # (batch, k): right at rank j?
        loss = F.cross_entropy(logits.double(), y, reduction="sum")
        sums += torch.stack([loss, hit[:, 0].sum(), hit.any(dim=1).sum(), torch.full_like(loss, len(y))])
    loss, c1, c5, n = all_reduce_sum(sums).tolist()
    model.train()
    return {"loss": loss / max(n, 1), "acc1": 100 * c1 / max(n, 1), "acc5": 100 * c5 / max(n, 1), "count": int(n)}


class EMA:
    """A moving average of a model's weights and buffers, updated on the device without a host sync. ``update(n)``
    after step n uses decay min(decay, (1 + n) / (10 + n)): the first updates are not pulled to the initial weights."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.module, self.decay = copy.deepcopy(model).requires_grad_(False), decay
        pairs = list(zip(self.module.state_dict().values(), model.state_dict().values()))  # tensors sharing storage
        self.floats = [[e for e, _ in pairs if e.is_floating_point()], [m for e, m in pairs if e.is_floating_point()]]
        self.others = [(e, m) for e, m in pairs if not e.is_floating_point()]

    @torch.no_grad()
    def update(self, n: int) -> None:
        torch._foreach_lerp_(*self.floats, 1 - min(self.decay, (1 + n) / (10 + n)))
        for e, m in self.others:
            e.copy_(m)


def check_finite_loss(loss: float | torch.Tensor, step: int) -> None:
    """A NaN or infinite loss stops the run before a checkpoint holds such weights (checked where the loop syncs)."""
    if not math.isfinite(value := float(loss)):
        raise UserError(
            f"loss is {value} at step {step}: stopped before writing a checkpoint, the last one is intact (lower "
            "--lr, check the data, or resume from last.pt with other settings)"
        )


def describe(m: dict[str, float]) -> str:
    skipped = f", {m['skipped']} unreadable skipped" if m.get("skipped") else ""
    return f"loss {m['loss']:.4f} acc1 {m['acc1']:.2f} acc5 {m['acc5']:.2f} ({m['count']} images{skipped})"


class StopSignal:
    """SIGTERM and SIGUSR2 (Slurm's ``--signal``) on any rank stop every rank at a step boundary: they agree by an
    all-reduce on a gloo group, started at one step and read at the next, so it never blocks the GPU stream."""

    def __init__(self):
        self.flag, self.work, self.received = torch.zeros(1, dtype=torch.int32), None, None
        for name in STOP_SIGNALS:
            signal.signal(getattr(signal, name), self._handler)
        # its own group: never interleaves with DDP's gradient all-reduces on the default group
        self.group = dist.new_group(backend="gloo") if is_dist() else None

    def _handler(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum).name

    def should_stop(self) -> bool:
        """Call once per optimizer step on every rank; True once any rank got a signal."""
        if not is_dist():
            return self.received is not None
        stop = False
        if self.work is not None:
            self.work.wait()
            stop = bool(self.flag.item())
        self.flag.fill_(1 if self.received else 0)
        self.work = dist.all_reduce(self.flag, group=self.group, async_op=True)
        return stop

    def exit_preempted(self, step: int, logger: Any) -> None:
        """After the last checkpoint: say how to continue, exit 75. Also create ``$PREEMPTED_MARKER`` if set:
        scripts/slurm/requeue.sh requeues on it, as the exit code it sees is torchrun's, not the ranks' 75."""
        if os.environ.get("PREEMPTED_MARKER"):
            open(os.environ["PREEMPTED_MARKER"], "a").close()
        print0(
            f"stopped by {self.received or 'a signal on another rank'} at step {step}; checkpoint saved, "
            f"rerun the same command to continue (exit {PREEMPTED_EXIT_CODE})"
        )
        logger.close()
        sys.exit(PREEMPTED_EXIT_CODE)

    def close(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
