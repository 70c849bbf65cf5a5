"""Run ModelNew's CUDA cases (harness.CASES) on the full problem and on ragged shapes, for compute-sanitizer.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 tools/sanitize.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool racecheck python3 tools/sanitize.py --ragged
    python3 tools/sanitize.py kernel-sm80_bf16 fused-strict_fp32    # only these case keys
    python3 tools/sanitize.py kernel                                # only the cases of a backend ("kernel": each kernel)
    python3 tools/sanitize.py --ragged fused                        # without the full problem (racecheck takes minutes there)
    python3 tools/sanitize.py train                                 # only the training step (saving forward, backward)

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


# The training step on ragged shapes (dX's column blocks are 256 input columns, dW's 256 output columns on the tensor
# cores and 128 on the CUDA cores; rows of whole 16-byte loads in every dtype, and element by element), under the
# profiles whose saving forwards differ: wgmma, mma.sync (full size and 99 KB), cuDNN + torch.min.
TRAIN_PROFILES = ("H100", "A100", "A10G", "T4")
TRAIN_SHAPES = [(3, 16, 37, 296), (2, 16, 19, 131), (1, 16, 3, 3)]
TRAIN_MANY_STEPS = (16, 16, 258, 136)  # many steps per backward CTA (the dW row ring); not with --ragged (racecheck)


def runs(args):
    """(label, case, shape, dtype) in order, filtered by the arguments."""
    ragged = "--ragged" in args
    only = set(a for a in args if a != "--ragged")
    if only == {"train"}:
        return
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
    only_args = set(a for a in sys.argv[1:] if a != "--ragged")
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
    if not only_args or "train" in only_args:
        failures += train(TRAIN_SHAPES + ([] if "--ragged" in sys.argv[1:] else [TRAIN_MANY_STEPS]))
    torch.backends.cudnn.allow_tf32 = True
    return 1 if failures else 0


def train(shapes):
    """One forward (saving the argmin) and backward per profile, precision and shape, checked against the float64
    chain through the saved argmin."""
    failures = 0
    sm90 = model_new.fused_kernel_launches("sm90_tf32")
    for profile in TRAIN_PROFILES:
        if profile == "H100" and not sm90:
            continue
        for precision, spec in harness.PRECISIONS.items():
            torch.backends.cudnn.allow_tf32 = spec.allow_tf32
            _, new = harness.make_models(5, device="cuda")
            new = new.to(spec.dtype)
            w, b = new.conv.weight.detach(), new.conv.bias.detach()
            for shape in shapes:
                x = harness.make_input(shape, seed=2, device="cuda").to(spec.dtype)
                with harness.emulated(profile):
                    out, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, 0)
                    g = torch.randn_like(out)
                    grads = torch.ops.kb25.conv_min_tanh2_backward(g, x, w, argmin, pre_min, True, True, True)
                torch.cuda.synchronize()
                want = harness.routed_float64_grads(x, w, argmin, pre_min, g)
                if precision == "tf32" and profile != "T4":  # dW on the tensor cores: TF32 products
                    tf32_dw = harness.routed_float64_grads(x, w, argmin, pre_min, g, harness.round_tf32)[1]
                    want = (want[0], tf32_dw, want[2])
                errs = [harness.relative_error(a, t) for a, t in zip(grads, want)]
                tols = [1e-2 if spec.dtype != torch.float32 else 1e-5] * 3
                if precision == "tf32" and profile != "T4":
                    tols[1] = harness.TF32_OPERAND_TOL  # dW against the TF32-operand chain, as the suite holds it
                ok = all(e <= t for e, t in zip(errs, tols))
                failures += not ok
                print(f"train {profile:5s} {precision:12s} {shape}: gradients x/w/b relative error "
                      f"{errs[0]:.1e} / {errs[1]:.1e} / {errs[2]:.1e}, ok {ok}", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
