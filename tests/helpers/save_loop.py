"""Save a ~30 MB checkpoint to OUT/last.pt over and over, in a child process the test SIGKILLs mid-save.

It imports torch once and forks a fresh saver for every line read on stdin (the test kills several): each saver
prints "<pid> <step>" after every complete save; once a saver is dead this process prints "dead", then waits for the
next line. EOF on stdin ends it.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common.checkpoint import save_checkpoint

out = Path(sys.argv[1])
for _ in sys.stdin:
    pid = os.fork()
    if pid == 0:  # the saver
        step = 0
        model = {"w": torch.randn(8_000_000)}  # 32 MB of float32
        while True:
            step += 1
            model["w"][0] = step
            save_checkpoint({"model": model, "step": step}, out / "last.pt")
            print(os.getpid(), step, flush=True)
    os.waitpid(pid, 0)
    print("dead", flush=True)
