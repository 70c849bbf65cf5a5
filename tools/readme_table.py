"""Write the README's generated blocks from a bench.py results file.

    python tools/readme_table.py                   # rewrite the blocks of README.md from results/<gpu>.json
    python tools/readme_table.py --check           # exit 1 if README.md's blocks are not what this would write
    python tools/readme_table.py --json results/h100.json --readme README.md --commit 1a2b3c4

Two blocks, each between `<!-- NAME:begin -->` and `<!-- NAME:end -->`:
  results-table   eager / torch.compile (max-autotune) / ModelNew / speedup / KernelBench per precision and the
                  training step, then one line naming the GPU, the versions, the date and the commit (if known).
  speed-of-light  each precision's work and minimum traffic against the rates measured on the GPU
                  (docs/perf-notes.md), what the reference spends, and KernelBench's own speedups.

A missing value prints as an em dash. Standard library only (no torch), so it runs on any machine. render() is what
tests/test_docs.py compares the README against.
"""
import argparse
import importlib.util
import json
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _operands():
    """{FUSED_TABLE name: what its tensor cores multiply}, from python/constants.py."""
    spec = importlib.util.spec_from_file_location("kb25_constants", ROOT / "python" / "constants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {row.name: row.operand for row in module.FUSED_TABLE}
BLOCKS = ("results-table", "speed-of-light")
DASH = "—"
WIDTH = 116  # prose lines of the generated blocks, as the README's own

# The problem's fixed part (the batch shape comes from the JSON): Conv2d(16 -> 64, 3x3), one output channel.
OUT_CHANNELS = 64
KERNEL = 3
# Measured on one NVIDIA H200 (docs/perf-notes.md, "Ceilings on this GPU"): TFLOP/s of a cuBLAS 8192^3 GEMM per
# precision (TF32 and 16-bit by wgmma; strict fp32 on the FMA units) and a device-to-device copy in TB/s.
RATES = {
    "H200": {
        "tf32": (413.0, "cuBLAS TF32 GEMM, wgmma"),
        "strict_fp32": (50.2, "cuBLAS strict fp32 GEMM"),
        "bf16": (767.0, "cuBLAS bf16 GEMM, wgmma"),
        "fp16": (767.0, "bf16's GEMM rate; fp16 has the same peak"),
    },
}
# GPUs whose GEMM rates were not measured, and the GPU whose measured rates stand in, named so in the table: the H100
# SXM has the H200's SMs (132) and clocks (1,980 MHz), so the same compute peak; an assumption, not a measurement.
# Its memory differs, so no copy rate stands in.
RATE_STAND_INS = {"H100 80GB HBM3": "H200"}
COPY_TB_S = {"H200": 4.13}

# Rows of the results table: (label, where its eager / compile / ModelNew times live, KernelBench precision).
PRECISION_ROWS = (
    ("TF32 (default fp32)", "tf32", "fp32"),
    ("strict fp32", "strict_fp32", None),
    ("bf16", "bf16", "bf16"),
    ("fp16", "fp16", "fp16"),
)
ELEMENT_BYTES = {"tf32": 4, "strict_fp32": 4, "bf16": 2, "fp16": 2}


class BadInput(Exception):
    """One line: what was expected and what came."""


def _get(obj, *keys):
    """obj[k0][k1]...; None where a key is absent or a level is not a dict."""
    for key in keys:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def _num(value):
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _fmt(value, spec, suffix=""):
    return DASH if value is None else f"{value:{spec}}{suffix}"


def _ratio(a, b):
    return a / b if a is not None and b else None


def _times(result, precision):
    """(eager, compile max-autotune, ModelNew) median ms of one precision."""
    if precision == "tf32":
        ms = _get(result, "ms") or {}
        return _num(_get(ms, "eager")), _num(_get(ms, "compile_max_autotune")), _num(_get(ms, "model_new"))
    ms = _get(result, "modes", precision, "ms") or {}
    return _num(_get(ms, "eager")), _num(_get(ms, "compile")), _num(_get(ms, "model_new"))


def _gpu_key(result, table):
    device = str(_get(result, "device") or "")
    return next((k for k in table if k in device), None)


def _cudnn(version):
    version = _num(version)
    if version is None:
        return None
    v = int(version)
    major, rest = (v // 10000, v % 10000) if v >= 90000 else (v // 1000, v % 1000)
    return f"{major}.{rest // 100}"


def _shape(result):
    shape = _get(result, "shape")
    if isinstance(shape, list) and len(shape) == 4 and all(isinstance(s, int) for s in shape):
        return shape
    return None


def render_results_table(result):
    head = ("| precision | eager ms | torch.compile max-autotune ms | ModelNew ms | speedup vs eager | "
            "KernelBench ModelNew ms (its timer) |")
    lines = [head, "|---|---:|---:|---:|---:|---:|"]
    for label, precision, kb in PRECISION_ROWS:
        eager, compiled, new = _times(result, precision)
        kb_ms = _num(_get(result, "kernelbench", kb, "ms")) if kb else None
        lines.append(f"| {label} | {_fmt(eager, '.3f')} | {_fmt(compiled, '.3f')} | {_fmt(new, '.3f')} | "
                     f"{_fmt(_ratio(eager, new), '.2f', '×')} | {_fmt(kb_ms, '.3f')} |")
    n = _get(result, "training", "n")
    eager = _num(_get(result, "training", "ms", "reference"))
    new = _num(_get(result, "training", "ms", "model_new"))
    label = f"training step (N={n}, x and params)" if n is not None else "training step (x and params)"
    lines.append(f"| {label} | {_fmt(eager, '.3f')} | {DASH} | {_fmt(new, '.3f')} | "
                 f"{_fmt(_ratio(eager, new), '.2f', '×')} | {DASH} |")

    facts = [str(_get(result, "device") or "GPU not recorded")]
    for name, value in (("torch", _get(result, "torch")), ("CUDA", _get(result, "cuda")),
                        ("cuDNN", _cudnn(_get(result, "cudnn")))):
        if value is not None:
            facts.append(f"{name} {value}")
    if _get(result, "date"):
        facts.append(str(_get(result, "date")))
    if _get(result, "commit"):
        facts.append(f"commit {str(_get(result, 'commit'))[:7]}")  # git's short form
    trials = _get(result, "trials")
    kb_trials = _get(result, "kernelbench", "fp32", "runtime_stats", "num_trials")
    timing = f"median of {trials} trials" if trials else "median"
    if kb_trials:
        timing += f"; KernelBench: mean of {kb_trials}"
    lines += ["", f"{', '.join(facts)}; {timing}."]
    return "\n".join(lines)


def render_speed_of_light(result):
    shape = _shape(result)
    gpu = _gpu_key(result, {**RATES, **RATE_STAND_INS})
    source = RATE_STAND_INS.get(gpu, gpu)
    rates = RATES.get(source, {})
    copy_rate = COPY_TB_S.get(gpu)
    rated_on = "this GPU" if source == gpu else f"the {source}"
    if shape is None:
        return f"No problem shape in the results (expected \"shape\": [N, C, H, W], got {_get(result, 'shape')!r})."
    n, c, h, w = shape
    oh, ow = h - KERNEL + 1, w - KERNEL + 1
    flop = 2.0 * n * oh * ow * OUT_CHANNELS * c * KERNEL * KERNEL
    weights = OUT_CHANNELS * c * KERNEL * KERNEL + OUT_CHANNELS
    lines = [f"Work: {flop / 1e9:.1f} GFLOP (2 × {n * oh * ow:,} output pixels × {OUT_CHANNELS} channels × "
             f"K = {c * KERNEL * KERNEL}) in every precision. Minimum traffic: the input once, the output once.", "",
             "| precision | fused kernel | minimum traffic | ModelNew ms | achieved TFLOP/s | measured rate on "
             f"{rated_on}, TFLOP/s | fraction of that rate | DRAM bandwidth used |",
             "|---|---|---:|---:|---:|---|---:|---:|"]
    for label, precision, _ in PRECISION_ROWS:
        _, _, new = _times(result, precision)
        elem = ELEMENT_BYTES[precision]
        traffic = (n * c * h * w + n * oh * ow + weights) * elem
        if precision == "tf32":
            kernel = _get(result, "fused_kernel")
        else:
            kernel = _get(result, "modes", precision, "fused_kernel")
        achieved = _ratio(flop / 1e12, new * 1e-3) if new else None
        rate, rate_name = rates.get(precision, (None, None))
        operand = _operands().get(kernel)
        if precision == "tf32" and operand not in (None, "tf32"):  # the TF32 products on another type's tensor cores
            rate, rate_name = rates.get(operand, (None, None))
            rate_name = rate_name and f"{operand} operands: {rate_name.split(';')[0]}"
        fraction = _ratio(achieved, rate)
        bandwidth = _ratio(traffic / 1e12, new * 1e-3) if new else None
        used = f"{bandwidth:.2f} TB/s" if bandwidth is not None else DASH
        if bandwidth is not None and copy_rate:
            used += f" ({100 * bandwidth / copy_rate:.0f}% of a {copy_rate} TB/s copy)"
        lines.append(f"| {label} | {kernel or DASH} | {traffic / 1e6:.1f} MB | {_fmt(new, '.3f')} | "
                     f"{_fmt(achieved, '.1f')} | {_fmt(rate, '.1f')} ({rate_name or 'not measured'}) | "
                     f"{_fmt(None if fraction is None else 100 * fraction, '.0f', '%')} | {used} |")

    _, _, strict = _times(result, "strict_fp32")
    # Strict fp32 as three tensor-core products: on fp16 hi/lo parts (the *_f16x3 kernels) or on TF32 parts (3xTF32).
    on_f16 = "f16x3" in str(_get(result, "modes", "strict_fp32", "fused_kernel") or "")
    parts_rate = _get(rates, "bf16" if on_f16 else "tf32")
    if strict and parts_rate:
        work = 3 * flop
        parts, mma, gemm = ("fp16 hi/lo parts", "fp16", "bf16") if on_f16 else ("3xTF32", "TF32", "TF32")
        lines += ["", f"Strict fp32 runs as {parts} on the tensor cores: three {mma} products per multiply-add, "
                      f"{work / 1e9:.1f} GFLOP of {mma} MMAs, {work / 1e12 / (strict * 1e-3):.0f} TFLOP/s, "
                      f"{100 * work / 1e12 / (strict * 1e-3) / parts_rate[0]:.0f}% of the rate cuBLAS reaches in "
                      f"{gemm} "
                      f"(a measured rate, below the tensor cores' peak); it passes the strict fp32 GEMM rate "
                      f"because that GEMM runs on the FMA units."]

    tf32_rate = _get(rates, "tf32")
    eager = _num(_get(result, "ms", "eager"))
    activation = n * OUT_CHANNELS * oh * ow * 4
    if eager is not None:
        achieved = flop / 1e12 / (eager * 1e-3)
        line = (f"The reference (TF32, eager): {eager:.3f} ms, {achieved:.1f} TFLOP/s")
        if tf32_rate:
            line += f" = {100 * achieved / tf32_rate[0]:.1f}% of the TF32 rate"
        line += (f". Its conv writes a {n}×{OUT_CHANNELS}×{oh}×{ow} fp32 activation ({activation / 1e9:.2f} GB) "
                 f"and the min reads it back")
        if copy_rate:
            line += (f": {2 * activation / 1e9:.2f} GB of traffic, {2 * activation / 1e12 / copy_rate * 1e3:.2f} ms "
                     f"at the copy rate on its own")
        lines += ["", line + "."]

    kb = _get(result, "kernelbench")
    if isinstance(kb, dict):
        parts = []
        for precision in ("fp32", "bf16", "fp16"):
            entry = kb.get(precision)
            if not isinstance(entry, dict):
                continue
            vs = _num(entry.get("vs_eager"))
            trials = entry.get("correctness_trials")
            flag = entry.get("excessive_speedup_flag")
            part = f"{precision} {_fmt(vs, '.2f', '×')}"
            extra = [f"correctness trials {str(trials).strip('()').replace(' ', '')}" if trials else None,
                     "excessive_speedup flagged" if flag else None]
            parts.append((part, ", ".join(e for e in extra if e)))
        if parts:
            # said once where two or more precisions share them
            shared = parts[0][1] if len(parts) > 1 and len({extra for _, extra in parts}) == 1 else None
            text = "; ".join(part if shared is not None or not extra else f"{part} ({extra})" for part, extra in parts)
            lines += ["", "KernelBench's own evaluation, ModelNew against its eager reference: " + text
                      + (f" ({shared} in each)" if shared else "") + "."]
    return "\n".join(lines)


def _wrap(block):
    """Wrap the block's prose paragraphs (table rows and blank lines stay as they are)."""
    return "\n".join(line if line.startswith("|") or not line else textwrap.fill(line, WIDTH)
                     for line in block.split("\n"))


def render(result: dict) -> dict:
    """Block name -> the text between its markers (without the markers)."""
    if not isinstance(result, dict):
        raise BadInput(f"a results JSON object expected, got {type(result).__name__}")
    return {"results-table": _wrap(render_results_table(result)),
            "speed-of-light": _wrap(render_speed_of_light(result))}


def _markers(name):
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def _span(text, name):
    """(start, end) of what lies between the block's markers; BadInput unless there is exactly one pair, in order."""
    begin, end = _markers(name)
    nb, ne = text.count(begin), text.count(end)
    if nb != 1 or ne != 1 or text.index(begin) > text.index(end):
        raise BadInput(f"one '{begin}' followed by one '{end}' expected in the README, got {nb} begin and {ne} "
                       f"end markers" + (" in the wrong order" if nb == ne == 1 else ""))
    return text.index(begin) + len(begin), text.index(end)


def blocks_of(text):
    """Block name -> its current text in the README (stripped of the newlines next to the markers)."""
    out = {}
    for name in BLOCKS:
        start, stop = _span(text, name)
        out[name] = text[start:stop].strip("\n")
    return out


def rewrite(text, blocks):
    for name in BLOCKS:
        start, stop = _span(text, name)
        text = text[:start] + "\n" + blocks[name] + "\n" + text[stop:]
    return text


def _read(path, what):
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise BadInput(f"{what} expected at {path}, got {e.strerror or e}") from None


def load_result(path):
    text = _read(path, "a results JSON file")
    try:
        result = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"JSON expected in {path}, got a parse error at line {e.lineno}: {e.msg}") from None
    if not isinstance(result, dict):
        raise BadInput(f"a JSON object expected in {path}, got {type(result).__name__}")
    return result


def current_results(root=ROOT):
    """results/<gpu>.json: bench.py's one current run (results/ keeps no other; git keeps the earlier ones)."""
    found = sorted((Path(root) / "results").glob("*.json"))
    if len(found) != 1:
        raise BadInput(f"one results/<gpu>.json expected (the current run), got {len(found)}: "
                       f"{[f.name for f in found]}")
    return found[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="bench.py's results file (default: the one results/<gpu>.json)")
    p.add_argument("--readme", default=str(ROOT / "README.md"))
    p.add_argument("--commit", default=None,
                   help="the commit the results were measured at, where the JSON has no \"commit\" key (the "
                        "docs test renders from the JSON alone, so prefer writing the key)")
    p.add_argument("--check", action="store_true", help="exit 1 if the README's blocks differ; write nothing")
    args = p.parse_args(argv)
    try:
        if args.commit is not None and not re.fullmatch(r"[0-9a-f]{7,40}", args.commit):
            raise BadInput(f"--commit expects 7-40 lowercase hex digits, got {args.commit!r}")
        if args.json is None:
            args.json = str(current_results())
        result = load_result(args.json)
        if args.commit:
            result = {**result, "commit": args.commit}
        blocks = render(result)
        text = _read(args.readme, "a README")
        current = blocks_of(text)
    except BadInput as e:
        print(f"readme_table.py: {e}", file=sys.stderr)
        return 2
    if args.check:
        stale = [name for name in BLOCKS if current[name] != blocks[name]]
        if stale:
            print(f"readme_table.py: {args.readme}'s {' and '.join(stale)} block(s) differ from what {args.json} "
                  f"gives; run python tools/readme_table.py", file=sys.stderr)
            return 1
        return 0
    new_text = rewrite(text, blocks)
    if new_text != text:
        Path(args.readme).write_text(new_text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
