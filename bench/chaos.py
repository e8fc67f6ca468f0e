"""Random faults thrown at 2-process CPU runs under torchrun; each ending compared bit for bit with a faultless run.

    python bench/chaos.py cifar --faults 50 --seed 0 --budget-s 450 --work /tmp/chaos_0 --log chaos_cifar_seed0.jsonl

transformer-fsdp: the transformer's run with --fsdp (sharded checkpoints through torch.distributed.checkpoint).

A fault is one of: SIGKILL of a rank, SIGKILL of rank 0 in the middle of a checkpoint write, SIGKILL or SIGTERM of
the torchrun agent, SIGSTOP then SIGCONT of a rank. Each follows a new checkpoint by a random number of steps, or
(the start-up faults: SIGKILL of a rank or the agent, SIGTERM of the agent) the ranks' appearance by 0.2 to 4 s, and
each is followed by the same command again, until the run ends; then a new run starts. An ending is bit-identical
when every tensor of last.pt (weights, optimizer, EMA, gradient scaler) and the position equal the uninterrupted run's,
and metrics.jsonl holds the same records (clock fields aside), each step once. The log holds one JSON line per fault
and per ending, and a last summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
KINDS = ("kill rank", "kill rank 0 mid-write", "kill agent", "term agent", "stop rank",
         "kill rank at start-up", "kill agent at start-up", "term agent at start-up")  # fmt: skip
CLOCK = ("time", "img_per_s", "tok_per_s")
# the training state a checkpoint holds (and the transformer's eval_step, compared where both checkpoints hold one)
STATE = ("model", "optimizer", "scaler", "ema", "epoch", "step", "batch_in_epoch", "best_metric", "log_lines")


def jpegs(root: Path, splits: dict[str, int], classes: int, size: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in splits.items():
        for i in range(n):
            (root / split / f"c{i % classes}").mkdir(parents=True, exist_ok=True)
            img = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            img[..., i % classes % 3] //= 4  # a class-dependent colour: learnable
            Image.fromarray(img).save(root / split / f"c{i % classes}" / f"{i}.jpg", quality=90)


def script_cmd(name: str, data: Path, out: Path) -> list[str]:
    """A short run of each script: about 60 to 80 optimizer steps, a checkpoint every 2 or 3, a DataLoader worker."""
    common = ["--output-dir", str(out), "-j", "1"]
    if name == "cifar":
        return ["cifar_resnet/train.py", "--data-dir", str(data), "-a", "resnet20", "--epochs", "12", "-b", "4",
                "--random-erasing", "0.5", "--ema", "0.9", "-p", "3", "--seed", "3", "--save-every-steps", "2",
                *common]  # fmt: skip
    if name == "imagenet":
        return ["imagenet/train.py", str(data), "-a", "resnet18", "-b", "4", "--epochs", "8", "-p", "3",
                "--train-crop-size", "32", "--val-resize-size", "40", "--val-crop-size", "32",
                "--save-every-steps", "2", "--seed", "5", *common]  # fmt: skip
    return ["transformer/train.py", "--data", str(data), "--lang-src", "de", "--lang-tgt", "en", "--preset", "tiny",
            "--dropout", "0.1", "--vocab-size", "200", "--max-tokens", "256", "--accum-steps", "2", "--epochs", "6",
            "--lr", "1e-3", "--warmup-epochs", "0.5", "-p", "2", "--save-every-steps", "3", *common,
            *(["--fsdp"] if name == "transformer-fsdp" else [])]  # fmt: skip


def make_data(name: str, root: Path) -> Path:
    if name == "cifar":
        jpegs(root, {"train": 40, "test": 7}, 10, 32)
    elif name == "imagenet":
        jpegs(root, {"train": 64, "val": 13}, 6, 41)
    else:
        sys.path[:0] = [str(REPO / "transformer"), str(REPO)]  # text.py, as transformer/train.py imports it
        from text import synthetic_corpus

        root.mkdir(parents=True)
        for split, (src, tgt) in synthetic_corpus(1, (400, 30, 21)).items():
            (root / f"{split}.de").write_text("\n".join(src) + "\n")
            (root / f"{split}.en").write_text("\n".join(tgt) + "\n")
    return root


def ranks_of(agent: int) -> list[int]:
    """The train.py processes below the torchrun agent ``agent``, rank 0 first."""
    found = {}
    for d in Path("/proc").iterdir():
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            p, chain = int(d.name), []
            while p > 1:
                p = int((Path("/proc") / str(p) / "stat").read_text().rsplit(")", 1)[1].split()[1])
                chain.append(p)
        except (OSError, ValueError, IndexError):
            continue
        rank = [e[5:] for e in env if e.startswith(b"RANK=")]
        if agent in chain and rank and b"train.py" in (d / "cmdline").read_bytes():
            found[int(rank[0])] = int(d.name)
    return [found[r] for r in sorted(found)]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def step_of(out: Path, seen: dict = {}) -> int:  # noqa: B006  (a cache: a checkpoint is read once, memory-mapped)
    try:
        st = os.stat(out / "last.pt")
        key = (str(out), st.st_ino, st.st_mtime_ns)
        if key not in seen:
            seen[key] = torch.load(out / "last.pt", weights_only=True, mmap=True)["step"]
        return seen[key]
    except (OSError, RuntimeError, EOFError, KeyError):
        return 0


def writing(out: Path) -> bool:  # a temporary file of last.pt, or --fsdp's temporary directory of shards
    return any(n.startswith(".last.") and n.endswith((".tmp", ".dcp")) for n in os.listdir(out))


def launch(cmd: list[str], log) -> subprocess.Popen:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}  # CPU, gloo
    return subprocess.Popen(torchrun + cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def inject(kind: str, proc: subprocess.Popen, out: Path, rng: random.Random, target: int) -> tuple[bool, list, str]:
    """Wait until last.pt holds step ``target`` (a checkpoint write, for the mid-write kill), or for a start-up fault
    until the ranks appear and then 0.2 to 4 s more, then throw the fault. False if the run ended first; the ranks;
    when it came."""
    start_up, kind = kind.endswith(" at start-up"), kind.removesuffix(" at start-up")
    while start_up and proc.poll() is None and len(ranks_of(proc.pid)) < 2:
        time.sleep(0.02)
    delay = rng.uniform(0.2, 4) if start_up else 0
    time.sleep(delay)
    when = f"{delay:.1f}s after the ranks appeared" if start_up else f"after step {target}"
    while not start_up and proc.poll() is None and step_of(out) < target:
        time.sleep(0.05)
    while kind.endswith("write") and proc.poll() is None and not writing(out):
        time.sleep(0.001)
    ranks = ranks_of(proc.pid) if proc.poll() is None else []
    if len(ranks) < 2:
        return False, ranks, when
    if kind == "kill rank 0 mid-write":  # stopped, then killed only if the write is still going
        os.kill(ranks[0], signal.SIGSTOP)
        if not writing(out):
            os.kill(ranks[0], signal.SIGCONT)
            return inject(kind, proc, out, rng, step_of(out) + 1)
        os.kill(ranks[0], signal.SIGKILL)
    elif kind == "kill rank":
        os.kill(rng.choice(ranks), signal.SIGKILL)
    elif kind in ("kill agent", "term agent"):
        os.kill(proc.pid, signal.SIGKILL if kind == "kill agent" else signal.SIGTERM)
    else:
        victim = rng.choice(ranks)
        os.kill(victim, signal.SIGSTOP)
        time.sleep(rng.uniform(0.5, 3))
        os.kill(victim, signal.SIGCONT)
    return True, ranks, when


def checkpoint(out: Path) -> dict:  # last.pt, with the weights and optimizer state of its shards under --fsdp
    ckpt = torch.load(out / "last.pt", weights_only=True)
    if "shards" in ckpt:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(out / ckpt["shards"], out / "whole.pt")
        ckpt.update(torch.load(out / "whole.pt", weights_only=True))
    return ckpt


def compare(ref: Path, out: Path) -> dict[str, bool]:
    a, b = (checkpoint(d) for d in (ref, out))
    keys = {k for c in (a, b) for k in c if k in STATE or isinstance(c[k], torch.Tensor)}
    keys |= {"eval_step"} & a.keys() & b.keys()
    recs = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (ref, out)]
    recs = [[{k: v for k, v in r.items() if k not in CLOCK} for r in rs] for rs in recs]
    return {"identical": all(k in a and k in b and same(a[k], b[k]) for k in keys), "records_equal": recs[0] == recs[1]}


def same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(map(same, x, y))
    return x == y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("script", choices=["cifar", "transformer", "transformer-fsdp", "imagenet"])
    p.add_argument("--faults", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=Path("/tmp/chaos"))
    p.add_argument("--log", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=1e9, help="throw no new fault after this many seconds")
    args = p.parse_args()
    work = args.work / args.script
    shutil.rmtree(work, ignore_errors=True)
    data = make_data(args.script, work / "data")
    rng, t_start = random.Random(args.seed), time.time()
    ref, leg = work / "reference", work / "leg.log"
    assert launch(script_cmd(args.script, data, ref), open(leg, "w")).wait() == 0, leg.read_text()[-3000:]
    thrown, survived, endings, run, done = dict.fromkeys(KINDS, 0), dict.fromkeys(KINDS, 0), [], 0, False
    with open(args.log, "w") as log:
        while not done:
            run += 1
            out = work / f"run{run}"
            for _ in range(1000):
                proc = launch(script_cmd(args.script, data, out), open(leg, "w"))
                more = sum(thrown.values()) < args.faults and time.time() - t_start < args.budget_s
                kind = rng.choice(KINDS) if more else None
                target = step_of(out) + rng.randint(1, 3)
                hit, ranks, when = inject(kind, proc, out, rng, target) if kind else (False, [], "")
                try:
                    rc = proc.wait(timeout=300)
                except subprocess.TimeoutExpired:
                    rc = "hung"
                deadline = time.time() + 30
                while any(map(alive, ranks)) and time.time() < deadline:
                    time.sleep(0.1)
                orphans = [r for r in ranks if alive(r)]
                for pid in orphans + ([proc.pid] if rc == "hung" else []):
                    os.kill(pid, signal.SIGKILL)
                proc.wait()
                if hit:
                    thrown[kind] += 1
                    survived[kind] += not orphans and rc != "hung"
                    rec = {"fault": kind, "run": run, "when": when, "exit": rc, "orphaned_ranks": len(orphans)}
                    rec["saved_exit_75"] = "(exit 75)" in leg.read_text()
                    log.write(json.dumps(rec) + "\n")
                if rc == 0:
                    break
            endings.append({"ending": run, **compare(ref, out), "steps": step_of(out)})
            log.write(json.dumps(endings[-1]) + "\n")
            log.flush()
            done = sum(thrown.values()) >= args.faults or time.time() - t_start >= args.budget_s
        summary = {"script": args.script, "faults": sum(thrown.values()), "thrown": thrown, "survived": survived,
                   "endings": len(endings), "bit_identical": sum(e["identical"] for e in endings),
                   "records_equal": sum(e["records_equal"] for e in endings), "seed": args.seed,
                   "wall_s": round(time.time() - t_start), "torch": torch.__version__,
                   "cpus": os.cpu_count()}  # fmt: skip
        log.write(json.dumps({"summary": summary}) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
