"""A stall watchdog: a rank that makes no training progress for ``--stall-timeout`` seconds dumps every
thread's stack to stderr, says what it was waiting for, and exits with code 124, so that torchrun
(``--max-restarts``) or Slurm restarts the job instead of it hanging until the allocation ends.

The training loop marks progress with a plain attribute assignment (a monotonic time and a label saying what
the rank does next); a daemon thread compares it with the clock. Nothing is added to the hot loop: no host
sync, no collective, no lock.

    watchdog = Watchdog(args.stall_timeout, info.rank)
    for x, y in watchdog.batches(train_batches(...)):   # "waiting for the data loader", then "training step"
        ...
    watchdog.beat(CHECKPOINT)                            # before a long piece of work of another kind
    watchdog.stop()
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

STALL_EXIT_CODE = 124  # as timeout(1): the command ran out of time
# The first training step (DataLoader workers starting, a fork server importing torch, torch.compile, NCCL
# communicators) gets at least this long whatever --stall-timeout says, so a short timeout watches the steady state;
# so does the first batch of every evaluation, for which an evaluation loader starts its workers (imagenet's keeps
# none between evaluations).
FIRST_STEP_TIMEOUT = 1200.0

TRAIN_DATA = "waiting for the next training batch from the data loader"
TRAIN_STEP = "in a training step (forward, backward with the gradient all-reduce, optimizer step, logging collectives)"
EVAL_DATA = "waiting for the next evaluation batch from the data loader"
EVAL_STEP = "evaluating (forward passes, then the all-reduce or gather of the results)"
CHECKPOINT = "writing a checkpoint"
STARTING = "starting the training loop"


class Watchdog:
    """Ends this process if ``beat()`` (or ``batches()``) is not called for ``timeout`` seconds (0: never)."""

    def __init__(self, timeout: float, rank: int = 0, what: str = STARTING):
        self.timeout, self.rank = timeout, rank
        # (since, doing what, starting: the first step's allowance applies); one tuple, replaced whole: the thread
        # never sees half an update
        self.state = (time.monotonic(), what, False)
        self.stepped = False  # True once a whole training step is done: from then on `timeout` applies
        self._stopped = threading.Event()
        self._poll = min(5.0, timeout / 4)
        if timeout > 0:
            self._arm_fallback()
            threading.Thread(target=self._watch, name="stall-watchdog", daemon=True).start()
            atexit.register(self.stop)  # also on an exception or sys.exit: no armed fallback during shutdown

    def beat(self, what: str) -> None:
        """Progress: from now on this rank is busy with ``what`` (a phrase for the error message)."""
        self.state = (time.monotonic(), what, False)

    def batches(self, iterable: Iterable[T], evaluating: bool = False) -> Iterator[T]:
        """Yield from ``iterable``, labelling the wait for each item and the work done with it."""
        waiting, working = (EVAL_DATA, EVAL_STEP) if evaluating else (TRAIN_DATA, TRAIN_STEP)
        starting = evaluating  # an evaluation loader starts its workers for its first batch
        it = iter(iterable)
        while True:
            self.state = (time.monotonic(), waiting, starting)
            try:
                item = next(it)
            except StopIteration:
                self.state = (time.monotonic(), working, False)
                return
            starting = False
            self.state = (time.monotonic(), working, False)
            yield item
            self.stepped = True

    def stop(self) -> None:
        self._stopped.set()
        if self.timeout > 0:
            faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        while not self._stopped.wait(self._poll):
            since, what, starting = self.state
            idle = time.monotonic() - since
            if idle > self._limit(starting):
                self._fire(idle, what)
            if not self._stopped.is_set():
                self._arm_fallback()

    def _arm_fallback(self) -> None:
        """A fallback in C for a main thread stuck in C code that holds the GIL, where the watchdog thread cannot
        run: re-armed at every poll, it fires (stacks, then exit code 1) only after a whole timeout of missed polls."""
        faulthandler.dump_traceback_later(self._limit(self.state[2]) + self._poll, exit=True, file=2)

    def _limit(self, starting: bool) -> float:
        """Seconds without progress allowed now: the first step's allowance before it is done or while starting."""
        return max(self.timeout, FIRST_STEP_TIMEOUT) if starting or not self.stepped else self.timeout

    def _fire(self, idle: float, what: str) -> None:
        """Stacks, then the one-line error, then exit. os._exit works where raising in the main thread would
        not: it may be blocked in C (a gloo/NCCL wait, a DataLoader queue get) and never see an exception."""
        faulthandler.cancel_dump_traceback_later()
        _write(f"rank {self.rank}: no progress for {idle:.0f}s {what}; the stack of every thread follows\n")
        faulthandler.dump_traceback(2, all_threads=True)
        # DataLoader workers (and any other multiprocessing child) die with us: a frozen one would stay an
        # orphan, and the others would only notice our death after their 5-second status poll.
        for child in multiprocessing.active_children():
            try:
                os.kill(child.pid, signal.SIGKILL)
            except OSError:
                pass
        # No destroy_process_group(): it may block on the very collective that stalled. Our sockets close with
        # the process, so peers fail fast (gloo) or time out (NCCL, --dist-timeout), or torchrun stops them.
        _write(
            f"error: rank {self.rank} stalled: no progress for {idle:.0f}s {what} (every thread's stack is above; "
            f"exit code {STALL_EXIT_CODE} lets torchrun --max-restarts or Slurm restart the job; a healthy phase "
            f"this slow needs a larger --stall-timeout than {self.timeout:g}, 0 turns the watchdog off)\n"
        )
        os._exit(STALL_EXIT_CODE)


def _write(text: str) -> None:
    """Straight to fd 2: the main thread may be stuck holding sys.stderr's lock."""
    try:
        os.write(2, text.encode())
    except OSError:
        pass
