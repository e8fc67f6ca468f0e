"""The docs' promises: README commands run, plots render, wandb offline works, a script copies as a template."""

import json
import re
import shutil
from pathlib import Path

import torch

from tests.conftest import PY, REPO, run

TINY_CIFAR = [PY, "cifar_resnet/train.py", "--synthetic", "-b", "4", "-j", "0", "-p", "1"]  # seconds on a CPU
CPU_BLOCK = re.compile(r"<!-- cpu-tested -->\s*```bash\n(.*?)```", re.S)


def readme_commands(path: Path) -> list[str]:
    """Commands in ```bash blocks that follow a `<!-- cpu-tested -->` marker (pip installs are skipped)."""
    cmds = []
    for block in CPU_BLOCK.findall(path.read_text()):
        for line in block.splitlines():
            line = line.strip()
            if line and not line.startswith(("#", "pip ")):
                cmds.append(line)
    return cmds


def copy_repo(dst: Path) -> Path:
    shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(".git", "runs", ".data", "__pycache__", "*.pt"))
    return dst


def test_readme_cpu_commands_run(tmp_path):
    cmds = readme_commands(REPO / "README.md")
    assert any(c.startswith("torchrun --standalone --nproc_per_node=2 cifar_resnet/train.py") for c in cmds), cmds
    repo = copy_repo(tmp_path / "repo")
    for cmd in cmds:
        if "pytest" in cmd:
            continue  # the test command is what runs this
        run(
            ["bash", "-c", cmd.replace("python ", f"{PY} ", 1) if cmd.startswith("python ") else cmd],
            cwd=repo,
            timeout=600,
        )
    recs = [json.loads(line) for line in open(repo / "runs/quickstart/metrics.jsonl")]
    assert [r["split"] for r in recs[-2:]] == ["val", "time"] and recs[-2]["count"] == 1000


def test_copy_as_template_runs_unchanged(tmp_path):
    """cp -r common/ cifar_resnet/ to a new project: it must run as is, with nothing of this repo on the path."""
    proj = tmp_path / "my_project"
    shutil.copytree(REPO / "common", proj / "common", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "cifar_resnet", proj / "cifar_resnet", ignore=shutil.ignore_patterns("__pycache__"))
    run(
        [
            PY,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "cifar_resnet/train.py",
            "--synthetic",
            "--max-steps",
            "2",
            "-b",
            "4",
            "-j",
            "0",
            "--eval-every",
            "0",
            "--output-dir",
            "out",
        ],
        cwd=proj,
    )
    assert torch.load(proj / "out/last.pt", weights_only=True)["step"] == 2


def test_plot_metrics_renders_png(tmp_path):
    out = tmp_path / "run"
    run([*TINY_CIFAR, "--max-steps", "3", "--output-dir", out])
    run([PY, "scripts/plot_metrics.py", out, out / "metrics.jsonl", "--out", tmp_path / "p.png"])
    data = (tmp_path / "p.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_wandb_offline_and_run_id_reused_on_resume(tmp_path):
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    cmd = [*TINY_CIFAR, "--output-dir", tmp_path, "--wandb", "--eval-every", "0"]  # no 1000-image evaluation
    run([*cmd, "--max-steps", "2"], env=env)
    first = torch.load(tmp_path / "last.pt", weights_only=True)["wandb_id"]
    run([*cmd, "--max-steps", "4"], env=env)
    assert torch.load(tmp_path / "last.pt", weights_only=True)["wandb_id"] == first and first
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.endswith(first) for r in runs), runs


def test_wandb_missing_is_one_line(tmp_path):
    shim = tmp_path / "shim/wandb"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('No module named wandb')\n")
    p = run(
        [*TINY_CIFAR, "--max-steps", "1", "--output-dir", tmp_path / "o", "--wandb"],
        env={"PYTHONPATH": str(tmp_path / "shim")},
        check=False,
    )
    assert (
        p.returncode == 2
        and p.stderr.strip() == "error: --wandb needs the wandb package (pip install wandb), or drop --wandb"
    )
