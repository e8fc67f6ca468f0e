"""The curves each workload README shows: its caption's command, run again, draws the committed picture from the
committed log. imagenet/README.md shows none: no ImageNet training log is committed (its recipes were not trained to
the end with this script).

Mutation that fails it: drop the val records from a log (``grep -v '"split": "val"'``): the picture's "Source" entry
(the log's sha256) no longer matches, and the redrawn pixels lose the eval curve. So does editing a caption's
command, or committing a picture without redrawing it.
"""

import re

import numpy as np
import pytest
from PIL import Image

from tests.conftest import PY, REPO, run

PICTURE = re.compile(r"^!\[[^\]]+\]\(\.\./(docs/img/[\w.-]+\.png)\)\n\n(.+)$", re.M)
COMMAND = re.compile(r"`python (scripts/plot_metrics\.py [^`]*--out (\S+))`")


@pytest.mark.parametrize("doc", ["cifar_resnet/README.md", "transformer/README.md"])
def test_readme_picture_redraws_from_its_log(doc, tmp_path):
    ((png, caption),) = PICTURE.findall((REPO / doc).read_text())  # one picture, its caption on the next line
    cmd, out = COMMAND.search(caption).groups()
    log = next(a for a in cmd.split() if a.endswith(".jsonl"))
    assert out == png and f"](../{log})" in caption, caption  # the caption links the log its command plots
    committed = Image.open(REPO / png)
    assert (REPO / png).stat().st_size < 60_000
    run([PY, *cmd.replace(f"--out {out}", f"--out {tmp_path / 'redrawn.png'}").split()])
    redrawn = Image.open(tmp_path / "redrawn.png")
    assert redrawn.info["Source"] == committed.info["Source"], "the log changed since the picture was drawn"
    if redrawn.info["Software"] != committed.info["Software"]:
        pytest.skip(f"pixels not compared: {png} drawn by {committed.info['Software']}, now {redrawn.info['Software']}")
    pixels = [np.asarray(im.convert("RGBA")) for im in (redrawn, committed)]
    same = pixels[0].shape == pixels[1].shape and np.array_equal(*pixels)
    assert same, f"{png} is not what its caption's command draws (redraw it with that command)"
