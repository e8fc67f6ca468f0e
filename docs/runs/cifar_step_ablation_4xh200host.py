"""Where the CIFAR script's step loses time against the bare loop: the bare step plus one script feature at a time."""
import functools, statistics, sys, time
sys.path.insert(0, ".")
import torch, torch.nn as nn, torch.nn.functional as F
from cifar_resnet.train import build_model
from cifar_resnet.data import gpu_crop_flip, normalize
from common.utils import param_groups, warmup_cosine
from common.distributed import mix_seed

dev = torch.device("cuda")
B = 512
torch.manual_seed(0)
train_x = torch.randint(0, 256, (45000, 40, 40, 3), dtype=torch.uint8, device=dev)
train_y = torch.randint(0, 10, (45000,), device=dev)

def make(opt_kind="bare", crit="bare", sched=False, data=False, accum=False, fused=False, cudnn_bench=False):
    torch.backends.cudnn.benchmark = cudnn_bench
    model = build_model("resnet18").to(dev).to(memory_format=torch.channels_last)
    if opt_kind == "bare":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, fused=fused or None)
    else:
        opt = torch.optim.SGD(param_groups(model, 5e-4), lr=0.4, momentum=0.9, nesterov=True, fused=fused or None)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(warmup_cosine, warmup=88, total=88 * 80))
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1) if crit == "ls" else nn.CrossEntropyLoss()
    fwd = torch.compile(model)
    x0 = torch.randn(B, 3, 32, 32, device=dev).contiguous(memory_format=torch.channels_last)
    y0 = torch.randint(0, 10, (B,), device=dev)
    gen = torch.Generator(dev)
    loss_sum = torch.zeros((), device=dev)
    state = {"i": 0}
    idx = torch.randperm(45000, device=dev)

    def step():
        i = state["i"] = (state["i"] + 1) % 87
        if data:
            b = idx[i * B:(i + 1) * B]
            gen.manual_seed(mix_seed(0, 0, 0, i))
            x, y = normalize(gpu_crop_flip(train_x[b], gen)), train_y[b]
            x = x.contiguous(memory_format=torch.channels_last)
        else:
            x, y = x0, y0
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = criterion(fwd(x), y)
        loss.backward()
        if accum:
            loss_sum.add_(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched:
            sch.step()
    return step

def timed(step, iters=60, warmup=15):
    for _ in range(warmup):
        step()
    rates = []
    for _ in range(5):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(iters // 5):
            step()
        torch.cuda.synchronize(); rates.append(B * (iters // 5) / (time.perf_counter() - t0))
    return statistics.median(rates)

V = {
    "bare": {},
    "bare cudnn.benchmark": dict(cudnn_bench=True),
    "+ script optimizer (2 groups, nesterov)": dict(opt_kind="script"),
    "+ label smoothing": dict(opt_kind="script", crit="ls"),
    "+ scheduler + loss sum": dict(opt_kind="script", crit="ls", sched=True, accum=True),
    "+ gpu data (crop/flip/normalize)": dict(opt_kind="script", crit="ls", sched=True, accum=True, data=True),
    "all + fused SGD": dict(opt_kind="script", crit="ls", sched=True, accum=True, data=True, fused=True),
    "all + cudnn.benchmark": dict(opt_kind="script", crit="ls", sched=True, accum=True, data=True, cudnn_bench=True),
    "bare + fused SGD": dict(fused=True),
}
for name, kw in V.items():
    r = timed(make(**kw))
    print(f"{r:9.0f} img/s  {45000 / r:.3f} s/epoch  {name}", flush=True)

# A profile of the full script-like step: CPU time per step against GPU kernel time per step.
from torch.profiler import profile, ProfilerActivity
step = make(opt_kind="script", crit="ls", sched=True, accum=True, data=True)
for _ in range(15): step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    t0 = time.perf_counter()
    for _ in range(20): step()
    t_cpu = time.perf_counter() - t0
    torch.cuda.synchronize()
    t_all = time.perf_counter() - t0
print(f"profiled 20 steps: host loop {t_cpu*50:.2f} ms/step, to sync {t_all*50:.2f} ms/step")
ka = prof.key_averages()
gpu_us = sum(e.self_device_time_total for e in ka)
print(f"GPU kernel time {gpu_us / 20 / 1000:.2f} ms/step")
print(ka.table(sort_by="self_device_time_total", row_limit=25))
