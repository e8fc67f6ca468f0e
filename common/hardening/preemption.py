"""Preemption: SIGTERM, SIGINT (Ctrl-C) or SIGUSR2 (Slurm's ``--signal``) on any rank stops every rank at one step;
the script saves ``last.pt``, exit 75 ("requeue me"); during start-up, at once. The ranks agree by an all-reduce on a
gloo group of its own, started at one step and read at the next, so it never blocks the GPU."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist

from common.distributed import print0

PREEMPTED = 75  # EX_TEMPFAIL: stopped on a signal after a checkpoint; rerun the same command to continue


class Preemption:
    def __init__(self) -> None:
        self.flag, self.work, self.group = torch.zeros(1, dtype=torch.int32), None, None
        self.received, self.step = None, None  # the signal this rank got; the last check's step (None: no step yet)
        self.stepping = self.stopped = False  # training asked for batches (a signal waits a step); all ranks stop
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum).name
        if not self.stepping:  # start-up: nothing to save
            self.stopped = True
            raise SystemExit(PREEMPTED)

    def start(self, init_process_group: Any, *args: Any, **kwargs: Any) -> None:
        """init_process_group, then this group, during start-up: making it needs the launcher's store, gone with it."""
        init_process_group(*args, **kwargs)
        self.group = dist.new_group(backend="gloo")  # its own: never interleaves with DDP's gradient all-reduces

    def batches(self, inner: Any, items: Any, evaluating: bool) -> Any:
        """The core's ``watched()``, through ``inner`` (the watchdog's): training batches end the start-up."""
        self.stepping = self.stepping or not evaluating
        return inner(items, evaluating)

    def stop(self, step: int) -> bool:
        """The core's ``stop_requested(step)``, every step on every rank: True a step after any rank got a signal."""
        self.step = step
        if not dist.is_initialized():
            self.stopped = self.received is not None
            return self.stopped
        if self.work is not None:
            self.work.wait()
            self.stopped = bool(self.flag.item())
        self.flag.fill_(1 if self.received else 0)
        self.work = dist.all_reduce(self.flag, group=self.group, async_op=True)
        return self.stopped

    def at_cleanup(self) -> None:
        """After the last checkpoint: say how to continue and exit 75. ``$PREEMPTED_MARKER``, if set, names a file
        to create, for a job script that sees torchrun's exit status rather than the ranks' (scripts/slurm)."""
        if self.work is not None and sys.exc_info()[0] is None:  # the last check's all-reduce, unless a peer failed
            self.work.wait()
        # a rank that got the signal before any step: its peers that had started training failed their next
        # collective when it left, and no step was done since the start, so that failure is this same stop
        if not (self.stopped or (self.received and self.step is None)):
            return
        if os.environ.get("PREEMPTED_MARKER") and (not dist.is_initialized() or dist.get_rank() == 0):
            open(os.environ["PREEMPTED_MARKER"], "a").close()
        when = (
            "before the first step; nothing to save" if self.step is None else f"at step {self.step}; checkpoint saved"
        )
        print0(f"stopped by {self.received or 'a signal on another rank'} {when}, rerun the same command to continue "
               f"(exit {PREEMPTED})")  # fmt: skip
        sys.exit(PREEMPTED)
