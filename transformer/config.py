"""transformer/train.py's flags, and the checks of their values before any process group, text or model exists."""

from __future__ import annotations

import argparse
import os

import torch
from common.checks import add_run_args, check_positive_ints, check_shared, finite, need

from common.distributed import add_dist_args
from common.errors import UserError

from .model import PRESETS, ModelConfig, Transformer


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train an encoder-decoder Transformer for translation with DistributedDataParallel.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        default="opus_books",
        help="Hugging Face dataset name, a dir of line-aligned {split}.{lang}[.gz] files, or a save_to_disk dir",
    )
    g.add_argument("--data-config", default=None, help="Hub dataset config (default: {src}-{tgt} or {tgt}-{src})")
    g.add_argument("--lang-src", default="en", help="source language: train.<lang>[.gz] in --data")
    g.add_argument("--lang-tgt", default="it", help="target language")
    g.add_argument("--synthetic", action="store_true", help="made-up word-mapping + reversal task: no disk/network")
    g.add_argument("--val-split", type=int, default=0, help="without a val split, hold out N train pairs (0: auto)")
    g.add_argument("--max-len", type=int, default=256, help="drop (and count) training pairs longer than this")
    g.add_argument("--tokenizer", choices=("bpe", "wordlevel"), default="bpe", help="joint vocabulary type")
    g.add_argument("--vocab-size", type=int, default=8000, help="joint source+target vocabulary size")
    g.add_argument("-j", "--workers", type=int, default=2, help="DataLoader workers per process (they pack rows)")
    g.add_argument("--pack-len", type=int, default=1024, help="tokens per packed row (at most --max-tokens)")
    g = p.add_argument_group("model")
    g.add_argument("--preset", choices=tuple(PRESETS), default="base", help="base: 512 wide, 6+6 layers")
    g.add_argument("--d-model", type=int, default=None, help="override the preset's width")
    g.add_argument("--layers", type=int, default=None, help="override the preset's encoder and decoder depth")
    g.add_argument("--heads", type=int, default=None, help="override the preset's attention heads")
    g.add_argument("--d-ff", type=int, default=None, help="override the preset's feed-forward width")
    g.add_argument("--dropout", type=float, default=None, help="override the preset's dropout")
    g.add_argument("--fsdp", nargs="?", const="layer", choices=("layer", "model"), default=None,
                   help="shard weights, gradients and optimizer state (FSDP2), not DDP; gathered a layer at a "
                   "time (layer, the default: least memory) or all at once a step (model: fastest)")  # fmt: skip
    g.add_argument("--compile", action="store_true", help="torch.compile the training model (one static shape)")
    g.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    g.add_argument(
        "--cudnn-attention",
        action="store_true",
        help="let attention use cuDNN (PyTorch's first pick on H100; slow with changing batch shapes)",
    )
    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=int, default=20, help="passes over the training pairs")
    g.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    g.add_argument(
        "--max-tokens", type=int, default=4096, help="tokens per batch per process: max-tokens // pack-len rows"
    )
    g.add_argument("--accum-steps", type=int, default=1, help="gradient accumulation micro-batches per step")
    g.add_argument("--lr", type=float, default=5e-4, help="peak LR (AdamW; not scaled with the batch)")
    g.add_argument("--warmup-steps", type=int, default=1000, help="linear warmup, then LR ~ 1/sqrt(step)")
    g.add_argument("--wd", "--weight-decay", dest="weight_decay", type=float, default=0.0, help="on weights only")
    g.add_argument("--label-smoothing", type=float, default=0.1, help="of the cross-entropy targets")
    g.add_argument("--clip-grad", type=float, default=1.0, help="max gradient norm (0: off)")
    g.add_argument(
        "--amp", choices=("auto", "bf16", "fp16", "none"), default="auto", help="auto: bf16 on GPU, off on CPU"
    )
    g = p.add_argument_group("evaluation")
    g.add_argument("-e", "--evaluate", action="store_true", help="only evaluate the checkpoint given by --resume")
    g.add_argument("--beam", type=int, default=1, help="beam size for BLEU decoding (1: greedy)")
    g.add_argument("--samples", type=int, default=3, help="sample translations to print at each evaluation")
    add_run_args(p, "runs/transformer")
    add_dist_args(p)
    return p


def check_args(args: argparse.Namespace) -> None:
    check_shared(args, writes=("tokenizer.json",))
    try:
        import sacrebleu  # noqa: F401  (imported where used; checked here so a missing one fails before training)
        import tokenizers  # noqa: F401
    except ImportError as e:
        raise UserError(f"this script needs the {e.name} package (pip install {e.name})") from None
    check_positive_ints(args, "max_tokens", "pack_len", "beam", "d_model", "layers", "heads", "d_ff")
    top = ModelConfig.max_positions - 1
    need(0 < args.max_len <= top, "--max-len", args.max_len, f"must be in 1..{top}", "the model's positions")
    need(args.vocab_size >= 8, "--vocab-size", args.vocab_size, "must be at least 8", "e.g. 8000")
    need(args.vocab_size <= 2**24, "--vocab-size", args.vocab_size, f"must be at most {2**24}",
         "the tokenizer trainer reserves memory for every entry up front; e.g. 8000")  # fmt: skip
    for attr, flag in (("val_split", "--val-split"), ("warmup_steps", "--warmup-steps"), ("samples", "--samples")):
        need(getattr(args, attr) >= 0, flag, getattr(args, attr), "must be 0 or more", "0: none")
    need(finite(args.clip_grad) and args.clip_grad >= 0, "--clip-grad", args.clip_grad, "must be >= 0", "0: off")
    need(args.dropout is None or 0 <= args.dropout < 1, "--dropout", args.dropout, "must be in [0, 1)", "e.g. 0.1")
    need(not (args.fsdp and args.amp == "fp16"), "--amp", "fp16", "does not work with --fsdp", "use --amp bf16")
    need(not (args.fsdp and args.keep_last), "--keep-last", args.keep_last, "does not work with --fsdp", "0 with it")
    graphs = args.fsdp and args.compile_mode == "reduce-overhead"  # measured: BENCHMARKS.md, "DDP or FSDP2"
    need(not graphs, "--compile-mode", "reduce-overhead", "is slower than --compile alone under --fsdp", "drop it")
    cfg = model_config(args, args.vocab_size)  # the vocabulary the tokenizer may reach
    need(cfg.d_model % cfg.n_heads == 0, "--heads", cfg.n_heads, f"does not divide the width {cfg.d_model}",
         "pick a divisor of --d-model")  # fmt: skip
    check_size(cfg)


def model_config(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    """The preset, with the flags that override it."""
    overrides = {"d_model": args.d_model, "n_heads": args.heads, "d_ff": args.d_ff, "dropout": args.dropout}
    overrides.update(enc_layers=args.layers, dec_layers=args.layers)
    return ModelConfig(vocab_size, **{**PRESETS[args.preset], **{k: v for k, v in overrides.items() if v is not None}})


def check_size(cfg: ModelConfig) -> None:
    """Every rank builds the whole model on the host before it moves or shards it (and on a CPU trains it there,
    with gradients and AdamW's two moments): a model that cannot fit would be killed by the kernel without a word."""
    if not hasattr(os, "sysconf"):  # Windows: no portable figure for the host's memory
        return
    with torch.device("meta"):  # shapes only: no memory
        n = sum(p.numel() for p in Transformer(cfg).parameters())
    size, host = n * (4 if torch.cuda.is_available() else 16), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need(size <= host, "the model", f"of {n / 1e9:.2f}B parameters", f"needs {size / 2**30:.0f} GiB on the host, "
         f"which has {host / 2**30:.0f} GiB", "lower --d-model, --d-ff, --layers or --vocab-size")  # fmt: skip
