"""Bad input at every entry point (cifar, imagenet, transformer, translate, doctor), one table.

Each case runs the script's command line in this process (its entry point with ``sys.argv`` and the environment
set, as ``__main__`` runs it), and must end with exit code 2, exactly one ``error:`` line on stderr (argparse's own
``prog: error:`` line counts), no traceback, within a time limit, and, where the output dir holds a good run, an
unchanged ``last.pt``. A few cases expect a warning and a finished run instead. The cases that need real processes
(a rendezvous that fails, a launcher) share one parallel batch of subprocesses.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PY, REPO, Evil, free_port, make_cifar_pickles, make_jpeg_imagefolder

sys.path.insert(0, str(REPO))

ENTRY = {  # script -> (module, its __main__ entry point)
    "cifar": ("cifar_resnet.train", lambda m: lambda: m.main(m.get_args_parser().parse_args())),
    "imagenet": ("imagenet.train", lambda m: lambda: m.main(m.get_args_parser().parse_args())),
    "transformer": ("transformer.train", lambda m: lambda: m.main(m.get_args_parser().parse_args())),
    "translate": ("transformer.translate", lambda m: lambda: m.main(m.get_args_parser().parse_args())),
    "doctor": ("scripts.doctor", lambda m: m.main),
}
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
               "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
               "OMPI_COMM_WORLD_SIZE", "WANDB_MODE", "WANDB_API_KEY")  # fmt: skip
ERROR_LINE = re.compile(r"^(\S+: )?error: ")  # ours, or argparse's "train.py: error: ..."
CIFAR = ["--synthetic", "-a", "resnet20", "-b", "4", "-j", "0", "--eval-every", "0"]
INET = ["{inet}", "-a", "resnet18", "-b", "4", "-j", "0", "--train-crop-size", "32", "--val-resize-size", "40",
        "--val-crop-size", "32"]  # fmt: skip
TR = ["--synthetic", "--preset", "tiny", "-j", "0"]
DOCTOR: list[str] = []
NOT_CKPT = "is not a checkpoint (not a file torch.save wrote"
ENV1 = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}

# (script, base args, extra args, environment, what the error line holds); {names} are paths made below; the
# cifar, imagenet and transformer cases write to {good} (a finished run) unless they name another --output-dir.
# fmt: off
CASES = [
    # ---- cifar: every shared flag, the script's own, the environment, its files
    ("cifar", CIFAR, ["-p", "0"], {}, "argument -p/--print-freq: 0 must be at least 1"),
    ("cifar", CIFAR, ["-p", "-3"], {}, "argument -p/--print-freq: -3 must be at least 1"),
    ("cifar", CIFAR, ["--lr", "-0.1"], {}, "argument --lr: -0.1 must be a finite number above 0"),
    ("cifar", CIFAR, ["--lr", "nan"], {}, "argument --lr: nan must be a finite number above 0"),
    ("cifar", CIFAR, ["--lr", "inf"], {}, "argument --lr: inf must be a finite number above 0"),
    ("cifar", CIFAR, ["--lr", "0"], {}, "argument --lr: 0 must be a finite number above 0"),
    ("cifar", CIFAR, ["--momentum", "-1"], {}, "argument --momentum: -1 must be in [0, 1)"),
    ("cifar", CIFAR, ["--momentum", "1.5"], {}, "argument --momentum: 1.5 must be in [0, 1)"),
    ("cifar", CIFAR, ["--label-smoothing", "2"], {}, "argument --label-smoothing: 2 must be in [0, 1)"),
    ("cifar", CIFAR, ["--label-smoothing", "-0.1"], {}, "argument --label-smoothing: -0.1 must be in [0, 1)"),
    ("cifar", CIFAR, ["-j", "-1"], {}, "argument -j/--workers: -1 must be 0 or more"),
    ("cifar", CIFAR, ["--epochs", "0"], {}, "argument --epochs: 0 must be at least 1"),
    ("cifar", CIFAR, ["--epochs", "-3"], {}, "argument --epochs: -3 must be at least 1"),
    ("cifar", CIFAR, ["--max-steps", "-1"], {}, "argument --max-steps: -1 must be 0 or more"),
    ("cifar", CIFAR, ["--save-every-steps", "-2"], {}, "argument --save-every-steps: -2 must be 0 or more"),
    ("cifar", CIFAR, ["--keep-last", "-1"], {}, "argument --keep-last: -1 must be 0 or more"),
    ("cifar", CIFAR, ["--eval-every", "-1"], {}, "argument --eval-every: -1 must be 0 or more"),
    ("cifar", CIFAR, ["--seed", "-1"], {}, "argument --seed: -1 must be in 0..2**63-1"),
    ("cifar", CIFAR, ["--batch-size", "0"], {}, "argument -b/--batch-size: 0 must be at least 1"),
    ("cifar", CIFAR, ["--batch-size", "-4"], {}, "argument -b/--batch-size: -4 must be at least 1"),
    ("cifar", CIFAR, ["--accum-steps", "0"], {}, "argument --accum-steps: 0 must be at least 1"),
    ("cifar", CIFAR, ["--wd", "-1"], {}, "argument --wd/--weight-decay: -1 must be a finite number >= 0"),
    ("cifar", CIFAR, ["--wd", "nan"], {}, "argument --wd/--weight-decay: nan must be a finite number >= 0"),
    ("cifar", CIFAR, ["--ema", "5"], {}, "argument --ema: 5 must be in [0, 1)"),
    ("cifar", CIFAR, ["--ema", "-0.5"], {}, "argument --ema: -0.5 must be in [0, 1)"),
    ("cifar", CIFAR, ["--random-erasing", "2"], {}, "argument --random-erasing: 2 must be in [0, 1]"),
    ("cifar", CIFAR, ["--val-split", "-1"], {}, "argument --val-split: -1 must be 0 or more"),
    ("cifar", CIFAR, ["--warmup-epochs", "-1"], {}, "argument --warmup-epochs: -1 must be a finite number >= 0"),
    ("cifar", CIFAR, ["--download"], {}, "argument --download: not allowed with argument --synthetic"),
    ("cifar", CIFAR, ["--arch", "resnet7"], {}, "-a/--arch: invalid choice: 'resnet7' (choose from 'resnet18'"),
    ("cifar", CIFAR, ["--compile-mode", "reduce-overhead"], {}, "--compile-mode reduce-overhead needs --compile"),
    ("cifar", CIFAR, ["--compile", "--compile-mode", "fast"], {}, "--compile-mode 'fast' is unknown (choose from"),
    ("cifar", CIFAR, ["--dist-timeout", "0"], {}, "argument --dist-timeout: 0 must be a finite number above 0"),
    ("cifar", CIFAR, ["--stall-timeout", "-1"], {}, "argument --stall-timeout: -1 must be a finite number >= 0"),
    ("cifar", CIFAR, ["--dist-url", "foo://x:1"], {}, "--dist-url foo://x:1 has an unknown scheme"),
    ("cifar", CIFAR, ["--dist-url", "tcp://host:notaport"], {}, "--dist-url tcp://host:notaport has no valid port"),
    ("cifar", CIFAR, ["--dist-url", "tcp://localhost:99999"], {}, "--dist-url tcp://localhost:99999 has no valid"),
    ("cifar", CIFAR, ["--dist-url", "tcp://:29500"], {}, "--dist-url tcp://:29500 names no host"),
    ("cifar", CIFAR, ["--dist-url", "file://{tmp}/no/rdzv", "--world-size", "2", "--rank", "1"], {},
     "names a file in {tmp}/no, which is not a directory"),  # torch's FileStore would wait for it forever
    ("cifar", CIFAR, ["--world-size", "0"], {}, "argument --world-size: 0 must be at least 1"),
    ("cifar", CIFAR, ["--rank", "-5"], {}, "argument --rank: -5 must be 0 or more"),
    ("cifar", CIFAR, ["--output-dir", "/proc/forbidden"], {}, "output dir /proc/forbidden is not writable"),
    ("cifar", CIFAR, ["--output-dir", "{text}"], {}, "is a file (give a directory)"),
    ("cifar", CIFAR, ["--output-dir", "{text}/run"], {}, "is under the file"),
    ("cifar", CIFAR, ["--output-dir", "{dirs}"], {}, "metrics.jsonl is not a file, and a run writes its metrics.jsonl"),
    ("cifar", CIFAR, ["--resume", "none"], {}, "--resume none would overwrite the run in"),
    ("cifar", CIFAR, ["--resume", "{tmp}/nope.pt"], {}, "nope.pt: no such file"),
    ("cifar", CIFAR, ["--resume", "{text}"], {}, NOT_CKPT),
    ("cifar", CIFAR, ["--resume", "{json}"], {}, NOT_CKPT),
    ("cifar", CIFAR, ["--resume", "{yaml}"], {}, NOT_CKPT),
    ("cifar", CIFAR, ["--resume", "{html}"], {}, NOT_CKPT),
    ("cifar", CIFAR, ["--resume", "{empty}"], {}, "is not a checkpoint (an empty file"),
    ("cifar", CIFAR, ["--resume", "{badstep}"], {}, "not a checkpoint of this collection: its 'step' entry is '3'"),
    ("cifar", CIFAR, ["--resume", "{negepoch}"], {}, "not a checkpoint of this collection: its 'epoch' entry is -1"),
    ("cifar", CIFAR, ["--output-dir", ""], {}, "--output-dir '' is empty (name a directory"),
    ("cifar", CIFAR, ["-a", "resnet32"], {}, "does not fit this model (another --arch, --preset or number of"),
    ("cifar", CIFAR, ["--evaluate", "--output-dir", "{tmp}/o"], {}, "--evaluate needs a checkpoint"),
    ("cifar", CIFAR, ["--max-steps", "6", "-p", "1", "--lr", "1e30"], {}, "at step 3: stopped before writing"),
    ("cifar", CIFAR, ["--wandb"], {}, "--wandb: not logged in to Weights & Biases (run `wandb login`"),
    ("cifar", CIFAR, ["--wandb"], {"WANDB_MODE": "OFFLINE"}, "WANDB_MODE='OFFLINE' is not a wandb mode (use one of"),
    ("cifar", CIFAR, ["--epochs", "x"], {}, "argument --epochs: invalid int value: 'x'"),
    ("cifar", CIFAR, ["--lr", "abc"], {}, "argument --lr: invalid float value: 'abc'"),
    ("cifar", CIFAR, ["--amp", "fp8"], {}, "argument --amp: invalid choice: 'fp8'"),
    ("cifar", CIFAR, [], {"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ("cifar", CIFAR, [], {"RANK": "0", "WORLD_SIZE": "y"}, "WORLD_SIZE='y' is not an integer"),
    ("cifar", CIFAR, [], {"RANK": "0", "WORLD_SIZE": "0"}, "world size 0 (from RANK/WORLD_SIZE) must be at least 1"),
    ("cifar", CIFAR, [], {"RANK": "5", "WORLD_SIZE": "2"}, "rank 5 (from RANK/WORLD_SIZE) is out of range for world"),
    ("cifar", CIFAR, [], {"RANK": "3", "WORLD_SIZE": "1"}, "rank 3 (from RANK/WORLD_SIZE) is out of range for world"),
    ("cifar", CIFAR, [], {"RANK": "-1", "WORLD_SIZE": "2"}, "rank -1 (from RANK/WORLD_SIZE) is out of range"),
    ("cifar", CIFAR, [], {"RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR is not set"),
    ("cifar", CIFAR, [], {"RANK": "1", **ENV1, "MASTER_PORT": ""}, "MASTER_PORT is not set"),
    ("cifar", CIFAR, [], {"RANK": "1", **ENV1, "MASTER_PORT": "abc"}, "MASTER_PORT 127.0.0.1:abc has no valid port"),
    ("cifar", CIFAR, [], {"RANK": "1", **ENV1, "MASTER_PORT": "99999"}, "127.0.0.1:99999 has no valid port"),
    ("cifar", CIFAR, [], {"RANK": "1", **ENV1, "MASTER_ADDR": "nosuch.invalid"},
     "cannot resolve host 'nosuch.invalid'"),
    ("cifar", CIFAR, [], {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "-1"}, "local rank -1 (LOCAL_RANK or"),
    ("cifar", CIFAR, [], {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "a"}, "LOCAL_RANK='a' is not an integer"),
    ("cifar", CIFAR, [], {"PMI_RANK": "0", "PMI_SIZE": "two"}, "PMI_SIZE='two' is not an integer"),
    ("cifar", CIFAR, [], {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "abc"},
     "SLURM_JOB_ID='abc' is not an integer"),
    ("cifar", CIFAR, ["--dist-url", "tcp://nosuch.invalid:29500", "--world-size", "2", "--rank", "1"], {},
     "rendezvous address tcp://nosuch.invalid:29500: cannot resolve host"),
    ("cifar", CIFAR, ["--dist-url", "tcp://127.0.0.1:29500", "--world-size", "2"], {}, "--dist-url needs --rank"),
    ("cifar", CIFAR, ["--dist-url", "tcp://127.0.0.1:29500", "--world-size", "2", "--rank", "0", "--dist-backend",
                      "glo", "--dist-timeout", "2"], {}, "--dist-backend glo is not a backend of this torch (use one"),
    ("cifar", CIFAR, ["--dist-url", "tcp://127.0.0.1:29500", "--world-size", "2", "--rank", "2"], {},
     "rank 2 (from --rank/--world-size) is out of range for world size 2"),
    ("cifar", ["--data-dir", "/nonexistent", "-j", "0"], [], {}, "no CIFAR-10 at /nonexistent"),
    ("cifar", ["--download", "--data-dir", "{tmp}/dl", "-j", "0"], [], {"https_proxy": "http://127.0.0.1:9",
     "HTTPS_PROXY": "http://127.0.0.1:9"}, "--download: cannot fetch CIFAR-10 into {tmp}/dl"),  # a proxy refusing
    ("cifar", ["--data-dir", "{cifar11}", "-j", "0"], [], {}, "train has 11 class folders but the model has 10"),
    ("cifar", ["--data-dir", "{cifar_corrupt}", "-j", "0"], [], {}, "unreadable image {cifar_corrupt}/train/class3/"),
    ("cifar", ["--data-dir", "{cifar_evil}", "-j", "0"], [], {}, "it names posix.system, which a CIFAR-10 batch"),
    ("cifar", ["--data-dir", "{cifar_text}", "-j", "0"], [], {}, "cannot read CIFAR-10 batch"),
    ("cifar", ["--data-dir", "{cifar_list}", "-j", "0"], [], {}, "data_batch_1 is not a CIFAR-10 batch"),
    ("cifar", ["--data-dir", "{cifar_label11}", "-j", "0"], [], {}, "data_batch_1 is not a CIFAR-10 batch"),
    ("cifar", ["--data-dir", "{cifar10}", "-j", "0", "-b", "16"], [], {}, "global batch 16 is larger than the 10 "),
    # ---- cifar: paths the OS refuses, bytes that are not UTF-8, odd ImageFolder trees
    ("cifar", CIFAR, ["--output-dir", "{long}/run"], {}, "cannot look up {long}/run: File name too long"),
    ("cifar", CIFAR, ["--resume", "{long}.pt"], {}, "cannot look up {long}.pt: File name too long"),
    ("cifar", ["--data-dir", "{long}", "-j", "0"], [], {}, "cannot look up {long}: File name too long"),
    ("cifar", CIFAR, ["--output-dir", "{loop}/run"], {}, "cannot look up {loop}/run: Too many levels of symbolic"),
    ("cifar", ["--data-dir", "{cifar_ff}", "-j", "0", "-b", "16"], [], {}, "global batch 16 is larger than the 10 "),
    ("cifar", ["--data-dir", "{cifar_loop}", "-j", "0"], [], {},
     "{cifar_loop}/train lists a folder twice, through a symlink into itself"),
    ("cifar", ["--data-dir", "{cifar_dangling}", "-j", "0"], [], {},
     "unreadable image {cifar_dangling}/train/class0/gone.jpg (not a regular file: a dangling symlink, a FIFO"),
    ("cifar", ["--data-dir", "{cifar_fifo}", "-j", "0"], [], {},
     "unreadable image {cifar_fifo}/train/class0/fifo.jpg (not a regular file"),  # opening it would block
    ("cifar", ["--data-dir", "{cifar_deep}", "-j", "0"], [], {}, "bad ImageFolder {cifar_deep}/train: maximum recurs"),
    ("cifar", ["--data-dir", "{cifar_file9}", "-j", "0"], [], {}, "train has 9 class folders but the model has 10"),
    # ---- imagenet
    ("imagenet", INET, ["--train-crop-size", "-5"], {}, "argument --train-crop-size: -5 must be at least 1"),
    ("imagenet", INET, ["--train-crop-size", "0"], {}, "argument --train-crop-size: 0 must be at least 1"),
    ("imagenet", INET, ["--val-crop-size", "0"], {}, "argument --val-crop-size: 0 must be at least 1"),
    ("imagenet", INET, ["--val-resize-size", "-1"], {}, "argument --val-resize-size: -1 must be at least 1"),
    ("imagenet", INET, ["--weights", "IMAGENET1K_V2"], {}, "--weights IMAGENET1K_V2 needs --pretrained"),
    ("imagenet", INET, ["--ema", "1.5"], {}, "argument --ema: 1.5 must be in [0, 1)"),
    ("imagenet", INET, ["--mixup-alpha", "-1"], {}, "argument --mixup-alpha: -1 must be a finite number >= 0"),
    ("imagenet", INET, ["--cutmix-alpha", "nan"], {}, "argument --cutmix-alpha: nan must be a finite number >= 0"),
    ("imagenet", INET, ["--lr-gamma", "0"], {}, "argument --lr-gamma: 0 must be a finite number above 0"),
    ("imagenet", INET, ["--lr-step-size", "0"], {}, "argument --lr-step-size: 0 must be at least 1"),
    ("imagenet", INET, ["--start-epoch", "5", "--epochs", "3"], {}, "--start-epoch 5 must be in 0..2"),
    ("imagenet", ["--dummy"], ["--dummy-sizes", "0", "5"], {}, "argument --dummy-sizes: 0 must be at least 1"),
    ("imagenet", INET, ["--nproc-per-node", "0"], {}, "argument --nproc-per-node: 0 must be at least 1"),
    ("imagenet", INET, ["--gpu", "-1"], {}, "argument --gpu: -1 must be 0 or more"),
    ("imagenet", INET, ["--momentum", "-1"], {}, "argument --momentum: -1 must be in [0, 1)"),
    ("imagenet", INET, ["--lr", "nan"], {}, "argument --lr/--learning-rate: nan must be a finite number above 0"),
    ("imagenet", INET, ["-p", "0"], {}, "argument -p/--print-freq: 0 must be at least 1"),
    ("imagenet", INET, ["--epochs", "0"], {}, "argument --epochs: 0 must be at least 1"),
    ("imagenet", INET, ["--label-smoothing", "1"], {}, "argument --label-smoothing: 1 must be in [0, 1)"),
    ("imagenet", INET, ["--resume", "{yaml}"], {}, NOT_CKPT),
    ("imagenet", INET, ["--resume", "none"], {}, "--resume none would overwrite the run in"),
    ("imagenet", INET, [], {"RANK": "5", "WORLD_SIZE": "2"}, "rank 5 (from RANK/WORLD_SIZE) is out of range"),
    ("imagenet", ["{text}"], [], {}, "is a file (give the folder that holds train/ and val/)"),
    ("imagenet", ["{inet_empty}"], [], {}, "has no train/ folder"),
    ("imagenet", ["{inet_flat}"], [], {}, "has no class folders (ImageNet's val/ ships flat"),
    ("imagenet", ["{inet_mixed}"], [], {}, "they must match; first difference: a"),
    ("imagenet", ["{tmp}/nope"], [], {}, "does not exist"),
    ("imagenet", [], [], {}, "DATA is required"),
    ("imagenet", ["{inet}", "--gpu", "0"], [], {}, "no CUDA GPU"),
    ("imagenet", ["{inet}", "--multiprocessing-distributed", "--world-size", "2"], [], {},
     "several nodes need --dist-url"),
    ("imagenet", ["{inet}", "-e", "--resume", "none", "--output-dir", "{tmp}/o"], [], {}, "-e needs weights"),
    ("imagenet", ["{inet}", "--compile-mode", "reduce-overhead"], [], {}, "reduce-overhead needs --compile"),
    ("imagenet", ["{inet}", "--resume", "nope.pt"], [], {}, "--resume nope.pt: no such file"),
    ("imagenet", ["--dummy", "--pretrained", "-a", "resnet18", "-e", "--output-dir", "{tmp}/o"], [],
     {"TORCH_HOME": "{tmp}/th"}, "--pretrained: cannot download"),  # no checkpoint there: -e evaluates the weights
    ("imagenet", ["{inet}", "-a", "resnet18"], [], {}, "global batch 256 is larger than the 37"),
    ("imagenet", ["{inet}", "-a", "resnet9000"], [], {},
     "argument -a/--arch: 'resnet9000' is not a torchvision classifier (did you mean"),
    ("imagenet", ["--dummy", "-a", "resnet18", "-b", "2", "-j", "0", "--output-dir", "{tmp}/o"],
     ["--train-crop-size", "10000000"], {}, "out of memory: can't allocate memory"),  # 2.4 PB: beyond any address space
    ("imagenet", ["{inet_bad}", *INET[1:], "--output-dir", "{tmp}/o"], [], {},
     "unreadable image {inet_bad}/train/class0/00002.jpg (not an image"),
    ("imagenet", ["{long}"], [], {}, "cannot look up {long}: File name too long"),
    ("imagenet", ["{inet_loop}", *INET[1:], "--max-steps", "1", "--output-dir", "{tmp}/o"], [], {},
     "{inet_loop}/train lists a folder twice, through a symlink into itself"),
    ("imagenet", ["{inet_fifo}", *INET[1:], "--output-dir", "{tmp}/o"], [], {},
     "unreadable image {inet_fifo}/train/class0/fifo.jpg (not a regular file"),  # opening it would block
    ("imagenet", ["{inet_deep}", *INET[1:], "--output-dir", "{tmp}/o"], [], {}, "/train: maximum recursion depth"),
    # ---- transformer
    ("transformer", TR, ["--heads", "3"], {}, "--heads 3 does not divide the width 64"),
    ("transformer", TR, ["--d-model", "0"], {}, "argument --d-model: 0 must be at least 1"),
    ("transformer", TR, ["--layers", "0"], {}, "argument --layers: 0 must be at least 1"),
    ("transformer", TR, ["--d-model", "4000000", "--heads", "1"], {}, "the model of 384040.40B parameters needs"),
    ("transformer", TR, ["--dropout", "1.5"], {}, "argument --dropout: 1.5 must be in [0, 1)"),
    ("transformer", TR, ["--max-len", "0"], {}, "argument --max-len: 0 must be in 1..1023"),
    ("transformer", TR, ["--max-len", "5000"], {}, "argument --max-len: 5000 must be in 1..1023"),
    ("transformer", TR, ["--max-tokens", "0"], {}, "argument --max-tokens: 0 must be at least 1"),
    ("transformer", TR, ["--pack-len", "0"], {}, "argument --pack-len: 0 must be at least 1"),
    ("transformer", TR, ["--beam", "0"], {}, "argument --beam: 0 must be at least 1"),
    ("transformer", TR, ["--vocab-size", "2"], {}, "argument --vocab-size: 2 must be in 8..16777216"),
    ("transformer", TR, ["--vocab-size", "1000000000"], {}, "argument --vocab-size: 1000000000 must be in 8..16777216"),
    ("transformer", TR, ["--warmup-epochs", "-1"], {}, "argument --warmup-epochs: -1 must be a finite number >= 0"),
    ("transformer", TR, ["--clip-grad", "-1"], {}, "argument --clip-grad: -1 must be a finite number >= 0"),
    ("transformer", TR, ["--lr", "-1"], {}, "argument --lr: -1 must be a finite number above 0"),
    ("transformer", TR, ["--label-smoothing", "2"], {}, "argument --label-smoothing: 2 must be in [0, 1)"),
    ("transformer", TR, ["-p", "0"], {}, "argument -p/--print-freq: 0 must be at least 1"),
    ("transformer", TR, ["--epochs", "0"], {}, "argument --epochs: 0 must be at least 1"),
    ("transformer", TR, ["--samples", "-1"], {}, "argument --samples: -1 must be 0 or more"),
    ("transformer", TR, ["--val-split", "-1"], {}, "argument --val-split: -1 must be 0 or more"),
    ("transformer", TR, ["--resume", "{html}"], {}, NOT_CKPT),
    ("transformer", TR, ["--resume", "none"], {}, "--resume none would overwrite the run in"),
    ("transformer", TR, ["--output-dir", "{tokdir}"], {}, "tokenizer.json is not a file, and a run writes its"),
    ("transformer", TR, ["--compile-mode", "reduce-overhead"], {}, "--compile-mode reduce-overhead needs --compile"),
    ("transformer", TR, ["--fsdp", "all"], {}, "argument --fsdp: invalid choice: 'all'"),
    ("transformer", TR, ["--fsdp", "--compile", "--compile-mode", "reduce-overhead"], {}, "slower than --compile"),
    ("transformer", TR, ["--fsdp", "--amp", "fp16"], {}, "--amp fp16 does not work with --fsdp (use --amp bf16)"),
    ("transformer", TR, ["--fsdp", "--keep-last", "2"], {}, "--keep-last 2 does not work with --fsdp"),
    ("transformer", TR, ["--fsdp", "--output-dir", "{tmp}/o"], {}, "--fsdp needs 2 or more processes"),
    ("transformer", TR, ["--dist-url", "127.0.0.1:29500"], {}, "--dist-url 127.0.0.1:29500 has an unknown scheme"),
    ("transformer", TR, [], {"RANK": "1", **ENV1, "MASTER_PORT": "0"}, "127.0.0.1:0 has no valid port"),
    ("transformer", ["--data", "{tmp}/nope", "-j", "0"], [], {}, "no such directory"),
    ("transformer", ["--data", "{corpus}", "--lang-src", "fr", "--lang-tgt", "en"], [], {}, "languages found: de, en"),
    ("transformer", ["--data", "{corpus_latin1}", "--lang-src", "de", "--lang-tgt", "en"], [], {},
     "train.de: not UTF-8 (invalid start byte at byte 2) (convert it, e.g. iconv"),
    ("transformer", ["--data", "{corpus_badgz}", "--lang-src", "de", "--lang-tgt", "en"], [], {},
     "train.de.gz: Not a gzipped file"),
    ("transformer", ["--data", "{corpus_utf16}", "--lang-src", "de", "--lang-tgt", "en"], [], {},
     "train.de: not UTF-8 (invalid start byte at byte 0) (convert it, e.g. iconv -f utf-16 -t utf-8"),
    ("transformer", ["--data", "{corpus_short}", "--lang-src", "de", "--lang-tgt", "en"], [], {},
     "train.en has 37: not line-aligned (line i of one must be the translation of line i of the other)"),
    ("transformer", ["--data", "{corpus_dirde}", "--lang-src", "de", "--lang-tgt", "en"], [], {},
     "no train.de and train.en (optionally .gz) in {corpus_dirde} (languages found: en; set --lang-src"),
    ("transformer", ["--data", "{saved_bad}", "--lang-src", "de", "--lang-tgt", "en"], [], {},
     "save_to_disk wrote, or a directory of text files)"),  # after the datasets package's own words
    ("transformer", ["--data", "{corpus_empty}", "--lang-src", "de", "--lang-tgt", "en"], [], {},
     "every training pair has an empty side"),
    ("transformer", ["--data", "{long}", "-j", "0"], [], {}, "cannot look up {long}: File name too long"),
    ("transformer", ["--data", "{corpus_ffname}", "--lang-src", "de", "--lang-tgt", "en"], [], {},
     "languages found: en, \\udcff;"),  # a file name of other bytes, printed as Python prints it on stderr
    ("transformer", ["--data", "{corpus_fifo}", "--lang-src", "de", "--lang-tgt", "en"], [], {},
     "no train.de and train.en (optionally .gz) in {corpus_fifo} (languages found: en;"),  # a FIFO is no file
    # ---- translate
    ("translate", ["--checkpoint", "{text}", "hallo"], [], {}, NOT_CKPT),
    ("translate", ["--checkpoint", "{json}", "hallo"], [], {}, NOT_CKPT),
    ("translate", ["--checkpoint", "{yaml}", "hallo"], [], {}, NOT_CKPT),
    ("translate", ["--checkpoint", "{html}", "hallo"], [], {}, NOT_CKPT),
    ("translate", ["--checkpoint", "{empty}", "hallo"], [], {}, "is not a checkpoint (an empty file"),
    ("translate", ["--checkpoint", "{tmp}/nope.pt", "hallo"], [], {}, "cannot read checkpoint {tmp}/nope.pt: No such"),
    ("translate", ["--checkpoint", "{good}/last.pt", "hallo"], [], {}, "is not a transformer/train.py checkpoint"),
    ("translate", ["--checkpoint", "{tr_tok}", "hallo"], [], {}, "holds no usable tokenizer: expected ident at line 1"),
    ("translate", ["--checkpoint", "{tr_cfg}", "hallo"], [], {}, "holds no usable model config: d_model must be a"),
    ("translate", ["--checkpoint", "x.pt", "--output", "{tmp}", "hallo"], [], {}, "is a directory (name a file"),
    ("translate", ["--checkpoint", "x.pt", "--output", "{text}/out.txt", "hallo"], [], {}, "is under the file"),
    ("translate", ["--checkpoint", "x.pt", "--output", "/proc/o.txt", "hi"], [], {}, "cannot write in /proc (No such"),
    ("translate", ["--checkpoint", "x.pt", "--device", "tpu9", "hallo"], [], {}, "--device tpu9 is not a device"),
    ("translate", ["--checkpoint", "x.pt", "--device", "cuda", "hallo"], [], {}, "but 0 CUDA GPU(s) are visible"),
    ("translate", ["--checkpoint", "x.pt", "--device", "cuda:3", "hallo"], [], {}, "--device cuda:3 but 0 CUDA"),
    ("translate", ["--checkpoint", "x.pt", "--device", "meta", "hallo"], [], {}, "--device meta is not supported"),
    ("translate", ["--checkpoint", "x.pt", "--beam", "0", "hallo"], [], {}, "argument --beam: 0 must be at least 1"),
    ("translate", ["--checkpoint", "x.pt", "--max-tokens", "-1", "hi"], [], {}, "--max-tokens: -1 must be at least 1"),
    ("translate", ["--checkpoint", "x.pt", "--input", "{text}", "hallo"], [], {}, "not both"),
    ("translate", ["--checkpoint", "x.pt", "--beam", "x"], [], {}, "argument --beam: invalid int value: 'x'"),
    ("translate", ["--checkpoint", "x.pt", "--output", "{long}", "hallo"], [], {}, "cannot look up {long}: File name"),
    ("translate", ["--checkpoint", "x.pt", "ok", "Gr\udcfc\udcdfe"], [], {},
     "sentence 2 (b'Gr\\xfc\\xdfe') is not UTF-8 (convert it"),  # bytes of another encoding on the command line
    ("translate", ["--checkpoint", "{tr_ok}", "--output", "{devfull}", "hallo"], [], {},
     "cannot write the translations to {devfull}: No space left on device"),  # a device: written, not replaced
    ("translate", ["hallo"], [], {}, "the following arguments are required: --checkpoint"),
    # ---- doctor
    ("doctor", DOCTOR, ["--size-mb", "0"], {}, "argument --size-mb: 0 must be a finite number above 0"),
    ("doctor", DOCTOR, ["--size-mb", "nan"], {}, "argument --size-mb: nan must be a finite number above 0"),
    ("doctor", DOCTOR, ["--iters", "0"], {}, "argument --iters: 0 must be at least 1"),
    ("doctor", DOCTOR, ["--warmup", "-1"], {}, "argument --warmup: -1 must be 0 or more"),
    ("doctor", DOCTOR, ["--dist-timeout", "-5"], {}, "argument --dist-timeout: -5 must be a finite number above 0"),
    ("doctor", DOCTOR, ["--dist-url", "foo://bar"], {}, "--dist-url foo://bar has an unknown scheme"),
    ("doctor", DOCTOR, ["--size-mb", "x"], {}, "argument --size-mb: invalid float value: 'x'"),
    ("doctor", DOCTOR, [], {"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ("doctor", DOCTOR, [], {"RANK": "5", "WORLD_SIZE": "2"}, "rank 5 (from RANK/WORLD_SIZE) is out of range"),
    ("doctor", DOCTOR, [], {"RANK": "0", "WORLD_SIZE": "0"}, "world size 0 (from RANK/WORLD_SIZE) must be at least"),
    ("doctor", DOCTOR, [], {"RANK": "0", **ENV1, "MASTER_PORT": "99999"}, "127.0.0.1:99999 has no valid port"),
    ("doctor", DOCTOR, [], {"RANK": "1", **ENV1, "MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
]

# Cases that need a process of their own, one parallel batch: (script, base args, extra args, environment, what the
# error line holds, how the process runs): under a file size limit (bash's ulimit -f, KiB: Python ignores SIGXFSZ, so
# a write fails with EFBIG); on a filesystem of its own at {mnt} (a tmpfs, read-only or small, in a user and mount
# namespace of its own); under permission bits that bind root too (in a user namespace that maps no user, root is the
# files' owner, not the superuser); with stdout or stderr that cannot be written; with stdin in latin-1; signalled
# once it holds its output dir, while it starts (after the interpreter's imports, before training). Where the system
# has no user namespaces, those cases skip.
TR_OK = ["--checkpoint", "{tr_ok}"]
REAL = [
    ("translate", TR_OK, ["hallo"], {}, "cannot write the translations to stdout: No space left on device",
     "stdout /dev/full"),
    ("translate", TR_OK, ["hallo"], {}, "cannot write the translations to stdout: Broken pipe", "stdout closed pipe"),
    ("translate", TR_OK, [], {}, "cannot read /dev/stdin: not UTF-8 (invalid start byte at byte 2) (convert it, e.g. "
     "iconv -f latin1 -t utf-8)", "stdin latin-1"),  # in the pipe: no file to name
    ("translate", TR_OK, ["hallo"], {}, "stdout is closed, and the translations go there", "stdout closed"),
    ("translate", TR_OK, ["--input", "{blank}", "--output", "{tmp}/o.txt"], {},
     "cannot write the translations to {tmp}/o.txt: File too large", "ulimit -f 1"),
    ("translate", TR_OK, ["--output", "{mnt}/o.txt", "hallo"], {}, "cannot write in {mnt} (Read-only file system",
     "tmpfs ro"),
    ("translate", ["--checkpoint", "{noread}", "hallo"], [], {}, "cannot read checkpoint {noread}: Permission denied",
     "unshare -U"),
    ("translate", TR_OK, ["--output", "{nowrite}/o.txt", "hallo"], {}, "cannot write in {nowrite} (Permission denied",
     "unshare -U"),
    ("cifar", CIFAR, ["--output-dir", "{tmp}/int"], {}, "stopped by SIGINT before the first step; nothing to save",
     "SIGINT at start"),  # Ctrl-C, as a preemption
]
# A write that fails once the run is under way (a checkpoint, a log line) or the error line's own: one line and exit 2.
# Under the file-size limit (a checkpoint over it: EFBIG) and with stdout on /dev/full, the run resumes a copy of
# {good} (RESUMED): its last.pt stays as it was, and no temporary file is left.
RESUMED = ("fsize", "full")
MID_RUN = [
    ("cifar", CIFAR, ["--max-steps", "3", "--output-dir", "{tmp}/fsize"], {}, "a write", "ulimit -f 200"),
    ("cifar", CIFAR, ["--max-steps", "1", "--output-dir", "{mnt}/o"], {}, "", "tmpfs size=300k"),
    ("cifar", CIFAR, ["--max-steps", "3", "--output-dir", "{tmp}/full"], {}, "a write", "stdout /dev/full"),
    ("translate", ["--checkpoint", "{text}", "hallo"], [], {}, "", "stderr /dev/full"),  # only the exit code tells
]
# fmt: on


def case_id(i: int, case) -> str:
    script, _, extra, env, want = case[:5]
    return f"{i:03d}-{script}:{' '.join(extra) or ' '.join(f'{k}={v}' for k, v in env.items()) or want[:30]}"


def sha(path: Path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> Iterator[dict[str, Path]]:
    """A finished cifar run ({good}), files that are not checkpoints, broken datasets of each kind."""
    root = tmp_path_factory.mktemp("bad")
    p = {"good": root / "good", "evil_marker": root / "evil_ran"}
    entry(["cifar_resnet/train.py", *CIFAR, "--max-steps", "1", "--output-dir", str(p["good"])], {})
    for name, text in (("text", "hello\n"), ("json", '{"model": 1}'), ("yaml", "model: 1\n"),
                       ("html", "<html><body>404</body></html>"), ("empty", "")):  # fmt: skip
        p[name] = root / f"file.{name}"
        p[name].write_text(text)
    p["badstep"] = root / "badstep.pt"  # loads with weights_only, but its step is text
    torch.save({**torch.load(p["good"] / "last.pt", weights_only=True), "step": "3"}, p["badstep"])
    p["negepoch"] = root / "negepoch.pt"  # a position no run reaches
    torch.save({**torch.load(p["good"] / "last.pt", weights_only=True), "epoch": -1}, p["negepoch"])
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).to_str()
    for name, tokenizer, config in (("tr_tok", "not json", {}), ("tr_cfg", tok, {"vocab_size": 8, "d_model": 6})):
        p[name] = root / f"{name}.pt"  # a transformer checkpoint whose tokenizer or model config cannot be used
        torch.save({"model": {}, "tokenizer": tokenizer, "model_config": config}, p[name])
    p["saved_bad"] = root / "saved_bad"  # a save_to_disk directory in name only
    p["saved_bad"].mkdir()
    (p["saved_bad"] / "state.json").write_text("{not json")
    p["dirs"] = root / "dirs"  # a directory where a run writes its file
    (p["dirs"] / "metrics.jsonl").mkdir(parents=True)
    p["tokdir"] = root / "tokdir"  # a directory where the transformer writes tokenizer.json
    (p["tokdir"] / "tokenizer.json").mkdir(parents=True)
    p["cifar11"] = make_jpeg_imagefolder(root / "cifar11", {"train": 11, "test": 11}, classes=11)
    p["cifar10"] = make_cifar_pickles(root / "cifar10", n_train=10, n_test=5)
    p["cifar_corrupt"] = make_jpeg_imagefolder(root / "cifar_corrupt", {"train": 10, "test": 10}, classes=10)
    (p["cifar_corrupt"] / "train" / "class3" / "00003.jpg").write_bytes(b"not a jpeg")
    label11 = {"data": np.zeros((2, 3072), np.uint8), "labels": [0, 11]}
    for name, content in (("evil", pickle.dumps(Evil(p["evil_marker"]))), ("text", b"batch 1\n"),
                          ("list", pickle.dumps([1, 2, 3])), ("label11", pickle.dumps(label11))):  # fmt: skip
        p[f"cifar_{name}"] = make_cifar_pickles(root / f"cifar_{name}", n_train=10, n_test=5)
        (p[f"cifar_{name}"] / "cifar-10-batches-py" / "data_batch_1").write_bytes(content)
    p["inet"] = make_jpeg_imagefolder(root / "inet", {"train": 37, "val": 6}, classes=6, size=41)
    p["inet_empty"], p["inet_flat"], p["inet_mixed"] = root / "inet_empty", root / "inet_flat", root / "inet_mixed"
    p["inet_empty"].mkdir()
    (p["inet_flat"] / "train" / "n01440764").mkdir(parents=True)
    (p["inet_flat"] / "val").mkdir()
    (p["inet_flat"] / "val" / "ILSVRC2012_val_00000001.JPEG").write_bytes(b"")
    (p["inet_mixed"] / "train" / "a").mkdir(parents=True)
    (p["inet_mixed"] / "val" / "b").mkdir(parents=True)
    p["inet_bad"] = make_jpeg_imagefolder(root / "inet_bad", {"train": 8, "val": 5}, classes=2, size=35)
    (p["inet_bad"] / "train" / "class0" / "00002.jpg").write_bytes(b"GIF89a, or not")
    odd_trees(p, root)
    from text import synthetic_corpus

    pairs = synthetic_corpus(0, (40, 0, 0))["train"]
    for name, de, en in (("corpus", pairs[0], pairs[1]), ("corpus_latin1", ["Gr\xfc\xdfe"] * 40, pairs[1]),
                         ("corpus_empty", [""] * 40, pairs[1]), ("corpus_badgz", None, pairs[1]),
                         ("corpus_utf16", pairs[0], pairs[1]), ("corpus_short", pairs[0], pairs[1][:-3]),
                         ("corpus_dirde", None, pairs[1])):  # fmt: skip
        d = p[name] = root / name
        d.mkdir()
        (d / "train.en").write_text("\n".join(en) + "\n")
        if name == "corpus_badgz":
            (d / "train.de.gz").write_bytes(b"not gzip at all")
        elif name == "corpus_dirde":
            (d / "train.de").mkdir()
        else:
            enc = {"corpus_latin1": "latin1", "corpus_utf16": "utf-16"}.get(name, "utf-8")
            (d / "train.de").write_bytes(("\n".join(de) + "\n").encode(enc))
    for name in ("corpus_ffname", "corpus_fifo"):  # train.<bytes that are not UTF-8>; a FIFO as train.de
        p[name] = root / name
        p[name].mkdir()
        (p[name] / "train.en").write_text("\n".join(pairs[1]) + "\n")
    (p["corpus_ffname"] / "train.\udcff").write_text("\n".join(pairs[0]) + "\n")
    os.mkfifo(p["corpus_fifo"] / "train.de")
    p["tr_ok"] = root / "tr_ok.pt"  # a transformer checkpoint translate.py can use: a tiny model, a word-level vocab
    from dataclasses import asdict

    from seq2seq import ModelConfig, Transformer

    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<s>", "</s>", "hallo", "welt"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).to_str()
    cfg = ModelConfig(8, d_model=8, n_heads=2, enc_layers=1, dec_layers=1, d_ff=16, dropout=0.0, max_positions=16)
    torch.save({"model": Transformer(cfg).state_dict(), "tokenizer": tok, "model_config": asdict(cfg)}, p["tr_ok"])
    yield p
    subprocess.run(["rm", "-rf", *(str(p[k]) for k in ("cifar_deep", "inet_deep"))])  # beyond shutil's recursion


def odd_trees(p: dict[str, Path], root: Path) -> None:
    """Paths the OS refuses (a name over NAME_MAX, a symlink loop), a run dir whose metrics.jsonl is not UTF-8, a
    CIFAR ImageFolder at a path of other bytes, and ImageFolders with a symlink back into themselves, a dangling
    symlink, a FIFO, folders nested beyond Python's recursion limit, a class folder that is a file."""
    p["long"], p["loop"], p["devfull"] = root / ("x" * 256), root / "loop_a", root / "devfull"
    os.symlink("loop_b", p["loop"])
    os.symlink("loop_a", root / "loop_b")
    os.symlink("/dev/full", p["devfull"])
    p["cifar_ff"] = make_jpeg_imagefolder(root / "cifar_\udcff", {"train": 10, "test": 10}, classes=10)
    for name in ("loop", "dangling", "fifo", "deep", "file9"):
        p[f"cifar_{name}"] = make_jpeg_imagefolder(root / f"cifar_{name}", {"train": 10, "test": 10}, classes=10)
    for name in ("loop", "fifo", "deep"):
        p[f"inet_{name}"] = make_jpeg_imagefolder(root / f"inet_{name}", {"train": 8, "val": 4}, classes=2, size=35)
    for tree in (p["cifar_loop"], p["inet_loop"]):
        os.symlink("..", tree / "train" / "class0" / "loop")
    os.symlink("missing.jpg", p["cifar_dangling"] / "train" / "class0" / "gone.jpg")
    for tree in (p["cifar_fifo"], p["inet_fifo"]):
        os.mkfifo(tree / "train" / "class0" / "fifo.jpg")
    for tree in (p["cifar_deep"], p["inet_deep"]):
        fd = os.open(tree / "train" / "class0", os.O_RDONLY)
        for _ in range(1100):  # os.makedirs itself recurses
            os.mkdir("d", dir_fd=fd)
            fd, parent = os.open("d", os.O_RDONLY, dir_fd=fd), fd
            os.close(parent)
        os.close(fd)
    for split in ("train", "test"):
        shutil.rmtree(p["cifar_file9"] / split / "class9")
        (p["cifar_file9"] / split / "class9").write_text("a file where a class folder was")


def entry(argv: list[str], env: dict[str, str], timeout: int = 60) -> None:
    """``python SCRIPT ARGV`` as __main__ runs it, in this process, with ``env`` set and the launcher's unset;
    a run past ``timeout`` seconds is a hang."""
    script = {"cifar_resnet/train.py": "cifar", "imagenet/train.py": "imagenet", "transformer/train.py": "transformer",
              "transformer/translate.py": "translate", "scripts/doctor.py": "doctor"}[argv[0]]  # fmt: skip
    name, main = ENTRY[script]
    mod = importlib.import_module(name)
    saved_env, saved_argv = dict(os.environ), sys.argv
    for k in LAUNCH_VARS:
        os.environ.pop(k, None)
    os.environ.update(env)
    sys.argv = argv
    sys.stderr.reconfigure(errors="backslashreplace")  # as Python's own stderr: a byte that is not UTF-8 as \udcff

    def hang(*_):
        raise TimeoutError(f"{' '.join(argv)} ran past {timeout}s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(timeout)
    try:
        mod.run_cli(main(mod))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv


SCRIPT_PATH = {"cifar": "cifar_resnet/train.py", "imagenet": "imagenet/train.py", "transformer": "transformer/train.py",
               "translate": "transformer/translate.py", "doctor": "scripts/doctor.py"}  # fmt: skip


def one_error_line(code, err: str, want: str) -> str:
    """Exit 2 and one error line holding ``want``; nothing else on stderr but argparse's usage lines."""
    lines = [ln for ln in err.splitlines() if ERROR_LINE.match(ln)]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err[-3000:])
    assert want in lines[0], (want, lines[0])
    assert lines[0].startswith("error: ") == (err.strip() == lines[0]), err[-3000:]
    return lines[0]


@pytest.mark.parametrize("case", CASES, ids=[case_id(i, c) for i, c in enumerate(CASES)])
def test_bad_input_is_one_error_line(case, paths, tmp_path, capsys):
    script, base, extra, env, want = case
    fill = lambda s: s.format(**paths, tmp=tmp_path)  # noqa: E731
    argv = [fill(a) for a in [*base, *extra]]
    if script in ("cifar", "imagenet", "transformer") and "--output-dir" not in argv:
        argv += ["--output-dir", str(paths["good"])]
    good = sha(paths["good"] / "last.pt")
    timers = lambda: {t for t in threading.enumerate() if isinstance(t, threading.Timer)}  # noqa: E731
    before = timers()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        entry([SCRIPT_PATH[script], *argv], {k: fill(v) for k, v in env.items()})
    one_error_line(e.value.code, capsys.readouterr().err, fill(want))
    assert timers() <= before, "a timer left running, such as a watchdog that would end this process later"
    assert sha(paths["good"] / "last.pt") == good  # not rewritten, not even touched
    assert not paths["evil_marker"].exists()  # no pickle ran code


def test_suspicious_data_warns_and_trains(paths, tmp_path, capsys):
    """Warnings, once, and the run goes on: a CIFAR set and an ImageFolder of one class; a corpus with empty pairs
    and a 2 MB line without spaces (dropped, and counted, before the tokenizer trains: BPE would take minutes over
    it, in native code that only a process's time limit stops)."""
    corpus = tmp_path / "c"
    corpus.mkdir()
    from text import synthetic_corpus

    de, en = synthetic_corpus(0, (60, 0, 0))["train"]
    de[5], en[7], de[9] = "", "", "x" * 2_000_000
    (corpus / "train.de").write_text("\n".join(de) + "\n")
    (corpus / "train.en").write_text("\n".join(en) + "\n")
    cmd = [PY, "transformer/train.py", "--data", str(corpus), "--lang-src", "de", "--lang-tgt", "en", "--preset",
           "tiny", "--layers", "1", "--vocab-size", "300", "--max-steps", "1", "--eval-every", "0", "-j", "0",
           "--output-dir", str(tmp_path / "o2")]  # fmt: skip
    env = {**{k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        one = make_cifar_pickles(tmp_path / "one", n_train=10, n_test=5)
        for f in (one / "cifar-10-batches-py").glob("*_batch*"):
            d = pickle.loads(f.read_bytes())
            f.write_bytes(pickle.dumps({**d, "labels": [0] * len(d["labels"])}))
        entry(["cifar_resnet/train.py", "--data-dir", str(one), "-a", "resnet20", "-b", "4", "-j", "0",
               "--max-steps", "1", "--eval-every", "0", "--output-dir", str(tmp_path / "o1")], {})  # fmt: skip
        out, err = capsys.readouterr()
        assert err.count("warning:") == 1 and "has label 0: one class trains to a loss of 0" in err, err
        assert "done: step 1, wall" in out and "best" not in out, out  # --eval-every 0: no best to name
        inet = make_jpeg_imagefolder(tmp_path / "inet1", {"train": 4, "val": 2}, classes=1, size=35)
        entry(["imagenet/train.py", str(inet), *INET[1:], "-b", "2", "--max-steps", "1", "--eval-every", "0",
               "--output-dir", str(tmp_path / "o0")], {})  # fmt: skip
        out, err = capsys.readouterr()
        assert err.count("warning:") == 1 and "holds one class: it trains to a loss of 0" in err, err
        assert "done: step 1, wall" in out and "best" not in out, out
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.count("dropped 1 training pairs over 4096 characters") == 1, out + err
    assert "done: step 1, wall" in out and "best" not in out, out
    assert err.count("warning:") == 1 and "2 of " in err and "pairs have an empty side" in err, err
    assert all((tmp_path / o / "last.pt").exists() for o in ("o0", "o1", "o2"))


def test_bad_launch_in_real_processes(paths, tmp_path):
    """What needs real processes, in one parallel batch: a rendezvous that times out (one line, no C++ frames), an
    address that does not resolve (one line at once, not after --dist-timeout), a bad RANK under the doctor, an
    argparse error from the command line, the Hub offline."""
    port = free_port()
    cifar = [PY, "cifar_resnet/train.py", *CIFAR, "--output-dir", str(tmp_path / "o")]
    cases = [
        (
            [*cifar, "--dist-timeout", "3"],
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
            "failed after 3s",
        ),  # fmt: skip
        (
            [*cifar, "--dist-url", "tcp://nosuch.invalid:29500", "--world-size", "2", "--rank", "1"],
            {},
            "cannot resolve host 'nosuch.invalid'",
        ),
        (  # a rank other than 0 whose master never answers under env://: one line, no C++ frames before it
            [*cifar, "--dist-timeout", "3"],
            {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
            "failed after 3s",
        ),
        ([PY, "scripts/doctor.py"], {"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ([*cifar, "--epochs", "x"], {}, "argument --epochs: invalid int value: 'x'"),
        (
            [PY, "transformer/train.py", "--data", "opus_books", "--output-dir", str(tmp_path / "t")],
            {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
            "HF_DATASETS_OFFLINE",
        ),
    ]
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    t0 = time.time()
    procs = [subprocess.Popen(cmd, cwd=REPO, env={**base, "OMP_NUM_THREADS": "1", **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for cmd, env, _ in cases]  # fmt: skip
    for p, (_, _, want) in zip(procs, cases):
        _, err = p.communicate(timeout=300)
        one_error_line(p.returncode, err, want)
    # the unresolvable address fails at once, not after --dist-timeout's 600 s (these processes start together, so
    # on 2 loaded cores their imports alone can take a minute)
    assert time.time() - t0 < 300


@pytest.fixture(scope="module")
def real_runs(paths, tmp_path_factory) -> list[tuple[int, str, str, str, tuple | None] | str]:
    """Every case of REAL and MID_RUN at once, each in its process: (exit code, stdout, stderr, what the error line
    holds, and for a RESUMED run: its last.pt's hash before and after, the temporary files left), or why it skips."""
    tmp = tmp_path_factory.mktemp("real")
    before = {}
    for name in RESUMED:
        shutil.copytree(paths["good"], tmp / name)
        before[tmp / name] = sha(tmp / name / "last.pt")
    (tmp / "blank.txt").write_text("\n" * 2000)  # 2000 empty lines, translated to 2000 empty lines: 2 KB to write
    shutil.copy(paths["tr_ok"], tmp / "noread.pt")
    (tmp / "noread.pt").chmod(0)
    (tmp / "nowrite").mkdir(mode=0o555)
    names = {**paths, "tmp": tmp, "blank": tmp / "blank.txt", "noread": tmp / "noread.pt", "nowrite": tmp / "nowrite"}
    (tmp / "probe").mkdir()
    ns = {"unshare -U": ["unshare", "-U", "true"], "tmpfs": ["unshare", "-rm", "mount", "-t", "tmpfs", "none",
                                                             str(tmp / "probe")]}  # fmt: skip
    ns = {how: bool(shutil.which("unshare")) and subprocess.run(cmd).returncode == 0 for how, cmd in ns.items()}
    env = {**{k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}, "OMP_NUM_THREADS": "1"}
    runs, threads = [], []
    for i, (script, base, extra, case_env, want, how) in enumerate([*REAL, *MID_RUN]):
        (tmp / f"mnt{i}").mkdir()
        fill = functools.partial(str.format, **names, mnt=tmp / f"mnt{i}")
        argv = [fill(a) for a in [*base, *extra]]
        cmd, io = [PY, SCRIPT_PATH[script], *argv], {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        if not ns.get(how.split()[0] if how.startswith("tmpfs") else how, True):
            runs.append(f"no user namespaces here for {how}")
            continue
        if how.startswith("ulimit"):
            cmd = ["bash", "-c", f'{how} && exec "$@"', "bash", *cmd]
        elif how.startswith("tmpfs"):
            mount = f'mount -t tmpfs -o {how.split()[1]} none "$0" && exec "$@"'
            cmd = ["unshare", "-rm", "sh", "-c", mount, str(tmp / f"mnt{i}"), *cmd]
        elif how == "unshare -U":
            cmd = ["unshare", "-U", *cmd]
        elif how == "stdout closed":
            cmd = ["bash", "-c", 'exec "$@" >&-', "bash", *cmd]
        elif how.endswith("/dev/full"):
            io[how.split()[0]] = open("/dev/full", "wb")
        elif how == "stdout closed pipe":
            read, io["stdout"] = os.pipe()
            os.close(read)
        proc = subprocess.Popen(cmd, cwd=REPO, env={**env, **case_env}, stdin=subprocess.PIPE, **io)
        if how == "stdout closed pipe":
            os.close(io["stdout"])
        elif how.endswith("/dev/full"):
            io[how.split()[0]].close()
        if how.startswith("SIG"):
            out = Path(argv[argv.index("--output-dir") + 1])
            threads.append(threading.Thread(target=signal_once_started, args=(proc, out, how.split()[0])))
            threads[-1].start()
        resumed = Path(argv[-1]) if Path(argv[-1]) in before else None
        runs.append((proc, b"Gr\xfc\xdfe\n" if how == "stdin latin-1" else b"", fill(want), resumed))
    results = []
    for run in runs:
        if isinstance(run, str):
            results.append(run)
            continue
        proc, stdin, want, resumed = run
        try:
            out, err = ((b or b"").decode(errors="replace") for b in proc.communicate(stdin, timeout=240))
        finally:
            proc.kill()
        kept = resumed and (before[resumed], sha(resumed / "last.pt"), list(resumed.glob(".*.tmp")))
        results.append((proc.returncode, out, err, want, kept))
    for t in threads:
        t.join()
    return results


def signal_once_started(proc: subprocess.Popen, out: Path, name: str) -> None:
    """``name`` (SIGINT, SIGTERM) to ``proc`` once it holds ``out``'s lock: its imports done, training not begun."""
    while not (out / ".lock").exists() and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(getattr(signal, name))


REAL_IDS = [f"{case_id(i, c)}-{c[5]}" for i, c in enumerate([*REAL, *MID_RUN])]


@pytest.mark.parametrize("i", range(len(REAL) + len(MID_RUN)), ids=REAL_IDS)
def test_bad_output_limits_and_signals_in_real_processes(i, real_runs):
    """Each ends with one line and no traceback: exit 2 and its error line; Ctrl-C at start-up, the preemption's
    stop line and exit 75; with stderr unwritable, a failing exit status alone. A checkpoint over the file-size limit
    (the write fails with EFBIG) or stdout on /dev/full, in a resumed run: last.pt as it was, no temporary file left.
    (SIGTERM while a run starts: test_fault.py's test_preemption_at_any_moment_of_start_up.)"""
    if isinstance(real_runs[i], str):
        pytest.skip(real_runs[i])
    code, out, err, want, kept = real_runs[i]
    how = [*REAL, *MID_RUN][i][5]
    if how == "stderr /dev/full":  # no line can tell: the exit status alone, and no output
        assert code not in (0, -signal.SIGKILL) and not out, (code, out)
    elif how == "SIGINT at start":
        assert code == 75 and want in out and "Traceback" not in err, (code, out, err)
    else:
        one_error_line(code, err, want)
    if kept is not None:
        reason = "File too large (over the file-size limit" if how.startswith("ulimit") else "No space left on device"
        before, after, left = kept
        assert reason in err and after == before and not left, (err[-3000:], left)


def test_the_table_covers_every_entry_point():
    assert len(CASES) >= 100 and {c[0] for c in CASES} == set(ENTRY)


def test_a_resume_keeps_the_metrics_lines_byte_for_byte(tmp_path):
    """metrics.jsonl lines of any bytes (a note in latin-1, say): a resume keeps the first ``log_lines`` as they are."""
    from common.checkpoint import Position
    from common.distributed import DistInfo
    from common.metrics import MetricsLogger

    (tmp_path / "metrics.jsonl").write_bytes(b'{"note": "\xe9t\xe9"}\n{"step": 1}\r\n{"step": 2}\n')
    MetricsLogger(tmp_path, DistInfo(), Position(log_lines=2), keep=2)
    assert (tmp_path / "metrics.jsonl").read_bytes() == b'{"note": "\xe9t\xe9"}\n{"step": 1}\r\n'
