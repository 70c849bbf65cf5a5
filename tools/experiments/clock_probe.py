"""How the forward's time moves with the GPU's clock under sustained load, in one process: ModelNew on the full
problem timed in rounds back to back (CUDA events, L2 flushed, as bench.py times a row), the SM clock, power,
temperature and active clock-throttle reasons read after each round. --alternate times the `fused` backend and
ModelNew (auto) in turn instead, to tell a difference between the two rows from a drift over the process.
--precisions times ModelNew in each of those precisions in turn (default: tf32 alone). --back-to-back S calls each
model back to back for S seconds a round instead, with nvidia-smi sampling every 50 ms beside the calls (the first
third of a round's samples dropped: the power reading lags), and prints ms a call and the samples' clock and power.

    python3 tools/experiments/clock_probe.py                 # 8 rounds of 100 trials
    python3 tools/experiments/clock_probe.py --alternate     # fused, ModelNew, fused, ... 4 rounds of 25 trials each
    python3 tools/experiments/clock_probe.py --precisions bf16 fp16 --back-to-back 3 --rounds 3
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import torch  # noqa: E402

import harness  # noqa: E402

QUERY = "--query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def gpu_state():
    try:
        return subprocess.run(["nvidia-smi", QUERY, "--format=csv,noheader"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        return f"nvidia-smi unavailable: {e}"


def back_to_back(fn, seconds):
    """fn called back to back for `seconds` beside nvidia-smi sampling every 50 ms: (ms a call, the settled samples'
    median, min and max SM MHz, median W, the clock event reasons seen)."""
    sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                                "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.monotonic()
    start.record()
    while time.monotonic() - t0 < seconds:
        for _ in range(50):
            fn()
        calls += 50
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    sampler.terminate()
    rows = [r.split(", ") for r in sampler.communicate()[0].strip().splitlines() if r.count(", ") == 2]
    rows = rows[len(rows) // 3:]
    if not rows:
        return start.elapsed_time(end) / calls, None
    clocks, watts = [float(r[0]) for r in rows], [float(r[1]) for r in rows]
    return start.elapsed_time(end) / calls, (statistics.median(clocks), min(clocks), max(clocks),
                                             statistics.median(watts), sorted({r[2] for r in rows}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alternate", action="store_true", help="the fused backend and ModelNew in turn")
    p.add_argument("--precisions", nargs="+", choices=list(harness.PRECISIONS), default=["tf32"],
                   help="ModelNew in each of these in turn (default: tf32)")
    p.add_argument("--back-to-back", type=float, default=None, metavar="S",
                   help="S seconds of back-to-back calls a round, sampled by nvidia-smi, instead of flushed trials")
    p.add_argument("--rounds", type=int, default=None, help="default 8 (4 with --alternate)")
    p.add_argument("--trials", type=int, default=None, help="per round and model; default 100 (25 with --alternate)")
    args = p.parse_args()
    if args.alternate and args.precisions != ["tf32"]:
        p.error(f"--alternate compares two backends in tf32; expected no --precisions with it, got {args.precisions}")
    if args.back_to_back is not None and not args.back_to_back > 0:
        p.error(f"--back-to-back: expected a positive number of seconds, got {args.back_to_back}")
    if args.back_to_back is not None and shutil.which("nvidia-smi") is None:
        p.error("--back-to-back samples the clock with nvidia-smi, which is not on PATH")
    if not torch.cuda.is_available():
        print("clock_probe.py needs a CUDA GPU; none is available here.")
        return 2
    rounds = args.rounds or (4 if args.alternate else 8)
    trials = args.trials or (25 if args.alternate else 100)
    cases = [harness.Case(f"{b}-{p}", b, p, None) for b in (["fused"] if args.alternate else []) + ["auto"]
             for p in args.precisions]
    runs = []
    for case in cases:
        _, fn = harness.case_model(case)
        x = harness.make_input(seed=1, device="cuda").to(harness.PRECISIONS[case.precision].dtype)
        runs.append((case, fn, x))
    print(f"before: {gpu_state()}", flush=True)
    for r in range(rounds):
        for case, fn, x in runs:
            # case_model set the precision's TF32 flag when it built the model; set it again for this round's calls
            torch.backends.cudnn.allow_tf32 = harness.PRECISIONS[case.precision].allow_tf32
            name = f"{case.key} ({fn.model.fused_kernel(x)})"
            if args.back_to_back is None:
                t = harness.summarize(harness.time_cuda(lambda: fn(x), trials=trials))
                print(f"round {r} {name} median {t['median']:.4f} min {t['min']:.4f} max {t['max']:.4f} ms | "
                      f"{gpu_state()}", flush=True)
            else:
                ms, s = back_to_back(lambda: fn(x), args.back_to_back)
                clock = "no samples" if s is None else (f"{s[0]:.0f} MHz ({s[1]:.0f}-{s[2]:.0f}), {s[3]:.0f} W, "
                                                       f"reasons {' '.join(s[4])}")
                print(f"round {r} {name} {ms:.4f} ms a call back to back | {clock}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
