"""Train a tiny MLP (no BatchNorm) with the collection's sampler; rank 0 saves the final weights.

Run with 1 process and batch 2B, or under torchrun with 2 processes and batch B:
the parameters must agree (DDP averages gradients over the same global batch).
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common.data import ResumableDistributedSampler
from common.distributed import add_dist_args, cleanup_distributed, setup_distributed

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, required=True)
p.add_argument("--out", required=True)
p.add_argument("--no-ddp", action="store_true", help="skip gradient averaging (the test's negative control)")
add_dist_args(p)
args = p.parse_args()
info = setup_distributed(args)
torch.set_default_dtype(torch.float64)
g = torch.Generator().manual_seed(123)
X, Y = torch.randn(96, 10, generator=g), torch.randint(0, 3, (96,), generator=g)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
if info.world_size > 1 and not args.no_ddp:
    model = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sampler = ResumableDistributedSampler(len(X), info.rank, info.world_size, seed=7)
for epoch in range(3):
    sampler.set_epoch(epoch)
    idx = [i for _, i in sampler]
    for s in range(0, len(idx) - args.batch_size + 1, args.batch_size):
        b = torch.tensor(idx[s : s + args.batch_size])
        loss = nn.functional.cross_entropy(model(X[b]), Y[b])
        opt.zero_grad()
        loss.backward()
        opt.step()
if info.is_main:
    torch.save({k.removeprefix("module."): v for k, v in model.state_dict().items()}, args.out)
cleanup_distributed()
