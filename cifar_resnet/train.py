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
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # find common/ when run as a script
from common.checkpoint import Position, resolve_resume, restore_training, save_checkpoint, set_schedule_position
from common.data import (
    ExactEvalSampler,
    ResumableDistributedSampler,
    SeededDataset,
    loader_generator,
    seed_worker,
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
from common.metrics import MetricsLogger, Progress, prepare_output_dir
from common.utils import (
    StopSignal,
    amp_dtype,
    autocast,
    describe,
    evaluate_classifier,
    param_groups,
    warmup_cosine,
)
from common.watchdog import CHECKPOINT, Watchdog

T_START = time.time()
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")


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
    g.add_argument("-j", "--workers", type=int, default=4, help="DataLoader workers per process")
    g = p.add_argument_group("model")
    g.add_argument("-a", "--arch", default="resnet18", help="|".join(ARCHS))
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
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
    g.add_argument("--save-every-steps", type=int, default=0, help="also checkpoint every N steps (0: at epoch end)")
    g.add_argument("--keep-last", type=int, default=0, help="keep the N newest step_*.pt copies (0: none)")
    g.add_argument("--eval-every", type=int, default=1, help="evaluate every N epochs and at the end (0: never)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("-p", "--print-freq", type=int, default=50, help="log every N steps")
    g.add_argument("--wandb", action="store_true", help="log to Weights & Biases from rank 0 (honours WANDB_MODE)")
    add_dist_args(p)
    return p


# ------------------------------------------------------------------ data


class SyntheticCIFAR(torch.utils.data.Dataset):
    """Sample i is a fixed function of (seed, i): deterministic, no disk."""

    def __init__(self, n: int, seed: int, transform=None):
        self.n, self.seed, self.transform = n, seed, transform
        self.targets = [i % 10 for i in range(n)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(mix_seed(self.seed, i))
        img = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=g)
        return (self.transform(img) if self.transform else img), self.targets[i]


class CIFARPickles(torch.utils.data.Dataset):
    """torchvision's CIFAR-10 files (cifar-10-batches-py/), read without MD5 checks so copies work."""

    def __init__(self, folder: Path, train: bool, transform=None):
        import pickle

        import numpy as np

        names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
        data, self.targets = [], []
        for name in names:
            try:
                with open(folder / name, "rb") as f:
                    entry = pickle.load(f, encoding="latin1")
            except (OSError, pickle.UnpicklingError, EOFError) as e:
                raise UserError(f"cannot read CIFAR-10 batch {folder / name}: {e}") from None
            data.append(entry["data"])
            self.targets += entry["labels"]
        self.data = np.concatenate(data).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # NHWC uint8
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        from PIL import Image

        img = Image.fromarray(self.data[i])
        return (self.transform(img) if self.transform else img), self.targets[i]


def load_splits(args, transform_train, transform_eval):
    """(train, eval, eval_name) datasets for the chosen source, with their transforms."""
    from torchvision import datasets

    if args.synthetic:
        return (
            SyntheticCIFAR(5000, args.seed, transform_train),
            SyntheticCIFAR(1000, args.seed + 1, transform_eval),
            "val",
        )
    root = Path(args.data_dir)
    if args.download or (root / "cifar-10-batches-py").is_dir():
        if args.download:
            datasets.CIFAR10(str(root), download=True)  # fetch and MD5-check once
        make = functools.partial(CIFARPickles, root / "cifar-10-batches-py")
        train, test = make(train=True, transform=transform_train), make(train=False, transform=transform_eval)
        eval_name = "test"
    elif (root / "train").is_dir():
        test_dir = next((root / s for s in ("test", "val") if (root / s).is_dir()), None)
        try:
            train = datasets.ImageFolder(str(root / "train"), transform=transform_train)
            test = datasets.ImageFolder(str(test_dir), transform=transform_eval) if test_dir else None
        except (FileNotFoundError, OSError) as e:
            raise UserError(f"bad ImageFolder under {root}: {e}") from None
        eval_name = test_dir.name if test_dir else "val"
        if test is None and args.val_split <= 0:
            raise UserError(f"{root} has train/ but no test/ or val/ (pass --val-split 5000 to hold out part of train)")
    else:
        raise UserError(
            f"no CIFAR-10 at {root} (expected cifar-10-batches-py/ or train/<class>/*.jpg; "
            "use --download, --data-dir DIR or --synthetic)"
        )
    if args.val_split > 0:  # seeded hold-out: identical on every rank and rerun; never seen in training
        n = len(train)
        if args.val_split >= n:
            raise UserError(f"--val-split {args.val_split} leaves no training images (train has {n})")
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(mix_seed(args.seed, 12345))).tolist()
        held = copy_with_transform(train, transform_eval)
        train, test = (
            torch.utils.data.Subset(train, perm[args.val_split :]),
            torch.utils.data.Subset(held, perm[: args.val_split]),
        )
        eval_name = "val"
    return train, test, eval_name


def copy_with_transform(ds, transform):
    import copy

    ds = copy.copy(ds)
    ds.transform = transform
    return ds


def to_uint8_tensors(ds, workers: int):
    """Decode a whole (small) dataset once into uint8 NHWC images and int64 labels."""
    loader = torch.utils.data.DataLoader(
        ds, batch_size=500, num_workers=workers, multiprocessing_context=worker_context(workers)
    )
    xs, ys = zip(*[(x, y) for x, y in loader])
    return torch.cat(xs).permute(0, 2, 3, 1).contiguous(), torch.cat(ys)


@functools.cache
def _mean_std(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Made once per device: a host->device copy inside the loop would sync the stream every step.
    return torch.tensor(MEAN, device=device) * 255, torch.tensor(STD, device=device) * 255


def normalize(x_uint8_nhwc: torch.Tensor) -> torch.Tensor:
    """uint8 NHWC -> normalized float NCHW (a channels_last view, no copy of layout)."""
    mean, std = _mean_std(x_uint8_nhwc.device)
    return ((x_uint8_nhwc.float() - mean) / std).permute(0, 3, 1, 2)


def gpu_crop_flip(x_padded: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random 32x32 crop of 40x40 padded uint8 NHWC images plus random flip, in one gather."""
    b, dev = x_padded.shape[0], x_padded.device
    dx, dy = torch.randint(0, 9, (2, b), device=dev, generator=gen)
    flip = torch.rand(b, device=dev, generator=gen) < 0.5
    ar = torch.arange(32, device=dev)
    rows = dy[:, None] + ar
    cols = dx[:, None] + torch.where(flip[:, None], 31 - ar, ar)
    return x_padded[torch.arange(b, device=dev)[:, None, None], rows[:, :, None], cols[:, None, :]]


# ------------------------------------------------------------------ model


def build_model(arch: str) -> nn.Module:
    import torchvision

    if arch not in ARCHS:
        raise UserError(f"unknown --arch {arch!r} (choose from {', '.join(ARCHS)})")
    model = getattr(torchvision.models, arch)(num_classes=10)
    # CIFAR stem: 3x3 stride-1 conv, no max-pool, so 32x32 inputs keep their resolution.
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


# ------------------------------------------------------------------ main


def main(args: argparse.Namespace) -> None:
    if args.batch_size <= 0 or args.accum_steps <= 0:
        raise UserError("--batch-size and --accum-steps must be positive")
    # [DDP 1] init the process group (torchrun, Slurm, MPI, --dist-url or none) and pick this rank's device.
    info = setup_distributed(args)
    device = info.device
    seed_everything(args.seed, info.rank)
    out = prepare_output_dir(args.output_dir)
    dtype = amp_dtype(args.amp, device)
    channels_last = args.channels_last if args.channels_last is not None else device.type == "cuda"
    global_batch = args.batch_size * info.world_size * args.accum_steps

    # ---- data
    import torchvision.transforms as T

    tf_eval = (
        T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
        if not args.synthetic
        else T.Compose([T.ConvertImageDtype(torch.float), T.Normalize(MEAN, STD)])
    )
    tf_train = T.Compose([T.RandomCrop(32, padding=4, padding_mode="reflect"), T.RandomHorizontalFlip(), tf_eval])
    if args.download and info.is_main:  # rank 0 downloads, the others wait, then all read
        load_splits(args, None, None)
    barrier()
    if args.gpu_data:  # decode once, keep uint8 on the device, augment there (see gpu_crop_flip)
        raw = T.PILToTensor() if not args.synthetic else None
        train_ds, eval_ds, eval_name = load_splits(args, raw, raw)
        train_x, train_y = (t.to(device) for t in to_uint8_tensors(train_ds, args.workers))
        eval_x, eval_y = (t.to(device) for t in to_uint8_tensors(eval_ds, args.workers))
        train_x = F.pad(train_x.permute(0, 3, 1, 2), (4, 4, 4, 4), mode="reflect").permute(0, 2, 3, 1).contiguous()
        n_train = len(train_y)
    else:
        train_ds, eval_ds, eval_name = load_splits(args, tf_train, tf_eval)
        n_train = len(train_ds)
    if not n_train or not len(eval_ds):
        raise UserError(f"empty dataset in {args.data_dir} (train {n_train} images, eval {len(eval_ds)})")
    # [DDP 2] every rank reads a different shard; the order of epoch e depends only on (seed, e).
    sampler = ResumableDistributedSampler(n_train, info.rank, info.world_size, args.seed)
    steps_per_epoch = len(sampler) // args.batch_size // args.accum_steps
    if steps_per_epoch == 0:
        raise UserError(f"global batch {global_batch} is larger than the {n_train} training images")
    loader_kw = dict(
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        worker_init_fn=seed_worker,
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
            for i, b in enumerate(idx.split(args.batch_size), start=skip):
                gen.manual_seed(mix_seed(args.seed, epoch, info.rank, i))  # per batch: resumable mid-epoch
                yield normalize(gpu_crop_flip(train_x[b], gen)), train_y[b]
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
    train_model = torch.compile(model) if args.compile else model

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
    pos, ckpt_path = Position(), resolve_resume(args.resume, out)
    if ckpt_path is not None:
        pos, _ = restore_training(
            ckpt_path,
            model_without_ddp,
            optimizer,
            scheduler,
            scaler,
            world_size=info.world_size,
            batch_size=args.batch_size,
            accum_steps=args.accum_steps,
        )
    epoch, step, batch_in_epoch, best, wandb_id = pos.epoch, pos.step, pos.batch_in_epoch, pos.best_metric, pos.wandb_id
    set_schedule_position(scheduler, epoch * steps_per_epoch + batch_in_epoch // args.accum_steps, lr)

    def save(name: str, keep_last: int = 0) -> float:
        """Returns the seconds it took, which the throughput leaves out (as it does evaluation)."""
        t = time.time()
        watchdog.beat(CHECKPOINT)
        if info.is_main:  # [DDP 4] only rank 0 writes, atomically
            state = dict(model=model_without_ddp.state_dict(), optimizer=optimizer.state_dict(),
                         scheduler=scheduler.state_dict(), scaler=scaler.state_dict(), epoch=epoch, step=step,
                         batch_in_epoch=batch_in_epoch, best_metric=best, args=vars(args),
                         world_size=info.world_size, wandb_id=wandb_id)  # fmt: skip
            save_checkpoint(state, out / name, keep_last=keep_last)
        return time.time() - t

    logger = MetricsLogger(out, info, args.wandb)
    config = logger.write_config(
        args, {"global_batch": global_batch, "peak_lr": lr, "steps_per_epoch": steps_per_epoch}
    )
    wandb_id = logger.start_wandb("cifar_resnet", config, wandb_id)
    if args.evaluate:
        if ckpt_path is None:
            raise UserError("--evaluate needs a checkpoint: --resume PATH (or an output dir with last.pt)")
        m = evaluate_classifier(model_without_ddp, eval_batches(), device, dtype, args.tta)
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
    stopped = False
    loss_sum, loss_n, t0, step0 = torch.zeros((), device=device), 0, time.time(), step
    while epoch < args.epochs and step < max_steps and not stopped:
        train_model.train()
        micro = 0
        for x, y in watchdog.batches(train_batches(epoch, batch_in_epoch)):
            micro += 1
            sync = micro % args.accum_steps == 0
            with model.no_sync() if (not sync and info.world_size > 1) else contextlib.nullcontext():
                with autocast(device, dtype):
                    loss = criterion(
                        train_model(x.contiguous(memory_format=torch.channels_last) if channels_last else x), y
                    )
                scaler.scale(loss / args.accum_steps).backward()
            loss_sum += loss.detach()
            if not sync:
                continue
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            batch_in_epoch += args.accum_steps
            loss_n += args.accum_steps
            if step % args.print_freq == 0 or step == max_steps:
                loss_avg = all_reduce_sum(loss_sum.clone()).item() / (loss_n * info.world_size)  # the one host sync
                dt = time.time() - t0
                ips = (step - step0) * global_batch / dt
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
                loss_sum.zero_()
                loss_n, t0, step0 = 0, time.time(), step
            if args.save_every_steps and step % args.save_every_steps == 0:
                t0 += save("last.pt", args.keep_last)
            stopped = stop.should_stop()
            if step >= max_steps or stopped:
                break
        epoch_done = batch_in_epoch >= steps_per_epoch * args.accum_steps
        if epoch_done:
            epoch, batch_in_epoch = epoch + 1, 0
        if args.eval_every > 0 and (
            (epoch_done and (epoch % args.eval_every == 0 or epoch == args.epochs))
            or (step >= max_steps and not stopped)
        ):
            broadcast_buffers(model_without_ddp)  # every rank evaluates rank 0's BN statistics, as saved
            batches = watchdog.batches(eval_batches(), evaluating=True)
            m = evaluate_classifier(model_without_ddp, batches, device, dtype, args.tta)
            logger.log({"split": eval_name, "epoch": epoch, "step": step, **m})
            progress.write(f"epoch {epoch} {eval_name}: {describe(m)}")
            if m["acc1"] > best:
                best = m["acc1"]
                save("best.pt")
            t0, step0 = time.time(), step  # keep eval time out of the throughput
        t0 += save("last.pt")  # keep checkpoint time out of the throughput too
    stop.close()
    watchdog.stop()
    progress.close()
    if stopped:
        stop.exit_preempted(step, logger)
    print0(f"done: step {step}, best {eval_name} acc1 {best:.2f}, wall {time.time() - T_START:.1f}s since start")
    logger.close()


def cli() -> None:
    args = get_args_parser().parse_args()
    try:
        main(args)
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # fail instead of hanging on a dead rank
    run_cli(cli)
