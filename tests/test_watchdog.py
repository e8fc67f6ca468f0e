"""The stall watchdog (common/hardening/watchdog.py) under real torchrun and gloo: a frozen DataLoader worker or a
frozen rank ends the run with every thread's stack and one error line; a healthy run with slow steps never trips it."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import PY, REPO, TORCHRUN, make_jpeg_imagefolder, popen, run

STALL_EXIT = "exitcode  : 124"  # torchrun's summary of the rank the watchdog ended


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_jpeg_imagefolder(tmp_path_factory.mktemp("d"), {"train": 40, "val": 8}, classes=4, size=64)


def torchrun_imagenet(data, out, *extra):
    """2 ranks of imagenet/train.py on real JPEGs: a small model, 64-pixel crops, 5 steps an epoch."""
    return [PY, TORCHRUN, "--standalone", "--nproc_per_node=2", "imagenet/train.py", str(data),
            "-a", "mobilenet_v3_small", "-b", "4", "--train-crop-size", "64", "--val-crop-size", "64",
            "--val-resize-size", "64", "-p", "1", "--output-dir", str(out), *extra]  # fmt: skip


def processes():
    """{pid: (parent pid, cmdline, environ)} of every process we may read."""
    found = {}
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue  # a zombie is dead
            found[int(d.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), (d / "cmdline").read_bytes(),
                                  (d / "environ").read_bytes().split(b"\0"))  # fmt: skip
        except (OSError, ValueError, IndexError):
            continue
    return found


def rank_process(launcher_pid, rank):
    """PID of train.py's rank `rank` (a child of torchrun; its DataLoader workers are its own children)."""
    procs = processes()
    return next(pid for pid, (ppid, cmd, env) in procs.items()
                if ppid == launcher_pid and b"train.py" in cmd and f"RANK={rank}".encode() in env)  # fmt: skip


def rank_process_alive(launcher_pid, rank):
    try:
        return rank_process(launcher_pid, rank) > 0
    except StopIteration:
        return False


def dataloader_workers(pid):
    """DataLoader workers of train.py's process `pid`: the children of its fork server (common/hardening/workers.py),
    or its own children where there is none."""
    procs = processes()
    children = [p for p, (ppid, cmd, _) in procs.items() if ppid == pid and b"resource_tracker" not in cmd]
    servers = [p for p in children if b"forkserver" in procs[p][1]]
    return [p for p, (ppid, _, _) in procs.items() if ppid in servers] or children


def wait_for_train_step(out, step, proc, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        try:
            lines = (out / "metrics.jsonl").read_text().splitlines()
            if any(r["split"] == "train" and r["step"] >= step for r in map(json.loads, lines[:-1])):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError("training did not start in time")


def kill_leftovers(proc, worker):
    """After a test, pass or fail: the launcher and a (stopped) worker must not outlive it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if worker in processes():
        os.kill(worker, signal.SIGKILL)


def communicate(proc, timeout):
    """proc's output once it and every process holding its stdout have ended; on a timeout, fail with the output
    so far and the processes still alive."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        alive = [f"{pid} (parent {ppid}): {cmd[:120]!r}" for pid, (ppid, cmd, _) in processes().items()
                 if b"train.py" in cmd or b"forkserver" in cmd or b"torchrun" in cmd]  # fmt: skip
        proc.kill()
        try:
            out = proc.communicate(timeout=5)[0]
        except subprocess.TimeoutExpired:
            out = "(the output pipe is still held open)"
        raise AssertionError(f"not ended after {timeout}s; still alive: {alive}\n{out[-3000:]}") from None


def assert_stalled(log, rank, what):
    """The watchdog's output: a header, every thread's stack (the main thread's included), one error line."""
    assert f"rank {rank}: no progress for " in log and "the stack of every thread follows" in log, log[-3000:]
    assert "Current thread" in log or "Thread 0x" in log, log[-3000:]  # faulthandler's stack dump
    assert 'File "' in log and "imagenet/train.py" in log
    error = [line for line in log.splitlines() if line.startswith(f"error: rank {rank} stalled: no progress for")]
    assert len(error) == 1 and what in error[0] and "a larger --stall-timeout than 2;" in error[0], log[-3000:]
    idle = int(re.search(r"no progress for (\d+)s", error[0]).group(1))
    assert 2 <= idle <= 2 + 3, error[0]  # fired at the timeout (give or take a poll on a busy machine)
    assert STALL_EXIT in log, log[-3000:]


def test_frozen_dataloader_worker_ends_the_run(data, tmp_path):
    """SIGSTOP rank 1's only DataLoader worker: rank 1 names the data loader, exits 124, and its worker dies too."""
    proc = popen(torchrun_imagenet(data, tmp_path, "-j", "1", "--epochs", "50", "--stall-timeout", "2"))
    worker = None
    try:
        wait_for_train_step(tmp_path, 2, proc)
        rank1 = rank_process(proc.pid, 1)
        (worker,) = dataloader_workers(rank1)
        os.kill(worker, signal.SIGSTOP)
        log = communicate(proc, 60)  # a worker left behind would hold the pipe open: a timeout
        assert proc.returncode != 0
        assert_stalled(log, 1, "waiting for the next training batch from the data loader")
        assert worker not in processes(), "the frozen DataLoader worker outlived its rank"
    finally:
        kill_leftovers(proc, worker)


@pytest.mark.parametrize("how", ["SIGKILL", "Ctrl-C"])
def test_a_killed_process_takes_its_stopped_dataloader_worker_along(how):
    """Whatever ends a rank (SIGKILL, where the watchdog cannot clean up; Ctrl-C, SIGINT to the whole process group,
    which the worker ignores, then the KeyboardInterrupt's exit with its loader still alive), its DataLoader workers
    die with it, even a stopped one, and so does their fork server: none is left holding the job's stdout open."""
    code = ("import sys, time, torch; sys.path.insert(0, sys.argv[1]); "
            "from common.hardening.workers import loader_args; "
            "dl = torch.utils.data.DataLoader(range(10**6), batch_size=1, num_workers=1, **loader_args()); "
            "it = iter(dl); next(it); print('ready', flush=True); time.sleep(300)")  # fmt: skip
    proc = popen([PY, "-c", code, str(REPO)], start_new_session=True)
    worker = None
    try:
        assert proc.stdout.readline().strip() == "ready"
        (worker,) = dataloader_workers(proc.pid)
        server = processes()[worker][0]
        os.kill(worker, signal.SIGSTOP)
        if how == "SIGKILL":
            os.kill(proc.pid, signal.SIGKILL)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        log = communicate(proc, 30)
        assert how == "SIGKILL" or "KeyboardInterrupt" in log, log
        deadline = time.time() + 10
        while (worker in processes() or server in processes()) and time.time() < deadline:
            time.sleep(0.05)
        assert worker not in processes() and server not in processes()
    finally:
        kill_leftovers(proc, worker)


class WorkerSignalMask(torch.utils.data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, i):
        return torch.tensor(sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))


def test_workers_are_born_with_the_stop_signals_blocked():
    """torch's worker loop installs its own SIGTERM handler before the worker's guard ignores the signal: a killpg in
    that window would end the worker. Workers inherit the fork server's mask instead, with SIGINT, SIGTERM and
    SIGUSR2 blocked (the guard ignores them without unblocking, so the mask seen here is the server's)."""
    from common.hardening.workers import loader_args

    loader = torch.utils.data.DataLoader(WorkerSignalMask(), num_workers=1, **loader_args())
    (mask,) = [set(b[0].tolist()) for b in loader]
    assert {signal.SIGINT, signal.SIGTERM, signal.SIGUSR2} <= mask, mask


def test_frozen_rank_ends_the_peer_waiting_in_the_all_reduce(data, tmp_path):
    """SIGSTOP rank 1: rank 0 waits in the gradient all-reduce (gloo, --dist-timeout 600) until its watchdog
    ends it after 2 s; torchrun then stops rank 1, which resumes only to find its peer gone."""
    proc = popen(torchrun_imagenet(data, tmp_path, "-j", "0", "--epochs", "50", "--stall-timeout", "2"))
    rank1 = None
    try:
        wait_for_train_step(tmp_path, 2, proc)
        rank1 = rank_process(proc.pid, 1)
        os.kill(rank1, signal.SIGSTOP)
        t0 = time.time()
        while rank_process_alive(proc.pid, 0) and time.time() - t0 < 40:
            time.sleep(0.1)
        assert time.time() - t0 < 30, "rank 0 did not end"
        os.kill(rank1, signal.SIGCONT)  # or torchrun would wait 30 s before it SIGKILLs the stopped rank
        log = communicate(proc, 60)
        assert proc.returncode != 0
        assert_stalled(log, 0, "in a training step (forward, backward with the gradient all-reduce")
    finally:
        if rank1 is not None and rank1 in processes():
            os.kill(rank1, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_healthy_run_with_slow_steps_never_fires(data, tmp_path):
    """--stall-timeout 1 on a run many times that long: steps of 0.1-0.7 s on 2 cores (the first one starts the
    DataLoader worker), two evaluations, a checkpoint every 2 steps. It finishes normally."""
    p = run(torchrun_imagenet(data, tmp_path, "-j", "1", "--epochs", "2", "--save-every-steps", "2",
                              "--stall-timeout", "1"), timeout=120, check=False)  # fmt: skip
    stalls = [line for line in p.stderr.splitlines() if "no progress for" in line]  # the output's tail may lack them
    assert p.returncode == 0 and not stalls, (p.returncode, stalls, p.stderr[-3000:])
    assert "done: step 10" in p.stdout and p.stdout.count(" val: ") == 2


def test_main_thread_holding_the_gil_still_ends():
    """After a first step, a C call that never releases the GIL starves the watchdog thread; faulthandler's C timer
    still dumps the stacks and exits (no torch: the watchdog needs the standard library only)."""
    code = ("import ctypes, sys, time; sys.path.insert(0, sys.argv[1]); from common.hardening.watchdog import Watchdog"
            "; w = Watchdog(1.0); list(w.batches(range(2))); time.sleep(0.6); ctypes.PyDLL(None).sleep(60)"
            )  # fmt: skip
    t0 = time.time()
    p = subprocess.run([PY, "-c", code, str(REPO)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and time.time() - t0 < 15, (p.returncode, p.stderr)
    assert "Timeout (0:00:01.250000)!" in p.stderr and 'File "<string>", line 1 in <module>' in p.stderr, p.stderr


def test_the_first_batch_of_an_evaluation_gets_the_first_steps_allowance():
    """An evaluation loader starts its workers when an evaluation asks for its first batch: that wait, like the
    first training step, gets FIRST_STEP_TIMEOUT, at every evaluation; a later batch as slow does not (timeout 0.5 s,
    the watchdog alone: no torch)."""
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from common.hardening.watchdog import Watchdog\n"
            "def slow(*waits):\n    for i, s in enumerate(waits):\n        time.sleep(s)\n        yield i\n"
            "w = Watchdog(0.5); list(w.batches(range(2)))\n"
            "for _ in range(2):\n    list(w.batches(slow(1.2), evaluating=True)); print('waited', flush=True)\n"
            "list(w.batches(slow(0, 1.2), evaluating=True)); print('second batch waited')")  # fmt: skip
    p = subprocess.run([PY, "-c", code, str(REPO)], capture_output=True, text=True, timeout=30)
    assert (p.returncode, p.stdout) == (124, "waited\nwaited\n"), (p.returncode, p.stdout, p.stderr)
    assert "no progress for 1s waiting for the next evaluation batch from the data loader" in p.stderr, p.stderr
