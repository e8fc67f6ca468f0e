"""Train a ResNet on CIFAR-10 with DistributedDataParallel.

    python cifar_resnet/train.py --synthetic --epochs 1                     # 1 process
    torchrun --standalone --nproc_per_node=2 cifar_resnet/train.py ...     # N processes
    (Slurm, MPI, --dist-url: see scripts/ -- the script itself is unchanged)

Read main() top to bottom: arguments -> distributed setup -> data -> model -> optimizer -> resume -> epochs of
train_one_epoch(), each followed by evaluate() and a checkpoint. The DDP recipe is four steps, marked [DDP 1-4].
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
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn
import torchvision

if not __package__:  # run as a script: import this folder as a package, whatever it is called, and find common/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = Path(__file__).resolve().parent.name
from common.checkpoint import (
    CheckpointWriter,
    Position,
    checkpoint_state,
    resolve_resume,
    restore_training,
    set_schedule_position,
)
from common.checks import add_run_args, check_shared, need
from common.data import ResumableDistributedSampler, SeededDataset, loader_kwargs
from common.distributed import (
    add_dist_args,
    barrier,
    broadcast_buffers,
    cleanup_distributed,
    print0,
    seed_everything,
    setup_distributed,
)
from common.errors import UserError, run_cli
from common.metrics import LossWindow, MetricsLogger, Progress, prepare_output_dir
from common.utils import EMA, StopSignal, amp_dtype, autocast, describe, evaluate_classifier, lr_lambda, param_groups
from common.watchdog import CHECKPOINT, Watchdog

from .data import DeviceData, eval_transform, load_splits, train_transform
from .model import DEPTHS, CifarResNet

T_START = time.time()
ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", *DEPTHS)


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    g = p.add_argument_group("data")
    g.add_argument("--data-dir", default="data/cifar10",
                   help="torchvision CIFAR-10 root, or ImageFolder with train/ and test/ (or val/)")  # fmt: skip
    g.add_argument("--download", action="store_true", help="download torchvision CIFAR-10 into --data-dir (rank 0)")
    g.add_argument("--synthetic", action="store_true", help="random images of the right shape: no disk, no network")
    g.add_argument("--val-split", type=int, default=0, help="hold out N train images (seeded) as the validation set")
    g.add_argument("--gpu-data", action="store_true", help="keep the uint8 dataset on the device; augment there")
    g.add_argument("-j", "--workers", type=int, default=4, help="DataLoader workers per process (and decode processes)")
    g.add_argument("--random-erasing", type=float, default=0.0, help="erase a random rectangle with probability P")
    g = p.add_argument_group("model")
    g.add_argument("-a", "--arch", default="resnet18", help="|".join(ARCHS))
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    g.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across ranks (GPU only)")
    g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None, help="default: on with CUDA")
    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=int, default=30, help="passes over the training set")
    g.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    g.add_argument("-b", "--batch-size", type=int, default=128, help="per process; global = this x world size x accum")
    g.add_argument("--accum-steps", type=int, default=1, help="gradient accumulation micro-batches per step")
    g.add_argument("--lr", type=float, default=0.2, help="peak LR for a global batch of 512, scaled linearly")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    g.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=True, help="Nesterov momentum")
    g.add_argument("--wd", "--weight-decay", dest="weight_decay", type=float, default=5e-4, help="on weights only")
    g.add_argument("--label-smoothing", type=float, default=0.1, help="of the cross-entropy targets")
    g.add_argument("--ema", type=float, default=0.0, help="evaluate an average of the weights with this decay (0: off)")
    g.add_argument("--warmup-epochs", type=float, default=1.0, help="linear LR warmup")
    g.add_argument("--lr-schedule", choices=("cosine", "onecycle"), default="cosine", help="after the warmup")
    g.add_argument("--amp", choices=("auto", "bf16", "fp16", "none"), default="auto", help="auto: bf16 on GPU only")
    g.add_argument("-e", "--evaluate", action="store_true", help="only evaluate the checkpoint given by --resume")
    g.add_argument("--tta", action="store_true", help="also average predictions over horizontal flips at eval")
    add_run_args(p, "runs/cifar")
    add_dist_args(p)
    return p


def check_args(args: argparse.Namespace) -> None:
    check_shared(args)
    need(args.arch in ARCHS, "--arch", repr(args.arch), "is unknown", f"choose from {', '.join(ARCHS)}")
    need(args.val_split >= 0, "--val-split", args.val_split, "must be 0 or more", "0: evaluate on test/")
    need(0 <= args.random_erasing <= 1, "--random-erasing", args.random_erasing, "must be in [0, 1]", "0: off")
    need(0 <= args.ema < 1, "--ema", args.ema, "must be in [0, 1)", "a decay such as 0.999; 0: off")
    need(not (args.download and args.synthetic), "--download", "with --synthetic", "makes no sense", "drop one")


class Clock:
    """Wall time by phase (start, data, compile, eval, checkpoint; train is the rest), plus what earlier processes
    of the run spent up to their last checkpoint (``carried``, from last.pt)."""

    def __init__(self, t_process: float, t_start: float, t_data: float):
        self.parts = {"start": t_start - t_process, "data": t_data - t_start, "eval": 0.0, "checkpoint": 0.0}
        self.t_process, self.t_data, self.carried = t_process, t_data, {}

    def total(self) -> dict[str, float]:
        now = {**self.parts, "wall": time.time() - self.t_process}
        return {k: now.get(k, 0.0) + self.carried.get(k, 0.0) for k in {*now, *self.carried}}

    def record(self) -> dict[str, float]:
        total = self.total()
        total["train"] = total["wall"] - sum(v for k, v in total.items() if k != "wall")
        return {k: total.get(k, 0.0) for k in ("start", "data", "compile", "train", "eval", "checkpoint", "wall")}


def build_model(arch: str) -> nn.Module:  # arch: one of ARCHS (check_args)
    if arch in DEPTHS:  # the paper's CIFAR ResNets, built for 32 px
        return CifarResNet(DEPTHS[arch])
    model = getattr(torchvision.models, arch)(num_classes=10)
    # CIFAR stem: 3x3 stride-1 conv, no max-pool, so 32x32 inputs keep their resolution.
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def build_data(args, info, out: Path, global_batch: int) -> SimpleNamespace:
    """Datasets, the train sampler and loaders, or with --gpu-data the whole uint8 dataset on the device."""
    tf_eval = eval_transform()
    if args.download and info.is_main:  # rank 0 downloads, the others wait, then all read
        load_splits(args, None, None, out, writer=False)
    barrier()
    # JPEG folders are decoded once into a cache file (one rank per host writes it, the others wait and read).
    splits = functools.partial(load_splits, args, cache_dir=out, writer=info.local_rank == 0)
    d = SimpleNamespace()
    if args.gpu_data:  # uint8 on the device, augmented there
        train_ds, eval_ds, d.eval_name = splits(None, None)
        d.gpu = DeviceData(train_ds, eval_ds, info.device)
    else:
        train_ds, eval_ds, d.eval_name = splits(train_transform(args, tf_eval), tf_eval)
    d.n_train = len(train_ds)
    if not d.n_train or not len(eval_ds):
        raise UserError(f"empty dataset in {args.data_dir} (train {d.n_train} images, eval {len(eval_ds)})")
    if d.n_train < global_batch:
        raise UserError(f"global batch {global_batch} is larger than the {d.n_train} training images (lower -b)")
    # [DDP 2] every rank reads a different shard; the order of epoch e depends only on (seed, e).
    d.sampler = ResumableDistributedSampler(d.n_train, info.rank, info.world_size, args.seed)
    d.steps_per_epoch = len(d.sampler) // args.batch_size // args.accum_steps
    if not args.gpu_data:
        kw = loader_kwargs(args.workers, args.seed, info.rank, info.device)
        d.train_loader = torch.utils.data.DataLoader(
            SeededDataset(train_ds, args.seed), args.batch_size, sampler=d.sampler, drop_last=True, **kw
        )
        d.eval_loader = torch.utils.data.DataLoader(  # each image on one rank, no padding: exact metrics
            eval_ds, 256, sampler=range(info.rank, len(eval_ds), info.world_size), **kw
        )
    return d


def train_batches(args, d: SimpleNamespace, device: torch.device, rank: int, epoch: int, skip: int):
    """(x, y) device batches of `epoch`, after skipping `skip` micro-batches already done."""
    d.sampler.set_epoch(epoch, skip=skip * args.batch_size)
    n = max(0, d.steps_per_epoch * args.accum_steps - skip) * args.batch_size
    if args.gpu_data:
        indices = d.sampler.indices()[skip * args.batch_size :][:n]
        yield from d.gpu.train_batches(indices, args.batch_size, args.random_erasing, args.seed, epoch, rank, skip)
        return
    for i, (x, y) in enumerate(d.train_loader):
        if i * args.batch_size >= n:
            return
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def eval_batches(args, d: SimpleNamespace, device: torch.device, rank: int, world_size: int):
    if args.gpu_data:
        yield from d.gpu.eval_batches(rank, world_size)
        return
    for x, y in d.eval_loader:
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def evaluate(r: SimpleNamespace, watched: bool = True) -> dict[str, float]:
    """Exact metrics of the EMA weights if any (the raw model's as raw_*), else of the model."""
    t, m = time.time(), {}
    for prefix, net in [("", r.model)] + ([("ema", r.ema.module)] if r.ema else []):
        broadcast_buffers(net)  # every rank evaluates rank 0's BN statistics, as saved
        batches = eval_batches(r.args, r.data, r.info.device, r.info.rank, r.info.world_size)
        batches = r.watchdog.batches(batches, evaluating=True) if watched else batches
        m[prefix] = evaluate_classifier(net, batches, r.info.device, r.dtype, r.args.tta)
    r.clock.parts["eval"] += time.time() - t
    return {**m["ema"], **{f"raw_{k}": v for k, v in m[""].items()}} if r.ema else m[""]


def save_state(name: str, r: SimpleNamespace, pos: Position, keep_last: int = 0) -> float:
    """Checkpoint ``name`` (rank 0 writes, on a thread; every rank calls it); returns the seconds it took."""
    t = time.time()
    r.watchdog.beat(CHECKPOINT)
    window = r.loss_window.state(pos.step)  # stops on a NaN or infinite loss since the last log point
    if r.info.is_main:  # [DDP 4] only rank 0 writes, atomically
        state = checkpoint_state(r.model, r.optimizer, r.scheduler, r.scaler, pos, r.args, r.info.world_size,
                                 r.ema, loss_window=window, wall=r.clock.total())  # fmt: skip
        r.writer.save(state, r.out / name, keep_last=keep_last)
    r.clock.parts["checkpoint"] += time.time() - t
    return time.time() - t


def train_one_epoch(r: SimpleNamespace, pos: Position, max_steps: int) -> None:
    """Optimizer steps from ``pos`` to the end of its epoch or ``max_steps`` (or a stop signal: ``r.stopped``)."""
    args, info, window = r.args, r.info, r.loss_window
    r.train_model.train()
    micro = 0
    for x, y in r.watchdog.batches(train_batches(args, r.data, info.device, info.rank, pos.epoch, pos.batch_in_epoch)):
        micro += 1
        sync = micro % args.accum_steps == 0
        with r.ddp.no_sync() if (not sync and info.world_size > 1) else contextlib.nullcontext():
            with autocast(info.device, r.dtype):
                loss = r.criterion(r.train_model(x.contiguous(memory_format=torch.channels_last) if r.cl else x), y)
            r.scaler.scale(loss / args.accum_steps).backward()
        window.sum += loss.detach()
        if not sync:
            continue
        r.scaler.step(r.optimizer)
        r.scaler.update()
        r.optimizer.zero_grad(set_to_none=True)
        r.scheduler.step()
        pos.step += 1
        if r.ema:
            r.ema.update(pos.step)
        if "compile" not in r.clock.parts:  # the first step compiles: one sync to time it
            if info.device.type == "cuda":
                torch.cuda.synchronize(info.device)
            r.clock.parts["compile"] = time.time() - r.clock.t_data
        pos.batch_in_epoch += args.accum_steps
        window.n += args.accum_steps
        if pos.step % args.print_freq == 0 or pos.step == max_steps:
            loss_avg = window.mean(pos.step)  # the one host sync
            ips = (pos.step - window.step0) * r.global_batch / (time.time() - window.t0)
            lr = r.scheduler.get_last_lr()[0]
            r.logger.log({"split": "train", "epoch": pos.epoch, "step": pos.step, "loss": loss_avg, "lr": lr,
                          "img_per_s": ips})  # fmt: skip
            r.progress.update(pos.step, f"epoch {pos.epoch} loss {loss_avg:.4f} lr {lr:.4g} {ips:.0f} img/s")
            window.reset(pos.step)
        if args.save_every_steps and pos.step % args.save_every_steps == 0:
            window.t0 += save_state("last.pt", r, pos, args.keep_last)
        r.stopped = r.stop.should_stop()
        if pos.step >= max_steps or r.stopped:
            return


def main(args: argparse.Namespace) -> None:
    # [DDP 1] init the process group (torchrun, Slurm, MPI, --dist-url or none) and pick this rank's device.
    info = setup_distributed(args)
    device = info.device
    seed_everything(args.seed, info.rank)
    out = prepare_output_dir(args.output_dir)
    t_start = time.time()
    r = SimpleNamespace(args=args, info=info, out=out, dtype=amp_dtype(args.amp, device), stopped=False)
    r.cl = args.channels_last if args.channels_last is not None else device.type == "cuda"
    r.global_batch = args.batch_size * info.world_size * args.accum_steps

    data = r.data = build_data(args, info, out, r.global_batch)
    r.clock = Clock(T_START, t_start, time.time())
    steps_per_epoch = data.steps_per_epoch

    # ---- model
    model = build_model(args.arch).to(device)
    if args.sync_bn and info.world_size > 1 and device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if r.cl:
        model = model.to(memory_format=torch.channels_last)
    # r.model is what we save, restore and evaluate. Eval runs eager: uneven shards and a second compile cost more.
    r.model = r.ddp = model
    # [DDP 3] wrap the model: gradients are averaged across ranks during backward.
    if info.world_size > 1:
        r.ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True
        )
    # a 32-px step is short enough that launching kernels sets the pace: reduce-overhead replays them as CUDA graphs
    r.train_model = torch.compile(r.ddp, mode=args.compile_mode) if args.compile else r.ddp
    r.ema = EMA(model, args.ema) if args.ema else None  # evaluated, saved and restored with the model

    # ---- optimizer and LR schedule (a pure function of the step)
    lr = args.lr * r.global_batch / 512
    r.optimizer = torch.optim.SGD(param_groups(model, args.weight_decay), lr=lr, momentum=args.momentum,
                                  nesterov=args.nesterov)  # fmt: skip
    r.scheduler = torch.optim.lr_scheduler.LambdaLR(r.optimizer, lr_lambda(args, steps_per_epoch))
    r.scaler = torch.amp.GradScaler(device.type, enabled=r.dtype == torch.float16)
    r.criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    # ---- resume (same command restarted by torchrun/Slurm continues where it stopped)
    pos, ckpt_path, ckpt = Position(), resolve_resume(args.resume, out), {}
    if ckpt_path is not None:
        pos, ckpt = restore_training(ckpt_path, model, r.optimizer, r.scheduler, r.scaler, ema=r.ema,
                                     world_size=info.world_size, batch_size=args.batch_size,
                                     accum_steps=args.accum_steps)  # fmt: skip
    set_schedule_position(r.scheduler, pos.epoch * steps_per_epoch + pos.batch_in_epoch // args.accum_steps, lr)
    r.clock.carried = ckpt.get("wall", {})  # earlier processes' time, each up to its last checkpoint
    r.writer = CheckpointWriter(out if info.is_main else None)  # writes on a thread

    r.logger = logger = MetricsLogger(out, info, args.wandb)
    extra = dict(global_batch=r.global_batch, peak_lr=lr, steps_per_epoch=steps_per_epoch)
    pos.wandb_id = logger.start(args, "cifar_resnet", pos.wandb_id, extra)

    if args.evaluate:
        if ckpt_path is None:
            raise UserError("--evaluate needs a checkpoint: --resume PATH (or an output dir with last.pt)")
        if r.ema is None and "ema" in ckpt:  # a checkpoint with averaged weights: evaluate those, as training did
            r.ema = EMA(model, 0.0)
            r.ema.module.load_state_dict(ckpt["ema"])
        m = evaluate(r, watched=False)
        logger.log({"split": data.eval_name, "epoch": pos.epoch, "step": pos.step, **m})
        print0(f"{ckpt_path} {data.eval_name}: {describe(m)}")
        return
    print0(
        f"{args.arch} on {data.n_train} images | {info.world_size} process(es) on {device.type} ({info.launcher}) | "
        f"global batch {r.global_batch} = {args.batch_size} x {info.world_size} x {args.accum_steps} | peak lr {lr:.4g}"
    )
    total_steps = pos.step + (args.epochs - pos.epoch) * steps_per_epoch - pos.batch_in_epoch // args.accum_steps
    max_steps = min(total_steps, args.max_steps or total_steps)
    r.progress, r.stop = Progress(info, max_steps, pos.step), StopSignal()
    r.watchdog = Watchdog(args.stall_timeout, info.rank)  # a stall becomes stacks and an exit
    r.loss_window = LossWindow(info, pos.step, ckpt.get("loss_window"))

    # ---- training: an evaluation that the last process did not record comes before any further step
    pending = pos.eval_due(args.eval_every, args.epochs, max_steps)
    todo = pos.step < max_steps or pending  # False: a rerun of a finished run, which changes no file
    if todo and ckpt_path is not None:
        logger.rewind(pos.step, pos.eval_step)
    while not r.stopped and (pos.step < max_steps or pending):
        if not pending:
            train_one_epoch(r, pos, max_steps)
        if pos.batch_in_epoch >= steps_per_epoch * args.accum_steps:
            pos.epoch, pos.batch_in_epoch = pos.epoch + 1, 0
        if not r.stopped and pos.eval_due(args.eval_every, args.epochs, max_steps):  # a preempted run's rerun does it
            m = evaluate(r)
            logger.log({"split": data.eval_name, "epoch": pos.epoch, "step": pos.step, **m})
            print0(f"epoch {pos.epoch} {data.eval_name}: {describe(m)}")
            if m["acc1"] > pos.best_metric:
                pos.best_metric = m["acc1"]
                save_state("best.pt", r, pos)
            pos.eval_step = r.loss_window.step0 = pos.step
            r.loss_window.t0 = time.time()  # evaluation time is not throughput
        pending = False
        r.loss_window.t0 += save_state("last.pt", r, pos)  # keep checkpoint time out of the throughput too
    r.stop.close()
    r.watchdog.stop()
    r.writer.wait()  # the last checkpoint is on disk before the run says so
    if r.stopped:
        r.stop.exit_preempted(pos.step, logger)
    best = f"done: step {pos.step}" + (f", best {data.eval_name} acc1 {pos.best_metric:.2f}" if args.eval_every else "")
    if not todo:
        print0(f"{best} (already finished: nothing to do)")
        return logger.close()
    parts = r.clock.record()  # the time of every process of the run: each one's up to its last checkpoint
    logger.log({"split": "time", **{f"{k}_s": round(v, 2) for k, v in parts.items()}})
    split = ", ".join(f"{k} {v:.1f}s" for k, v in parts.items() if k != "wall")
    how = "since start" if not r.clock.carried else "summed over its processes"
    print0(f"{best} ({split}), wall {parts['wall']:.1f}s {how}")
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
