"""Run a command over and over and catch the rare run that stalls, with every process's stack.

    python bench/hang_loop.py --runs 300 --stall 60 --out runs/hang -- \
        torchrun --standalone --nproc_per_node=2 cifar_resnet/train.py ... --output-dir {dir}

Each run gets a fresh directory (``{dir}`` in the command; ``--prepare DIR`` is copied into it first, e.g. a
checkpoint to resume from). A run that writes nothing to stdout/stderr for ``--stall`` seconds is a stall: the
harness runs ``py-spy dump`` (Python and native frames) on every process of the run (the launcher, the ranks
and their DataLoader workers), saves the dumps and the run's output under ``--out/stall_<i>/``, kills the run
and goes on. ``--hog N`` keeps N busy-looping processes beside the runs, ``--jobs K`` runs K loops at once.
The last line gives the counts; the exit code is 1 if any run stalled or failed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """pid and every process below it (from /proc, no psutil)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def dump_stacks(pid: int, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for p in descendants(pid):
        try:
            cmdline = open(f"/proc/{p}/cmdline").read().replace("\0", " ")
        except OSError:
            continue
        with open(folder / f"pid{p}.txt", "w") as f:
            f.write(f"# {cmdline}\n")
            f.flush()
            # Python frames with locals, then native frames too (py-spy cannot unwind every native stack).
            for extra in (["--locals"], ["--native"]):
                try:
                    subprocess.run(["py-spy", "dump", *extra, "--pid", str(p)], stdout=f, stderr=f, timeout=120)
                except subprocess.TimeoutExpired:
                    f.write("(py-spy timed out)\n")
                f.flush()


def one_run(i: int, args: argparse.Namespace, tmp: Path) -> str:
    """Returns 'ok', 'failed' or 'stall'."""
    d = tmp / f"run{i}"
    shutil.rmtree(d, ignore_errors=True)
    if args.prepare:
        shutil.copytree(args.prepare, d)
    else:
        d.mkdir()
    cmd = [c.replace("{dir}", str(d)) for c in args.cmd]
    log = d / "output.log"
    with open(log, "wb") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        last_size, last_change = -1, time.monotonic()
        while p.poll() is None:
            time.sleep(1)
            size = log.stat().st_size
            if size != last_size:
                last_size, last_change = size, time.monotonic()
            elif time.monotonic() - last_change > args.stall:
                where = Path(args.out) / f"stall_{os.getpid()}_{i}"
                dump_stacks(p.pid, where)
                for pid in descendants(p.pid):  # launchers may put their workers in other process groups
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                p.wait()
                shutil.copy(log, where / "output.log")
                return "stall"
    if p.returncode != 0:
        where = Path(args.out) / f"failed_{os.getpid()}_{i}"
        where.mkdir(parents=True, exist_ok=True)
        shutil.copy(log, where / "output.log")
        return "failed"
    shutil.rmtree(d, ignore_errors=True)
    return "ok"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=300, help="runs per job")
    p.add_argument("--jobs", type=int, default=1, help="loops running at once")
    p.add_argument("--stall", type=float, default=60, help="seconds without output that make a stall")
    p.add_argument("--hog", type=int, default=0, help="busy-looping processes beside the runs")
    p.add_argument("--prepare", default=None, help="directory copied into each run's directory first")
    p.add_argument("--out", default="runs/hang_loop", help="where stalls and failures are saved")
    p.add_argument("--max-seconds", type=float, default=0, help="start no new run after this long (0: no limit)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command; {dir} is the run's directory")
    args = p.parse_args()
    args.cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not args.cmd:
        p.error("no command given")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hog)]
    counts = {"ok": 0, "failed": 0, "stall": 0}
    lock, t0 = threading.Lock(), time.monotonic()

    def loop(job: int) -> None:
        with tempfile.TemporaryDirectory(prefix="hang_loop_") as tmp:
            for i in range(args.runs):
                if args.max_seconds and time.monotonic() - t0 > args.max_seconds:
                    return
                r = one_run(job * args.runs + i, args, Path(tmp))
                with lock:
                    counts[r] += 1
                    print(f"[{time.monotonic() - t0:7.0f}s] job {job} run {i}: {r}  total {counts}", flush=True)

    try:
        threads = [threading.Thread(target=loop, args=(j,)) for j in range(args.jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for h in hogs:
            h.kill()
    print(f"runs {sum(counts.values())}: ok {counts['ok']}, failed {counts['failed']}, stalled {counts['stall']}")
    sys.exit(1 if counts["failed"] or counts["stall"] else 0)


if __name__ == "__main__":
    main()
