"""ModelNew's kernels alone, without torch (tools/kernels_alone.cu): build a model_new.py's kernels into one
executable, run it, or compare two builds in alternating processes.

    python tools/kernels_alone.py build -o build/alone/tree                       # the current model_new.py
    python tools/kernels_alone.py build -o build/alone/base --source other/model_new.py
    python tools/kernels_alone.py ab build/alone/base build/alone/tree --rounds 3 [-- --only grad_input ...]

`build` compiles the file's CUDA source with the extension's nvcc flags (tools/machine_code.py's) and checks that
each of the file's kernels has the same machine code in the executable as in the extension's build: what it times is
what the extension runs. It compiles in bench.py's weight and bias (harness.make_reference): the argmins, and so the
backward kernels' times, depend on them; `-- --params spread` runs on another draw. Build where nvcc is (no GPU
needed), run where the GPU is: a run takes seconds, where loading a variant as an extension first builds it on the
GPU's machine.

`ab` runs A and B in turn, `--rounds` times each (arguments after `--` go to both), and prints each case's median
time over the rounds, B's ratio to A, and whether their checksums agree (every byte each kernel wrote); exit 1 if
any differ or no case ran in both.
"""
import argparse
import glob
import os
import re
import statistics
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import machine_code  # noqa: E402

ROOT = os.path.dirname(HERE)
HARNESS = os.path.join(HERE, "kernels_alone.cu")
LINE = re.compile(r"^(\S+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+([0-9a-f]{16})$")


def benchmark_params():
    """The weight (in Conv2d's order) and then the bias of bench.py's model (harness.make_reference at bench.py's
    default seed), as float32 bit patterns."""
    import torch

    sys.path.insert(0, ROOT)
    import bench
    import harness

    conv = harness.make_reference(bench.SEED).conv
    values = torch.cat([conv.weight.detach().flatten(), conv.bias.detach().flatten()])
    return list(struct.unpack(f"<{values.numel()}I", values.numpy().tobytes()))


def params_header(bits):
    """The harness's include of the parameters: kBenchmarkParams, float32 bit patterns."""
    rows = [", ".join(f"0x{v:08x}u" for v in bits[i:i + 8]) for i in range(0, len(bits), 8)]
    return ("// bench.py's weight and bias (tools/kernels_alone.py's benchmark_params), float32 bit patterns.\n"
            f"constexpr unsigned kBenchmarkParams[{len(bits)}] = {{\n    " + ",\n    ".join(rows) + "};\n")


def build(source, out, arch=machine_code.DEFAULT_ARCH, nvcc="nvcc"):
    """Compile `source`'s kernels and the harness into the executable `out`; return the digests of its kernels,
    which must equal tools/machine_code.py's of the same source."""
    module = machine_code.load_module(source, "model_new_alone")
    flags = machine_code.build_flags(module, arch)
    if arch == "sm_90a":
        flags.append("-DKB25_BUILT_FOR_SM90A")  # as the extension's C++ side is told: wgmma code is there
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        kernels = os.path.join(tmp, "kernels.cuh")
        with open(kernels, "w") as f:
            f.write(module.cuda_source())
        params = os.path.join(tmp, "params.h")
        with open(params, "w") as f:
            f.write(params_header(benchmark_params()))
        run = subprocess.run([nvcc, *flags, f'-DKB25_KERNELS_SOURCE="{kernels}"', f'-DKB25_PARAMS="{params}"',
                              "-keep", "-keep-dir", tmp,
                              HARNESS, "-o", out], capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"nvcc failed on the harness with {source}'s kernels:\n{run.stderr[-4000:]}")
        # One arch: nvcc keeps kernels_alone.cubin (and the device link's kernels_alone_dlink.cubin).
        cubins = [c for c in glob.glob(os.path.join(tmp, "kernels_alone*.cubin")) if "_dlink" not in c]
        if len(cubins) != 1:
            raise RuntimeError(f"expected one {arch} cubin among nvcc's kept files, got {cubins}")
        with open(cubins[0], "rb") as f:
            return machine_code.digests_of_cubin(f.read(), machine_code.tag_table(module))


def differing_kernels(harness_digests, extension_digests):
    """The extension's kernels whose machine code differs in the harness, or that the harness lacks."""
    return sorted(k for k, v in extension_digests.items() if harness_digests.get(k) != v)


def parse(text):
    """{case: (kernel, median ms, min ms, checksum)} from a run's output; comment lines and cases with no kernel on
    the profile are skipped."""
    cases = {}
    for line in text.splitlines():
        found = LINE.match(line.strip())
        if found:
            case, kernel, median, least, checksum = found.groups()
            cases[case] = (kernel, float(median), float(least), checksum)
    return cases


def compare(runs_a, runs_b):
    """Rows (case, kernel A, kernel B, median A, median B, B / A, checksums equal) over the cases both runs have: the
    median over rounds of each round's median."""
    rows = []
    for case in runs_a[0]:
        if not all(case in r for r in runs_a + runs_b):
            continue
        a = statistics.median(r[case][1] for r in runs_a)
        b = statistics.median(r[case][1] for r in runs_b)
        sums = {r[case][3] for r in runs_a + runs_b}
        rows.append((case, runs_a[0][case][0], runs_b[0][case][0], a, b, b / a, len(sums) == 1))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile a model_new.py's kernels with the harness")
    b.add_argument("-o", "--out", required=True)
    b.add_argument("--source", default=os.path.join(ROOT, "model_new.py"))
    b.add_argument("--arch", default=machine_code.DEFAULT_ARCH)
    b.add_argument("--nvcc", default="nvcc")
    a = sub.add_parser("ab", help="run two builds in turn and compare them")
    a.add_argument("a")
    a.add_argument("b")
    a.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # after --: arguments for both runs
    args = p.parse_args(argv[:len(argv) - len(extra) - (1 if "--" in argv else 0)])
    if args.command == "build":
        if not re.fullmatch(r"sm_\d+a?", args.arch):
            p.error(f"--arch expects an nvcc code name such as sm_90a, got {args.arch!r}")
        harness = build(args.source, args.out, args.arch, args.nvcc)
        extension = machine_code.digests(args.source, args.arch, args.nvcc)["kernels"]
        differ = differing_kernels(harness, extension)
        print(f"{args.out}: {len(extension) - len(differ)} of {len(extension)} kernels as the extension builds them")
        for name in differ:
            print(f"  differs: {name}")
        return 1 if differ else 0
    if args.rounds < 1:
        p.error(f"--rounds expects at least 1, got {args.rounds}")
    runs = {args.a: [], args.b: []}
    for _ in range(args.rounds):
        for exe in (args.a, args.b):
            run = subprocess.run([os.path.abspath(exe), *extra], capture_output=True, text=True)
            if run.returncode != 0:
                print(f"{exe} failed (rc {run.returncode}):\n{run.stderr[-2000:]}")
                return 1
            runs[exe].append(parse(run.stdout))
    print(f"{'case':22} {'kernel':26} {'A ms':>8} {'B ms':>8} {'B/A':>6}  checksums")
    rows = compare(runs[args.a], runs[args.b])
    for case, ka, kb, ta, tb, ratio, equal in rows:
        kernel = ka if ka == kb else f"{ka}|{kb}"
        print(f"{case:22} {kernel:26} {ta:8.4f} {tb:8.4f} {ratio:6.3f}  {'equal' if equal else 'DIFFER'}")
    return 0 if rows and all(row[-1] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
