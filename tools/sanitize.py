"""Run ModelNew's CUDA backends on the full problem and on ragged shapes, for compute-sanitizer.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 tools/sanitize.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool racecheck python3 tools/sanitize.py
    python3 tools/sanitize.py cudnn_epilogue      # only the cases of the named backends
    python3 tools/sanitize.py fused:strict_fp32 fused:bf16    # only those backend:precision cases
    python3 tools/sanitize.py --ragged fused    # without the full-problem cases (racecheck takes minutes on those)

Without the caching allocator every tensor is its own allocation, so an out-of-bounds access cannot hide inside a
pooled block. Each output is also checked against the torch backend.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import harness  # noqa: E402
import reference  # noqa: E402

FULL = (reference.batch_size, reference.in_channels, reference.height, reference.width)

# (backend, precision (a name in harness.PRECISIONS: its TF32 setting and tolerance), shape, dtype).
CASES = [
    ("fused", "tf32", (128, 16, 256, 256), torch.float32),  # the full problem: 16-byte row loads
    ("fused", "tf32", (3, 16, 67, 300), torch.float32),  # two column blocks, ragged rows and columns
    ("fused", "tf32", (2, 16, 259, 130), torch.float32),  # W % 4 != 0: rows loaded element by element
    ("fused_mma_sync", "tf32", (128, 16, 256, 256), torch.float32),
    ("fused_mma_sync", "tf32", (3, 16, 67, 300), torch.float32),
    ("fused_mma_sync", "tf32", (2, 16, 259, 130), torch.float32),
    ("fused", "strict_fp32", (128, 16, 256, 256), torch.float32),  # 3xTF32: both operand and weight copies in smem
    ("fused", "strict_fp32", (3, 16, 67, 300), torch.float32),
    ("fused", "strict_fp32", (2, 16, 259, 130), torch.float32),
    ("fused", "bf16", (128, 16, 256, 256), torch.bfloat16),  # 16-byte row loads (W % 8 == 0)
    ("fused", "bf16", (3, 16, 67, 264), torch.bfloat16),  # ragged, W % 8 == 0
    ("fused", "bf16", (2, 16, 259, 130), torch.bfloat16),  # W % 8 != 0: rows loaded element by element
    ("fused", "fp16", (128, 16, 256, 256), torch.float16),
    ("fused", "fp16", (3, 16, 67, 264), torch.float16),
    ("fused", "fp16", (2, 16, 259, 131), torch.float16),  # odd W
    # the epilogue after cuDNN, each element type, vector (inner % (16 bytes) == 0) and scalar paths
    ("cudnn_epilogue", "tf32", (3, 16, 67, 300), torch.float32),
    ("cudnn_epilogue", "tf32", (2, 16, 259, 130), torch.float32),
    ("cudnn_epilogue", "tf32", (3, 16, 67, 300), torch.float64),
    ("cudnn_epilogue", "tf32", (2, 16, 35, 37), torch.float64),
    ("cudnn_epilogue", "tf32", (3, 16, 67, 300), torch.float16),
    ("cudnn_epilogue", "tf32", (2, 16, 35, 37), torch.float16),
    ("cudnn_epilogue", "tf32", (3, 16, 67, 300), torch.bfloat16),
    ("cudnn_epilogue", "tf32", (2, 16, 35, 37), torch.bfloat16),
    ("cudnn_epilogue", "tf32", (16, 67, 300), torch.float32),  # unbatched: min over rows
]


def main():
    failures = 0
    args = sys.argv[1:]
    ragged = "--ragged" in args
    only = set(a for a in args if a != "--ragged")
    for backend, precision, shape, dtype in CASES:
        if only and backend not in only and f"{backend}:{precision}" not in only:
            continue
        if ragged and shape == FULL:
            continue
        torch.backends.cudnn.allow_tf32 = harness.PRECISIONS[precision].allow_tf32
        _, new = harness.make_models(0, device="cuda", backend=backend)
        new = new.to(dtype)
        x = harness.make_input(shape, seed=1, device="cuda").to(dtype)
        kernel = str(new.fused_kernel(x)) if backend != "cudnn_epilogue" else "-"
        with torch.no_grad():
            got = new(x)
            new.backend = "torch"
            want = new(x)
        torch.cuda.synchronize()
        low = dtype in (torch.float16, torch.bfloat16)
        tol = harness.LOW_PRECISION_TOL if low else harness.PRECISIONS[precision].tol
        ok, diff = harness.compare(got, want, atol=tol, rtol=tol)
        failures += not ok
        print(f"{backend:14s} {kernel:12s} {str(dtype):14s} {shape}: allclose {ok}, max abs diff {diff:.2e}",
              flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
