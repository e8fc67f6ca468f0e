"""Train an encoder-decoder Transformer for translation with DistributedDataParallel.

    python transformer/train.py --synthetic --preset tiny --epochs 2                  # 1 process, no data
    python transformer/train.py --data /path/to/multi30k --lang-src de --lang-tgt en --preset small
    torchrun --standalone --nproc_per_node=2 transformer/train.py ...                 # N processes
    python transformer/translate.py --checkpoint runs/transformer/best.pt "Ein Satz."

Read top to bottom: arguments -> distributed setup -> text -> tokenizer -> packed batches
-> model -> optimizer -> resume -> training loop with periodic evaluation (loss and sacreBLEU over
the whole validation set) and checkpoints. The DDP recipe is four steps, marked [DDP 1-4].
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

gc.disable()  # until the end of the imports: see there
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # find common/ when run as a script
from common.checkpoint import CheckpointWriter, eval_due, load_checkpoint, load_model_state, resolve_resume
from common.checks import check_positive_ints, check_shared, finite, need
from common.data import ExactEvalSampler, init_worker, worker_context
from common.distributed import (
    add_dist_args,
    all_reduce_sum,
    broadcast_object,
    cleanup_distributed,
    is_dist,
    mix_seed,
    print0,
    seed_everything,
    setup_distributed,
)
from common.errors import UserError, run_cli
from common.metrics import LossWindow, MetricsLogger, Progress, prepare_output_dir
from common.utils import StopSignal, amp_dtype, autocast, check_finite_loss, count_params, param_groups
from common.watchdog import CHECKPOINT, EVAL_STEP, Watchdog
from transformer.data import (
    PAD,
    PackedBatchSampler,
    PackedRows,
    ParallelDataset,
    collate,
    decode,
    encode,
    load_corpus,
    one_line,
    shared_tokenizer,
    token_batches,
    tokenizers_done_forking,
)
from transformer.model import PRESETS, ModelConfig, Transformer, allow_cudnn_attention, translate_ids

# Python's cyclic garbage collector would run hundreds of times during the imports above, scanning the same young
# objects over and over: about a quarter of a process's start-up CPU, paid again by every rank and restart
# (bench/startup.py). It was off for them; what they built lives as long as the process, so freeze it out of every
# later collection (each then skips these few hundred thousand objects) and turn the collector back on. No
# collection first: DataLoader workers run this module's top level again, and one would scan all they inherit.
gc.freeze()
gc.enable()

T_START = time.time()


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        default="opus_books",
        help="Hugging Face dataset name, a dir of line-aligned {split}.{lang}[.gz] files, or a save_to_disk dir",
    )
    g.add_argument("--data-config", default=None, help="Hub dataset config (default: {src}-{tgt} or {tgt}-{src})")
    g.add_argument("--lang-src", default="en")
    g.add_argument("--lang-tgt", default="it")
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
    g.add_argument("--compile", action="store_true", help="torch.compile the training model (one static shape)")
    g.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    g.add_argument(
        "--cudnn-attention",
        action="store_true",
        help="let attention use cuDNN (PyTorch's first pick on H100; slow with changing batch shapes)",
    )
    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=int, default=20)
    g.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    g.add_argument(
        "--max-tokens", type=int, default=4096, help="tokens per batch per process: max-tokens // pack-len rows"
    )
    g.add_argument("--accum-steps", type=int, default=1, help="gradient accumulation micro-batches per step")
    g.add_argument("--lr", type=float, default=5e-4, help="peak LR (Adam; not scaled with the batch)")
    g.add_argument("--warmup-steps", type=int, default=1000, help="linear warmup, then LR ~ 1/sqrt(step)")
    g.add_argument("--wd", "--weight-decay", dest="weight_decay", type=float, default=0.0)
    g.add_argument("--label-smoothing", type=float, default=0.1)
    g.add_argument("--clip-grad", type=float, default=1.0, help="max gradient norm (0: off)")
    g.add_argument(
        "--amp", choices=("auto", "bf16", "fp16", "none"), default="auto", help="auto: bf16 on GPU, off on CPU"
    )
    g = p.add_argument_group("evaluation")
    g.add_argument("-e", "--evaluate", action="store_true", help="only evaluate the checkpoint given by --resume")
    g.add_argument("--beam", type=int, default=1, help="beam size for BLEU decoding (1: greedy)")
    g.add_argument("--eval-every", type=int, default=1, help="evaluate every N epochs and at the end (0: never)")
    g.add_argument("--samples", type=int, default=3, help="sample translations to print at each evaluation")
    g = p.add_argument_group("run")
    g.add_argument("--output-dir", default="runs/transformer")
    g.add_argument("--resume", default="auto", help="auto (continue from output-dir/last.pt if present) | PATH | none")
    g.add_argument("--overwrite", action="store_true", help="with --resume none: start over where a run saved")
    g.add_argument("--save-every-steps", type=int, default=0, help="also checkpoint every N steps (0: at epoch end)")
    g.add_argument("--keep-last", type=int, default=0, help="keep the N newest step_*.pt copies (0: none)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("-p", "--print-freq", type=int, default=50, help="log every N steps")
    g.add_argument("--wandb", action="store_true", help="log to Weights & Biases from rank 0 (honours WANDB_MODE)")
    add_dist_args(p)
    return p


def check_args(args: argparse.Namespace) -> None:
    """Every flag's value, before any process group, text or model (common/checks.py has the shared rules)."""
    check_shared(args)
    check_positive_ints(args, "max_tokens", "pack_len", "beam", "d_model", "layers", "heads", "d_ff")
    top = ModelConfig.max_positions - 1
    need(0 < args.max_len <= top, "--max-len", args.max_len, f"must be in 1..{top}", "the model's positions")
    need(args.vocab_size >= 8, "--vocab-size", args.vocab_size, "must be at least 8", "e.g. 8000")
    for attr, flag in (("val_split", "--val-split"), ("warmup_steps", "--warmup-steps"), ("samples", "--samples")):
        need(getattr(args, attr) >= 0, flag, getattr(args, attr), "must be 0 or more", "0: none")
    need(finite(args.clip_grad) and args.clip_grad >= 0, "--clip-grad", args.clip_grad, "must be >= 0", "0: off")
    need(args.dropout is None or 0 <= args.dropout < 1, "--dropout", args.dropout, "must be in [0, 1)", "e.g. 0.1")
    width, heads = args.d_model or PRESETS[args.preset]["d_model"], args.heads or PRESETS[args.preset]["n_heads"]
    need(width % heads == 0, "--heads", heads, f"does not divide the width {width}", "pick a divisor of --d-model")


def inverse_sqrt(step: int, warmup: int) -> float:
    """LR multiplier: linear warmup to 1, then warmup**0.5 / step**0.5. Pure in `step`."""
    step += 1
    return min(step / warmup, (warmup / step) ** 0.5) if warmup > 0 else step**-0.5


def bleu_signature() -> str:
    """sacreBLEU's signature for the settings evaluate() uses (it needs one scored corpus to exist)."""
    from sacrebleu.metrics import BLEU

    bleu = BLEU()
    bleu.corpus_score(["a"], [["a"]])
    return str(bleu.get_signature())


@torch.no_grad()
def evaluate(model, data, tok, args, info, dtype) -> dict:
    """Loss and sacreBLEU over the whole split: each pair on one rank, the hypotheses gathered on rank 0.

    `model` is the bare model: ranks hold different numbers of batches, and a DDP forward would wait
    for the others. It is never the compiled one either (--compile wraps the DDP model), so evaluation's
    many batch shapes run eagerly instead of compiling one graph each.
    """
    from sacrebleu.metrics import BLEU

    src_ids, tgt_ids, src_text, refs = data
    device = info.device
    model.eval()
    mine = list(ExactEvalSampler(len(src_ids), info.rank, info.world_size))  # rank r: r, r+W, r+2W, ...
    lengths = [max(len(src_ids[i]), len(tgt_ids[i])) + 1 for i in range(len(src_ids))]
    pairs = ParallelDataset(src_ids, tgt_ids)
    sums = torch.zeros(2, device=device, dtype=torch.float64)  # summed NLL, target tokens
    for batch in token_batches(sorted(mine, key=lengths.__getitem__), lengths, args.max_tokens):
        src, tgt_in, tgt_out = (t.to(device) for t in collate([pairs[i] for i in batch]))
        with autocast(device, dtype):
            logits = model(src, tgt_in)
        nll = F.cross_entropy(logits.float().flatten(0, 1), tgt_out.flatten(), ignore_index=PAD, reduction="sum")
        sums += torch.stack([nll.double(), (tgt_out != PAD).sum().double()])
    loss, n_tok = all_reduce_sum(sums).tolist()
    hyps = decode(tok, translate_ids(model, [src_ids[i] for i in mine], args.max_tokens, args.beam, dtype))
    gathered = [None] * info.world_size if info.is_main else None
    if is_dist():
        dist.gather_object(list(zip(mine, hyps)), gathered, dst=0)
    else:
        gathered = [list(zip(mine, hyps))]
    result = None
    if info.is_main:  # detokenized, cased corpus BLEU against the original reference text
        by_index = dict(pair for part in gathered for pair in part)
        hyps = [one_line(by_index[i]) for i in range(len(refs))]  # as translate.py writes them
        bleu = BLEU()
        score = bleu.corpus_score(hyps, [[one_line(r) for r in refs]]).score
        samples = [(src_text[i], refs[i], hyps[i]) for i in range(min(args.samples, len(refs)))]
        result = {"bleu": score, "bleu_signature": str(bleu.get_signature()), "samples": samples}
    result = broadcast_object(result)
    model.train()
    return {"loss": loss / max(n_tok, 1), **result, "count": len(refs)}


# ------------------------------------------------------------------ main


def main(args: argparse.Namespace) -> None:
    pack_len = min(args.pack_len, args.max_tokens)
    if args.max_len >= pack_len:
        print0(f"note: --max-len {args.max_len} lowered to {pack_len - 1}: a pair must fit a row of {pack_len}")
    try:
        import sacrebleu  # noqa: F401  (imported where used; checked here so a missing one fails before training)
        from tokenizers import Tokenizer
    except ImportError as e:
        raise UserError(f"this script needs the {e.name} package (pip install {e.name})") from None
    # [DDP 1] init the process group (torchrun, Slurm, MPI, --dist-url or none) and pick this rank's device.
    info = setup_distributed(args)
    device = info.device
    seed_everything(args.seed, info.rank)
    out = prepare_output_dir(args.output_dir)
    dtype = amp_dtype(args.amp, device)
    allow_cudnn_attention(args.cudnn_attention)  # off by default: see allow_cudnn_attention

    # ---- resume: read the checkpoint first, its tokenizer decides how text becomes ids
    ckpt_path = resolve_resume(args.resume, out)
    ckpt = load_checkpoint(ckpt_path) if ckpt_path is not None else None

    # ---- text (the Hub is contacted by rank 0 only)
    splits = load_corpus(args, info)
    src_lang, tgt_lang = ("src", "tgt") if args.synthetic else (args.lang_src, args.lang_tgt)
    print0(", ".join(f"{k}: {len(v[0])} pairs" for k, v in splits.items()) + f" ({src_lang}->{tgt_lang})")

    # ---- tokenizer: trained on the training split by rank 0, sent to the others, kept in every checkpoint
    if ckpt is not None and "tokenizer" not in ckpt:
        raise UserError(f"checkpoint {ckpt_path} has no tokenizer (not from transformer/train.py?)")
    tok_json = ckpt["tokenizer"] if ckpt is not None else shared_tokenizer(args, splits["train"], info)
    if info.is_main:
        (out / "tokenizer.json").write_text(tok_json)
    tok = Tokenizer.from_str(tok_json)

    # ---- token ids; drop (and count) over-long training pairs; evaluation keeps every pair
    ids = {k: (encode(tok, s), encode(tok, t)) for k, (s, t) in splits.items()}
    tokenizers_done_forking()
    max_len = min(args.max_len, pack_len - 1)  # a row holds its pairs and a tail of at least one <pad>
    keep = [i for i, (s, t) in enumerate(zip(*ids["train"])) if max(len(s), len(t)) + 1 <= max_len]
    n_long = len(ids["train"][0]) - len(keep)
    train_src, train_tgt = [ids["train"][0][i] for i in keep], [ids["train"][1][i] for i in keep]
    print0(f"vocab {tok.get_vocab_size()} ({args.tokenizer}); dropped {n_long} training pairs over {max_len} tokens")
    if not train_src:
        raise UserError(f"no training pair fits in {max_len} tokens (raise --max-len or --pack-len)")
    limit = ModelConfig.max_positions - 1  # the decoder also needs room for <s>
    eval_sets = {
        k: ([s[:limit] for s in ids[k][0]], [t[:limit] for t in ids[k][1]], *splits[k])
        for k in ("val", "test")
        if k in splits
    }

    # [DDP 2] sentence pairs packed end to end into rows of pack_len tokens (data.PackedBatchSampler): every batch has
    # the same shape, every rank the same number of batches, the order of epoch e is a function of (seed, e), and
    # an epoch's last step is topped up with the next epoch's first rows (empty rows only at the end of the run).
    rows = args.max_tokens // pack_len
    sampler = PackedBatchSampler(
        [len(s) + 1 for s in train_src],
        [len(t) + 1 for t in train_tgt],
        pack_len,
        rows,
        info.rank,
        info.world_size,
        args.seed,
        args.accum_steps,
        args.epochs,
    )
    train_loader = torch.utils.data.DataLoader(
        PackedRows(ParallelDataset(train_src, train_tgt), pack_len),
        batch_sampler=sampler,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        persistent_workers=args.workers > 0,
        worker_init_fn=init_worker,
        multiprocessing_context=worker_context(args.workers),  # not forked from this process: see worker_context
    )

    # ---- model
    preset = PRESETS[args.preset]
    overrides = {"d_model": args.d_model, "n_heads": args.heads, "d_ff": args.d_ff, "dropout": args.dropout}
    overrides.update(enc_layers=args.layers, dec_layers=args.layers)
    cfg = ModelConfig(tok.get_vocab_size(), **{**preset, **{k: v for k, v in overrides.items() if v is not None}})
    model = Transformer(cfg).to(device)
    model_without_ddp = model  # what we save, evaluate and restore
    # [DDP 3] wrap the model: gradients are averaged across ranks during backward.
    if info.world_size > 1:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True
        )

    def token_loss(logits, tgt_out):
        """Summed token cross-entropy of one batch. Compiled (--compile), the loss over the whole vocabulary
        (batch x length x vocab, the largest activation) fuses into a few kernels."""
        return F.cross_entropy(
            logits.flatten(0, 1),
            tgt_out.flatten(),
            ignore_index=PAD,
            label_smoothing=args.label_smoothing,
            reduction="sum",
        )

    if args.compile:
        # Packed batches all have one shape: the whole model (block masks included) compiles once. Compiling the DDP
        # model lets the compiler split the graph at DDP's gradient buckets, so all-reduces overlap the backward.
        model = torch.compile(model, dynamic=False, mode=args.compile_mode)
        token_loss = torch.compile(token_loss, dynamic=False)

    # ---- optimizer and LR schedule (a pure function of the step)
    optimizer = torch.optim.AdamW(
        param_groups(model_without_ddp, args.weight_decay),
        lr=args.lr,
        betas=(0.9, 0.98),
        eps=1e-9,
        fused=device.type == "cuda",
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(inverse_sqrt, warmup=args.warmup_steps))
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    # ---- resume (same command restarted by torchrun/Slurm continues where it stopped)
    epoch, step, batch_in_epoch, best, wandb_id, eval_step, window = 0, 0, 0, 0.0, None, 0, None
    if ckpt is not None:
        load_model_state(model_without_ddp, ckpt["model"], ckpt_path)
        try:
            optimizer.load_state_dict(ckpt["optimizer"])
            scheduler.load_state_dict(ckpt["scheduler"])
            scaler.load_state_dict(ckpt["scaler"])
        except (KeyError, ValueError) as e:
            raise UserError(f"checkpoint {ckpt_path} has no usable optimizer state ({e})") from None
        epoch, step, batch_in_epoch, best = ckpt["epoch"], ckpt["step"], ckpt["batch_in_epoch"], ckpt["best_metric"]
        wandb_id, eval_step, window = ckpt.get("wandb_id"), ckpt.get("eval_step", step), ckpt.get("loss_window")
        print0(f"resumed from {ckpt_path}: epoch {epoch}, step {step}, batch {batch_in_epoch} of the epoch")
        old_ws, old_accum = ckpt.get("world_size"), ckpt["args"].get("accum_steps")
        if (old_ws, old_accum) != (info.world_size, args.accum_steps):
            # Another world size or accumulation cuts epochs into other batches, so "skip the first k" would
            # repeat some pairs and miss others: continue from the start of the next epoch instead.
            print0(
                f"note: checkpoint was written with world size {old_ws} x accum {old_accum}, now "
                f"{info.world_size} x {args.accum_steps}; continuing at the next epoch boundary "
                "(the data order differs from an uninterrupted run)"
            )
            epoch, batch_in_epoch, window = epoch + (batch_in_epoch > 0), 0, None
        del ckpt

    # writes on a thread: the step waits only for a copy of the state in host memory
    writer = CheckpointWriter(out if info.is_main else None)

    def save(name: str, keep_last: int = 0) -> float:
        """Returns the seconds it took, which the throughput leaves out (as it does evaluation)."""
        t = time.time()
        watchdog.beat(CHECKPOINT)
        window = loss_window.state()  # every rank's part
        check_finite_loss(window["sums"].sum(), step)  # the losses since the last log point
        if info.is_main:  # [DDP 4] only rank 0 writes, atomically
            writer.save(
                {
                    "model": model_without_ddp.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "scaler": scaler.state_dict(),
                    "epoch": epoch,
                    "step": step,
                    "batch_in_epoch": batch_in_epoch,
                    "best_metric": best,
                    "eval_step": eval_step,
                    "loss_window": window,
                    "args": vars(args),
                    "world_size": info.world_size,
                    "wandb_id": wandb_id,
                    "tokenizer": tok_json,  # translate.py needs nothing but this file
                    "model_config": asdict(cfg),
                    "langs": [src_lang, tgt_lang],
                },
                out / name,
                keep_last=keep_last,
            )
        return time.time() - t

    n_params = count_params(model_without_ddp.parameters())
    logger = MetricsLogger(out, info, args.wandb)
    config = logger.write_config(
        args,
        {
            "model_config": asdict(cfg),
            "params": n_params,
            "train_pairs": len(train_src),
            "dropped_long_pairs": n_long,
            "steps_per_epoch": round(sampler.steps_per_epoch, 2),
            "max_tokens_per_step": rows * pack_len * info.world_size * args.accum_steps,
            "pack_len": pack_len,
            "rows_per_batch": rows,
            "row_fill": sampler.fill,
            "bleu_signature": bleu_signature(),
        },
    )
    wandb_id = logger.start_wandb("transformer", config, wandb_id)
    print0(
        f"transformer {args.preset} ({n_params / 1e6:.1f}M params) on {len(train_src)} pairs | "
        f"{info.world_size} process(es) on {device.type} ({info.launcher}) | {rows} x {pack_len} tokens x "
        f"{info.world_size} x {args.accum_steps} per step, {sampler.fill:.1%} of them real | "
        f"{sampler.steps_per_epoch:.1f} steps/epoch | peak lr {args.lr:.4g}"
    )
    total_steps = sampler.steps_before(args.epochs)
    max_steps = min(total_steps, args.max_steps or total_steps)
    progress = Progress(info, max_steps, step)
    stop = StopSignal()
    watchdog = Watchdog(args.stall_timeout, info.rank)  # a stall becomes stacks and an exit

    def run_eval(split: str) -> dict:
        watchdog.beat(EVAL_STEP)
        m = evaluate(model_without_ddp, eval_sets[split], tok, args, info, dtype)
        logger.log(
            {"split": split, "epoch": epoch, "step": step, "loss": m["loss"], "bleu": m["bleu"], "count": m["count"]}
        )
        progress.write(
            f"epoch {epoch} {split}: loss {m['loss']:.4f} BLEU {m['bleu']:.2f} ({m['count']} sentences, "
            f"{'greedy' if args.beam == 1 else f'beam {args.beam}'}; sacreBLEU {m['bleu_signature']})"
        )
        for s, r, h in m["samples"]:
            progress.write(f"  src: {s}\n  ref: {r}\n  hyp: {h}")
        return m

    if args.evaluate:
        if ckpt_path is None:
            raise UserError("--evaluate needs a checkpoint: --resume PATH (or an output dir with last.pt)")
        for split in eval_sets:
            run_eval(split)
        return

    # ---- training loop
    def due() -> bool:  # an evaluation at this position, not yet recorded
        return eval_due(args.eval_every, args.epochs, epoch, batch_in_epoch, step, max_steps, eval_step)

    stopped, pending, loss_window = False, due(), LossWindow(info, step, window)
    if ckpt_path is not None and (step < max_steps or pending):
        logger.rewind(step, eval_step)
    # One DataLoader iterator for the whole run: the sampler deals epoch after epoch, so the workers never restart
    # at an epoch boundary (on 4 GPUs the restart and the epoch plan cost each rank about 0.1 s:
    # docs/runs/tr_base_m8_trace_eager_restart_4xh100.txt).
    sampler.set_epoch(epoch, skip=batch_in_epoch, until=args.epochs)
    batches = watchdog.batches(train_loader)
    while not stopped and (step < max_steps or pending):
        model.train()
        step_tokens = sampler.step_tokens(epoch)  # target tokens of each optimizer step, all ranks together
        # an evaluation that the last process did not record comes before any further step
        for i in () if pending else range(batch_in_epoch, sampler.steps_in(epoch) * args.accum_steps):
            src, tgt_in, tgt_out, src_doc, tgt_doc = (t.to(device, non_blocking=True) for t in next(batches))
            if i % args.accum_steps == 0:  # dropout masks depend on (seed, rank, step) only: resumable
                torch.manual_seed(mix_seed(args.seed, info.rank, step))
            sync = (i + 1) % args.accum_steps == 0
            with model.no_sync() if (not sync and info.world_size > 1) else contextlib.nullcontext():
                with autocast(device, dtype):
                    loss = token_loss(model(src, tgt_in, src_doc, tgt_doc), tgt_out)
                # DDP averages gradients over ranks; x world_size / tokens makes the step's gradient the mean
                # over every target token of the step, however unevenly the tokens fall on ranks and micro-batches.
                scaler.scale(loss * (info.world_size / max(1, step_tokens[i // args.accum_steps]))).backward()
            loss_window.sum += loss.detach()
            if not sync:
                continue
            scaler.unscale_(optimizer)
            if args.clip_grad > 0:
                nn.utils.clip_grad_norm_(model_without_ddp.parameters(), args.clip_grad)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            batch_in_epoch = i + 1
            loss_window.n += step_tokens[i // args.accum_steps]
            if step % args.print_freq == 0 or step == max_steps:
                # per target token; the one host sync
                loss_avg = all_reduce_sum(loss_window.sum.clone()).item() / loss_window.n
                tps = loss_window.n / (time.time() - loss_window.t0)
                check_finite_loss(loss_avg, step)
                lr = scheduler.get_last_lr()[0]
                logger.log(
                    {"split": "train", "epoch": epoch, "step": step, "loss": loss_avg, "lr": lr, "tok_per_s": tps}
                )
                progress.update(step, f"epoch {epoch} loss {loss_avg:.4f} lr {lr:.4g} {tps:.0f} tok/s")
                loss_window.reset(step)
            if args.save_every_steps and step % args.save_every_steps == 0:
                loss_window.t0 += save("last.pt", args.keep_last)
            stopped = stop.should_stop()
            if step >= max_steps or stopped:
                break
        epoch_done = batch_in_epoch >= sampler.steps_in(epoch) * args.accum_steps
        if epoch_done:
            epoch, batch_in_epoch = epoch + 1, 0
        if not stopped and due():  # a preempted run saves at once: its rerun evaluates
            m = run_eval("val")
            if m["bleu"] >= best:  # >=: a first evaluation at BLEU 0 still leaves a best.pt
                best = m["bleu"]
                save("best.pt")
            if step >= max_steps and "test" in eval_sets:  # recorded with the final evaluation: done once
                run_eval("test")
            eval_step = step
            check_finite_loss(all_reduce_sum(loss_window.sum.clone()), step)  # before they are dropped
            loss_window.reset(step)  # keep eval time out of the throughput
        pending = False
        loss_window.t0 += save("last.pt")  # a small corpus checkpoints often; keep that out of the tokens/s too
    stop.close()
    progress.close()
    writer.wait()  # the last checkpoint is on disk before the run says so
    if stopped:
        stop.exit_preempted(step, logger)
    watchdog.stop()
    print0(f"done: step {step}, best val BLEU {best:.2f}, wall {time.time() - T_START:.1f}s since start")
    logger.close()


def cli() -> None:
    args = get_args_parser().parse_args()
    check_args(args)
    try:
        main(args)
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # fail instead of hanging on a dead rank
    run_cli(cli)
