"""Same-process A/B of every kernel: model_new.py as it is (B) against model_new.py at a git revision (A), both built
into one process (A under its own extension and op namespace), each kernel checked against the other's output and
timed in alternating rounds (CUDA events, L2 flushed, median of the trials, then the median over rounds).

    python3 tools/ab.py --base HEAD~3               # every fused kernel (both variants) and the backward kernels
    python3 tools/ab.py --base build/ab/old_model_new.py   # a copy (where the tree travels without .git)
    python3 tools/ab.py --base 44eb74e --rounds 5 --trials 25

Items: each FUSED_TABLE kernel this GPU can launch, inference (run_fused_kernel) and saving (the op's saving forward,
under emulate_device for the rows a GPU of another profile picks), and the backward (dX, dW, db) per dtype. Exit 1 if
any item of B is more than --limit (1%) slower than A, or if their outputs differ.
"""
import argparse
import importlib.util
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import harness  # noqa: E402
import reference  # noqa: E402

FULL = (reference.batch_size, reference.in_channels, reference.height, reference.width)
# Where each saving variant runs: the backend that picks its row on this GPU. Guards have none (a backend picks the
# kernel they guard; they recompute listed images only).
SAVING_ROUTES = {"sm90": "fused", "sm80": "fused_mma_sync"}


def load(path, name, extension=None, namespace=None):
    """A model_new.py as module `name`; extension and namespace renamed where given (two builds in one process)."""
    with open(path) as f:
        text = f.read()
    if extension:
        for old, new in (('EXTENSION_NAME = "kb25_conv_min_tanh2"', f'EXTENSION_NAME = "{extension}"'),
                         ('OP_NAMESPACE = "kb25"', f'OP_NAMESPACE = "{namespace}"')):
            if text.count(old) != 1:
                raise SystemExit(f"ab.py: expected {old!r} once in {path}, found it {text.count(old)} times")
            text = text.replace(old, new)
        # the C++ library registers its CUDA kernels under the namespace that the bundled sources define
        text = text.replace("#define KB25_OP_NAMESPACE kb25\n", f"#define KB25_OP_NAMESPACE {namespace}\n")
    copy = os.path.join(ROOT, "build", "ab", f"{name}.py")
    os.makedirs(os.path.dirname(copy), exist_ok=True)
    with open(copy, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(name, copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def route(name):
    for key, value in SAVING_ROUTES.items():
        if name.startswith(key):
            return value
    raise ValueError(f"no saving route for {name}")


def items(mod, kernels):
    """{item: fn(x, w, b) -> outputs} for one build."""
    out = {}
    for row in mod.FUSED_TABLE:
        if row.name not in kernels:
            continue
        input_dtype = mod.INPUT_DTYPES[row.input] if hasattr(row, "input") else None

        def inference(x, w, b, n=row.name, input_dtype=input_dtype):
            return mod.run_fused_kernel(x if input_dtype is None else x.to(input_dtype), w, b, n)

        out[(row.name, "inference")] = (row.precision, inference)
        if getattr(row, "input", row.precision) != row.precision and row.precision in ("bf16", "fp16"):
            continue  # a kernel that rounds float32 x: autocast's inference call only, no saving variant runs
        if row.name in getattr(mod, "GUARD_KERNELS", ()):
            continue  # no backend picks a guard: its saving variant runs only for the images it recomputes
        code = mod.OP_BACKENDS.index(route(row.name))

        def saving(x, w, b, code=code):
            return mod._ext.conv_min_tanh2_with_argmin(x, w, b, code)

        out[(row.name, "saving")] = (row.precision, saving)
    for precision in ("tf32", "bf16", "fp16"):
        def backward(x, w, b, state={}):
            key = (x.data_ptr(), x.dtype)
            if key not in state:  # the saved argmin and pre-tanh min, made once
                _, argmin, pre_min = mod._ext.conv_min_tanh2_with_argmin(x, w, b, mod.OP_BACKENDS.index("auto"))
                gen = torch.Generator(device=x.device).manual_seed(1)  # the same gradient for A and B
                state[key] = (torch.rand(argmin.shape, generator=gen, device=x.device, dtype=x.dtype), argmin, pre_min)
            grad, argmin, pre_min = state[key]
            return mod._ext.conv_min_tanh2_backward(grad, x, w, argmin, pre_min, True, True, True)

        out[("backward", precision)] = (precision, backward)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="A: a model_new.py file, or a git revision (its model_new.py)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--trials", type=int, default=25)
    p.add_argument("--limit", type=float, default=0.01, help="largest allowed slowdown of B against A (fraction)")
    p.add_argument("kernels", nargs="*", help="FUSED_KERNELS names (default: all this GPU launches)")
    args = p.parse_args()
    base_path = args.base
    if not os.path.isfile(base_path):
        base_text = subprocess.run(["git", "show", f"{args.base}:model_new.py"], cwd=ROOT, capture_output=True,
                                   text=True)
        if base_text.returncode != 0:
            raise SystemExit(f"ab.py: expected a model_new.py file or a git revision with one, got {args.base!r}: "
                             f"{base_text.stderr.strip()}")
        base_path = os.path.join(ROOT, "build", "ab", "base_source.py")
        os.makedirs(os.path.dirname(base_path), exist_ok=True)
        with open(base_path, "w") as f:
            f.write(base_text.stdout)
    import model_new as b_mod  # noqa: E402  (B: the tree's, under its own names)

    a_mod = load(base_path, "model_new_ab_base", "kb25_conv_min_tanh2_ab_base", "kb25_ab_base")
    kernels = [k for k in (args.kernels or b_mod.FUSED_KERNELS) if b_mod.fused_kernel_launches(k)]
    a_items, b_items = items(a_mod, kernels), items(b_mod, kernels)
    keys = [k for k in b_items if k in a_items]
    times = {k: ([], []) for k in keys}
    mismatches = []
    for r in range(args.rounds):
        for key in keys:
            precision, fn_b = b_items[key]
            _, fn_a = a_items[key]
            spec = harness.PRECISIONS[precision]
            torch.backends.cudnn.allow_tf32 = spec.allow_tf32
            torch.manual_seed(0)
            ref = reference.Model(*reference.get_init_inputs()).cuda().to(spec.dtype)
            w, b = ref.conv.weight.detach(), ref.conv.bias.detach()
            x = harness.make_input(FULL, seed=r, device="cuda").to(spec.dtype)
            if r == 0:
                out_a, out_b = fn_a(x, w, b), fn_b(x, w, b)
                out_a = out_a if isinstance(out_a, (tuple, list)) else (out_a,)
                out_b = out_b if isinstance(out_b, (tuple, list)) else (out_b,)
                if any(not torch.equal(u, v) for u, v in zip(out_a, out_b)):
                    mismatches.append(key)
            for side, fn in ((0, fn_a), (1, fn_b)) if r % 2 == 0 else ((1, fn_b), (0, fn_a)):
                ms = statistics.median(harness.time_cuda(lambda: fn(x, w, b), trials=args.trials))
                times[key][side].append(ms)
        torch.cuda.empty_cache()
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    torch.backends.cudnn.allow_tf32 = True
    slower = []
    print(f"A = {args.base}, B = the tree; {args.rounds} alternating rounds of {args.trials} trials, L2 flushed")
    print(f"| {'kernel':22s} | {'variant':9s} | {'A ms':>7s} | {'B ms':>7s} | {'B/A':>6s} | same output |")
    print(f"|{'-' * 24}|{'-' * 11}|{'-' * 9}|{'-' * 9}|{'-' * 8}|-------------|")
    for key in keys:
        a, b = statistics.median(times[key][0]), statistics.median(times[key][1])
        ratio = b / a
        if ratio > 1 + args.limit:
            slower.append(key)
        print(f"| {key[0]:22s} | {key[1]:9s} | {a:7.4f} | {b:7.4f} | {ratio:6.3f} | {key not in mismatches!s:11s} |")
    print(f"{len(keys)} items; {len(slower)} more than {args.limit:.0%} slower; {len(mismatches)} with other output")
    return 1 if slower or mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
