"""Profile transformer/train.py across its epoch boundaries, unchanged: where does the time between two epochs go?

    torchrun --standalone --nproc_per_node=4 bench/trace_boundary.py --out /tmp/tb -- \
        --data /tmp/m8 --lang-src de --lang-tgt en --preset base --max-tokens 65536 --max-steps 40 ...

Everything after ``--`` goes to transformer/train.py, which runs as it is. This wrapper only adds, on every rank:
- the wall-clock time of every optimizer step (``steps_rankR.json``: seconds between consecutive LR-scheduler
  steps, plus the step numbers that ended an epoch);
- a ``torch.profiler`` trace (CPU and CUDA) of the steps from ``--before`` steps ahead of the first epoch end
  to ``--after`` steps past it (``trace_rankR.json.gz`` and a table of the named ranges, ``ranges_rankR.txt``).
  Named ranges mark the sampler's epoch plan, the DataLoader's restart and the checkpoint write.
With ``--no-checkpoint`` the script writes no checkpoint at all, to isolate what writing one costs.
``--summarize`` prints, per rank, the steps that crossed an epoch end, the timeline of the named ranges, the
longest GPU idle stretches and the GPU compute of each profiled step (the rank with the most is the one the
others waited for in DDP's all-reduce).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def named(owner, attr: str, label: str) -> None:
    """Wrap owner.attr in a profiler range called label."""
    fn = getattr(owner, attr)

    def wrapper(*a, **k):
        with record_function(label):
            return fn(*a, **k)

    setattr(owner, attr, wrapper)


def compute_per_step(events: list[dict]) -> list[float]:
    """Kernel time without NCCL kernels (which also count the wait for other ranks) of each profiled step. A step
    ends with the optimizer's kernels; compared across ranks, it shows which rank the others waited for."""
    steps, cur, in_opt = [], 0.0, False
    for e in sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"]):
        name = e["name"].lower()
        opt = "adam" in name or "multi_tensor" in name
        if in_opt and not opt and cur > 5e3:  # optimizer done (clip-norm kernels alone make a stretch of < 5 ms)
            steps, cur = [*steps, cur / 1e3], 0.0
        cur += 0.0 if "nccl" in name else e["dur"]
        in_opt = opt
    return steps


def summarize(out: Path) -> None:
    """Print, per rank: the median step, the steps that crossed an epoch end, and the profiled boundary's
    timeline (named CPU ranges, and the longest stretches with no GPU kernel running)."""
    import gzip
    import statistics

    for f in sorted(out.glob("steps_rank*.json")):
        rec = json.loads(f.read_text())
        gaps, ends = rec["step_seconds"], rec["epoch_end_after_step"]
        crossing = {e - 1 for e in ends}  # gaps[k] runs from the end of step k+1 to the end of step k+2
        inner = [g for k, g in enumerate(gaps[5:-1], 5) if k not in crossing]
        line = f"rank {rec['rank']}: median step {1e3 * statistics.median(inner):.1f} ms (steps 7+, no boundary)"
        print(line + "; steps crossing an epoch end: " + ", ".join(f"{1e3 * gaps[k]:.0f} ms" for k in sorted(crossing)))
        trace = out / f"trace_rank{rec['rank']}.json.gz"
        if not trace.exists():
            continue
        events = [e for e in json.load(gzip.open(trace))["traceEvents"] if e.get("ph") == "X"]
        t0 = min(e["ts"] for e in events)
        for e in sorted(events, key=lambda e: e["ts"]):
            name = e["name"]
            if name.startswith(("boundary:", "ProfilerStep#")) or "DataLoader" in name:
                print(f"  cpu {(e['ts'] - t0) / 1e3:9.1f} ms  {e['dur'] / 1e3:8.1f} ms  {name}")
        print(
            "  GPU compute per step (kernel time without NCCL), ms: "
            + ", ".join(f"{c:.0f}" for c in compute_per_step(events))
        )
        busy = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy"))
        idle, end = [], busy[0][1] if busy else 0
        for a, b in busy:
            if a > end:
                idle.append((a - end, end))
            end = max(end, b)
        for gap, at in sorted(idle, reverse=True)[:6]:
            print(f"  gpu idle {gap / 1e3:8.1f} ms from {(at - t0) / 1e3:9.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--summarize", action="store_true", help="print what --out holds (after a run) and exit")
    p.add_argument("--before", type=int, default=2, help="profile from this many steps before the first epoch end")
    p.add_argument("--after", type=int, default=3, help="... to this many steps after it")
    p.add_argument("--no-checkpoint", action="store_true", help="write no checkpoint (isolates what writing costs)")
    args, rest = p.parse_known_args()
    if args.summarize:
        return summarize(Path(args.out))
    train_args = rest[1:] if rest[:1] == ["--"] else rest
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import common.checkpoint
    import transformer.data

    sampler_cls = transformer.data.PackedBatchSampler
    named(sampler_cls, "plan", "boundary: sampler.plan (an epoch's batches)")
    named(torch.utils.data.DataLoader, "__iter__", "boundary: DataLoader.__iter__ (workers start or restart)")
    if args.no_checkpoint:
        common.checkpoint.save_checkpoint = lambda *a, **k: None
    named(common.checkpoint, "save_checkpoint", "boundary: save_checkpoint (rank 0)")

    stamps: list[float] = []
    state = {"prof": None, "sampler": None}
    orig_set_epoch = sampler_cls.set_epoch

    def set_epoch(self, *a, **k):  # learn the epoch lengths, to start the profiler where the first end is near
        state["sampler"] = self
        return orig_set_epoch(self, *a, **k)

    sampler_cls.set_epoch = set_epoch

    orig_step = torch.optim.lr_scheduler.LRScheduler.step

    def scheduler_step(self, *a, **k):
        result = orig_step(self, *a, **k)
        if not getattr(self, "_initial_step_done", False):  # the constructor's own step() call
            self._initial_step_done = True
            return result
        stamps.append(time.perf_counter())
        n, spe = len(stamps), state["sampler"] and state["sampler"].steps_before(1)  # the first epoch's end
        if state["prof"] is None and spe and n == spe - args.before:
            state["prof"] = profile(
                activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * torch.cuda.is_available()
            )
            state["prof"].__enter__()
        elif state["prof"] is not None and not state.get("done"):
            state["prof"].step()
            if n == spe + args.after:
                state["prof"].__exit__(None, None, None)
                state["done"] = True
                prof = state["prof"]
                prof.export_chrome_trace(str(out / f"trace_rank{rank}.json.gz"))
                table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
                (out / f"ranges_rank{rank}.txt").write_text(table)
        return result

    torch.optim.lr_scheduler.LRScheduler.step = scheduler_step
    sys.argv = [str(REPO / "transformer" / "train.py"), *train_args]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        ends = []  # a run from the start: epoch e ends after step steps_before(e + 1)
        while state["sampler"] and state["sampler"].steps_before(len(ends) + 1) < len(stamps):
            ends.append(state["sampler"].steps_before(len(ends) + 1))
        record = {"rank": rank, "step_seconds": gaps, "epoch_end_after_step": ends}
        (out / f"steps_rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
