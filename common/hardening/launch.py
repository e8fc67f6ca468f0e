"""Launches that fail fast, in one line (``check_launch``, ``init_process_group``: a store per torchrun restart
attempt, a probe of a tcp:// master), and ranks that never outlive their launcher (``exit_with_launcher``)."""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.util
import os
import socket
import threading
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

import torch.distributed as dist

from common.distributed import LAUNCHERS, DistInfo
from common.errors import UserError

RDZV_HINT = "is the master (rank 0) running and reachable, its port open? check MASTER_ADDR, firewalls, NCCL_"
RDZV_HINT += "SOCKET_IFNAME/GLOO_SOCKET_IFNAME; debug with NCCL_DEBUG=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL"


def check_env(env: Mapping[str, str]) -> None:
    """Every launcher variable that is set is an integer (else detect_launcher's int() is a traceback)."""
    names = {n for row in LAUNCHERS for n in row[1:]} | ({"SLURM_JOB_ID"} if "SLURM_PROCID" in env else set())
    for name in sorted(n for n in names if env.get(n, "") != ""):
        try:
            int(env[name])
        except ValueError:
            raise UserError(f"{name}={env[name]!r} is not an integer (launchers set it; unset it to run one "
                            "process)") from None  # fmt: skip


def check_launch(launch: DistInfo, env: Mapping[str, str]) -> None:
    """Rank, world size and rendezvous address make sense and resolve."""
    if launch.launcher == "dist-url" and launch.rank < 0:
        raise UserError("--dist-url needs --rank (this process's global rank)")
    src = {"dist-url": "--rank/--world-size", "slurm": "SLURM_PROCID/SLURM_STEP_NUM_TASKS", "mpi": "the MPI rank"}
    src = src.get(launch.launcher, "RANK/WORLD_SIZE")
    hint = "set by the launcher; unset RANK and WORLD_SIZE to run one process"
    if launch.world_size < 1:
        raise UserError(f"world size {launch.world_size} (from {src}) must be at least 1 ({hint})")
    if not 0 <= launch.rank < launch.world_size:
        raise UserError(f"rank {launch.rank} (from {src}) is out of range for world size {launch.world_size} "
                        f"(ranks run 0..{launch.world_size - 1}; {hint})")  # fmt: skip
    if launch.local_rank < 0:
        raise UserError(f"local rank {launch.local_rank} (LOCAL_RANK or --local-rank) must be 0 or more ({hint})")
    if launch.world_size == 1:
        return  # one process: no rendezvous
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
        return check_dist_url(launch.init_method)
    check_host_port(host_port, where)
    host = host_port.rpartition(":")[0].strip("[]")
    try:
        socket.getaddrinfo(host, None)
    except OSError as e:
        raise UserError(f"{where}: cannot resolve host {host!r} ({e.strerror or e}; check MASTER_ADDR / "
                        "--dist-url, and that every node can resolve it)") from None  # fmt: skip


def check_dist_url(url: str | None) -> None:
    """``--dist-url``: tcp://HOST:PORT, env:// or file:///PATH."""
    parts = urlsplit(url or "env://")  # None: the launcher's variables
    if parts.scheme not in ("tcp", "env", "file"):
        raise UserError(f"--dist-url {url} has an unknown scheme (use tcp://HOST:PORT, env:// or file:///shared/path)")
    if parts.scheme == "tcp":
        check_host_port(url[len("tcp://") :], f"--dist-url {url}")
    folder = os.path.dirname(parts.path)
    if parts.scheme == "file" and not os.path.isdir(folder):  # torch's FileStore would wait for it forever
        raise UserError(f"--dist-url {url} names a file in {folder}, which is not a directory (give a path on a "
                        "filesystem that every process shares)")  # fmt: skip


def check_host_port(host_port: str, where: str) -> None:
    host, _, port = host_port.rpartition(":")
    if not host.strip("[]"):
        raise UserError(f"{where} names no host (use tcp://HOST:PORT)")
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise UserError(f"{where} has no valid port (a number in 1..65535, e.g. tcp://{host}:29500)")


def check_backend(requested: str | None) -> None:
    """--dist-backend names a backend of this torch (ccl: once Intel's bindings have registered it)."""
    if requested is None:
        return
    backend = requested.lower()
    if backend == "ccl":
        try:
            import oneccl_bindings_for_pytorch  # noqa: F401  (registers the "ccl" backend)
        except ImportError:
            raise UserError("--dist-backend ccl needs Intel's oneCCL bindings (pip install oneccl_bind_pt, "
                            "or source oneAPI's setvars.sh); use gloo on CPUs without it") from None  # fmt: skip
    if backend not in dist.Backend.backend_list:
        names = ", ".join(b for b in dist.Backend.backend_list if b not in ("undefined", "fake"))
        raise UserError(f"--dist-backend {backend} is not a backend of this torch (use one of {names})")


def init_process_group(backend: str, *, init_method: str, rank: int, world_size: int, timeout, claim=None) -> None:
    """dist.init_process_group, as the core calls it, with what a restarted or failing launch needs; then
    ``claim()``: the output dir's lock, which rank 0 takes and tells the others about."""
    if backend == "nccl" and not __import__("torch").cuda.is_available():
        raise UserError("--dist-backend nccl needs CUDA GPUs (use gloo on CPU)")
    env = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    where = env if init_method == "env://" else init_method.removeprefix("tcp://")
    if rank != 0 and not init_method.startswith("file://"):  # a master that never answers: one line, no C++ frames
        _wait_for_master(where, timeout.total_seconds())
    try:
        store = _attempt_store(init_method, world_size, rank, timeout)
        dist.init_process_group(backend, init_method=None if store else init_method, store=store, rank=rank,
                                world_size=world_size, timeout=timeout)  # fmt: skip
    except Exception as e:  # a failed rendezvous: one actionable line, not C++ frames
        msg = str(e)
        first = (msg.strip() or type(e).__name__).splitlines()[0][:200]
        if "EADDRINUSE" in msg or "address already in use" in msg.lower():
            raise UserError(f"port already in use at {where} (a stale job, e.g. after Ctrl-C? kill it or choose "
                            "another MASTER_PORT / --dist-url port / --rdzv-endpoint)") from None  # fmt: skip
        if any(w in msg.lower() for w in ("timed out", "timeout", "connect")):
            raise UserError(f"rendezvous with {where} failed after {timeout.total_seconds():.0f}s: {first} "
                            f"({RDZV_HINT})") from None  # fmt: skip
        if isinstance(e, (RuntimeError, ValueError)):  # torch's C++ errors carry frames after their first line
            hint = "check the launcher's settings; debug with TORCH_DISTRIBUTED_DEBUG=DETAIL"
            raise UserError(f"cannot start the process group at {where}: {first} ({hint})") from None
        raise
    if claim is not None:
        claim()


def _attempt_store(init_method: str, world_size: int, rank: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, a store whose keys are private to this restart attempt: the agent keeps one store across
    ``--max-restarts``, and a restarted rank would otherwise read a dead peer's address ("Connection refused")."""
    env = os.environ
    if init_method != "env://" or "TORCHELASTIC_RESTART_COUNT" not in env:
        return None
    agent_hosts = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size,
                          is_master=not agent_hosts and rank == 0, timeout=timeout)  # fmt: skip
    return dist.PrefixStore(f"attempt_{env['TORCHELASTIC_RESTART_COUNT']}", store)


def _wait_for_master(where: str, timeout_s: float) -> None:
    """Probe HOST:PORT until it answers: an unreachable master is one line, not torch's C++ warnings."""
    host, port = where.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise UserError(f"rendezvous with {where} failed after {timeout_s:.0f}s: {e.strerror or e} "
                                f"({RDZV_HINT})") from None  # fmt: skip
            time.sleep(0.5)


_launcher: tuple[DistInfo, int] | None = None  # (how this rank was launched, the launcher's pid)
_exiting = threading.Lock()


def exit_with_launcher(launch: DistInfo) -> None:
    """Under an elastic agent (torchrun, accelerate) or mp.spawn, end this rank within a second of its launcher's
    death: torchrun detaches its ranks (setsid), so ranks of a SIGKILLed agent would otherwise go on writing or wait
    forever. slurmstepd ends its tasks itself, and a plain ``python``'s parent may go without ending the job."""
    global _launcher
    if "TORCHELASTIC_RUN_ID" not in os.environ and launch.launcher != "mp.spawn":
        return
    _launcher = (launch, os.getppid() if os.getppid() != 1 else -1)  # 1: it died already, this rank is init's
    exit_if_launcher_gone()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            exit_if_launcher_gone()

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def exit_if_launcher_gone() -> None:
    """Also called at cleanup: a collective that failed because a peer's launcher died is this same event, told by
    one line rather than a traceback."""
    if _launcher is None or os.getppid() == _launcher[1]:
        return
    with _exiting:  # one line, whichever thread comes first; the other waits here for os._exit
        launch, parent = _launcher
        gone = "was gone before it started" if parent == -1 else f"(pid {parent}) is gone"
        # straight to fd 2, and os._exit: the main thread may be blocked in C (a collective, the dead store)
        os.write(2, f"error: rank {launch.rank}: its launcher {launch.launcher} {gone}, so it exits too (rerun the "
                    "command to continue from the last checkpoint)\n".encode())  # fmt: skip
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # then quiet: the main thread's errors are this same event
        threading.Timer(2.0, os._exit, (1,)).start()  # in case a finalizer below blocks
        for child in multiprocessing.active_children():  # DataLoader workers, before their semaphores go
            child.kill()
        time.sleep(0.5)  # a worker the fork server is starting opens its semaphores first (it dies with the server)
        multiprocessing.util._run_finalizers(0)  # unlink the DataLoader's semaphores, as a normal exit does
        os._exit(1)
