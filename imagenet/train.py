"""Train an ImageNet classifier (ResNet50 by default) with DistributedDataParallel.

The command line of pytorch/examples imagenet/main.py works unchanged:

    python imagenet/train.py -a resnet50 --dist-url tcp://NODE0:PORT --dist-backend nccl \
        --multiprocessing-distributed --world-size NODES --rank NODE_RANK /data/imagenet
    torchrun --standalone --nproc_per_node=8 imagenet/train.py /data/imagenet     # or torchrun, Slurm, MPI
    python imagenet/train.py --dummy -a resnet50 --max-steps 100                    # benchmark the model only

Differences from main.py: -b and -j are per process (main.py divides them by the GPUs of a node), --lr is
for 256 images and scales with the global batch, and runs write to --output-dir (last.pt, best.pt,
metrics.jsonl). Read top to bottom: arguments -> (optional) spawn -> distributed setup -> data -> model
-> optimizer -> resume -> training loop with exact evaluation and checkpoints. See imagenet/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import sys
import time
from pathlib import Path

gc.disable()  # until the end of the imports: see there
import torch
import torch.nn as nn
import torchvision
import torchvision.transforms as T

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # find common/ when run as a script
from common.checkpoint import (
    CheckpointWriter,
    Position,
    eval_due,
    load_checkpoint,
    load_model_state,
    resolve_resume,
    restore_training,
    set_schedule_position,
)
from common.data import (
    ExactEvalSampler,
    ResumableDistributedSampler,
    SeededDataset,
    init_worker,
    loader_generator,
    worker_context,
)
from common.distributed import (
    LaunchEnv,
    add_dist_args,
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
from common.watchdog import CHECKPOINT, Watchdog
from imagenet.data import MEAN, STD, check_args, collate, fetch_weights, image_folder, weights_file
from imagenet.spawn import spawn

# Python's cyclic garbage collector would run hundreds of times during the imports above, scanning the same young
# objects over and over: about a quarter of a process's start-up CPU, paid again by every rank and restart
# (bench/startup.py). It was off for them; what they built lives as long as the process, so freeze it out of every
# later collection (each then skips these few hundred thousand objects) and turn the collector back on. No
# collection first: DataLoader workers run this module's top level again, and one would scan all they inherit.
gc.freeze()
gc.enable()

# Defaults each recipe gives to the flags left unset (an explicit flag always wins).
# fmt: off
RECIPES = {
    # torchvision V1 / pytorch/examples: 76.13% top-1 for ResNet50 (torchvision's number, not reproduced here).
    "classic": dict(lr=0.1, momentum=0.9, weight_decay=1e-4, label_smoothing=0.0, lr_schedule="step",
                    warmup_epochs=0.0, norm_bias_decay=True),
    # NVIDIA DeepLearningExamples ResNet50 v1.5, 90 epochs AMP: 77.1% top-1 (their number, not reproduced here).
    "modern": dict(lr=0.256, momentum=0.875, weight_decay=1 / 32768, label_smoothing=0.1, lr_schedule="cosine",
                   warmup_epochs=5.0, norm_bias_decay=False),
}
# fmt: on


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):  # no "(default: None)" on flags that --recipe or the launcher fills in
        return action.help if action.default is None else super()._get_help_string(action)


def rd(name: str) -> str:
    """Help text for a flag that --recipe fills in: its value in each recipe."""
    return "default: " + ", ".join(
        f"{r} {v[name]:.4g}" if type(v[name]) is float else f"{r} {v[name]}" for r, v in RECIPES.items()
    )  # noqa: E501


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=HelpFormatter,
        epilog="Differences from pytorch/examples imagenet/main.py: -b and -j count per process (main.py divides\n"
        "them by the GPUs of a node); --lr is for 256 images and is scaled to the global batch; --resume defaults\n"
        "to auto (continue from OUTPUT_DIR/last.pt); checkpoints and metrics go to --output-dir; --seed defaults\n"
        "to 0. --world-size/--rank count nodes with --multiprocessing-distributed (as in main.py), processes\n"
        "otherwise. See imagenet/README.md.",
    )
    p.add_argument("data", metavar="DATA", nargs="?", help="ImageFolder root: train/<class>/* and val/<class>/*")
    g = p.add_argument_group("data")
    g.add_argument("-j", "--workers", type=int, default=4, help="DataLoader workers per process (main.py: per node)")
    g.add_argument(
        "--synthetic", "--dummy", dest="synthetic", action="store_true",
        help="random batches made on the device, deterministic in (seed, step): benchmarks the model, not the disk",
    )  # fmt: skip
    g.add_argument(
        "--dummy-sizes", type=int, nargs=2, default=(1281167, 50000), metavar=("TRAIN", "VAL"), help="--dummy images"
    )
    g.add_argument("--train-crop-size", type=int, default=224, help="RandomResizedCrop size")
    g.add_argument("--val-resize-size", type=int, default=256, help="Resize before the center crop")
    g.add_argument("--val-crop-size", type=int, default=224, help="CenterCrop size")
    g.add_argument("--skip-bad-images", action="store_true", help="skip, count and report unreadable images")
    g.add_argument("--gpu-decode", action="store_true", help="decode JPEGs (torchvision.io) and augment on the GPU")
    g = p.add_argument_group("model")
    g.add_argument("-a", "--arch", default="resnet50", help="any torchvision classification model name")
    g.add_argument("--pretrained", action="store_true", help="start from torchvision's ImageNet weights")
    g.add_argument("--weights", default=None, help="with --pretrained: IMAGENET1K_V1 (main.py's), V2, DEFAULT...")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    g.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across ranks (GPU only)")
    g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None, help="default: on with CUDA")
    g = p.add_argument_group("optimization (unset values come from --recipe)")
    g.add_argument("--recipe", choices=tuple(RECIPES), default="classic", help="classic: main.py; modern: NVIDIA-like")
    g.add_argument("--epochs", type=int, default=90)
    g.add_argument("--start-epoch", type=int, default=0, help="start from this epoch when not resuming")
    g.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    g.add_argument(
        "-b", "--batch-size", type=int, default=256,
        help="per process (main.py: per node); global = this x world size x accum",
    )  # fmt: skip
    g.add_argument("--accum-steps", type=int, default=1, help="gradient accumulation micro-batches per step")
    g.add_argument(
        "--lr", "--learning-rate", type=float, help="for 256 images, scaled to the global batch; " + rd("lr")
    )
    g.add_argument("--momentum", type=float, help=rd("momentum"))
    g.add_argument("--wd", "--weight-decay", dest="weight_decay", type=float, help=rd("weight_decay"))
    g.add_argument("--norm-bias-decay", action=argparse.BooleanOptionalAction, help=rd("norm_bias_decay"))
    g.add_argument("--label-smoothing", type=float, help=rd("label_smoothing"))
    g.add_argument("--lr-schedule", choices=("step", "cosine"), help=rd("lr_schedule"))
    g.add_argument("--lr-step-size", type=int, default=30, help="step schedule: decay every N epochs")
    g.add_argument("--lr-gamma", type=float, default=0.1, help="step schedule: decay factor")
    g.add_argument("--warmup-epochs", type=float, help="linear warmup; " + rd("warmup_epochs"))
    g.add_argument("--mixup-alpha", type=float, default=0.0, help="mixup Beta(alpha, alpha) (0: off)")
    g.add_argument("--cutmix-alpha", type=float, default=0.0, help="cutmix Beta(alpha, alpha) (0: off)")
    g.add_argument("--ema", type=float, default=0.0, help="keep an EMA of the weights with this decay, e.g. 0.9999")
    g.add_argument(
        "--amp", choices=("auto", "bf16", "fp16", "none"), default="auto", help="auto: bf16 on GPU, off on CPU"
    )
    g = p.add_argument_group("run")
    g.add_argument("--output-dir", default="runs/imagenet")
    g.add_argument("--resume", default="auto", help="auto (continue from output-dir/last.pt if present) | PATH | none")
    g.add_argument("--overwrite", action="store_true", help="with --resume none: start over where a run saved")
    g.add_argument("-e", "--evaluate", action="store_true", help="evaluate --resume (or --pretrained) only")
    g.add_argument("--save-every-steps", type=int, default=0, help="also checkpoint every N steps (0: at epoch end)")
    g.add_argument("--keep-last", type=int, default=0, help="keep the N newest step_*.pt copies (0: none)")
    g.add_argument("--eval-every", type=int, default=1, help="evaluate every N epochs and at the end (0: never)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("-p", "--print-freq", type=int, default=10, help="log every N steps")
    g.add_argument("--wandb", action="store_true", help="log to Weights & Biases from rank 0 (honours WANDB_MODE)")
    add_dist_args(p)
    g = p.add_argument_group("pytorch/examples launch mode")
    g.add_argument(
        "--multiprocessing-distributed", action="store_true",
        help="spawn --nproc-per-node processes on this node; --world-size/--rank then count NODES, and a "
        "process's global rank is rank x nproc-per-node + local rank (as in main.py)",
    )  # fmt: skip
    g.add_argument("--nproc-per-node", type=int, help="with --multiprocessing-distributed; default: GPUs, else 1")
    g.add_argument("--gpu", type=int, help="GPU id for a single process (or one per node with --dist-url)")
    return p


def apply_recipe(args: argparse.Namespace) -> argparse.Namespace:
    for k, v in RECIPES[args.recipe].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


# ------------------------------------------------------------------ model


def build_model(arch: str, num_classes: int, weights=None) -> nn.Module:
    kw = {"aux_logits": False} if arch in ("googlenet", "inception_v3") else {}  # one output like every other model
    return torchvision.models.get_model(arch, weights=weights, num_classes=num_classes, **kw)


# ------------------------------------------------------------------ main


def main(args: argparse.Namespace, launch: LaunchEnv | None = None) -> None:
    # [DDP 1] init the process group (torchrun, Slurm, MPI, --dist-url, mp.spawn or none) and pick the device.
    launch = launch or detect_launcher(None, args.dist_url, args.world_size, args.rank, args.local_rank)
    if args.gpu is not None and launch.launcher != "mp.spawn":
        if launch.launcher not in ("single", "dist-url"):
            raise UserError(f"--gpu picks one process's GPU; under {launch.launcher} each rank uses its local rank")
        launch = dataclasses.replace(launch, local_rank=args.gpu)
    if args.gpu_decode:  # read when CUDA makes its context, so before setup_distributed picks the device
        # CUDA runs streams on 8 hardware queues by default: the decode's stream shares one with the training's and
        # waits behind the work queued there, a whole CUDA graph replay included (BENCHMARKS.md). 32 gives it its own.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    info = setup_distributed(args, launch=launch)
    device = info.device
    seed_everything(args.seed, info.rank)
    out = prepare_output_dir(args.output_dir)
    ckpt_path = resolve_resume(args.resume, out)
    if args.evaluate and ckpt_path is None and not args.pretrained:
        raise UserError("-e needs weights: --resume CHECKPOINT, --pretrained, or a last.pt in --output-dir")
    dtype = amp_dtype(args.amp, device)
    channels_last = args.channels_last if args.channels_last is not None else device.type == "cuda"
    torch.backends.cudnn.benchmark = True  # fixed input sizes: let cuDNN pick the fastest kernels once
    global_batch = args.batch_size * info.world_size * args.accum_steps
    bad_train = 0  # unreadable training images skipped by this rank (--skip-bad-images)

    # ---- data
    normalize = [T.PILToTensor(), T.ConvertImageDtype(torch.float), T.Normalize(MEAN, STD)]
    tf_train = T.Compose([T.RandomResizedCrop(args.train_crop_size), T.RandomHorizontalFlip(), *normalize])
    tf_val = T.Compose([T.Resize(args.val_resize_size), T.CenterCrop(args.val_crop_size), *normalize])
    if args.synthetic:
        num_classes, (n_train, n_val) = 1000, args.dummy_sizes
    else:
        train_ds = None if args.evaluate else image_folder(Path(args.data) / "train", tf_train)
        val_ds = image_folder(Path(args.data) / "val", tf_val)
        num_classes, n_train, n_val = len(val_ds.classes), len(train_ds or ()), len(val_ds)
    if num_classes == 1:
        print0(f"warning: {args.data} holds one class: it trains to a loss of 0 and learns nothing", file=sys.stderr)
    if args.pretrained and num_classes != 1000:
        raise UserError(f"--pretrained loads 1000-class ImageNet heads, but {args.data} has {num_classes} classes")
    loader_kw = dict(
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        worker_init_fn=init_worker,
        persistent_workers=args.workers > 0,
        prefetch_factor=2 if args.workers > 0 else None,  # batches in flight per worker
        multiprocessing_context=worker_context(args.workers),  # not forked from this process: see worker_context
        generator=loader_generator(args.seed, info.rank),
        collate_fn=collate,
    )
    gpu_decode = args.gpu_decode and not args.synthetic  # on CPU it still runs (torchvision.io), for tests
    if gpu_decode:  # workers only read file bytes; decode, crop, flip and normalize run on the GPU (see gpu_decode.py)
        from imagenet.gpu_decode import EncodedImages, GpuTransform, collate_encoded, prefetch

        loader_kw["collate_fn"] = collate_encoded
        gpu_train = GpuTransform(device, args.train_crop_size, channels_last=channels_last)
        gpu_val = GpuTransform(device, args.val_crop_size, args.val_resize_size, channels_last=channels_last)
        train_ds = EncodedImages(train_ds.samples, args.seed) if train_ds is not None else None
        val_ds = EncodedImages(val_ds.samples)
    if not args.evaluate:
        # [DDP 2] every rank reads a different shard; the order of epoch e depends only on (seed, e).
        if n_train < global_batch:
            raise UserError(f"global batch {global_batch} is larger than the {n_train} training images")
        sampler = ResumableDistributedSampler(n_train, info.rank, info.world_size, args.seed)
        steps_per_epoch = len(sampler) // args.batch_size // args.accum_steps
        if not args.synthetic:
            train_loader = torch.utils.data.DataLoader(
                train_ds if gpu_decode else SeededDataset(train_ds, args.seed),
                args.batch_size,
                sampler=sampler,
                drop_last=True,
                **loader_kw,
            )
    if not args.synthetic:
        val_sampler = ExactEvalSampler(n_val, info.rank, info.world_size)
        val_kw = {**loader_kw, "persistent_workers": False}  # idle between evals: do not hold -j more processes
        val_loader = torch.utils.data.DataLoader(val_ds, args.batch_size, sampler=val_sampler, **val_kw)
    gen = torch.Generator(device)

    def check_bad(bad: list[str], split: str) -> None:
        if bad and not args.skip_bad_images:
            raise UserError(f"unreadable image {bad[0]} (fix or delete it, or pass --skip-bad-images)")
        for msg in bad:
            print(f"warning: rank {info.rank} skips unreadable {split} image {msg}", file=sys.stderr, flush=True)

    def train_batches(epoch: int, skip: int):
        """(index, x, y) device batches of `epoch`, after skipping `skip` micro-batches already done."""
        n = steps_per_epoch * args.accum_steps
        if args.synthetic:  # made on the device: no PIL, no DataLoader, no host-to-device copy
            for i in range(skip, n):
                gen.manual_seed(mix_seed(args.seed, epoch, info.rank, i))
                size = (args.batch_size, 3, args.train_crop_size, args.train_crop_size)
                x = torch.randn(size, device=device, generator=gen)
                yield i, x, torch.randint(0, num_classes, (args.batch_size,), device=device, generator=gen)
            return
        nonlocal bad_train
        sampler.set_epoch(epoch, skip=skip * args.batch_size)
        for i, (x, y, bad) in enumerate(prefetch(train_loader, gpu_train) if gpu_decode else train_loader, start=skip):
            if i >= n:
                return
            check_bad(bad, "train")
            bad_train += len(bad)
            if x is None:  # every rank must run the same number of backward passes
                raise UserError(f"a whole batch of unreadable training images, e.g. {bad[0]}")
            yield i, x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def val_batches():
        if args.synthetic:  # image k is pool[k % 64]: the same numbers for any world size
            gen.manual_seed(mix_seed(args.seed, 2**40))
            pool = torch.randn((64, 3, args.val_crop_size, args.val_crop_size), device=device, generator=gen)
            for idx in torch.arange(info.rank, n_val, info.world_size, device=device).split(args.batch_size):
                yield pool[idx % 64], idx % num_classes, 0
            return
        for x, y, bad in prefetch(val_loader, gpu_val) if gpu_decode else val_loader:
            check_bad(bad, "val")
            if x is not None:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            yield x, y, len(bad)

    # ---- model
    weights = None
    if args.pretrained:
        failed = torch.zeros(1, device=device)
        err = fetch_weights(args) if info.local_rank == 0 else None  # one download per node (the cache is local)
        failed += err is not None
        if all_reduce_sum(failed).item():  # also the barrier before the other local ranks read the file
            raise UserError(err or "--pretrained: downloading the weights failed on another node")
        weights = weights_file(args)[0]
    model = build_model(args.arch, num_classes, weights).to(device)
    if args.sync_bn and info.world_size > 1 and device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model_without_ddp = model  # what we save, evaluate and restore
    eval_model = torch.compile(model) if args.compile else model

    def log_eval(m: dict, epoch: int, step: int, extra: dict | None = None) -> None:
        logger.log({"split": "val", "epoch": epoch, "step": step, **m, **(extra or {})})
        ema_txt = f" | ema acc1 {m['ema_acc1']:.2f}" if "ema_acc1" in m else ""
        print0(f"epoch {epoch} val: {describe(m)}{ema_txt}")

    logger = MetricsLogger(out, info, args.wandb)
    if args.evaluate:  # -e: evaluate a checkpoint (or the pretrained weights) once and stop
        ckpt = load_checkpoint(ckpt_path) if ckpt_path is not None else {"epoch": 0, "step": 0}
        if ckpt_path is not None:
            load_model_state(model_without_ddp, ckpt["model"], ckpt_path)
        m = evaluate_classifier(eval_model, val_batches(), device, dtype)
        log_eval(m, ckpt["epoch"], ckpt["step"], {"checkpoint": str(ckpt_path or weights)})
        return

    # [DDP 3] wrap the model: gradients are averaged across ranks during backward.
    if info.world_size > 1:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True
        )
    # --compile-mode reduce-overhead replays the forward and backward as CUDA graphs: a step costs the host almost
    # nothing to launch, which matters most with --gpu-decode, whose threads share the interpreter (BENCHMARKS.md).
    train_model = torch.compile(model, mode=args.compile_mode) if args.compile else model
    # updated on every rank from the same weights, on the device; BN buffers are synced before eval
    ema = EMA(model_without_ddp, args.ema) if args.ema else None
    mix = None
    if args.mixup_alpha > 0 or args.cutmix_alpha > 0:  # on the device batch; soft targets go to the loss
        from torchvision.transforms import v2

        ops = [v2.MixUp(alpha=args.mixup_alpha, num_classes=num_classes)] if args.mixup_alpha > 0 else []
        ops += [v2.CutMix(alpha=args.cutmix_alpha, num_classes=num_classes)] if args.cutmix_alpha > 0 else []
        mix = ops[0] if len(ops) == 1 else v2.RandomChoice(ops)

    # ---- optimizer and LR schedule (a pure function of the step)
    lr = args.lr * global_batch / 256
    optimizer = torch.optim.SGD(
        param_groups(model_without_ddp, args.weight_decay, skip_norm_bias=not args.norm_bias_decay),
        lr=lr,
        momentum=args.momentum,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args, steps_per_epoch))
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    # ---- resume (same command restarted by torchrun/Slurm continues where it stopped)
    pos, ckpt = Position(epoch=args.start_epoch), {}
    if ckpt_path is not None:
        pos, ckpt = restore_training(ckpt_path, model_without_ddp, optimizer, scheduler, scaler,
                                  world_size=info.world_size, batch_size=args.batch_size,
                                  accum_steps=args.accum_steps, ema=ema)  # fmt: skip
    epoch, step, batch_in_epoch, best, wandb_id = pos.epoch, pos.step, pos.batch_in_epoch, pos.best_metric, pos.wandb_id
    at = epoch * steps_per_epoch + batch_in_epoch // args.accum_steps  # where the LR schedule should be
    set_schedule_position(scheduler, at, lr)
    step = step or at  # main.py's --start-epoch also counts the skipped epochs' steps
    eval_step = pos.eval_step if ckpt_path is not None else step

    # writes on a thread: the step waits only for a copy of the state in host memory
    writer = CheckpointWriter(out if info.is_main else None)

    def save(name: str, keep_last: int = 0) -> float:
        """Returns the seconds it took, which the throughput leaves out (as it does evaluation)."""
        t = time.time()
        watchdog.beat(CHECKPOINT)
        window = loss_window.state()  # every rank's part
        check_finite_loss(window["sums"].sum(), step)  # the losses since the last log point
        if info.is_main:  # [DDP 4] only global rank 0 writes (not every node's local rank 0), atomically
            state = dict(model=model_without_ddp.state_dict(), optimizer=optimizer.state_dict(),
                         scheduler=scheduler.state_dict(), scaler=scaler.state_dict(), epoch=epoch, step=step,
                         batch_in_epoch=batch_in_epoch, best_metric=best, eval_step=eval_step, args=vars(args),
                         world_size=info.world_size, wandb_id=wandb_id, arch=args.arch, num_classes=num_classes,
                         loss_window=window)  # fmt: skip
            writer.save({**state, **({"ema": ema.state_dict()} if ema else {})}, out / name, keep_last)
        return time.time() - t

    config = logger.write_config(
        args, {"global_batch": global_batch, "peak_lr": lr, "steps_per_epoch": steps_per_epoch}
    )
    wandb_id = logger.start_wandb("imagenet", config, wandb_id)
    print0(
        f"{args.arch} ({args.recipe} recipe) on {n_train} images, {num_classes} classes | {info.world_size} "
        f"process(es) on {device.type} ({info.launcher}) | global batch {global_batch} = {args.batch_size} x "
        f"{info.world_size} x {args.accum_steps} | peak lr {lr:.4g}"
    )
    total_steps = step + (args.epochs - epoch) * steps_per_epoch - batch_in_epoch // args.accum_steps
    max_steps = min(total_steps, args.max_steps or total_steps)
    progress = Progress(info, max_steps, step)
    stop = StopSignal()
    watchdog = Watchdog(args.stall_timeout, info.rank)  # a stall becomes stacks and an exit

    # ---- training loop
    def due() -> bool:  # an evaluation at this position, not yet recorded
        return eval_due(args.eval_every, args.epochs, epoch, batch_in_epoch, step, max_steps, eval_step)

    stopped, n_skipped, pending, loss_window = False, 0, due(), LossWindow(info, step, ckpt.get("loss_window"))
    if ckpt_path is not None and (step < max_steps or pending):
        logger.rewind(step, eval_step)
    while not stopped and (step < max_steps or pending):
        train_model.train()
        micro = 0
        # an evaluation that the last process did not record comes before any further step
        for i, x, y in () if pending else watchdog.batches(train_batches(epoch, batch_in_epoch)):
            micro += 1
            sync = micro % args.accum_steps == 0
            if mix is not None:  # seeded per micro-batch: identical after a resume
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(mix_seed(args.seed, epoch, info.rank, i, 1))
                    x, y = mix(x, y)
            if micro == 1:  # dropout/stochastic depth: global RNG as a function of (seed, rank, step)
                torch.manual_seed(mix_seed(args.seed, info.rank, step))
            with model.no_sync() if (not sync and info.world_size > 1) else contextlib.nullcontext():
                with autocast(device, dtype):
                    loss = criterion(
                        train_model(x.contiguous(memory_format=torch.channels_last) if channels_last else x), y
                    )
                scaler.scale(loss / args.accum_steps).backward()
            loss_window.sum += loss.detach()
            if not sync:
                continue
            micro = 0
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            if ema is not None:
                ema.update(step)
            batch_in_epoch += args.accum_steps
            loss_window.n += args.accum_steps
            if step % args.print_freq == 0 or step == max_steps:
                stats = torch.stack([loss_window.sum, torch.full_like(loss_window.sum, bad_train)])
                loss_tot, n_skipped = all_reduce_sum(stats).tolist()  # the one host sync
                loss_avg, n_skipped = loss_tot / (loss_window.n * info.world_size), int(n_skipped)
                check_finite_loss(loss_avg, step)
                ips = (step - loss_window.step0) * global_batch / (time.time() - loss_window.t0)
                rec = {"split": "train", "epoch": epoch, "step": step, "loss": loss_avg}
                rec.update(lr=scheduler.get_last_lr()[0], img_per_s=ips)
                logger.log({**rec, **({"skipped_images": n_skipped} if args.skip_bad_images else {})})
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
            broadcast_buffers(model_without_ddp)  # every rank evaluates rank 0's BN statistics, as saved
            m = evaluate_classifier(eval_model, watchdog.batches(val_batches(), evaluating=True), device, dtype)
            if ema is not None:
                broadcast_buffers(ema.module)
                m_ema = evaluate_classifier(ema.module, watchdog.batches(val_batches(), evaluating=True), device, dtype)
                m.update({f"ema_{k}": m_ema[k] for k in ("loss", "acc1", "acc5")})
            log_eval(m, epoch, step)
            if m["acc1"] > best:
                best = m["acc1"]
                save("best.pt")
            eval_step, loss_window.t0, loss_window.step0 = step, time.time(), step  # eval time is not throughput
        pending = False
        loss_window.t0 += save("last.pt")  # keep checkpoint time out of the throughput too
    stop.close()
    watchdog.stop()
    progress.close()
    if n_skipped:
        print0(f"skipped {n_skipped} unreadable training image(s), listed above as warnings")
    if gpu_decode:  # training images each decoder took on rank 0 (cpu: what nvJPEG refused)
        print0("gpu-decode decoded (rank 0): " + ", ".join(f"{k} {v}" for k, v in sorted(gpu_train.counts.items())))
    writer.wait()  # the last checkpoint is on disk before the run says so
    if stopped:
        stop.exit_preempted(step, logger)
    print0(f"done: step {step}, best val acc1 {best:.2f}")
    logger.close()


def cli() -> None:
    args = apply_recipe(get_args_parser().parse_args())
    check_args(args)
    if args.multiprocessing_distributed:
        if args.pretrained and (err := fetch_weights(args)):  # once per node, before the workers need it
            raise UserError(err)
        return spawn(main, args, args.nproc_per_node or torch.cuda.device_count() or 1)
    try:
        main(args)
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # fail instead of hanging on a dead rank
    run_cli(cli)
