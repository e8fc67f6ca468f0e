"""Train an ImageNet classifier (ResNet50 by default) with DistributedDataParallel.

The command line of pytorch/examples imagenet/main.py works unchanged:

    python imagenet/train.py -a resnet50 --dist-url tcp://NODE0:PORT --dist-backend nccl \
        --multiprocessing-distributed --world-size NODES --rank NODE_RANK /data/imagenet
    torchrun --standalone --nproc_per_node=8 imagenet/train.py /data/imagenet     # or torchrun, Slurm, MPI
    python imagenet/train.py --dummy -a resnet50 --max-steps 100                    # benchmark the model only

Read main() top to bottom: distributed setup -> data -> model -> optimizer -> resume -> epochs of
train_one_epoch(), each followed by evaluate() and a checkpoint. Differences from main.py: see --help.
"""

from __future__ import annotations

if __name__ == "__main__":  # a faster start: no cyclic GC during the imports (BENCHMARKS.md "Process start-up")
    __import__("gc").disable()

import argparse
import contextlib
import dataclasses
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
from common.watchdog import CHECKPOINT, Watchdog

from common.checkpoint import (
    CheckpointWriter,
    Position,
    checkpoint_state,
    load_checkpoint,
    load_model_state,
    resolve_resume,
    restore_training,
    set_schedule_position,
)
from common.data import ResumableDistributedSampler, SeededDataset, loader_kwargs
from common.distributed import (
    DistInfo,
    all_reduce_sum,
    broadcast_buffers,
    cleanup_distributed,
    detect_launcher,
    mix_seed,
    print0,
    seed_everything,
    setup_distributed,
)
from common.errors import UserError, run_cli
from common.metrics import LossWindow, MetricsLogger, Progress, prepare_output_dir
from common.utils import (
    EMA,
    StopSignal,
    amp_dtype,
    autocast,
    check_finite_loss,
    describe,
    evaluate_classifier,
    lr_lambda,
    param_groups,
)

from .data import check_bad, collate, fetch_weights, image_folder, mixup_cutmix, parse_args, transforms, weights_file
from .gpu_decode import EncodedImages, GpuTransform, collate_encoded, prefetch
from .spawn import spawn

# ------------------------------------------------------------------ model


def build_model(arch: str, num_classes: int, weights=None) -> nn.Module:
    kw = {"aux_logits": False} if arch in ("googlenet", "inception_v3") else {}  # one output like every other model
    return torchvision.models.get_model(arch, weights=weights, num_classes=num_classes, **kw)


# ------------------------------------------------------------------ data


def build_data(args, info, channels_last: bool) -> SimpleNamespace:
    """Datasets and loaders (none with --dummy: its batches are made on the device), the train sampler."""
    d = SimpleNamespace(bad_train=0, bad_val=0, gen=torch.Generator(info.device))
    d.gpu_decode = args.gpu_decode and not args.synthetic  # on CPU it still runs (torchvision.io), for tests
    tf_train, tf_val = transforms(args)
    if args.synthetic:
        d.num_classes, (d.n_train, d.n_val) = 1000, args.dummy_sizes
    else:
        train_ds = None if args.evaluate else image_folder(Path(args.data) / "train", tf_train)
        val_ds = image_folder(Path(args.data) / "val", tf_val)
        d.num_classes, d.n_train, d.n_val = len(val_ds.classes), len(train_ds or ()), len(val_ds)
    if d.num_classes == 1:
        print0(f"warning: {args.data} holds one class: it trains to a loss of 0 and learns nothing", file=sys.stderr)
    if args.pretrained and d.num_classes != 1000:
        raise UserError(f"--pretrained loads 1000-class ImageNet heads, but {args.data} has {d.num_classes} classes")
    kw = loader_kwargs(args.workers, args.seed, info.rank, info.device)
    kw.update(prefetch_factor=2 if args.workers > 0 else None, collate_fn=collate)  # batches in flight per worker
    if d.gpu_decode:  # workers only read file bytes; decode, crop, flip and normalize run on the GPU (gpu_decode.py)
        kw["collate_fn"] = collate_encoded
        d.gpu_train = GpuTransform(info.device, args.train_crop_size, channels_last=channels_last)
        d.gpu_val = GpuTransform(info.device, args.val_crop_size, args.val_resize_size, channels_last=channels_last)
        train_ds = EncodedImages(train_ds.samples, args.seed) if train_ds is not None else None
        val_ds = EncodedImages(val_ds.samples)
    if not args.evaluate:
        # [DDP 2] every rank reads a different shard; the order of epoch e depends only on (seed, e).
        global_batch = args.batch_size * info.world_size * args.accum_steps
        if d.n_train < global_batch:
            raise UserError(f"global batch {global_batch} is larger than the {d.n_train} training images (lower -b)")
        d.sampler = ResumableDistributedSampler(d.n_train, info.rank, info.world_size, args.seed)
        d.steps_per_epoch = len(d.sampler) // args.batch_size // args.accum_steps
        if not args.synthetic:
            d.train_loader = torch.utils.data.DataLoader(
                train_ds if d.gpu_decode else SeededDataset(train_ds, args.seed), args.batch_size, sampler=d.sampler,
                drop_last=True, **kw)  # fmt: skip
    if not args.synthetic:
        val_kw = {**kw, "persistent_workers": False}  # idle between evals: do not hold -j more processes
        sampler = range(info.rank, d.n_val, info.world_size)  # each image on one rank, no padding: exact metrics
        d.val_loader = torch.utils.data.DataLoader(val_ds, args.batch_size, sampler=sampler, **val_kw)
    return d


def train_batches(args, d: SimpleNamespace, device, rank: int, epoch: int, skip: int):
    """(index, x, y) device batches of `epoch`, after skipping `skip` micro-batches already done."""
    n = d.steps_per_epoch * args.accum_steps
    if args.synthetic:  # made on the device: no PIL, no DataLoader, no host-to-device copy
        for i in range(skip, n):
            d.gen.manual_seed(mix_seed(args.seed, epoch, rank, i))
            x = torch.randn((args.batch_size, 3, args.train_crop_size, args.train_crop_size), device=device,
                            generator=d.gen)  # fmt: skip
            yield i, x, torch.randint(0, d.num_classes, (args.batch_size,), device=device, generator=d.gen)
        return
    d.sampler.set_epoch(epoch, skip=skip * args.batch_size)
    loader = prefetch(d.train_loader, d.gpu_train) if d.gpu_decode else d.train_loader
    for i, (x, y, bad) in enumerate(loader, start=skip):
        if i >= n:
            return
        check_bad(args, rank, bad, "train")
        d.bad_train += len(bad)
        if x is None:  # every rank must run the same number of backward passes
            raise UserError(f"a whole batch of unreadable training images, e.g. {bad[0]}")
        yield i, x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def val_batches(args, d: SimpleNamespace, device, rank: int, world_size: int):
    """(x, y) device batches of this rank's share of val; unreadable images counted in ``d.bad_val``."""
    if args.synthetic:  # image k is pool[k % 64]: the same numbers for any world size
        d.gen.manual_seed(mix_seed(args.seed, 2**40))
        pool = torch.randn((64, 3, args.val_crop_size, args.val_crop_size), device=device, generator=d.gen)
        for idx in torch.arange(rank, d.n_val, world_size, device=device).split(args.batch_size):
            yield pool[idx % 64], idx % d.num_classes
        return
    for x, y, bad in prefetch(d.val_loader, d.gpu_val) if d.gpu_decode else d.val_loader:
        check_bad(args, rank, bad, "val")
        d.bad_val += len(bad)
        if x is not None:
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


# ------------------------------------------------------------------ the loop


def evaluate(r: SimpleNamespace, watched: bool = True) -> dict:
    """Exact metrics of the model (and of the EMA as ema_*); unreadable val images skipped are counted."""
    m = {}
    for prefix, net in [("", r.eval_model)] + ([("ema_", r.ema.module)] if r.ema else []):
        broadcast_buffers(net)  # every rank evaluates rank 0's BN statistics, as saved
        r.data.bad_val = 0
        batches = val_batches(r.args, r.data, r.info.device, r.info.rank, r.info.world_size)
        res = evaluate_classifier(net, r.watchdog.batches(batches, evaluating=True) if watched else batches,
                                  r.info.device, r.dtype)  # fmt: skip
        m.update({f"{prefix}{k}": res[k] for k in (("loss", "acc1", "acc5") if prefix else res)})
    skipped = int(all_reduce_sum(torch.tensor([r.data.bad_val], device=r.info.device)).item())
    return {**m, "skipped": skipped} if skipped else m


def log_eval(r: SimpleNamespace, m: dict, epoch: int, step: int, extra: dict | None = None) -> None:
    r.logger.log({"split": "val", "epoch": epoch, "step": step, **m, **(extra or {})})
    ema_txt = f" | ema acc1 {m['ema_acc1']:.2f}" if "ema_acc1" in m else ""
    print0(f"epoch {epoch} val: {describe(m)}{ema_txt}")


def save_state(name: str, r: SimpleNamespace, pos: Position, keep_last: int = 0) -> float:
    """Checkpoint ``name`` (rank 0 writes, on a thread; every rank calls it); returns the seconds it took."""
    t = time.time()
    r.watchdog.beat(CHECKPOINT)
    window = r.loss_window.state(pos.step)  # stops on a NaN or infinite loss since the last log point
    if r.info.is_main:  # [DDP 4] only global rank 0 writes (not every node's local rank 0), atomically
        state = checkpoint_state(r.model, r.optimizer, r.scheduler, r.scaler, pos, r.args, r.info.world_size, r.ema,
                                 arch=r.args.arch, num_classes=r.data.num_classes, loss_window=window)  # fmt: skip
        r.writer.save(state, r.out / name, keep_last=keep_last)
    return time.time() - t


def train_one_epoch(r: SimpleNamespace, pos: Position, max_steps: int) -> None:
    """Optimizer steps from ``pos`` to the end of its epoch or ``max_steps`` (or a stop signal: ``r.stopped``)."""
    args, info, window, device = r.args, r.info, r.loss_window, r.info.device
    r.train_model.train()
    micro = 0
    for i, x, y in r.watchdog.batches(train_batches(args, r.data, device, info.rank, pos.epoch, pos.batch_in_epoch)):
        micro += 1
        sync = micro % args.accum_steps == 0
        if r.mix is not None:  # seeded per micro-batch: identical after a resume
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(mix_seed(args.seed, pos.epoch, info.rank, i, 1))
                x, y = r.mix(x, y)
        if micro == 1:  # dropout/stochastic depth: global RNG as a function of (seed, rank, step)
            torch.manual_seed(mix_seed(args.seed, info.rank, pos.step))
        with r.ddp.no_sync() if (not sync and info.world_size > 1) else contextlib.nullcontext():
            with autocast(device, r.dtype):
                loss = r.criterion(r.train_model(x.contiguous(memory_format=torch.channels_last) if r.cl else x), y)
            r.scaler.scale(loss / args.accum_steps).backward()
        window.sum += loss.detach()
        if not sync:
            continue
        micro = 0
        r.scaler.step(r.optimizer)
        r.scaler.update()
        r.optimizer.zero_grad(set_to_none=True)
        r.scheduler.step()
        pos.step += 1
        if r.ema is not None:
            r.ema.update(pos.step)
        pos.batch_in_epoch += args.accum_steps
        window.n += args.accum_steps
        if pos.step % args.print_freq == 0 or pos.step == max_steps:
            stats = torch.stack([window.sum, torch.full_like(window.sum, r.data.bad_train)])
            loss_tot, n_skipped = all_reduce_sum(stats).tolist()  # the one host sync
            loss_avg, r.n_skipped = loss_tot / (window.n * info.world_size), int(n_skipped)
            check_finite_loss(loss_avg, pos.step)
            ips = (pos.step - window.step0) * r.global_batch / (time.time() - window.t0)
            lr = r.scheduler.get_last_lr()[0]
            rec = {"split": "train", "epoch": pos.epoch, "step": pos.step, "loss": loss_avg, "lr": lr, "img_per_s": ips}
            r.logger.log({**rec, **({"skipped_images": r.n_skipped} if args.skip_bad_images else {})})
            r.progress.update(pos.step, f"epoch {pos.epoch} loss {loss_avg:.4f} lr {lr:.4g} {ips:.0f} img/s")
            window.reset(pos.step)
        if args.save_every_steps and pos.step % args.save_every_steps == 0:
            window.t0 += save_state("last.pt", r, pos, args.keep_last)
        r.stopped = r.stop.should_stop()
        if pos.step >= max_steps or r.stopped:
            return


# ------------------------------------------------------------------ main


def main(args: argparse.Namespace, launch: DistInfo | None = None) -> None:
    # [DDP 1] init the process group (torchrun, Slurm, MPI, --dist-url, mp.spawn or none) and pick the device.
    launch = launch or detect_launcher(None, args.dist_url, args.world_size, args.rank, args.local_rank)
    if args.gpu is not None and launch.launcher != "mp.spawn":
        if launch.launcher not in ("single", "dist-url"):
            raise UserError(f"--gpu picks one process's GPU; under {launch.launcher} each rank uses its local rank")
        launch = dataclasses.replace(launch, local_rank=args.gpu)
    if args.gpu_decode:  # the decode's stream gets a hardware queue of its own (read when CUDA starts)
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    info = setup_distributed(args, launch=launch)
    device = info.device
    seed_everything(args.seed, info.rank)
    out = prepare_output_dir(args.output_dir)
    ckpt_path = resolve_resume(args.resume, out)
    if args.evaluate and ckpt_path is None and not args.pretrained:
        raise UserError("-e needs weights: --resume CHECKPOINT, --pretrained, or a last.pt in --output-dir")
    r = SimpleNamespace(args=args, info=info, out=out, dtype=amp_dtype(args.amp, device), stopped=False, n_skipped=0)
    r.cl = args.channels_last if args.channels_last is not None else device.type == "cuda"
    torch.backends.cudnn.benchmark = True  # fixed input sizes: let cuDNN pick the fastest kernels once
    r.global_batch = args.batch_size * info.world_size * args.accum_steps
    data = r.data = build_data(args, info, r.cl)

    # ---- model
    weights = None
    if args.pretrained:
        err = fetch_weights(args) if info.local_rank == 0 else None  # one download per node (the cache is local)
        if all_reduce_sum(torch.tensor([float(err is not None)], device=device)).item():  # the barrier before reading
            raise UserError(err or "--pretrained: downloading the weights failed on another node")
        weights = weights_file(args)[0]
    model = build_model(args.arch, data.num_classes, weights).to(device)
    if args.sync_bn and info.world_size > 1 and device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if r.cl:
        model = model.to(memory_format=torch.channels_last)
    r.model = r.ddp = model  # r.model: what we save, evaluate and restore
    r.eval_model = torch.compile(model) if args.compile else model
    r.logger = logger = MetricsLogger(out, info, args.wandb)
    r.ema = None
    if args.evaluate:  # -e: evaluate a checkpoint (or the pretrained weights) once and stop
        ckpt = load_checkpoint(ckpt_path) if ckpt_path is not None else {"epoch": 0, "step": 0}
        if ckpt_path is not None:
            load_model_state(model, ckpt["model"], ckpt_path)
        m = evaluate(r, watched=False)
        return log_eval(r, m, ckpt["epoch"], ckpt["step"], {"checkpoint": str(ckpt_path or weights)})

    # [DDP 3] wrap the model: gradients are averaged across ranks during backward.
    if info.world_size > 1:
        r.ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True
        )
    r.train_model = torch.compile(r.ddp, mode=args.compile_mode) if args.compile else r.ddp
    r.ema = EMA(model, args.ema) if args.ema else None
    r.mix = mixup_cutmix(args, data.num_classes)

    # ---- optimizer and LR schedule (a pure function of the step)
    lr = args.lr * r.global_batch / 256
    r.optimizer = torch.optim.SGD(param_groups(model, args.weight_decay, skip_norm_bias=not args.norm_bias_decay),
                                  lr=lr, momentum=args.momentum)  # fmt: skip
    r.scheduler = torch.optim.lr_scheduler.LambdaLR(r.optimizer, lr_lambda(args, data.steps_per_epoch))
    r.scaler = torch.amp.GradScaler(device.type, enabled=r.dtype == torch.float16)
    r.criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    # ---- resume (same command restarted by torchrun/Slurm continues where it stopped)
    pos, ckpt = Position(epoch=args.start_epoch), {}
    if ckpt_path is not None:
        pos, ckpt = restore_training(ckpt_path, model, r.optimizer, r.scheduler, r.scaler, ema=r.ema,
                                     world_size=info.world_size, batch_size=args.batch_size,
                                     accum_steps=args.accum_steps)  # fmt: skip
    at = pos.epoch * data.steps_per_epoch + pos.batch_in_epoch // args.accum_steps  # where the LR schedule should be
    set_schedule_position(r.scheduler, at, lr)
    pos.step = pos.step or at  # main.py's --start-epoch also counts the skipped epochs' steps
    pos.eval_step = pos.eval_step if ckpt_path is not None else pos.step
    r.writer = CheckpointWriter(out if info.is_main else None)  # writes on a thread

    extra = dict(global_batch=r.global_batch, peak_lr=lr, steps_per_epoch=data.steps_per_epoch)
    pos.wandb_id = logger.start(args, "imagenet", pos.wandb_id, extra)
    print0(
        f"{args.arch} ({args.recipe} recipe) on {data.n_train} images, {data.num_classes} classes | {info.world_size} "
        f"process(es) on {device.type} ({info.launcher}) | global batch {r.global_batch} = {args.batch_size} x "
        f"{info.world_size} x {args.accum_steps} | peak lr {lr:.4g}"
    )
    total_steps = pos.step + (args.epochs - pos.epoch) * data.steps_per_epoch - pos.batch_in_epoch // args.accum_steps
    max_steps = min(total_steps, args.max_steps or total_steps)
    r.progress, r.stop = Progress(info, max_steps, pos.step), StopSignal()
    r.watchdog = Watchdog(args.stall_timeout, info.rank)  # a stall becomes stacks and an exit

    # ---- training: an evaluation that the last process did not record comes before any further step
    pending = pos.eval_due(args.eval_every, args.epochs, max_steps)
    r.loss_window = LossWindow(info, pos.step, ckpt.get("loss_window"))
    if ckpt_path is not None and (pos.step < max_steps or pending):
        logger.rewind(pos.step, pos.eval_step)
    while not r.stopped and (pos.step < max_steps or pending):
        if not pending:
            train_one_epoch(r, pos, max_steps)
        if pos.batch_in_epoch >= data.steps_per_epoch * args.accum_steps:
            pos.epoch, pos.batch_in_epoch = pos.epoch + 1, 0
        if not r.stopped and pos.eval_due(args.eval_every, args.epochs, max_steps):  # a preempted run's rerun does it
            m = evaluate(r)
            log_eval(r, m, pos.epoch, pos.step)
            if m["acc1"] > pos.best_metric:
                pos.best_metric = m["acc1"]
                save_state("best.pt", r, pos)
            pos.eval_step = r.loss_window.step0 = pos.step
            r.loss_window.t0 = time.time()  # evaluation time is not throughput
        pending = False
        r.loss_window.t0 += save_state("last.pt", r, pos)  # keep checkpoint time out of the throughput too
    r.stop.close()
    r.watchdog.stop()
    if r.n_skipped:
        print0(f"skipped {r.n_skipped} unreadable training image(s), listed above as warnings")
    if data.gpu_decode:  # training images each decoder took on rank 0 (cpu: what nvJPEG refused)
        counts = ", ".join(f"{k} {v}" for k, v in sorted(data.gpu_train.counts.items()))
        print0(f"gpu-decode decoded (rank 0): {counts}")
    r.writer.wait()  # the last checkpoint is on disk before the run says so
    if r.stopped:
        r.stop.exit_preempted(pos.step, logger)
    print0(f"done: step {pos.step}" + (f", best val acc1 {pos.best_metric:.2f}" if args.eval_every else ""))
    logger.close()


def cli() -> None:
    args = parse_args()
    if args.multiprocessing_distributed:
        if args.pretrained and (err := fetch_weights(args)):  # once per node, before the workers need it
            raise UserError(err)
        return spawn(main, args, args.nproc_per_node or torch.cuda.device_count() or 1)
    try:
        main(args)
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    gc.freeze()  # what the imports built lives as long as the process: keep it out of every later collection
    gc.enable()
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # fail instead of hanging on a dead rank
    run_cli(cli)
