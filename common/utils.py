"""Training helpers the scripts share: precision, the LR, weight decay, the weight average, [DDP 5] exact eval."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.distributed import all_reduce_sum
from common.errors import UserError


def amp_dtype(amp: str, device: torch.device) -> torch.dtype | None:  # --amp: auto is bf16 on GPU, none on CPU
    amp = ("bf16" if device.type == "cuda" else "none") if amp == "auto" else amp
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}[amp]


def lr_at(epoch: int, step: int, peak: float, args: Any, steps_per_epoch: int) -> float:
    """The LR of step ``step`` (from 0) of epoch ``epoch``: warmup, then cosine, onecycle or step decay, in epochs."""
    step += epoch * steps_per_epoch
    warmup, total = round(args.warmup_epochs * steps_per_epoch), args.epochs * steps_per_epoch
    if args.lr_schedule == "onecycle":
        top = max(1, int(0.25 * total))
        return peak * min((step + 1) / top, max(0.0, (total - step) / (total - top)))
    if args.lr_schedule == "cosine" and step >= warmup:
        return peak * 0.5 * (1 + math.cos(math.pi * min(1, (step - warmup) / max(1, total - warmup))))
    ramp = min(1.0, (step + 1) / warmup) if warmup else 1.0
    decay = 1.0 if args.lr_schedule == "cosine" else args.lr_gamma ** (step // (args.lr_step_size * steps_per_epoch))
    return peak * ramp * decay


def param_groups(model: torch.nn.Module, weight_decay: float, skip_norm_bias: bool = True) -> list[dict[str, Any]]:
    """Weight decay on weights, none on norm layers and biases (1-d params) if asked."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if skip_norm_bias and p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def check_finite(loss: float, step: int) -> None:
    """A NaN or infinite loss stops the run before a checkpoint holds such weights."""
    if not math.isfinite(loss):
        raise UserError(f"loss is {loss} at step {step}: stopped before writing a checkpoint, the last one is intact "
                        "(lower --lr, check the data, or resume from last.pt with other settings)")  # fmt: skip


class EMA:
    """A moving average of a model's weights and buffers; after step n, decay min(decay, (1 + n) / (10 + n))."""

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


@torch.no_grad()
def evaluate_classifier(model: torch.nn.Module, batches: Iterable, device: torch.device, dtype: torch.dtype | None,
                        tta: bool = False) -> dict[str, float]:  # fmt: skip
    """Exact: each rank sums its own batches (none padded), one all-reduce; the bare model (not DDP), eager."""
    if dist.is_initialized():  # every rank evaluates rank 0's BatchNorm statistics, the ones its checkpoint holds
        for b in model.buffers():
            dist.broadcast(b, src=0)
    model.eval()
    sums = torch.zeros(4, device=device, dtype=torch.float64)  # loss, correct top-1, correct top-5, count
    for x, y in batches:
        with torch.autocast(device.type, dtype, enabled=dtype is not None):
            logits = model(x).float()
            if tta:  # average with the mirrored image
                logits = (logits + model(torch.flip(x, dims=[3])).float()) / 2
        hit = logits.topk(min(5, logits.shape[1]), dim=1).indices == y[:, None]  # (batch, k): right at rank j?
        loss = F.cross_entropy(logits.double(), y, reduction="sum")
        sums += torch.stack([loss, hit[:, 0].sum(), hit.any(dim=1).sum(), torch.full_like(loss, len(y))])
    loss, c1, c5, n = all_reduce_sum(sums).tolist()  # [DDP 5]
    model.train()
    return {"loss": loss / max(n, 1), "acc1": 100 * c1 / max(n, 1), "acc5": 100 * c5 / max(n, 1), "count": int(n)}
