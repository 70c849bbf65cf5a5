"""What the step before a trial costs the fused kernel: the same ModelNew call timed (CUDA events, median) after
bench.py's flush (a 256 MiB fill on the GPU, leaving L2 full of dirty lines), after a read-only pass over that buffer,
after a 256 MiB fill of a host buffer (what bench.py's flush did before it was moved to the GPU: L2 untouched, the
GPU idle while the CPU fills), after the host sleeps 25 ms, after a 1 ms device sleep, and back to back; plus the SM
clock and power nvidia-smi reports under load.

    python3 tools/experiments/l2_flush_probe.py [--trials 30]
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import torch  # noqa: E402

import harness  # noqa: E402


def clocks_under_load(fn, seconds=2.0):
    query = "clocks.sm,power.draw,clocks_throttle_reasons.active"
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", "-lms", "100"],
                           stdout=subprocess.PIPE, text=True)
    start = time.time()
    while time.time() - start < seconds:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    return lines[len(lines) // 2] if lines else "nvidia-smi gave nothing"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=30)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("l2_flush_probe.py needs a CUDA GPU; none is available here")
        return 2
    flush = harness.l2_flush_buffer()
    host = torch.empty(flush.numel(), dtype=flush.dtype)
    for name in ("tf32", "bf16"):
        precision = harness.PRECISIONS[name]
        torch.backends.cudnn.allow_tf32 = precision.allow_tf32
        _, new = harness.make_models(0, device="cuda")
        new = new.to(precision.dtype).eval()
        x = harness.make_input(device="cuda", seed=1).to(precision.dtype)
        with torch.no_grad():
            fn = lambda: new(x)  # noqa: E731
            median = lambda before: statistics.median(harness.time_cuda(fn, args.trials, before=before))  # noqa: E731
            rows = {
                "after the GPU flush (written)": median(lambda: flush.fill_(1.0)),
                "after a GPU read of the flush buffer": median(lambda: flush.sum()),
                "after a host fill of 256 MiB (the old flush)": median(lambda: host.fill_(1.0)),
                "after the host sleeps 25 ms": median(lambda: time.sleep(0.025)),
                "after a 1 ms device sleep": median(lambda: torch.cuda._sleep(2_000_000)),
            }
            burst_start, burst_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            burst_start.record()
            for _ in range(args.trials):
                fn()
            burst_end.record()
            torch.cuda.synchronize()
            rows["back to back"] = burst_start.elapsed_time(burst_end) / args.trials
            load = clocks_under_load(fn)
        print(f"{name} {new.fused_kernel(x)}: " + ", ".join(f"{k} {v:.4f} ms" for k, v in rows.items())
              + f" | under load: {load}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
