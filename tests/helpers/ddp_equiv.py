"""Train a tiny MLP (no BatchNorm) with the collection's sampler; rank 0 saves the final weights.

Run with 1 process and batch 2B, or under torchrun with 2 processes and batch B: the parameters must agree (DDP
averages gradients over the same global batch). train() is also called in the test's own process, for the runs
that need no process group: the single process, and one rank's shard trained alone (the negative control).
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common.args import add_dist_args
from common.data import ResumableDistributedSampler
from common.distributed import cleanup_distributed, setup_distributed

DTYPE = torch.float64  # passed explicitly: the test's process keeps its default dtype


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16, dtype=DTYPE), nn.Tanh(), nn.Linear(16, 3, dtype=DTYPE))


def train(batch_size: int, rank: int = 0, world_size: int = 1, ddp: bool = True) -> dict:
    """3 epochs of SGD on rank's shard; with ddp and world_size > 1 (a process group needed) gradients are averaged."""
    g = torch.Generator().manual_seed(123)
    X, Y = torch.randn(96, 10, generator=g, dtype=DTYPE), torch.randint(0, 3, (96,), generator=g)
    model = make_model()
    if world_size > 1 and ddp:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ResumableDistributedSampler(len(X), rank, world_size, seed=7)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        idx = [i for _, i in sampler]
        for s in range(0, len(idx) - batch_size + 1, batch_size):
            b = torch.tensor(idx[s : s + batch_size])
            loss = nn.functional.cross_entropy(model(X[b]), Y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {k.removeprefix("module."): v for k, v in model.state_dict().items()}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--out", required=True)
    add_dist_args(p)
    args = p.parse_args()
    info = setup_distributed(args)
    weights = train(args.batch_size, info.rank, info.world_size)
    if info.is_main:
        torch.save(weights, args.out)
    cleanup_distributed()
