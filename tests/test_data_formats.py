"""Each folder README's "Get the data": its commands, run on tiny fixtures in the formats the real downloads have
(the network fetch replaced by a local copy), give what train.py reads."""

import gzip
import importlib
import io
import json
import re
import sys
import tarfile
from pathlib import Path

import numpy as np
from conftest import PY, REPO, make_cifar_pickles, make_jpeg_imagefolder, run
from PIL import Image


def train_in_process(monkeypatch, module: str, *argv) -> None:
    """A train script's entry point in this process, as ``python SCRIPT ARGS`` runs it: what it reads is the point."""
    mod = importlib.import_module(module)
    monkeypatch.setattr(sys, "argv", list(map(str, argv)))
    mod.run_cli(mod.main, mod.get_args_parser().parse_args())


def block(doc: str, marker: str, lang: str = "bash") -> str:
    """The code block that follows `<!-- marker -->` in a README."""
    (code,) = re.findall(rf"<!-- {marker} -->\s*```{lang}\n(.*?)```", (REPO / doc).read_text(), re.S)
    return code


def records(out: Path, split: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def test_cifar_jpegs_made_from_torchvision_download(tmp_path, monkeypatch):
    """The README's snippet on torchvision's pickled batches (the MD5 check aside: the fixture's batches are tiny)
    writes train/<class>/NNNN.jpg and test/ at quality 75, as the recipes' JPEGs; the README's tarball is what
    bench/reproduce.sh extracts; train.py reads it with --val-split."""
    make_cifar_pickles(tmp_path / "data/cifar10", n_train=60, n_test=20)
    offline = "import os, torchvision.datasets.cifar as c\n"
    offline += "c.check_integrity = lambda path, md5=None: os.path.isfile(path)\n"
    run([PY, "-c", offline + block("cifar_resnet/README.md", "cifar-jpeg", "python")], cwd=tmp_path)
    jpegs = tmp_path / "data/cifar10-jpeg"
    assert sorted(p.name for p in (jpegs / "train").iterdir()) == [f"c{i}" for i in range(10)]  # batches.meta's names
    for split, n in (("train", 60), ("test", 20)):
        names = [sorted(p.name for p in d.iterdir()) for d in (jpegs / split).iterdir()]
        assert all(x == [f"{i:04d}.jpg" for i in range(len(x))] for x in names) and sum(map(len, names)) == n
    image = Image.open(jpegs / "train/c3/0001.jpg")
    assert (image.format, image.mode, image.size) == ("JPEG", "RGB", (32, 32))
    again = io.BytesIO()
    Image.fromarray(np.asarray(image)).save(again, "JPEG", quality=75)
    assert Image.open(again).quantization == image.quantization  # the quality of the recipes' JPEGs

    (tar,) = re.findall(r"`(mkdir -p \.data && tar -cJf[^`]*)`", (REPO / "cifar_resnet/README.md").read_text())
    run(["bash", "-c", " ".join(tar.split())], cwd=tmp_path)
    assert 'tar -xJf "$CIFAR_TAR" -C /tmp/c' in (REPO / "bench/reproduce.sh").read_text()
    (tmp_path / "c").mkdir()
    run(["tar", "-xJf", ".data/train.tar.xz", "-C", "c"], cwd=tmp_path)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["train"]

    out = tmp_path / "out"
    train_in_process(monkeypatch, "cifar_resnet.train", REPO / "cifar_resnet/train.py", "--data-dir", tmp_path / "c",
                     "--val-split", "10", "-a", "resnet20", "-b", "8", "-j", "0", "--epochs", "1", "--max-steps", "2",
                     "--output-dir", out)  # fmt: skip
    assert [r["count"] for r in records(out, "val")] == [10]


def test_multi30k_fetched_where_the_recipes_read_it(tmp_path, monkeypatch):
    """The README's commands with curl answering from a copy of multi30k/dataset's raw files (gzipped, line-aligned):
    the files land in .data/multi30k, which the recipe reads."""
    from text import synthetic_corpus

    upstream = tmp_path / "upstream"
    upstream.mkdir()
    corpus = synthetic_corpus(0, (60, 12, 1))
    for split in ("train", "val"):
        for lang, lines in zip(("de", "en"), corpus[split]):
            (upstream / f"{split}.{lang}.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    fake_curl = """curl() {  # curl -fL -o OUT URL, from $UPSTREAM
  local out url
  while [ $# -gt 0 ]; do case $1 in -o) out=$2; shift 2 ;; -*) shift ;; *) url=$1; shift ;; esac; done
  echo "$url" >>urls.txt && cp "$UPSTREAM/${url##*/}" "$out"
}
"""
    run(["bash", "-ec", fake_curl + block("transformer/README.md", "multi30k")], cwd=tmp_path,
        env={"UPSTREAM": str(upstream)})  # fmt: skip
    raw = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
    fetched = [raw + f"{split}.{lang}.gz" for split in ("train", "val") for lang in ("de", "en")]
    assert (tmp_path / "urls.txt").read_text().split() == fetched
    assert "--data .data/multi30k --lang-src de --lang-tgt en" in (REPO / "transformer/README.md").read_text()

    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)  # the README's relative path
    train_in_process(monkeypatch, "transformer.train", REPO / "transformer/train.py", "--data", ".data/multi30k",
                     "--lang-src", "de", "--lang-tgt", "en", "--preset", "tiny", "--vocab-size", "200", "--max-tokens",
                     "256", "-j", "0", "--max-steps", "2", "--output-dir", out)  # fmt: skip
    (val,) = records(out, "val")
    assert "bleu" in val and val["count"] == 12


def test_imagenet_tars_prepared_as_the_readme_says(tmp_path, monkeypatch):
    """ILSVRC2012's layout in miniature: a train tar of one tar per class (n01440764.tar holding
    n01440764_<i>.JPEG), a val tar of flat ILSVRC2012_val_<i>.JPEG files, and a valprep.sh of valprep.sh's form
    (mkdir -p WNID; mv FILE WNID/). The README's commands make train/<wnid>/ and val/<wnid>/, which train.py reads."""
    wnids = ["n01440764", "n01443537"]
    src = make_jpeg_imagefolder(tmp_path / "src", {"train": 8, "val": 4}, classes=2, size=40)
    data = tmp_path / "DATA"
    data.mkdir()
    with tarfile.open(data / "ILSVRC2012_img_train.tar", "w") as train_tar:
        for c, wnid in enumerate(wnids):
            with tarfile.open(tmp_path / f"{wnid}.tar", "w") as class_tar:
                for i, jpg in enumerate(sorted((src / "train" / f"class{c}").iterdir())):
                    class_tar.add(jpg, arcname=f"{wnid}_{i}.JPEG")
            train_tar.add(tmp_path / f"{wnid}.tar", arcname=f"{wnid}.tar")
    valprep = ""
    with tarfile.open(data / "ILSVRC2012_img_val.tar", "w") as val_tar:
        for n, jpg in enumerate(sorted((src / "val").rglob("*.jpg")), 1):
            name, wnid = f"ILSVRC2012_val_{n:08d}.JPEG", wnids[int(jpg.parent.name[-1])]
            val_tar.add(jpg, arcname=name)
            valprep += f"mkdir -p {wnid}\nmv {name} {wnid}/\n"
    (tmp_path / "valprep.sh").write_text(valprep)

    cmds = block("imagenet/README.md", "imagenet-prep")
    fetch = "wget -qO- https://raw.githubusercontent.com/soumith/imagenetloader.torch/master/valprep.sh | bash"
    assert cmds.count(fetch) == 1 and cmds.startswith("cd /data/imagenet && ")
    run(["bash", "-ec", cmds.replace(fetch, f"bash {tmp_path / 'valprep.sh'}").replace("/data/imagenet", str(data), 1)])
    for split, n in (("train", 4), ("val", 2)):
        assert sorted(p.name for p in (data / split).iterdir()) == wnids
        assert all(len(list((data / split / w).glob("*.JPEG"))) == n for w in wnids)

    out = tmp_path / "out"
    train_in_process(monkeypatch, "imagenet.train", REPO / "imagenet/train.py", data, "-a", "resnet18", "-b", "2",
                     "-j", "0", "--epochs", "1", "--max-steps", "2", "--train-crop-size", "32", "--val-resize-size",
                     "40", "--val-crop-size", "32", "--output-dir", out)  # fmt: skip
    assert [r["count"] for r in records(out, "val")] == [4]
