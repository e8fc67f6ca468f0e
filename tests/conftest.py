"""Shared test helpers: free ports, tiny on-disk datasets in real formats, subprocess runners."""

from __future__ import annotations

import getpass
import json
import os
import pickle
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Runs in this process (a script's entry point called by a test) use one thread, like every subprocess (run() sets
# OMP_NUM_THREADS=1): two pytest workers share the cores, and threads that wait for a busy core only burn CPU. Set
# before numpy or torch start their thread pools.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
import torch

# Inductor's cache does not tell CPU kernel levels apart: code compiled under one ATEN_CPU_CAPABILITY and loaded under
# another crashes (heap corruption, failed index checks). One cache per level, for this process and its children.
CPU_LEVEL = torch.backends.cpu.get_cpu_capability().lower()
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{CPU_LEVEL}")
)

REPO = Path(__file__).resolve().parent.parent
# Each script imports the modules beside it by name (as `python cifar_resnet/train.py` finds them), and common/ from
# the folder above: in this process too. No two scripts' modules share a name, except train.py.
sys.path[:0] = [str(REPO / d) for d in ("cifar_resnet", "imagenet", "transformer")] + [str(REPO)]
PY = sys.executable
TORCHRUN = str(REPO / "tests/helpers/torchrun.py")


# `pytest -n auto` (pytest-xdist, --dist loadgroup set below) hands out groups of tests, one per free worker, slowest
# first so that none is left running alone at the end (--no-loadscope-reorder keeps this order: xdist would otherwise
# hand out the groups with the most tests first). A group is a file, so that a module's fixtures run once, except
# test_fault.py: its other-script runs are one group, its peer-failure tests go one by one. An uninterrupted reference
# run that tests in several files compare with (see shared) is made by whichever group needs it first; a group that
# needs it meanwhile waits.
SLOWEST_FIRST = ["test_cifar.py", "test_imagenet.py", "test_launchers.py", "test_transformer.py", "test_chaos.py",
                 "test_fsdp.py", "test_slurm.py",
                 "test_fault.py::other", "test_docs.py", "test_wandb.py", "test_watchdog.py", "test_bench.py",
                 "test_ddp.py", "test_checkpoint.py"]  # fmt: skip


def group(item) -> str:
    name = item.path.name
    if name != "test_fault.py":
        return name
    return name + "::other" if "other_reference" in item.fixturenames else item.nodeid


def pytest_configure(config):
    """With -n N: --dist loadgroup --no-loadscope-reorder, set here rather than in addopts so that pytest without
    pytest-xdist (or with -p no:xdist) runs a file as usual. A worker parses only the command line, so it learns
    from the controller that it must name each test's group in the test's id."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    if hasattr(config, "workerinput"):
        config.option.loadgroup = config.workerinput["loadgroup"]
    elif config.getoption("dist") == "load":
        config.option.dist, config.option.loadscopereorder = "loadgroup", False


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, in the controller, for each worker it starts
def pytest_configure_node(node):
    node.workerinput["loadgroup"] = node.config.getoption("dist") == "loadgroup"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            item.add_marker(pytest.mark.xdist_group(group(item)))
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(group(item), len(rank)))  # stable: each group keeps its own order


def free_port() -> int:
    """A free port picked at random above the kernel's ephemeral range (32768-60999 by default): neither a client
    socket nor another test's pick is likely to take it before the rank that binds it."""
    while True:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port := random.SystemRandom().randint(61000, 65000)))
                return port
            except OSError:
                continue


def run(cmd: list[str], timeout: float = 300, env: dict | None = None, cwd: Path | str = REPO, check: bool = True):
    """Run a command, return CompletedProcess; on failure show its output in the assertion."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    p = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} exited {p.returncode}\n"
            f"--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}"
        )
    return p


def run_parallel(cmds: list[list], env: dict | None = None, timeout: float = 240) -> list[subprocess.Popen]:
    """Start all commands at once (they mostly wait on imports), wait for all; returns them with .out/.err."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    pipe = subprocess.PIPE
    procs = [subprocess.Popen(c, cwd=REPO, env=full_env, stdout=pipe, stderr=pipe, text=True) for c in cmds]
    for p in procs:
        p.out, p.err = p.communicate(timeout=timeout)
    return procs


def torchrun_cmd(nproc: int, *args, restarts: int = 0) -> list[str]:
    """The command line of `torchrun --standalone --nproc_per_node=N [--max-restarts=R] args...`: the real launcher
    (tests/helpers/torchrun.py runs its entry point with the GC off while torch imports)."""
    elastic = [f"--max-restarts={restarts}"] if restarts else []
    return [PY, TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *elastic, *map(str, args)]


def torchrun(nproc: int, *args: str, **kw):
    """`torchrun --standalone --nproc_per_node=N args...` (the real launcher)."""
    return run(torchrun_cmd(nproc, *args), **kw)


# ------------------------------------------------------------------ fault injection into a running torchrun job


def descendants_with_rank(root_pid, rank):
    """PIDs of train.py workers under root_pid whose environment says RANK=rank."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            env = (d / "environ").read_bytes().split(b"\0")
            pid, ppids = int(d.name), []
            p = pid
            while p > 1:
                p = int((Path("/proc") / str(p) / "stat").read_text().rsplit(")", 1)[1].split()[1])
                ppids.append(p)
        except (OSError, ValueError, IndexError):
            continue
        if b"train.py" in cmd and f"RANK={rank}".encode() in env and root_pid in ppids:
            found.append(pid)
    return found


def wait_for_step(out, step, proc, timeout=120):
    """Until out/last.pt holds step >= ``step``. Each checkpoint is renamed into place whole, so a new one is a new
    inode: only then is it read, memory-mapped (its step, not its ~100 MB of tensors), so that the poll takes no CPU
    from the training processes while they run."""
    deadline, seen = time.time() + timeout, None
    while time.time() < deadline:
        assert proc.poll() is None, "training ended before the fault could be injected"
        try:
            st = os.stat(out / "last.pt")
            if (st.st_ino, st.st_mtime_ns) != seen:
                seen = (st.st_ino, st.st_mtime_ns)
                if torch.load(out / "last.pt", weights_only=True, mmap=True)["step"] >= step:
                    return
        except (OSError, RuntimeError, EOFError):
            seen = None
        time.sleep(0.05)
    raise AssertionError("no checkpoint in time")


def popen(cmd, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def preempt(cmd, out, at, target="worker", sig=signal.SIGTERM) -> tuple[int, str]:
    """torchrun on cmd; once last.pt holds step >= at, send sig to rank 1 (or to the launcher, which forwards it):
    every rank stops at the same step, rank 0 saves, exit 75. Returns the step of the checkpoint it saved, and the
    log."""
    proc = popen(torchrun_cmd(2, *cmd))
    wait_for_step(out, at, proc)
    os.kill(proc.pid if target == "launcher" else descendants_with_rank(proc.pid, 1)[0], sig)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "rerun the same command to continue (exit 75)" in log, log[-3000:]
    assert "exitcode  : 75" in log or "exitcode: 75" in log.replace(" ", "") or target == "launcher", log[-3000:]
    return torch.load(out / "last.pt", weights_only=True)["step"], log


def restart_after_sigkill(cmd, out, at, restarts=1) -> list[int]:
    """torchrun --max-restarts on cmd; once last.pt holds step >= at, SIGKILL rank 1: the group restarts from last.pt
    and finishes. Returns the steps rank 0 said it resumed from, in order."""
    proc = popen(torchrun_cmd(2, *cmd, restarts=restarts))
    wait_for_step(out, at, proc)
    os.kill(descendants_with_rank(proc.pid, 1)[0], signal.SIGKILL)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-3000:]
    return [int(s) for s in re.findall(r"resumed from .*: epoch \d+, step (\d+),", log)]


def assert_same_training_state(ref: dict, got: dict) -> None:
    """Two checkpoints hold the same training state, bit for bit: the position (step, epoch, batch, records logged),
    weights, every optimizer state tensor (Adam's moments, SGD's momentum) and the LR of its param groups, the
    gradient scaler's state. (The LR schedule is a function of the step: no state.)"""
    position = ("step", "epoch", "batch_in_epoch", "log_lines", "scaler")
    assert [got[k] for k in position] == [ref[k] for k in position]
    assert [g["lr"] for g in got["optimizer"]["param_groups"]] == [g["lr"] for g in ref["optimizer"]["param_groups"]]
    for k, v in ref["model"].items():
        assert torch.equal(v, got["model"][k]), k
    for i, state in ref["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(got["optimizer"]["state"][i][k])), (i, k)


def run_records(out) -> list[dict]:
    """metrics.jsonl less what depends on the clock (time, throughput): what a resumed run must log exactly as the
    uninterrupted run did, each step once."""
    clock = ("time", "img_per_s", "tok_per_s")
    recs = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in clock} for r in recs]


class Evil:
    """A pickle that would create a file when loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def make_jpeg_imagefolder(root: Path, split_sizes: dict[str, int], classes: int = 3, size: int = 32, seed: int = 0):
    """Write real JPEG files: root/<split>/<class>/<i>.jpg, class-dependent colours so it is learnable."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, n in split_sizes.items():
        for i in range(n):
            c = i % classes
            d = root / split / f"class{c}"
            d.mkdir(parents=True, exist_ok=True)
            base = np.zeros((size, size, 3), np.float32)
            base[..., c % 3] = 200
            img = np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(d / f"{i:05d}.jpg", quality=90)
    return root


def make_cifar_pickles(root: Path, n_train: int = 50, n_test: int = 20, seed: int = 0) -> Path:
    """Write torchvision's real CIFAR-10 on-disk format (pickled batches) with tiny contents."""
    rng = np.random.default_rng(seed)
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True, exist_ok=True)

    def batch(n, name):
        labels = [i % 10 for i in range(n)]
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        with open(d / name, "wb") as f:
            pickle.dump({"data": data, "labels": labels, "batch_label": name}, f)

    per = -(-n_train // 5)
    for k in range(1, 6):
        batch(min(per, n_train - per * (k - 1)), f"data_batch_{k}")
    batch(n_test, "test_batch")
    with open(d / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)], "num_cases_per_batch": per}, f)
    return root


def shared(tmp_path_factory, name: str, make) -> Path:
    """A directory that `make(path)` fills once per test session, also across xdist workers (a file lock in the
    run's temp dir, which the workers share): the uninterrupted runs that tests in several files compare against."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    path = root / name
    with FileLock(f"{path}.lock"):
        if not (path / ".done").exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            make(path)
            (path / ".done").touch()
    return path


def cifar_resume_cmd(data, out, *extra, gpu_data: bool = True) -> list[str]:
    """cifar_resnet/train.py's ResNet-20 on 40 images, 12 epochs of 5 steps per rank at 2 ranks, the GPU-resident
    data path (or the DataLoader's) with random erasing and EMA, a checkpoint every 2 steps: test_cifar.py's resume,
    preemption and restart runs, and test_fault.py's dead-peer runs. Their faults follow an early checkpoint, and the
    run must still be going: ResNet-20's steps are short, so 60 of them (on 2 idle cores, 4.5-5 s from step 4 to the
    end, where ResNet-18's 15 steps took 6.4 s)."""
    data_path = ["--gpu-data", "-j", "0"] if gpu_data else ["-j", "1"]
    return ["cifar_resnet/train.py", "--data-dir", str(data), "-a", "resnet20", "--epochs", "12", *data_path,
            "--random-erasing", "0.5", "--ema", "0.9", "-b", "4", "-p", "1", "--seed", "3", "--save-every-steps", "2",
            "--output-dir", str(out), *map(str, extra)]  # fmt: skip


def cifar_data(tmp_path_factory) -> Path:
    return shared(tmp_path_factory, "cifar_data", lambda d: make_jpeg_imagefolder(d, {"train": 40, "test": 7}, 10))


def cifar_loader_cmd(data, out, *extra) -> list[str]:
    """cifar_resume_cmd on the DataLoader path (a worker per rank), logged every 3 steps: checkpoints (every 2) fall
    inside an open loss window."""
    return cifar_resume_cmd(data, out, "-p", "3", *extra, gpu_data=False)


def cifar_loader_reference(tmp_path_factory) -> Path:
    """The output dir of the uninterrupted torchrun run of cifar_loader_cmd, which test_cifar.py's resume test and
    test_chaos.py compare with."""
    data = cifar_data(tmp_path_factory)
    return shared(tmp_path_factory, "cifar_loader_reference", lambda d: torchrun(2, *cifar_loader_cmd(data, d)))


def transformer_ddp_cmd(data, out, *extra) -> list[str]:
    """transformer/train.py on a local de->en corpus by 2 processes, 13.5 steps an epoch, a checkpoint every 3 steps,
    to step 18: test_fault.py's preempted, resumed and restarted run compares with one uninterrupted run of it
    (transformer_reference), which test_transformer.py also checks end to end."""
    return ["transformer/train.py", "--data", str(data), "--lang-src", "de", "--lang-tgt", "en", "--preset", "tiny",
            "--dropout", "0.1", "--vocab-size", "200", "--max-tokens", "256", "--accum-steps", "2", "--epochs", "3",
            "--lr", "1e-3", "--warmup-epochs", "0.5", "-j", "1", "-p", "2", "--save-every-steps", "3",
            "--max-steps", "18", "--output-dir", str(out), *map(str, extra)]  # fmt: skip


def transformer_corpus(tmp_path_factory) -> Path:
    """A local corpus in the formats a user has: .gz and plain files (train.de.gz, train.en, ..., val.en.gz)."""

    def make(root: Path):
        import gzip

        from text import synthetic_corpus

        for split, (a, b) in synthetic_corpus(1, (400, 30, 21)).items():
            for lang, lines in (("de", a), ("en", b)):
                data = ("\n".join(lines) + "\n").encode()
                gz = f"{split}.{lang}" in ("train.de", "val.en")
                (root / f"{split}.{lang}{'.gz' if gz else ''}").write_bytes(gzip.compress(data) if gz else data)

    return shared(tmp_path_factory, "transformer_corpus", make)


def transformer_reference(tmp_path_factory) -> Path:
    """The output dir of the uninterrupted torchrun run of transformer_ddp_cmd."""
    data = transformer_corpus(tmp_path_factory)
    return shared(tmp_path_factory, "transformer_reference", lambda d: torchrun(2, *transformer_ddp_cmd(data, d)))


@pytest.fixture
def tiny_imagefolder(tmp_path):
    return make_jpeg_imagefolder(tmp_path / "imgs", {"train": 40, "test": 13}, classes=10)
