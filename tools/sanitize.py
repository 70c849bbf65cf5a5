"""Run ModelNew's CUDA cases (harness.CASES) on the full problem and on ragged shapes, for compute-sanitizer.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 tools/sanitize.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool racecheck python3 tools/sanitize.py --ragged
    python3 tools/sanitize.py kernel-sm80_bf16 fused-strict_fp32    # only these case keys
    python3 tools/sanitize.py kernel                                # only the cases of a backend ("kernel": each kernel)
    python3 tools/sanitize.py --ragged fused                        # without the full problem (racecheck takes minutes there)

Without the caching allocator every tensor is its own allocation, so an out-of-bounds access cannot hide inside a
pooled block. Each output is also checked against the reference in its precision.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import harness  # noqa: E402
import model_new  # noqa: E402
import reference  # noqa: E402

FULL = (reference.batch_size, reference.in_channels, reference.height, reference.width)
# Ragged shapes per element size: two column blocks with ragged rows and columns (16-byte row loads), and a width that
# is not a multiple of the vector (rows loaded element by element).
RAGGED = {4: [(3, 16, 67, 300), (2, 16, 259, 130)], 2: [(3, 16, 67, 264), (2, 16, 259, 131)]}
# The epilogue after cuDNN in the types no precision case has: float64, and an unbatched input (min over rows).
EPILOGUE_EXTRAS = [((3, 16, 67, 300), torch.float64), ((2, 16, 35, 37), torch.float64), ((16, 67, 300), torch.float32)]


def runs(args):
    """(label, case, shape, dtype) in order, filtered by the arguments."""
    ragged = "--ragged" in args
    only = set(a for a in args if a != "--ragged")
    for key, case in harness.CASES.items():
        if case.backend == "fused_mma_sync" or (only and key not in only and case.backend not in only):
            continue
        dtype = harness.PRECISIONS[case.precision].dtype
        shapes = ([] if ragged or case.backend == "cudnn_epilogue" else [FULL]) + RAGGED[dtype.itemsize]
        for shape in shapes:
            yield key, case, shape, dtype
    if not only or "cudnn_epilogue" in only:
        for shape, dtype in EPILOGUE_EXTRAS:
            yield "cudnn_epilogue", harness.CASES["cudnn_epilogue-tf32"], shape, dtype


def main():
    failures = 0
    for label, case, shape, dtype in runs(sys.argv[1:]):
        if case.kernel is not None and not model_new.fused_kernel_launches(case.kernel):
            print(f"{label}: not run, this GPU cannot launch it", flush=True)
            continue
        ref, fn = harness.case_model(case)
        ref, fn.model = ref.to(dtype), fn.model.to(dtype)
        x = harness.make_input(shape, seed=1, device="cuda").to(dtype)
        got = fn(x)
        with torch.no_grad():
            want = ref(x)
        torch.cuda.synchronize()
        tol = harness.PRECISIONS[case.precision].tol if dtype != torch.float64 else 1e-12
        ok, diff = harness.compare(got, want, atol=tol, rtol=tol)
        failures += not ok
        kernel = case.kernel or str(fn.model.fused_kernel(x))
        print(f"{label:24s} {kernel:16s} {str(dtype):14s} {shape}: allclose {ok}, max abs diff {diff:.2e}", flush=True)
    torch.backends.cudnn.allow_tf32 = True
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
