"""Reads the traces of jpeg_profile_window.py and says where a fed step loses time against a baseline's.

Usage: python3 docs/runs/jpeg_profile_window_gaps.py BASELINE.json.gz FED.json.gz [MORE.json.gz ...]
For each trace, over its profiled steps: the wall time per step (from the "step k" spans), the training stream's
busy time (the union of its kernels, copies and memsets; the training stream is the one with the most GPU time)
and its idle time, both per step; the other streams' GPU time per step and how much of it ran while the training
stream was busy (sharing the SMs) or idle. Then the training stream's idle gaps over 0.1 ms, summed by cause:
"host" where the next piece of work started within 20 us of the call that launched it returning (the GPU waited
for the host), "device" where it had been launched earlier (it waited for another stream, e.g. a batch's event);
and the longest gaps with the kernel after them and what the main thread was doing then. Finally, for traces after
the first: the training-stream kernels whose time per step grew most against the baseline (kernels that ran
slower because they shared the GPU), by kernel name."""

import collections
import gzip
import json
import sys


def load(path):
    ev = [e for e in json.load(gzip.open(path, "rt"))["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in ev if e.get("cat") == "user_annotation" and e["name"].startswith("step ")),
                   key=lambda e: e["ts"])  # fmt: skip
    main = steps[0]["tid"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_stream = collections.defaultdict(list)
    for e in gpu:
        by_stream[e["args"].get("stream")].append(e)
    train = max(by_stream, key=lambda s: sum(e["dur"] for e in by_stream[s]))
    launch = {e["args"]["correlation"]: e for e in ev if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    return ev, steps, main, by_stream, train, launch


def union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def overlap(a, b, busy):
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)


def analyse(path, base_names=None):
    ev, steps, main, by_stream, train, launch = load(path)
    n = len(steps)
    t0 = steps[0]["ts"]
    work = sorted((e for e in by_stream[train] if e["ts"] >= t0), key=lambda e: e["ts"])
    span0, span1 = work[0]["ts"], max(e["ts"] + e["dur"] for e in work)
    busy = union((e["ts"], e["ts"] + e["dur"]) for e in work)
    busy_ms = sum(b - a for a, b in busy) / 1e3
    wall = (steps[-1]["ts"] + steps[-1]["dur"] - t0) / 1e3
    print(f"{path}: {n} steps, training stream {train}")
    print(f"  wall {wall / n:.2f} ms/step; training stream busy {busy_ms / n:.2f}, idle {((span1 - span0) / 1e3 - busy_ms) / n:.2f} ms/step")
    for s, es in sorted(by_stream.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        if s == train:
            continue
        es = [e for e in es if span0 <= e["ts"] <= span1]
        tot = sum(e["dur"] for e in es) / 1e3
        if tot / n < 0.02:
            continue
        shared = sum(overlap(e["ts"], e["ts"] + e["dur"], busy) for e in es) / 1e3
        kinds = collections.Counter(e["name"][:40] for e in es).most_common(3)
        print(f"  stream {s}: {tot / n:.2f} ms/step, {shared / n:.2f} of it beside training work; e.g. {kinds}")
    cpu_main = sorted((e for e in ev if e.get("tid") == main and e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime")),
                      key=lambda e: e["ts"])  # fmt: skip
    causes, gaps = collections.Counter(), []
    for (a0, a1), (b0, b1) in zip(busy, busy[1:]):
        gap = (b0 - a1) / 1e3
        if gap < 0.1:
            continue
        nxt = next(e for e in work if e["ts"] >= b0)
        call = launch.get(nxt["args"].get("correlation"))
        ret = call["ts"] + call["dur"] if call else None
        cause = "host" if ret is not None and nxt["ts"] - ret < 20 else "device"
        causes[cause] += gap
        doing = [e["name"] for e in cpu_main if e["ts"] <= a1 <= e["ts"] + e["dur"] and not e["name"].startswith("step ")]
        gaps.append((gap, cause, nxt["name"][:50], call["name"] if call else "?", doing[:3]))
    print(f"  idle gaps > 0.1 ms: " + ", ".join(f"{c} {v / n:.2f} ms/step" for c, v in causes.items()))
    for g in sorted(gaps, reverse=True)[:8]:
        print(f"    {g[0]:.2f} ms ({g[1]}): next {g[2]!r} launched by {g[3]}; main thread in {g[4]}")
    names = collections.Counter()
    for e in work:
        if e.get("cat") == "kernel":
            names[e["name"]] += e["dur"] / 1e3 / n
    if base_names is not None:
        diff = sorted(((names[k] - base_names.get(k, 0.0), k) for k in names), reverse=True)
        print(f"  training kernels: {sum(names.values()):.2f} ms/step against {sum(base_names.values()):.2f} in the baseline; grew most:")
        for d, k in diff[:8]:
            print(f"    +{d:.3f} ms/step ({base_names.get(k, 0.0):.3f} -> {names[k]:.3f}) {k[:90]}")
    return names


base = analyse(sys.argv[1])
for p in sys.argv[2:]:
    analyse(p, base)
