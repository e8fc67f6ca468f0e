"""imagenet/train.py on CPU with gloo: tiny ImageFolders of real JPEGs, real launchers, numbers compared.

The val set (25) and the train set (37) divide evenly neither by the ranks (2, 3) nor by the batch (4),
so an evaluation that pads or drops images, or counts one twice, gives a different count.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PY, REPO, free_port, make_jpeg_imagefolder, run, run_records, torchrun
from imagenet_cli import apply_recipe, get_args_parser  # noqa: E402  (tests/conftest.py: the scripts' folders)

from common.utils import lr_at

SCRIPT = str(REPO / "imagenet" / "train.py")
N_TRAIN, N_VAL = 37, 25
TINY = [
    *("-a", "resnet18", "-b", "4", "-j", "1", "-p", "1", "--epochs", "2"),
    *("--train-crop-size", "32", "--val-resize-size", "40", "--val-crop-size", "32"),
]
ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.slow


def records(out: Path, split: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def in_process(monkeypatch, *args):
    """imagenet/train.py's entry point in this process, as ``python imagenet/train.py ARGS`` runs it."""
    import imagenet.train as train

    monkeypatch.setattr(sys, "argv", [SCRIPT, *map(str, args)])
    train.run_cli(train.main, train.get_args_parser().parse_args())


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    # 41 px images: resize/crop paths are exercised; 6 classes so top-5 is not trivially 100%.
    return make_jpeg_imagefolder(tmp_path_factory.mktemp("inet"), {"train": N_TRAIN, "val": N_VAL}, classes=6, size=41)


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> dict:
    """A: the pytorch/examples command line (mp.spawn, 2 CPU processes, a DataLoader worker each) stopped mid-epoch
    at step 3, then resumed under torchrun to the end, loading in the main process (-j 0). B: the same training under
    torchrun, uninterrupted, loading in the main process: every random stream is a function of (seed, epoch, index),
    so the worker count does not change the result."""
    root = tmp_path_factory.mktemp("runs")
    a, b = root / "a", root / "b"
    port = free_port()
    examples = ["-a", "resnet18", "--dist-url", f"tcp://127.0.0.1:{port}", "--dist-backend", "gloo"]
    examples += ["--multiprocessing-distributed", "--world-size", "1", "--rank", "0", str(data)]
    extra = ["--nproc-per-node", "2", "--max-steps", "3", "--save-every-steps", "1", "--output-dir", str(a)]
    p1 = run([PY, SCRIPT, *examples, *TINY, *extra])
    snap = {"config": json.loads((a / "config.json").read_text()), "ckpt": ckpt(a / "last.pt"), "stdout": p1.stdout}
    snap["train"], snap["val"] = records(a, "train"), records(a, "val")
    p2 = torchrun(2, SCRIPT, str(data), *TINY, "-j", "0", "--output-dir", a)
    p3 = torchrun(2, SCRIPT, str(data), *TINY, "-j", "0", "--output-dir", b)
    return {"a": a, "b": b, "first": snap, "resumed_stdout": p2.stdout, "b_stdout": p3.stdout}


def test_examples_command_line_spawns_cpu_processes(runs):
    s = runs["first"]
    assert (s["config"]["world_size"], s["config"]["launcher"], s["config"]["backend"]) == (2, "mp.spawn", "gloo")
    assert s["config"]["global_batch"] == 8
    assert [r["step"] for r in s["train"]] == [1, 2, 3]
    assert all(r["img_per_s"] > 0 and r["loss"] > 0 for r in s["train"])
    # Stopped by --max-steps in the middle of epoch 0 (4 steps of 2 x 4 images), then evaluated exactly.
    assert (s["ckpt"]["epoch"], s["ckpt"]["step"], s["ckpt"]["batch_in_epoch"], s["ckpt"]["world_size"]) == (0, 3, 3, 2)
    assert [(r["step"], r["count"]) for r in s["val"]] == [(3, N_VAL)]
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in s["ckpt"]["model"])
    assert s["stdout"].count("global batch 8") == 1  # printed by rank 0 only


def test_torchrun_two_processes(runs):
    b = runs["b"]
    cfg = json.loads((b / "config.json").read_text())
    assert (cfg["world_size"], cfg["launcher"]) == (2, "torchrun")
    assert [r["step"] for r in records(b, "train")] == list(range(1, 9))
    assert [(r["epoch"], r["step"], r["count"]) for r in records(b, "val")] == [(1, 4, N_VAL), (2, 8, N_VAL)]
    last = ckpt(b / "last.pt")
    assert (last["epoch"], last["step"], last["batch_in_epoch"]) == (2, 8, 0)
    assert (b / "best.pt").is_file()


def test_checkpoint_from_mp_spawn_resumes_under_torchrun_exactly(runs):
    a, b = runs["a"], runs["b"]
    assert "resumed from" in runs["resumed_stdout"] and "step 3, batch 3" in runs["resumed_stdout"]
    steps = [r["step"] for r in records(a, "train")]
    assert steps == [1, 2, 3] + list(range(4, 9))  # continues counting, nothing repeated
    assert json.loads((a / "config.json").read_text())["launcher"] == "torchrun"
    # Same world size, same (seed, epoch) order, same per-sample augmentation (whichever process loads): bit-identical.
    wa, wb = ckpt(a / "last.pt"), ckpt(b / "last.pt")
    assert wa["step"] == wb["step"] == 8
    for k in wb["model"]:
        assert torch.equal(wa["model"][k], wb["model"][k]), k
    # each step and evaluation once, with the same values (a also evaluated at its --max-steps 3)
    assert [r for r in run_records(a) if (r["split"], r["step"]) != ("val", 3)] == run_records(b)


def test_exact_eval_identical_for_world_sizes_1_2_3(runs, data, tmp_path, monkeypatch):
    """-e --resume CKPT on 1 process (the script's entry point in this process) and 3 (mp.spawn) equals the
    2-process (torchrun) eval of the same weights at the end of training: each of the 25 images counted once, same
    numbers."""
    last = runs["b"] / "last.pt"
    evaluate = [SCRIPT, str(data), *TINY, "-j", "0", "-e", "--resume", str(last), "--output-dir"]
    run([PY, *evaluate, str(tmp_path / "w3"), "--multiprocessing-distributed", "--nproc-per-node", "3",
         "--dist-url", f"tcp://127.0.0.1:{free_port()}"])  # fmt: skip
    in_process(monkeypatch, *evaluate[1:], tmp_path / "w1")
    ref = records(runs["b"], "val")[-1]
    for w in ("w1", "w3"):
        (r,) = records(tmp_path / w, "val")
        assert (r["epoch"], r["step"], r["count"], r["checkpoint"]) == (2, 8, N_VAL, str(last))
        assert (r["acc1"], r["acc5"]) == (ref["acc1"], ref["acc5"])
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert 0 < ref["acc5"] and ref["acc1"] <= ref["acc5"] <= 100


def test_dummy_data_modern_recipe_resumes_bit_identical(tmp_path, monkeypatch):
    """--dummy batches are made as tensors, deterministic in (seed, step); mixup/cutmix and the EMA are
    seeded per step and checkpointed, so 3 + 3 steps equal 6 steps exactly (three runs of the script's entry point in
    this process). The evaluation's acc1 is the EMA's, the raw model's beside it as raw_*."""
    args = ["--dummy", "--dummy-sizes", "64", "11", *TINY, "--recipe", "modern"]
    args += ["--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--ema", "0.9"]
    one, two = tmp_path / "one", tmp_path / "two"
    for steps, out in ((6, one), (3, two), (6, two)):
        in_process(monkeypatch, *args, "--max-steps", steps, "--output-dir", out)
    a, b = ckpt(one / "last.pt"), ckpt(two / "last.pt")
    assert a["step"] == b["step"] == 6
    for key in ("model", "ema"):
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), (key, k)
    ta, tb = records(one, "train"), records(two, "train")
    assert [r["loss"] for r in ta] == [r["loss"] for r in tb]
    assert [r["lr"] for r in ta] == [r["lr"] for r in tb]
    assert ta[0]["lr"] < ta[-1]["lr"]  # warming up
    (va,) = records(one, "val")
    assert va["count"] == 11 and {"acc1", "loss", "raw_acc1", "raw_loss", "raw_acc5"} <= va.keys()
    assert va["loss"] != va["raw_loss"]  # two models evaluated: the average and the weights
    torch.save({**{k: v for k, v in a.items() if k != "ema"}, "model": a["ema"]}, tmp_path / "ema.pt")
    in_process(monkeypatch, *args, "-e", "--resume", tmp_path / "ema.pt", "--output-dir", tmp_path / "e")
    assert records(tmp_path / "e", "val")[0]["loss"] == va["loss"]  # the EMA's weights alone: acc1's, loss's model


def test_resume_with_another_global_batch_keeps_the_epoch_position_and_rescales_lr(tmp_path, monkeypatch, capsys):
    """A checkpoint of 3 steps x 4 images resumed with -b 2 (as after a change of world size): the epoch
    continues after the same 12 images (micro-batch 6 of 32), the step counter keeps counting, and the LR
    follows the new global batch (linear scaling: half). Both runs in this process."""
    args = ["--dummy", "--dummy-sizes", "64", "5", *TINY, "--epochs", "1", "--output-dir", tmp_path]
    in_process(monkeypatch, *args, "--max-steps", "3")
    first = records(tmp_path, "train")
    capsys.readouterr()
    in_process(monkeypatch, *args, "-b", "2", "--max-steps", "5")
    assert (
        "note: checkpoint of 1 process(es) x 4 samples, now 1 x 2: the epoch goes on after them"
        in capsys.readouterr().out
    )
    after = records(tmp_path, "train")[len(first) :]
    assert [r["step"] for r in after] == [4, 5]
    assert after[0]["lr"] == pytest.approx(first[-1]["lr"] / 2)
    last = ckpt(tmp_path / "last.pt")
    assert (last["step"], last["batch_in_epoch"], last["epoch"]) == (5, 8, 0)


@pytest.mark.parametrize("epochs", [2, 1])
def test_another_global_batch_at_an_epochs_end(tmp_path, monkeypatch, capsys, epochs):
    """A checkpoint at an epoch's end (8 steps x 4 images of 32), resumed with -b 2 (as on another world size): with
    --epochs 2 the second epoch runs whole (16 steps of 2), each epoch evaluated once; at the last epoch's end
    (--epochs 1) the rerun has nothing to do and changes no file."""
    args = ["--dummy", "--dummy-sizes", "32", "5", *TINY, "--epochs", str(epochs), "--output-dir", tmp_path]
    in_process(monkeypatch, *args, "--max-steps", "8")
    files = {f.name: f.read_bytes() for f in tmp_path.iterdir()}
    in_process(monkeypatch, *args, "-b", "2")
    last = ckpt(tmp_path / "last.pt")
    if epochs == 1:
        assert "already finished: nothing to do" in capsys.readouterr().out
        assert {f.name: f.read_bytes() for f in tmp_path.iterdir()} == files
    else:
        assert (last["step"], last["batch_in_epoch"], last["epoch"]) == (24, 0, 2)
        assert [(r["epoch"], r["step"]) for r in records(tmp_path, "val")] == [(1, 8), (2, 24)]


def test_sigterm_to_the_spawning_parent_checkpoints_and_exits_75(tmp_path):
    """The parent of --multiprocessing-distributed forwards SIGTERM (Slurm preemption) to its workers,
    which save last.pt at the next step boundary; the parent exits 75 (rerun to resume)."""
    out = tmp_path / "o"
    cmd = [PY, SCRIPT, "--dummy", "--dummy-sizes", "100000", "8", *TINY, "-j", "0", "--output-dir", str(out)]
    cmd += ["--multiprocessing-distributed", "--nproc-per-node", "2"]
    pipe = subprocess.PIPE
    p = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **ENV}, stdout=pipe, stderr=pipe, text=True)
    for line in p.stdout:  # training has begun: the signal waits for a step boundary
        if line.startswith("step 1/"):
            break
    p.send_signal(signal.SIGTERM)
    rest, err = p.communicate(timeout=120)
    assert p.returncode == 75, err[-2000:]
    last = ckpt(out / "last.pt")
    assert f"stopped by SIGTERM at step {last['step']}; checkpoint saved" in rest
    assert last["step"] >= 1 and last["batch_in_epoch"] == last["step"] and "Traceback" not in err


def parse(*argv: str):
    args = get_args_parser().parse_args(list(argv))
    apply_recipe(args)
    return args


def test_recipes_fill_unset_flags_and_schedules():
    c = parse("DATA")
    assert (c.lr, c.momentum, c.weight_decay, c.label_smoothing, c.lr_schedule, c.norm_bias_decay) == (
        0.1, 0.9, 1e-4, 0.0, "step", True,
    )  # fmt: skip
    mo = parse("--recipe", "modern", "--lr", "0.5", "--dummy", "--wd", "0.01")
    assert (mo.lr, mo.weight_decay, mo.momentum, mo.label_smoothing) == (0.5, 0.01, 0.875, 0.1)
    assert mo.lr_schedule == "cosine" and mo.synthetic and not mo.norm_bias_decay
    f = lambda step: lr_at(0, step, 1.0, c, steps_per_epoch=10)  # noqa: E731  (classic: x0.1 every 30 epochs, like main.py)
    assert [f(0), f(299), f(300), f(599), f(600)] == pytest.approx([1, 1, 0.1, 0.1, 0.01])
    mo10 = parse("--recipe", "modern", "--epochs", "10")
    f = lambda step: lr_at(0, step, 1.0, mo10, steps_per_epoch=10)  # noqa: E731  (5 epochs of warmup)
    assert [f(0), f(49), f(50)] == pytest.approx([1 / 50, 1, 1]) and f(99) < 0.01
    assert parse("--learning-rate", "0.3", "--weight-decay", "0", "X").lr == 0.3


def test_the_script_sets_no_environment_variable(data, tmp_path, monkeypatch, capsys):
    """The environment is the user's: with --gpu-decode too (its docs recommend CUDA_DEVICE_MAX_CONNECTIONS=32), a
    run leaves os.environ as it found it. In this process; the run stops at an error raised after the device setup,
    one line, exit 2."""
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    before = dict(os.environ)
    with pytest.raises(SystemExit) as e:
        in_process(monkeypatch, data, "--gpu-decode", "-e", "--resume", "none", "--output-dir", tmp_path / "o")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: -e needs weights") and err.count("\n") == 1, err
    assert dict(os.environ) == before


def test_bad_inputs_from_the_command_line(tmp_path):
    """Exit code 2 and one `error:` line, no traceback, also when one worker of a distributed run finds a
    corrupt JPEG (the other rank must neither hang nor add a traceback)."""
    bad = make_jpeg_imagefolder(tmp_path / "bad", {"train": 8, "val": 5}, classes=2, size=35)
    corrupt = bad / "train" / "class1" / "00003.jpg"
    corrupt.write_bytes(b"not a jpeg")
    spawn2 = ["-b", "2", "--multiprocessing-distributed", "--nproc-per-node", "2"]
    p = run([PY, SCRIPT, str(bad), *TINY, *spawn2, "--output-dir", str(tmp_path / "out")], check=False)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert len(errors) == 1 and f"unreadable image {corrupt}" in errors[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]


def test_skip_bad_images_counts_and_reports(tmp_path, monkeypatch, capsys):
    """The script's entry point in this process, loading in it (-j 0)."""
    d = make_jpeg_imagefolder(tmp_path / "d", {"train": 12, "val": 7}, classes=3, size=35)
    (d / "train" / "class1" / "00004.jpg").write_bytes(b"not a jpeg")
    jpg = d / "val" / "class2" / "00005.jpg"
    jpg.write_bytes(jpg.read_bytes()[:200])  # truncated
    in_process(monkeypatch, d, *TINY, "-j", "0", "--epochs", "1", "--skip-bad-images", "--output-dir", tmp_path / "o")
    err = capsys.readouterr().err
    assert "00004.jpg" in err and "00005.jpg" in err
    assert records(tmp_path / "o", "train")[-1]["skipped_images"] == 1  # 12 images = 3 full steps: all seen
    (v,) = records(tmp_path / "o", "val")
    assert (v["count"], v["skipped"]) == (6, 1)


def test_pretrained_weights_from_the_hub_cache_offline(tmp_path, monkeypatch):
    import torchvision

    cache = tmp_path / "th" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.save(torchvision.models.resnet18().state_dict(), cache / "resnet18-f37072fd.pth")  # main.py's V1 file
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    out = tmp_path / "o"
    in_process(monkeypatch, "--dummy", "--dummy-sizes", "8", "13", *TINY, "--pretrained", "-e", "--output-dir", out)
    (r,) = records(out, "val")
    assert r["count"] == 13 and r["checkpoint"] == "ResNet18_Weights.IMAGENET1K_V1"


def test_start_epoch_starts_the_schedule_there(tmp_path, monkeypatch):
    """main.py's --start-epoch: epoch 30 of a step schedule starts at step 30 x 4 with the LR already x0.1."""
    out = tmp_path / "o"
    in_process(monkeypatch, "--dummy", "--dummy-sizes", "16", "4", *TINY, "-j", "0", "--epochs", "31", "--start-epoch",
               "30", "--output-dir", out)  # fmt: skip
    train = records(out, "train")
    assert [r["step"] for r in train] == [121, 122, 123, 124] and {r["epoch"] for r in train} == {30}
    assert all(r["lr"] == pytest.approx(0.1 * 4 / 256 * 0.1) for r in train)
    assert ckpt(out / "last.pt")["epoch"] == 31


def test_device_decode_path_trains_and_evaluates_like_the_pillow_path(data, tmp_path, monkeypatch):
    """--gpu-decode (torchvision.io decode + device-side crop/flip/normalize; on CPU here) under torchrun:
    trains, evaluates every val image once, and its val metrics on the same checkpoint match the Pillow
    path closely (same crops; only the resize kernels differ). Files read in the main process (-j 0): the workers'
    part of the path (reading bytes) is test_gpu_decode.py's."""
    out = tmp_path / "gd"
    torchrun(2, SCRIPT, str(data), *TINY, "-j", "0", "--epochs", "1", "--gpu-decode", "--output-dir", str(out))
    assert ckpt(out / "last.pt")["step"] > 0
    (dev,) = records(out, "val")
    assert dev["count"] == N_VAL
    # the Pillow path's evaluation, in this process
    in_process(monkeypatch, data, *TINY, "-e", "--resume", out / "last.pt", "--output-dir", tmp_path / "pil")
    (pil,) = records(tmp_path / "pil", "val")
    assert pil["count"] == N_VAL and abs(pil["loss"] - dev["loss"]) < 0.05 * max(1.0, pil["loss"]), (pil, dev)
