"""Run ModelNew's CUDA backends on the full problem and on ragged shapes, for compute-sanitizer.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 tools/sanitize.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool racecheck python3 tools/sanitize.py
    python3 tools/sanitize.py cudnn_epilogue      # only the cases of the named backends

Without the caching allocator every tensor is its own allocation, so an out-of-bounds access cannot hide inside a
pooled block. Each output is also checked against the torch backend.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import harness  # noqa: E402

CASES = [
    ("fused", (128, 16, 256, 256), torch.float32),  # the full problem
    ("fused", (3, 16, 67, 300), torch.float32),  # two column blocks, ragged rows and columns
    ("fused", (2, 16, 259, 130), torch.float32),  # W % 4 != 0 (the mma.sync kernel's 4-byte copy path)
    ("fused_mma_sync", (128, 16, 256, 256), torch.float32),
    ("fused_mma_sync", (3, 16, 67, 300), torch.float32),
    ("fused_mma_sync", (2, 16, 259, 130), torch.float32),
    # the epilogue after cuDNN, each element type, vector (inner % (16 bytes) == 0) and scalar paths
    ("cudnn_epilogue", (3, 16, 67, 300), torch.float32),
    ("cudnn_epilogue", (2, 16, 259, 130), torch.float32),
    ("cudnn_epilogue", (3, 16, 67, 300), torch.float64),
    ("cudnn_epilogue", (2, 16, 35, 37), torch.float64),
    ("cudnn_epilogue", (3, 16, 67, 300), torch.float16),
    ("cudnn_epilogue", (2, 16, 35, 37), torch.float16),
    ("cudnn_epilogue", (3, 16, 67, 300), torch.bfloat16),
    ("cudnn_epilogue", (2, 16, 35, 37), torch.bfloat16),
    ("cudnn_epilogue", (16, 67, 300), torch.float32),  # unbatched: min over rows
]


def main():
    torch.backends.cudnn.allow_tf32 = True
    failures = 0
    only = set(sys.argv[1:])
    for backend, shape, dtype in CASES:
        if only and backend not in only:
            continue
        _, new = harness.make_models(0, device="cuda", backend=backend)
        new = new.to(dtype)
        x = harness.make_input(shape, seed=1, device="cuda").to(dtype)
        with torch.no_grad():
            got = new(x)
            new.backend = "torch"
            want = new(x)
        torch.cuda.synchronize()
        tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else harness.ATOL
        ok, diff = harness.compare(got, want, atol=tol, rtol=tol)
        failures += not ok
        print(f"{backend:14s} {str(dtype):14s} {shape}: allclose {ok}, max abs diff {diff:.2e}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
