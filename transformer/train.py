"""Train an encoder-decoder Transformer for translation with DistributedDataParallel (or FSDP2: --fsdp).

    python transformer/train.py --synthetic --preset tiny --epochs 2                  # 1 process, no data
    python transformer/train.py --data /path/to/multi30k --lang-src de --lang-tgt en --preset small
    torchrun --standalone --nproc_per_node=2 transformer/train.py ...                 # N processes
    python transformer/translate.py --checkpoint runs/transformer/best.pt "Ein Satz."

main() is the recipe, top to bottom: process group -> text -> tokenizer -> packed batches -> model -> optimizer ->
resume -> for each epoch, train_one_epoch(), evaluate() (loss and sacreBLEU over the whole validation set) and a
checkpoint. The six steps of DDP are marked [DDP 1] to [DDP 6].
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ sits beside this folder
import fsdp
import text
from seq2seq import PRESETS, ModelConfig, Transformer, check_size, model_config, translate_ids

from common import hardening  # [hardening] fault survival, one call in main(); a minimal copy deletes these lines
from common.args import ABOVE_0, AT_LEAST_0, COUNT, FRACTION, POSITIVE, add_shared_args, checked, from_checkpoint
from common.checkpoint import CheckpointWriter, Position, checkpoint_state, resolve_resume, resume
from common.data import loader_kwargs
from common.distributed import all_reduce_sum, mix_seed, print0, setup_distributed, stop_requested, watched
from common.errors import UserError, run_cli
from common.metrics import LossWindow, MetricsLogger
from common.utils import amp_dtype, check_finite, param_groups

MAX_LEN = ModelConfig.max_positions - 1  # the decoder also needs room for <s>


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    g = p.add_argument_group("data")
    g.add_argument("--data", default="opus_books", help="Hugging Face dataset name, a dir of line-aligned "
                   "{split}.{lang}[.gz] files, or a save_to_disk dir")  # fmt: skip
    g.add_argument("--data-config", default=None, help="Hub dataset config (default: {src}-{tgt} or {tgt}-{src})")
    g.add_argument("--lang-src", default="en", help="source language: train.<lang>[.gz] in --data")
    g.add_argument("--lang-tgt", default="it", help="target language")
    g.add_argument("--synthetic", action="store_true", help="made-up word-mapping + reversal task: no disk/network")
    g.add_argument("--val-split", type=COUNT, default=0, help="without a val split, hold out N train pairs (0: auto)")
    g.add_argument("--max-len", type=checked(int, lambda v: 1 <= v <= MAX_LEN, f"must be in 1..{MAX_LEN}"), default=256,
                   help="drop (and count) training pairs longer than this")  # fmt: skip
    g.add_argument("--tokenizer", choices=("bpe", "wordlevel"), default="bpe", help="joint vocabulary type")
    g.add_argument("--vocab-size", type=checked(int, lambda v: 8 <= v <= 2**24, f"must be in 8..{2**24}"), default=8000,
                   help="joint source+target vocabulary (the trainer reserves memory for each entry)")  # fmt: skip
    g.add_argument("-j", "--workers", type=COUNT, default=2, help="DataLoader workers per process (they pack rows)")
    g.add_argument("--pack-len", type=POSITIVE, default=1024, help="tokens per packed row (at most --max-tokens)")
    add_shared_args(p, "runs/transformer", epochs=20, vision=False)
    g = p.add_argument_group("transformer")
    g.add_argument("--preset", choices=tuple(PRESETS), default="base", help="base: 512 wide, 6+6 layers")
    g.add_argument("--d-model", type=POSITIVE, default=None, help="override the preset's width")
    g.add_argument("--layers", type=POSITIVE, default=None, help="override the preset's encoder and decoder depth")
    g.add_argument("--heads", type=POSITIVE, default=None, help="override the preset's attention heads")
    g.add_argument("--d-ff", type=POSITIVE, default=None, help="override the preset's feed-forward width")
    g.add_argument("--dropout", type=FRACTION, default=None, help="override the preset's dropout")
    g.add_argument("--fsdp", nargs="?", const="layer", choices=("layer", "model"), default=None,
                   help="shard weights, gradients and optimizer state (FSDP2), not DDP; gathered a layer at a "
                   "time (layer, the default: least memory) or all at once a step (model: fastest)")  # fmt: skip
    g.add_argument("--cudnn-attention", action="store_true", help="allow cuDNN attention (slow on changing shapes)")
    g = p.add_argument_group("optimization")
    g.add_argument("--max-tokens", type=POSITIVE, default=4096, help="tokens a micro-batch a process (in rows)")
    g.add_argument("--lr", type=ABOVE_0, default=5e-4, help="peak LR (AdamW; not scaled with the batch)")
    g.add_argument("--warmup-epochs", type=AT_LEAST_0, default=4.0, help="linear warmup, then LR ~ 1/sqrt(step)")
    g.add_argument("--wd", "--weight-decay", dest="weight_decay", type=AT_LEAST_0, default=0.0, help="weights only")
    g.add_argument("--label-smoothing", type=FRACTION, default=0.1, help="of the cross-entropy targets")
    g.add_argument("--clip-grad", type=AT_LEAST_0, default=1.0, help="max gradient norm (0: off)")
    g = p.add_argument_group("evaluation")
    g.add_argument("-e", "--evaluate", action="store_true", help="only evaluate the checkpoint given by --resume")
    g.add_argument("--beam", type=POSITIVE, default=1, help="beam size for BLEU decoding (1: greedy)")
    g.add_argument("--samples", type=COUNT, default=3, help="sample translations to print at each evaluation")
    return p


def check_args(args: argparse.Namespace) -> None:
    """What no ``type=`` sees: the packages, flags that exclude each other, a model too big for the host."""
    try:
        import sacrebleu  # noqa: F401  (imported where used; checked here so a missing one fails before training)
        import tokenizers  # noqa: F401
    except ImportError as e:
        raise UserError(f"this script needs the {e.name} package (pip install {e.name})") from None
    if args.fsdp and args.amp == "fp16":
        raise UserError("--amp fp16 does not work with --fsdp (use --amp bf16)")
    if args.fsdp and args.keep_last:
        raise UserError(f"--keep-last {args.keep_last} does not work with --fsdp (0 with it)")
    if args.fsdp and args.compile_mode == "reduce-overhead":  # measured: BENCHMARKS.md, "DDP or FSDP2"
        raise UserError("--compile-mode reduce-overhead is slower than --compile alone under --fsdp (drop it)")
    cfg = model_config(args, args.vocab_size)  # the vocabulary the tokenizer may reach
    if cfg.d_model % cfg.n_heads:
        raise UserError(f"--heads {cfg.n_heads} does not divide the width {cfg.d_model} (pick a divisor of --d-model)")
    check_size(cfg)


def build_data(args, info, tok, splits: dict, pack_len: int):
    """Token ids; over-long training pairs dropped (and counted), evaluation keeps every pair; the packed loader."""
    ids = {k: (text.encode(tok, s), text.encode(tok, t)) for k, (s, t) in splits.items()}
    max_len = min(args.max_len, pack_len - 1)  # a row holds its pairs and a tail of at least one <pad>
    keep = [i for i, (s, t) in enumerate(zip(*ids["train"])) if max(len(s), len(t)) + 1 <= max_len]
    src, tgt = [ids["train"][0][i] for i in keep], [ids["train"][1][i] for i in keep]
    n_long = len(ids["train"][0]) - len(keep)
    print0(f"vocab {tok.get_vocab_size()} ({args.tokenizer}); dropped {n_long} training pairs over {max_len} tokens")
    if not src:
        raise UserError(f"no training pair fits in {max_len} tokens (raise --max-len or --pack-len)")
    eval_sets = {k: ([s[:MAX_LEN] for s in ids[k][0]], [t[:MAX_LEN] for t in ids[k][1]], *splits[k])
                 for k in ("val", "test") if k in splits}  # fmt: skip
    # [DDP 2] sentence pairs packed end to end into rows of pack_len tokens (PackedBatchSampler): every batch has
    # the same shape, every rank the same number of batches, the order of epoch e is a function of (seed, e), and
    # an epoch's last step is topped up with the next epoch's first rows (empty rows only at the end of the run).
    sampler = text.PackedBatchSampler([len(s) + 1 for s in src], [len(t) + 1 for t in tgt], pack_len,
                                      args.max_tokens // pack_len, info.rank, info.world_size, args.seed,
                                      args.accum_steps, args.epochs)  # fmt: skip
    rows = text.PackedRows(text.ParallelDataset(src, tgt), pack_len)
    kw = loader_kwargs(args.workers, args.seed, info.rank, info.device)
    loader = torch.utils.data.DataLoader(rows, batch_sampler=sampler, collate_fn=partial(torch.stack, dim=1), **kw)
    return sampler, loader, eval_sets, {"train_pairs": len(src), "dropped_long_pairs": n_long}


def continue_at_next_epoch(pos: Position, ckpt: dict, world_size: int, accum_steps: int, epoch_end: int) -> dict:
    """After a resume with another world size or accumulation (other steps), the epoch in progress ends here: its
    evaluation, if due, and checkpoint come next, then the next epoch. Returns ``ckpt`` less its loss window."""
    old = ckpt["world_size"], ckpt["args"]["accum_steps"]
    if old == (world_size, accum_steps):
        return ckpt
    print0(f"note: checkpoint was written with world size {old[0]} x accum {old[1]}, now {world_size} x {accum_steps}; "
           "continuing at the next epoch boundary (the data order differs from an uninterrupted run)")  # fmt: skip
    pos.batch_in_epoch = epoch_end if pos.batch_in_epoch else 0
    return {k: v for k, v in ckpt.items() if k != "window"}


def lr_at(epoch: int, step: int, args, sampler: text.PackedBatchSampler) -> float:
    """The LR of step ``step`` (from 0) of epoch ``epoch``: a linear warmup to --lr over --warmup-epochs, then --lr x
    sqrt(warmup / step). In epochs: the same on any GPU count, and after a resume on another."""
    step, warmup = sampler.steps_before(epoch) + step + 1, round(args.warmup_epochs * sampler.steps_per_epoch)
    return args.lr * (min(step / warmup, (warmup / step) ** 0.5) if warmup else step**-0.5)


def train_one_epoch(model, optimizer, scaler, no_sync, batches, step_tokens: list[int], pos: Position,
                    window: LossWindow, args, info, logger: MetricsLogger, save, end: int, lr_of) -> bool:  # fmt: skip
    """Optimizer steps up to step ``end`` (the epoch's last or --max-steps), their micro-batches taken from ``batches``,
    the run's one iterator. Returns True if the ranks agreed to stop before it (preemption; the loss window open)."""
    model.train()
    dtype = amp_dtype(args.amp, info.device)
    for i, batch in zip(range(pos.batch_in_epoch, pos.batch_in_epoch + (end - pos.step) * args.accum_steps), batches):
        src, tgt_in, tgt_out, src_doc, tgt_doc = batch.to(info.device, non_blocking=True)  # one (5, rows, len) copy
        if i % args.accum_steps == 0:  # dropout masks depend on (seed, rank, step) only: resumable; the device's
            # generator alone (torch.manual_seed also queues a stack trace a step for each absent accelerator kind)
            rng = torch.cuda if info.device.type == "cuda" else torch.default_generator
            rng.manual_seed(mix_seed(args.seed, info.rank, pos.step))
        sync = (i + 1) % args.accum_steps == 0
        # [DDP 3] micro-batches that do not step accumulate locally: no gradient all-reduce until the last one
        with no_sync() if not sync and info.world_size > 1 else contextlib.nullcontext():
            with torch.autocast(info.device.type, dtype, enabled=dtype is not None):
                loss = model(src, tgt_in, src_doc, tgt_doc, tgt_out=tgt_out, label_smoothing=args.label_smoothing)
            # DDP averages gradients over ranks; x world_size / tokens makes the step's gradient the mean over every
            # target token of the step, however unevenly the tokens fall on ranks and micro-batches
            scaler.scale(loss * (info.world_size / max(1, step_tokens[i // args.accum_steps]))).backward()
        window.sum += loss.detach()
        if not sync:
            continue
        scaler.unscale_(optimizer)
        if args.clip_grad > 0:  # the optimizer's lists of parameters: a walk of the module tree costs host time
            nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], args.clip_grad)
        for group in optimizer.param_groups:  # the LR of this step: a pure function of the position in training
            group["lr"] = lr = lr_of(pos.epoch, i // args.accum_steps)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        pos.step, pos.batch_in_epoch, window.n = pos.step + 1, i + 1, window.n + step_tokens[i // args.accum_steps]
        periodic = args.save_every_steps and pos.step % args.save_every_steps == 0 and pos.step < end
        if pos.step % args.print_freq == 0 or periodic or pos.step == end:
            log_loss(window, pos, info, logger, lr)
        if periodic:
            save(pos, Path(args.output_dir) / "last.pt", args.keep_last)
        if pos.step == end:
            return False
        if stop_requested(pos.step):  # every rank sees it at the same step
            return True
    return False


def log_loss(window: LossWindow, pos: Position, info, logger: MetricsLogger, lr: float) -> None:
    """A train record: the mean loss per target token since the last one, over every rank, then a new window."""
    sums = all_reduce_sum(window.sums.clone())  # [DDP 4] each rank's sum: the one host sync of a log point
    loss, tps = sums.sum().item() / window.n, window.n / (time.time() - window.t0)  # n: target tokens, all ranks
    check_finite(loss, pos.step)
    mem = {"max_mem_gib": torch.cuda.max_memory_allocated() / 2**30} if info.device.type == "cuda" else {}
    logger.log({"split": "train", "epoch": pos.epoch, "step": pos.step, "loss": loss, "lr": lr, "tok_per_s": tps,
                **mem})  # fmt: skip
    logger.progress(pos.step, f"epoch {pos.epoch} loss {loss:.4f} lr {lr:.4g} {tps:.0f} tok/s")
    window.reset()


def save(pos: Position, path: Path, keep: int = 0, *, model, optimizer, scaler, args, info, writer, **extra) -> None:
    """A checkpoint of the bare model and ``pos`` at ``path``; ``extra``: the tokenizer, model config, languages."""
    if args.fsdp:  # [DDP 6] (--fsdp: every rank writes its shards, a collective; best.pt also gets the whole model)
        state = checkpoint_state(model, optimizer, scaler, pos, args, info.world_size, **extra)
        fsdp.save(state, model, optimizer, path, whole=path.name == "best.pt")
    elif info.is_main:  # [DDP 6] rank 0 alone writes; the save holds no collective
        writer.save(checkpoint_state(model, optimizer, scaler, pos, args, info.world_size, **extra), path, keep)


@torch.no_grad()
def evaluate(model, data, tok, args, info, dtype) -> dict:
    """[DDP 5] Loss and sacreBLEU over the whole split: each pair on one rank, the loss sums all-reduced, the
    hypotheses gathered on every rank, which all score them alike. The bare model (under FSDP with its weights
    gathered), not DDP: ranks hold different numbers of batches, and a DDP forward would wait for the others."""
    from sacrebleu.metrics import BLEU

    src_ids, tgt_ids, src_text, refs = data
    model.eval()  # and eager: evaluation's many batch shapes would each compile a graph of their own
    mine = list(range(info.rank, len(src_ids), info.world_size))  # each pair on one rank, no padding
    sums = torch.zeros(2, device=info.device, dtype=torch.float64)  # summed NLL, target tokens
    pairs = text.padded_batches([src_ids[i] for i in mine], [tgt_ids[i] for i in mine], args.max_tokens, info.device)
    for src, tgt_in, tgt_out in watched(pairs, evaluating=True):
        with torch.autocast(info.device.type, dtype, enabled=dtype is not None):
            nll = model(src, tgt_in, tgt_out=tgt_out)
        sums += torch.stack([nll.double(), (tgt_out != text.PAD).sum().double()])
    loss, n_tok = all_reduce_sum(sums).tolist()  # [DDP 5]
    ids = translate_ids(model, [src_ids[i] for i in mine], args.max_tokens, args.beam, dtype,
                        partial(watched, evaluating=True))  # fmt: skip
    mine_hyps = list(zip(mine, text.decode(tok, ids)))  # (index, hypothesis)
    parts = [mine_hyps] * info.world_size  # every rank's, gathered on every rank: all score BLEU alike
    if dist.is_initialized():
        dist.all_gather_object(parts, mine_hyps)
    hyps = [text.one_line(h) for _, h in sorted(pair for part in parts for pair in part)]  # as translate.py writes
    bleu = BLEU()  # detokenized, cased corpus BLEU against the original reference text
    score = bleu.corpus_score(hyps, [[text.one_line(r) for r in refs]]).score
    model.train()
    return {"loss": loss / max(n_tok, 1), "bleu": score, "sacrebleu": str(bleu.get_signature()), "count": len(refs),
            "samples": [(src_text[i], refs[i], hyps[i]) for i in range(min(args.samples, len(refs)))]}  # fmt: skip


def log_eval(model, data, split: str, tok, args, info, dtype, logger: MetricsLogger, pos: Position) -> dict:
    """Evaluate ``split``, log its record, print it with a few sample translations."""
    with fsdp.whole_weights(model) if args.fsdp else contextlib.nullcontext():
        m = evaluate(model, data, tok, args, info, dtype)
    logger.log({"split": split, "epoch": pos.epoch, "step": pos.step, **{k: m[k] for k in ("loss", "bleu", "count",
                "sacrebleu")}})  # fmt: skip
    print0(f"epoch {pos.epoch} {split}: loss {m['loss']:.4f} BLEU {m['bleu']:.2f} ({m['count']} sentences, "
           f"{'greedy' if args.beam == 1 else f'beam {args.beam}'}; sacreBLEU {m['sacrebleu']})")  # fmt: skip
    print0("".join(f"  src: {s}\n  ref: {ref}\n  hyp: {h}\n" for s, ref, h in m["samples"]), end="")
    return m


def main(args: argparse.Namespace) -> None:
    t_start = time.time()
    # [hardening] Deleting this call and its import loses: one-line errors for bad input (check_args's too),
    # [hardening] preemption (SIGTERM: save, exit 75), the stall watchdog, the --output-dir lock, ranks that die with
    # [hardening] their launcher.
    hardening.enable(args, check_args, writes=("tokenizer.json",))
    info = setup_distributed(args)  # [DDP 1] init the process group (any launcher) and pick this rank's device
    device, out, dtype = info.device, Path(args.output_dir), amp_dtype(args.amp, info.device)
    torch.manual_seed(args.seed + info.rank)  # each rank its own; every rank starts from rank 0's weights
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.enable_cudnn_sdp(args.cudnn_attention)  # cuDNN plans each new shape: evaluation has many
    pack_len = min(args.pack_len, args.max_tokens)
    if args.max_len >= pack_len:
        print0(f"note: --max-len {args.max_len} lowered to {pack_len - 1}: a pair must fit a row of {pack_len}")

    # ---- the checkpoint first: its tokenizer decides how text becomes ids
    ckpt_path, pos, ckpt = resolve_resume(args.resume, out), Position(), {}
    if ckpt_path is not None:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)  # tensors and numbers: runs no code
    if args.evaluate and ckpt:  # the checkpoint's model, language pair and beam, unless the command line says others
        from_checkpoint(get_args_parser(), args, ckpt["args"], ("preset", "d_model", "layers", "heads", "d_ff"),
                        ("lang_src", "lang_tgt", "beam"))  # fmt: skip

    # ---- text (the Hub is contacted by rank 0 only); the tokenizer: trained by rank 0, kept in every checkpoint
    splits = text.load_corpus(args, info)
    langs = ["src", "tgt"] if args.synthetic else [args.lang_src, args.lang_tgt]
    print0(", ".join(f"{k}: {len(v[0])} pairs" for k, v in splits.items()) + " ({}->{})".format(*langs))
    if ckpt and list(ckpt.get("langs", langs)) != langs:  # its tokenizer is another pair's
        raise UserError(f"{ckpt_path} is a run of {'->'.join(ckpt['langs'])}, not {'->'.join(langs)} (give this "
                        "pair another --output-dir, or --resume none --overwrite to start over there)")  # fmt: skip
    if ckpt and "tokenizer" not in ckpt:
        raise UserError(f"checkpoint {ckpt_path} has no tokenizer (not from transformer/train.py?)")
    tok_json = ckpt["tokenizer"] if ckpt else text.shared_tokenizer(args, splits["train"], info)
    tok = text.load_tokenizer(tok_json, ckpt_path)
    if info.is_main:
        (out / "tokenizer.json").write_text(tok_json)
    sampler, loader, eval_sets, stats = build_data(args, info, tok, splits, pack_len)

    # ---- model
    cfg = model_config(args, tok.get_vocab_size())
    model = ddp = Transformer(cfg).to("cpu" if args.fsdp else device)  # the bare model: saved, evaluated, restored
    if args.fsdp:  # [DDP 3] (--fsdp: fully_shard instead) each rank keeps 1/N of weights, gradients, optimizer state
        model = ddp = fsdp.shard(model, dtype, device, args.fsdp)
    elif info.world_size > 1:  # [DDP 3] wrap the model: backward all-reduces the gradients, bucket by bucket
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                                  gradient_as_bucket_view=True)  # fmt: skip
    no_sync = partial(fsdp.no_sync, model) if args.fsdp else getattr(ddp, "no_sync", None)
    # --compile: one shape for every packed batch, so the whole step's forward (block masks and loss included)
    # compiles once. Compiled with DDP, the graph splits at DDP's buckets: the all-reduces overlap the backward.
    train_model = torch.compile(ddp, dynamic=False, mode=args.compile_mode) if args.compile else ddp

    # ---- optimizer; the LR is set each step by lr_at, a function of the position in training alone
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.98), eps=1e-9,
                                  fused=device.type == "cuda")  # fmt: skip
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    # ---- resume: the same command, restarted, continues where the run stopped
    if ckpt:
        if args.fsdp:  # the shards resharded to this world size, or a DDP checkpoint's weights and optimizer state
            fsdp.load(ckpt_path, ckpt, model, optimizer)
        elif "shards" in ckpt:
            raise UserError(f"{ckpt_path} is a sharded checkpoint of an FSDP run (resume it with --fsdp)")
        pos = resume(ckpt_path, ckpt, None if args.fsdp else model, optimizer, scaler, world_size=info.world_size)
        ckpt = continue_at_next_epoch(pos, ckpt, info.world_size, args.accum_steps,
                                      sampler.steps_in(pos.epoch) * args.accum_steps)  # fmt: skip
    if args.evaluate:
        if ckpt_path is None:
            raise UserError("--evaluate needs a checkpoint: --resume PATH (or an output dir with last.pt)")
        for split in eval_sets:
            log_eval(model, eval_sets[split], split, tok, args, info, dtype, MetricsLogger(out, info, pos), pos)
        return
    left_in_epoch = sampler.steps_in(pos.epoch) - pos.batch_in_epoch // args.accum_steps  # 0: its end comes next
    total_steps = pos.step + left_in_epoch + sampler.steps_before(args.epochs) - sampler.steps_before(pos.epoch + 1)
    max_steps = min(total_steps, args.max_steps or total_steps)
    eval_step = ckpt.get("eval_step", -1)  # the step of the last evaluation recorded
    if pos.step >= max_steps and not (left_in_epoch == 0 and args.eval_every and eval_step != pos.step):
        return print0(f"done: step {pos.step} (already finished: nothing to do)")
    same_run = ckpt_path is not None and ckpt_path.resolve().parent == out.resolve()
    logger = MetricsLogger(out, info, pos, keep=pos.log_lines if same_run else 0, total=max_steps)
    n_params = sum(p.numel() for p in model.parameters())
    logger.start(args, info, "transformer", model_config=asdict(cfg), params=n_params, **stats, pack_len=pack_len,
                 rows=sampler.rows, steps_per_epoch=sampler.steps_per_epoch, row_fill=sampler.fill)  # fmt: skip
    fsdp_by = f", FSDP2 by {args.fsdp}" if args.fsdp else ""
    print0(f"transformer {args.preset} ({n_params / 1e6:.1f}M params) on {stats['train_pairs']} pairs | "
           f"{info.world_size} process(es) on {device.type} ({info.launcher}{fsdp_by}) | {sampler.rows} x {pack_len} "
           f"tokens x {info.world_size} x {args.accum_steps} per step, {sampler.fill:.1%} of them real | "
           f"{sampler.steps_per_epoch:.1f} steps/epoch | peak lr {args.lr:.4g}")  # fmt: skip
    writer = CheckpointWriter()
    save_at = partial(save, model=model, optimizer=optimizer, scaler=scaler, args=args, info=info, writer=writer,
                      tokenizer=tok_json, model_config=asdict(cfg), langs=langs)  # fmt: skip
    lr_of = partial(lr_at, args=args, sampler=sampler)

    # ---- training: an epoch, its evaluation, then the checkpoint that moves the position past it. One DataLoader
    # iterator deals epoch after epoch (its workers never restart); each epoch takes its steps' batches from it.
    sampler.set_epoch(pos.epoch, skip=pos.batch_in_epoch, until=args.epochs)  # [DDP 2] this rank's rows, from here
    batches, window, stopped = iter(watched(loader)), LossWindow(info, ckpt.get("window")), False
    for epoch in range(pos.epoch, args.epochs):
        end = min(max_steps, pos.step + sampler.steps_in(epoch) - pos.batch_in_epoch // args.accum_steps)
        stopped = train_one_epoch(train_model, optimizer, scaler, no_sync, batches, sampler.step_tokens(epoch),
                                  pos, window, args, info, logger, save_at, end, lr_of)  # fmt: skip
        if stopped:  # preempted: every rank at this step; the checkpoint holds every rank's part of the open window
            save_at(pos, out / "last.pt", window={"sums": all_reduce_sum(window.sums.clone()), "n": window.n})
            break
        if pos.batch_in_epoch >= sampler.steps_in(epoch) * args.accum_steps:
            pos.epoch, pos.batch_in_epoch = epoch + 1, 0
        if args.eval_every and eval_step != pos.step and (pos.step >= max_steps or pos.epoch > epoch and (
                pos.epoch % args.eval_every == 0 or pos.epoch == args.epochs)):  # fmt: skip
            m = log_eval(model, eval_sets["val"], "val", tok, args, info, dtype, logger, pos)
            if pos.step >= max_steps and "test" in eval_sets:  # the test split: with the final evaluation only
                log_eval(model, eval_sets["test"], "test", tok, args, info, dtype, logger, pos)
            if m["bleu"] >= pos.best_metric:  # >=: a first evaluation at BLEU 0 still leaves a best.pt
                pos.best_metric = m["bleu"]
                save_at(pos, out / "best.pt", eval_step=pos.step)
            eval_step = pos.step
        keep = args.keep_last if args.save_every_steps and pos.step % args.save_every_steps == 0 else 0
        save_at(pos, out / "last.pt", keep, eval_step=eval_step)
        window.reset()  # the evaluation and checkpoint are no part of the next record's tokens/s
        if pos.step >= max_steps:
            break
    writer.wait()  # the last checkpoint is on disk before the run says so
    logger.close()
    best = f", best val BLEU {pos.best_metric:.2f}" if args.eval_every else ""
    if not stopped:
        print0(f"done: step {pos.step}{best}, wall {time.time() - t_start:.1f}s")


if __name__ == "__main__":
    run_cli(main, get_args_parser().parse_args())
