"""Run a training script unchanged, with torch.profiler over a window of its training steps and every step timed.

Usage, from the repository root (under torchrun too):
    PROFILE_START=40 PROFILE_STEPS=10 PROFILE_OUT=DIR PROFILE_LABEL=NAME python docs/runs/jpeg_profile_window.py \
        imagenet/train.py ARGS...
It wraps common.watchdog.Watchdog.batches, through which every script's training loop draws its batches, so it
sees each step begin without touching the script. Steps PROFILE_START .. PROFILE_START + PROFILE_STEPS - 1
(counted from 0 over the whole run) are profiled (CPU ops and CUDA activity, CUDA graph replays included), with a
"next_batch" span around each wait for a batch and a "step k" span around each step; the window also ends at the
end of an epoch. The trace goes to DIR/trace_NAME_rankR.json.gz. At exit each rank prints every step's wall time
in ms and how much of it was the wait for the batch (the first steps include the compile).
Experiment switches: PROFILE_SGD=fused|foreach forces torch.optim.SGD's implementation; PROFILE_SWITCH=SECONDS sets
CPython's GIL switch interval (sys.setswitchinterval); PROFILE_DUMP=SECONDS prints the Python stack of every thread of a
step that runs longer (faulthandler; run the script with --stall-timeout 0). PROFILE_START past the run's steps profiles nothing."""

import atexit
import faulthandler
import os
import runpy
import sys
import time

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from common import watchdog  # noqa: E402

START, STEPS = int(os.environ.get("PROFILE_START", 40)), int(os.environ.get("PROFILE_STEPS", 10))
OUT, LABEL, RANK = os.environ.get("PROFILE_OUT", "/tmp"), os.environ.get("PROFILE_LABEL", "run"), os.environ.get("RANK", "0")
DUMP = float(os.environ.get("PROFILE_DUMP", 0))  # seconds; with --stall-timeout 0, whose fallback uses faulthandler too
original = watchdog.Watchdog.batches
steps: list[tuple[float, float]] = []  # (wall ms, of which waiting for the batch ms), per step
state = {"k": 0, "prof": None}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def stop_profile() -> None:
    prof, state["prof"] = state["prof"], None
    if prof is not None:
        sync()
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(f"{OUT}/trace_{LABEL}_rank{RANK}.json.gz")


def batches(self, iterable, evaluating=False):
    it = original(self, iterable, evaluating)
    if evaluating:
        yield from it
        return
    try:
        while True:
            k = state["k"]
            if k == START:
                sync()
                state["prof"] = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * torch.cuda.is_available())
                state["prof"].__enter__()
            if k == START + STEPS:
                stop_profile()
            t0 = time.perf_counter()
            with record_function("next_batch"):
                item = next(it, None)
            if item is None:
                return
            t1 = time.perf_counter()
            state["k"] += 1
            if DUMP:  # a step still running after DUMP seconds prints every thread's Python stack (in C: no GIL needed)
                faulthandler.dump_traceback_later(DUMP, file=sys.stderr)
            try:
                with record_function(f"step {k}"):
                    yield item
            finally:  # also for the last step, after which the loop closes this generator
                if DUMP:
                    faulthandler.cancel_dump_traceback_later()
                steps.append(((time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3))
    finally:  # the window also ends with the epoch, or where the loop stops drawing batches
        stop_profile()


def report() -> None:
    print(f"[steps rank {RANK}] wall ms: {' '.join(f'{w:.0f}' for w, _ in steps)}", file=sys.stderr, flush=True)
    print(f"[steps rank {RANK}] batch wait ms: {' '.join(f'{b:.0f}' for _, b in steps)}", file=sys.stderr, flush=True)


if os.environ.get("PROFILE_SGD") in ("fused", "foreach"):  # the optimizer's implementation, forced
    sgd_init = torch.optim.SGD.__init__

    def sgd(self, *args, **kwargs):
        fused = os.environ["PROFILE_SGD"] == "fused"
        sgd_init(self, *args, **{**kwargs, "fused": fused or None, "foreach": None if fused else True})

    torch.optim.SGD.__init__ = sgd
if os.environ.get("PROFILE_SWITCH"):  # CPython's GIL switch interval, seconds (default 0.005)
    sys.setswitchinterval(float(os.environ["PROFILE_SWITCH"]))
watchdog.Watchdog.batches = batches
atexit.register(report)
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
