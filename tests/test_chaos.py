"""Chaos: a fixed schedule of faults thrown at one 2-process CIFAR run (ResNet-20, a DataLoader worker per rank), each
followed by the same command again. The end equals an uninterrupted run bit for bit, and so does metrics.jsonl.
bench/chaos.py throws random faults of the same kinds at all three scripts."""

import os
import signal
import subprocess
import time

import torch

from tests.conftest import (
    PY,
    REPO,
    assert_same_training_state,
    cifar_data,
    cifar_loader_cmd,
    cifar_loader_reference,
    descendants_with_rank,
    popen,
    run_records,
    torchrun_cmd,
    wait_for_step,
)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def writing(out) -> list[str]:
    return [n for n in os.listdir(out) if n.startswith(".last.pt.") and n.endswith(".tmp")]


def kill_mid_write(out, pid: int) -> None:
    """SIGKILL ``pid`` while its checkpoint thread writes last.pt: stopped as soon as a temporary file shows, killed if
    that file is still there (the write not done), else resumed to try the next checkpoint."""
    deadline = time.time() + 60
    while time.time() < deadline:
        if writing(out):
            os.kill(pid, signal.SIGSTOP)
            if writing(out):
                os.kill(pid, signal.SIGKILL)
                return
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.001)
    raise AssertionError("no checkpoint write caught")


def holders(proc) -> tuple[list[int], str]:
    """Every process that holds the job's output pipe open, as ps shows it: what keeps a finished job from ending."""
    pipe = os.readlink(f"/proc/self/fd/{proc.stdout.fileno()}")
    pids = []
    for d in os.listdir("/proc"):
        try:
            if (
                d.isdigit()
                and int(d) != os.getpid()
                and pipe in {os.readlink(f"/proc/{d}/fd/{fd}") for fd in ("1", "2")}
            ):
                pids.append(d)
        except OSError:
            pass
    ps = subprocess.run(
        ["ps", "-o", "pid,ppid,pgid,stat,etime,args", "-p", ",".join(pids) or "1"], capture_output=True, text=True
    )
    return [int(p) for p in pids], ps.stdout


def communicate(proc, timeout: float, fault: str) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired as e:
        pids, held = holders(proc)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        raise AssertionError(
            f"{fault}: the job did not end; its output is held by\n{held}\n{(e.output or '')[-3000:]}"
        ) from None


def test_a_schedule_of_faults_ends_as_an_uninterrupted_run(tmp_path, tmp_path_factory):
    """SIGKILL of rank 1; SIGKILL of rank 0 in the middle of a checkpoint write (the temporary file it leaves is gone
    after the rerun); SIGKILL of the torchrun agent (the ranks exit by themselves); SIGTERM of the agent (the ranks
    save and exit 75); SIGTERM of the agent 1.5 s after the ranks appear (they start: nothing new to save); SIGSTOP
    then SIGCONT of rank 1 (the run finishes). Each fault but the start-up one follows a new checkpoint, so every
    rerun resumes mid-run. (A rerun of a finished run: test_cifar.py::test_final_evaluation_happens_once.)"""
    data, out = cifar_data(tmp_path_factory), tmp_path / "run"
    ref = cifar_loader_reference(tmp_path_factory)
    cmd = torchrun_cmd(2, *cifar_loader_cmd(data, out))
    step, left = 0, []
    faults = (
        "kill rank 1",
        "kill rank 0 mid-write",
        "kill agent",
        "term agent",
        "term agent at start-up",
        "stop rank 1",
    )
    for fault in faults:
        proc = popen(cmd)
        while fault.endswith("start-up") and not (
            descendants_with_rank(proc.pid, 0) and descendants_with_rank(proc.pid, 1)
        ):
            time.sleep(0.02)
        if not fault.endswith("start-up"):
            wait_for_step(out, step + 1, proc)
        assert not set(left) & set(writing(out)), "a temporary file of a killed write survived the rerun"
        ranks = [descendants_with_rank(proc.pid, r)[0] for r in (0, 1)]
        if fault == "term agent at start-up":
            time.sleep(1.5)
            os.kill(proc.pid, signal.SIGTERM)
        elif fault == "kill rank 1":
            os.kill(ranks[1], signal.SIGKILL)
        elif fault == "kill rank 0 mid-write":
            kill_mid_write(out, ranks[0])
            left = writing(out)
        elif fault == "kill agent":
            os.kill(proc.pid, signal.SIGKILL)
        elif fault == "term agent":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.kill(ranks[1], signal.SIGSTOP)
            time.sleep(2)
            os.kill(ranks[1], signal.SIGCONT)
        thrown = time.time()
        log = communicate(proc, 300, fault)  # the last leg trains to the end
        while any(map(alive, ranks)):  # no rank outlives its agent
            assert time.time() < thrown + 20, f"{fault}: ranks still running after the agent ended"
            time.sleep(0.1)
        # The job ends within seconds, not at the agent's SIGKILL 30 s later (a failed rank's DataLoader workers,
        # which ignore SIGTERM, must not hold its exit).
        assert fault == "stop rank 1" or time.time() < thrown + 20, (fault, log[-3000:])
        if fault == "term agent":
            assert "rerun the same command to continue (exit 75)" in log, log[-3000:]
        assert "[rank" not in log, (fault, log[-3000:])  # no traceback from a rank
        assert (proc.returncode == 0) == (fault == "stop rank 1"), (fault, proc.returncode, log[-3000:])
        step = torch.load(out / "last.pt", weights_only=True)["step"]
    a, b = (torch.load(d / "last.pt", weights_only=True) for d in (ref, out))
    assert_same_training_state(a, b)
    assert a["batch_in_epoch"] == b["batch_in_epoch"] and a["step"] == 60
    assert all(torch.equal(v, b["ema"][k]) for k, v in a["ema"].items())
    assert run_records(out) == run_records(ref)  # each step and evaluation once, the same values


RANK_DIES_WHILE_A_WORKER_STARTS = """
import functools, os, signal, sys, time
import torch
from common.data import loader_kwargs
from common.distributed import SEAMS
from common.hardening import workers
import slow_init

SEAMS.loader = workers.loader_args  # as hardening.enable() sets it
data = torch.utils.data.TensorDataset(torch.arange(8))
kw = loader_kwargs(1, 0, 0, torch.device("cpu"))
kw["worker_init_fn"] = functools.partial(slow_init.init, kw["worker_init_fn"])
batches = iter(torch.utils.data.DataLoader(data, **kw))
time.sleep(1.5)  # the worker is forked and sleeps in its init, before the guard
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_worker_whose_rank_dies_while_it_starts_exits_too(tmp_path):
    """The rank dies between a worker's fork and its guard (workers.guard, its worker_init_fn): the worker ends
    anyway, and so does the fork server, instead of waiting for the dead rank forever (holding the job's output
    open, so that whatever waits for the job's end hangs)."""
    (tmp_path / "slow_init.py").write_text("import time\n\ndef init(guard, i):\n    time.sleep(2)\n    guard(i)\n")
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{tmp_path}", "OMP_NUM_THREADS": "1", "CHAOS_MARKER": str(tmp_path)}
    proc = subprocess.run([PY, "-c", RANK_DIES_WHILE_A_WORKER_STARTS], cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    deadline = time.time() + 10  # the worker's init sleeps 2 s more
    while left := marked(f"CHAOS_MARKER={tmp_path}".encode()):
        assert time.time() < deadline, f"processes of the dead rank still running: {left}"
        time.sleep(0.2)


def marked(marker: bytes) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and marker in open(f"/proc/{d}/environ", "rb").read().split(b"\0") and alive(int(d)):
                found.append(int(d))
        except OSError:
            pass
    return found
