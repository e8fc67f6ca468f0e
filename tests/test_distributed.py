"""Launcher detection from fabricated environments, and one-line errors for rendezvous problems."""

import argparse
import socket
import sys
import time

import pytest

from common.distributed import detect_launcher
from common.errors import UserError
from common.hardening.launch import check_launch
from tests.conftest import free_port


def detect(env, dist_url=None, world_size=-1, rank=-1, local_rank=None):
    return detect_launcher(env, argparse.Namespace(dist_url=dist_url, world_size=world_size, rank=rank,
                                                   local_rank=local_rank))  # fmt: skip


def test_torchrun_env_wins_even_inside_slurm_and_mpi():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "TORCHELASTIC_RUN_ID": "x",
        "SLURM_PROCID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "PMI_RANK": "0",
        "PMI_SIZE": "2",
    }
    L = detect(env)
    assert (L.launcher, L.rank, L.local_rank, L.world_size, L.init_method) == ("torchrun", 3, 1, 8, "env://")


def test_legacy_launch_local_rank_from_argument():
    L = detect({"RANK": "1", "WORLD_SIZE": "2"}, local_rank=1)
    assert (L.launcher, L.rank, L.local_rank) == ("env", 1, 1)


def test_accelerate_detected():
    L = detect(
        {
            "RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "TORCHELASTIC_RUN_ID": "n",
            "ACCELERATE_MIXED_PRECISION": "no",
        }
    )
    assert L.launcher == "accelerate"


def test_slurm_tasks_with_port_from_job_id():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_NTASKS": "8",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "PATH": "/nonexistent",
    }
    L = detect(env)
    assert (L.launcher, L.rank, L.local_rank, L.world_size) == ("slurm", 5, 1, 8)
    assert L.init_method == f"tcp://gpu07:{15000 + 4242 % 20000}"
    L = detect({**env, "MASTER_PORT": "1234", "MASTER_ADDR": "head"})
    assert L.init_method == "tcp://head:1234"


def test_slurm_batch_script_without_srun_is_single_process():
    # `python train.py` inside an sbatch script: SLURM_NTASKS=4 but no srun step -> must not wait for 3 peers
    L = detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "1"})
    assert L.launcher == "single" and L.world_size == 1


@pytest.mark.parametrize(
    "env,expect",
    [
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MASTER_ADDR": "n0"}, (1, 1, 2, "tcp://n0:29500")),
        (
            {
                "OMPI_COMM_WORLD_RANK": "2",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                "MASTER_PORT": "2000",
            },
            (2, 0, 4, "tcp://127.0.0.1:2000"),
        ),
        (
            {"MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "1"},
            (3, 1, 4, "tcp://127.0.0.1:29500"),
        ),
    ],
)
def test_mpi_flavours(env, expect):
    L = detect(env)
    assert L.launcher == "mpi" and (L.rank, L.local_rank, L.world_size, L.init_method) == expect


def test_dist_url_and_single():
    L = detect({}, dist_url="tcp://h:1", world_size=2, rank=1)
    assert (L.launcher, L.rank, L.world_size, L.init_method) == ("dist-url", 1, 2, "tcp://h:1")
    args = argparse.Namespace(dist_url="tcp://h:1", world_size=2, rank=-1, local_rank=None)
    with pytest.raises(UserError, match="--dist-url needs --rank"):  # hardening's check, before any connection
        check_launch(detect_launcher({}, args), {})
    assert detect({}).launcher == "single"


@pytest.mark.parametrize("nodes,first", [("gpu[07-09,12],cpu1", "gpu07"), ("a1,a2", "a1"), ("solo", "solo")])
def test_first_host_of_nodelist(nodes, first):
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": nodes}
    assert detect(env).init_method == f"tcp://{first}:15001"


def rank_args(out, port: int, rank: int, timeout: int) -> list:
    """One rank of a 2-process --dist-url run of cifar_resnet/train.py (the other rank is never started)."""
    return ["cifar_resnet/train.py", "--synthetic", "--max-steps", "1", "-j", "0", "--output-dir", out,
            "--dist-url", f"tcp://127.0.0.1:{port}", "--world-size", "2", "--rank", str(rank),
            "--dist-timeout", str(timeout)]  # fmt: skip


def run_rank(monkeypatch, capsys, argv) -> tuple[int, str]:
    """The script's entry point in this process, as ``python cifar_resnet/train.py ARGS`` runs it: its exit code and
    stderr (the rendezvous fails before any collective, so nothing of it stays in this process)."""
    import cifar_resnet.train as train

    monkeypatch.setattr(sys, "argv", list(map(str, argv)))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.run_cli(train.main, train.get_args_parser().parse_args())
    return e.value.code, capsys.readouterr().err


def test_port_in_use_is_one_line_error(tmp_path, monkeypatch, capsys):
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        code, err = run_rank(monkeypatch, capsys, rank_args(tmp_path, port, rank=0, timeout=20))
    assert code == 2
    assert err.strip().startswith("error: port already in use"), err
    assert "Traceback" not in err


def test_unreachable_master_fails_within_timeout(tmp_path, monkeypatch, capsys):
    port = free_port()  # nobody listens there: rank 1 must give up after --dist-timeout
    t0 = time.time()
    code, err = run_rank(monkeypatch, capsys, rank_args(tmp_path, port, rank=1, timeout=5))
    assert code == 2 and time.time() - t0 < 60, err
    assert err.startswith("error: rendezvous with") and "Traceback" not in err, err
