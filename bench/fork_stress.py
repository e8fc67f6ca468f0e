"""Start DataLoader workers over and over in a 2-rank gloo job, with gloo work in flight at each start.

    python bench/hang_loop.py --runs 20 --stall 60 -- \
        torchrun --standalone --nproc_per_node=2 bench/fork_stress.py --workers-from fork --in-flight 32
    ... the same with --workers-from forkserver (common.data.worker_context, what the scripts use)

Each iteration trains one DDP step, starts --in-flight async all-reduces on a second gloo group (as StopSignal does
every step), iterates a fresh one-worker DataLoader over real JPEGs and all-reduces. A worker forked from the rank
(--workers-from fork) can hang inside os.fork() when a gloo thread took the GIL at that instant (Python < 3.11.10:
CPython gh-112275); the rank then waits for it forever and the other rank in its all-reduce. Prints one line per
iteration, so hang_loop.py sees a stall.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as T
from torchvision import datasets

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.data import SeededDataset, init_worker, loader_generator, worker_context
from tests.conftest import make_jpeg_imagefolder

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers-from", choices=("fork", "forkserver"), default="forkserver", help="how workers start")
    p.add_argument("--in-flight", type=int, default=1, help="async all-reduces in flight when a worker starts")
    p.add_argument("--iters", type=int, default=100000)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.new_group(backend="gloo")
    root = Path(tempfile.mkdtemp(prefix=f"fork_stress{rank}_"))
    tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor()])
    ds = SeededDataset(datasets.ImageFolder(str(make_jpeg_imagefolder(root, {"train": 8}) / "train"), tf), 0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(7200, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctx = worker_context(1) if args.workers_from == "forkserver" else None
    for it in range(args.iters):
        nn.functional.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.randint(0, 3, (4,))).backward()
        opt.step()
        opt.zero_grad()
        works = [dist.all_reduce(torch.ones(1), group=group, async_op=True) for _ in range(args.in_flight)]
        loader = torch.utils.data.DataLoader(ds, 4, sampler=[(0, i) for i in range(8)], num_workers=1,
                                             multiprocessing_context=ctx, worker_init_fn=init_worker,
                                             generator=loader_generator(0, rank))  # fmt: skip
        total = torch.tensor([float(sum(x.sum() for x, _ in loader))])
        for w in works:
            w.wait()
        dist.all_reduce(total)
        print(rank, it, flush=True)
    dist.destroy_process_group()
