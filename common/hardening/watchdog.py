"""A rank without progress for ``--stall-timeout`` seconds dumps every stack, says what it waited for and exits 124
(to be restarted). Progress is an assignment a daemon thread reads: no host sync, collective or lock in the loop."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import multiprocessing
import os
import threading
import time
from collections.abc import Iterable, Iterator

STALL_EXIT_CODE = 124  # as timeout(1): the command ran out of time
# the first training step (workers starting, torch.compile, NCCL) and every evaluation's first batch get at least
# this long, so that a short --stall-timeout watches the steady state
FIRST_STEP_TIMEOUT = 1200.0

TRAIN_DATA = "waiting for the next training batch from the data loader"
TRAIN_STEP = "in a training step (forward, backward with the gradient all-reduce, optimizer step, logging collectives)"
EVAL_DATA = "waiting for the next evaluation batch from the data loader"
EVAL_STEP = "evaluating (forward passes, then the all-reduce or gather of the results)"


class Watchdog:
    """Ends this process if ``beat()`` (or ``batches()``) is not called for ``timeout`` seconds (0: never)."""

    def __init__(self, timeout: float, rank: int = 0):
        self.timeout, self.rank = timeout, rank
        # (since, doing what, starting); one tuple, replaced whole: the thread never sees half an update
        self.state = (time.monotonic(), "starting the training loop", False)
        self.stepped = False  # True once a whole training step is done: from then on `timeout` applies
        self.started = False  # the thread starts with the first batch asked for: start-up is not watched
        self._stopped = threading.Event()
        self._poll = min(5.0, timeout / 4)

    def beat(self, what: str) -> None:  # progress: from now on this rank is busy with `what`
        self.state = (time.monotonic(), what, False)

    def batches(self, iterable: Iterable, evaluating: bool = False) -> Iterator:
        """Yield from ``iterable``, labelling the wait for each item and the work done with it."""
        waiting, working = (EVAL_DATA, EVAL_STEP) if evaluating else (TRAIN_DATA, TRAIN_STEP)
        if not self.started and self.timeout > 0:
            self._arm_fallback()
            threading.Thread(target=self._watch, name="stall-watchdog", daemon=True).start()
            atexit.register(self.stop)  # also on an exception or sys.exit: no armed fallback during shutdown
        self.started = True
        # an evaluation loader starts its workers for its first batch
        self.state = (time.monotonic(), waiting, evaluating)
        for item in iterable:
            self.beat(working)
            yield item
            self.stepped = True
            self.beat(waiting)
        self.beat(working)

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
        """A fallback in C for a main thread stuck in C holding the GIL: re-armed each poll, fires after a timeout."""
        faulthandler.dump_traceback_later(self._limit(self.state[2]) + self._poll, exit=True, file=2)

    def _limit(self, starting: bool) -> float:
        return max(self.timeout, FIRST_STEP_TIMEOUT) if starting or not self.stepped else self.timeout

    def _fire(self, idle: float, what: str) -> None:
        """Stacks, the one-line error, os._exit: the main thread may be blocked in C and never see an exception."""
        faulthandler.cancel_dump_traceback_later()
        _write(f"rank {self.rank}: no progress for {idle:.0f}s {what}; the stack of every thread follows\n")
        faulthandler.dump_traceback(2, all_threads=True)
        # DataLoader workers die with us: a frozen one would stay an orphan
        for child in multiprocessing.active_children():
            with contextlib.suppress(OSError):  # nothing may keep this thread from the exit below
                child.kill()
        # no destroy_process_group(): it may block on the very collective that stalled; peers see our sockets close
        _write(f"error: rank {self.rank} stalled: no progress for {idle:.0f}s {what} (every thread's stack is above; "
               f"exit code {STALL_EXIT_CODE} lets torchrun --max-restarts or Slurm restart the job; a healthy phase "
               f"this slow needs a larger --stall-timeout than {self.timeout:g}; 0 turns it off)\n")  # fmt: skip
        os._exit(STALL_EXIT_CODE)


def _write(text: str) -> None:
    # straight to fd 2: the main thread may be stuck holding sys.stderr's lock
    with contextlib.suppress(OSError):
        os.write(2, text.encode())
