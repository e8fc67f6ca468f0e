"""Samplers for exact evaluation and resumable, deterministic training.

Training order of epoch ``e`` is a pure function of ``(seed, e)``, so a run
resumed in the middle of an epoch replays the same permutation and skips the
batches it already did. Random augmentation is seeded per sample from
``(seed, epoch, index)``, so it is the same whatever the number of ranks or
DataLoader workers, and after a resume.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from common.distributed import STOP_SIGNALS, mix_seed

fork_server_pid: int | None = None  # set in the fork server (forkserver_guard); the workers it forks inherit it


class ResumableDistributedSampler(Sampler):
    """Like DistributedSampler (shuffle, drop_last), plus ``set_epoch(e, skip=k)``.

    Yields ``(epoch, index)`` pairs; wrap the dataset in ``SeededDataset`` so
    each sample's augmentation is seeded from them. Every rank yields the same
    number of samples, so every rank runs the same number of steps (no DDP hang).
    """

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1, seed: int = 0):
        if num_samples < world_size:
            raise ValueError(f"{num_samples} samples cannot be split over {world_size} ranks")
        self.n, self.rank, self.world, self.seed = num_samples, rank, world_size, seed
        self.per_rank = num_samples // world_size  # drop the tail so ranks stay equal
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Select epoch ``epoch`` and skip its first ``skip`` samples on this rank."""
        self.epoch, self.skip = epoch, skip

    def indices(self) -> list[int]:
        g = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch))
        order = torch.randperm(self.n, generator=g).tolist()
        return order[: self.per_rank * self.world][self.rank :: self.world]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((self.epoch, i) for i in self.indices()[self.skip :])

    def __len__(self) -> int:
        return self.per_rank - self.skip


class ExactEvalSampler(Sampler):
    """Each sample on exactly one rank, no padding: rank r gets r, r+W, r+2W, ...

    Ranks may get different counts, so evaluate with the bare model (no DDP
    forward, which would wait for the other ranks) and all-reduce sums.
    """

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1):
        self.n, self.rank, self.world = num_samples, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.n, self.world))

    def __len__(self) -> int:
        return max(0, math.ceil((self.n - self.rank) / self.world))


class SeededDataset(Dataset):
    """``dataset[(epoch, i)]`` runs ``dataset[i]`` (and its random transform) under a
    torch seed made from ``(seed, epoch, i)``; plain ``dataset[i]`` is passed through."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, tuple):
            return self.dataset[key]
        epoch, i = key
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(mix_seed(self.seed, epoch, i))
            return self.dataset[i]


def die_with_parent(parent: int | None = None) -> None:
    """Linux: have the kernel SIGKILL this process when the thread that started it exits (PR_SET_PDEATHSIG).

    SIGKILL ends even a stopped process. Two links use it, so that DataLoader workers never outlive their rank,
    however it dies (the stall watchdog, SIGKILL from a launcher or Slurm, the OOM killer): the fork server dies
    with its rank (``worker_context`` preloads common/forkserver_guard.py into it), and each worker with the fork
    server (``init_worker``). The fork server alone would not exit: it waits for its last worker, and a worker
    stopped or stuck in a read would then keep the job's stdout open and hang whatever waits on it.
    ``parent``: the pid the parent had; one that died before this call sends nothing, so this process ends itself.
    """
    import sys

    if sys.platform == "linux":
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)
        if parent is not None and os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)


def leave_signals_to_the_rank(block: bool = False) -> None:
    """Ignore SIGINT and the stop signals (``STOP_SIGNALS``) in a DataLoader worker and its fork server.

    torchrun's agent forwards a signal to each rank's whole process group (os.killpg), Slurm signals every process
    of a job step, a terminal's Ctrl-C the whole foreground group. Left to their defaults, the workers die of it
    before their rank reaches a step boundary, and the rank fails with "DataLoader worker exited unexpectedly"
    instead of saving and exiting 75 (or, on Ctrl-C, with that error instead of its KeyboardInterrupt). The rank
    decides; its workers die with it (``die_with_parent``), and the stall watchdog SIGKILLs a stuck one.

    The fork server also blocks them (``block``): its workers inherit the mask, so a signal that arrives while a
    new worker runs torch's own SIGTERM handler, before ``init_worker``, stays pending and is then discarded.
    """
    import signal

    sigs = [getattr(signal, name) for name in ("SIGINT", *STOP_SIGNALS)]
    for sig in sigs:
        signal.signal(sig, signal.SIG_IGN)
    if block:
        signal.pthread_sigmask(signal.SIG_BLOCK, sigs)


def init_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: seed python/numpy from the worker's torch seed; die with the fork server; leave
    stop signals to the rank (torch's worker loop has just installed its own SIGTERM handler, which exits).

    A worker forked from the fork server inherits its imports with the cyclic GC off (common/forkserver_guard.py):
    frozen, later collections never touch them, so the pages the worker shares with the server stay shared."""
    import gc
    import random
    import sys

    gc.freeze()
    gc.enable()

    s = torch.initial_seed() % 2**32
    random.seed(s)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(s)
    die_with_parent(fork_server_pid)
    leave_signals_to_the_rank()


def loader_generator(seed: int, rank: int) -> torch.Generator:
    """Generator for a DataLoader so worker base seeds depend on (seed, rank) only."""
    return torch.Generator().manual_seed(mix_seed(seed, rank))


def loader_kwargs(workers: int, seed: int, rank: int, device: torch.device) -> dict[str, Any]:
    """DataLoader arguments every script uses: fork-server workers that die with their rank, seeded by (seed, rank)."""
    return dict(num_workers=workers, pin_memory=device.type == "cuda", worker_init_fn=init_worker,
                persistent_workers=workers > 0, generator=loader_generator(seed, rank),
                multiprocessing_context=worker_context(workers))  # fmt: skip


def worker_context(num_workers: int) -> multiprocessing.context.BaseContext | None:
    """DataLoader ``multiprocessing_context``: workers forked from a fork server, never from the training process.

    A rank runs threads of its own (gloo's, NCCL's watchdog), and a worker forked while one of them holds a lock
    inherits the lock and waits for it forever (CPython gh-112275). The fork server is a fresh single-threaded
    process that imports torch once (``forkserver_guard``; pair with ``worker_init_fn=init_worker``); started here,
    at once, so that its imports overlap the model's construction.
    """
    if num_workers <= 0 or "forkserver" not in multiprocessing.get_all_start_methods():
        return None  # no workers, or spawn (macOS, Windows): nothing is forked
    import sys
    from multiprocessing import forkserver

    # The server imports these once, not every worker again (Python's own preload of __main__ finds no main path).
    heavy = ("torch", "torch.distributed", "torchvision", "PIL.Image", "numpy")
    guard = f"{__package__}.forkserver_guard" if __package__ else "forkserver_guard"  # whatever common/ is called
    forkserver.set_forkserver_preload([guard] + [m for m in heavy if m in sys.modules])
    forkserver.ensure_running()
    return _WorkerContext()


if hasattr(multiprocessing.context, "ForkServerProcess"):  # not on Windows
    from multiprocessing import popen_forkserver

    class _Popen(popen_forkserver.Popen):
        """Ending a worker means SIGKILL: it ignores SIGTERM (``leave_signals_to_the_rank``), and a rank that fails
        with a loader alive would otherwise wait for good at its exit, where multiprocessing terminates and joins the
        workers left (until the launcher's SIGKILL, 30 s later under torchrun; for good under mp.spawn)."""

        def terminate(self) -> None:
            self.kill()

    class _Worker(multiprocessing.context.ForkServerProcess):  # pickled to the fork server: a module-level class
        _Popen = staticmethod(_Popen)

    class _WorkerContext(multiprocessing.context.ForkServerContext):
        Process = _Worker
