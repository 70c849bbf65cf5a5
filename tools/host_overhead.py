"""Host (CPU) microseconds per call on a tiny input, grad disabled: what a timed forward pays before the GPU starts.

    python3 tools/host_overhead.py

Rows: ModelNew(x); the op's CUDA kernel called directly (the C++ function ModelNew's eager path calls); the same op
through the dispatcher (torch.ops, as compiled graphs and autograd call it). bench.py records the same numbers.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness  # noqa: E402

_, new = harness.make_models(0, device="cuda")
for name, us in harness.measure_host_us(new.eval()).items():
    print(f"{name:16s} {us:6.1f} us per call", flush=True)
