"""Train an ImageNet classifier (ResNet-50 by default) with DistributedDataParallel.

The command line of pytorch/examples imagenet/main.py works unchanged:

    python imagenet/train.py -a resnet50 --dist-url tcp://NODE0:PORT --dist-backend nccl \
        --multiprocessing-distributed --world-size NODES --rank NODE_RANK /data/imagenet
    torchrun --standalone --nproc_per_node=8 imagenet/train.py /data/imagenet     # or Slurm, MPI: see scripts/
    python imagenet/train.py --dummy -a resnet50 --max-steps 100                    # the model alone, no data

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
from types import SimpleNamespace

import torch
import torch.nn as nn
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/ sits beside this folder
from imagenet_cli import apply_recipe, check_args, get_args_parser, gpu_launch, spawn
from imagenet_data import check_bad, collate, image_folder, mixup_cutmix, pretrained_weights, transforms

from common import hardening  # [hardening] fault survival, one call in main(); a minimal copy deletes these lines
from common.args import from_checkpoint
from common.checkpoint import CheckpointWriter, Position, checkpoint_state, load_model_state, resolve_resume, resume
from common.data import ResumableDistributedSampler, SeededDataset, loader_kwargs
from common.distributed import DistInfo, all_reduce_sum, mix_seed, print0, setup_distributed, stop_requested, watched
from common.errors import UserError, run_cli
from common.metrics import LossWindow, MetricsLogger
from common.utils import EMA, amp_dtype, check_finite, evaluate_classifier, lr_at, param_groups


def build_model(arch: str, num_classes: int, weights=None, source=None) -> nn.Module:
    """``weights``: torchvision's entry, or ``source``'s ImageNet state_dict: all of it but a head of another size."""
    kw = {"aux_logits": False} if arch in ("googlenet", "inception_v3") else {}  # one output like every other model
    if not isinstance(weights, dict):  # None, or an entry torchvision loads itself
        return torchvision.models.get_model(arch, weights=weights, num_classes=num_classes, **kw)
    model = torchvision.models.get_model(arch, num_classes=num_classes, **kw)
    own = model.state_dict()
    head = [k for k, v in weights.items() if k in own and own[k].shape != v.shape and v.shape[:1] == (1000,)]
    load_model_state(model, {**weights, **{k: own[k] for k in head}}, source)
    if head:
        print0(f"--pretrained: a new head ({', '.join(head)}) for {num_classes} classes, the rest from {source}")
    return model


def build_data(args, info, channels_last: bool) -> SimpleNamespace:
    """The sampler and loaders (none with --dummy: batches made on the device); ``bad``: unreadable images skipped."""
    d = SimpleNamespace(bad={"train": 0, "val": 0}, skipped=0, gen=torch.Generator(info.device),
                        memory_format=torch.channels_last if channels_last else torch.contiguous_format)  # fmt: skip
    d.gpu_decode = args.gpu_decode and not args.synthetic  # on a CPU it runs too (torchvision.io), for tests
    tf_train, tf_val = transforms(args)
    if args.synthetic:
        d.num_classes, (d.n_train, d.n_val) = 1000, args.dummy_sizes
    else:
        train_ds = None if args.evaluate else image_folder(Path(args.data) / "train", tf_train)
        val_ds = image_folder(Path(args.data) / "val", tf_val)
        d.num_classes, d.n_train, d.n_val = len(val_ds.classes), len(train_ds or ()), len(val_ds)
    if d.num_classes == 1:
        print0(f"warning: {args.data} holds one class: it trains to a loss of 0 and learns nothing", file=sys.stderr)
    kw = {**loader_kwargs(args.workers, args.seed, info.rank, info.device), "collate_fn": collate}
    if d.gpu_decode:  # workers only read file bytes; decode, crop, flip and normalize run on the device
        from gpu_decode import EncodedImages, GpuTransform, Prefetched, collate_encoded

        kw["collate_fn"] = collate_encoded
        train_ds = EncodedImages(train_ds.samples, args.seed) if train_ds is not None else None
        val_ds = EncodedImages(val_ds.samples)
    if not args.evaluate:
        global_batch = args.batch_size * info.world_size * args.accum_steps
        if d.n_train < global_batch:
            raise UserError(f"global batch {global_batch} is larger than the {d.n_train} training images (lower -b)")
        # [DDP 2] each rank reads its own shard of every epoch; the order of epoch e depends only on (seed, e)
        d.sampler = ResumableDistributedSampler(d.n_train, info.rank, info.world_size, args.seed)
        d.steps_per_epoch = len(d.sampler) // args.batch_size // args.accum_steps
        if not args.synthetic:
            ds = train_ds if d.gpu_decode else SeededDataset(train_ds, args.seed)  # EncodedImages seeds its own boxes
            d.train_loader = torch.utils.data.DataLoader(ds, args.batch_size, sampler=d.sampler, drop_last=True, **kw)
    if not args.synthetic:  # each image on one rank, none padded: exact metrics; no workers kept between evaluations
        d.val_loader = torch.utils.data.DataLoader(val_ds, args.batch_size, **{**kw, "persistent_workers": False},
                                                   sampler=range(info.rank, d.n_val, info.world_size))  # fmt: skip
    if d.gpu_decode:  # decoded a batch ahead of the step, on a side stream
        transform = partial(GpuTransform, info.device, channels_last=channels_last)
        d.val_loader = Prefetched(d.val_loader, transform(args.val_crop_size, args.val_resize_size))
        if not args.evaluate:
            d.train_loader = Prefetched(d.train_loader, transform(args.train_crop_size))
    return d


def train_batches(args, d: SimpleNamespace, info, epoch: int, skip: int):
    """(index, x, y) device batches of ``epoch``'s rest, after the ``skip`` micro-batches already done."""
    device, end = info.device, d.steps_per_epoch * args.accum_steps
    if args.synthetic:  # made on the device: no PIL, no DataLoader, no host-to-device copy
        for i in range(skip, end):
            d.gen.manual_seed(mix_seed(args.seed, epoch, info.rank, i))
            shape = (args.batch_size, 3, args.train_crop_size, args.train_crop_size)
            x = torch.randn(shape, device=device, generator=d.gen).contiguous(memory_format=d.memory_format)
            yield i, x, torch.randint(0, d.num_classes, (args.batch_size,), device=device, generator=d.gen)
        return
    d.sampler.set_epoch(epoch, skip=skip * args.batch_size)  # [DDP 2] this rank's shard, in epoch e's order
    for i, (x, y, bad) in zip(range(skip, end), d.train_loader):
        check_bad(args, info.rank, bad, "train")
        d.bad["train"] += len(bad)
        if x is None:  # every rank must run the same number of backward passes
            raise UserError(f"a whole batch of unreadable training images, e.g. {bad[0]}")
        yield i, x.to(device, non_blocking=True, memory_format=d.memory_format), y.to(device, non_blocking=True)


def val_batches(args, d: SimpleNamespace, info):
    """(x, y) device batches of this rank's share of val; the unreadable images it skips counted in ``d.bad``."""
    if args.synthetic:  # image k is pool[k % 64]: the same numbers for any world size
        d.gen.manual_seed(mix_seed(args.seed, 2**40))
        pool = torch.randn((64, 3, args.val_crop_size, args.val_crop_size), device=info.device, generator=d.gen)
        for idx in torch.arange(info.rank, d.n_val, info.world_size, device=info.device).split(args.batch_size):
            yield pool[idx % 64], idx % d.num_classes
        return
    for x, y, bad in d.val_loader:
        check_bad(args, info.rank, bad, "val")
        d.bad["val"] += len(bad)
        if x is not None:
            yield x.to(info.device, non_blocking=True), y.to(info.device, non_blocking=True)


def evaluate(model, ema, data, args, info, dtype) -> dict[str, float]:
    """[DDP 5] Exact metrics of the EMA weights where --ema is on (the raw model's as raw_*), else of the model, and
    the unreadable val images skipped on all ranks. Eager: a compiled model would recompile for the last batch."""
    metrics = {}
    for prefix, net in [("raw_" if ema else "", model)] + ([("", ema.module)] if ema else []):
        data.bad["val"] = 0
        m = evaluate_classifier(net, watched(val_batches(args, data, info), evaluating=True), info.device, dtype)
        metrics.update({f"{prefix}{k}": v for k, v in m.items() if not (prefix and k == "count")})
    skipped = int(all_reduce_sum(torch.tensor([data.bad["val"]], device=info.device)).item())
    return {**metrics, "skipped": skipped} if skipped else metrics


def train_one_epoch(model, criterion, optimizer, scaler, ema, mix, batches, pos: Position, window: LossWindow, args,
                    info, logger: MetricsLogger, writer: CheckpointWriter, lr_of, end: int, data) -> bool:  # fmt: skip
    """Optimizer steps over ``batches`` up to step ``end`` (the epoch's last or --max-steps). Returns True if the
    ranks agreed to stop before it (preemption), leaving the loss window open for the checkpoint to hold."""
    model.train()
    dtype = amp_dtype(args.amp, info.device)
    for micro, (i, x, y) in enumerate(batches, start=1):
        sync = micro % args.accum_steps == 0
        if mix is not None:  # seeded per micro-batch: the same after a resume
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(mix_seed(args.seed, pos.epoch, info.rank, i, 1))
                x, y = mix(x, y)
        if (micro - 1) % args.accum_steps == 0:  # dropout, stochastic depth: the global RNG, a function of the step
            torch.manual_seed(mix_seed(args.seed, info.rank, pos.step))
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
            log_loss(window, pos, args, info, logger, lr, data)
        if save and info.is_main:  # [DDP 6] rank 0 alone writes; the save holds no collective
            writer.save(checkpoint_state(model, optimizer, scaler, pos, args, info.world_size, ema),
                        Path(args.output_dir) / "last.pt", args.keep_last)  # fmt: skip
        if pos.step == end:
            return False
        if stop_requested(pos.step):  # every rank sees it at the same step
            return True
    return False


def log_loss(window: LossWindow, pos: Position, args, info, logger: MetricsLogger, lr: float, data) -> None:
    """A train record: the mean loss since the last one, over every rank (with --skip-bad-images also the training
    images skipped so far), then a new window."""
    bad = window.sums.new_tensor([data.bad["train"]])
    *sums, skipped = all_reduce_sum(torch.cat([window.sums, bad])).tolist()  # [DDP 4] the one host sync of a log point
    loss, data.skipped = sum(sums) / (window.n * args.accum_steps * info.world_size), int(skipped)
    check_finite(loss, pos.step)
    ips = window.n * args.batch_size * args.accum_steps * info.world_size / (time.time() - window.t0)
    record = {"split": "train", "epoch": pos.epoch, "step": pos.step, "loss": loss, "lr": lr, "img_per_s": ips}
    logger.log({**record, "skipped_images": data.skipped} if args.skip_bad_images else record)
    logger.progress(pos.step, f"epoch {pos.epoch} loss {loss:.4f} lr {lr:.4g} {ips:.0f} img/s")
    window.reset()


def main(args: argparse.Namespace, launch: DistInfo | None = None) -> None:
    t_start = time.time()
    apply_recipe(args)  # the flags left unset take --recipe's values
    if args.multiprocessing_distributed and launch is None:  # pytorch/examples: a process per GPU, each runs main()
        return spawn(main, args)
    launch = launch or gpu_launch(args)  # None: as the launcher's environment says
    # [hardening] Deleting this call and its import loses: one-line errors for bad input and data, preemption (SIGTERM:
    # [hardening] save, exit 75), the stall watchdog, the --output-dir lock, ranks that die with their launcher.
    hardening.enable(args, check_args, how=launch)
    info = setup_distributed(args, launch)  # [DDP 1] init the process group (any launcher) and pick this rank's device
    device, out, dtype = info.device, Path(args.output_dir), amp_dtype(args.amp, info.device)
    torch.manual_seed(args.seed + info.rank)  # each rank its own; DDP starts every rank from rank 0's weights
    torch.backends.cudnn.benchmark = True  # fixed input sizes: cuDNN picks the fastest kernels once
    out.mkdir(parents=True, exist_ok=True)
    global_batch = args.batch_size * info.world_size * args.accum_steps
    channels_last = args.channels_last if args.channels_last is not None else device.type == "cuda"
    ckpt_path = resolve_resume(args.resume, out)
    if args.evaluate and ckpt_path is None and not args.pretrained:
        raise UserError("-e needs weights: --resume CHECKPOINT, --pretrained, or a last.pt in --output-dir")
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True) if ckpt_path else {}  # runs no code
    if args.evaluate and ckpt:  # the checkpoint's model and evaluation settings, unless the command line says others
        from_checkpoint(get_args_parser(), args, ckpt.get("args", {}), ("arch",), ("val_resize_size", "val_crop_size"))

    # ---- data, then the model: any torchvision classifier, with --pretrained ImageNet's weights
    data = build_data(args, info, channels_last)
    weights, source = pretrained_weights(args, data.num_classes, info.local_rank, device)
    model = build_model(args.arch, data.num_classes, weights, source).to(device)
    if args.sync_bn and info.world_size > 1 and device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.evaluate:  # -e: the checkpoint's weights (and its EMA's, if it holds them) or --pretrained's, once
        if ckpt:
            load_model_state(model, ckpt["model"], ckpt_path)
        ema = EMA(model, 0.0) if "ema" in ckpt else None  # averaged weights: evaluate those, as training did
        if ema is not None:
            ema.module.load_state_dict(ckpt["ema"])
        m, pos = evaluate(model, ema, data, args, info, dtype), Position(ckpt.get("epoch", 0), ckpt.get("step", 0))
        MetricsLogger(out, info, pos).log({"split": "val", "epoch": pos.epoch, "step": pos.step, **m,
                                           "checkpoint": str(ckpt_path or source)})  # fmt: skip
        return print0(f"{ckpt_path or source} val: {describe(m)}")
    ddp = model
    if info.world_size > 1:  # [DDP 3] wrap the model: backward all-reduces the gradients, bucket by bucket
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                                  gradient_as_bucket_view=True)  # fmt: skip
    train_model = torch.compile(ddp, mode=args.compile_mode) if args.compile else ddp
    ema = EMA(model, args.ema) if args.ema else None  # saved, restored and evaluated with the model
    mix = mixup_cutmix(args, data.num_classes)

    # ---- optimizer; the LR is set each step by lr_at, a function of the position in training alone
    peak_lr = args.lr * global_batch / 256
    optimizer = torch.optim.SGD(param_groups(model, args.weight_decay, skip_norm_bias=not args.norm_bias_decay),
                                lr=peak_lr, momentum=args.momentum)  # fmt: skip
    lr_of = partial(lr_at, peak=peak_lr, args=args, steps_per_epoch=data.steps_per_epoch)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    # ---- resume: the same command, restarted, continues where the run stopped; else main.py's --start-epoch
    pos = Position(epoch=args.start_epoch, step=args.start_epoch * data.steps_per_epoch)
    if ckpt:
        pos = resume(ckpt_path, ckpt, model, optimizer, scaler, ema, world_size=info.world_size,
                     batch_size=args.batch_size, accum_steps=args.accum_steps)  # fmt: skip
    steps_per_epoch = data.steps_per_epoch
    total_steps = pos.step + (args.epochs - pos.epoch) * steps_per_epoch - pos.batch_in_epoch // args.accum_steps
    max_steps = min(total_steps, args.max_steps or total_steps)
    if pos.step >= max_steps:
        return print0(f"done: step {pos.step} (already finished: nothing to do)")
    same_run = ckpt_path is not None and ckpt_path.resolve().parent == out.resolve()
    logger = MetricsLogger(out, info, pos, keep=pos.log_lines if same_run else 0, total=max_steps)
    logger.start(args, info, "imagenet", global_batch=global_batch, peak_lr=peak_lr, steps_per_epoch=steps_per_epoch)
    writer = CheckpointWriter()
    print0(f"{args.arch} ({args.recipe} recipe) on {data.n_train} images, {data.num_classes} classes | "
           f"{info.world_size} process(es) on {device.type} ({info.launcher}) | global batch {global_batch} = "
           f"{args.batch_size} x {info.world_size} x {args.accum_steps} | peak lr {peak_lr:.4g}")  # fmt: skip

    # ---- training: an epoch, its evaluation, then the checkpoint that moves the position past it
    window = LossWindow(info, ckpt.get("window"))
    for epoch in range(pos.epoch, args.epochs):
        batches = watched(train_batches(args, data, info, epoch, pos.batch_in_epoch))
        end = min(max_steps, pos.step + steps_per_epoch - pos.batch_in_epoch // args.accum_steps)
        stopped = train_one_epoch(train_model, criterion, optimizer, scaler, ema, mix, batches, pos, window, args, info,
                                  logger, writer, lr_of, end, data)  # fmt: skip
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
            m = evaluate(model, ema, data, args, info, dtype)
            logger.log({"split": "val", "epoch": pos.epoch, "step": pos.step, **m})
            print0(f"epoch {pos.epoch} val: {describe(m)}")
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
    if data.skipped:
        print0(f"skipped {data.skipped} unreadable training image(s), listed above as warnings")
    if data.gpu_decode:  # the training images each decoder took on rank 0 (cpu: what nvJPEG does not take)
        counts = sorted(data.train_loader.transform.counts.items())
        print0("gpu-decode decoded (rank 0): " + ", ".join(f"{k} {v}" for k, v in counts))
    best = f", best val acc1 {pos.best_metric:.2f}" if args.eval_every else ""
    if not stopped:
        print0(f"done: step {pos.step}{best}, wall {time.time() - t_start:.1f}s")


def describe(m: dict[str, float]) -> str:
    skipped = f", {m['skipped']} unreadable skipped" if m.get("skipped") else ""
    return f"loss {m['loss']:.4f} acc1 {m['acc1']:.2f} acc5 {m['acc5']:.2f} ({m['count']} images{skipped})"


if __name__ == "__main__":
    run_cli(main, get_args_parser().parse_args())
