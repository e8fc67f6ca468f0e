"""Environment doctor: what this process sees, and how fast all_reduce runs across the world.

    python -m scripts.doctor                                      # versions, GPUs, launcher, network
    torchrun --nproc_per_node=2 -m scripts.doctor                 # ... plus all_reduce bus bandwidth
    scripts/torchrun_multinode.sh --nnodes 2 --master node0 -m scripts.doctor --size-mb 256

It runs under every launcher the train scripts accept (srun, mpiexec.hydra, accelerate launch,
--dist-url ...). Bandwidth is reported as nccl-tests does: algbw = bytes / time, and
busbw = algbw * 2(n-1)/n, comparable across world sizes. A rendezvous or collective that does not
finish within --dist-timeout seconds ends the process with hints instead of hanging.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # find common/; also runs as `python scripts/doctor.py`
from common.args import ABOVE_0, COUNT, POSITIVE, add_dist_args
from common.distributed import DistInfo, setup_distributed
from common.errors import UserError, run_cli
from common.hardening import enable_launch

HINTS = (
    "are all ranks started and MASTER_ADDR reachable from every node with its port open (firewall)? "
    "pin the network interface with NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME (see the interfaces above); "
    "rerun with NCCL_DEBUG=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL"
)
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED", "MASTER_", "CUDA_VISIBLE", "OMP_NUM")


def ipv4(name: str) -> str:
    """The IPv4 address of a network interface (Linux), or '-'."""
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack("256s", name[:15].encode())
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
    except (ImportError, OSError):
        return "-"


def report_local() -> list[str]:
    """Versions, GPUs, network interfaces and distributed settings of this machine."""
    cuda = torch.cuda.is_available()
    try:  # the NCCL that torch was built with; readable without a GPU
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "-"
    except (AttributeError, RuntimeError):
        nccl = "-"
    lines = [
        f"torch {torch.__version__} | CUDA {torch.version.cuda or '-'} | NCCL {nccl} | python {sys.version.split()[0]}",
        f"backends available: gloo={dist.is_gloo_available()} nccl={dist.is_nccl_available()} "
        f"mpi={dist.is_mpi_available()}",
    ]
    for i in range(torch.cuda.device_count() if cuda else 0):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
    if not cuda:
        lines.append("GPUs: none visible (CPU only: use the gloo backend)")
    host = socket.gethostname()
    try:
        resolved = socket.gethostbyname(host)
    except OSError as e:
        resolved = f"does not resolve ({e})"
    lines.append(f"host {host} -> {resolved}")
    ifaces = [f"{name} {ipv4(name)}" for _, name in socket.if_nameindex()]
    lines.append("interfaces: " + ", ".join(ifaces))
    env = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(ENV_PREFIXES))
    lines.append("settings: " + (" ".join(env) if env else "none of NCCL_*/GLOO_*/TORCH_*/MASTER_* set"))
    return lines


@contextlib.contextmanager
def watchdog(seconds: float, what: str) -> Iterator[None]:
    """Exit with hints if the block is still running after `seconds` (backends may block in C++)."""

    def fire() -> None:
        print(f"error: {what} did not finish within {seconds:.0f}s ({HINTS})", file=sys.stderr, flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:  # also when the block raises: a timer left running would end whatever process imported this module
        timer.cancel()
        timer.join()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_all_reduce(info: DistInfo, size_mb: float, iters: int, warmup: int) -> tuple[float, float, float]:
    """(seconds per all_reduce, algbw GB/s, busbw GB/s); time is the slowest rank's."""
    n = info.world_size
    check = torch.full((4,), float(info.rank + 1), device=info.device)
    dist.all_reduce(check)  # correctness first: sum of 1..n on every rank
    if not torch.all(check == n * (n + 1) / 2):
        raise RuntimeError(f"all_reduce returned {check.tolist()}, expected {n * (n + 1) / 2}")
    x = torch.zeros(max(1, int(size_mb * 2**20) // 4), dtype=torch.float32, device=info.device)
    for _ in range(warmup):
        dist.all_reduce(x)
    sync(info.device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    sync(info.device)
    dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=info.device)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    seconds = dt.item()
    algbw = x.numel() * x.element_size() / seconds / 1e9
    return seconds, algbw, algbw * 2 * (n - 1) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=ABOVE_0, default=64.0, help="all_reduce message size in MiB")
    p.add_argument("--iters", type=POSITIVE, default=20, help="timed all_reduce calls")
    p.add_argument("--warmup", type=COUNT, default=5, help="untimed calls first")
    add_dist_args(p)
    p.set_defaults(dist_timeout=60.0)
    args = p.parse_args()
    launch = enable_launch(args)  # the launch's checks: one line for a bad launcher variable or address
    if launch.local_rank == 0:  # once per node: interfaces and settings differ between nodes
        print("\n".join(report_local()), flush=True)
    with watchdog(args.dist_timeout + 10, f"rendezvous at {launch.init_method or 'env://'}"):
        info = setup_distributed(args, launch=launch)
    me = f"rank {info.rank}/{info.world_size} local_rank {info.local_rank} on {socket.gethostname()} ({info.device})"
    if info.world_size == 1:
        print(f"launcher {info.launcher}: {me}; one process, so no all_reduce to time (start it with 2+)")
        return
    with watchdog(args.dist_timeout + 10, "all_reduce"):
        try:
            ranks: list[str | None] = [None] * info.world_size
            dist.all_gather_object(ranks, me)
            if info.is_main:
                print(f"launcher {info.launcher}, backend {info.backend}, world size {info.world_size}:")
                print("\n".join(f"  {r}" for r in ranks))
                print(f"timing all_reduce of {args.size_mb:g} MiB float32, {args.iters} iterations ...", flush=True)
            seconds, algbw, busbw = bench_all_reduce(info, args.size_mb, args.iters, args.warmup)
        except (RuntimeError, dist.DistError) as e:  # gloo raises on its timeout; NCCL is caught by the watchdog
            raise UserError(f"all_reduce failed: {str(e).splitlines()[0][:200]} ({HINTS})") from None
    if info.is_main:
        print(
            f"all_reduce {args.size_mb:g} MiB: {seconds * 1e6:.0f} us, algbw {algbw:.3f} GB/s, busbw {busbw:.3f} GB/s",
            flush=True,
        )


if __name__ == "__main__":
    run_cli(main)
