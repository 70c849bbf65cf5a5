"""Run one case of harness.CASES on the full problem, for a profiler to catch (no timing here). A precision name
alone means ModelNew's own choice in that precision; grad_weight and grad_input run that part of the fused backward
in TF32 (after one saving forward), and print how the argmins spread over the channels.

    ncu -k regex:conv3x3_min_tanh2_kernel --launch-skip 1 --launch-count 1 python3 tools/run_once.py bf16
    ncu ... python3 tools/run_once.py kernel-sm80_bf16
    ncu -k regex:grad_weight_fed --launch-skip 1 --launch-count 1 python3 tools/run_once.py grad_weight

Where the stalls sit: `ncu --set full -o rep ...`, then `ncu -i rep.ncu-rep --page source --csv --print-source sass`
into tools/ncu_hotspots.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import harness  # noqa: E402


def run_backward(key):
    import model_new

    torch.backends.cudnn.allow_tf32 = True
    _, new = harness.make_models(0, device="cuda")
    w, b = new.conv.weight.detach(), new.conv.bias.detach()
    x = harness.make_input(device="cuda")
    with torch.no_grad():
        out, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, model_new.OP_BACKENDS.index("auto"))
        g = torch.randn(out.shape, generator=torch.Generator("cuda").manual_seed(1), device="cuda")
        counts = torch.bincount(argmin.flatten().long(), minlength=w.shape[0])
        for _ in range(2):  # profile the second
            torch.ops.kb25.conv_min_tanh2_backward(g, x, w, argmin, pre_min, *harness.BACKWARD_PARTS[key])
    torch.cuda.synchronize()
    print(f"{key}: ran; the most frequent argmin channel holds {counts.max().item() / argmin.numel():.1%} of the "
          f"pixels, {int((counts > 0).sum())} channels hold any")


def main():
    keys = list(harness.PRECISIONS) + list(harness.CASES) + list(harness.BACKWARD_PARTS)
    if len(sys.argv) != 2 or sys.argv[1] not in keys:
        print(f"usage: run_once.py {{{','.join(keys)}}}, got {sys.argv[1:]}")
        return 2
    if not torch.cuda.is_available():
        print("run_once.py needs a CUDA GPU; none is available here")
        return 2
    key = sys.argv[1]
    if key in harness.BACKWARD_PARTS:
        run_backward(key)
        return 0
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
