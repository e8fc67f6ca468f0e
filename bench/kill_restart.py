"""Measure what an elastic restart costs: SIGKILL one worker under torchrun --max-restarts=1 and time
kill -> first training step after the restart; also time one ResNet-50 checkpoint save.

    python bench/kill_restart.py --nproc 2 --out /tmp/kr      # ResNet-50 --dummy, NCCL on 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from common.checkpoint import save_checkpoint  # noqa: E402


def worker_pid(root: int, rank: int) -> int:
    """The train.py process under ``root`` whose environment says RANK=rank."""
    for d in Path("/proc").iterdir():
        try:
            if b"train.py" not in (d / "cmdline").read_bytes():
                continue
            if f"RANK={rank}".encode() not in (d / "environ").read_bytes().split(b"\0"):
                continue
            p = int(d.name)
            while p > 1:  # walk up the parents to the torchrun agent
                p = int((Path("/proc") / str(p) / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if p == root:
                    return int(d.name)
        except (OSError, ValueError, IndexError):
            continue
    raise RuntimeError(f"no rank {rank} worker under {root}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default="/tmp/kill_restart")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("-b", type=int, default=128)
    p.add_argument("--extra", default="", help="more train.py flags, e.g. '--train-crop-size 64' on CPU")
    args = p.parse_args()
    out = Path(args.out)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        "--max-restarts=1",
        "imagenet/train.py",
        "--dummy",
        "-a",
        args.arch,
        "-b",
        str(args.b),
        "--amp",
        "bf16",
        "--max-steps",
        "60",
        "--save-every-steps",
        "20",
        "-p",
        "1",
        "--output-dir",
        str(out),
        "--resume",
        "auto",
        *args.extra.split(),
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while not (out / "last.pt").exists():
        time.sleep(0.2)
    time.sleep(1.0)  # let it run a few steps past the checkpoint
    # torchrun's agent pid is in every worker's environment; the agent is the Popen child itself
    pid = worker_pid(proc.pid, 1)
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    log, _ = proc.communicate()
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in recs if r["split"] == "train"]
    before = [r for r in train if r["time"] <= t_kill]
    after = [r for r in train if r["time"] > t_kill]
    ckpt = torch.load(out / "last.pt", weights_only=True)
    t0 = time.perf_counter()
    save_checkpoint(ckpt, out / "timing.pt")
    save_s = time.perf_counter() - t0
    result = {
        "cmd": " ".join(cmd).replace(sys.executable, "python3"),
        "returncode": proc.returncode,
        "last_step_before_kill": before[-1]["step"] if before else None,
        "first_step_after_restart": after[0]["step"] if after else None,
        "kill_to_first_step_s": round(after[0]["time"] - t_kill, 2) if after else None,
        "final_step": ckpt["step"],
        "checkpoint_mb": round((out / "timing.pt").stat().st_size / 2**20, 1),
        "checkpoint_save_s": round(save_s, 3),
        "resumed_line": next((line for line in log.splitlines() if "resumed from" in line), None),
    }
    if proc.returncode:
        print(log[-3000:])
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
