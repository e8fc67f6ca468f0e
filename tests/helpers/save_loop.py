"""Save a ~30 MB checkpoint to OUT/last.pt over and over (the test SIGKILLs this mid-save)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common.checkpoint import save_checkpoint

out = Path(sys.argv[1])
step = 0
model = {"w": torch.randn(8_000_000)}  # 32 MB of float32
while True:
    step += 1
    model["w"][0] = step
    save_checkpoint({"model": model, "step": step}, out / "last.pt")
    print(step, flush=True)
