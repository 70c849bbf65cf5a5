"""Run ModelNew's CUDA backends on the full problem and on ragged shapes, for compute-sanitizer.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 tools/sanitize.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool racecheck python3 tools/sanitize.py

Without the caching allocator every tensor is its own allocation, so an out-of-bounds access cannot hide inside a
pooled block. Each output is also checked against the torch backend.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import harness  # noqa: E402

CASES = [
    ("fused", (128, 16, 256, 256)),  # the full problem
    ("fused", (3, 16, 67, 300)),  # two column blocks, ragged rows and columns
    ("fused", (2, 16, 259, 130)),  # W % 4 != 0 (the mma.sync kernel's 4-byte copy path)
    ("fused_mma_sync", (128, 16, 256, 256)),
    ("fused_mma_sync", (3, 16, 67, 300)),
    ("fused_mma_sync", (2, 16, 259, 130)),
    ("card", (3, 16, 67, 300)),
    ("card", (2, 16, 259, 130)),
]


def main():
    torch.backends.cudnn.allow_tf32 = True
    failures = 0
    for backend, shape in CASES:
        _, new = harness.make_models(0, device="cuda", backend=backend)
        x = harness.make_input(shape, seed=1, device="cuda")
        with torch.no_grad():
            got = new(x)
            new.backend = "torch"
            want = new(x)
        torch.cuda.synchronize()
        ok, diff = harness.compare(got, want)
        failures += not ok
        print(f"{backend:14s} {shape}: allclose {ok}, max abs diff {diff:.2e}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
