"""How the TF32 forward's time moves with the GPU's clock under sustained load, in one process: ModelNew on the full
problem timed in rounds back to back (CUDA events, L2 flushed, as bench.py times a row), the SM clock, power,
temperature and active clock-throttle reasons read after each round. --alternate times the `fused` backend and
ModelNew (auto) in turn instead, to tell a difference between the two rows from a drift over the process.

    python3 tools/clock_probe.py                 # 8 rounds of 100 trials
    python3 tools/clock_probe.py --alternate     # fused, ModelNew, fused, ... 4 rounds of 25 trials each
"""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import harness  # noqa: E402
import reference  # noqa: E402

QUERY = "--query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def gpu_state():
    try:
        return subprocess.run(["nvidia-smi", QUERY, "--format=csv,noheader"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        return f"nvidia-smi unavailable: {e}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alternate", action="store_true", help="the fused backend and ModelNew in turn")
    p.add_argument("--rounds", type=int, default=None, help="default 8 (4 with --alternate)")
    p.add_argument("--trials", type=int, default=None, help="per round and model; default 100 (25 with --alternate)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("clock_probe.py needs a CUDA GPU; none is available here.")
        return 2
    rounds = args.rounds or (4 if args.alternate else 8)
    trials = args.trials or (25 if args.alternate else 100)
    torch.backends.cudnn.allow_tf32 = True
    init = reference.get_init_inputs()
    shape = (reference.batch_size, reference.in_channels, reference.height, reference.width)
    models = [("model_new", harness.make_models(0, init, device="cuda")[1].eval())]
    if args.alternate:
        models.insert(0, ("fused", harness.make_models(0, init, device="cuda", backend="fused")[1].eval()))
    x = harness.make_input(shape, seed=1, device="cuda")
    print(f"before: {gpu_state()}", flush=True)
    with torch.no_grad():
        for r in range(rounds):
            for name, model in models:
                t = harness.summarize(harness.time_cuda(lambda: model(x), trials=trials))
                print(f"round {r} {name:9s} median {t['median']:.3f} min {t['min']:.3f} max {t['max']:.3f} ms | "
                      f"{gpu_state()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
