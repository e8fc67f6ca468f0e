"""``setup_distributed(args)``: detect the launcher (torchrun, accelerate, Slurm, MPI, ``--dist-url`` or plain
``python``), init the process group, return a ``DistInfo``; ``cleanup_distributed()`` (in a ``finally``) undoes it."""

from __future__ import annotations

import argparse
import datetime
import gc
import multiprocessing
import multiprocessing.util
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from common.checks import check_dist_url, check_host_port
from common.errors import UserError

RDZV_HINT = (
    "is the master (rank 0) running and reachable, and the port open? check MASTER_ADDR, firewalls, "
    "NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME; debug with NCCL_DEBUG=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL"
)
STOP_SIGNALS = ("SIGTERM", "SIGUSR2")  # a rank stops on these at a step boundary; its DataLoader workers ignore them


@dataclass(frozen=True)
class DistInfo:  # detect_launcher fills what the launcher told; setup_distributed the device and backend
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    launcher: str = "single"
    backend: str | None = None
    init_method: str = ""  # "env://" or "tcp://host:port"; "" for one process

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def add_dist_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--dist-backend", default=None, help="nccl | gloo | ccl | xccl (default: nccl with CUDA, else gloo)")
    g.add_argument("--dist-url", default=None, help="init method, e.g. tcp://HOST:PORT (only without a launcher)")
    g.add_argument("--world-size", type=int, default=-1, help="number of processes (with --dist-url)")
    g.add_argument("--rank", type=int, default=-1, help="global rank of this process (with --dist-url)")
    # torch.distributed.launch passes --local-rank (torch>=2.0) or --local_rank (older)
    g.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument(
        "--dist-timeout", type=float, default=600.0, help="seconds before a stuck rendezvous or collective fails"
    )
    g.add_argument(
        "--stall-timeout",
        type=float,
        default=1200.0,  # longer than a healthy first step with torch.compile; twice --dist-timeout's default
        help="seconds without training progress before a rank dumps every thread's stack and exits with code 124 "
        "for the launcher to restart (0: off); the first step gets at least 1200 s in any case",
    )


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    """A launcher's variable as an int (``default``, if given, when unset), or one line naming it."""
    if default is not None and env.get(name, "") == "":
        return default
    try:
        return int(env[name])
    except ValueError:
        raise UserError(
            f"{name}={env[name]!r} is not an integer (launchers set it; unset it to run one process)"
        ) from None


def slurm_master_addr(env: Mapping[str, str]) -> str:
    """First host of the job's node list, expanded by ``scontrol show hostnames``."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return first_host(nodelist)


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list without scontrol: ``gpu[07-09,12],cpu1`` -> ``gpu07``."""
    prefix, first = re.match(r"([^,\[]*)(?:\[([^-,\]]*))?", nodelist).groups()
    return prefix + (first or "")


def detect_launcher(
    env: Mapping[str, str] | None = None,
    dist_url: str | None = None,
    world_size: int = -1,
    rank: int = -1,
    local_rank: int | None = None,
) -> DistInfo:
    """Rank, world size and rendezvous from the environment or --dist-url: the first of the cases below that fits."""
    env = os.environ if env is None else env
    # 1. torchrun / torch.distributed.launch / accelerate all export RANK and WORLD_SIZE
    if "RANK" in env and "WORLD_SIZE" in env:
        name = "env"
        if "TORCHELASTIC_RUN_ID" in env:
            name = "accelerate" if any(k.startswith("ACCELERATE_") for k in env) else "torchrun"
        lr = _int(env, "LOCAL_RANK", local_rank or 0)
        return DistInfo(_int(env, "RANK"), lr, _int(env, "WORLD_SIZE"), launcher=name, init_method="env://")
    master_port = env.get("MASTER_PORT")
    # 2. Slurm, one task per process. SLURM_STEP_NUM_TASKS exists only inside an srun step, so a plain `python` in
    # an sbatch script (where SLURM_NTASKS may be > 1) is not mistaken for a rank.
    slurm_n = _int(env, "SLURM_STEP_NUM_TASKS", 0)
    if "SLURM_PROCID" in env and slurm_n > 1:
        addr = env.get("MASTER_ADDR") or slurm_master_addr(env)
        port = master_port or str(15000 + _int(env, "SLURM_JOB_ID", 0) % 20000)
        rank, local_rank = _int(env, "SLURM_PROCID"), _int(env, "SLURM_LOCALID", 0)
        return DistInfo(rank, local_rank, slurm_n, launcher="slurm", init_method=f"tcp://{addr}:{port}")
    # 3. MPI: MPICH / Intel MPI hydra (PMI_*), Open MPI (OMPI_COMM_WORLD_*), MVAPICH2 (MV2_*)
    for r, s, lr in (
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),
    ):
        if r in env and s in env and _int(env, s) > 1:
            init = f"tcp://{env.get('MASTER_ADDR', '127.0.0.1')}:{master_port or 29500}"
            return DistInfo(_int(env, r), _int(env, lr, 0), _int(env, s), launcher="mpi", init_method=init)
    # 4. Explicit --dist-url/--world-size/--rank (the pytorch/examples style)
    if dist_url and world_size > 1:
        if rank < 0:
            raise UserError("--dist-url needs --rank (this process's global rank)")
        return DistInfo(rank, local_rank or 0, world_size, launcher="dist-url", init_method=dist_url)
    return DistInfo(0, local_rank or 0, 1)


def check_launch(launch: DistInfo, env: Mapping[str, str]) -> None:
    """Rank, world size and rendezvous address make sense and resolve: checked before any connection, so that a
    mistake is one line at once, not C++ frames after --dist-timeout."""
    src = {"dist-url": "--rank/--world-size", "slurm": "SLURM_PROCID/SLURM_STEP_NUM_TASKS", "mpi": "the MPI rank"}
    src = src.get(launch.launcher, "RANK/WORLD_SIZE")
    hint = "set by the launcher; unset RANK and WORLD_SIZE to run one process"
    if launch.world_size < 1:
        raise UserError(f"world size {launch.world_size} (from {src}) must be at least 1 ({hint})")
    if not 0 <= launch.rank < launch.world_size:
        raise UserError(
            f"rank {launch.rank} (from {src}) is out of range for world size {launch.world_size} "
            f"(ranks run 0..{launch.world_size - 1}; {hint})"
        )
    if launch.local_rank < 0:
        raise UserError(f"local rank {launch.local_rank} (LOCAL_RANK or --local-rank) must be 0 or more ({hint})")
    if launch.world_size == 1 and launch.launcher in ("single", "env", "torchrun", "accelerate"):
        return  # one process: no rendezvous (setup_distributed)
    if launch.init_method == "env://":
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(name):
                raise UserError(f"{name} is not set (world size {launch.world_size} needs the rank 0 host's "
                                "MASTER_ADDR and a free MASTER_PORT; torchrun sets both)")  # fmt: skip
        host_port = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        where = f"MASTER_ADDR:MASTER_PORT {host_port}"
    elif launch.init_method.startswith("tcp://"):
        host_port, where = launch.init_method[len("tcp://") :], f"rendezvous address {launch.init_method}"
    else:
        check_dist_url(launch.init_method)
        return
    check_host_port(host_port, where)
    host = host_port.rpartition(":")[0].strip("[]")
    try:
        socket.getaddrinfo(host, None)
    except OSError as e:
        raise UserError(
            f"{where}: cannot resolve host {host!r} ({e.strerror or e}; check MASTER_ADDR / --dist-url, "
            "and that every node can resolve it)"
        ) from None


def _pick_backend(requested: str | None, device: torch.device) -> str:
    backend = (requested or ("nccl" if device.type == "cuda" else "gloo")).lower()  # torch ignores the case
    if backend == "ccl":
        try:
            import oneccl_bindings_for_pytorch  # noqa: F401  (registers the "ccl" backend)
        except ImportError:
            raise UserError(
                "--dist-backend ccl needs Intel's oneCCL bindings (pip install oneccl_bind_pt, "
                "or source oneAPI's setvars.sh); use gloo on CPUs without it"
            ) from None
    if backend not in dist.Backend.backend_list:  # what this torch has built in or registered (ccl, above)
        names = ", ".join(b for b in dist.Backend.backend_list if b not in ("undefined", "fake"))
        raise UserError(f"--dist-backend {backend} is not a backend of this torch (use one of {names})")
    if backend == "nccl" and device.type != "cuda":
        raise UserError("--dist-backend nccl needs CUDA GPUs (use gloo on CPU)")
    return backend


def setup_distributed(args: argparse.Namespace, *, launch: DistInfo | None = None) -> DistInfo:
    """Init the process group for however we were launched. The CUDA device is set before the init, so that NCCL
    never puts two ranks on GPU 0."""
    launch = launch or detect_launcher(None, args.dist_url, args.world_size, args.rank, args.local_rank)
    check_launch(launch, os.environ)
    exit_with_launcher(launch)
    if torch.cuda.is_available() and args.dist_backend not in ("gloo", "ccl"):
        if launch.local_rank >= torch.cuda.device_count():
            raise UserError(
                f"local rank {launch.local_rank} but only {torch.cuda.device_count()} visible GPU(s) "
                "(more processes per node than GPUs? check --nproc-per-node and CUDA_VISIBLE_DEVICES)"
            )
        device = torch.device("cuda", launch.local_rank)
        torch.cuda.set_device(device)
    elif torch.xpu.is_available():
        device = torch.device("xpu", launch.local_rank)
        torch.xpu.set_device(device)
    else:
        device = torch.device("cpu")
    if launch.world_size == 1 and launch.launcher in ("single", "env", "torchrun", "accelerate"):
        return replace(launch, device=device)
    backend = _pick_backend(args.dist_backend, device)
    timeout = datetime.timedelta(seconds=args.dist_timeout)
    if launch.init_method.startswith("tcp://") and launch.rank != 0:
        _wait_for_master(launch.init_method, args.dist_timeout)
    try:
        store = _attempt_store(launch, timeout)
        dist.init_process_group(backend, init_method=None if store else launch.init_method, store=store,
                                rank=launch.rank, world_size=launch.world_size, timeout=timeout)  # fmt: skip
    except Exception as e:  # turn rendezvous failures into one actionable line
        msg = str(e)
        first = (msg.strip() or type(e).__name__).splitlines()[0][:200]
        where = launch.init_method
        if where == "env://":
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        if "EADDRINUSE" in msg or "address already in use" in msg.lower():
            raise UserError(
                f"port already in use at {where} (a stale job, e.g. after Ctrl-C? kill it or choose "
                "another MASTER_PORT / --dist-url port / --rdzv-endpoint)"
            ) from None
        if "timed out" in msg.lower() or "timeout" in msg.lower() or "connect" in msg.lower():
            raise UserError(
                f"rendezvous with {where} failed after {args.dist_timeout:.0f}s: {first} ({RDZV_HINT})"
            ) from None
        if isinstance(e, (RuntimeError, ValueError)):  # torch's C++ errors carry frames after their first line
            hint = "check the launcher's settings; debug with TORCH_DISTRIBUTED_DEBUG=DETAIL"
            raise UserError(f"cannot start the process group at {where}: {first} ({hint})") from None
        raise
    return replace(launch, device=device, backend=backend)


def _attempt_store(launch: DistInfo, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, a store whose keys are private to this restart attempt: the agent keeps one store across
    ``--max-restarts``, and a restarted rank would otherwise read a dead peer's address ("Connection refused")."""
    env = os.environ
    if launch.init_method != "env://" or "TORCHELASTIC_RESTART_COUNT" not in env:
        return None
    agent_hosts = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), launch.world_size,
                          is_master=not agent_hosts and launch.rank == 0, timeout=timeout)  # fmt: skip
    return dist.PrefixStore(f"attempt_{env['TORCHELASTIC_RESTART_COUNT']}", store)


def _wait_for_master(init_method: str, timeout_s: float) -> None:
    """Probe tcp://HOST:PORT until it answers: an unreachable master is one line, not torch's C++ warnings."""
    host, port = init_method[len("tcp://") :].rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise UserError(
                    f"rendezvous with {init_method} failed after {timeout_s:.0f}s: {e.strerror or e} ({RDZV_HINT})"
                ) from None
            time.sleep(0.5)


def exit_with_launcher(launch: DistInfo) -> None:
    """Under an elastic agent (torchrun, accelerate) or mp.spawn, end this rank within a second of its launcher's
    death: torchrun detaches its ranks (setsid), so ranks of a SIGKILLed agent would otherwise go on writing or wait
    forever. slurmstepd ends its tasks itself, and a plain ``python``'s parent may go without ending the job."""
    global _launcher
    if "TORCHELASTIC_RUN_ID" not in os.environ and launch.launcher != "mp.spawn":
        return
    _launcher = (launch, os.getppid())

    def watch() -> None:
        while True:
            time.sleep(0.5)
            _exit_if_launcher_gone()

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


_launcher: tuple[DistInfo, int] | None = None  # (how this rank was launched, the launcher's pid)
_exiting = threading.Lock()


def _exit_if_launcher_gone() -> None:
    """Also called by cleanup_distributed: a collective that failed because a peer's launcher died is this same
    event, told by one line rather than a traceback."""
    if _launcher is None or os.getppid() == _launcher[1]:
        return
    with _exiting:  # one line, whichever thread comes first; the other waits here for os._exit
        launch, parent = _launcher
        # straight to fd 2, and os._exit: the main thread may be blocked in C (a collective, the dead store)
        os.write(2, f"error: rank {launch.rank}: its launcher ({launch.launcher}, pid {parent}) is gone, so it "
                    "exits too (rerun the command to continue from the last checkpoint)\n".encode())  # fmt: skip
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # then quiet: the main thread's errors are this same event
        threading.Timer(2.0, os._exit, (1,)).start()  # in case a finalizer below blocks
        for child in multiprocessing.active_children():  # DataLoader workers, before their semaphores go
            child.kill()
        multiprocessing.util._run_finalizers(0)  # unlink the DataLoader's semaphores, as a normal exit does
        os._exit(1)


_AT_CLEANUP: list[Callable[[], None]] = []


def at_cleanup(fn: Callable[[], None]) -> None:
    """Have ``cleanup_distributed()`` call ``fn`` (e.g. to release the output directory's lock)."""
    _AT_CLEANUP.append(fn)


def cleanup_distributed() -> None:
    _exit_if_launcher_gone()
    while _AT_CLEANUP:
        _AT_CLEANUP.pop()()
    if is_dist():
        # a DDP model in a reference cycle holds its process group; freed at interpreter shutdown instead, Gloo's
        # threads abort the process ("terminate called without an active exception")
        gc.collect()
        dist.destroy_process_group()


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if is_dist():  # with NCCL, name this rank's GPU: torch otherwise warns that it guesses it
        dist.barrier(device_ids=[torch.cuda.current_device()] if dist.get_backend() == "nccl" else None)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks, in place."""
    if is_dist():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


@torch.no_grad()
def broadcast_buffers(module: torch.nn.Module) -> None:
    """Rank 0's buffers (BatchNorm statistics) on every rank: DDP broadcasts them only at a forward's start,
    so call before evaluating, or each rank evaluates its own model, not the checkpoint's."""
    if is_dist():
        for b in module.buffers():
            dist.broadcast(b, src=0)


def broadcast_object(obj: Any) -> Any:  # rank 0's object
    box = [obj]
    if is_dist():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def print0(*a: Any, **kw: Any) -> None:
    if not is_dist() or dist.get_rank() == 0:
        print(*a, **kw, flush=True)


def seed_everything(seed: int, rank: int = 0) -> None:
    s = seed + rank
    random.seed(s)
    torch.manual_seed(s)
    if "numpy" in sys.modules:  # never import numpy just for this
        sys.modules["numpy"].random.seed(s % 2**32)


def mix_seed(*parts: int) -> int:
    """A deterministic 63-bit seed from several integers (seed, epoch, index, ...)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) + 0x9E3779B97F4A7C15 + ((h << 6) & (2**64 - 1)) + (h >> 2))) & (2**64 - 1)
        h = (h * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    return h >> 1
