"""-e from a checkpoint alone, in each train.py; imagenet/train.py fine-tuning on other classes from a weights file.

Each evaluation names no model flag: the architecture, the model's settings and the evaluation settings (--tta, the
val sizes, the language pair) come from the checkpoint's args, and the metrics equal those the training run logged
for that checkpoint. Mutation that fails them: ``from_checkpoint`` (common/args.py) leaving ``args`` as they are, so
that the defaults' model (cifar resnet18, imagenet resnet50, the transformer's base en->it) meets the checkpoint.
"""

from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch
from conftest import REPO, make_jpeg_imagefolder, transformer_corpus

SCRIPT = {"cifar": "cifar_resnet.train", "imagenet": "imagenet.train", "transformer": "transformer.train"}


def entry(monkeypatch, script: str, *args) -> None:
    """``python <script>/train.py ARGS``, in this process."""
    train = importlib.import_module(SCRIPT[script])
    monkeypatch.setattr(sys, "argv", [str(REPO / SCRIPT[script].replace(".", "/")) + ".py", *map(str, args)])
    train.run_cli(train.main, train.get_args_parser().parse_args())


def one_error_line(monkeypatch, capsys, script: str, *args) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        entry(monkeypatch, script, *args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), (e.value.code, err)
    return err


def records(out, split: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def logged(out, split: str, keys=("loss", "acc1", "count")) -> dict:
    """The one ``split`` record in ``out``'s metrics.jsonl, its ``keys``."""
    (record,) = records(out, split)
    return {k: record[k] for k in keys}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_jpeg_imagefolder(tmp_path_factory.mktemp("img"), {"train": 16, "val": 10}, classes=5, size=41)


def test_cifar(tmp_path, monkeypatch, capsys):
    """A ResNet-20 trained with --tta, evaluated with neither -a nor --tta (--tta changes the loss)."""
    images = make_jpeg_imagefolder(tmp_path / "img", {"train": 20, "test": 10}, classes=10)
    data = ["--data-dir", images, "-j", "0"]
    entry(monkeypatch, "cifar", *data, "-a", "resnet20", "--tta", "-b", "4", "--max-steps", "2", "--output-dir",
          tmp_path / "run")  # fmt: skip
    entry(monkeypatch, "cifar", *data, "-e", "--resume", tmp_path / "run/last.pt", "--output-dir", tmp_path / "e")
    assert logged(tmp_path / "e", "test") == logged(tmp_path / "run", "test")
    err = one_error_line(monkeypatch, capsys, "cifar", *data, "-a", "resnet18", "-e", "--resume",
                         tmp_path / "run/last.pt", "--output-dir", tmp_path / "e2")  # fmt: skip
    assert err == "error: --arch resnet18 contradicts the checkpoint's resnet20 (drop it)"


def test_imagenet(images, tmp_path, monkeypatch, capsys):
    """A ResNet-18 trained at 32 px (val resize 40), evaluated with none of -a, --val-resize-size, --val-crop-size."""
    entry(monkeypatch, "imagenet", images, "-a", "resnet18", "-b", "4", "-j", "0", "--max-steps", "2",
          "--train-crop-size", "32", "--val-resize-size", "40", "--val-crop-size", "32", "--output-dir",
          tmp_path / "run")  # fmt: skip
    entry(monkeypatch, "imagenet", images, "-b", "4", "-j", "0", "-e", "--resume", tmp_path / "run/last.pt",
          "--output-dir", tmp_path / "e")  # fmt: skip
    assert logged(tmp_path / "e", "val") == logged(tmp_path / "run", "val")
    err = one_error_line(monkeypatch, capsys, "imagenet", images, "-a", "resnet34", "-e", "--resume",
                         tmp_path / "run/last.pt", "--output-dir", tmp_path / "e2")  # fmt: skip
    assert err == "error: --arch resnet34 contradicts the checkpoint's resnet18 (drop it)"


def test_transformer(tmp_path_factory, tmp_path, monkeypatch, capsys):
    """A tiny de->en model, evaluated with none of --preset, --lang-src, --lang-tgt: val and test as logged."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("sacrebleu")
    data = ["--data", transformer_corpus(tmp_path_factory), "--max-tokens", "256", "-j", "0"]
    entry(monkeypatch, "transformer", *data, "--lang-src", "de", "--lang-tgt", "en", "--preset", "tiny",
          "--vocab-size", "200", "--max-steps", "2", "--output-dir", tmp_path / "run")  # fmt: skip
    entry(monkeypatch, "transformer", *data, "-e", "--resume", tmp_path / "run/last.pt", "--output-dir", tmp_path / "e")
    for split in ("val", "test"):
        keys = ("loss", "bleu", "count")
        assert logged(tmp_path / "e", split, keys) == logged(tmp_path / "run", split, keys)
    err = one_error_line(monkeypatch, capsys, "transformer", *data, "--preset", "small", "-e", "--resume",
                         tmp_path / "run/last.pt", "--output-dir", tmp_path / "e2")  # fmt: skip
    assert err == "error: --preset small contradicts the checkpoint's tiny (drop it)"


# ---- fine-tuning: --pretrained FILE with 5 classes


@pytest.fixture(scope="module")
def resnet18_file(tmp_path_factory):
    """An ImageNet ResNet-18's state_dict, as torchvision's downloaded file holds it (here: random weights)."""
    import torchvision

    path = tmp_path_factory.mktemp("w") / "resnet18-f37072fd.pth"  # the name of torchvision's IMAGENET1K_V1 file
    torch.save(torchvision.models.resnet18(num_classes=1000).state_dict(), path)
    return path


def test_finetune_starts_from_the_file_with_a_new_head(images, resnet18_file, tmp_path, monkeypatch, capsys):
    """A step at a tiny LR: every tensor of the backbone is the file's, the head has 5 outputs. Fails if build_model
    leaves the file's tensors out (the backbone then torchvision's random init)."""
    capsys.readouterr()
    entry(monkeypatch, "imagenet", images, "-a", "resnet18", "--pretrained", resnet18_file, "-b", "4", "-j", "0",
          "--max-steps", "1", "--lr", "1e-9", "--train-crop-size", "32", "--val-resize-size", "40",
          "--val-crop-size", "32", "--output-dir", tmp_path / "ft")  # fmt: skip
    assert "--pretrained: a new head (fc.weight, fc.bias) for 5 classes" in capsys.readouterr().out
    got, file = torch.load(tmp_path / "ft/last.pt")["model"], torch.load(resnet18_file)  # weights_only: the default
    assert got["fc.weight"].shape == (5, 512) and got["fc.bias"].shape == (5,)
    backbone = [k for k in file if not k.startswith("fc.") and "running_" not in k and "num_batches" not in k]
    assert len(backbone) == 60 and all(torch.allclose(got[k], file[k], atol=1e-6) for k in backbone)


def test_pretrained_from_the_hub_cache_in_main_py_order(images, resnet18_file, tmp_path, monkeypatch, capsys):
    """pytorch/examples' ``--pretrained DATA``: the folder is DATA, the weights torchvision's (from the hub cache, as
    offline), the head new for the folder's 5 classes."""
    (tmp_path / "th/hub/checkpoints").mkdir(parents=True)
    (tmp_path / "th/hub/checkpoints" / resnet18_file.name).symlink_to(resnet18_file)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "th"))
    capsys.readouterr()
    entry(monkeypatch, "imagenet", "-a", "resnet18", "-b", "4", "-j", "0", "--val-resize-size", "40", "--val-crop-size",
          "32", "-e", "--output-dir", tmp_path / "o", "--pretrained", images)  # fmt: skip
    assert "--pretrained: a new head (fc.weight, fc.bias) for 5 classes" in capsys.readouterr().out
    (r,) = records(tmp_path / "o", "val")
    assert r["count"] == 10 and r["checkpoint"] == "ResNet18_Weights.IMAGENET1K_V1"


def test_pretrained_files_that_do_not_fit_are_one_line(tmp_path, monkeypatch, capsys):
    """A file of another architecture (resnet34's tensors include all of resnet18's names, same shapes), a missing
    file, a file torch.save did not write. Fails if build_model loads the file's tensors without ``strict``."""
    import torchvision

    torch.save(torchvision.models.resnet34().state_dict(), tmp_path / "r34.pth")
    (tmp_path / "text.pth").write_text("not weights\n")
    run = ["--dummy", "--dummy-sizes", "8", "4", "-a", "resnet18", "-b", "4", "-j", "0", "--output-dir", tmp_path / "o"]
    for file, want in ((tmp_path / "r34.pth", "does not fit this model"), (tmp_path / "nope.pth", "cannot load it"),
                       (tmp_path / "text.pth", "cannot load it")):  # fmt: skip
        assert want in one_error_line(monkeypatch, capsys, "imagenet", *run, "--pretrained", file)
