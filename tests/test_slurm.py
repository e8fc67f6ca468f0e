"""scripts/slurm/ on a real single-node Slurm cluster (slurmctld + slurmd + munged on this machine).

The module fixture starts the cluster with scripts/ci/setup_slurm.sh unless it already answers; if
the daemons cannot start here, every test in this file is skipped with the reason. Jobs train
cifar_resnet/train.py through tests/helpers/spy_train.py (see test_launchers.py for what is checked).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import PY, REPO, make_cifar_pickles, run
from tests.test_launchers import check_run, train

pytestmark = pytest.mark.slow
CONF = Path(os.environ.get("SLURM_CI_DIR", "/tmp/slurm-ci")) / "slurm.conf"
NAME = "pytest-launchers"  # every job here has this name; leftovers of an interrupted run are cancelled


@pytest.fixture(scope="module")
def slurm_env():
    env = {"SLURM_CONF": str(CONF), "PYTHON": PY, "OMP_NUM_THREADS": "1"}
    if run(["scripts/ci/setup_slurm.sh", "--status"], check=False, timeout=60).returncode != 0:
        p = run(["scripts/ci/setup_slurm.sh"], check=False, timeout=600)
        if p.returncode != 0:
            pytest.skip(f"no local Slurm cluster: scripts/ci/setup_slurm.sh failed: {(p.stderr + p.stdout)[-600:]}")
    run(["scancel", f"--name={NAME}"], env=env)
    yield env
    run(["scancel", f"--name={NAME}"], env=env)


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory) -> Path:
    return make_cifar_pickles(tmp_path_factory.mktemp("cifar"), n_train=64, n_test=16)


def sbatch(env: dict, log: Path, *args: str) -> str:
    cmd = ["sbatch", "--parsable", f"--job-name={NAME}", f"--output={log}", *args]
    return run(cmd, env=env).stdout.strip().split(";")[0]


def job(env: dict, job_id: str) -> dict[str, str]:
    out = run(["scontrol", "-o", "show", "job", job_id], env=env).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def wait_for(env: dict, job_id: str, done, timeout: float = 180) -> dict[str, str]:
    t0 = time.time()
    while time.time() - t0 < timeout:
        info = job(env, job_id)
        if done(info):
            return info
        time.sleep(0.3)
    subprocess.run(["scancel", job_id], env={**os.environ, **env})
    raise AssertionError(f"job {job_id} still {info.get('JobState')} ({info.get('Reason')}) after {timeout:.0f}s")


def finished(env: dict, job_id: str, log: Path, timeout: float = 180) -> str:
    info = wait_for(
        env,
        job_id,
        lambda i: i["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"),
        timeout,
    )
    text = log.read_text() if log.exists() else "(no log)"
    assert info["JobState"] == "COMPLETED", f"job {job_id} {info['JobState']} {info.get('ExitCode')}\n{text[-4000:]}"
    return text


def train_steps(out: Path) -> list[int]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["split"] == "train"]


@pytest.mark.parametrize(
    "script, sbatch_args, launcher, signal",
    [
        ("scripts/slurm/sbatch_srun.sh", ["--nodes=1", "--ntasks-per-node=2"], "slurm", ["--batch", "--signal=USR2"]),
        ("scripts/slurm/sbatch_torchrun.sh", ["--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=2"], "torchrun",
         ["--signal=TERM"]),
    ],
    ids=["srun-per-process", "srun-torchrun"],
)  # fmt: skip
def test_sbatch_preempted_requeues_and_resumes(slurm_env, tmp_path, cifar_dir, script, sbatch_args, launcher, signal):
    """Preempted with a DataLoader worker per task: SIGUSR2 to the batch script (what --signal=B:USR2@180 sends before
    the time limit), which signals every process of the step, workers included; or SIGTERM to every process of the
    step (torchrun, its ranks and their workers), after which torchrun exits 1 and the ranks 75: either way the tasks
    save and stop, the job requeues itself, and the second start continues from the checkpoint to the end."""
    env = {**slurm_env, "NPROC_PER_NODE": "2"}
    log, out = tmp_path / "job.log", tmp_path / "run"
    # ResNet-18: its steps last long enough for the signal to travel from scancel to the tasks before step 12
    job_id = sbatch(env, log, *sbatch_args, script, *train(out, cifar_dir, 12, "-j", "1", arch="resnet18"))
    t0 = time.time()
    while not (out / "metrics.jsonl").exists() or len(train_steps(out)) < 2:
        assert time.time() - t0 < 120 and job(env, job_id)["JobState"] in ("PENDING", "RUNNING"), log.read_text()
        time.sleep(0.2)
    run(["scancel", *signal, job_id], env=env)
    wait_for(env, job_id, lambda i: (i["JobState"], i["Restarts"], i["Reason"]) == ("PENDING", "1", "BeginTime"), 120)
    stopped_at = train_steps(out)[-1]
    assert 2 <= stopped_at < 12
    # Slurm holds a requeued job ~2 min (BeginTime); release it now. Not within the same second as the
    # requeue, or slurmd refuses the launch ("Job credential revoked").
    time.sleep(2)
    run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env)
    text = finished(env, job_id, log)
    assert f"stopped by SIGTERM at step {stopped_at}; checkpoint saved" in text and f"requeueing job {job_id}" in text
    assert ("SIGUSR2: asking the tasks" in text) == (launcher == "slurm")
    if launcher == "torchrun":
        assert "step exited with code 1" in text and "the tasks saved a checkpoint and stopped on a signal" in text
    assert f"job {job_id} (restart 1)" in text and f"resumed from {out / 'last.pt'}: epoch 0, step {stopped_at}" in text
    assert train_steps(out) == list(range(1, 13)), "the requeued run must continue, not start over"
    check_run(out, 2, launcher, steps=12)


def test_a_users_own_sbatch_script_from_the_docs_requeues(slurm_env, tmp_path, cifar_dir):
    """scripts/README.md's own sbatch script, as a user copies it (one node of 2 CPU processes here, and a tiny
    cifar run): SIGTERM to the tasks stops the ranks at a step with a checkpoint and the marker file, its last line
    requeues the job, and the second start resumes to the end. Without the marker (the ranks' at_cleanup not
    creating it) the job ends after the first start and the test fails."""
    text = (REPO / "scripts" / "README.md").read_text()
    script = text.split("**Preemption in your own sbatch script.**")[1].split("```bash\n")[1].split("```")[0]
    log, out, port = tmp_path / "job.log", tmp_path / "run", 15000 + os.getpid() % 20000
    cmd = " ".join([PY, *train(out, cifar_dir, 12, arch="resnet18")])  # -j 0: the workers' part is the test above
    for doc, here in ((" --gpus-per-node=8", ""), ("--nodes=2", "--nodes=1"), ("-per-task=64", "-per-task=2"),
                      ("--nproc-per-node=8", "--nproc-per-node=2"), (":29500", f":{port}"),
                      ("cifar_resnet/train.py --data-dir data/cifar10 -a resnet50 --output-dir runs/r50",
                       f"--no-python {cmd}")):  # one CPU node, a tiny run  # fmt: skip
        assert doc in script, doc
        script = script.replace(doc, here)
    (tmp_path / "job.sh").write_text(script)
    job_id = sbatch(slurm_env, log, f"--chdir={REPO}", str(tmp_path / "job.sh"))
    t0 = time.time()
    while not (out / "metrics.jsonl").exists() or len(train_steps(out)) < 2:
        assert time.time() - t0 < 120 and job(slurm_env, job_id)["JobState"] in ("PENDING", "RUNNING"), log.read_text()
        time.sleep(0.2)
    run(["scancel", "--signal=TERM", job_id], env=slurm_env)
    wait_for(slurm_env, job_id, lambda i: (i["JobState"], i["Restarts"]) == ("PENDING", "1"), 120)
    stopped_at = train_steps(out)[-1]
    time.sleep(2)  # as above: release the requeued job now, not within the second of its requeue
    run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=slurm_env)
    text = finished(slurm_env, job_id, log)
    assert f"stopped by SIGTERM at step {stopped_at}; checkpoint saved" in text, text[-3000:]
    assert f"resumed from {out / 'last.pt'}: epoch 0, step {stopped_at}" in text, text[-3000:]
    assert train_steps(out) == list(range(1, 13)) and not list(REPO.glob(f".preempted-{job_id}"))
    check_run(out, 2, "torchrun", steps=12)


def test_helper_sh_runs_torchrun_on_every_node(slurm_env, tmp_path, cifar_dir):
    """The Palmetto-style helper.sh under srun, one task per node: MASTER_HOST PROJECT_DIR NODES GPUS EPOCHS."""
    log, out = tmp_path / "job.log", tmp_path / "run"
    args = [socket.gethostname(), str(REPO), "1", "2", "1", *train(out, cifar_dir)]
    cmd = " ".join(["srun", "scripts/slurm/helper.sh", *args])
    job_id = sbatch(slurm_env, log, "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=2", f"--wrap={cmd}")
    text = finished(slurm_env, job_id, log)
    assert f"--rdzv-id={job_id}" in text
    check_run(out, 2, "torchrun")
    assert json.loads((out / "config.json").read_text())["epochs"] == 1  # EPOCHS reached the script


def test_launch_legacy_under_srun(slurm_env, tmp_path, cifar_dir):
    """launch_legacy.sh as one srun task per node: node rank from SLURM_NODEID, master from the node list."""
    log, out = tmp_path / "job.log", tmp_path / "run"
    cmd = " ".join(["srun", "scripts/launch_legacy.sh", "--nproc-per-node", "2", *train(out, cifar_dir)])
    job_id = sbatch(slurm_env, log, "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=2", f"--wrap={cmd}")
    text = finished(slurm_env, job_id, log)
    assert f"--node-rank=0 --nproc-per-node=2 --master-addr={socket.gethostname()}" in text
    check_run(out, 2, "torchrun")
