"""[DDP 2] The resumable distributed sampler, and augmentation seeded per sample: a resume needs no RNG state."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from common.distributed import SEAMS, mix_seed


class ResumableDistributedSampler(Sampler):
    """DistributedSampler (shuffle, drop_last), epoch e's order a function of (seed, e); ``set_epoch(e, skip=k)``."""

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1, seed: int = 0):
        self.n, self.rank, self.world, self.seed, self.epoch, self.skip = num_samples, rank, world_size, seed, 0, 0
        self.per_rank = num_samples // world_size  # drop the tail so ranks stay equal

    def set_epoch(self, epoch: int, skip: int = 0) -> None:  # skip: this rank's samples already done
        self.epoch, self.skip = epoch, skip

    def indices(self) -> list[int]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(mix_seed(self.seed, self.epoch)))
        return order[: self.per_rank * self.world][self.rank :: self.world].tolist()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((self.epoch, i) for i in self.indices()[self.skip :])

    def __len__(self) -> int:
        return max(0, self.per_rank - self.skip)


class SeededDataset(Dataset):
    """``dataset[(epoch, i)]`` runs ``dataset[i]`` under a torch seed made from ``(seed, epoch, i)``."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __getitem__(self, key: tuple[int, int]) -> Any:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(mix_seed(self.seed, *key))
            return self.dataset[key[1]]


def loader_kwargs(workers: int, seed: int, rank: int, device: torch.device) -> dict[str, Any]:
    """Workers kept across epochs, seeded by (seed, rank) only (torch seeds each worker from ``generator``)."""
    generator = torch.Generator().manual_seed(mix_seed(seed, rank))
    return dict(num_workers=workers, pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                generator=generator, **(SEAMS.loader() if workers > 0 else {}))  # fmt: skip
