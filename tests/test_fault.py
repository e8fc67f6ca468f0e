"""Fault tolerance with real processes: preemption by SIGTERM and elastic restart after SIGKILL (the CIFAR script's,
also by SIGUSR2 and through torchrun, in test_cifar.py's resume test), dead or stuck peers never hang the survivors."""

import json
import os
import re
import signal
import socket
import subprocess
import time

import pytest
import torch

from common.hardening.checks import claim_output_dir, release_locks
from tests.conftest import (
    PY,
    REPO,
    assert_same_training_state,
    cifar_data,
    cifar_resume_cmd,
    descendants_with_rank,
    free_port,
    popen,
    preempt,
    restart_after_sigkill,
    run,
    run_records,
    torchrun,
    torchrun_cmd,
    transformer_corpus,
    transformer_ddp_cmd,
    transformer_reference,
    wait_for_step,
)

train_cmd = cifar_resume_cmd  # the run test_cifar.py resumes, preempts and restarts


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return cifar_data(tmp_path_factory)


def two_ranks_dist_url(data, out, timeout):
    port = free_port()
    procs = []
    for rank in (0, 1):
        cmd = [
            PY,
            *train_cmd(data, out),
            "--dist-url",
            f"tcp://127.0.0.1:{port}",
            "--world-size",
            "2",
            "--rank",
            str(rank),
            "--dist-timeout",
            str(timeout),
        ]
        procs.append(popen(cmd))
    return procs


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_dead_or_stuck_peer_never_hangs_the_survivor(data, tmp_path, sig):
    """No torchrun to clean up: rank 1 is killed (or frozen); rank 0 must exit within --dist-timeout."""
    r0, r1 = two_ranks_dist_url(data, tmp_path, timeout=10)
    try:
        wait_for_step(tmp_path, 2, r0)
        os.kill(r1.pid, sig)
        t0 = time.time()
        out, _ = r0.communicate(timeout=60)
        assert r0.returncode not in (0, None)
        assert time.time() - t0 < 40, "survivor took too long"
        # gloo names the cause: "Connection closed/reset by peer" (dead) or a timeout (frozen)
        assert "by peer" in out or "timed out" in out.lower() or "timeout" in out.lower(), out[-2000:]
    finally:
        for p in (r0, r1):
            if p.poll() is None:
                p.kill()
            p.wait()


# ------------------------------------------------------------------ the same guarantee for the other two scripts


def other_script_cmd(name, tmp_path_factory, out):
    if name == "imagenet":
        # a small model with dropout (the resume restores its random stream too); 14 steps an epoch, so that a signal
        # sent once step 4 is saved lands well before the run ends, on a loaded host too
        return ["imagenet/train.py", "--dummy", "--dummy-sizes", "112", "7", "-a", "mobilenet_v3_small", "-b", "4",
                "-j", "0", "--train-crop-size", "32", "--val-crop-size", "32", "--val-resize-size", "36",
                "--epochs", "2", "--save-every-steps", "2", "-p", "1", "--seed", "5",
                "--output-dir", str(out)]  # fmt: skip
    # the run test_transformer.py checks end to end, without its DataLoader worker: an exact resume does not depend
    # on -j either
    return transformer_ddp_cmd(transformer_corpus(tmp_path_factory), out, "-j", "0")


@pytest.fixture(scope="module")
def other_reference(tmp_path_factory):
    """name -> the uninterrupted run of that script, made once for both its restart and its preemption test (the
    transformer's also for test_transformer.py)."""
    refs = {}

    def get(name):
        if name not in refs:
            if name == "transformer":
                out = transformer_reference(tmp_path_factory)
            else:
                out = tmp_path_factory.mktemp(f"ref_{name}") / "ref"
                torchrun(2, *other_script_cmd(name, tmp_path_factory, out))
            refs[name] = {**torch.load(out / "last.pt", weights_only=True), "records": run_records(out)}
        return refs[name]

    return get


@pytest.mark.parametrize("name", ["imagenet", "transformer"])
def test_preemption_and_elastic_restart_other_scripts(name, other_reference, tmp_path, tmp_path_factory):
    """imagenet/ and transformer/: SIGTERM to one worker after the first checkpoint: every rank stops at the same
    step, rank 0 saves, exit 75. The same command continues under torchrun --max-restarts=1; SIGKILL a worker after
    its next checkpoint: the group restarts from last.pt and finishes, past an epoch end, bit-identical to an
    uninterrupted run (dropout included): weights, optimizer state, epoch and step, and metrics.jsonl. This is also
    the transformer's resume test (its uninterrupted run loads in a DataLoader worker, these in the main process)."""
    ref = other_reference(name)
    out = tmp_path / "run"
    cmd = other_script_cmd(name, tmp_path_factory, out)
    stopped, _ = preempt(cmd, out, at=4)
    assert 4 <= stopped < ref["step"]
    resumed = restart_after_sigkill(cmd, out, at=stopped + 1)
    assert len(resumed) == 2 and resumed[0] == stopped < resumed[1] <= ref["step"], resumed  # see the cifar test
    assert_same_training_state(ref, torch.load(out / "last.pt", weights_only=True))
    assert run_records(out) == ref["records"]  # each step and evaluation once, the same values


# ------------------------------------------------------------------ preemption with DataLoader workers


@pytest.mark.parametrize("launcher", ["torchrun", "process-group"])
def test_preemption_with_dataloader_workers(data, tmp_path, launcher):
    """SIGTERM reaches a rank's DataLoader worker and its fork server too: torchrun's agent forwards it to each
    rank's whole process group (os.killpg), as Slurm signals every process of a step, and timeout(1) or a shell
    signals a whole process group (here: one process, -j 1, in a session of its own). The workers ignore it, so
    the ranks stop at a step boundary, save, and exit 75; torchrun itself exits 1 (its SignalException). The rerun
    continues from the step they stopped at."""
    out = tmp_path / "run"
    cmd = train_cmd(data, out, gpu_data=False)  # -j 1
    if launcher == "torchrun":
        stopped, log = preempt(cmd, out, at=2, target="launcher")
        assert "SignalException" in log  # torchrun's own exit, code 1 (see preempt)
    else:
        proc = popen([PY, *cmd], start_new_session=True)
        wait_for_step(out, 2, proc)
        os.killpg(proc.pid, signal.SIGTERM)
        log, _ = proc.communicate(timeout=60)
        assert proc.returncode == 75, log[-3000:]
        stopped = torch.load(out / "last.pt", weights_only=True)["step"]
    assert f"stopped by SIGTERM at step {stopped}; checkpoint saved" in log, log[-3000:]
    assert "exited unexpectedly" not in log and "[rank" not in log.replace("[rank0]:[W", ""), log[-3000:]
    if launcher == "process-group":  # a rerun continues (after torchrun too: test_cifar.py's resume test)
        rerun = run([PY, *cmd, "--max-steps", str(stopped + 1)]).stdout
        assert re.search(rf"resumed from .*: epoch \d+, step {stopped},", rerun), rerun[-3000:]


@pytest.mark.parametrize("moment", ["0.3 s after the ranks appear", "the start line", "the first step"])
def test_preemption_at_any_moment_of_start_up(data, tmp_path, moment):
    """SIGTERM to torchrun (which forwards it to its ranks) while they start: before the script's first line (the
    interpreter importing torch), the signal's default action ends a rank, and nothing is lost; from then on, its
    handler ends it with the stop line and exit 75: at once before training asks for its first batch ("nothing to
    save"), else at the next step boundary, with a checkpoint. DataLoader workers start meanwhile (-j 1); no
    traceback from a rank. The same command then runs to the end."""
    out = tmp_path / "run"
    cmd = train_cmd(data, out, "--epochs", "2", gpu_data=False)
    proc = popen(torchrun_cmd(2, *cmd))
    seen = []
    if moment.endswith("appear"):
        while not (descendants_with_rank(proc.pid, 0) and descendants_with_rank(proc.pid, 1)):
            time.sleep(0.02)
        time.sleep(0.3)
    else:
        want = "resnet20 on 40 images" if moment == "the start line" else "step 1/"
        while not seen or want not in seen[-1]:
            seen.append(proc.stdout.readline())
            assert seen[-1], "".join(seen)[-3000:]
    proc.send_signal(signal.SIGTERM)
    log = "".join(seen) + proc.communicate(timeout=120)[0]
    ranks = log.split('File "' + str(REPO / "tests/helpers/torchrun.py"))[0]  # torchrun's own SignalException
    stops = [line for line in ranks.splitlines() if line.startswith("stopped by SIGTERM")]
    assert "Error" not in ranks.replace("SignalException", "") and "[rank" not in ranks, ranks[-3000:]
    assert proc.returncode == 1 and stops == [] if moment.endswith("appear") and not stops else len(stops) == 1, log
    if stops and "checkpoint saved" in stops[0]:
        assert (out / "last.pt").exists() and f"at step {torch.load(out / 'last.pt')['step']};" in stops[0], stops
    else:
        assert moment != "the first step" and stops in (
            [],
            ["stopped by SIGTERM before the first step; nothing to save, rerun the same command to continue (exit 75)"],
        )
    if moment == "the first step":  # the same command continues, as after any other moment
        assert "done: step 10" in run(torchrun_cmd(2, *cmd), timeout=300).stdout


# ------------------------------------------------------------------ one job per output dir, ranks never outlive it


def test_ranks_exit_with_their_killed_agent(data, tmp_path):
    """torchrun starts its ranks in sessions of their own: SIGKILL of the agent reaches none of them. Each rank sees
    its launcher gone and exits within a second or two with one line, its DataLoader worker with it (the pipe of the
    job's output closes), and the output directory is free for the next job."""
    out = tmp_path / "run"
    cmd = train_cmd(data, out, gpu_data=False)  # -j 1
    proc = popen(torchrun_cmd(2, *cmd))
    wait_for_step(out, 2, proc)
    os.kill(proc.pid, signal.SIGKILL)
    t0 = time.time()
    log, _ = proc.communicate(timeout=60)  # returns once every process holding its output is gone
    assert time.time() - t0 < 10, log[-3000:]
    for rank in (0, 1):
        line = f"error: rank {rank}: its launcher torchrun (pid {proc.pid}) is gone, so it exits too"
        assert line in log, log[-3000:]
    assert "Traceback" not in log and "done:" not in log, log[-3000:]
    claim_output_dir(out, is_main=True)  # the output dir is free: its lock died with rank 0
    release_locks()


STEPS_AFTER_THE_STORE = """
import argparse, os, time
from common import hardening
from common.args import add_shared_args
from common.distributed import cleanup_distributed, setup_distributed, stop_requested

p = argparse.ArgumentParser()
add_shared_args(p, "out", 1)
args = p.parse_args()
hardening.enable(args)
setup_distributed(args)
print("started", flush=True)
while not os.path.exists(os.path.join(args.output_dir, "go")):
    time.sleep(0.05)
print("steps:", [stop_requested(step) for step in (1, 2, 3)], flush=True)
cleanup_distributed()
"""


def test_steps_need_nothing_from_the_launchers_store(tmp_path):
    """The store a torchrun agent hosts goes with it, SIGKILLed or stopped. Whatever the ranks need from it (their
    groups: the default one and the stop's) they get during start-up, so at a step no store traffic can meet a
    store just gone and print torch's C++ frames. Here the test is the agent: it hosts the store, closes it once
    both ranks have started, and they step on."""
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "t", "TORCHELASTIC_RESTART_COUNT": "0",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}  # fmt: skip
    ranks = [subprocess.Popen([PY, "-c", STEPS_AFTER_THE_STORE, "--output-dir", str(tmp_path)], cwd=REPO, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in (0, 1)]  # fmt: skip
    try:
        for rank in ranks:
            assert rank.stdout.readline() == "started\n"
        del store
        (tmp_path / "go").touch()
        logs = [rank.communicate(timeout=60)[0] for rank in ranks]
        assert [rank.returncode for rank in ranks] == [0, 0] and logs == ["steps: [False, False, False]\n"] * 2, logs
    finally:
        for rank in ranks:
            rank.kill()


def marked(marker: str) -> list[int]:
    """The processes whose environment holds ``marker`` (NAME=VALUE): a job's launcher, ranks and workers."""
    found = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and marker.encode() in open(f"/proc/{d}/environ", "rb").read().split(b"\0"):
                found.append(int(d))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("delay", [0.3, 2.5])
def test_ranks_that_start_after_their_agent_died_exit_too(data, tmp_path, delay):
    """The agent SIGKILLed 0.3 or 2.5 s after its ranks appear, while they import torch, build the data or wait
    for the rendezvous (the default --dist-timeout, 600 s): every rank and DataLoader worker is gone within 30 s,
    whether it saw its launcher die or only found itself an orphan of init."""
    marker = f"AGENT_KILL_TEST={tmp_path.name}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AGENT_KILL_TEST": tmp_path.name}
    proc = subprocess.Popen(torchrun_cmd(2, *train_cmd(data, tmp_path / "run", gpu_data=False)), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        while not (descendants_with_rank(proc.pid, 0) and descendants_with_rank(proc.pid, 1)):
            assert proc.poll() is None
            time.sleep(0.02)
        time.sleep(delay)
        proc.kill()
        proc.wait()
        deadline = time.time() + 30
        while marked(marker) and time.time() < deadline:
            time.sleep(0.2)
        assert not marked(marker), "ranks outlived their agent"
    finally:
        for pid in marked(marker):
            os.kill(pid, signal.SIGKILL)


def test_a_second_job_on_a_busy_output_dir_is_refused(data, tmp_path):
    """Two jobs on one --output-dir: the second stops on every rank with one line naming the first one's host and
    rank 0's pid (the holder of <dir>/.lock), before it writes anything; the first goes on unharmed (here until
    SIGTERM: it saves and stops as usual, every step logged once)."""
    out = tmp_path / "run"
    first = popen(torchrun_cmd(2, *train_cmd(data, out, "--epochs", 1000)))
    try:
        wait_for_step(out, 2, first)
        (rank0,) = descendants_with_rank(first.pid, 0)
        second = run(torchrun_cmd(2, *train_cmd(data, out)), check=False)
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        log, _ = first.communicate(timeout=120)
    line = f"error: output dir {out} is in use by another job: host {socket.gethostname()}, pid {rank0} ("
    assert second.returncode != 0 and second.stderr.count(line) == 2, second.stderr[-3000:]
    assert "[rank" not in second.stdout + second.stderr, second.stderr[-3000:]  # no traceback from a rank
    stopped = torch.load(out / "last.pt", weights_only=True)["step"]
    assert f"stopped by SIGTERM at step {stopped}; checkpoint saved" in log, log[-3000:]
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, stopped + 1))
