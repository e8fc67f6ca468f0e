"""[DDP 1] ``setup_distributed(args)``: the launcher, this rank's device, the process group; a few collectives."""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

# (launcher, rank, world size, local rank) variables; the first row of world size > 1 wins (torchrun's, at any size)
LAUNCHERS = [
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),  # also torch.distributed.launch and accelerate
    ("slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"),  # srun's tasks (an sbatch script is no step)
    ("mpi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),  # MPICH, Intel MPI
    ("mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),  # Open MPI
    ("mpi", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),  # MVAPICH2
]


@dataclass(frozen=True)
class DistInfo:  # who this process is, filled by setup_distributed
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    launcher: str = "single"
    backend: str | None = None
    init_method: str = ""  # env:// (torchrun: MASTER_ADDR, MASTER_PORT) or tcp://HOST:PORT

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def detect_launcher(env: Mapping[str, str], args: argparse.Namespace) -> DistInfo:
    """Rank, world size and rendezvous from the first row of LAUNCHERS that fits, else from --dist-url."""
    for name, rank, size, local in LAUNCHERS:
        if rank in env and size in env and (int(env[size]) > 1 or name == "torchrun"):
            if name == "torchrun":  # an elastic agent runs torchrun's ranks and accelerate's, not the legacy launch's
                accelerate = any(k.startswith("ACCELERATE_") for k in env)
                name = ("accelerate" if accelerate else name) if "TORCHELASTIC_RUN_ID" in env else "env"
                url = "env://"
            else:  # Slurm: the node list's first host (gpu07 of gpu[07-09,12]), a port from the job id; MPI: 29500
                nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
                first = re.match(r"([^,\[]*)(?:\[([^-,\]]*))?", nodes).groups()
                slurm = first[0] + (first[1] or ""), 15000 + int(env.get("SLURM_JOB_ID", 0)) % 20000
                host, port = slurm if name == "slurm" else ("127.0.0.1", 29500)
                url = f"tcp://{env.get('MASTER_ADDR') or host}:{env.get('MASTER_PORT') or port}"
            local_rank = int(env.get(local, args.local_rank or 0))
            return DistInfo(int(env[rank]), local_rank, int(env[size]), launcher=name, init_method=url)
    if (url := args.dist_url) and args.world_size > 1:  # pytorch/examples: --dist-url tcp://H:P --world-size N --rank R
        return DistInfo(args.rank, args.local_rank or 0, args.world_size, launcher="dist-url", init_method=url)
    return DistInfo(local_rank=args.local_rank or 0)


def setup_distributed(args: argparse.Namespace, launch: DistInfo | None = None) -> DistInfo:
    """Pin this rank's device first (NCCL must not put two ranks on GPU 0), then init the process group, if any."""
    launch = launch or detect_launcher(os.environ, args)
    kind = "cuda" if torch.cuda.is_available() else "xpu" if torch.xpu.is_available() else "cpu"
    device = torch.device("cpu")
    if kind != "cpu" and args.dist_backend != "gloo":
        device = torch.device(kind, launch.local_rank)
        getattr(torch, kind).set_device(device)
    if launch.world_size == 1:
        return replace(launch, device=device)
    backend = args.dist_backend or {"cuda": "nccl", "xpu": "xccl"}.get(device.type, "gloo")
    timeout = datetime.timedelta(seconds=args.dist_timeout)  # for the rendezvous and every collective
    SEAMS.init_process_group(backend, init_method=launch.init_method, rank=launch.rank,
                             world_size=launch.world_size, timeout=timeout)  # fmt: skip
    return replace(launch, device=device, backend=backend)


def cleanup_distributed() -> None:
    try:
        while SEAMS.at_cleanup:
            SEAMS.at_cleanup.pop(0)()
    finally:
        if dist.is_initialized():
            gc.collect()  # a DDP model in a reference cycle holds the group: freed at exit, gloo aborts the process
            dist.destroy_process_group()


@dataclass
class Seams:  # where common/hardening plugs in; a plain run leaves each as it is
    init_process_group: Callable[..., None] = dist.init_process_group  # hardening: a per-restart store, one-line errors
    batches: Callable[[Iterable, bool], Iterable] = lambda items, evaluating: items  # hardening: the stall watchdog
    stop: Callable[[int], bool] = lambda step: False  # hardening: True once every rank agrees to stop (preemption)
    loader: Callable[[], dict[str, Any]] = dict  # hardening: DataLoader workers that die with their rank
    explain: Callable[[Exception], str | None] = lambda e: None  # hardening: memory or disk that runs out, one line
    at_cleanup: list[Callable[[], None]] = field(default_factory=list)


SEAMS = Seams()


def watched(items: Iterable, evaluating: bool = False) -> Iterable:  # batches, seen by the stall watchdog if any
    return SEAMS.batches(items, evaluating)


def stop_requested(step: int) -> bool:  # once per step on every rank: True once the ranks agreed to stop (preemption)
    return SEAMS.stop(step)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:  # the sum over all ranks, in place
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj: Any) -> Any:  # rank 0's object, on every rank
    box = [obj]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def print0(*a: Any, **kw: Any) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, **kw, flush=True)


def mix_seed(*parts: int) -> int:
    """A deterministic 63-bit seed from several integers (seed, epoch, index, ...)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) + 0x9E3779B97F4A7C15 + ((h << 6) & (2**64 - 1)) + (h >> 2))) & (2**64 - 1)
        h = (h * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    return h >> 1
