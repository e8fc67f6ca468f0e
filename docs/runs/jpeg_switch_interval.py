"""--gpu-decode leaves the training stream idle in gaps of 5-7 ms that end the moment a launch call returns
(jpeg_batched_timeline_gaps_1xh200.log): the launching thread waited for the GIL. CPython makes a thread that wants
the GIL wait up to ``sys.getswitchinterval()`` (5 ms) before it asks the holder to let go. Does a shorter interval
close the gap, and do CUDA graphs gain once the decode has its own hardware queues (CUDA_DEVICE_MAX_CONNECTIONS)?

Each row is imagenet/train.py itself (ResNet-50, batch 256, bf16, channels_last, --compile, -j 8) on bench's 20,480
ImageNet-sized JPEGs, timed like bench/benchmark.py's jpeg rows (median img/s of the logged windows after warm-up,
CPU cores and SM utilisation over them); the interval is set by a sitecustomize.py before the script starts.
Run from the repository root:  python3 docs/runs/jpeg_switch_interval.py OUT_DIR"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
from bench.benchmark import make_jpeg_folder, script_row  # noqa: E402

out = Path(sys.argv[1])
root = out / "jpeg500"
if not (root / "val").exists():
    print(f"{make_jpeg_folder(root, 20480, 512) / 1e3:.0f} KB per JPEG", flush=True)
site = out / "site"
site.mkdir(parents=True, exist_ok=True)
(site / "sitecustomize.py").write_text(
    "import os, sys\n"
    "if 'SWITCH_INTERVAL' in os.environ:\n"
    "    sys.setswitchinterval(float(os.environ['SWITCH_INTERVAL']))\n"
)
fast = ["--amp", "bf16", "--channels-last", "--compile"]
graphs = [*fast, "--compile-mode", "reduce-overhead"]
tv = ["--gpu-decode", "-j", "8"]
rows = [  # (name, flags, environment)
    ("--gpu-decode, switch interval 5 ms (default)", [*tv, *fast], {}),
    ("--gpu-decode, switch interval 0.1 ms", [*tv, *fast], {"SWITCH_INTERVAL": "0.0001"}),
    ("--dummy", ["--dummy", "--dummy-sizes", "20480", "512", "-j", "8", *fast], {}),
    ("--gpu-decode, switch interval 1 ms", [*tv, *fast], {"SWITCH_INTERVAL": "0.001"}),
    ("--gpu-decode + CUDA graphs, 32 hardware queues", [*tv, *graphs], {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}),
    ("--gpu-decode + CUDA graphs, switch interval 0.1 ms", [*tv, *graphs], {"SWITCH_INTERVAL": "0.0001"}),
]
base_env = dict(os.environ)
pythonpath = os.pathsep.join(p for p in (str(site.resolve()), base_env.get("PYTHONPATH")) if p)
results = {}
for k, (name, flags, env) in enumerate(rows):
    os.environ.clear()
    os.environ.update({**base_env, "PYTHONPATH": pythonpath, **env})
    run = out / f"run_{k}"
    data = [] if "--dummy" in flags else [str(root)]
    cmd = [sys.executable, "imagenet/train.py", *data, "-a", "resnet50", "-b", "256", "--epochs", "1", "-p", "10",
           "--output-dir", str(run), "--resume", "none", *flags]  # fmt: skip
    row = script_row("jpeg", name, cmd, run, "img_per_s", 2, monitor=True, batch=256, env=env)
    results[name] = row
    print(json.dumps(row), flush=True)
print("FINAL " + json.dumps({k: round(r.get("img_per_s", 0)) for k, r in results.items()}), flush=True)
