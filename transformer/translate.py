r"""Translate sentences with a checkpoint of transformer/train.py.

    python transformer/translate.py --checkpoint runs/transformer/best.pt "Ein Mann fährt Fahrrad."
    python transformer/translate.py --checkpoint runs/transformer/best.pt < sentences.txt > out.txt
    python transformer/translate.py --checkpoint runs/transformer/best.pt --input test.de --output test.hyp

The checkpoint carries the tokenizer and the model config, so nothing else is needed. Decoding is the
same code as validation (seq2seq.translate_ids: greedy, or beam search with --beam N).

Exactly one output line per input line, in order, for any reader: a line ends at "\n" only, and every
other character some tool ends a line at (\r, \v, \f, \x1c-\x1e, \x85, \u2028, \u2029) becomes a space,
in the input and in the translation (text.one_line, which validation BLEU uses too). An empty input line
gives an empty output line. --output appears whole or not at all (a file; a device or pipe it names, such as
/dev/stdout, is written as a stream).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ sits beside this folder
from seq2seq import ModelConfig, Transformer, translate_ids
from text import decode, encode, load_tokenizer, one_line, read_lines

from common.args import POSITIVE
from common.checkpoint import atomic_write, load_model_state
from common.errors import UserError, run_cli
from common.hardening.checks import check_checkpoint, check_path
from common.utils import amp_dtype


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sentences", nargs="*", help="sentences to translate (default: one per line from --input or stdin)")
    p.add_argument("--input", default=None, help="UTF-8 text file (or .gz), one sentence per line (default: stdin)")
    p.add_argument("--output", default=None, help="write the translations here, atomically (default: stdout)")
    p.add_argument("--checkpoint", required=True, help="last.pt or best.pt written by transformer/train.py")
    p.add_argument("--beam", type=POSITIVE, default=1, help="beam size (1: greedy)")
    p.add_argument("--max-tokens", type=POSITIVE, default=8192, help="source tokens per batch x beam")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--amp", choices=("auto", "bf16", "fp16", "none"), default="auto", help="auto: bf16 on GPU")
    return p


def check_args(args: argparse.Namespace) -> torch.device:
    """Every flag's value before the checkpoint is read; returns the device."""
    if args.sentences and args.input:
        raise UserError("give sentences as arguments or --input FILE, not both")
    for i, sentence in enumerate(args.sentences, start=1):
        try:
            sentence.encode()
        except UnicodeEncodeError:  # bytes of another encoding on the command line, surrogate-escaped by Python
            raw = sentence.encode(errors="surrogateescape")
            raise UserError(f"sentence {i} ({raw!r:.60}) is not UTF-8 (convert it: iconv -f latin1 -t utf-8)") from None
    if args.output is None and sys.stdout is None:
        raise UserError("stdout is closed, and the translations go there (pass --output FILE)")
    if args.output:
        check_path(args.output)
        out = Path(args.output)
        if out.is_dir():
            raise UserError(f"--output {args.output} is a directory (name a file to write)")
        parent = next((q for q in out.parents if q.exists()), None)
        if parent is not None and not parent.is_dir():
            raise UserError(f"--output {args.output} is under the file {parent} (fix the path)")
        try:  # a directory it cannot write in fails now, not after the translating (a device or pipe: once opened)
            if not out.exists() or out.is_file():
                tempfile.TemporaryFile(dir=parent).close()
        except OSError as e:
            raise UserError(f"--output {args.output}: cannot write in {parent} ({e.strerror}; pick another)") from None
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise UserError(f"--device {args.device} is not a device (cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda", "xpu", "mps"):
        raise UserError(f"--device {args.device} is not supported (cpu or cuda:N)")
    if device.type == "cuda" and torch.cuda.device_count() <= (device.index or 0):
        raise UserError(f"--device {args.device} but {torch.cuda.device_count()} CUDA GPU(s) are visible (use --device "
                        "cpu)")  # fmt: skip
    return device


def main(args: argparse.Namespace) -> None:
    device = check_args(args)
    try:
        import tokenizers  # noqa: F401  (load_tokenizer imports it)
    except ImportError:
        raise UserError("translate.py needs the tokenizers package (pip install tokenizers)") from None
    check_checkpoint(Path(args.checkpoint))  # hardening: not a checkpoint of ours (or pickled code) is one line
    ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=True)  # tensors and numbers: runs no code
    if "tokenizer" not in ckpt or "model_config" not in ckpt:
        raise UserError(f"{args.checkpoint} is not a transformer/train.py checkpoint (no tokenizer or model config)")
    if "shards" in ckpt and not ckpt["model"]:
        raise UserError(f"{args.checkpoint} is an --fsdp run's last.pt, whose weights are in shards: give its best.pt")
    bad = [k for k, v in ckpt["model"].items() if torch.is_floating_point(v) and not v.isfinite().all()]
    if bad:  # they would translate every sentence to nothing
        raise UserError(f"{args.checkpoint} holds non-finite weights ({bad[0]} has NaN or inf) (translate with an "
                        "earlier checkpoint, e.g. a step_*.pt of --keep-last)")  # fmt: skip
    tok = load_tokenizer(ckpt["tokenizer"], args.checkpoint)
    try:
        model = Transformer(ModelConfig(**ckpt["model_config"]))
    except (TypeError, ValueError, RuntimeError, AssertionError, ArithmeticError) as e:  # unknown or impossible sizes
        detail = " ".join(str(e).split())[:160]
        raise UserError(f"{args.checkpoint} holds no usable model config: {detail} (pass a best.pt that "
                        "transformer/train.py wrote)") from None  # fmt: skip
    load_model_state(model, ckpt["model"], args.checkpoint)
    model.to(device).eval()
    torch.backends.cuda.enable_cudnn_sdp(False)  # decoding brings a new shape every step: cuDNN would plan each one

    # read_lines ends a line at "\n" only (and drops a "\r" before it): the line count `wc -l` gives
    sentences = args.sentences or read_lines(Path(args.input or "/dev/stdin"))
    sentences = [one_line(s) for s in sentences]
    todo = [i for i, s in enumerate(sentences) if s.strip()]  # an empty (or blank) line stays empty
    limit = model.cfg.max_positions - 1
    sources = [ids[:limit] for ids in encode(tok, [sentences[i] for i in todo])]
    hyps = translate_ids(model, sources, args.max_tokens, args.beam, amp_dtype(args.amp, device))
    lines = [""] * len(sentences)
    for i, hyp in zip(todo, decode(tok, hyps)):
        lines[i] = one_line(hyp)
    text = "".join(line + "\n" for line in lines)
    if not text.count("\n") == len(text.splitlines()) == len(sentences):  # a bug, never the user's input
        raise RuntimeError(f"{len(sentences)} input lines but {len(text.splitlines())} output lines")
    write_out(text, args.output)


def write_out(text: str, output: str | None) -> None:
    """``text`` to stdout, into the device or pipe ``output`` names (/dev/stdout, a FIFO), or to the file it names,
    atomically; a write that fails (a full disk, a file size limit, a pipe whose reader has gone) is one line."""
    try:
        if output is None:
            sys.stdout.write(text)
            sys.stdout.flush()
        elif Path(output).exists() and not Path(output).is_file():  # in place: a rename would put a file there
            with open(output, "w") as f:
                f.write(text)
        else:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(output) as f:
                f.write(text.encode())
    except OSError as e:
        if output is None:  # Python's own flush of stdout at exit would fail again, after the error line
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        hint = "its reader exited first" if e.errno == errno.EPIPE else "make room, or write elsewhere"
        raise UserError(f"cannot write the translations to {output or 'stdout'}: {e.strerror} ({hint})") from None


if __name__ == "__main__":
    run_cli(main, get_args_parser().parse_args())
