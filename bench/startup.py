"""Start-up CPU of a training process, with and without Python's cyclic GC during the imports.

    python bench/startup.py [--reps 10] [--out docs/runs/startup_gc_HOST.json]

Each train.py turns the collector off before ``import torch`` and, after its last import, freezes what the imports
built and turns it back on. This runs ``SCRIPT --help`` (every import, the argument parser, the
interpreter's exit) in fresh processes, alternating:
- ``gc on``: the same script with those calls made no-ops (what a script without them does);
- ``gc off, frozen``: the script as it is.

It reports each process's CPU time (user + system, from the parent's rusage), and how long one full collection
takes right after the imports: the pause every later automatic full collection of that process costs (a frozen
object is skipped). Process CPU is what a 2-core machine running many processes waits for; on an idle many-core
host it is also the start-up wall time of each rank.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = ("cifar_resnet/train.py", "imagenet/train.py", "transformer/train.py")

# The child: run the script's imports and --help as the script would, then time one full collection.
CHILD = r"""
import gc, runpy, sys, time
mode, script = sys.argv[1], sys.argv[2]
collect = gc.collect
if mode == "on":  # the script's gc calls become no-ops: the collector stays on through the imports, nothing frozen
    gc.disable = gc.enable = gc.freeze = lambda: None
    gc.collect = lambda *a: 0
sys.argv = [script, "--help"]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit:
    pass
t = time.perf_counter()
collect()
print(f"COLLECT {time.perf_counter() - t:.6f} OBJECTS {len(gc.get_objects())}", file=sys.stderr)
"""


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one(mode: str, script: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    before = child_cpu()
    p = subprocess.run([sys.executable, "-c", CHILD, mode, script], cwd=REPO, env=env, capture_output=True, text=True)
    cpu = child_cpu() - before
    if p.returncode != 0 or "COLLECT" not in p.stderr:
        raise SystemExit(f"error: {script} ({mode}) exited {p.returncode}: {p.stderr.strip()[-500:]}")
    _, collect_s, _, objects = p.stderr.strip().splitlines()[-1].split()
    return {"cpu_s": round(cpu, 3), "collect_ms": round(1000 * float(collect_s), 2), "gc_objects": int(objects)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=10, help="processes per script and mode, the two modes alternating")
    p.add_argument("--scripts", default=",".join(SCRIPTS))
    p.add_argument("--out", type=Path, help="also write the results as JSON")
    args = p.parse_args()
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}
    rows = []
    for script in args.scripts.split(","):
        runs = {"gc on": [], "gc off, frozen": []}
        for _ in range(args.reps):
            for mode, key in (("on", "gc on"), ("off", "gc off, frozen")):
                runs[key].append(one(mode, script))
        for mode, rs in runs.items():
            cpu = [r["cpu_s"] for r in rs]
            rows.append({"script": script, "mode": mode, "cpu_s": cpu, "cpu_median_s": statistics.median(cpu),
                         "collect_ms_median": statistics.median(r["collect_ms"] for r in rs),
                         "gc_objects": rs[-1]["gc_objects"]})  # fmt: skip
    print(f"python {env['python']}, torch {env['torch']}, {env['cpus']} CPUs, {args.reps} processes each\n")
    print("| script | GC during imports | process CPU, median (s) | min-max (s) | one full collection after (ms) |")
    print("|---|---|---|---|---|")
    for r in rows:
        lo, hi = min(r["cpu_s"]), max(r["cpu_s"])
        print(f"| {r['script']} | {r['mode']} | {r['cpu_median_s']:.2f} | {lo:.2f}-{hi:.2f} | "
              f"{r['collect_ms_median']:.1f} |")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"env": env, "reps": args.reps, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
