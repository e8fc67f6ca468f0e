"""translate.py writes exactly one line per input line, for `wc -l` and for str.splitlines(), whatever line-break
characters the input or the model's output holds; --output is written atomically. Validation BLEU scores the
same one-line text."""

from __future__ import annotations

import subprocess
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch
from conftest import PY, REPO, run

pytest.importorskip("tokenizers")
pytest.importorskip("sacrebleu")

from seq2seq import PRESETS, ModelConfig, Transformer  # noqa: E402  (conftest: the scripts' folders)
from text import synthetic_corpus, train_tokenizer  # noqa: E402

TRANSLATE = str(REPO / "transformer" / "translate.py")
# every character str.splitlines() ends a line at, "\n" (the only one `wc -l` counts) last
BREAKS = "\r\v\f\x1c\x1d\x1e\x85\u2028\u2029\n"


def breaking_model():
    """A tiny model with a byte-level BPE tokenizer that answers every sentence with a token holding every
    line-break character, repeated: what an untrained or unlucky byte-level model can emit."""
    from tokenizers import AddedToken

    tok = train_tokenizer("bpe", synthetic_corpus(0, (50, 0, 0))["train"][0], 300)
    tok.add_tokens([AddedToken(f"x{BREAKS}y", normalized=False)])
    token = tok.get_vocab_size() - 1
    cfg = ModelConfig(tok.get_vocab_size(), **PRESETS["tiny"])
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():  # the decoder's last norm always outputs u; only that token's embedding points along u
        u = torch.nn.functional.normalize(torch.randn(cfg.d_model), dim=0)
        model.embed.weight[token] = 20 * u
        model.dec_norm.weight.zero_()
        model.dec_norm.bias.copy_(u)
    return model.eval(), tok, cfg


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model, tok, cfg = breaking_model()
    path = tmp_path_factory.mktemp("ckpt") / "best.pt"
    torch.save({"model": model.state_dict(), "tokenizer": tok.to_str(), "model_config": asdict(cfg)}, path)
    return path


def wc_l(text: str) -> int:
    return text.count("\n")


def test_one_output_line_per_input_line(checkpoint, tmp_path):
    # a line with each break character inside, empty lines (first, middle, last), a CRLF line, a blank one
    lines = ["", *(f"ein {c} Hund" for c in BREAKS[:-1]), "", "ein Hund\r", "eine Katze", "  ", ""]
    src = "".join(line + "\n" for line in lines)
    assert wc_l(src) == len(lines) < len(src.splitlines())  # the readers disagree on the input
    empty = [i for i, line in enumerate(lines) if not line.strip()]

    (tmp_path / "in.de").write_bytes(src.encode())
    out = tmp_path / "out" / "hyp.en"
    p = run([PY, TRANSLATE, "--checkpoint", checkpoint, "--input", tmp_path / "in.de", "--output", out])
    assert p.stdout == ""
    text = out.read_bytes().decode()
    assert wc_l(text) == len(text.splitlines()) == len(lines), repr(text)
    hyps = text.splitlines()
    assert [i for i, h in enumerate(hyps) if not h] == empty
    assert all(h.startswith("x yx y") for i, h in enumerate(hyps) if i not in empty), hyps  # breaks: spaces
    assert [f.name for f in out.parent.iterdir()] == ["hyp.en"]  # no temp file left behind

    # stdin gives the same text on stdout
    p = subprocess.run([PY, TRANSLATE, "--checkpoint", str(checkpoint)], input=src.encode(), capture_output=True,
                       cwd=REPO, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr.decode()
    assert p.stdout.decode() == text


def test_failed_run_leaves_output_untouched(checkpoint, tmp_path):
    out = tmp_path / "hyp.en"
    out.write_text("old\n")
    p = run([PY, TRANSLATE, "--checkpoint", checkpoint, "--input", tmp_path / "missing.de", "--output", out],
            check=False)  # fmt: skip
    assert p.returncode == 2 and p.stderr.startswith("error: cannot read") and len(p.stderr.splitlines()) == 1
    assert out.read_text() == "old\n" and [f.name for f in tmp_path.iterdir()] == ["hyp.en"]


def test_non_finite_weights_are_one_line(checkpoint, tmp_path):
    """A checkpoint whose weights hold a NaN or an infinity (it would translate every sentence to nothing) is
    refused: one error line naming the tensor, exit 2, no output."""
    for bad in (float("nan"), float("-inf")):
        ckpt = torch.load(checkpoint, weights_only=True)
        ckpt["model"]["decoder.0.ff.fc1.weight"][3, 1] = bad
        torch.save(ckpt, tmp_path / "bad.pt")
        p = run([PY, TRANSLATE, "--checkpoint", tmp_path / "bad.pt", "ein Hund", "eine Katze"], check=False)
        want = f"error: {tmp_path / 'bad.pt'} holds non-finite weights (decoder.0.ff.fc1.weight has NaN or inf) ("
        assert p.returncode == 2 and p.stdout == "" and p.stderr.startswith(want) and p.stderr.count("\n") == 1, p


def test_validation_bleu_scores_one_line_hypotheses():
    """train.py's evaluate() normalises hypotheses and references the way translate.py writes them."""
    from text import encode

    from transformer.train import evaluate

    model, tok, _ = breaking_model()
    src = ["ein Hund", "eine Katze"]
    ids = encode(tok, src)
    hyp = run_evaluate(evaluate, model, tok, (ids, ids, src, ["x y x", f"x{BREAKS}y"]))
    assert all(len(h.splitlines()) == 1 and h.startswith("x yx y") for _, _, h in hyp["samples"]), hyp["samples"]


def run_evaluate(evaluate, model, tok, data):
    from common.distributed import DistInfo

    args = SimpleNamespace(max_tokens=256, beam=1, samples=2)
    return evaluate(model, data, tok, args, DistInfo(), None)
