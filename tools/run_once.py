"""Run one case of harness.CASES on the full problem, for a profiler to catch (no timing here). A precision name
alone means ModelNew's own choice in that precision.

    ncu -k regex:conv3x3_min_tanh2_kernel --launch-skip 1 --launch-count 1 python3 tools/run_once.py bf16
    ncu ... python3 tools/run_once.py kernel-sm80_bf16
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import harness  # noqa: E402


def main():
    keys = list(harness.PRECISIONS) + list(harness.CASES)
    if len(sys.argv) != 2 or sys.argv[1] not in keys:
        print(f"usage: run_once.py {{{','.join(keys)}}}, got {sys.argv[1:]}")
        return 2
    if not torch.cuda.is_available():
        print("run_once.py needs a CUDA GPU; none is available here")
        return 2
    key = sys.argv[1]
    case = harness.Case(key, "auto", key, None) if key in harness.PRECISIONS else harness.CASES[key]
    _, fn = harness.case_model(case)
    x = harness.make_input(device="cuda").to(harness.PRECISIONS[case.precision].dtype)
    for _ in range(2):  # the first launch pays the shared-memory opt-in; profile the second
        fn(x)
    torch.cuda.synchronize()
    print(f"{key}: ran {case.kernel or fn.model.fused_kernel(x)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
