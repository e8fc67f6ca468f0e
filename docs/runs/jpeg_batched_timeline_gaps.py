"""Reads the torch.profiler traces that jpeg_batched_timeline.py writes (trace_DECODER_connN.json.gz) and prints, per
trace, for steps 3-9 of the profiled window: the step's wall time, how long the loop waited for its batch, how long
the forward (main thread) and the backward (autograd thread) took to launch, and the training stream's kernel time;
then the training stream's idle gaps, and for the longest ones whether the next kernel started as soon as its launch
call returned (the GPU waiting for the host) and how much other-stream GPU work ran inside the gap.
Usage: python3 docs/runs/jpeg_batched_timeline_gaps.py DIR"""

import gzip
import json
import sys
from pathlib import Path

for path in sorted(Path(sys.argv[1]).glob("trace_*.json.gz")):
    ev = [e for e in json.load(gzip.open(path, "rt"))["traceEvents"] if e.get("ph") == "X"]
    wait = sorted((e for e in ev if e.get("name") == "wait"), key=lambda e: e["ts"])
    main = wait[0]["tid"]
    work = {}
    for e in ev:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            work.setdefault(e["args"].get("stream"), []).append(e)
    stream = max(work, key=lambda s: len(work[s]))  # the training stream has by far the most
    train = sorted(work[stream], key=lambda e: e["ts"])
    calls = {}
    for e in ev:
        if e.get("cat") in ("cpu_op", "cuda_runtime"):
            calls[e["tid"]] = calls.get(e["tid"], 0) + 1
    autograd = max((t for t in calls if t != main), key=calls.get)
    print(path.name)
    for i in range(3, len(wait) - 1):
        s0, s1 = wait[i]["ts"], wait[i + 1]["ts"]
        bwd = [e for e in ev if e["tid"] == autograd and s0 <= e["ts"] < s1 and e.get("cat") in ("cpu_op", "cuda_runtime")]
        b0, b1 = min(e["ts"] for e in bwd), max(e["ts"] + e["dur"] for e in bwd)
        k = sum(e["dur"] for e in train if s0 <= e["ts"] < s1)
        print(f"  step {i}: wall {(s1 - s0) / 1e3:5.1f} ms, wait for batch {wait[i]['dur'] / 1e3:4.2f}, forward launch "
              f"{(b0 - s0) / 1e3:5.1f}, backward launch {(b1 - b0) / 1e3:5.1f}, training kernels {k / 1e3:5.1f}")
    t0, t1 = wait[3]["ts"], wait[-1]["ts"]
    window = [e for e in train if t0 <= e["ts"] <= t1]
    gaps = [(a["ts"] + a["dur"], b) for a, b in zip(window, window[1:]) if b["ts"] - a["ts"] - a["dur"] > 200]
    idle = sum(b["ts"] - g0 for g0, b in gaps)
    print(f"  training stream idle in gaps > 0.2 ms: {idle / 1e3:.1f} of {(t1 - t0) / 1e3:.1f} ms ({len(gaps)} gaps)")
    launches = {e["args"].get("correlation"): e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    others = [e for s, es in work.items() if s != stream for e in es]
    for g0, b in sorted(gaps, key=lambda g: g[0] - g[1]["ts"])[:6]:
        launch = launches.get(b["args"].get("correlation"))
        late = f"{(b['ts'] - launch['ts'] - launch['dur']) / 1e3:.2f} ms after its launch returned" if launch else "?"
        inside = sum(max(0, min(e["ts"] + e["dur"], b["ts"]) - max(e["ts"], g0)) for e in others)
        print(f"    gap {(b['ts'] - g0) / 1e3:5.2f} ms: next kernel {b['name'][:40]!r} started {late}; "
              f"other-stream GPU work inside: {inside / 1e3:.2f} ms")
