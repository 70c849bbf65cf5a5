"""Every fused kernel of model_new.FUSED_TABLE that this GPU can launch, side by side in one process: checked against
the reference in its precision (full problem and a ragged shape), then timed on the full problem (CUDA events, L2
flushed, median). Then the kernel each device profile (harness.DEVICE_PROFILES, through emulate_device) picks per
precision. For choosing table rows; bench.py times what users run.

    python3 tools/kernel_sweep.py                  # every kernel
    python3 tools/kernel_sweep.py sm80_tf32 sm80_bf16 --trials 30
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import harness  # noqa: E402
import model_new  # noqa: E402
import reference  # noqa: E402

FULL = (reference.batch_size, reference.in_channels, reference.height, reference.width)
RAGGED = (3, 16, 67, 300)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernels", nargs="*", help="names in FUSED_KERNELS (default: all)")
    p.add_argument("--trials", type=int, default=25)
    args = p.parse_args()
    names = args.kernels or list(model_new.FUSED_KERNELS)
    failures = 0
    rows = []
    for name in names:
        case = harness.CASES[f"kernel-{name}"]
        tol = harness.PRECISIONS[case.precision].tol
        ref, fn = harness.case_model(case)
        smem = model_new.fused_kernel_smem_bytes(name)
        if not model_new.fused_kernel_launches(name):
            print(f"{name}: not run, this GPU cannot launch it ({smem} bytes of shared memory per block)", flush=True)
            continue
        ok_all, diffs = True, []
        for shape in (RAGGED, FULL):
            x = harness.make_input(shape, seed=3, device="cuda").to(harness.PRECISIONS[case.precision].dtype)
            with torch.no_grad():
                want = ref(x)
            harness.poison_cuda_allocator(want.numel() * 4)
            ok, diff = harness.compare(fn(x), want, atol=tol, rtol=tol)
            ok_all &= ok
            diffs.append(diff)
        ms = harness.summarize(harness.time_cuda(lambda: fn(x), trials=args.trials))["median"]
        failures += not ok_all
        rows.append((name, case.precision, smem, ms, ok_all, diffs))
        print(f"{name:20s} {case.precision:12s} smem {smem:7d} B  {ms:.3f} ms  correct {ok_all}  "
              f"max abs diff {diffs[0]:.1e} / {diffs[1]:.1e}", flush=True)
        del x, want, ref, fn
        torch.cuda.empty_cache()
    torch.backends.cudnn.allow_tf32 = True
    x = torch.empty(1, 16, 3, 3, device="cuda")
    for profile in harness.DEVICE_PROFILES:
        chosen = []
        with harness.emulated(profile):
            for precision, spec in harness.PRECISIONS.items():
                torch.backends.cudnn.allow_tf32 = spec.allow_tf32
                _, new = harness.make_models(0, device="cuda")
                new = new.to(spec.dtype)
                chosen.append(f"{precision}: {new.fused_kernel(x.to(spec.dtype))}")
        torch.backends.cudnn.allow_tf32 = True
        print(f"{profile:8s} " + ", ".join(chosen), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
