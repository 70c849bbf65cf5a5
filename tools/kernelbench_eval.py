"""KernelBench's own checks on model_new.py, the steps scripts/run_and_check.py takes: its static checker, then
eval_kernel_against_ref (5 correctness trials, 100 timed trials, CUDA events, L2 flushed) and
measure_ref_program_time for the reference in eager mode and under torch.compile, in fp32, bf16 and fp16.

    KERNELBENCH_DIR=/path/to/KernelBench python3 tools/kernelbench_eval.py [--output results/<gpu>.json]

KERNELBENCH_DIR is a checkout of ScalingIntelligence/KernelBench; its src/ and the problem file
KernelBench/level2/25_Conv2d_Min_Tanh_Tanh.py are used. The LLM API clients its package imports at start (dotenv,
openai, litellm) play no part in evaluation, and where they are not installed an empty module stands in for each;
where pydantic is not installed, RecordModel stands in for the one class eval uses, a record of its results.
Results go under the key "kernelbench" of the output JSON; its other keys are kept.
"""
import argparse
import copy
import importlib.util
import json
import os
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

import torch  # noqa: E402

PROBLEM = os.path.join("KernelBench", "level2", "25_Conv2d_Min_Tanh_Tanh.py")
PRECISIONS = ("fp32", "bf16", "fp16")


class RecordModel:
    """pydantic.BaseModel as KernelBench's eval uses it (KernelExecResult: a record of keyword arguments over class
    defaults, a fresh copy of each mutable default), where pydantic is not installed."""

    def __init__(self, **kwargs):
        for name in getattr(type(self), "__annotations__", {}):
            setattr(self, name, copy.deepcopy(getattr(type(self), name)))
        self.__dict__.update(kwargs)

    def __repr__(self):
        return " ".join(f"{name}={value!r}" for name, value in self.__dict__.items())


LLM_CLIENTS = {"dotenv": {"load_dotenv": lambda *a, **k: None}, "openai": {"OpenAI": None},
               "litellm": {"completion": None}}
STAND_INS = {**LLM_CLIENTS, "pydantic": {"BaseModel": RecordModel}}


def import_kernelbench(root):
    for name, attrs in STAND_INS.items():
        if importlib.util.find_spec(name) is None:
            print(f"kernelbench_eval: {name} is not installed; a stand-in takes its place", flush=True)
            module = types.ModuleType(name)
            module.__dict__.update(attrs)
            sys.modules[name] = module
    sys.path.insert(0, os.path.join(root, "src"))
    from kernelbench import eval as kb_eval
    from kernelbench import timing
    from kernelbench.kernel_static_checker import validate_kernel_static

    return kb_eval, timing, validate_kernel_static


def evaluate(precision, ref_src, kernel_src, kb_eval, timing, build_dir, correct_trials, perf_trials):
    device = torch.device("cuda:0")
    result = kb_eval.eval_kernel_against_ref(
        original_model_src=ref_src, custom_model_src=kernel_src, measure_performance=True,
        timing_method="cuda_event", verbose=False, num_correct_trials=correct_trials, num_perf_trials=perf_trials,
        build_dir=build_dir, device=device, backend="cuda", precision=kb_eval.get_torch_dtype_from_string(precision))
    refs = {}
    for key, compiled in (("eager", False), ("compile", True)):
        stats = timing.measure_ref_program_time(
            ref_arch_name="Reference Program", ref_arch_src=ref_src, num_trials=perf_trials,
            use_torch_compile=compiled, timing_method="cuda_event", device=device, verbose=False,
            precision=precision)
        refs[key] = stats["mean"] if stats else None
    print(f"[{precision}] [Eval] Kernel eval result: {result}", flush=True)
    print(f"[{precision}] [Timing] PyTorch Reference Eager exec time: {refs['eager']} ms")
    print(f"[{precision}] [Timing] PyTorch Reference torch.compile time: {refs['compile']} ms")
    if result is None or not result.correctness:
        print(f"[{precision}] [Speedup] Speedup Not Available as Kernel did not pass correctness")
        metadata = {} if result is None else {k: str(v) for k, v in result.metadata.items()}
        return {"correct": False, "metadata": metadata, "eager_ms": refs["eager"], "compile_ms": refs["compile"]}
    ms = result.runtime
    print(f"[{precision}] [Timing] Custom Kernel exec time: {ms} ms")
    print(f"[{precision}] [Speedup] Speedup over eager: {refs['eager'] / ms:.2f}x")
    print(f"[{precision}] [Speedup] Speedup over torch.compile: {refs['compile'] / ms:.2f}x", flush=True)
    return {
        "correct": True,
        "ms": ms,
        "runtime_stats": {k: v for k, v in result.runtime_stats.items() if k in ("mean", "std", "min", "max",
                                                                                  "num_trials")},
        "eager_ms": refs["eager"],
        "compile_ms": refs["compile"],
        "vs_eager": refs["eager"] / ms,
        "vs_compile": refs["compile"] / ms,
        "correctness_trials": result.metadata.get("correctness_trials"),
        "excessive_speedup_flag": bool(result.metadata.get("excessive_speedup", False)),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default=None, help="results JSON to update (default results/<gpu>.json)")
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--correct-trials", type=int, default=5)
    p.add_argument("--perf-trials", type=int, default=100)
    args = p.parse_args()
    root = os.environ.get("KERNELBENCH_DIR")
    if not root or not os.path.isfile(os.path.join(root, PROBLEM)):
        p.error(f"KERNELBENCH_DIR must point to a KernelBench checkout with {PROBLEM}, got {root!r}")
    if not torch.cuda.is_available():
        p.error("KernelBench's evaluation needs a CUDA GPU")
    kb_eval, timing, validate_kernel_static = import_kernelbench(root)
    with open(os.path.join(root, PROBLEM)) as f:
        ref_src = f.read()
    with open(os.path.join(HERE, "model_new.py")) as f:
        kernel_src = f.read()

    summary = {"static_valid": True, "static_warnings": []}
    build_dir = tempfile.mkdtemp(prefix="kb_build_")
    for precision in args.precisions:
        valid, errors, warnings = validate_kernel_static(kernel_src, backend="cuda", precision=precision)
        print(f"[{precision}] static check: valid {valid}, errors {errors}, warnings {warnings}", flush=True)
        summary["static_valid"] &= valid
        summary["static_warnings"] = sorted(set(summary["static_warnings"]) | set(warnings))
        if not valid:  # run_and_check.py stops here
            summary[precision] = {"correct": False, "static_errors": errors}
            continue
        summary[precision] = evaluate(precision, ref_src, kernel_src, kb_eval, timing, build_dir,
                                      args.correct_trials, args.perf_trials)

    print("\n| precision | correct | ModelNew ms | eager ms | compile ms | vs eager | vs compile |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for precision in args.precisions:
        r = summary[precision]
        if r.get("correct"):
            print(f"| {precision} | True | {r['ms']:.3f} | {r['eager_ms']:.3f} | {r['compile_ms']:.3f} | "
                  f"{r['vs_eager']:.2f}x | {r['vs_compile']:.2f}x |")
        else:
            print(f"| {precision} | False | - | - | - | - | - |")
    print(f"static check valid: {summary['static_valid']}, warnings: {summary['static_warnings']}")

    from bench import default_output

    path = args.output or default_output()
    results = {}
    if os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
    results["kernelbench"] = summary
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {path}")
    return 0 if summary["static_valid"] and all(summary[p].get("correct") for p in args.precisions) else 1


if __name__ == "__main__":
    sys.exit(main())
