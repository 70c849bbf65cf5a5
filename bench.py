"""Time the reference (eager, torch.compile) against ModelNew's backends on the same inputs; write results JSON
and a picture of the medians next to it.

Every variant's output is checked against the eager reference before it is timed. Times: CUDA events around one
forward, an L2 flush (>= 2x L2) before each trial, median / min / max over the trials. Also measured: ModelNew
under torch.compile(fullgraph=True), and the host (CPU) time of one call on a tiny input.
"""
import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import harness
import reference
from tools import machine_code

COMPILED_REFERENCES = ("compile_default", "compile_max_autotune")
# Other people's implementations of the same model: ModelNew's speedup is also given against the fastest of them.
PEERS = ("eager", "compile_default", "compile_max_autotune", "cudnn_graph")
# The other precisions a user can ask of the model (harness.PRECISIONS: TF32 setting, dtype, tolerance, float64 bound).
MODES = ("strict_fp32", "bf16", "fp16")
SEED = 0  # --seed's default: the draws of the parameters and inputs that results/ records
TF32_FLOOR_MS = 0.37  # 152.2 GFLOP at the 413 TFLOP/s measured for a TF32 GEMM on an H200 (docs/perf-notes.md)


def log(msg):
    print(msg, flush=True)


def run_python(code, *argv, env=None):
    """The stdout lines of `python -c code argv...` in a fresh process at the repository's root; where it fails, its
    last lines and stderr raised."""
    proc = subprocess.run([sys.executable, "-c", code, *map(str, argv)], cwd=os.path.dirname(os.path.abspath(__file__)),
                          env=env, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0:
        raise RuntimeError("\n".join([*lines[-20:], proc.stderr]))
    return lines


def current_commit(root=os.path.dirname(os.path.abspath(__file__))):
    """HEAD's short hash where the tracked files but results/ (what runs write) are as HEAD has them; None where git
    fails or they differ (a copy of a working tree beside an older .git would otherwise name a commit whose code did
    not run): pass --commit then."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
    except OSError:  # no git
        return None
    if head.returncode != 0 or changed.returncode != 0:
        return None
    if changed.stdout.strip():
        log(f"[commit] the tracked files differ from HEAD {head.stdout.strip()}: no commit recorded (pass --commit)")
        return None
    return head.stdout.strip()


def parse_args():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trials", type=int, default=25, help="timed trials per variant (at least 20)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--skip-compile", action="store_true", help="do not time torch.compile (it takes minutes)")
    p.add_argument("--skip-modes", action="store_true", help="time only the default (TF32) precision")
    p.add_argument("--skip-portability", action="store_true",
                   help="do not time what each GPU profile of harness.DEVICE_PROFILES runs (emulated on this GPU)")
    p.add_argument("--skip-training", action="store_true",
                   help="do not time the training steps, kernels and forms, nor the autocast forward")
    p.add_argument("--measure-import", action="store_true",
                   help="also time a first import (compile into an empty cache) and a cached import")
    p.add_argument("--commit", default=None,
                   help="the commit the tree is at, recorded in the results (default: HEAD, where the tracked files "
                        "are as HEAD has them)")
    p.add_argument("--output", default=None, help="results file (default results/<gpu>.json)")
    p.add_argument("--spread-processes", type=int, default=3,
                   help="fresh processes that each time ModelNew on a fresh input (0: skip; at least 3 otherwise)")
    args = p.parse_args()
    if args.trials < 20:
        p.error("--trials must be at least 20")
    if 0 < args.spread_processes < 3:
        p.error(f"--spread-processes must be 0 or at least 3, got {args.spread_processes}")
    return args


def default_output():
    name = torch.cuda.get_device_name().lower()
    match = re.search(r"\b([a-z]\d{2,4}[a-z]?)\b", name.replace("nvidia", ""))
    tag = match.group(1) if match else re.sub(r"[^a-z0-9]+", "_", name).strip("_")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"{tag}.json")


def keep_other_tools(earlier, result):
    """The run's result, plus what other tools recorded in the results file before it (tools/kernelbench_eval.py:
    "kernelbench") where they ran at this run's commit; an earlier commit's sections would describe other code."""
    if earlier.get("commit") is None or earlier.get("commit") != result.get("commit"):
        return result
    return {**earlier, **result}


def measure_import():
    """Seconds for `import model_new` in a fresh process: into an empty extension cache, then from the cache."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=cache)
        # torch is imported before the clock starts: this times model_new's own import (build or cache load)
        code = "import torch, time; t = time.perf_counter(); import model_new; " \
               "assert model_new.extension_available(); print(time.perf_counter() - t)"
        for key in ("first", "cached"):
            log(f"  import model_new ({key}) ...")
            out[key] = float(run_python(code, env=env)[-1])
    return out


def make_cudnn_graph(ref, x):
    """The whole model as one cuDNN graph (conv_fprop -> bias -> tanh -> tanh -> reduction MIN over the channels;
    tanh is monotone, so taking the min last gives the same values), through cuDNN's frontend (the optional
    `nvidia-cudnn-frontend` package). fp32 operands with fp32 compute; cuDNN's top-ranked plan decides TF32 itself,
    and the output is checked like every other row. Returns fn(x) -> output."""
    import cudnn

    weight, bias = ref.conv.weight.detach(), ref.conv.bias.detach().reshape(1, -1, 1, 1)
    n, _, h, w = x.shape
    k = weight.shape[-1]
    out = torch.empty((n, 1, h - k + 1, w - k + 1), device=x.device, dtype=x.dtype)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    f32 = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(handle=handle, io_data_type=f32, intermediate_data_type=f32, compute_data_type=f32)
    x_t, w_t, b_t = graph.tensor_like(x), graph.tensor_like(weight), graph.tensor_like(bias)
    y = graph.conv_fprop(image=x_t, weight=w_t, padding=[0, 0], stride=[1, 1], dilation=[1, 1], compute_data_type=f32)
    y = graph.tanh(input=graph.tanh(input=graph.bias(input=y, bias=b_t)))
    m = graph.reduction(input=y, mode=cudnn.reduction_mode.MIN, compute_data_type=f32)
    m.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride())).set_data_type(f32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(max(graph.get_workspace_size(), 1), device=x.device, dtype=torch.uint8)

    def forward(inp):
        graph.execute({x_t: inp, w_t: weight, b_t: bias, m: out}, workspace, handle=handle)
        return out

    return forward


SPREAD_CODE = """
import statistics, sys, torch, harness
torch.backends.cudnn.allow_tf32 = True
model_seed, input_seed, trials, warmup = (int(a) for a in sys.argv[1:5])
new = harness.make_models(model_seed, device="cuda")[1].eval()
x = harness.make_input(seed=input_seed, device="cuda")
with torch.no_grad():
    print(statistics.median(harness.time_cuda(lambda: new(x), trials=trials, warmup=warmup)))
"""


def measure_spread(args):
    """ModelNew's median in fresh processes, each with its own input allocation (seed): the spread between them."""
    medians = []
    for i in range(args.spread_processes):
        log(f"  spread: process {i + 1}/{args.spread_processes} ...")
        medians.append(float(run_python(SPREAD_CODE, args.seed, args.seed + 100 + i, args.trials, args.warmup)[-1]))
    return {"min": min(medians), "median": statistics.median(medians), "max": max(medians),
            "processes": len(medians), "medians": medians}


def draw(rows, result, path):
    """Median ms per variant (log scale) with min-max whiskers and the TF32 floor."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [(name, row["time_ms"]) for name, row in rows.items() if "time_ms" in row]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(timed) + 1.5))
    ys = range(len(timed))
    medians = [t["median"] for _, t in timed]
    whiskers = [[t["median"] - t["min"] for _, t in timed], [t["max"] - t["median"] for _, t in timed]]
    ax.barh(ys, medians, xerr=whiskers, color=["tab:gray" if n in PEERS else "tab:blue" for n, _ in timed],
            capsize=3)
    for y, (_, t) in zip(ys, timed):
        ax.text(t["max"] * 1.04, y, f"{t['median']:.3f}", va="center", fontsize=8)
    ax.axvline(TF32_FLOOR_MS, color="tab:red", linestyle="--", label=f"TF32 floor {TF32_FLOOR_MS} ms")
    ax.set_yticks(list(ys), [n for n, _ in timed])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(0.8 * min(TF32_FLOOR_MS, min(t["min"] for _, t in timed)), 1.6 * max(t["max"] for _, t in timed))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel("median ms per forward (min-max whiskers), L2 flushed")
    ax.set_title(f"{result['device']}, x {tuple(result['shape'])}, {result['trials']} trials", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def time_row(name, fn, x, want, tol, args):
    """Check fn(x) against want at tol, then time it: (row, output) or (row, None) when it is wrong."""
    log(f"[{name}] checking output against the reference ...")
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn(x)
        torch.cuda.synchronize()
        ok, diff = harness.compare(out, want, atol=tol, rtol=tol)
    log(f"[{name}] first call {time.perf_counter() - t0:.1f} s, max abs diff {diff:.3g}, allclose {tol:g}: {ok}")
    correct = {"max_abs_diff": diff, "allclose_" + f"{tol:.0e}".replace("e-0", "e-"): ok}  # allclose_1e-4
    if not ok and name not in COMPILED_REFERENCES:
        log(f"[{name}] WRONG OUTPUT: not timed")
        return {"correct": correct}, None
    log(f"[{name}] timing {args.trials} trials ...")
    with torch.no_grad():
        times = harness.time_cuda(lambda: fn(x), trials=args.trials, warmup=args.warmup)
    return {"time_ms": harness.summarize(times), "correct": correct}, out


def bench_modes(args, init, shape):
    """Strict fp32 (TF32 off), bf16 and fp16 models: eager, torch.compile (max-autotune-no-cudagraphs) and ModelNew,
    each output checked against the reference in that precision and against the float64 truth."""
    modes = {}
    for mode in MODES:
        allow_tf32, dtype, tol, truth_bound = harness.PRECISIONS[mode]
        torch.backends.cudnn.allow_tf32 = allow_tf32
        ref, new = (m.to(dtype).eval() for m in harness.make_models(args.seed, init, device="cuda"))
        x = harness.make_input(shape, seed=args.seed + 1, device="cuda").to(dtype)
        with torch.no_grad():
            want = ref(x)
            truth = harness.float64_forward(x, ref.conv.weight, ref.conv.bias)
        ref_err = harness.max_abs_error(want, truth)
        entry = {"fused_kernel": new.fused_kernel(x), "tol": tol, "ms": {}}
        fns = [("eager", ref)]
        if not args.skip_compile:
            torch._dynamo.reset()
            fns.append(("compile", torch.compile(ref, mode="max-autotune-no-cudagraphs")))
        fns.append(("model_new", new))
        for name, fn in fns:
            row, out = time_row(f"{mode} {name}", fn, x, want, tol, args)
            entry["ms"][name] = row.get("time_ms", {}).get("median")
            if name == "model_new":
                err = harness.max_abs_error(out, truth) if out is not None else None
                entry.update(correct=out is not None and err <= truth_bound * ref_err,
                             max_abs_diff=row["correct"]["max_abs_diff"],
                             max_abs_error_vs_float64={"model_new": err, "reference": ref_err,
                                                       "bound": f"{truth_bound:g} x reference"},
                             time_ms=row.get("time_ms"))
            del out
        ms = entry["ms"]
        entry["speedup"] = {f"vs_{k}": ms[k] / ms["model_new"] for k in ("eager", "compile")
                            if ms.get(k) and ms.get("model_new")}
        modes[mode] = entry
        del ref, new, x, want, truth
        torch.cuda.empty_cache()
    torch.backends.cudnn.allow_tf32 = True
    return modes


def bench_portability(args, init, shape):
    """What each GPU profile (harness.DEVICE_PROFILES) runs, emulated on this GPU (model_new.emulate_device): per
    precision the fused kernel (None: cudnn_epilogue), the shared memory it asks for, its median time on the full
    problem here, and whether its output matches the reference in that precision. A precision's profiles are timed
    in interleaved rounds (harness.time_cuda_rounds): several profiles run the same kernel, and timed one after
    another the same kernel read up to 6% apart by its place in the run."""
    import model_new

    out = {name: {"capability": list(profile.capability), "smem_optin": profile.smem_optin, "precisions": {}}
           for name, profile in harness.DEVICE_PROFILES.items()}
    for precision, spec in harness.PRECISIONS.items():
        torch.backends.cudnn.allow_tf32 = spec.allow_tf32
        ref, new = (m.to(spec.dtype).eval() for m in harness.make_models(args.seed, init, device="cuda"))
        x = harness.make_input(shape, seed=args.seed + 1, device="cuda").to(spec.dtype)
        checked, calls = {}, {}
        with torch.no_grad():
            want = ref(x)
            for name in out:
                with harness.emulated(name):
                    checked[name] = (new.fused_kernel(x), *harness.compare(new(x), want, atol=spec.tol,
                                                                           rtol=spec.tol))
                calls[name] = lambda name=name: _emulated_call(name, new, x)
            times = harness.time_cuda_rounds(calls, trials=args.trials, warmup=args.warmup)
        for name, (kernel, ok, diff) in checked.items():
            ms = statistics.median(times[name])
            out[name]["precisions"][precision] = {
                "kernel": kernel, "smem_bytes": model_new.fused_kernel_smem_bytes(kernel) if kernel else None,
                "ms": ms, "correct": ok, "max_abs_diff": diff}
            log(f"[portability] {name:8s} {precision:12s} {str(kernel):16s} {ms:.3f} ms, "
                f"max abs diff {diff:.2e}, correct {ok}")
        del ref, new, x, want
        torch.cuda.empty_cache()
    torch.backends.cudnn.allow_tf32 = True
    return out


def _emulated_call(profile, model, x):
    with harness.emulated(profile):
        return model(x)


TRAIN_N = 32  # the training step's batch (its float64 truth and the reference's activation fit in memory)


def bench_training(args, init, shape):
    """One training step (forward and backward, x and the parameters all requiring grad, PyTorch's default TF32) at
    N = TRAIN_N: the median time (CUDA events, L2 flushed before each step), the peak memory the step allocates above
    what was allocated before it, and each gradient's relative error against the float64 truth, for the reference
    and ModelNew, in one process."""
    torch.backends.cudnn.allow_tf32 = True
    ref, new = (m.train() for m in harness.make_models(args.seed, init, device="cuda"))
    x = harness.make_input((TRAIN_N, *shape[1:]), seed=args.seed + 2, device="cuda").requires_grad_(True)
    oh, ow = shape[2] - init[2] + 1, shape[3] - init[2] + 1
    g = torch.randn(TRAIN_N, 1, oh, ow, generator=torch.Generator("cuda").manual_seed(args.seed + 3), device="cuda")
    out = {"n": TRAIN_N, "ms": {}, "peak_mb": {}, "grad_err_vs_f64": {}}
    w, b = ref.conv.weight.detach(), ref.conv.bias.detach()
    truth = harness.float64_grads(x.detach(), w, b, g)
    for name, model in (("reference", ref), ("model_new", new)):
        def clear():
            model.zero_grad(set_to_none=True)
            x.grad = None

        def step():
            clear()
            model(x).backward(g)

        step()
        grads = (x.grad, model.conv.weight.grad, model.conv.bias.grad)
        out["grad_err_vs_f64"][name] = {k: harness.relative_error(v, t) for k, v, t in zip("x weight bias".split(),
                                                                                         grads, truth)}
        del grads
        out["peak_mb"][name] = _peak_mb(step, clear)
        out["ms"][name] = statistics.median(harness.time_cuda(step, trials=args.trials, warmup=args.warmup))
        model.zero_grad(set_to_none=True)
        x.grad = None
        log(f"[training] {name:10s} step {out['ms'][name]:.3f} ms, peak {out['peak_mb'][name]:.1f} MB above the "
            f"inputs, gradient error vs float64 " + ", ".join(f"{k} {v:.2e}" for k, v in
                                                            out["grad_err_vs_f64"][name].items()))
    errs = out["grad_err_vs_f64"]
    out["speedup"] = out["ms"]["reference"] / out["ms"]["model_new"]
    out["peak_fraction"] = out["peak_mb"]["model_new"] / out["peak_mb"]["reference"]
    out["correct"] = all(errs["model_new"][k] <= 2 * errs["reference"][k] for k in errs["model_new"])
    del ref, new, x, g, truth
    torch.cuda.empty_cache()
    return out


# The training table: every form, batch and precision of the step a user runs, in one process.
TRAIN_FORMS = ("params_only", "x_and_params")
TRAIN_FORM_NS = (32, 128)
TRAIN_FORM_PRECISIONS = ("tf32", "bf16")


def _peak_mb(step, clear):
    """The peak memory one call of step allocates above what was allocated before it, in MB; clear() first drops
    what the last step left (its gradients), which the step would free before allocating them again."""
    clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 1e6


# The training steps run in a process of their own (bench_training_steps), in this order: bench_training's, then the
# forms' models pass by pass, so that every eager step (the reference and ModelNew) comes before the first
# torch.compile. A process that has compiled issues each later eager call about a third slower (docs/perf-notes.md,
# "Host and dispatch"), and at N = 32 ModelNew's step is the host's.
TRAIN_FORM_PASSES = (("reference", "model_new"), ("reference_compiled",))

TRAINING_CODE = """
import json, sys, types, bench, reference
args = types.SimpleNamespace(seed=int(sys.argv[1]), trials=int(sys.argv[2]), warmup=int(sys.argv[3]))
init, shape = reference.get_init_inputs(), (reference.batch_size, reference.in_channels, reference.height,
                                            reference.width)
training = bench.bench_training(args, init, shape)
print(bench.TRAINING_MARK + json.dumps({"training": training, "forms": bench.time_training_forms(args, init, shape)}))
"""
TRAINING_MARK = "TRAINING_JSON "  # starts the child's result line (a compile worker may write to its stdout too)


def bench_training_steps(args):
    """(bench_training, time_training_forms) in a fresh process, on reference.py's model and input shape, the
    child's log lines passed on."""
    lines = run_python(TRAINING_CODE, args.seed, args.trials, args.warmup)
    results = [line for line in lines if line.startswith(TRAINING_MARK)]
    for line in lines:
        if not line.startswith(TRAINING_MARK):
            log(line)
    if not results:
        raise RuntimeError(f"the training steps' process printed no line starting {TRAINING_MARK!r}")
    result = json.loads(results[-1][len(TRAINING_MARK):])
    return result["training"], result["forms"]


def time_training_forms(args, init, shape, device="cuda"):
    """Each training form, batch and precision: the step's median time (CUDA events, L2 flushed before each step) for
    the reference, torch.compile(reference) (default mode: the anchor a training user would otherwise pick) and
    ModelNew, and the peak memory above the inputs for the reference and ModelNew, timed in TRAIN_FORM_PASSES' order.
    params_only: the data needs no grad and the loss is the MSE against a fixed target (a training loop's step);
    x_and_params: x needs grad too and the output takes backward(g) (bench_training's form). "ms" also holds
    "pytorch_floor" (_time_pytorch_floor: the step's own PyTorch calls, on which a host-bound step waits). A list of
    {"form", "n", "precision", "ms", "peak_mb", "vs_reference", "vs_reference_compiled"}. (device: "cpu" only for the
    test of the order, which stands in for the timer.)"""
    entries = {}
    for names in TRAIN_FORM_PASSES:
        for precision in TRAIN_FORM_PRECISIONS:
            spec = harness.PRECISIONS[precision]
            torch.backends.cudnn.allow_tf32 = spec.allow_tf32
            for n in TRAIN_FORM_NS:
                oh, ow = shape[2] - init[2] + 1, shape[3] - init[2] + 1
                gen = torch.Generator(device).manual_seed(args.seed + 5)
                x0 = harness.make_input((n, *shape[1:]), seed=args.seed + 4, device=device).to(spec.dtype)
                target = (2 * torch.rand(n, 1, oh, ow, generator=gen, device=device) - 1).to(spec.dtype)
                g = torch.randn(n, 1, oh, ow, generator=gen, device=device).to(spec.dtype)
                for form in TRAIN_FORMS:
                    ref, new = (m.train().to(spec.dtype) for m in harness.make_models(args.seed, init, device=device))
                    x = x0.detach().requires_grad_(form == "x_and_params")
                    entry = entries.setdefault((precision, n, form), {"form": form, "n": n, "precision": precision,
                                                                      "ms": {}, "peak_mb": {}})
                    for name in names:
                        model = torch.compile(ref) if name == "reference_compiled" else {"reference": ref,
                                                                                         "model_new": new}[name]

                        def clear():
                            model.zero_grad(set_to_none=True)
                            x.grad = None

                        def step():
                            clear()
                            out = model(x)
                            if form == "params_only":
                                torch.nn.functional.mse_loss(out, target).backward()
                            else:
                                out.backward(g)

                        step()  # compiles, or builds what the first backward builds
                        if name != "reference_compiled":
                            entry["peak_mb"][name] = _peak_mb(step, clear)
                        # 10 trials a model: steps of 1-16 ms, and the 8 compiles keep bench.py within its 10 minutes
                        entry["ms"][name] = statistics.median(harness.time_cuda(step, trials=min(args.trials, 10),
                                                                                warmup=args.warmup))
                    if "model_new" in names:
                        entry["ms"]["pytorch_floor"] = _time_pytorch_floor(form, new, target, g, args)
                    del ref, new, x
                    if "reference_compiled" in names:
                        torch._dynamo.reset()
                    torch.cuda.empty_cache()
                del x0, target, g
    torch.backends.cudnn.allow_tf32 = True
    forms = []
    for entry in entries.values():
        ms = entry["ms"]
        entry["vs_reference"] = ms["reference"] / ms["model_new"]
        entry["vs_reference_compiled"] = ms["reference_compiled"] / ms["model_new"]
        forms.append(entry)
        log(f"[training forms] {entry['form']:12s} N={entry['n']:3d} {entry['precision']}: reference "
            f"{ms['reference']:.3f}, compiled {ms['reference_compiled']:.3f}, ModelNew {ms['model_new']:.3f} ms "
            f"({entry['vs_reference']:.1f}x / {entry['vs_reference_compiled']:.1f}x; PyTorch's part alone "
            f"{ms['pytorch_floor']:.3f}); peak "
            f"{entry['peak_mb']['reference']:.0f} / {entry['peak_mb']['model_new']:.0f} MB")
    return forms


def _time_pytorch_floor(form, model, target, g, args):
    """The part of a training form's step that is PyTorch's whatever the model: the step with the model's forward
    and backward left out, a leaf standing for its output (the parameters' zero_grad, then the MSE loss and its
    backward, or backward(g)). Its time is the host's issue of those calls; a host-bound step cannot go below it."""
    out = torch.empty_like(target).uniform_(-1, 1).requires_grad_(True)

    def step():
        model.zero_grad(set_to_none=True)
        out.grad = None
        if form == "params_only":
            torch.nn.functional.mse_loss(out, target).backward()
        else:
            out.backward(g)

    step()
    return statistics.median(harness.time_cuda(step, trials=min(args.trials, 10), warmup=args.warmup))


def bench_training_kernels(args, init, shape):
    """At N = 128 in TF32: the median time of each kernel a training step runs, on its own (L2 flushed): the
    inference forward, the saving forward, the weight gradient (dW and db, with its partials' reduce) and the input
    gradient."""
    import model_new

    torch.backends.cudnn.allow_tf32 = True
    _, new = harness.make_models(args.seed, init, device="cuda")
    w, b = new.conv.weight.detach(), new.conv.bias.detach()
    x = harness.make_input((128, *shape[1:]), seed=args.seed + 6, device="cuda")
    auto = model_new.OP_BACKENDS.index("auto")
    with torch.no_grad():
        out, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, auto)
        g = torch.randn(out.shape, generator=torch.Generator("cuda").manual_seed(args.seed + 7), device="cuda")
        backward = torch.ops.kb25.conv_min_tanh2_backward
        kernels = {
            "inference_forward": lambda: model_new.conv_min_tanh2(x, w, b, auto),
            "saving_forward": lambda: model_new.conv_min_tanh2_with_argmin(x, w, b, auto),
            "grad_weight": lambda: backward(g, x, w, argmin, pre_min, *harness.BACKWARD_PARTS["grad_weight"]),
            "grad_input": lambda: backward(g, x, w, argmin, pre_min, *harness.BACKWARD_PARTS["grad_input"]),
        }
        # interleaved: the saving forward's bar is a ratio to the inference forward's time
        out_ms = {name: statistics.median(times) for name, times in
                  harness.time_cuda_rounds(kernels, trials=args.trials, warmup=args.warmup).items()}
    log("[training kernels] N=128 tf32: " + ", ".join(f"{k} {v:.3f} ms" for k, v in out_ms.items()) +
        f"; saving / inference {out_ms['saving_forward'] / out_ms['inference_forward']:.2f}x")
    del x, out, argmin, pre_min, g
    torch.cuda.empty_cache()
    return out_ms


def bench_strict_grad_err(args, init, shape):
    """In strict fp32 (TF32 off) at N = TRAIN_N: each gradient's relative error against the float64 truth, for
    ModelNew and the reference (x and the parameters needing grad, backward(g))."""
    torch.backends.cudnn.allow_tf32 = False
    ref, new = (m.train() for m in harness.make_models(args.seed, init, device="cuda"))
    x = harness.make_input((TRAIN_N, *shape[1:]), seed=args.seed + 2, device="cuda").requires_grad_(True)
    oh, ow = shape[2] - init[2] + 1, shape[3] - init[2] + 1
    g = torch.randn(TRAIN_N, 1, oh, ow, generator=torch.Generator("cuda").manual_seed(args.seed + 3), device="cuda")
    truth = harness.float64_grads(x.detach(), ref.conv.weight.detach(), ref.conv.bias.detach(), g)
    errs = {}
    for name, model in (("model_new", new), ("reference", ref)):
        model.zero_grad(set_to_none=True)
        x.grad = None
        model(x).backward(g)
        grads = (x.grad, model.conv.weight.grad, model.conv.bias.grad)
        errs[name] = {k: harness.relative_error(v, t) for k, v, t in zip(("x", "weight", "bias"), grads, truth)}
    log("[strict gradients] relative error vs float64, ModelNew / reference: " +
        ", ".join(f"{k} {errs['model_new'][k]:.2e} / {errs['reference'][k]:.2e}" for k in errs["model_new"]))
    torch.backends.cudnn.allow_tf32 = True
    del ref, new, x, g, truth
    torch.cuda.empty_cache()
    return errs


def bench_autocast(args, init, shape):
    """ModelNew and the reference in float32 under torch.autocast("cuda", dtype), no grad: the output's dtype, the
    fused kernel that runs (the one for the autocast dtype that reads float32 x), the median time (the weights' cast
    included, as autocast does it on every call) and whether the output matches the reference's there at 1e-2; and
    the native 16-bit ModelNew (model and x in dtype, x cast before the timing), timed in rounds interleaved with
    it (harness.time_cuda_rounds), since the bar is their ratio."""
    torch.backends.cudnn.allow_tf32 = True
    ref, new = (m.eval() for m in harness.make_models(args.seed, init, device="cuda"))
    x = harness.make_input(shape, seed=args.seed + 1, device="cuda")
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        native, x_native = harness.make_models(args.seed, init, device="cuda")[1].to(dtype).eval(), x.to(dtype)
        with torch.no_grad():
            with torch.autocast("cuda", dtype=dtype):
                want, got = ref(x), new(x)
                kernel = new.fused_kernel(x)  # the one that rounds float32 x itself, where the GPU has it
            times = harness.time_cuda_rounds({"autocast": lambda: _autocast_call(dtype, new, x),
                                              "native": lambda: native(x_native)},
                                             trials=args.trials, warmup=args.warmup)
        ok, diff = harness.compare(got.float(), want.float(), atol=harness.LOW_PRECISION_TOL,
                                   rtol=harness.LOW_PRECISION_TOL)
        ms, native_ms = statistics.median(times["autocast"]), statistics.median(times["native"])
        out[name] = {"out_dtype": str(got.dtype), "reference_dtype": str(want.dtype),
                     "kernel": kernel, "ms": ms, "native_ms": native_ms, "vs_native": ms / native_ms,
                     "correct": ok and got.dtype == want.dtype, "max_abs_diff": diff}
        log(f"[autocast] {name}: {out[name]['out_dtype']} (reference {out[name]['reference_dtype']}), "
            f"{out[name]['kernel']}, {ms:.3f} ms, native {native_ms:.3f} ms ({ms / native_ms:.2f}x), "
            f"max abs diff {diff:.2e}, correct {out[name]['correct']}")
        del want, got, native, x_native
    del ref, new, x
    torch.cuda.empty_cache()
    return out


def _autocast_call(dtype, model, x):
    with torch.autocast("cuda", dtype=dtype):
        return model(x)


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        log("bench.py needs a CUDA GPU; none is available here.")
        return 2

    import_s = measure_import() if args.measure_import else None
    import model_new  # builds the extension; a failed build raises here with the compiler's message

    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default; the reference is defined under it
    init = reference.get_init_inputs()
    shape = (reference.batch_size, reference.in_channels, reference.height, reference.width)
    ref, new = harness.make_models(args.seed, init, device="cuda")
    ref.eval()
    new.eval()
    x = harness.make_input(shape, seed=args.seed + 1, device="cuda")
    flops = harness.problem_flops(*shape)

    with torch.no_grad():
        want = ref(x)
    # Host time first: once torch.compile has run in a process, every eager call there costs about a third more
    # host time (a plain torch.relu included), so this is measured before anything is compiled.
    log("host time per call on a (1, 16, 8, 8) input ...")
    host_us = harness.measure_host_us(new)

    def model_with(backend):
        return harness.make_models(args.seed, init, device="cuda", backend=backend)[1].eval()

    variants = [("eager", ref)]
    if not args.skip_compile:
        variants += [
            ("compile_default", torch.compile(ref)),
            ("compile_max_autotune", torch.compile(ref, mode="max-autotune-no-cudagraphs")),
        ]
    cudnn_graph_note = None
    try:
        variants.append(("cudnn_graph", make_cudnn_graph(ref, x)))
    except ImportError as e:
        cudnn_graph_note = f"not timed: the optional nvidia-cudnn-frontend package is not installed ({e})"
        log(f"[cudnn_graph] {cudnn_graph_note}")
    variants += [(backend, model_with(backend)) for backend in ("cudnn_epilogue", "fused_mma_sync", "fused")]
    variants += [("model_new", new)]
    if not args.skip_compile:
        variants += [("model_new_compiled", torch.compile(new, fullgraph=True))]

    rows = {}
    for name, fn in variants:
        rows[name], out = time_row(name, fn, x, want, harness.ATOL, args)
        del out
        # The fused kernel each of ModelNew's rows ran (None: cudnn_epilogue, or not a ModelNew).
        kernel_of = getattr(fn, "fused_kernel", None)
        if kernel_of is not None and "time_ms" in rows[name]:
            rows[name]["fused_kernel"] = kernel_of(x)
    del variants
    torch._dynamo.reset()
    modes = {} if args.skip_modes else bench_modes(args, init, shape)
    portability = {} if args.skip_portability else bench_portability(args, init, shape)
    training_kernels = None if args.skip_training else bench_training_kernels(args, init, shape)
    strict_grad_err = None if args.skip_training else bench_strict_grad_err(args, init, shape)
    training, training_forms = (None, None) if args.skip_training else bench_training_steps(args)
    autocast = None if args.skip_training else bench_autocast(args, init, shape)
    spread = {"model_new": measure_spread(args)} if args.spread_processes else None
    def med(name):
        return rows.get(name, {}).get("time_ms", {}).get("median")

    compile_modes = [m for m in ("compile_default", "compile_max_autotune") if med(m) is not None]
    best_compile = min((med(m) for m in compile_modes), default=None)
    ms = {
        "eager": med("eager"),
        "compile": best_compile,
        "compile_default": med("compile_default"),
        "compile_max_autotune": med("compile_max_autotune"),
        "cudnn_epilogue": med("cudnn_epilogue"),
        "fused": med("fused"),
        "fused_mma_sync": med("fused_mma_sync"),
        "model_new": med("model_new"),
        "model_new_compiled": med("model_new_compiled"),
        "cudnn_graph": med("cudnn_graph"),
    }
    peers = {name: med(name) for name in PEERS if med(name) is not None}
    best_peer = min(peers, key=peers.get)
    compiled_row = rows.get("model_new_compiled", {})
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "shape": list(shape),
        "model_new_backend": new.resolve_backend(x),
        "fused_mma": model_new.fused_mma_kind(),
        "fused_kernel": new.fused_kernel(x),
        "trials": args.trials,
        "ms": ms,
        "speedup": {
            "vs_eager": ms["eager"] / ms["model_new"] if ms["model_new"] else None,
            "vs_compile": best_compile / ms["model_new"] if best_compile and ms["model_new"] else None,
            "vs_best_peer": peers[best_peer] / ms["model_new"] if ms["model_new"] else None,
            "best_peer": best_peer,
        },
        "cudnn_graph_note": cudnn_graph_note,
        "spread": spread,
        "correct": rows["model_new"]["correct"],
        "variants": rows,
        "compile_fullgraph": bool(compiled_row.get("correct", {}).get("allclose_1e-4")) and "time_ms" in compiled_row,
        "modes": modes,
        "portability": portability,
        "training": training,
        "training_forms": training_forms,
        "training_kernels_ms": training_kernels,
        "training_strict_grad_err": strict_grad_err,
        "autocast": autocast,
        "host_us": host_us,
        "import_s": import_s,
        "date": time.strftime("%Y-%m-%d"),
        "commit": args.commit or current_commit(),
        # What ran, as machine code: a digest of each kernel's SASS (tools/machine_code.py). A later tree whose
        # digests are these runs the same kernels, so these results still describe it.
        "machine_code": machine_code.of_extension(model_new, machine_code.device_arch()),
    }

    log("")
    log(f"{result['device']} | torch {result['torch']} | CUDA {result['cuda']} | cuDNN {result['cudnn']} | "
        f"x {tuple(shape)} | {args.trials} trials, L2 flushed")
    header = f"| {'variant':<22} | {'median ms':>9} | {'min':>7} | {'max':>7} | {'vs eager':>8} | " \
             f"{'vs compile':>10} | {'TFLOP/s':>7} | {'% of TF32 floor':>15} | {'max abs diff':>12} |"
    log(header)
    log("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for name, row in rows.items():
        t = row.get("time_ms")
        if t is None:
            log(f"| {name:<22} | {'wrong':>9} |")
            continue
        vs_compile = f"{best_compile / t['median']:.2f}x" if best_compile else "-"
        log(f"| {name:<22} | {t['median']:9.3f} | {t['min']:7.3f} | {t['max']:7.3f} | "
            f"{ms['eager'] / t['median']:7.2f}x | {vs_compile:>10} | {flops / t['median'] / 1e9:7.1f} | "
            f"{100 * TF32_FLOOR_MS / t['median']:14.0f}% | {row['correct']['max_abs_diff']:12.2e} |"
            + (f" {row['fused_kernel']}" if row.get("fused_kernel") else ""))
    for mode, entry in modes.items():
        ms_m = entry["ms"]
        log(f"{mode:<12} ({entry['fused_kernel']}): " + ", ".join(
            f"{k} {v:.3f} ms" if v else f"{k} -" for k, v in ms_m.items()) + " | " + ", ".join(
            f"{k} {v:.2f}x" for k, v in entry["speedup"].items()) + f" | max abs diff {entry['max_abs_diff']:.2e} "
            f"(tol {entry['tol']:g}), vs float64 {entry['max_abs_error_vs_float64']['model_new'] or float('nan'):.2e} "
            f"(reference {entry['max_abs_error_vs_float64']['reference']:.2e}), correct: {entry['correct']}")
    log(f"best peer: {best_peer} {peers[best_peer]:.3f} ms; ModelNew {result['speedup']['vs_best_peer']:.2f}x faster")
    if spread:
        sp = spread["model_new"]
        log(f"ModelNew median over {sp['processes']} fresh processes: min {sp['min']:.3f}, median {sp['median']:.3f}, "
            f"max {sp['max']:.3f} ms ({', '.join(f'{v:.3f}' for v in sp['medians'])})")
    log(f"host us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in host_us.items()))
    if import_s:
        log(f"import model_new: first (compile) {import_s['first']:.1f} s, cached {import_s['cached']:.2f} s")
    if training:
        log(f"training step at N={training['n']}: reference {training['ms']['reference']:.3f} ms, ModelNew "
            f"{training['ms']['model_new']:.3f} ms ({training['speedup']:.2f}x); peak {training['peak_mb']['reference']:.0f}"
            f" / {training['peak_mb']['model_new']:.0f} MB ({100 * training['peak_fraction']:.1f}%); gradients within 2x "
            f"of the reference's float64 error: {training['correct']}")

    path = args.output or default_output()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.exists(path):
        with open(path) as f:
            result = keep_other_tools(json.load(f), result)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    log(f"wrote {path}")
    picture = os.path.splitext(path)[0] + ".png"
    draw(rows, result, picture)
    log(f"wrote {picture}")
    ok = result["correct"]["allclose_1e-4"] and all(entry["correct"] for entry in modes.values()) and all(
        p["correct"] for entry in portability.values() for p in entry["precisions"].values())
    ok = ok and (training is None or training["correct"]) and all(a["correct"] for a in (autocast or {}).values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
