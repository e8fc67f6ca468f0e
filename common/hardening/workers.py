"""DataLoader workers that never outlive their rank nor die of the signals meant for it (torchrun, Slurm and Ctrl-C
signal the whole group; a dead worker fails its rank before it saves): forked from a fork server, not from the rank,
whose threads (gloo, NCCL) may hold a lock at the fork, with the stop signals blocked, then ignored (``guard``)."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import sys
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)


@functools.cache
def loader_args() -> dict[str, Any]:
    """DataLoader arguments for workers from the fork server (started now, to overlap the model's construction);
    none where processes are spawned, not forked (macOS, Windows)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return {}
    from multiprocessing import forkserver, resource_tracker

    # the server imports these once, not every worker again
    forkserver.set_forkserver_preload([m for m in ("torch", "torchvision", "PIL.Image", "numpy") if m in sys.modules])
    resource_tracker.ensure_running()  # first: starting it unblocks SIGINT and SIGTERM, which must stay blocked below
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # inherited by the server, then by every worker
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    server = forkserver._forkserver._forkserver_pid  # the workers' parent: they die with it (PR_SET_PDEATHSIG)
    return {"multiprocessing_context": _WorkerContext(), "worker_init_fn": functools.partial(guard, server)}


def guard(server: int | None, worker_id: int) -> None:
    """A worker's first line (``worker_init_fn``): ignore the stop signals (torch's worker set its own SIGTERM
    handler; the signals stay blocked, and one that came meanwhile is dropped), and die with the fork server."""
    from multiprocessing import forkserver

    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive is not None:  # the server ends once no process holds this pipe: let that be its rank alone
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the kernel kills us when the server ends
        if server is not None and os.getppid() != server:  # it ended before that line
            os.kill(os.getpid(), signal.SIGKILL)


if hasattr(multiprocessing.context, "ForkServerProcess"):  # not on Windows
    from multiprocessing import popen_forkserver

    class _Popen(popen_forkserver.Popen):
        """Ending a worker means SIGKILL: it ignores SIGTERM, and a failed rank's exit would otherwise wait for it."""

        def terminate(self) -> None:
            self.kill()

    class _Worker(multiprocessing.context.ForkServerProcess):
        _Popen = staticmethod(_Popen)

    class _WorkerContext(multiprocessing.context.ForkServerContext):
        Process = _Worker
