"""cifar_resnet/train.py end to end under torchrun, in every data format, and exact resume."""

import json
import math
import os
import shutil
import sys
from pathlib import Path
from signal import SIGTERM, SIGUSR2

import pytest
import torch
from cifar10 import decode_folder, gpu_random_erasing  # noqa: E402  (tests/conftest.py: the scripts' folders)
from resnets import BasicBlock  # noqa: E402

from cifar_resnet.train import build_model  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.utils import EMA  # noqa: E402
from tests.conftest import (
    assert_same_training_state,
    cifar_data,
    cifar_loader_reference,
    cifar_resume_cmd,
    make_cifar_pickles,
    make_jpeg_imagefolder,
    preempt,
    restart_after_sigkill,
    run_records,
    torchrun,
)

TINY = ["-a", "resnet20", "-b", "4", "--print-freq", "1", "--seed", "3"]  # the paper's ResNet-20: fast on a CPU


def records(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def check_run(out, world_size, steps):
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["world_size"] == world_size and cfg["launcher"] in ("torchrun", "single")
    assert cfg["global_batch"] == 4 * world_size
    ckpt = torch.load(out / "last.pt", weights_only=True)
    assert ckpt["step"] == steps and not any(k.startswith(("module.", "_orig_mod.")) for k in ckpt["model"])
    recs = records(out)
    train = [r for r in recs if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert all(r["img_per_s"] > 0 and r["loss"] > 0 for r in train)
    assert any(r["split"] in ("val", "test") and r["count"] > 0 for r in recs)
    return recs


# --synthetic under torchrun (2 processes, every step logged, all 1,000 val images counted once) is the README's
# quickstart command, checked by tests/test_docs.py::test_readme_cpu_commands_run.


def in_process(monkeypatch, *args):
    """cifar_resnet/train.py's entry point in this process (1 process, no launcher): no start-up of its own."""
    import cifar_resnet.train as train

    monkeypatch.setattr(sys, "argv", ["cifar_resnet/train.py", *map(str, args)])
    train.run_cli(train.main, train.get_args_parser().parse_args())


def test_torchvision_pickle_format(tmp_path, monkeypatch):
    """In this process; test_launchers.py trains on the same format under every launcher."""
    data = make_cifar_pickles(tmp_path / "data", n_train=50, n_test=21)
    out = tmp_path / "out"
    in_process(monkeypatch, "--data-dir", data, "--epochs", "1", "-j", "0", "--output-dir", out, *TINY)
    recs = check_run(out, 1, 12)  # 50 images (5 files of 10) / batch 4 = 12 steps
    assert [r["count"] for r in recs if r["split"] == "test"] == [21]


def test_jpeg_imagefolder_with_val_split(tmp_path, tiny_imagefolder, monkeypatch):
    out = tmp_path / "out"
    in_process(monkeypatch, "--data-dir", tiny_imagefolder, "--val-split", "9", "--max-steps", "2", "-j", "0",
               "--output-dir", out, *TINY)  # fmt: skip
    recs = check_run(out, 1, 2)
    assert [r["count"] for r in recs if r["split"] == "val"] == [9]


@pytest.mark.parametrize("evaluated", [True, False])
def test_resume_from_a_checkpoint_saved_at_an_epoch_end(tmp_path, tmp_path_factory, monkeypatch, evaluated):
    """An epoch's end is checkpointed after its evaluation, at (epoch e + 1, batch 0). A checkpoint of an epoch with
    every batch done but not yet evaluated, (epoch e, batch 5), is what a resume on another world size can make; made
    here by hand from the first. Resuming from either must train steps 6-10 as the uninterrupted run did, with no
    step more (--gpu-data once trained an empty batch there), the pending evaluation done once. In this process: 2
    epochs of 5 steps, --keep-last keeps step 5's checkpoint."""
    data = cifar_data(tmp_path_factory)  # 40 images, 1 process, batch 8: 5 steps per epoch
    a, b = tmp_path / "a", tmp_path / "b"
    args = ["--epochs", "2", "-b", "8", "-j", "0", "--save-every-steps", "5", "-p", "3"]
    in_process(monkeypatch, *cifar_resume_cmd(data, a, *args, "--keep-last", "20")[1:])
    kept = torch.load(a / "step_00000005.pt", weights_only=True)
    assert (kept["epoch"], kept["batch_in_epoch"], kept["step"]) == (1, 0, 5)
    if not evaluated:  # as if saved before the evaluation: its record not yet in metrics.jsonl
        kept.update(epoch=0, batch_in_epoch=5, log_lines=kept["log_lines"] - 1)
    b.mkdir()
    torch.save(kept, b / "last.pt")
    (b / "metrics.jsonl").write_text("".join(open(a / "metrics.jsonl").readlines()[: kept["log_lines"]]))
    in_process(monkeypatch, *cifar_resume_cmd(data, b, *args)[1:])
    assert run_records(b) == run_records(a)  # steps 3 and 5 kept, the evaluation at 5 once, then 6, 9, 10
    assert [r["step"] for r in run_records(a) if r["split"] == "train"] == [3, 5, 6, 9, 10]
    assert all(r["loss"] == r["loss"] for r in run_records(b))  # no NaN from an empty batch
    ref, got = (torch.load(x / "last.pt", weights_only=True) for x in (a, b))
    assert_same_training_state(ref, got)
    assert all(torch.equal(v, got["ema"][k]) for k, v in ref["ema"].items())


def test_final_evaluation_happens_once(tmp_path, tmp_path_factory, monkeypatch):
    """The last step is checkpointed after the final evaluation, never before it. A run killed during that
    evaluation (last.pt still step 5's; no best.pt yet; metrics.jsonl written on past step 5; a write cut short)
    redoes steps 6-10 and evaluates, once: the records equal the uninterrupted run's, and the temporary file is gone.
    A rerun of the finished run changes no file. In this process: 2 epochs of 5 steps."""
    data, a = cifar_data(tmp_path_factory), tmp_path / "a"
    args = ["--epochs", "2", "-b", "8", "-j", "0", "--keep-last", "9", "--save-every-steps", "5", "--eval-every", "2"]
    run = lambda: in_process(monkeypatch, *cifar_resume_cmd(data, a, *args)[1:])  # noqa: E731
    run()
    ref = run_records(a)
    assert [(r["split"], r["step"]) for r in ref if r["split"] != "train"] == [("test", 10)]
    assert torch.load(a / "step_00000010.pt", weights_only=True)["log_lines"] == len(ref)  # saved after it
    (a / "last.pt").write_bytes((a / "step_00000005.pt").read_bytes())
    (a / "best.pt").unlink()
    (a / ".last.pt.x1y2.tmp").write_bytes(b"cut short")
    run()
    assert run_records(a) == ref
    assert (a / "best.pt").exists() and not list(a.glob("*.tmp"))
    files = {f.name: f.read_bytes() for f in a.iterdir()}
    run()
    assert {f.name: f.read_bytes() for f in a.iterdir()} == files


@pytest.mark.parametrize("data_path", ["loader", "gpu-data"])
def test_resume_mid_epoch_is_bit_identical(tmp_path, tmp_path_factory, data_path):
    """Uninterrupted 12 epochs (60 steps) == stop at step 3 (mid-epoch 1) + the same command again, stopped after its
    next checkpoint, + ... + the same command to the end. The DataLoader path is preempted twice: SIGUSR2 (Slurm's
    --signal), then SIGTERM, to a worker (every rank stops at the same step, rank 0 saves, exit 75). The --gpu-data
    path is preempted by SIGTERM to torchrun, which forwards it, then continues under torchrun --max-restarts=1: a
    worker SIGKILLed after the next checkpoint, the group restarts from last.pt and finishes."""
    data = cifar_data(tmp_path_factory)  # 40 images / 2 ranks / 4 = 5 steps per epoch
    gpu = data_path == "gpu-data"
    # Uninterrupted; on the DataLoader path with a worker per rank, while the interrupted legs load in the main process
    # (-j 0): a resume must be exact with another worker count too.
    # Preempted inside a loss window (logged every 3 steps): every rank's part of it travels in last.pt.
    if gpu:
        torchrun(2, *cifar_resume_cmd(data, tmp_path / "a", "-p", "3", gpu_data=gpu))
    else:  # shared with test_chaos.py
        shutil.copytree(cifar_loader_reference(tmp_path_factory), tmp_path / "a")
    cmd = lambda o, *extra: cifar_resume_cmd(data, o, *([] if gpu else ["-j", "0"]), "-p", "3", *extra, gpu_data=gpu)  # noqa: E731
    out = tmp_path / "b"
    torchrun(2, *cmd(out, "--max-steps", "3"))
    mid = torch.load(out / "last.pt", weights_only=True)
    assert mid["batch_in_epoch"] == 3 and mid["epoch"] == 0
    resumed_at = 3
    for target, sig in [("launcher", SIGTERM)] if gpu else [("worker", SIGUSR2), ("worker", SIGTERM)]:
        stopped, log = preempt(cmd(out), out, at=resumed_at + 1, target=target, sig=sig)
        assert f"step {resumed_at}, batch {resumed_at % 5} of" in log and resumed_at < stopped < 60
        resumed_at = stopped
    if gpu:  # the restart resumes from the checkpoint the kill followed, or from the final save if it came after it
        resumed = restart_after_sigkill(cmd(out), out, at=resumed_at + 1)
        assert len(resumed) == 2 and resumed[0] == resumed_at < resumed[1] <= 60, resumed
    else:
        assert f"step {resumed_at}, batch {resumed_at % 5} of" in torchrun(2, *cmd(out)).stdout
    a, b = (torch.load(tmp_path / f"{x}/last.pt", weights_only=True) for x in "ab")
    assert a["step"] == b["step"] == 60
    for k, v in [*a["model"].items(), *(("ema." + k, v) for k, v in a["ema"].items())]:
        assert torch.equal(v, (b["ema"] if k.startswith("ema.") else b["model"])[k.removeprefix("ema.")]), k
    assert not torch.equal(a["ema"]["fc.weight"], a["model"]["fc.weight"])  # the average lags the weights
    for k, v in a["optimizer"]["state"].items():
        assert torch.equal(v["momentum_buffer"], b["optimizer"]["state"][k]["momentum_buffer"])
    assert not torch.equal(mid["model"]["fc.weight"], a["model"]["fc.weight"])  # not vacuous: it trained on
    # every record once, with the same values (b also evaluated at its --max-steps 3)
    rec_a, rec_b = run_records(tmp_path / "a"), run_records(tmp_path / "b")
    # logged every 3 steps, at every checkpoint (every 2) and at every epoch's end (every 5)
    assert [r["step"] for r in rec_a if r["split"] == "train"] == [
        s for s in range(1, 61) if 0 in (s % 2, s % 3, s % 5)
    ]
    assert rec_a == [r for r in rec_b if (r["split"], r["step"]) != ("test", 3)]


def test_resume_under_another_world_size_continues_the_epoch(tmp_path, tiny_imagefolder, monkeypatch):
    """1 process x 4 images for 2 steps (in this process), then 2 processes x 4 (torchrun): the epoch continues
    after the same 8 images (micro-batch 1 of 5), the step counter keeps counting, and the LR follows the doubled
    global batch, at the schedule's position in training (not at the step counter's: the cosine would end early)."""
    cmd = ["cifar_resnet/train.py", "--data-dir", tiny_imagefolder, "--epochs", "2", "-j", "0",
           "--output-dir", tmp_path, "--warmup-epochs", "0", *TINY]  # fmt: skip
    in_process(monkeypatch, *cmd[1:], "--max-steps", "2")
    p = torchrun(2, *cmd)
    assert "note: checkpoint of 1 process(es) x 4 samples, now 2 x 4" in p.stdout
    train = [r for r in records(tmp_path) if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 12))  # 2 + (5 - 1) + 5
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["peak_lr"] == pytest.approx(2 * 0.2 * 4 / 512)
    assert train[2]["lr"] > train[1]["lr"]  # jumped to the new peak (cosine, no warmup)
    cosine = [cfg["peak_lr"] * 0.5 * (1 + math.cos(math.pi * k / 10)) for k in range(1, 10)]  # 2 epochs of 5 steps
    assert [r["lr"] for r in train[2:]] == pytest.approx(cosine, rel=1e-6)
    last = torch.load(tmp_path / "last.pt", weights_only=True)
    assert (last["epoch"], last["batch_in_epoch"], last["step"]) == (2, 0, 11)


def test_overwrite_starts_every_file_of_the_run_over(tmp_path, tiny_imagefolder, monkeypatch):
    """--resume none --overwrite where a run saved: metrics.jsonl holds the new run's records alone, config.json its
    arguments, and the old run's best.pt is gone until the new run evaluates (here it never does)."""
    out = tmp_path / "run"
    cmd = ["--data-dir", tiny_imagefolder, "--epochs", "1", "-j", "0", "--output-dir", out, *TINY]
    in_process(monkeypatch, *cmd, "--max-steps", "4")
    assert (out / "best.pt").exists() and len(records(out)) == 5  # 4 steps, an evaluation
    in_process(monkeypatch, *cmd, "--max-steps", "2", "--eval-every", "0", "--resume", "none", "--overwrite")
    assert [(r["split"], r["step"]) for r in records(out)] == [("train", 1), ("train", 2)]
    assert json.loads((out / "config.json").read_text())["max_steps"] == 2 and not (out / "best.pt").exists()


@pytest.mark.parametrize("epochs", [2, 1])
def test_another_world_size_at_an_epochs_end(tmp_path, tiny_imagefolder, monkeypatch, capsys, epochs):
    """4 images a step to the end of the first epoch (10 steps), then 8 (-b 8, as 2 processes x 4 would take: 5 steps
    an epoch), in this process: with --epochs 2 the second epoch runs whole, each epoch evaluated once; at the last
    epoch's end (--epochs 1) the rerun has nothing to do and changes no file."""
    out = tmp_path / "run"
    cmd = ["cifar_resnet/train.py", "--data-dir", tiny_imagefolder, "--epochs", str(epochs), "-j", "0",
           "--output-dir", out, *TINY]  # fmt: skip
    in_process(monkeypatch, *cmd[1:], "--max-steps", "10")
    files = {f.name: f.read_bytes() for f in out.iterdir() if f.name != ".lock"}  # the lock names its holder
    in_process(monkeypatch, *cmd[1:], "-b", "8")
    last = torch.load(out / "last.pt", weights_only=True)
    if epochs == 1:
        assert "already finished: nothing to do" in capsys.readouterr().out
        assert {f.name: f.read_bytes() for f in out.iterdir() if f.name != ".lock"} == files
    else:
        assert (last["epoch"], last["batch_in_epoch"], last["step"]) == (2, 0, 15)
        assert [(r["epoch"], r["step"]) for r in records(out) if r["split"] == "test"] == [(1, 10), (2, 15)]


def test_the_papers_cifar_resnets():
    """He et al. 2016, section 4.2: 6n + 2 layers with weights (convolutions and the linear layer; the shortcuts have
    none) and 0.27M, 0.46M, 0.66M, 0.85M and 1.7M parameters; where a stage begins, the shortcut is the input
    subsampled and zero-padded with channels."""
    paper = {"resnet20": 0.27, "resnet32": 0.46, "resnet44": 0.66, "resnet56": 0.85, "resnet110": 1.7}
    for arch, millions in paper.items():
        model = build_model(arch)
        assert round(sum(p.numel() for p in model.parameters()) / 1e6, 2 if millions < 1 else 1) == millions, arch
        layers = [m for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
        assert len(layers) == int(arch.removeprefix("resnet")), arch
    assert build_model("resnet20")(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    block = BasicBlock(16, 32, stride=2)
    torch.nn.init.zeros_(block.bn2.weight)  # the residual branch gives 0: the block is relu(shortcut)
    x = torch.randn(2, 16, 8, 8)
    expected = torch.cat([x[:, :, ::2, ::2], torch.zeros(2, 16, 4, 4)], dim=1).relu()
    assert torch.equal(block(x), expected)


def test_gpu_random_erasing_is_per_sample_and_a_function_of_the_seed():
    x = torch.randn(256, 3, 32, 32)
    erase = lambda p, seed: gpu_random_erasing(x, p, torch.Generator().manual_seed(seed))  # noqa: E731
    a, b, c = erase(0.5, 7), erase(0.5, 7), erase(0.5, 8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(erase(0.0, 7), x)
    zeros = (a == 0).all(dim=1).flatten(1).sum(dim=1)  # erased pixels per image (all channels 0)
    erased = zeros > 0
    assert 0.35 < erased.float().mean() < 0.65  # p = 0.5, each image on its own
    assert len(set(zeros[erased].tolist())) > 20  # rectangles of many sizes
    frac = zeros[erased].float() / 1024
    assert frac.min() >= 0.01 and frac.max() <= 0.4  # area fraction about (0.02, 0.33), after rounding
    assert torch.equal(a[~erased], x[~erased]) and torch.equal(a != 0, (a != 0) & (x != 0))  # nothing else changes
    for i in erased.nonzero()[:20, 0]:  # the erased pixels of each image form one rectangle
        rows, cols = (a[i, 0] == 0).any(1).nonzero()[:, 0], (a[i, 0] == 0).any(0).nonzero()[:, 0]
        assert zeros[i] == len(rows) * len(cols) == (rows[-1] - rows[0] + 1) * (cols[-1] - cols[0] + 1)


def test_decode_cache_is_reused_and_rebuilt_when_files_change(tmp_path):
    import numpy as np
    from PIL import Image
    from torchvision.datasets import ImageFolder

    root = make_jpeg_imagefolder(tmp_path / "d", {"train": 6}, classes=2)
    first = decode_folder(root / "train", (root,), workers=0, writer=True)
    (cache,) = root.glob(".decoded-train-*.npz")
    folder = ImageFolder(str(root / "train"))
    assert (first.data == np.stack([np.asarray(img) for img, _ in folder])).all() and first.targets == folder.targets
    mtime = cache.stat().st_mtime_ns
    again = decode_folder(root / "train", (root,), workers=0, writer=True)
    assert cache.stat().st_mtime_ns == mtime and (again.data == first.data).all()  # read, not decoded again
    new = Path(folder.samples[0][0]).parent / "new.jpg"
    Image.new("RGB", (32, 32), (255, 0, 0)).save(new)  # a file added
    added = decode_folder(root / "train", (root,), workers=0, writer=True)
    assert len(added) == 7 and not cache.exists() and len(list(root.glob(".decoded-train-*.npz"))) == 1
    Image.new("RGB", (32, 32), (0, 255, 0)).save(new)  # the same file rewritten
    os.utime(new, ns=(1, 1))  # a different mtime even on a coarse clock
    changed = decode_folder(root / "train", (root,), workers=0, writer=True)
    assert not (changed.data == added.data).all()
    # A data dir we cannot write (here: missing, as root may write anywhere): the cache goes to the next dir.
    other = decode_folder(root / "train", (tmp_path / "missing", tmp_path), workers=0, writer=True)
    assert (other.data == changed.data).all() and len(list(tmp_path.glob(".decoded-train-*.npz"))) == 1


def test_ema_update_maths():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    ema = EMA(model, decay=0.9)
    w0 = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    model(torch.randn(4, 2))  # BN buffers move, num_batches_tracked counts
    ema.update(1)  # decay min(0.9, 2/11): ema = w0 + (1 - 2/11) * 1
    torch.testing.assert_close(ema.module[0].weight, w0 + 9 / 11)
    torch.testing.assert_close(ema.module[1].running_mean, model[1].running_mean * 9 / 11)
    assert ema.module[1].num_batches_tracked == 1
    ema.update(1000)  # decay 0.9 now: a tenth of the way to the weights
    torch.testing.assert_close(ema.module[0].weight, w0 + 9 / 11 + 0.1 * (2 / 11))
    assert model[0].weight.requires_grad and not ema.module[0].weight.requires_grad


def test_a_test_folder_short_of_a_class_is_labelled_by_class_name(tmp_path):
    """test/ without class0: its images keep the training set's labels (class1 is 1, not 0 as ImageFolder alone
    numbers the folders it finds); a class that train/ lacks is one error line."""
    root = make_jpeg_imagefolder(tmp_path / "d", {"train": 6, "test": 6}, classes=3)
    shutil.rmtree(root / "test" / "class0")
    train = decode_folder(root / "train", (root,), workers=0, writer=True)
    test = decode_folder(root / "test", (root,), workers=0, writer=True, classes=train.classes)
    assert train.classes == ["class0", "class1", "class2"] and sorted(set(test.targets)) == [1, 2]
    (root / "test" / "class9").mkdir()
    shutil.copy(next((root / "test" / "class1").iterdir()), root / "test" / "class9")
    with pytest.raises(UserError, match="has class folders that train/ lacks: class9"):
        decode_folder(root / "test", (root,), workers=0, writer=True, classes=train.classes)
