"""pytorch/examples' ``--multiprocessing-distributed``: one process per GPU of this node (``--nproc-per-node`` on
CPUs); as in main.py, ``--world-size`` and ``--rank`` count nodes."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch

from common.distributed import DistInfo, cleanup_distributed
from common.errors import UserError
from common.utils import PREEMPTED_EXIT_CODE


def _worker(local_rank: int, main: Callable, args: Any, nprocs: int, node_rank: int, world: int, url: str, errors):
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nprocs))  # CPU ranks share the cores
    try:
        main(args, DistInfo(node_rank * nprocs + local_rank, local_rank, world, launcher="mp.spawn", init_method=url))
    except UserError as e:
        errors.put(str(e))  # the parent prints each distinct error once
        sys.exit(2)
    finally:
        cleanup_distributed()


def spawn(main: Callable[[argparse.Namespace, DistInfo], None], args: argparse.Namespace, nprocs: int) -> None:
    """Run ``main(args, launch)`` in ``nprocs`` processes on this node; forward SIGTERM/SIGUSR2 to them."""
    import torch.multiprocessing as mp

    if "TORCHELASTIC_RUN_ID" in os.environ:
        raise UserError("--multiprocessing-distributed starts its own processes: drop it under torchrun")
    if args.dist_url == "env://":  # main.py reads the node count and node rank from the environment
        args.world_size = args.world_size if args.world_size > 0 else int(os.environ.get("WORLD_SIZE", 1))
        args.rank = args.rank if args.rank >= 0 else int(os.environ.get("RANK", 0))
    nodes, node_rank = max(args.world_size, 1), max(args.rank, 0)
    if nodes > 1 and (args.rank < 0 or not args.dist_url):
        raise UserError("several nodes need --dist-url tcp://NODE0_ADDR:PORT and --rank NODE_RANK on every node")
    if node_rank >= nodes:
        raise UserError(f"--rank {args.rank} is a node rank and must be below --world-size {nodes} (nodes)")
    if not args.dist_url:  # one node: any free local port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.dist_url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    errors = mp.get_context("spawn").SimpleQueue()
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # no "Terminating process" noise
    world = nodes * nprocs
    ctx = mp.spawn(_worker, args=(main, args, nprocs, node_rank, world, args.dist_url, errors), nprocs=nprocs,
                   join=False)  # fmt: skip

    def forward(signum, frame):  # preemption: every worker checkpoints at its next step and exits 75
        for proc in ctx.processes:
            if proc.is_alive():
                os.kill(proc.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGUSR2):
        signal.signal(sig, forward)
    try:
        while not ctx.join():
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        msgs = []
        while not errors.empty():
            msgs.append(errors.get())
        if msgs:
            raise UserError("\nerror: ".join(dict.fromkeys(msgs))) from None
        if isinstance(e, mp.ProcessRaisedException):
            raise  # a bug: shows the worker's traceback
        if e.exit_code != PREEMPTED_EXIT_CODE:  # 75: stopped after a checkpoint (rank 0 said so)
            print(f"{os.path.basename(sys.argv[0])}: {e}", file=sys.stderr, flush=True)  # e.g. killed by a signal
        sys.exit(e.exit_code if e.exit_code > 0 else 1)
