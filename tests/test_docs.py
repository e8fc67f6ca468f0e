"""The docs' promises: README commands run, plots render, a missing wandb is one line, a script copies as a
template (wandb itself, offline: tests/test_wandb.py)."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import PY, REPO, make_jpeg_imagefolder, run

TINY_CIFAR = [PY, "cifar_resnet/train.py", "--synthetic", "-a", "resnet20", "-b", "4", "-j", "0", "-p", "1"]
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


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> Path:
    """The README's CPU-tested commands, run as written in a copy of the repository; returns its runs/quickstart."""
    cmds = readme_commands(REPO / "README.md")
    assert any(c.startswith("torchrun --standalone --nproc_per_node=2 cifar_resnet/train.py") for c in cmds), cmds
    repo = copy_repo(tmp_path_factory.mktemp("readme") / "repo")
    for cmd in cmds:
        if "pytest" in cmd:
            continue  # the test command is what runs this
        run(
            ["bash", "-c", cmd.replace("python ", f"{PY} ", 1) if cmd.startswith("python ") else cmd],
            cwd=repo,
            timeout=600,
        )
    return repo / "runs/quickstart"


def test_readme_cpu_commands_run(quickstart):
    """The quickstart is also cifar_resnet/train.py's end-to-end check of --synthetic under torchrun: 2 gloo
    processes, every step logged and checkpointed without wrapper prefixes, all 1,000 val images counted once."""
    recs = [json.loads(line) for line in open(quickstart / "metrics.jsonl")]
    assert [r["count"] for r in recs if r["split"] == "val"] == [1000]  # once, at the end (after it: timings)
    cfg = json.loads((quickstart / "config.json").read_text())
    assert (cfg["world_size"], cfg["launcher"], cfg["backend"], cfg["global_batch"]) == (2, "torchrun", "gloo", 32)
    ckpt = torch.load(quickstart / "last.pt", weights_only=True)
    assert ckpt["step"] == 10 and not any(k.startswith(("module.", "_orig_mod.")) for k in ckpt["model"])
    train = [r for r in recs if r["split"] == "train"]
    assert [r["step"] for r in train] == [5, 10] and all(r["img_per_s"] > 0 and r["loss"] > 0 for r in train)


def test_readme_layout_lists_every_file():
    """The README's layout block names each file and subfolder of the code folders (README.md, __init__.py aside)."""
    block = re.search(r"## Layout\n\n```\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    listed, folder = {}, None
    for line in block.splitlines():
        head, *names = line.split() if not line.startswith(" ") else [folder, *line.split()]
        folder = head
        listed.setdefault(head.rstrip("/"), set()).update(n for n in names if not n.endswith(":"))
    for name in ("common", "cifar_resnet", "imagenet", "transformer", "scripts", "bench"):
        present = {p.name + "/" * p.is_dir() for p in (REPO / name).iterdir() if not p.name.startswith((".", "__"))}
        assert listed[name] == present - {"README.md"}, name


def make_it_yours(doc: str) -> list[str]:
    """The command lines of a README's `<!-- make-it-yours -->` block: what a user runs to copy the script."""
    (block,) = re.findall(r"<!-- make-it-yours -->\s*```bash\n(.*?)```", (REPO / doc).read_text(), re.S)
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.parametrize("doc", ["cifar_resnet/README.md", "imagenet/README.md"])
def test_copy_as_template_runs_unchanged(tmp_path, doc):
    """Each workload README's copy instruction, run as written (the copy lands in tmp_path): the copy runs with nothing
    of this repo on the path, under another folder name, and the fork server it starts for DataLoader workers
    imports its preloaded modules there (checked in the CIFAR copy: its common/ is the ImageNet copy's). ImageNet's
    runs --gpu-decode, whose CPU fallback needs every file of the folder."""
    folder, proj = doc.split("/")[0], tmp_path / "my_project"
    copy, go = make_it_yours(doc)
    assert go.startswith("cd ../my_project && "), go
    run(["bash", "-c", copy.replace("../my_project", str(proj))])
    assert sorted(p.name for p in proj.iterdir()) == sorted(["common", folder])
    go = go.removeprefix("cd ../my_project && ").replace("python ", f"{PY} ", 1)
    (proj / folder).rename(proj / "mine")  # any folder name works
    go = go.replace(f"{folder}/train.py", "mine/train.py")
    if folder == "imagenet":
        data = make_jpeg_imagefolder(tmp_path / "imgs", {"train": 12, "val": 6}, classes=3)
        go = go.replace("/path/to/imagefolder", str(data))
    p = run(["bash", "-c", go], cwd=proj)
    assert torch.load(proj / "out/last.pt", weights_only=True)["step"] > 0
    assert folder == "cifar_resnet" or "gpu-decode decoded (rank 0): cpu 12" in p.stdout, p.stdout
    if folder == "imagenet":
        return  # the check below depends on common/ and the copy's layout alone, the same in both copies
    check = "import importlib, torch, multiprocessing.forkserver as f; from common.hardening.workers import loader_args"
    check += "; loader_args(); [importlib.import_module(m) for m in f._forkserver._preload_modules]; print('ok')"
    assert run([PY, "-c", check], cwd=proj).stdout.strip().endswith("ok")


def minimal_copy(dst: Path, folder: str, name: str) -> Path:
    """``folder`` copied as ``dst/name`` with common/ but not common/hardening/, and the lines of train.py that name
    hardening deleted, nothing else: what a reader who wants the lesson alone keeps."""
    shutil.copytree(REPO / "common", dst / "common", ignore=shutil.ignore_patterns("hardening", "__pycache__"))
    shutil.copytree(REPO / folder, dst / name, ignore=shutil.ignore_patterns("__pycache__", "README.md"))
    train = dst / name / "train.py"
    lines = train.read_text().splitlines(keepends=True)
    train.write_text("".join(line for line in lines if "hardening" not in line))
    code = [line for line in lines if "hardening" in line and not line.strip().startswith("#")]
    assert [line.split("#")[0].strip() for line in code] == ["from common import hardening", "hardening.enable(args)"]
    return dst


def test_a_minimal_copy_trains_resumes_and_evaluates(tmp_path):
    """cifar_resnet/ as mynet/, common/ without common/hardening/, train.py less its two hardening lines: 2
    processes under torchrun with DataLoader workers (-j 2) train, then the same command with more steps resumes
    from last.pt, then -e evaluates it, each as the full script would. Fails if a core module imports the hardening
    layer (the copy has none)."""
    proj = minimal_copy(tmp_path / "p", "cifar_resnet", "mynet")
    data = make_jpeg_imagefolder(tmp_path / "imgs", {"train": 32, "test": 8}, classes=10)
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "mynet/train.py",
           "--data-dir", str(data), "-a", "resnet20", "-b", "4", "-j", "2", "--epochs", "2", "-p", "1",
           "--output-dir", "out"]  # fmt: skip
    first = run([*cmd, "--max-steps", "3"], cwd=proj).stdout
    assert "done: step 3" in first and "test: loss" in first, first
    second = run(cmd, cwd=proj).stdout
    assert "resumed from out/last.pt: epoch 0, step 3, batch 3 of the epoch" in second and "done: step 8" in second
    evaluated = run([*cmd, "-e", "--resume", "out/last.pt", "--output-dir", "eval"], cwd=proj).stdout
    ckpt = torch.load(proj / "out/last.pt", weights_only=True)
    assert ckpt["step"] == 8 and "out/last.pt test: loss" in evaluated, evaluated
    test = [json.loads(r) for r in (proj / "out/metrics.jsonl").read_text().splitlines() if '"test"' in r]
    assert evaluated.splitlines()[-1].endswith(f"acc1 {test[-1]['acc1']:.2f} acc5 {test[-1]['acc5']:.2f} (8 images)")


def test_transformer_copy_runs_under_another_name(tmp_path):
    """common/ and transformer/ copied, the folder renamed: train.py under torchrun with a DataLoader worker per
    rank, then translate.py on its checkpoint."""
    proj = tmp_path / "my_project"
    for folder, name in (("common", "common"), ("transformer", "my_translator")):
        shutil.copytree(REPO / folder, proj / name, ignore=shutil.ignore_patterns("__pycache__", "README.md"))
    run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "my_translator/train.py",
         "--synthetic", "--preset", "tiny", "--max-tokens", "512", "--max-steps", "2", "--eval-every", "0", "-j", "1",
         "--output-dir", "out"], cwd=proj)  # fmt: skip
    out = run([PY, "my_translator/translate.py", "--checkpoint", "out/last.pt", "kaka mine"], cwd=proj).stdout
    assert len(out.splitlines()) == 1, out


def test_plot_metrics_renders_png(quickstart, tmp_path):
    """The README's run (train and val records): a run directory and a metrics file, plotted together."""
    run([PY, "scripts/plot_metrics.py", quickstart, quickstart / "metrics.jsonl", "--out", tmp_path / "p.png"])
    data = (tmp_path / "p.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_wandb_missing_is_one_line(tmp_path, monkeypatch, capsys):
    """The script's entry point in this process, with `import wandb` failing as where it is not installed."""
    import cifar_resnet.train as train

    monkeypatch.setitem(sys.modules, "wandb", None)  # None in sys.modules: the import raises ImportError
    monkeypatch.setattr(
        sys, "argv", [*map(str, TINY_CIFAR[1:]), "--max-steps", "1", "--output-dir", str(tmp_path), "--wandb"]
    )
    with pytest.raises(SystemExit) as e:
        train.run_cli(train.main, train.get_args_parser().parse_args())
    err = capsys.readouterr().err
    assert (
        e.value.code == 2
        and err.strip() == "error: --wandb needs the wandb package (pip install wandb), or drop --wandb"
    )


def test_two_node_slurm_lines_ask_for_gpus_and_keep_each_recipes_global_batch():
    """Each workload's Slurm line for 2 nodes of 8 GPUs: its flags parse with the script's own parser, it asks Slurm
    for the GPUs, and 16 processes keep the recipe's global batch (CIFAR 512 images, ImageNet's modern recipe 2,048,
    the Multi30k recipe 8,192 tokens, which its packed rows fill: --max-tokens a multiple of --pack-len)."""
    import importlib.util
    import shlex

    expect = {"cifar_resnet": 512, "imagenet": 2048, "transformer": 8192}
    seen = []
    for doc in ("cifar_resnet/README.md", "scripts/README.md", "transformer/README.md"):
        text = (REPO / doc).read_text()
        env = dict(re.findall(r'^([A-Z])="([^"]*)"$', text, re.M))  # the doc's C="..." and A="..."
        for line in (x for x in text.splitlines() if x.startswith("sbatch -N 2 ")):
            assert "--gpus-per-node=8" in line, line
            for name, value in env.items():
                line = line.replace(f"${name} ", f"{value} ")
            words = shlex.split(line)
            script = next(w for w in words if w.endswith("/train.py"))
            folder = script.split("/")[0]
            spec = importlib.util.spec_from_file_location(f"docs_{folder}_train", REPO / script)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            args = module.get_args_parser().parse_args(words[words.index(script) + 1 :])
            if folder == "transformer":
                assert args.max_tokens % args.pack_len == 0 and 16 * args.max_tokens == expect[folder], line
            else:
                assert 16 * args.batch_size * args.accum_steps == expect[folder], line
            seen.append(folder)
    assert sorted(set(seen)) == sorted(expect) and seen.count("imagenet") == 2, seen
