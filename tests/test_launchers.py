"""The scripts in scripts/ under the real launchers: torchrun (two c10d agents), torch.distributed.launch,
--dist-url processes, MPICH's mpiexec.hydra, Open MPI's mpirun and accelerate launch, on CPU with gloo.

Each run trains cifar_resnet/train.py's ResNet-20 for 2 steps on a tiny on-disk CIFAR-10 through
tests/helpers/spy_train.py, which records per rank what the launcher gave it and which samples the
training sampler really handed it. Every run must show: the right world size and launcher, ranks
0..N-1 once each, disjoint data shards, and a finished last.pt. Slurm is in test_slurm.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from common.data import ResumableDistributedSampler
from tests.conftest import PY, REPO, free_port, make_cifar_pickles, run

pytestmark = pytest.mark.slow
SPY = "tests/helpers/spy_train.py"
N_TRAIN = 64
ENV = {"PYTHON": PY, "OMP_NUM_THREADS": "1"}
SCRIPTS = sorted(str(p.relative_to(REPO)) for p in (REPO / "scripts").rglob("*.sh"))


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory) -> Path:
    return make_cifar_pickles(tmp_path_factory.mktemp("cifar"), n_train=N_TRAIN, n_test=16)


def train(out: Path, data: Path, steps: int = 2, *extra: str, arch: str = "resnet20") -> list[str]:
    """spy_train.py + cifar_resnet/train.py arguments: a launch script's TRAIN_SCRIPT [TRAIN_ARGS]."""
    return [
        SPY,
        "cifar_resnet/train.py",
        *("--data-dir", str(data), "-a", arch, "--max-steps", str(steps), "-b", "2", "-j", "0", "--epochs", "1"),
        *("--print-freq", "1", "--output-dir", str(out), *extra),
    ]


def check_run(out: Path, world: int, launcher: str, steps: int = 2) -> list[dict]:
    """One world of `world` ranks trained to the end, each rank on its own shard."""
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["world_size"], cfg["launcher"]) == (world, launcher), cfg
    ckpt = torch.load(out / "last.pt", weights_only=True, map_location="cpu")
    assert (ckpt["step"], ckpt["world_size"]) == (steps, world)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"][-1] == steps
    ranks = [json.loads(p.read_text()) for p in sorted((out / "ranks").glob("rank*.json"))]
    assert sorted(r["rank"] for r in ranks) == list(range(world)), ranks
    assert len({r["pid"] for r in ranks}) == world
    for r in ranks:
        assert (r["world_size"], r["launcher"]) == (world, launcher), r
        assert (r["sampler_rank"], r["sampler_world"]) == (r["rank"], world), r  # what training used
        shard = ResumableDistributedSampler(N_TRAIN, r["rank"], world, seed=0).indices()
        start = shard.index(r["indices"][0])  # 0, or where a resumed run skipped to
        assert r["indices"] == shard[start : start + len(r["indices"])], r
    shards = [set(r["indices"]) for r in ranks]
    assert sum(map(len, shards)) == len(set().union(*shards)), "two ranks read the same samples"
    return ranks


def run_together(cmds: list[list[str]], timeout: float = 180) -> list[str]:
    """Start several launcher invocations at once (as on several machines); all must succeed."""
    procs = [
        subprocess.Popen(c, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c in cmds
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for c, p, o in zip(cmds, procs, outs):
        assert p.returncode == 0, f"{' '.join(c)} exited {p.returncode}\n{o[-4000:]}"
    return outs


def _env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **ENV}


# ------------------------------------------------------------------ static checks


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    p = run(["shellcheck", "-x", *SCRIPTS], check=False)
    assert p.returncode == 0, p.stdout + p.stderr


def test_every_script_has_usage_and_strict_mode():
    for s in SCRIPTS:
        text = (REPO / s).read_text()
        if s.endswith(("lib.sh", "requeue.sh", "hostfile.sh")):  # sourced helpers
            continue
        assert "set -euo pipefail" in text and "Usage:" in text, s
        assert run(["bash", s, "--help"], env=ENV).stdout.count("Usage:") == 1, s


@pytest.mark.parametrize(
    "cmd",
    [
        ["scripts/local.sh"],
        ["scripts/torchrun_single_node.sh", "--nproc", "two", SPY],
        ["scripts/torchrun_multinode.sh", "--master", "127.0.0.1", SPY],  # no --nnodes
        ["scripts/launch_legacy.sh", "--nnodes", "2", "--node-rank", "2", SPY],
        ["scripts/spawn_dist_url.sh", "--bogus", SPY],
        ["scripts/spawn_dist_url.sh", "--nnodes", "2", SPY],  # several nodes need --dist-url
        ["scripts/accelerate_launch.sh", "--nproc", "0", SPY],
        ["scripts/slurm/sbatch_srun.sh", SPY],  # outside a Slurm job
        ["scripts/slurm/sbatch_torchrun.sh", SPY],
        ["scripts/slurm/helper.sh", "node0", "."],
        ["scripts/mpi/mpiexec_hydra.sh", "-f", "/nonexistent/hostfile", SPY],
        ["scripts/mpi/mpirun_openmpi.sh", "--ppn"],
        ["scripts/mpi/verify_hosts.sh", "--bogus"],
        ["scripts/ci/setup_slurm.sh", "--bogus"],
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_wrong_arguments_print_usage_and_fail(cmd):
    p = run(cmd, env=ENV, check=False, timeout=30)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Usage:" in p.stderr and "error:" in p.stderr, p.stderr


def test_missing_train_script_is_one_line():
    p = run(["scripts/torchrun_single_node.sh", "--nproc", "2", "no/such/train.py"], env=ENV, check=False)
    assert p.returncode == 1 and p.stderr.strip().startswith("error: train script no/such/train.py not found")


def test_port_in_use_says_so():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        for cmd in (
            ["scripts/torchrun_single_node.sh", "--port", str(port), SPY],
            ["scripts/launch_legacy.sh", "--master-port", str(port), SPY],
            ["scripts/spawn_dist_url.sh", "--dist-url", f"tcp://127.0.0.1:{port}", SPY],
        ):
            p = run(cmd, env=ENV, check=False, timeout=30)
            assert p.returncode == 1 and f"port {port} is already in use" in p.stderr, p.stderr
            assert "kill it" in p.stderr


# ------------------------------------------------------------------ real launchers


def test_torchrun_multinode_two_agents(tmp_path, cifar_dir):
    """scripts/torchrun_multinode.sh run twice, as on two machines: one world through the first's c10d store."""
    port = free_port()
    node = ["scripts/torchrun_multinode.sh", "--nnodes", "2", "--nproc-per-node", "1"]
    node += ["--master", f"127.0.0.1:{port}", "--rdzv-id", f"test{port}", "--rdzv-timeout", "60"]
    run_together([node + train(tmp_path, cifar_dir)] * 2)
    ranks = check_run(tmp_path, 2, "torchrun")
    assert all(r["local_rank"] == 0 for r in ranks)  # one process on each "node"


def test_launch_legacy_two_node_ranks(tmp_path, cifar_dir):
    common = ["--nnodes", "2", "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port"]
    common.append(str(free_port()))
    run_together([["scripts/launch_legacy.sh", *common, "--node_rank", r, *train(tmp_path, cifar_dir)] for r in "01"])
    ranks = check_run(tmp_path, 2, "torchrun")  # torch.distributed.launch is torchrun's agent underneath
    assert all(r["local_rank_arg"] == 0 for r in ranks), "torch.distributed.launch passes --local-rank"


def test_spawn_dist_url(tmp_path, cifar_dir):
    p = run(["scripts/spawn_dist_url.sh", "--nproc", "2", *train(tmp_path, cifar_dir)], env=ENV)
    assert re.search(r"--dist-url tcp://127\.0\.0\.1:\d+ --world-size 2 --rank", p.stderr)
    ranks = check_run(tmp_path, 2, "dist-url")
    assert sorted(r["local_rank"] for r in ranks) == [0, 1]


def test_spawn_dist_url_stops_the_others_when_one_fails(tmp_path, cifar_dir):
    """Rank 0 dies before the rendezvous: rank 1 must not wait out its 600 s timeout."""
    t0 = time.time()
    cmd = ["scripts/spawn_dist_url.sh", "--nproc", "2", *train(tmp_path, cifar_dir)]
    p = run(cmd, env={**ENV, "SPY_FAIL_RANK": "0"}, check=False, timeout=60)
    assert p.returncode == 3 and "stopping the others" in p.stderr and time.time() - t0 < 30, p.stderr


def test_spawn_dist_url_multiprocessing_distributed(tmp_path):
    """pytorch/examples' own mode: one python per node gets --world-size NODES --rank NODE and spawns its ranks."""
    script = REPO / "imagenet/train.py"
    if not script.exists() or "--multiprocessing-distributed" not in script.read_text():
        pytest.skip("imagenet/train.py with --multiprocessing-distributed is not in this checkout")
    cmd = ["scripts/spawn_dist_url.sh", "--nproc", "2", "--multiprocessing-distributed", "imagenet/train.py"]
    cmd += ["--dummy", "--dummy-sizes", "64", "8", "--train-crop-size", "32", "--val-resize-size", "32"]
    cmd += ["--val-crop-size", "32", "-a", "resnet18", "--max-steps", "2", "-b", "2", "-j", "0", "--epochs", "1"]
    p = run([*cmd, "--output-dir", str(tmp_path)], env=ENV, timeout=240)
    assert "--world-size 1 --rank 0 --multiprocessing-distributed --nproc-per-node 2" in p.stderr
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["world_size"], cfg["launcher"]) == (2, "mp.spawn")
    ckpt = torch.load(tmp_path / "last.pt", weights_only=True, map_location="cpu")
    assert (ckpt["step"], ckpt["world_size"]) == (2, 2)


def _need(tool: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed (scripts/ci/setup_system.sh installs it)")


def test_mpiexec_hydra_hostfile(tmp_path, cifar_dir):
    _need("mpiexec.hydra")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# the master first\nlocalhost:2\n")
    p = run(["scripts/mpi/verify_hosts.sh", "-f", str(hostfile)], env=ENV, timeout=60)
    assert p.stdout.splitlines()[0] == socket.gethostname() and "ok: 1 host(s) answered" in p.stdout
    env = {**ENV, "MASTER_PORT": str(free_port())}
    mpi = ["scripts/mpi/mpiexec_hydra.sh", "-f", str(hostfile), "--ppn", "2"]
    p = run([*mpi, *train(tmp_path / "run", cifar_dir)], env=env)
    assert "-genv MASTER_ADDR localhost" in p.stderr
    ranks = check_run(tmp_path / "run", 2, "mpi")
    assert sorted(r["env"]["PMI_RANK"] for r in ranks) == ["0", "1"]
    p = run([*mpi, "--dist-backend", "ccl", *train(tmp_path / "ccl", cifar_dir)], env=env, check=False)
    assert p.returncode == 1 and "needs Intel's oneCCL bindings" in p.stderr, p.stderr


def test_mpirun_openmpi(tmp_path, cifar_dir):
    _need("mpirun.openmpi")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    env = {**ENV, "MASTER_PORT": str(free_port()), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    cmd = ["scripts/mpi/mpirun_openmpi.sh", "--hostfile", str(hostfile), "--ppn", "2", *train(tmp_path, cifar_dir)]
    run(cmd, env=env)
    ranks = check_run(tmp_path, 2, "mpi")
    assert sorted(r["env"]["OMPI_COMM_WORLD_RANK"] for r in ranks) == ["0", "1"]


def test_accelerate_launch(tmp_path, cifar_dir):
    pytest.importorskip("accelerate", reason="accelerate is not installed (it is in requirements-dev.txt)")
    _need("accelerate")
    run(["scripts/accelerate_launch.sh", "--nproc", "2", *train(tmp_path, cifar_dir)], env=ENV)
    check_run(tmp_path, 2, "accelerate")


# ------------------------------------------------------------------ doctor


def test_doctor_single_process_through_local_sh():
    p = run(["scripts/local.sh", "-m", "scripts.doctor"], env=ENV)
    assert "launcher single: rank 0/1" in p.stdout and "no all_reduce to time" in p.stdout


def test_doctor_reports_bus_bandwidth_under_torchrun():
    p = run(
        ["scripts/torchrun_single_node.sh", "--nproc", "2", "-m", "scripts.doctor", "--size-mb", "4", "--iters", "5"],
        env=ENV,
    )
    assert f"torch {torch.__version__}" in p.stdout and "interfaces: " in p.stdout
    assert "launcher torchrun, backend gloo, world size 2" in p.stdout
    assert "rank 0/2" in p.stdout and "rank 1/2" in p.stdout
    m = re.search(r"algbw ([\d.]+) GB/s, busbw ([\d.]+) GB/s", p.stdout)
    assert m, p.stdout
    algbw, busbw = map(float, m.groups())
    assert busbw > 0 and busbw == pytest.approx(algbw * 2 * (2 - 1) / 2, rel=0.01)


def test_doctor_rendezvous_timeout_fails_in_time_with_hints():
    """Rank 0 alone: nobody joins, so it must give up after --dist-timeout, with the hints."""
    t0 = time.time()
    url = f"tcp://127.0.0.1:{free_port()}"
    p = run(
        [PY, "-m", "scripts.doctor", "--dist-url", url, "--world-size", "2", "--rank", "0", "--dist-timeout", "3"],
        check=False,
        timeout=60,
    )
    assert p.returncode == 2 and time.time() - t0 < 30
    err = p.stderr.strip().splitlines()[-1]
    assert (
        err.startswith("error: rendezvous with")
        and "NCCL_DEBUG=INFO" in err
        and "TORCH_DISTRIBUTED_DEBUG=DETAIL" in err
    )


def test_doctor_collective_timeout_fails_in_time_with_hints():
    """A rank that freezes mid-benchmark (SIGSTOP): the other fails within the timeout, naming the usual causes."""
    url = f"tcp://127.0.0.1:{free_port()}"
    cmd = [PY, "-m", "scripts.doctor", "--dist-url", url, "--world-size", "2", "--dist-timeout", "3"]
    cmd += ["--size-mb", "0.01", "--iters", "100000000", "--warmup", "0"]
    procs = [
        subprocess.Popen(
            [*cmd, "--rank", str(r)], cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    try:
        for line in procs[0].stdout:  # wait until the world formed and the timed loop started
            if line.startswith("timing all_reduce"):
                break
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.time()
        _, err = procs[0].communicate(timeout=60)
        assert procs[0].returncode == 2 and time.time() - t0 < 20, err
        assert "error: all_reduce failed" in err and "GLOO_SOCKET_IFNAME" in err and "NCCL_DEBUG=INFO" in err
    finally:
        for p in procs:
            p.kill()
            p.wait()
