"""Host time of ModelNew's training step at N = 32 (params only; x and params): the step timed with CUDA events, the host
time to issue it (no sync), and step plus sync; in a fresh process and after a torch.compile has run in it.

    python3 tools/experiments/training_host.py
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import harness  # noqa: E402

init = (16, 64, 3)
ref, new = (m.train() for m in harness.make_models(5, init, device="cuda"))
x0 = harness.make_input((32, 16, 256, 256), seed=3, device="cuda")
gen = torch.Generator("cuda").manual_seed(4)
target = 2 * torch.rand(32, 1, 254, 254, generator=gen, device="cuda") - 1
g = torch.randn(32, 1, 254, 254, generator=gen, device="cuda")

def make(form):
    x = x0.detach().requires_grad_(form == "x_and_params")
    def step():
        new.zero_grad(set_to_none=True)
        x.grad = None
        out = new(x)
        if form == "params_only":
            torch.nn.functional.mse_loss(out, target).backward()
        else:
            out.backward(g)
    return step

def measure(tag):
    for form in ("params_only", "x_and_params"):
        step = make(form)
        for _ in range(3): step()
        torch.cuda.synchronize()
        gpu = statistics.median(harness.time_cuda(step, trials=15, warmup=2))
        t = time.perf_counter()
        for _ in range(50): step()
        host = (time.perf_counter() - t) / 50 * 1e3
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            step(); torch.cuda.synchronize()
        synced = (time.perf_counter() - t) / 20 * 1e3
        print(f"{tag} {form}: timed {gpu:.3f} ms, host issue {host:.3f} ms/step, step+sync {synced:.3f} ms", flush=True)

measure("fresh")
torch.compile(ref)(x0[:2]).sum()
measure("after_compile")
