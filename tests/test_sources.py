"""CPU checks of the sources, of what the results claim about them, and of the tools that read profiles: model_new.py
is the bundle of csrc/ and python/, csrc/ builds on its own to the same machine code, results/<gpu>.json describes the
kernels of this tree, tools/kernels_alone.py times the extension's machine code, and tools/ncu_hotspots.py reads
Nsight Compute's source page."""
import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import kernels_alone  # noqa: E402
import machine_code  # noqa: E402



def _bundle(*args, root=ROOT):
    return subprocess.run([sys.executable, str(root / "tools" / "bundle.py"), *args], capture_output=True, text=True)


def test_bundle_is_current():
    run = _bundle("--check")
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("edit, stale", [
    (("csrc/op.cpp", "\n// an edit the bundle has not seen\n"), "model_new.py"),
    (("python/ops.py", "\n# an edit the bundle has not seen\n"), "model_new.py"),
    (("python/constants.py", None), "csrc/generated/fused_table.cuh"),
], ids=["csrc", "python", "table"])
def test_bundle_check_names_what_is_stale(tmp_path, edit, stale):
    for part in ("csrc", "python"):
        shutil.copytree(ROOT / part, tmp_path / part)
    (tmp_path / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "bundle.py", tmp_path / "tools")
    shutil.copy(ROOT / "model_new.py", tmp_path)
    assert _bundle("--check", root=tmp_path).returncode == 0
    path, text = edit
    target = tmp_path / path
    if text is None:  # one row of the instantiation table changed: its ring grows by a slot
        source = target.read_text()
        row = 'FusedKernel("sm90_tf32", "wgmma", "tf32", "tf32", "fp32", 256, 2, 4, 5,'
        assert source.count(row) == 1
        target.write_text(source.replace(row, row.replace("4, 5,", "4, 6,")))
    else:
        target.write_text(target.read_text() + text)
    run = _bundle("--check", root=tmp_path)
    assert run.returncode == 1
    assert run.stdout.count("\n") == 1 and stale in run.stdout, run.stdout
    assert _bundle(root=tmp_path).returncode == 0 and _bundle("--check", root=tmp_path).returncode == 0


def test_model_new_has_no_version_labels():
    text = (ROOT / "model_new.py").read_text()
    # "v21", "since v25", attempt ids such as "(docs/perf-notes.md, 19c, 19g)"; not PTX's ".v4" nor "1e-38f"
    labels = re.findall(r"(?<![.\-])\bv\d{1,2}[a-z]?\b|(?<![.\-])\b\d{1,2}[a-g]\b(?=[,)])", text)
    assert not labels, labels


def _nvcc():
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    return "nvcc"


def test_results_describe_the_machine_code_of_this_tree():
    """results/<gpu>.json records a digest of each kernel's SASS, from the extension its run built. nvcc here, of the
    same version, must make the same machine code of this tree's sources: csrc/launch.cu as it lies, with the flags
    of the extension's build (model_new.py is these sources, by test_bundle_is_current). A kernel change without a
    new GPU run fails here; a comment-only change does not."""
    results = next((ROOT / "results").glob("*.json"), None)  # the one current run (test_docs checks there is one)
    assert results is not None, "no results/<gpu>.json: run bench.py on a GPU"
    recorded = json.loads(results.read_text()).get("machine_code")
    assert recorded, f"{results} records no machine_code: run bench.py"
    nvcc = _nvcc()
    if recorded.get("nvcc") != machine_code.nvcc_version(nvcc):
        pytest.skip(f"{results.name}'s kernels were built by nvcc {recorded.get('nvcc')}, this nvcc is "
                    f"{machine_code.nvcc_version(nvcc)}: their machine code need not match")
    assert machine_code.differences(recorded, {"kernels": _tree_digests(recorded["arch"])}) == []


@functools.cache
def _tree_digests(arch):
    """{kernel: digest} of csrc/launch.cu as it lies, built with the flags of the extension's build for `arch`."""
    module = machine_code.load_module(str(ROOT / "model_new.py"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "kernels.cubin"
        run = subprocess.run([_nvcc(), "-cubin", *machine_code.build_flags(module, arch),
                              str(ROOT / "csrc" / "launch.cu"), "-o", str(out)], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        return machine_code.digests_of_cubin(out.read_bytes(), machine_code.tag_table(module))


def test_kernels_alone_times_the_extensions_machine_code(tmp_path):
    """tools/kernels_alone.py builds model_new.py's kernels into an executable that runs them without torch. Every
    kernel in it must be the one the extension runs: the same digest as csrc/launch.cu built with the extension's
    flags."""
    harness = kernels_alone.build(str(ROOT / "model_new.py"), str(tmp_path / "alone"), nvcc=_nvcc())
    tree = _tree_digests(machine_code.DEFAULT_ARCH)
    assert len(tree) > 50 and kernels_alone.differing_kernels(harness, tree) == []
    # Its arguments (exit 2 is a refused one; past them, it needs a GPU, and with --only no-case runs nothing)
    bad = subprocess.run([str(tmp_path / "alone"), "--params", "uniform"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--params spread, got --params" in bad.stderr, bad.stderr
    good = subprocess.run([str(tmp_path / "alone"), "--params", "spread", "--only", "no-case", "--trials", "1"],
                          capture_output=True, text=True)
    assert good.returncode != 2, good.stderr


def test_kernels_alone_builds_in_the_benchmarks_parameters(monkeypatch):
    """The harness's weight and bias are bench.py's (harness.make_models at bench.py's default seed), bit for bit: the
    argmins, and so the backward kernels' times, depend on them."""
    import torch

    sys.path.insert(0, str(ROOT))
    import bench
    import harness

    monkeypatch.setattr(sys, "argv", ["bench.py"])
    assert bench.parse_args().seed == bench.SEED
    ref, _ = harness.make_models(bench.SEED)
    want = torch.cat([ref.conv.weight.detach().flatten(), ref.conv.bias.detach().flatten()])
    header = kernels_alone.params_header(kernels_alone.benchmark_params())
    got = [int(v, 16) for v in re.findall(r"0x([0-9a-f]{8})u", header)]
    assert f"kBenchmarkParams[{want.numel()}]" in header
    assert torch.tensor(got, dtype=torch.int64).to(torch.int32).view(torch.float32).equal(want)


def test_kernels_alone_ab_passes_arguments_and_fails_on_differing_checksums(tmp_path):
    """`kernels_alone.py ab A B -- ARGS` gives ARGS to both runs, and exits 1 where the checksums differ."""
    def fake(name, checksum):
        exe = tmp_path / name
        exe.write_text("#!/bin/sh\n"
                       f'[ "$1 $2" = "--only grad_input" ] && echo "tf32/grad_input grad_input 0.25 0.24 {checksum}"\n'
                       "exit 0\n")
        exe.chmod(0o755)
        return str(exe)

    a, b, c = fake("a", "0" * 16), fake("b", "0" * 16), fake("c", "1" * 16)
    tool = [sys.executable, str(ROOT / "tools" / "kernels_alone.py"), "ab"]
    same = subprocess.run([*tool, a, b, "--rounds", "2", "--", "--only", "grad_input"], capture_output=True, text=True)
    assert same.returncode == 0 and "tf32/grad_input" in same.stdout and "equal" in same.stdout, same.stdout
    differ = subprocess.run([*tool, a, c, "--", "--only", "grad_input"], capture_output=True, text=True)
    assert differ.returncode == 1 and "DIFFER" in differ.stdout, differ.stdout
    none = subprocess.run([*tool, a, b], capture_output=True, text=True)  # no case ran: nothing compared
    assert none.returncode == 1, none.stdout


def test_kernels_alone_ab_takes_each_cases_median_and_compares_checksums():
    """`kernels_alone.py ab`: a case's time is the median over rounds, B's ratio is to A, the checksums agree only
    where every round of both wrote the same bytes; lines that are not cases (the header, a case with no kernel on
    the profile) are skipped."""
    def run(ms, checksum, dx_ms=0.25):
        return kernels_alone.parse(f"# H100, profile sm_90; shape 128,256,256; 25 trials\n"
                                   f"tf32/forward           sm90_tf32_f16              {ms:.4f} 0.2000 {checksum}\n"
                                   f"tf32/grad_input        grad_input                 {dx_ms:.4f} 0.2400 {'1' * 16}\n"
                                   f"autocast_bf16/forward  none on this profile\n")
    same, other = "0123456789abcdef", "0123456789abcdee"
    a = [run(0.30, same), run(0.32, same), run(0.31, same)]
    b = [run(0.27, same), run(0.29, other), run(0.28, same, dx_ms=0.20)]
    rows = kernels_alone.compare(a, b)
    assert [r[0] for r in rows] == ["tf32/forward", "tf32/grad_input"]
    forward, dx = rows
    assert forward[1:5] == ("sm90_tf32_f16", "sm90_tf32_f16", pytest.approx(0.31), pytest.approx(0.28))
    assert forward[5] == pytest.approx(0.28 / 0.31) and forward[6] is False
    assert dx[3:] == (pytest.approx(0.25), pytest.approx(0.25), pytest.approx(1.0), True)


TWO_KERNELS = r"""
__global__ void scale(float* v) { v[threadIdx.x] *= 2.0f; }
__global__ void shift(float* v) { v[threadIdx.x] += 1.0f; }
"""


def test_machine_code_digest_follows_each_kernels_code():
    """Each kernel's digest changes with its own machine code and with nothing else: one constant of one of two
    kernels changed changes that kernel's digest only; a comment changes none."""
    flags = ["-O3", "-gencode=arch=compute_90a,code=sm_90a"]
    base = machine_code.digests_of_cubin(machine_code.cubin_of(TWO_KERNELS, flags, _nvcc()))
    edited = machine_code.digests_of_cubin(machine_code.cubin_of(TWO_KERNELS.replace("2.0f", "3.0f"), flags))
    commented = machine_code.digests_of_cubin(machine_code.cubin_of("// a comment\n" + TWO_KERNELS, flags))
    assert len(base) == 2 and base.keys() == edited.keys()
    changed = [k for k in base if base[k] != edited[k]]
    assert len(changed) == 1 and "scale" in changed[0], changed
    assert commented == base


def test_ncu_hotspots_ranks_instructions_and_skips_other_rows(capsys):
    """ncu's source page as CSV holds more than instruction rows (a kernel's name, blank lines, a second header, rows
    cut short); the hotspots are the instructions with the most stall samples, with their stall reasons."""
    import ncu_hotspots

    head = '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",' \
           '"Instructions Executed","stall_long_sb","stall_wait"'
    lines = [
        '"conv3x3_min_tanh2_grad_weight_fed_kernel"',
        head,
        '"00007f0000000000","LDG.E.128 R4, desc[UR4][R2.64]","10","2","100","0","1"',
        '"00007f0000000010","F2FP.F16.F32.PACK_AB R6, R5, R4","70","60","100","65","5"',
        '',
        '"00007f0000000020","HMMA.16816.F32 R8, R12, R16, R8"',
        '"00007f0000000030","STS.128 [R1], R4","20","20","1,200","0","20"',
        head,
    ]
    rows = ncu_hotspots.read_rows(lines)
    assert [r[0][-2:] for r in rows] == ["00", "10", "20", "30"]
    assert rows[3][3] == 1200 and rows[1][4] == {"stall_long_sb": 65, "stall_wait": 5}
    text = ncu_hotspots.report(rows, top=2, floor=0.15)
    top = text.splitlines()[1:3]
    assert "F2FP" in top[0] and "70.00%" in top[0] and "stall_long_sb 65" in top[0], text
    assert "STS.128" in top[1] and "20.00%" in top[1], text
    assert text.splitlines()[4:] == [line for line in text.splitlines()[4:] if "LDG" not in line]  # 10% < floor
    with pytest.raises(SystemExit, match="expected a CSV header"):
        ncu_hotspots.read_rows(['"a","b"', '"1","2"'])
