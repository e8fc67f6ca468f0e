"""Train a ResNet on CIFAR-10 with DistributedDataParallel.

    python cifar_resnet/train.py --synthetic --epochs 1                     # 1 process
    torchrun --standalone --nproc_per_node=2 cifar_resnet/train.py ...     # N processes
    (Slurm, MPI, --dist-url: see scripts/ -- the script itself is unchanged)

main() is the recipe, top to bottom: process group -> data -> model -> optimizer -> resume -> for each epoch,
train_one_epoch(), evaluate() and a checkpoint. The six steps of DDP are marked [DDP 1] to [DDP 6].
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ sits beside this folder
from cifar10 import DeviceData, load_splits
from resnets import DEPTHS, CifarResNet

from common import hardening  # [hardening] fault survival, one call in main(); a minimal copy deletes these lines
from common.args import ABOVE_0, AT_LEAST_0, COUNT, FRACTION, POSITIVE, PROBABILITY, add_shared_args, from_checkpoint
from common.checkpoint import CheckpointWriter, Position, checkpoint_state, resolve_resume, resume
from common.data import ResumableDistributedSampler, SeededDataset, loader_kwargs
from common.distributed import all_reduce_sum, print0, setup_distributed, stop_requested, watched
from common.errors import UserError, run_cli
from common.metrics import LossWindow, MetricsLogger
from common.utils import EMA, amp_dtype, check_finite, evaluate_classifier, lr_at, param_groups

ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", *DEPTHS)


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    g = p.add_argument_group("data")
    g.add_argument("--data-dir", default="data/cifar10",
                   help="torchvision CIFAR-10 root, or ImageFolder with train/ and test/ (or val/)")  # fmt: skip
    source = g.add_mutually_exclusive_group()
    source.add_argument("--download", action="store_true", help="download torchvision CIFAR-10 into --data-dir")
    source.add_argument("--synthetic", action="store_true", help="random images of the right shape: no disk")
    g.add_argument("--val-split", type=COUNT, default=0, help="hold out N train images (seeded) to validate on")
    g.add_argument("--gpu-data", action="store_true", help="keep the uint8 dataset on the device; augment there")
    g.add_argument("-j", "--workers", type=COUNT, default=4, help="DataLoader workers per process (and decoders)")
    g.add_argument("--random-erasing", type=PROBABILITY, default=0.0, help="erase a random rectangle, probability P")
    add_shared_args(p, "runs/cifar", epochs=30)
    p.add_argument("-a", "--arch", default="resnet18", choices=ARCHS, metavar="|".join(ARCHS))
    g = p.add_argument_group("optimization")
    g.add_argument("-b", "--batch-size", type=POSITIVE, default=128, help="per process; global = this x world x accum")
    g.add_argument("--lr", type=ABOVE_0, default=0.2, help="peak LR for a global batch of 512, scaled linearly")
    g.add_argument("--momentum", type=FRACTION, default=0.9, help="SGD momentum")
    g.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=True, help="Nesterov momentum")
    g.add_argument("--wd", "--weight-decay", dest="weight_decay", type=AT_LEAST_0, default=5e-4, help="weights only")
    g.add_argument("--label-smoothing", type=FRACTION, default=0.1, help="of the cross-entropy targets")
    g.add_argument("--ema", type=FRACTION, default=0.0, help="evaluate an average of the weights, this decay (0: off)")
    g.add_argument("--warmup-epochs", type=AT_LEAST_0, default=1.0, help="linear LR warmup")
    g.add_argument("--lr-schedule", choices=("cosine", "onecycle"), default="cosine", help="after the warmup")
    g.add_argument("-e", "--evaluate", action="store_true", help="only evaluate the checkpoint given by --resume")
    g.add_argument("--tta", action="store_true", help="also average predictions over horizontal flips at eval")
    return p


def build_model(arch: str) -> nn.Module:
    if arch in DEPTHS:  # the paper's CIFAR ResNets, built for 32 px
        return CifarResNet(DEPTHS[arch])
    model = getattr(torchvision.models, arch)(num_classes=10)
    # CIFAR stem: 3x3 stride-1 conv, no max-pool, so 32x32 inputs keep their resolution.
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def train_batches(args, data, sampler, epoch: int, skip: int, info, channels_last: bool):
    """(x, y) device batches of ``epoch``'s rest, after the ``skip`` micro-batches already done."""
    sampler.set_epoch(epoch, skip=skip * args.batch_size)  # [DDP 2] this rank's shard, in epoch e's order
    if args.gpu_data:
        yield from data.train_batches(sampler.indices()[skip * args.batch_size :], args.batch_size,
                                      args.random_erasing, args.seed, epoch, info.rank, skip)  # fmt: skip
        return
    memory_format = torch.channels_last if channels_last else torch.preserve_format
    for x, y in data:
        yield x.to(info.device, non_blocking=True, memory_format=memory_format), y.to(info.device, non_blocking=True)


def evaluate(model, ema, data, args, info, dtype) -> dict[str, float]:
    """[DDP 5] Exact metrics of the EMA weights where --ema is on (the raw model's as raw_*), else of the model."""
    metrics = {}
    for prefix, net in [("raw_" if ema else "", model)] + ([("", ema.module)] if ema else []):
        if args.gpu_data:
            batches = data.eval_batches(info.rank, info.world_size)
        else:
            batches = ((x.to(info.device), y.to(info.device)) for x, y in data)
        m = evaluate_classifier(net, watched(batches, evaluating=True), info.device, dtype, args.tta)
        metrics.update({f"{prefix}{k}": v for k, v in m.items() if not (prefix and k == "count")})
    return metrics


def train_one_epoch(model, criterion, optimizer, scaler, ema, batches, pos: Position, window: LossWindow, args, info,
                    logger: MetricsLogger, writer: CheckpointWriter, lr_of, end: int) -> bool:  # fmt: skip
    """Optimizer steps over ``batches`` up to step ``end`` (the epoch's last or --max-steps). Returns True if the
    ranks agreed to stop before it (preemption), leaving the loss window open for the checkpoint to hold."""
    model.train()
    dtype = amp_dtype(args.amp, info.device)
    for micro, (x, y) in enumerate(batches, start=1):
        sync = micro % args.accum_steps == 0
        # [DDP 3] micro-batches that do not step accumulate locally: no gradient all-reduce until the last one
        with model.no_sync() if not sync and info.world_size > 1 else contextlib.nullcontext():
            with torch.autocast(info.device.type, dtype, enabled=dtype is not None):
                loss = criterion(model(x), y)
            scaler.scale(loss / args.accum_steps).backward()
        window.sum += loss.detach()
        if not sync:
            continue
        for group in optimizer.param_groups:  # the LR of this step: a pure function of the position in training
            group["lr"] = lr = lr_of(pos.epoch, pos.batch_in_epoch // args.accum_steps)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        pos.step, pos.batch_in_epoch, window.n = pos.step + 1, pos.batch_in_epoch + args.accum_steps, window.n + 1
        if ema is not None:
            ema.update(pos.step)
        save = args.save_every_steps and pos.step % args.save_every_steps == 0 and pos.step < end
        if pos.step % args.print_freq == 0 or save or pos.step == end:
            log_loss(window, pos, args, info, logger, lr)
        if save and info.is_main:  # [DDP 6] rank 0 alone writes; the save holds no collective
            writer.save(checkpoint_state(model, optimizer, scaler, pos, args, info.world_size, ema),
                        Path(args.output_dir) / "last.pt", args.keep_last)  # fmt: skip
        if pos.step == end:
            return False
        if stop_requested(pos.step):  # every rank sees it at the same step
            return True
    return False


def log_loss(window: LossWindow, pos: Position, args, info, logger: MetricsLogger, lr: float) -> None:
    """A train record: the mean loss since the last one, over every rank, then a new window."""
    sums = all_reduce_sum(window.sums.clone())  # [DDP 4] each rank's sum: the one host sync of a log point
    loss = sums.sum().item() / (window.n * args.accum_steps * info.world_size)
    check_finite(loss, pos.step)
    ips = window.n * args.batch_size * args.accum_steps * info.world_size / (time.time() - window.t0)
    logger.log({"split": "train", "epoch": pos.epoch, "step": pos.step, "loss": loss, "lr": lr, "img_per_s": ips})
    logger.progress(pos.step, f"epoch {pos.epoch} loss {loss:.4f} lr {lr:.4g} {ips:.0f} img/s")
    window.reset()


def main(args: argparse.Namespace) -> None:
    t_start = time.time()
    # [hardening] Deleting this call and its import loses: one-line errors for bad input, preemption (SIGTERM: save,
    # [hardening] exit 75), the stall watchdog, the --output-dir lock, ranks that die with their launcher.
    hardening.enable(args)
    info = setup_distributed(args)  # [DDP 1] init the process group (any launcher) and pick this rank's device
    device, out = info.device, Path(args.output_dir)
    dtype = amp_dtype(args.amp, device)
    torch.manual_seed(args.seed + info.rank)  # each rank its own; DDP starts every rank from rank 0's weights
    out.mkdir(parents=True, exist_ok=True)
    global_batch = args.batch_size * info.world_size * args.accum_steps
    channels_last = args.channels_last if args.channels_last is not None else device.type == "cuda"

    # ---- data: a cache of decoded images is written by one rank per host, the others wait for it
    train_ds, eval_ds, eval_name = load_splits(args, out, writer=info.local_rank == 0, is_main=info.is_main)
    if len(train_ds) < global_batch and not args.evaluate:
        raise UserError(f"global batch {global_batch} is larger than the {len(train_ds)} training images (lower -b)")
    # [DDP 2] each rank reads its own shard of every epoch; the order of epoch e depends only on (seed, e)
    sampler = ResumableDistributedSampler(len(train_ds), info.rank, info.world_size, args.seed)
    steps_per_epoch = len(sampler) // args.batch_size // args.accum_steps
    if args.gpu_data:  # uint8 on the device, augmented there
        train_data = eval_data = DeviceData(train_ds, eval_ds, device)
    else:
        kw = loader_kwargs(args.workers, args.seed, info.rank, device)
        train_data = torch.utils.data.DataLoader(SeededDataset(train_ds, args.seed), args.batch_size, sampler=sampler,
                                                 drop_last=True, **kw)  # fmt: skip
        eval_data = torch.utils.data.DataLoader(  # each image on one rank, none padded: exact metrics
            eval_ds, 256, sampler=range(info.rank, len(eval_ds), info.world_size), **kw
        )

    # ---- model: with -e, the checkpoint's (and its evaluation settings) unless the command line says otherwise
    ckpt_path, pos = resolve_resume(args.resume, out), Position()
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True) if ckpt_path else {}  # runs no code
    if args.evaluate and ckpt:
        from_checkpoint(get_args_parser(), args, ckpt["args"], ("arch",), ("tta",))
    model = build_model(args.arch).to(device)
    if args.sync_bn and info.world_size > 1 and device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    ddp = model
    if info.world_size > 1:  # [DDP 3] wrap the model: backward all-reduces the gradients, bucket by bucket
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                                  gradient_as_bucket_view=True)  # fmt: skip
    # a 32-px step is short enough that launching kernels sets the pace: reduce-overhead replays them as CUDA graphs
    train_model = torch.compile(ddp, mode=args.compile_mode) if args.compile else ddp
    ema = EMA(model, args.ema) if args.ema else None  # saved, restored and evaluated with the model

    # ---- optimizer; the LR is set each step by lr_at, a function of the position in training alone
    peak_lr = args.lr * global_batch / 512
    optimizer = torch.optim.SGD(param_groups(model, args.weight_decay), lr=peak_lr, momentum=args.momentum,
                                nesterov=args.nesterov)  # fmt: skip
    lr_of = partial(lr_at, peak=peak_lr, args=args, steps_per_epoch=steps_per_epoch)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    # ---- resume: the same command, restarted, continues where the run stopped
    if ckpt:
        pos = resume(ckpt_path, ckpt, model, optimizer, scaler, ema, world_size=info.world_size,
                     batch_size=args.batch_size, accum_steps=args.accum_steps)  # fmt: skip
    if args.evaluate:
        if ckpt_path is None:
            raise UserError("--evaluate needs a checkpoint: --resume PATH (or an output dir with last.pt)")
        if ema is None and "ema" in ckpt:  # a checkpoint with averaged weights: evaluate those, as training did
            ema = EMA(model, 0.0)
            ema.module.load_state_dict(ckpt["ema"])
        m = evaluate(model, ema, eval_data, args, info, dtype)
        logger = MetricsLogger(out, info, pos)  # appends to metrics.jsonl
        logger.start(args, info, "cifar_resnet")
        logger.log({"split": eval_name, "epoch": pos.epoch, "step": pos.step, **m})
        return print0(f"{ckpt_path} {eval_name}: {describe(m)}")
    total_steps = pos.step + (args.epochs - pos.epoch) * steps_per_epoch - pos.batch_in_epoch // args.accum_steps
    max_steps = min(total_steps, args.max_steps or total_steps)
    if pos.step >= max_steps:
        return print0(f"done: step {pos.step} (already finished: nothing to do)")
    same_run = ckpt_path is not None and ckpt_path.resolve().parent == out.resolve()
    logger = MetricsLogger(out, info, pos, keep=pos.log_lines if same_run else 0, total=max_steps)
    logger.start(args, info, "cifar_resnet", global_batch=global_batch, peak_lr=peak_lr,
                 steps_per_epoch=steps_per_epoch)  # fmt: skip
    writer = CheckpointWriter()
    print0(f"{args.arch} on {len(train_ds)} images | {info.world_size} process(es) on {device.type} ({info.launcher}) "
           f"| global batch {global_batch} = {args.batch_size} x {info.world_size} x {args.accum_steps} | peak lr "
           f"{peak_lr:.4g}")  # fmt: skip

    # ---- training: an epoch, its evaluation, then the checkpoint that moves the position past it
    window = LossWindow(info, ckpt.get("window"))
    for epoch in range(pos.epoch, args.epochs):
        batches = watched(train_batches(args, train_data, sampler, epoch, pos.batch_in_epoch, info, channels_last))
        end = min(max_steps, pos.step + steps_per_epoch - pos.batch_in_epoch // args.accum_steps)
        stopped = train_one_epoch(train_model, criterion, optimizer, scaler, ema, batches, pos, window, args, info,
                                  logger, writer, lr_of, end)  # fmt: skip
        if stopped:  # preempted: every rank at this step; rank 0 saves it, with every rank's part of the open window
            sums = all_reduce_sum(window.sums.clone())
            if info.is_main:  # [DDP 6]
                writer.save(checkpoint_state(model, optimizer, scaler, pos, args, info.world_size, ema,
                                             window={"sums": sums, "n": window.n}), out / "last.pt")  # fmt: skip
            break
        better = False
        if pos.batch_in_epoch >= steps_per_epoch * args.accum_steps:
            pos.epoch, pos.batch_in_epoch = epoch + 1, 0
        if args.eval_every and (pos.step >= max_steps or pos.epoch > epoch and (
                pos.epoch % args.eval_every == 0 or pos.epoch == args.epochs)):  # fmt: skip
            m = evaluate(model, ema, eval_data, args, info, dtype)
            logger.log({"split": eval_name, "epoch": pos.epoch, "step": pos.step, **m})
            print0(f"epoch {pos.epoch} {eval_name}: {describe(m)}")
            better, pos.best_metric = m["acc1"] > pos.best_metric, max(m["acc1"], pos.best_metric)
        if info.is_main:  # [DDP 6] rank 0 alone writes; the save holds no collective
            state = checkpoint_state(model, optimizer, scaler, pos, args, info.world_size, ema)
            if better:
                writer.save(state, out / "best.pt")
            keep = args.keep_last if args.save_every_steps and pos.step % args.save_every_steps == 0 else 0
            writer.save(state, out / "last.pt", keep)
        if pos.step >= max_steps:
            break
    writer.wait()  # the last checkpoint is on disk before the run says so
    logger.close()
    best = f", best {eval_name} acc1 {pos.best_metric:.2f}" if args.eval_every else ""
    if not stopped:
        print0(f"done: step {pos.step}{best}, wall {time.time() - t_start:.1f}s")


def describe(m: dict[str, float]) -> str:
    return f"loss {m['loss']:.4f} acc1 {m['acc1']:.2f} acc5 {m['acc5']:.2f} ({m['count']} images)"


if __name__ == "__main__":
    run_cli(main, get_args_parser().parse_args())
