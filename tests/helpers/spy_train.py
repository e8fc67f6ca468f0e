"""Run a train script unchanged and record what its launcher gave this rank (test-only).

    <launcher> tests/helpers/spy_train.py cifar_resnet/train.py TRAIN_ARGS...

Records rank, world size and launcher as ``detect_launcher`` sees them before the script starts,
and the sample indices that ``ResumableDistributedSampler`` really hands this rank during
training. At exit it writes ``<--output-dir>/ranks/rank<R>.json``, so a test can check every rank
joined one world and read a different shard. ``SPY_FAIL_RANK=R`` makes rank R exit 3 at once.
"""

import argparse
import atexit
import json
import os
import runpy
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common.args import add_dist_args
from common.data import ResumableDistributedSampler
from common.distributed import detect_launcher

ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "PMI_RANK",
    "OMPI_COMM_WORLD_RANK",
)

# torch.distributed.launch inserts --local-rank=N before the script's own arguments.
target = next(a for a in sys.argv[1:] if a.endswith(".py"))
argv = [a for a in sys.argv[1:] if a is not target]
p = argparse.ArgumentParser(add_help=False)
p.add_argument("--output-dir", required=True)
add_dist_args(p)
args, _ = p.parse_known_args(argv)
launch = detect_launcher(os.environ, args)
if str(launch.rank) == os.environ.get("SPY_FAIL_RANK"):
    sys.exit(3)
record = {
    "rank": launch.rank,
    "local_rank": launch.local_rank,
    "world_size": launch.world_size,
    "launcher": launch.launcher,
    "local_rank_arg": args.local_rank,
    "host": socket.gethostname(),
    "pid": os.getpid(),
    "env": {k: os.environ[k] for k in ENV if k in os.environ},
    "indices": [],
}
original_iter = ResumableDistributedSampler.__iter__


def spying_iter(self):
    record.update(sampler_rank=self.rank, sampler_world=self.world)
    for item in original_iter(self):
        record["indices"].append(item[1])
        yield item


def dump() -> None:
    out = Path(args.output_dir) / "ranks"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{launch.rank}.json").write_text(json.dumps(record) + "\n")


ResumableDistributedSampler.__iter__ = spying_iter
atexit.register(dump)
sys.argv = [target, *argv]
sys.path.insert(0, str(Path(target).resolve().parent))  # as `python TARGET` would: its folder first
runpy.run_path(target, run_name="__main__")
