"""The resumable training sampler (epoch e's order is a pure function of ``(seed, e)``, each sample's augmentation
of ``(seed, epoch, index)``), and DataLoader workers that never outlive their rank."""

from __future__ import annotations

import gc
import multiprocessing
import os
import random
import signal
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from common.distributed import STOP_SIGNALS, mix_seed

fork_server_pid: int | None = None  # set in the fork server (forkserver_guard); the workers it forks inherit it


class ResumableDistributedSampler(Sampler):
    """DistributedSampler (shuffle, drop_last) plus ``set_epoch(e, skip=k)``; yields ``(epoch, index)`` pairs for
    ``SeededDataset``. Every rank yields as many samples, so all run the same number of steps (no DDP hang)."""

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1, seed: int = 0):
        if num_samples < world_size:
            raise ValueError(f"{num_samples} samples cannot be split over {world_size} ranks")
        self.n, self.rank, self.world, self.seed = num_samples, rank, world_size, seed
        self.per_rank = num_samples // world_size  # drop the tail so ranks stay equal
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:  # skip: this rank's samples already done
        self.epoch, self.skip = epoch, skip

    def indices(self) -> list[int]:
        g = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch))
        order = torch.randperm(self.n, generator=g).tolist()
        return order[: self.per_rank * self.world][self.rank :: self.world]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((self.epoch, i) for i in self.indices()[self.skip :])

    def __len__(self) -> int:
        return self.per_rank - self.skip


class SeededDataset(Dataset):
    """``dataset[(epoch, i)]`` runs ``dataset[i]`` under a torch seed made from ``(seed, epoch, i)``."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, i = key
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(mix_seed(self.seed, epoch, i))
            return self.dataset[i]


def die_with_parent(parent: int | None = None) -> None:
    """Linux: the kernel SIGKILLs this process when the thread that started it exits (PR_SET_PDEATHSIG), however it
    dies. The fork server dies with its rank (forkserver_guard.py), each worker with the fork server (init_worker):
    a worker left stopped or stuck in a read would keep the job's stdout open and hang whatever waits on it.
    ``parent``: the pid the parent had; one that died before the call sends nothing, so this process ends itself."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if parent is not None and os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)


def leave_signals_to_the_rank(block: bool = False) -> None:
    """Ignore SIGINT and STOP_SIGNALS in a DataLoader worker and its fork server: torchrun, Slurm and Ctrl-C signal
    the whole process group, and a worker that died of it would fail its rank ("DataLoader worker exited
    unexpectedly") before the rank saves and exits 75. The fork server also blocks them (``block``), so that a
    signal arriving before a new worker's ``init_worker`` stays pending and is then discarded."""
    sigs = [getattr(signal, name) for name in ("SIGINT", *STOP_SIGNALS)]
    for sig in sigs:
        signal.signal(sig, signal.SIG_IGN)
    if block:
        signal.pthread_sigmask(signal.SIG_BLOCK, sigs)


def init_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn. What it inherited with the GC off is frozen, so that those pages stay shared."""
    gc.freeze()
    gc.enable()

    s = torch.initial_seed() % 2**32
    random.seed(s)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(s)
    die_with_parent(fork_server_pid)
    leave_signals_to_the_rank()


def loader_kwargs(workers: int, seed: int, rank: int, device: torch.device) -> dict[str, Any]:
    """DataLoader arguments: fork-server workers that die with their rank, seeded by (seed, rank) only."""
    return dict(num_workers=workers, pin_memory=device.type == "cuda", worker_init_fn=init_worker,
                persistent_workers=workers > 0, generator=torch.Generator().manual_seed(mix_seed(seed, rank)),
                multiprocessing_context=worker_context(workers))  # fmt: skip


def worker_context(num_workers: int) -> multiprocessing.context.BaseContext | None:
    """DataLoader ``multiprocessing_context``: workers forked from a single-threaded fork server, never from the rank,
    whose threads (gloo, NCCL) may hold a lock at the fork (CPython gh-112275). Started at once, to overlap the
    model's construction."""
    if num_workers <= 0 or "forkserver" not in multiprocessing.get_all_start_methods():
        return None  # no workers, or spawn (macOS, Windows): nothing is forked
    from multiprocessing import forkserver

    # the server imports these once, not every worker again
    heavy = ("torch", "torch.distributed", "torchvision", "PIL.Image", "numpy")
    guard = f"{__package__}.forkserver_guard" if __package__ else "forkserver_guard"  # whatever common/ is called
    forkserver.set_forkserver_preload([guard] + [m for m in heavy if m in sys.modules])
    forkserver.ensure_running()
    return _WorkerContext()


if hasattr(multiprocessing.context, "ForkServerProcess"):  # not on Windows
    from multiprocessing import popen_forkserver

    class _Popen(popen_forkserver.Popen):
        """Ending a worker means SIGKILL: it ignores SIGTERM, and a failed rank's exit would otherwise wait for it."""

        def terminate(self) -> None:
            self.kill()

    class _Worker(multiprocessing.context.ForkServerProcess):  # pickled to the fork server: a module-level class
        _Popen = staticmethod(_Popen)

    class _WorkerContext(multiprocessing.context.ForkServerContext):
        Process = _Worker
