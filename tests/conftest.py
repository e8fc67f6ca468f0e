"""Shared test helpers: free ports, tiny on-disk datasets in real formats, subprocess runners."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


# `pytest -n auto` (pytest-xdist, --dist loadgroup in pyproject.toml) hands out groups of tests, one per free
# worker, slowest first so that none is left running alone at the end. A group is a file, so that a module's
# fixtures run once, except test_fault.py: its CIFAR runs and its other-script runs share no fixture, so they are
# two groups, and its peer-failure tests go one by one.
SLOWEST_FIRST = ["test_imagenet.py", "test_transformer.py", "test_fault.py::cifar", "test_fault.py::other",
                 "test_docs.py", "test_cifar.py", "test_bench.py", "test_launchers.py", "test_slurm.py"]  # fmt: skip


def group(item) -> str:
    name = item.path.name
    if name != "test_fault.py":
        return name
    if "other_reference" in item.fixturenames:
        return name + "::other"
    return name + "::cifar" if "reference" in item.fixturenames else item.nodeid


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(group(item), len(rank)))  # stable: each group keeps its own order


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def torchrun_cmd(nproc: int, *args) -> list[str]:
    """The command line of `torchrun --standalone --nproc_per_node=N args...` (the real launcher)."""
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *map(str, args)]


def torchrun(nproc: int, *args: str, **kw):
    """`torchrun --standalone --nproc_per_node=N args...` (the real launcher)."""
    return run(torchrun_cmd(nproc, *args), **kw)


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


@pytest.fixture
def tiny_imagefolder(tmp_path):
    return make_jpeg_imagefolder(tmp_path / "imgs", {"train": 40, "test": 13}, classes=10)
