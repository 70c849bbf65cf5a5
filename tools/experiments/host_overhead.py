"""Host (CPU) microseconds per call on a tiny input, grad disabled: what a timed forward pays before the GPU starts.

    python3 tools/experiments/host_overhead.py [--compiled]

Rows: ModelNew(x); the op's CUDA kernel called directly (the C++ function ModelNew's eager path calls); the same op
through the dispatcher (torch.ops, as compiled graphs and autograd call it); with --compiled also
torch.compile(ModelNew, fullgraph=True). bench.py records the first three.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import torch  # noqa: E402

import harness  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--compiled", action="store_true", help="also time torch.compile(ModelNew, fullgraph=True)")
args = p.parse_args()
_, new = harness.make_models(0, device="cuda")
new.eval()
rows = harness.measure_host_us(new)
if args.compiled:
    compiled = torch.compile(new, fullgraph=True)
    x = harness.make_input((1, 16, 8, 8), device="cuda")
    with torch.no_grad():
        rows["model_new_compiled"] = harness.host_us_per_call(lambda: compiled(x))
for name, us in rows.items():
    print(f"{name:20s} {us:6.1f} us per call", flush=True)
