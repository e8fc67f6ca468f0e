"""What makes a run survive faults and bad input, turned on by one call, ``hardening.enable(args)``, which checks
the command line and the launch and fills the core's seams (``common.distributed.SEAMS``). The core trains, resumes
and evaluates without it; common/README.md lists what each part adds."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

from common.distributed import SEAMS, DistInfo, detect_launcher

from . import checks, launch, preemption, watchdog, workers


def enable(args: argparse.Namespace, check: Callable[[argparse.Namespace], None] | None = None,
           writes: tuple[str, ...] = (), how: DistInfo | None = None) -> None:  # fmt: skip
    """Before setup_distributed: check ``args`` (the shared flags, the script's ``check``; ``writes``: its own files in
    --output-dir) and the launch (``how``: as setup_distributed will get it), and fill the core's seams."""
    sys.stdout.reconfigure(errors="backslashreplace")  # a path's bytes that are not UTF-8: \udcff, as on stderr
    checks.check_shared(args, writes)
    if check is not None:
        check(args)
    stop = preemption.Preemption()  # before the lock is taken: a signal from here on ends in the stop line
    SEAMS.at_cleanup.append(stop.at_cleanup)  # last: it may exit 75
    how = enable_launch(args, how, Path(args.output_dir))
    SEAMS.init_process_group = functools.partial(stop.start, SEAMS.init_process_group)
    dog = watchdog.Watchdog(args.stall_timeout, how.rank)
    SEAMS.batches, SEAMS.stop = functools.partial(stop.batches, dog.batches), stop.stop
    SEAMS.loader, SEAMS.explain = workers.loader_args, lambda e: launch.exit_if_launcher_gone() or checks.explain(e)
    SEAMS.at_cleanup[:0] = [dog.stop, checks.release_locks]


def enable_launch(args: argparse.Namespace, how: DistInfo | None = None, out: Path | None = None) -> DistInfo:
    """The launch's part of ``enable``, also for tools with no output dir (scripts/doctor.py): the launch checked,
    a rank that exits with its launcher, one-line rendezvous errors; ``out``: locked once the group is up."""
    launch.check_backend(args.dist_backend)
    launch.check_dist_url(args.dist_url)
    launch.check_env(os.environ)
    how = how or detect_launcher(os.environ, args)
    launch.check_launch(how, os.environ)
    launch.exit_with_launcher(how)
    claim = functools.partial(checks.claim_output_dir, out, how.rank == 0) if out is not None else None
    if claim is not None and how.world_size == 1:
        claim()
    SEAMS.init_process_group = functools.partial(launch.init_process_group, claim=claim)
    SEAMS.at_cleanup.append(launch.exit_if_launcher_gone)
    return how
