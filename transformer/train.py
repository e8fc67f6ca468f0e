"""Train an encoder-decoder Transformer for translation with DistributedDataParallel.

    python transformer/train.py --synthetic --preset tiny --epochs 2                  # 1 process, no data
    python transformer/train.py --data /path/to/multi30k --lang-src de --lang-tgt en --preset small
    torchrun --standalone --nproc_per_node=2 transformer/train.py ...                 # N processes
    python transformer/translate.py --checkpoint runs/transformer/best.pt "Ein Satz."

Read top to bottom: arguments -> distributed setup -> text -> tokenizer -> packed batches
-> model -> optimizer -> resume -> training loop with periodic evaluation (loss and sacreBLEU over
the whole validation set) and checkpoints. The DDP recipe is four steps, marked [DDP 1-4]; --fsdp: [FSDP 3-4].
"""

from __future__ import annotations

if __name__ == "__main__":  # a faster start: no cyclic GC during the imports (BENCHMARKS.md "Process start-up")
    __import__("gc").disable()

import argparse
import contextlib
import functools
import gc
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

if not __package__:  # run as a script: import this folder as a package, whatever it is called, and find common/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = Path(__file__).resolve().parent.name
from common.watchdog import CHECKPOINT, EVAL_STEP, Watchdog

from common.checkpoint import (
    CheckpointWriter,
    Position,
    checkpoint_state,
    load_checkpoint,
    resolve_resume,
    restore_training,
)
from common.data import loader_kwargs
from common.distributed import (
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
from common.utils import StopSignal, amp_dtype, autocast, check_finite_loss, param_groups

from . import fsdp
from .config import check_args, get_args_parser, model_config
from .data import (
    PAD,
    PackedBatchSampler,
    PackedRows,
    ParallelDataset,
    collate,
    continue_at_next_epoch,
    decode,
    encode,
    load_corpus,
    load_tokenizer,
    one_line,
    shared_tokenizer,
    token_batches,
    tokenizers_done_forking,
)
from .model import ModelConfig, Transformer, allow_cudnn_attention, translate_ids

T_START = time.time()


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

    `model` is the bare model (under FSDP, with its weights gathered): ranks hold different numbers of batches, and a
    DDP forward would wait for the others. Never the compiled one either, so evaluation's many batch shapes run
    eagerly instead of compiling one graph each.
    """
    from sacrebleu.metrics import BLEU

    src_ids, tgt_ids, src_text, refs = data
    device = info.device
    model.eval()
    mine = list(range(info.rank, len(src_ids), info.world_size))  # each pair on one rank, no padding
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


def log_eval(r: SimpleNamespace, split: str, pos: Position) -> dict:
    """Evaluate the bare model on ``split``, log the record and print it with a few sample translations."""
    r.watchdog.beat(EVAL_STEP)
    with r.fsdp.whole_weights(r.model) if r.fsdp else contextlib.nullcontext():
        m = evaluate(r.model, r.eval_sets[split], r.tok, r.args, r.info, r.dtype)
    r.logger.log({"split": split, "epoch": pos.epoch, "step": pos.step, "loss": m["loss"], "bleu": m["bleu"],
                  "count": m["count"]})  # fmt: skip
    how = "greedy" if r.args.beam == 1 else f"beam {r.args.beam}"
    print0(f"epoch {pos.epoch} {split}: loss {m['loss']:.4f} BLEU {m['bleu']:.2f} ({m['count']} sentences, "
                     f"{how}; sacreBLEU {m['bleu_signature']})")  # fmt: skip
    for s, ref, h in m["samples"]:
        print0(f"  src: {s}\n  ref: {ref}\n  hyp: {h}")
    return m


def token_loss(logits: torch.Tensor, tgt_out: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """Summed token cross-entropy of one batch. Compiled (--compile), the loss over the whole vocabulary
    (batch x length x vocab, the largest activation) fuses into a few kernels."""
    return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD, label_smoothing=label_smoothing,
                           reduction="sum")  # fmt: skip


def save_state(name: str, r: SimpleNamespace, pos: Position, keep_last: int = 0) -> float:
    """Checkpoint ``name`` (rank 0 writes, on a thread); returns the seconds it took, which the throughput leaves
    out. Every rank calls it: the loss window gathers every rank's sum."""
    t = time.time()
    r.watchdog.beat(CHECKPOINT)
    window = r.loss_window.state(pos.step)  # stops on a NaN or infinite loss since the last log point
    state = checkpoint_state(r.model, r.optimizer, r.scheduler, r.scaler, pos, r.args, r.info.world_size,
                             loss_window=window, tokenizer=r.tok_json, model_config=asdict(r.cfg),
                             langs=list(r.langs))  # fmt: skip
    if r.fsdp:  # [FSDP 4] every rank writes its shards; best.pt also gets the whole model, for translate.py
        r.fsdp.save(state, r.model, r.optimizer, r.out / name, whole=name == "best.pt")
    elif r.info.is_main:  # [DDP 4] only rank 0 writes, atomically; translate.py needs nothing but this file
        r.writer.save(state, r.out / name, keep_last=keep_last)
    return time.time() - t


def train_one_epoch(r: SimpleNamespace, pos: Position, max_steps: int, batches) -> None:
    """Optimizer steps from ``pos`` to the end of its epoch or ``max_steps`` (or a stop signal: ``r.stopped``)."""
    args, info, window, device = r.args, r.info, r.loss_window, r.info.device
    r.train_model.train()
    step_tokens = r.sampler.step_tokens(pos.epoch)  # target tokens of each optimizer step, all ranks together
    for i in range(pos.batch_in_epoch, r.sampler.steps_in(pos.epoch) * args.accum_steps):
        src, tgt_in, tgt_out, src_doc, tgt_doc = (t.to(device, non_blocking=True) for t in next(batches))
        if i % args.accum_steps == 0:  # dropout masks depend on (seed, rank, step) only: resumable
            torch.manual_seed(mix_seed(args.seed, info.rank, pos.step))
        sync = (i + 1) % args.accum_steps == 0
        with r.no_sync() if (not sync and info.world_size > 1) else contextlib.nullcontext():
            with autocast(device, r.dtype):
                loss = r.loss_fn(r.train_model(src, tgt_in, src_doc, tgt_doc), tgt_out)
            # DDP averages gradients over ranks; x world_size / tokens makes the step's gradient the mean
            # over every target token of the step, however unevenly the tokens fall on ranks and micro-batches.
            r.scaler.scale(loss * (info.world_size / max(1, step_tokens[i // args.accum_steps]))).backward()
        window.sum += loss.detach()
        if not sync:
            continue
        r.scaler.unscale_(r.optimizer)
        if args.clip_grad > 0:
            nn.utils.clip_grad_norm_(r.model.parameters(), args.clip_grad)
        r.scaler.step(r.optimizer)
        r.scaler.update()
        r.optimizer.zero_grad(set_to_none=True)
        r.scheduler.step()
        pos.step, pos.batch_in_epoch = pos.step + 1, i + 1
        window.n += step_tokens[i // args.accum_steps]
        if pos.step % args.print_freq == 0 or pos.step == max_steps:
            loss_avg = all_reduce_sum(window.sum.clone()).item() / window.n  # per target token; the one host sync
            tps = window.n / (time.time() - window.t0)
            check_finite_loss(loss_avg, pos.step)
            lr = r.scheduler.get_last_lr()[0]
            mem = {"max_mem_gib": torch.cuda.max_memory_allocated() / 2**30} if device.type == "cuda" else {}
            r.logger.log({"split": "train", "epoch": pos.epoch, "step": pos.step, "loss": loss_avg, "lr": lr,
                          "tok_per_s": tps, **mem})  # fmt: skip
            r.progress.update(pos.step, f"epoch {pos.epoch} loss {loss_avg:.4f} lr {lr:.4g} {tps:.0f} tok/s")
            window.reset(pos.step)
        if args.save_every_steps and pos.step % args.save_every_steps == 0:
            window.t0 += save_state("last.pt", r, pos, args.keep_last)
        r.stopped = r.stop.should_stop()
        if pos.step >= max_steps or r.stopped:
            return


def build_data(args, info, tok, splits: dict, pack_len: int) -> SimpleNamespace:
    """Token ids; over-long training pairs dropped (and counted), evaluation keeps every pair; the packed loader."""
    d = SimpleNamespace()
    ids = {k: (encode(tok, s), encode(tok, t)) for k, (s, t) in splits.items()}
    tokenizers_done_forking()
    max_len = min(args.max_len, pack_len - 1)  # a row holds its pairs and a tail of at least one <pad>
    keep = [i for i, (s, t) in enumerate(zip(*ids["train"])) if max(len(s), len(t)) + 1 <= max_len]
    d.n_long = len(ids["train"][0]) - len(keep)
    src, tgt = [ids["train"][0][i] for i in keep], [ids["train"][1][i] for i in keep]
    print0(f"vocab {tok.get_vocab_size()} ({args.tokenizer}); dropped {d.n_long} training pairs over {max_len} tokens")
    if not src:
        raise UserError(f"no training pair fits in {max_len} tokens (raise --max-len or --pack-len)")
    limit = ModelConfig.max_positions - 1  # the decoder also needs room for <s>
    d.eval_sets = {k: ([s[:limit] for s in ids[k][0]], [t[:limit] for t in ids[k][1]], *splits[k])
                   for k in ("val", "test") if k in splits}  # fmt: skip
    # [DDP 2] sentence pairs packed end to end into rows of pack_len tokens (data.PackedBatchSampler): every batch has
    # the same shape, every rank the same number of batches, the order of epoch e is a function of (seed, e), and
    # an epoch's last step is topped up with the next epoch's first rows (empty rows only at the end of the run).
    d.n_train, d.rows = len(src), args.max_tokens // pack_len
    d.sampler = PackedBatchSampler([len(s) + 1 for s in src], [len(t) + 1 for t in tgt], pack_len, d.rows, info.rank,
                                   info.world_size, args.seed, args.accum_steps, args.epochs)  # fmt: skip
    kw = loader_kwargs(args.workers, args.seed, info.rank, info.device)
    d.loader = torch.utils.data.DataLoader(PackedRows(ParallelDataset(src, tgt), pack_len), batch_sampler=d.sampler,
                                           **kw)  # fmt: skip
    return d


def main(args: argparse.Namespace) -> None:
    pack_len = min(args.pack_len, args.max_tokens)
    if args.max_len >= pack_len:
        print0(f"note: --max-len {args.max_len} lowered to {pack_len - 1}: a pair must fit a row of {pack_len}")

    # [DDP 1] init the process group (torchrun, Slurm, MPI, --dist-url or none) and pick this rank's device.
    info = setup_distributed(args)
    device = info.device
    seed_everything(args.seed, info.rank)
    out = prepare_output_dir(args.output_dir)
    r = SimpleNamespace(args=args, info=info, out=out, dtype=amp_dtype(args.amp, device), stopped=False)
    r.fsdp = fsdp if args.fsdp else None  # FSDP2 and its checkpoints (transformer/fsdp.py)
    allow_cudnn_attention(args.cudnn_attention)  # off by default: see allow_cudnn_attention

    # ---- resume: read the checkpoint first, its tokenizer decides how text becomes ids
    ckpt_path = resolve_resume(args.resume, out)
    ckpt = load_checkpoint(ckpt_path) if ckpt_path is not None else None

    # ---- text (the Hub is contacted by rank 0 only)
    splits = load_corpus(args, info)
    r.langs = ("src", "tgt") if args.synthetic else (args.lang_src, args.lang_tgt)
    print0(", ".join(f"{k}: {len(v[0])} pairs" for k, v in splits.items()) + " ({}->{})".format(*r.langs))
    if ckpt is not None and list(ckpt.get("langs", r.langs)) != list(r.langs):  # its tokenizer is another pair's
        raise UserError(f"{ckpt_path} is a run of {'->'.join(ckpt['langs'])}, not {'->'.join(r.langs)} (give this "
                        "pair another --output-dir, or --resume none --overwrite to start over there)")  # fmt: skip

    # ---- tokenizer: trained on the training split by rank 0, sent to the others, kept in every checkpoint
    if ckpt is not None and "tokenizer" not in ckpt:
        raise UserError(f"checkpoint {ckpt_path} has no tokenizer (not from transformer/train.py?)")
    r.tok_json = ckpt["tokenizer"] if ckpt is not None else shared_tokenizer(args, splits["train"], info)
    r.tok = load_tokenizer(r.tok_json, ckpt_path)
    if info.is_main:
        (out / "tokenizer.json").write_text(r.tok_json)
    data = build_data(args, info, r.tok, splits, pack_len)
    r.sampler, r.eval_sets = data.sampler, data.eval_sets

    # ---- model
    r.cfg = model_config(args, r.tok.get_vocab_size())
    r.model = r.ddp = Transformer(r.cfg).to("cpu" if r.fsdp else device)  # what we save, evaluate and restore
    # [DDP 3] wrap the model: gradients are averaged across ranks during backward.
    if r.fsdp:  # [FSDP 3] or shard it: each rank keeps 1/N of the weights, gradients and optimizer state
        r.model = r.ddp = r.fsdp.shard(r.model, r.dtype, device, args.fsdp)
        r.no_sync = functools.partial(r.fsdp.no_sync, r.model)
    elif info.world_size > 1:
        ids = [device.index] if device.type == "cuda" else None
        r.ddp = nn.parallel.DistributedDataParallel(r.model, device_ids=ids, gradient_as_bucket_view=True)
        r.no_sync = r.ddp.no_sync
    r.train_model, r.loss_fn = r.ddp, functools.partial(token_loss, label_smoothing=args.label_smoothing)
    if args.compile:
        # Packed batches all have one shape: the whole model (block masks included) compiles once. Compiling the DDP
        # model lets the compiler split the graph at DDP's gradient buckets, so all-reduces overlap the backward.
        r.train_model = torch.compile(r.ddp, dynamic=False, mode=args.compile_mode)
        r.loss_fn = torch.compile(r.loss_fn, dynamic=False)

    # ---- optimizer and LR schedule (a pure function of the step)
    r.optimizer = torch.optim.AdamW(param_groups(r.model, args.weight_decay), lr=args.lr, betas=(0.9, 0.98), eps=1e-9,
                                    fused=device.type == "cuda")  # fmt: skip
    lr_factor = functools.partial(inverse_sqrt, warmup=args.warmup_steps)
    r.scheduler = torch.optim.lr_scheduler.LambdaLR(r.optimizer, lr_factor)
    r.scaler = torch.amp.GradScaler(device.type, enabled=r.dtype == torch.float16)

    # ---- resume (same command restarted by torchrun/Slurm continues where it stopped)
    pos = Position()
    if ckpt is not None:
        if r.fsdp:  # the shards resharded to this world size, or a DDP checkpoint's weights and optimizer state
            r.fsdp.load(ckpt_path, ckpt, r.model, r.optimizer)
        elif "shards" in ckpt:
            raise UserError(f"{ckpt_path} is a sharded checkpoint of an FSDP run (resume it with --fsdp)")
        pos, ckpt = restore_training(ckpt_path, *((None, None) if r.fsdp else (r.model, r.optimizer)), r.scheduler,
                                     r.scaler, ckpt=ckpt, world_size=info.world_size)  # fmt: skip
        ckpt = continue_at_next_epoch(pos, ckpt, info.world_size, args.accum_steps)
    r.writer = CheckpointWriter(out if info.is_main else None)  # writes on a thread

    n_params = sum(p.numel() for p in r.model.parameters())
    r.logger = logger = MetricsLogger(out, info, args.wandb)
    max_tokens = data.rows * pack_len * info.world_size * args.accum_steps
    pos.wandb_id = logger.start(args, "transformer", pos.wandb_id, dict(
        model_config=asdict(r.cfg), params=n_params, train_pairs=data.n_train, dropped_long_pairs=data.n_long,
        steps_per_epoch=round(r.sampler.steps_per_epoch, 2), max_tokens_per_step=max_tokens, pack_len=pack_len,
        rows_per_batch=data.rows, row_fill=r.sampler.fill, bleu_signature=bleu_signature()))  # fmt: skip
    print0(f"transformer {args.preset} ({n_params / 1e6:.1f}M params) on {data.n_train} pairs | {info.world_size} "
           f"process(es) on {device.type} ({info.launcher}{', FSDP2 by ' + args.fsdp if r.fsdp else ''}) | {data.rows} "
           f"x {pack_len} tokens x {info.world_size} x {args.accum_steps} per step, {r.sampler.fill:.1%} of them real "
           f"| {r.sampler.steps_per_epoch:.1f} steps/epoch | peak lr {args.lr:.4g}")  # fmt: skip
    total_steps = r.sampler.steps_before(args.epochs)
    max_steps = min(total_steps, args.max_steps or total_steps)
    r.progress, r.stop = Progress(info, max_steps, pos.step), StopSignal()
    r.watchdog = Watchdog(args.stall_timeout, info.rank)  # a stall becomes stacks and an exit
    if args.evaluate:
        if ckpt_path is None:
            raise UserError("--evaluate needs a checkpoint: --resume PATH (or an output dir with last.pt)")
        for split in r.eval_sets:
            log_eval(r, split, pos)
        return

    # ---- training: an evaluation that the last process did not record comes before any further step
    pending = pos.eval_due(args.eval_every, args.epochs, max_steps)
    r.loss_window = LossWindow(info, pos.step, (ckpt or {}).get("loss_window"))
    if ckpt_path is not None and (pos.step < max_steps or pending):
        logger.rewind(pos.step, pos.eval_step)
    # one DataLoader iterator for the run: the sampler deals epoch after epoch, so workers never restart at an epoch
    r.sampler.set_epoch(pos.epoch, skip=pos.batch_in_epoch, until=args.epochs)
    batches = r.watchdog.batches(data.loader)
    while not r.stopped and (pos.step < max_steps or pending):
        if not pending:
            train_one_epoch(r, pos, max_steps, batches)
        if pos.batch_in_epoch >= r.sampler.steps_in(pos.epoch) * args.accum_steps:
            pos.epoch, pos.batch_in_epoch = pos.epoch + 1, 0
        if not r.stopped and pos.eval_due(args.eval_every, args.epochs, max_steps):  # a preempted run's rerun does it
            m = log_eval(r, "val", pos)
            if m["bleu"] >= pos.best_metric:  # >=: a first evaluation at BLEU 0 still leaves a best.pt
                pos.best_metric = m["bleu"]
                save_state("best.pt", r, pos)
            if pos.step >= max_steps and "test" in r.eval_sets:  # recorded with the final evaluation: done once
                log_eval(r, "test", pos)
            pos.eval_step = pos.step
            check_finite_loss(all_reduce_sum(r.loss_window.sum.clone()), pos.step)  # before they are dropped
            r.loss_window.reset(pos.step)  # keep eval time out of the throughput
        pending = False
        r.loss_window.t0 += save_state("last.pt", r, pos)  # a small corpus checkpoints often; not in the tokens/s
    r.stop.close()
    r.writer.wait()  # the last checkpoint is on disk before the run says so
    if r.stopped:
        r.stop.exit_preempted(pos.step, logger)
    r.watchdog.stop()
    best = f", best val BLEU {pos.best_metric:.2f}" if args.eval_every else ""
    print0(f"done: step {pos.step}{best}, wall {time.time() - T_START:.1f}s since start")
    logger.close()


def cli() -> None:
    args = get_args_parser().parse_args()
    check_args(args)
    try:
        main(args)
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    gc.freeze()  # what the imports built lives as long as the process: keep it out of every later collection
    gc.enable()
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # fail instead of hanging on a dead rank
    run_cli(cli)
