"""Put on PYTHONPATH as sitecustomize.py: every Python process then prints each garbage collection that takes more
than 20 ms (generation, duration, objects collected, unix time) to stderr, tagged with its pid and torchrun RANK.
Used for jpeg_gc_timing_2xh200.log: does a collection explain the 1.1 s step near the end of the first epoch?"""

import gc
import os
import sys
import time

_t = {}


def _cb(phase, info):
    if phase == "start":
        _t["s"] = time.perf_counter()
    else:
        ms = (time.perf_counter() - _t.get("s", time.perf_counter())) * 1e3
        if ms > 20:
            print(
                f"[gc pid {os.getpid()} rank {os.environ.get('RANK')}] gen {info['generation']} {ms:.0f} ms "
                f"collected {info['collected']} at {time.time():.3f}",
                file=sys.stderr,
                flush=True,
            )


gc.callbacks.append(_cb)
