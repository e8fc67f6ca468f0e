"""Train a ResNet on CIFAR-10 with DistributedDataParallel.

    python cifar_resnet/train.py --synthetic --epochs 1                     # 1 process
    torchrun --standalone --nproc_per_node=2 cifar_resnet/train.py ...     # N processes
    (Slurm, MPI, --dist-url: see scripts/ -- the script itself is unchanged)

Read top to bottom: arguments -> distributed setup -> data -> model -> optimizer
-> resume -> training loop with periodic eval and checkpoints. The DDP recipe is
four steps, marked [DDP 1-4] below.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import sys
import time
from pathlib import Path

gc.disable()  # until the end of the imports: see there
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # find common/ when run as a script
from cifar_resnet.data import (
    MEAN,
    STD,
    gpu_crop_flip,
    gpu_random_erasing,
    load_splits,
    normalize,
    to_uint8_tensors,
    train_transform,
)
from cifar_resnet.model import DEPTHS, CifarResNet
from common.checkpoint import (
    CheckpointWriter,
    Position,
    eval_due,
    resolve_resume,
    restore_training,
    set_schedule_position,
)
from common.checks import check_shared, need
from common.data import (
    ExactEvalSampler,
    ResumableDistributedSampler,
    SeededDataset,
    init_worker,
    loader_generator,
    worker_context,
)
from common.distributed import (
    add_dist_args,
    all_reduce_sum,
    barrier,
    broadcast_buffers,
    cleanup_distributed,
    mix_seed,
    print0,
    seed_everything,
    setup_distributed,
)
from common.errors import UserError, run_cli
from common.metrics import LossWindow, MetricsLogger, Progress, prepare_output_dir
from common.utils import (
    StopSignal,
    amp_dtype,
    autocast,
    check_finite_loss,
    describe,
    evaluate_classifier,
    param_groups,
    warmup_cosine,
)
from common.watchdog import CHECKPOINT, Watchdog

# Python's cyclic garbage collector would run hundreds of times during the imports above, scanning the same young
# objects over and over: about a quarter of a process's start-up CPU, paid again by every rank and restart
# (bench/startup.py). It was off for them; what they built lives as long as the process, so freeze it out of every
# later collection (each then skips these few hundred thousand objects) and turn the collector back on. No
# collection first: DataLoader workers run this module's top level again, and one would scan all they inherit.
gc.freeze()
gc.enable()

T_START = time.time()
ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", *DEPTHS)


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--data-dir",
        default="data/cifar10",
        help="torchvision CIFAR-10 root, or ImageFolder with train/ and test/ (or val/)",
    )
    g.add_argument(
        "--download", action="store_true", help="download torchvision CIFAR-10 into --data-dir (rank 0 only)"
    )
    g.add_argument("--synthetic", action="store_true", help="random images of the right shape: no disk, no network")
    g.add_argument("--val-split", type=int, default=0, help="hold out N train images (seeded) as the validation set")
    g.add_argument(
        "--gpu-data", action="store_true", help="keep the uint8 dataset on the device; crop+flip there (fastest)"
    )
    g.add_argument("-j", "--workers", type=int, default=4, help="DataLoader workers per process (and decode processes)")
    g.add_argument("--random-erasing", type=float, default=0.0, help="erase a random rectangle with probability P")
    g = p.add_argument_group("model")
    g.add_argument("-a", "--arch", default="resnet18", help="|".join(ARCHS))
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    g.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across ranks (GPU only)")
    g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None, help="default: on with CUDA")
    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=int, default=30)
    g.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    g.add_argument("-b", "--batch-size", type=int, default=128, help="per process; global = this x world size x accum")
    g.add_argument("--accum-steps", type=int, default=1, help="gradient accumulation micro-batches per step")
    g.add_argument("--lr", type=float, default=0.2, help="peak LR for a global batch of 512, scaled linearly")
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--wd", "--weight-decay", dest="weight_decay", type=float, default=5e-4)
    g.add_argument("--label-smoothing", type=float, default=0.1)
    g.add_argument("--ema", type=float, default=0.0, help="evaluate an average of the weights with this decay (0: off)")
    g.add_argument("--warmup-epochs", type=float, default=1.0)
    g.add_argument("--sched", choices=("cosine", "onecycle"), default="cosine")
    g.add_argument(
        "--amp", choices=("auto", "bf16", "fp16", "none"), default="auto", help="auto: bf16 on GPU, off on CPU"
    )
    g.add_argument("-e", "--evaluate", action="store_true", help="only evaluate the checkpoint given by --resume")
    g.add_argument("--tta", action="store_true", help="also average predictions over horizontal flips at eval")
    g = p.add_argument_group("run")
    g.add_argument("--output-dir", default="runs/cifar")
    g.add_argument("--resume", default="auto", help="auto (continue from output-dir/last.pt if present) | PATH | none")
    g.add_argument("--overwrite", action="store_true", help="with --resume none: start over where a run saved")
    g.add_argument("--save-every-steps", type=int, default=0, help="also checkpoint every N steps (0: at epoch end)")
    g.add_argument("--keep-last", type=int, default=0, help="keep the N newest step_*.pt copies (0: none)")
    g.add_argument("--eval-every", type=int, default=1, help="evaluate every N epochs and at the end (0: never)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("-p", "--print-freq", type=int, default=50, help="log every N steps")
    g.add_argument("--wandb", action="store_true", help="log to Weights & Biases from rank 0 (honours WANDB_MODE)")
    add_dist_args(p)
    return p


def check_args(args: argparse.Namespace) -> None:
    """Every flag's value, before any process group, data or model (common/checks.py has the shared rules)."""
    check_shared(args)
    need(args.arch in ARCHS, "--arch", repr(args.arch), "is unknown", f"choose from {', '.join(ARCHS)}")
    need(args.val_split >= 0, "--val-split", args.val_split, "must be 0 or more", "0: evaluate on test/")
    need(0 <= args.random_erasing <= 1, "--random-erasing", args.random_erasing, "must be in [0, 1]", "0: off")
    need(0 <= args.ema < 1, "--ema", args.ema, "must be in [0, 1)", "a decay such as 0.999; 0: off")
    need(not (args.download and args.synthetic), "--download", "with --synthetic", "makes no sense", "drop one")


# ------------------------------------------------------------------ model


def build_model(arch: str) -> nn.Module:
    if arch not in ARCHS:
        raise UserError(f"unknown --arch {arch!r} (choose from {', '.join(ARCHS)})")
    if arch in DEPTHS:  # the paper's CIFAR ResNets, built for 32 px
        return CifarResNet(DEPTHS[arch])
    model = getattr(torchvision.models, arch)(num_classes=10)
    # CIFAR stem: 3x3 stride-1 conv, no max-pool, so 32x32 inputs keep their resolution.
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


class EMA:
    """An exponential moving average of a model's weights and BN buffers, updated on the device without a sync.

    ``update`` after each optimizer step: ema += (1 - d) * (model - ema), d = min(decay, (1 + n) / (10 + n)) after n
    updates, so the first updates are not pulled towards the initial weights. Integer buffers are copied.
    """

    def __init__(self, model: nn.Module, decay: float):
        import copy

        self.module, self.decay = copy.deepcopy(model).requires_grad_(False), decay
        pairs = list(zip(self.module.state_dict().values(), model.state_dict().values()))  # tensors sharing storage
        self.floats = [[e for e, _ in pairs if e.is_floating_point()], [m for e, m in pairs if e.is_floating_point()]]
        self.others = [(e, m) for e, m in pairs if not e.is_floating_point()]

    @torch.no_grad()
    def update(self, n: int) -> None:
        torch._foreach_lerp_(*self.floats, 1 - min(self.decay, (1 + n) / (10 + n)))
        for e, m in self.others:
            e.copy_(m)


# ------------------------------------------------------------------ main


def main(args: argparse.Namespace) -> None:
    # [DDP 1] init the process group (torchrun, Slurm, MPI, --dist-url or none) and pick this rank's device.
    info = setup_distributed(args)
    device = info.device
    seed_everything(args.seed, info.rank)
    out = prepare_output_dir(args.output_dir)
    t_start = time.time()
    dtype = amp_dtype(args.amp, device)
    channels_last = args.channels_last if args.channels_last is not None else device.type == "cuda"
    global_batch = args.batch_size * info.world_size * args.accum_steps

    # ---- data
    to_float = T.ToTensor() if not args.synthetic else T.ConvertImageDtype(torch.float)
    tf_eval = T.Compose([to_float, T.Normalize(MEAN, STD)])
    if args.download and info.is_main:  # rank 0 downloads, the others wait, then all read
        load_splits(args, None, None, out, writer=False)
    barrier()
    # JPEG folders are decoded once into a cache file (one rank per host writes it, the others wait and read).
    splits = functools.partial(load_splits, args, cache_dir=out, writer=info.local_rank == 0)
    if args.gpu_data:  # keep uint8 on the device, augment there (see gpu_crop_flip)
        train_ds, eval_ds, eval_name = splits(None, None)
        train_x, train_y = (t.to(device) for t in to_uint8_tensors(train_ds))
        eval_x, eval_y = (t.to(device) for t in to_uint8_tensors(eval_ds))
        train_x = F.pad(train_x.permute(0, 3, 1, 2), (4, 4, 4, 4), mode="reflect").permute(0, 2, 3, 1).contiguous()
        n_train = len(train_y)
    else:
        train_ds, eval_ds, eval_name = splits(train_transform(args, tf_eval), tf_eval)
        n_train = len(train_ds)
    t_data = time.time()
    # Wall time from process start: start (imports, process group), data (decode, load), compile (to the end of the
    # first step), eval, checkpoint, and train (the rest).
    wall = {"start": t_start - T_START, "data": t_data - t_start, "eval": 0.0, "checkpoint": 0.0}
    if not n_train or not len(eval_ds):
        raise UserError(f"empty dataset in {args.data_dir} (train {n_train} images, eval {len(eval_ds)})")
    if n_train < global_batch:
        raise UserError(f"global batch {global_batch} is larger than the {n_train} training images (lower -b)")
    # [DDP 2] every rank reads a different shard; the order of epoch e depends only on (seed, e).
    sampler = ResumableDistributedSampler(n_train, info.rank, info.world_size, args.seed)
    steps_per_epoch = len(sampler) // args.batch_size // args.accum_steps
    loader_kw = dict(
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        worker_init_fn=init_worker,
        persistent_workers=args.workers > 0,
        multiprocessing_context=worker_context(args.workers),  # not forked from this process: see worker_context
        generator=loader_generator(args.seed, info.rank),
    )
    if not args.gpu_data:
        train_loader = torch.utils.data.DataLoader(
            SeededDataset(train_ds, args.seed), args.batch_size, sampler=sampler, drop_last=True, **loader_kw
        )
        eval_loader = torch.utils.data.DataLoader(
            eval_ds, 256, sampler=ExactEvalSampler(len(eval_ds), info.rank, info.world_size), **loader_kw
        )

    def train_batches(epoch: int, skip: int):
        """(x, y) device batches of `epoch`, after skipping `skip` micro-batches already done."""
        sampler.set_epoch(epoch, skip=skip * args.batch_size)
        n = max(0, steps_per_epoch * args.accum_steps - skip) * args.batch_size
        if args.gpu_data:
            idx = torch.tensor(sampler.indices()[skip * args.batch_size :][:n], device=device, dtype=torch.long)
            gen = torch.Generator(device)
            # n == 0: resumed from a checkpoint saved at the epoch's last step (--save-every-steps), where split()
            # would still give one empty batch, hence one phantom step
            for i, b in enumerate(idx.split(args.batch_size) if n else (), start=skip):
                gen.manual_seed(mix_seed(args.seed, epoch, info.rank, i))  # per batch: resumable mid-epoch
                x = normalize(gpu_crop_flip(train_x[b], gen))
                yield (gpu_random_erasing(x, args.random_erasing, gen) if args.random_erasing else x), train_y[b]
            return
        for i, (x, y) in enumerate(train_loader):
            if i * args.batch_size >= n:
                return
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def eval_batches():
        if args.gpu_data:
            for b in torch.arange(info.rank, len(eval_y), info.world_size, device=device).split(512):
                yield normalize(eval_x[b]), eval_y[b]
        else:
            for x, y in eval_loader:
                yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    # ---- model
    model = build_model(args.arch).to(device)
    if args.sync_bn and info.world_size > 1 and device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    # What we save, restore and evaluate. Eval runs eager: uneven shards and a second compile cost more than it saves.
    model_without_ddp = model
    # [DDP 3] wrap the model: gradients are averaged across ranks during backward.
    if info.world_size > 1:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True
        )
    # A ResNet-18 step on 32x32 images is short enough that launching its kernels, not running them, sets the pace:
    # --compile-mode reduce-overhead replays the whole forward and backward as CUDA graphs.
    train_model = torch.compile(model, mode=args.compile_mode) if args.compile else model
    ema = EMA(model_without_ddp, args.ema) if args.ema else None  # evaluated, saved and restored with the model

    # ---- optimizer and LR schedule (a pure function of the step)
    lr = args.lr * global_batch / 512
    optimizer = torch.optim.SGD(
        param_groups(model_without_ddp, args.weight_decay), lr=lr, momentum=args.momentum, nesterov=args.nesterov
    )
    sched_steps = args.epochs * steps_per_epoch
    warmup = int(args.warmup_epochs * steps_per_epoch)
    if args.sched == "cosine":
        lr_fn = functools.partial(warmup_cosine, warmup=warmup, total=sched_steps)
    else:  # one-cycle: linear up to the peak at 25%, linear down to 0
        peak = max(1, int(0.25 * sched_steps))
        lr_fn = lambda s: min((s + 1) / peak, max(0.0, (sched_steps - s) / (sched_steps - peak)))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_fn)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    # ---- resume (same command restarted by torchrun/Slurm continues where it stopped)
    pos, ckpt_path, ckpt = Position(), resolve_resume(args.resume, out), {}
    if ckpt_path is not None:
        pos, ckpt = restore_training(
            ckpt_path,
            model_without_ddp,
            optimizer,
            scheduler,
            scaler,
            world_size=info.world_size,
            batch_size=args.batch_size,
            accum_steps=args.accum_steps,
            extra={"ema": ema.module} if ema else None,
        )
    epoch, step, batch_in_epoch, best, wandb_id = pos.epoch, pos.step, pos.batch_in_epoch, pos.best_metric, pos.wandb_id
    eval_step = pos.eval_step
    set_schedule_position(scheduler, epoch * steps_per_epoch + batch_in_epoch // args.accum_steps, lr)
    carried = ckpt.get("wall", {})  # earlier processes' time, each up to its last checkpoint

    def wall_total() -> dict[str, float]:
        now = {**wall, "wall": time.time() - T_START}
        return {k: now.get(k, 0.0) + carried.get(k, 0.0) for k in {*now, *carried}}

    # writes on a thread: the step waits only for a copy of the state in host memory
    writer = CheckpointWriter(out if info.is_main else None)

    def save(name: str, keep_last: int = 0) -> float:
        """Returns the seconds it took, which the throughput leaves out (as it does evaluation)."""
        t = time.time()
        watchdog.beat(CHECKPOINT)
        window = loss_window.state()  # every rank's part
        check_finite_loss(window["sums"].sum(), step)  # the losses since the last log point
        if info.is_main:  # [DDP 4] only rank 0 writes, atomically
            state = dict(model=model_without_ddp.state_dict(), optimizer=optimizer.state_dict(),
                         scheduler=scheduler.state_dict(), scaler=scaler.state_dict(), epoch=epoch, step=step,
                         batch_in_epoch=batch_in_epoch, best_metric=best, eval_step=eval_step, args=vars(args),
                         world_size=info.world_size, wandb_id=wandb_id, loss_window=window,
                         wall=wall_total())  # fmt: skip
            if ema:
                state["ema"] = ema.module.state_dict()
            writer.save(state, out / name, keep_last=keep_last)
        wall["checkpoint"] += time.time() - t
        return time.time() - t

    def evaluate(wrap=lambda batches: batches) -> dict[str, float]:
        """Eval metrics of the EMA weights if any (the raw model's as raw_*), else of the model."""
        t = time.time()
        m = {}
        for prefix, net in [("", model_without_ddp)] + ([("ema", ema.module)] if ema else []):
            broadcast_buffers(net)  # every rank evaluates rank 0's BN statistics, as saved
            m[prefix] = evaluate_classifier(net, wrap(eval_batches()), device, dtype, args.tta)
        wall["eval"] += time.time() - t
        return {**m["ema"], **{f"raw_{k}": v for k, v in m[""].items()}} if ema else m[""]

    logger = MetricsLogger(out, info, args.wandb)
    config = logger.write_config(
        args, {"global_batch": global_batch, "peak_lr": lr, "steps_per_epoch": steps_per_epoch}
    )
    wandb_id = logger.start_wandb("cifar_resnet", config, wandb_id)
    if args.evaluate:
        if ckpt_path is None:
            raise UserError("--evaluate needs a checkpoint: --resume PATH (or an output dir with last.pt)")
        if ema is None and "ema" in ckpt:  # a checkpoint with averaged weights: evaluate those, as training did
            ema = EMA(model_without_ddp, 0.0)
            ema.module.load_state_dict(ckpt["ema"])
        m = evaluate()
        logger.log({"split": eval_name, "epoch": epoch, "step": step, **m})
        print0(f"{ckpt_path} {eval_name}: {describe(m)}")
        return
    print0(
        f"{args.arch} on {n_train} images | {info.world_size} process(es) on {device.type} ({info.launcher}) | "
        f"global batch {global_batch} = {args.batch_size} x {info.world_size} x {args.accum_steps} | peak lr {lr:.4g}"
    )
    total_steps = step + (args.epochs - epoch) * steps_per_epoch - batch_in_epoch // args.accum_steps
    max_steps = min(total_steps, args.max_steps or total_steps)
    progress = Progress(info, max_steps, step)
    stop = StopSignal()
    watchdog = Watchdog(args.stall_timeout, info.rank)  # a stall becomes stacks and an exit

    # ---- training loop
    def due() -> bool:  # an evaluation at this position, not yet recorded
        return eval_due(args.eval_every, args.epochs, epoch, batch_in_epoch, step, max_steps, eval_step)

    stopped, pending, loss_window = False, due(), LossWindow(info, step, ckpt.get("loss_window"))
    todo = step < max_steps or pending  # False: a rerun of a finished run, which changes no file
    if todo and ckpt_path is not None:
        logger.rewind(step, eval_step)
    while not stopped and (step < max_steps or pending):
        train_model.train()
        micro = 0
        # an evaluation that the last process did not record comes before any further step
        for x, y in () if pending else watchdog.batches(train_batches(epoch, batch_in_epoch)):
            micro += 1
            sync = micro % args.accum_steps == 0
            with model.no_sync() if (not sync and info.world_size > 1) else contextlib.nullcontext():
                with autocast(device, dtype):
                    loss = criterion(
                        train_model(x.contiguous(memory_format=torch.channels_last) if channels_last else x), y
                    )
                scaler.scale(loss / args.accum_steps).backward()
            loss_window.sum += loss.detach()
            if not sync:
                continue
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            if ema:
                ema.update(step)
            if "compile" not in wall:  # the first step compiles: one sync to time it
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                wall["compile"] = time.time() - t_data
            batch_in_epoch += args.accum_steps
            loss_window.n += args.accum_steps
            if step % args.print_freq == 0 or step == max_steps:
                # the one host sync
                loss_avg = all_reduce_sum(loss_window.sum.clone()).item() / (loss_window.n * info.world_size)
                ips = (step - loss_window.step0) * global_batch / (time.time() - loss_window.t0)
                check_finite_loss(loss_avg, step)
                logger.log(
                    {
                        "split": "train",
                        "epoch": epoch,
                        "step": step,
                        "loss": loss_avg,
                        "lr": scheduler.get_last_lr()[0],
                        "img_per_s": ips,
                    }
                )
                progress.update(
                    step, f"epoch {epoch} loss {loss_avg:.4f} lr {scheduler.get_last_lr()[0]:.4g} {ips:.0f} img/s"
                )
                loss_window.reset(step)
            if args.save_every_steps and step % args.save_every_steps == 0:
                loss_window.t0 += save("last.pt", args.keep_last)
            stopped = stop.should_stop()
            if step >= max_steps or stopped:
                break
        epoch_done = batch_in_epoch >= steps_per_epoch * args.accum_steps
        if epoch_done:
            epoch, batch_in_epoch = epoch + 1, 0
        if not stopped and due():  # a preempted run saves at once: its rerun evaluates
            m = evaluate(functools.partial(watchdog.batches, evaluating=True))
            logger.log({"split": eval_name, "epoch": epoch, "step": step, **m})
            progress.write(f"epoch {epoch} {eval_name}: {describe(m)}")
            if m["acc1"] > best:
                best = m["acc1"]
                save("best.pt")
            eval_step, loss_window.t0, loss_window.step0 = step, time.time(), step  # eval time is not throughput
        pending = False
        loss_window.t0 += save("last.pt")  # keep checkpoint time out of the throughput too
    stop.close()
    watchdog.stop()
    progress.close()
    writer.wait()  # the last checkpoint is on disk before the run says so
    if stopped:
        stop.exit_preempted(step, logger)
    if not todo:
        print0(f"done: step {step}, best {eval_name} acc1 {best:.2f} (already finished: nothing to do)")
        return logger.close()
    # The time of every process of the run: each one's up to its last checkpoint, and this one's whole.
    total = wall_total()
    total["train"] = 2 * total["wall"] - sum(v for k, v in total.items() if k != "train")
    parts = {k: total.get(k, 0.0) for k in ("start", "data", "compile", "train", "eval", "checkpoint", "wall")}
    logger.log({"split": "time", **{f"{k}_s": round(v, 2) for k, v in parts.items()}})
    split = ", ".join(f"{k} {v:.1f}s" for k, v in parts.items() if k != "wall")
    print0(
        f"done: step {step}, best {eval_name} acc1 {best:.2f} ({split}), wall {total['wall']:.1f}s "
        + ("since start" if not carried else "summed over its processes")
    )
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
