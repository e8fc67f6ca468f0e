"""Preemption: SIGTERM or SIGUSR2 (Slurm's ``--signal``) on any rank stops every rank at the same step; the script
saves ``last.pt`` and the run exits 75 ("requeue me"), to continue with the same command. The ranks agree through an
all-reduce on a gloo group of its own, started at one step and read at the next: it never blocks the GPU stream.
Before the first step there is nothing new to save: a signal then ends the rank at once, with exit 75 too."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist

from common.distributed import print0

PREEMPTED = 75  # EX_TEMPFAIL: stopped on a signal after a checkpoint; rerun the same command to continue
SIGNALS = ("SIGTERM", "SIGUSR2")


class Preemption:
    def __init__(self) -> None:
        self.flag, self.work, self.group = torch.zeros(1, dtype=torch.int32), None, None
        self.received: str | None = None  # the signal this rank got
        self.stepping = False  # True from the first step on: a signal then waits for the step boundary
        self.stopped = False  # True once the ranks agreed to stop
        self.step = 0  # the step of the last check
        for name in SIGNALS:
            signal.signal(getattr(signal, name), self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum).name
        if not self.stepping:  # start-up: nothing to save
            self.stopped = True
            raise SystemExit(PREEMPTED)

    def stop(self, step: int) -> bool:
        """The core's ``stop_requested(step)``: once per optimizer step on every rank; True once any rank got a
        signal (a step later: the all-reduce started at one step is read at the next)."""
        self.stepping, self.step = True, step
        if not dist.is_initialized():
            self.stopped = self.received is not None
            return self.stopped
        if self.group is None:  # its own group: never interleaves with DDP's gradient all-reduces
            self.group = dist.new_group(backend="gloo")
        if self.work is not None:
            self.work.wait()
            self.stopped = bool(self.flag.item())
        self.flag.fill_(1 if self.received else 0)
        self.work = dist.all_reduce(self.flag, group=self.group, async_op=True)
        return self.stopped

    def at_cleanup(self) -> None:
        """After the last checkpoint: say how to continue and exit 75. ``$PREEMPTED_MARKER``, if set, names a file
        to create, for a job script that sees torchrun's exit status rather than the ranks' (scripts/slurm)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        if not self.stopped:
            return
        if os.environ.get("PREEMPTED_MARKER") and (not dist.is_initialized() or dist.get_rank() == 0):
            open(os.environ["PREEMPTED_MARKER"], "a").close()
        when = f"at step {self.step}; checkpoint saved" if self.stepping else "before the first step; nothing to save"
        print0(f"stopped by {self.received or 'a signal on another rank'} {when}, rerun the same command to continue "
               f"(exit {PREEMPTED})")  # fmt: skip
        sys.exit(PREEMPTED)
