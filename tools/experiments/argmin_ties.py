"""Where a 16-bit reference's backward routes a pixel's gradient elsewhere than float64's argmin (CPU only).

The reference in bf16 or fp16 rounds its conv output to the dtype, then torch.min takes the first of the channels
that share the smallest rounded value. The saving forward takes the argmin of its fp32 sums, which is float64's
wherever the two smallest sums are apart by more than the accumulation error. This counts the output pixels where
the two differ: the conv in float64 of the dtype's inputs and parameters (the sums the kernel's fp32 accumulation
approaches), rounded to the dtype for the reference's side. docs/design.md ("NaN") quotes the output.

    python3 tools/experiments/argmin_ties.py [--weights 0 1 2] [--inputs 4] [--n 2]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import harness  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def differing_fraction(weight_seed, input_seed, n, dtype):
    ref = harness.make_reference(weight_seed, None, "cpu")
    w, b = (t.detach().to(dtype).double() for t in (ref.conv.weight, ref.conv.bias))
    x = harness.make_input((n, 16, 256, 256), seed=input_seed).to(dtype).double()
    y = torch.conv2d(x, w, b)
    return (y.argmin(dim=1) != y.to(dtype).min(dim=1).indices).double().mean().item()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", type=int, nargs="+", default=[0, 1, 2], help="seeds of reference.Model's parameters "
                   "(0: the benchmark's)")
    p.add_argument("--inputs", type=int, nargs="+", default=[4], help="seeds of the torch.rand inputs")
    p.add_argument("--n", type=int, default=2, help="images per input (16 x 256 x 256 each)")
    args = p.parse_args()
    for name, dtype in DTYPES.items():
        for weight_seed in args.weights:
            for input_seed in args.inputs:
                share = differing_fraction(weight_seed, input_seed, args.n, dtype)
                print(f"{name} weights seed {weight_seed} input seed {input_seed}: {share:.4%} of the pixels route "
                      f"the reference's gradient elsewhere than float64's argmin")
    return 0


if __name__ == "__main__":
    sys.exit(main())
