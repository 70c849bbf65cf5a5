"""ModelNew against reference.Model. CPU tests run everywhere; GPU tests need CUDA and skip with a reason."""
import re
import shutil
import subprocess
import types

import pytest
import torch

import harness
import model_new
import reference
from harness import compare, make_input, make_models

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
CUDA_BACKENDS = ["fused", "fused_mma_sync", "card"]
TF32_EMULATION_TOL = 5e-5  # fused output vs the float64 TF32 round-to-nearest emulation: fp32 accumulation only
FULL_SHAPE = (reference.batch_size, reference.in_channels, reference.height, reference.width)


@pytest.fixture
def tf32_default():
    """Run with PyTorch's default conv precision (TF32) and restore whatever was set before."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True
    yield
    torch.backends.cudnn.allow_tf32 = saved


# ================================================================================================ CPU tests
def test_seeded_init_matches_reference():
    for seed in (0, 7):
        ref, new = make_models(seed)
        ref_sd, new_sd = ref.state_dict(), new.state_dict()
        assert list(ref_sd) == list(new_sd) == ["conv.weight", "conv.bias"]
        for key in ref_sd:
            assert torch.equal(ref_sd[key], new_sd[key]), key
    a, b = make_models(0)
    c, d = make_models(1)
    assert not torch.equal(a.conv.weight, c.conv.weight)  # the seed matters, so the equality above means something


def test_state_dict_round_trip():
    ref, new = make_models(3)
    _, other = make_models(4)
    other.load_state_dict(ref.state_dict())
    assert torch.equal(other.conv.weight, ref.conv.weight) and torch.equal(other.conv.bias, ref.conv.bias)
    ref2, _ = make_models(5)
    ref2.load_state_dict(new.state_dict())
    assert torch.equal(ref2.conv.weight, new.conv.weight) and torch.equal(ref2.conv.bias, new.conv.bias)


@pytest.mark.parametrize("shape", [(2, 16, 12, 12), (1, 16, 3, 3), (3, 16, 9, 21), (2, 16, 33, 5)])
def test_cpu_matches_reference(shape):
    ref, new = make_models(11)
    for seed in range(3):
        x = make_input(shape, seed=100 + seed)
        with torch.no_grad():
            ok, err = compare(new(x), ref(x))
        assert ok, f"max abs diff {err}"


def test_cpu_other_channel_counts_and_float64():
    ref, new = make_models(2, init_inputs=[3, 5, 3])
    x = make_input((2, 3, 10, 11), seed=1)
    with torch.no_grad():
        assert compare(new(x), ref(x))[0]
    ref, new = ref.double(), new.double()
    x = x.double()
    with torch.no_grad():
        assert compare(new(x), ref(x), atol=1e-12, rtol=1e-12)[0]


def test_cpu_autograd_matches_reference():
    ref, new = make_models(5)
    x = make_input((2, 16, 9, 9), seed=3).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    ref(x).sum().backward()
    new(x2).sum().backward()
    assert torch.allclose(x.grad, x2.grad) and torch.allclose(ref.conv.weight.grad, new.conv.weight.grad)
    assert torch.allclose(ref.conv.bias.grad, new.conv.bias.grad)


def test_recompute_backward_matches_autograd():
    """The backward that CUDA backends use (recompute the reference math) gives the reference gradients."""
    ref, _ = make_models(6)
    w = ref.conv.weight.detach().clone().requires_grad_(True)
    b = ref.conv.bias.detach().clone().requires_grad_(True)
    x = make_input((2, 16, 8, 10), seed=4).requires_grad_(True)
    out = model_new._FastForwardRecomputeBackward.apply(x, w, b, "torch")
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, w, b], grad_out)
    want = torch.autograd.grad(ref(x), [x, ref.conv.weight, ref.conv.bias], grad_out)
    for g, e in zip(got, want):
        assert torch.allclose(g, e, atol=1e-6, rtol=1e-5)


BAD_INPUTS = [
    ("not a tensor", lambda: [[1.0]], TypeError, r"expects a torch\.Tensor, got list"),
    ("3-D", lambda: torch.rand(16, 8, 8), ValueError, r"4-D input .* got shape \(16, 8, 8\)"),
    ("5-D", lambda: torch.rand(1, 1, 16, 8, 8), ValueError, r"4-D input"),
    ("float16", lambda: torch.rand(1, 16, 8, 8).half(), ValueError, r"torch\.float32 input .* got torch\.float16"),
    ("int", lambda: torch.ones(1, 16, 8, 8, dtype=torch.int32), ValueError, r"got torch\.int32"),
    ("float64 vs float32 weights", lambda: torch.rand(1, 16, 8, 8).double(), ValueError, r"got torch\.float64"),
    ("channels", lambda: torch.rand(1, 8, 8, 8), ValueError, r"expects 16 input channels, got 8"),
    ("small H", lambda: torch.rand(1, 16, 2, 8), ValueError, r"H >= 3 and W >= 3 .* got H=2, W=8"),
    ("small W", lambda: torch.rand(1, 16, 8, 1), ValueError, r"got H=8, W=1"),
    ("device", lambda: torch.rand(1, 16, 8, 8, device="meta"), ValueError, r"expects input on cpu .* got meta"),
]


@pytest.mark.parametrize("name,make,exc,pattern", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_refused_with_a_clear_message(name, make, exc, pattern):
    _, new = make_models(0)
    with pytest.raises(exc, match=pattern):
        new(make())


def test_backend_setting_is_validated():
    _, new = make_models(0)
    with pytest.raises(ValueError, match="backend must be one of"):
        new.backend = "fast"
    with pytest.raises(ValueError, match="backend must be one of"):
        make_models(0, backend="cuda")
    new.backend = "card"
    with pytest.raises(ValueError, match="needs CUDA input"):
        new(torch.rand(1, 16, 4, 4))


def test_backend_decision_table(tf32_default):
    """auto: CPU -> torch; CUDA + TF32 conv + 16->64 3x3 -> fused; CUDA otherwise -> card."""
    _, new = make_models(0)
    cpu = torch.rand(1, 16, 4, 4)
    cuda = types.SimpleNamespace(device=torch.device("cuda"))  # decision only: no CUDA needed
    assert new.resolve_backend(cpu) == "torch"
    assert new.resolve_backend(cuda) == "fused"
    torch.backends.cudnn.allow_tf32 = False
    assert not model_new.conv_uses_tf32()
    assert new.resolve_backend(cuda) == "card"
    torch.backends.cudnn.allow_tf32 = True
    _, other = make_models(0, init_inputs=[16, 32, 3])
    assert not other.fused_supported() and other.resolve_backend(cuda) == "card"
    new.backend = "card"
    assert new.resolve_backend(cuda) == "card"


def test_round_tf32_is_round_to_nearest_ties_away():
    one_ulp = 2.0**-10  # TF32 keeps 10 mantissa bits
    vals = torch.tensor([1.0, 1.0 + one_ulp / 2, 1.0 + one_ulp / 4, -(1.0 + one_ulp / 2), 1.0 + 0.75 * one_ulp])
    want = torch.tensor([1.0, 1.0 + one_ulp, 1.0, -(1.0 + one_ulp), 1.0 + one_ulp])
    assert torch.equal(harness.round_tf32(vals), want)
    assert torch.equal(harness.truncate_tf32(vals), torch.tensor([1.0, 1.0, 1.0, -1.0, 1.0]))
    special = torch.tensor([float("inf"), -float("inf"), float("nan")])
    got = harness.round_tf32(special)
    assert got[0] == float("inf") and got[1] == -float("inf") and torch.isnan(got[2])


def _tf32_setup(seed, shape):
    ref, _ = make_models(seed)
    w, b = ref.conv.weight.detach(), ref.conv.bias.detach()
    x = make_input(shape, seed=seed + 1)
    return x, w, b, harness.float64_forward(x, w, b, operands=harness.round_tf32).float()


def test_checker_rejects_known_wrong_variants():
    """The comparison used everywhere must fail each known-wrong implementation, and pass the right one.
    Reference here: the TF32 (round-to-nearest) emulation, i.e. what cuDNN computes on the GPU by default."""
    x, w, b, tf32_ref = _tf32_setup(21, (4, 16, 48, 48))
    assert compare(harness.float64_forward(x, w, b, operands=harness.round_tf32).float(), tf32_ref)[0]
    for name, variant in harness.wrong_variants().items():
        ok, err = compare(variant(x, w, b), tf32_ref)
        assert not ok, f"the check accepted the wrong variant {name} (max abs diff {err})"
    nan_out = tf32_ref.clone()
    nan_out[0, 0, 0, 0] = float("nan")
    assert not compare(nan_out, tf32_ref)[0]
    assert not compare(tf32_ref[:, :, :-1], tf32_ref)[0]


def test_exact_fp32_misses_the_tf32_reference():
    """Why the fused kernel must round its operands like cuDNN: exact fp32 is too far from the TF32 reference."""
    x, w, b, tf32_ref = _tf32_setup(22, (4, 16, 48, 48))
    assert not compare(harness.float64_forward(x, w, b).float(), tf32_ref)[0]


def _ptxas_report(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    src = tmp_path / "kernels.cu"
    src.write_text(model_new.cuda_source())
    cmd = [nvcc, "-c", "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
           str(src), "-o", str(tmp_path / "kernels.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_cuda_source_compiles_for_sm90a_without_spills(tmp_path):
    report = _ptxas_report(tmp_path)
    kernels = re.findall(r"Compiling entry function '(\w+)'", report)
    for name in ("conv3x3_min_tanh2_mma_sync_kernel", "conv3x3_min_tanh2_wgmma_kernel"):
        assert any(name in k for k in kernels), f"{name} missing\n{report}"
    assert sum("min_tanh2_kernel" in k and "conv3x3" not in k for k in kernels) == 2, report
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(frames) == len(kernels), report
    assert all(f == ("0", "0", "0") for f in frames), report
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    assert regs and max(regs) <= 255, report


def test_cuda_source_has_no_torch_headers():
    assert not any("torch" in inc or "ATen" in inc or "c10" in inc
                   for inc in re.findall(r"#include\s*[<\"]([^>\"]+)", model_new.cuda_source()))


def test_import_never_builds_without_cuda():
    if HAS_CUDA:
        pytest.skip("this machine has CUDA: the extension is expected to build here")
    assert not model_new.extension_available()
    _, new = make_models(0, backend="fused")
    with pytest.raises(ValueError, match="needs CUDA input"):
        new(torch.rand(1, 16, 4, 4))


# ================================================================================================ GPU tests
def _cuda_models(seed=0, **kw):
    return make_models(seed, device="cuda", **kw)


def _run(model, x):
    with torch.no_grad():
        return model(x)


def _check_output(got, want, x, ref, backend):
    """The card backend runs the reference's own cuDNN conv, so it must match the reference at 1e-4 everywhere.
    The fused kernels compute a TF32 conv with round-to-nearest operands. cuDNN runs the reference in TF32 at the
    problem size (test_full_size_matches_reference insists on it), but for some small shapes it picks a
    full-fp32 algorithm even with TF32 allowed; there the two differ by the TF32 rounding itself (~2e-4). So a
    fused output must match the TF32 emulation to 5e-5, and the reference at 1e-4 wherever the reference is TF32,
    else at the TF32-vs-fp32 distance (5e-4)."""
    if backend == "card":
        ok, diff = compare(got, want)
        assert ok, f"card: max abs diff {diff} vs the reference"
        return
    w, b = ref.conv.weight.detach(), ref.conv.bias.detach()
    emulated = harness.float64_forward(x, w, b, operands=harness.round_tf32).float()
    ok, diff = compare(got, emulated, atol=TF32_EMULATION_TOL, rtol=0)
    assert ok, f"{backend}: max abs diff {diff} vs the TF32 emulation"
    ref_is_tf32 = compare(want, emulated, atol=TF32_EMULATION_TOL, rtol=0)[0]
    tol = harness.ATOL if ref_is_tf32 else 5e-4
    ok, diff = compare(got, want, atol=tol, rtol=tol)
    assert ok, f"{backend}: max abs diff {diff} vs the reference (reference is TF32: {ref_is_tf32})"


@needs_cuda
def test_extension_built():
    assert model_new.extension_available(), model_new._ext_error


@needs_cuda
def test_auto_backend_on_gpu(tf32_default):
    _, new = _cuda_models()
    x = torch.empty(1, 16, 4, 4, device="cuda")
    assert new.resolve_backend(x) == "fused"
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert model_new.fused_mma_kind() == ("wgmma" if hopper else "mma_sync")
    torch.backends.cudnn.allow_tf32 = False
    assert new.resolve_backend(x) == "card"


@needs_cuda
@pytest.mark.parametrize("seed", range(5))
def test_full_size_matches_reference(seed, tf32_default):
    ref, new = _cuda_models(seed)
    x = make_input(FULL_SHAPE, seed=1000 + seed, device="cuda")
    w, b = ref.conv.weight.detach(), ref.conv.bias.detach()
    want = _run(ref, x)
    truth = harness.float64_forward(x, w, b)
    tf32_truth = harness.float64_forward(x, w, b, operands=harness.round_tf32)
    ref_err = harness.max_abs_error(want, truth)
    assert harness.max_abs_error(want, tf32_truth) <= TF32_EMULATION_TOL, "the reference is not TF32 here"
    outputs = {}
    for backend, err_factor in (("fused", 1.5), ("fused_mma_sync", 1.5), ("card", 1.0)):
        new.backend = backend
        harness.poison_cuda_allocator(want.numel() * 4)
        got = outputs[backend] = _run(new, x)
        ok, diff = compare(got, want)
        assert ok, f"{backend}: max abs diff {diff} vs the reference"
        err = harness.max_abs_error(got, truth)
        assert err <= err_factor * ref_err, f"{backend}: error vs float64 {err} > {err_factor} x reference's {ref_err}"
        emu = harness.max_abs_error(got, tf32_truth)
        assert emu <= TF32_EMULATION_TOL, f"{backend}: {emu} from the TF32 round-to-nearest emulation"
    new.backend = "auto"
    assert torch.equal(_run(new, x), outputs["fused"])  # auto picks fused under the default settings


@needs_cuda
def test_strict_fp32_matches_strict_reference():
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        ref, new = _cuda_models(3)
        assert new.resolve_backend(torch.empty(1, device="cuda")) == "card"
        x = make_input(FULL_SHAPE, seed=77, device="cuda")
        ok, diff = compare(_run(new, x), _run(ref, x), atol=harness.STRICT_ATOL, rtol=harness.STRICT_RTOL)
        assert ok, f"max abs diff {diff}"
    finally:
        torch.backends.cudnn.allow_tf32 = saved


EDGE_SHAPES = [
    (1, 16, 256, 256),  # N = 1
    (2, 16, 3, 3),  # 1x1 output
    (2, 16, 5, 5),
    (2, 16, 67, 67),
    (2, 16, 255, 255),
    (2, 16, 257, 257),
    (2, 16, 258, 258),  # exactly one 256-column block
    (2, 16, 259, 259),  # one column past it
    (3, 16, 40, 600),  # several column blocks, non-square
    (2, 16, 301, 19),
    (1, 16, 3, 1000),  # one output row
    (5, 16, 4, 6),  # W % 4 != 0 and W % 4 == 0 mixed with tiny sizes
]


@needs_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("shape", EDGE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_edge_shapes(shape, backend, tf32_default):
    ref, new = _cuda_models(8, backend=backend)
    for seed in range(2):
        x = make_input(shape, seed=seed, device="cuda")
        want = _run(ref, x)
        harness.poison_cuda_allocator(want.numel() * 4)
        _check_output(_run(new, x), want, x, ref, backend)


@needs_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_nan_and_inf_inputs(backend, tf32_default):
    ref, new = _cuda_models(9, backend=backend)
    x = make_input((2, 16, 64, 70), seed=5, device="cuda")
    flat = x.view(-1)
    idx = torch.randperm(flat.numel(), device="cuda")[:60]
    flat[idx[:20]] = float("nan")
    flat[idx[20:40]] = float("inf")
    flat[idx[40:]] = -float("inf")
    want, got = _run(ref, x), _run(new, x)
    assert torch.isnan(want).any() and torch.isfinite(want).any()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN positions differ from the reference"
    _check_output(got, want, x, ref, backend)


@needs_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_noncontiguous_and_channels_last(backend, tf32_default):
    ref, new = _cuda_models(10, backend=backend)
    base = make_input((2, 16, 50, 140), seed=6, device="cuda")
    strided = base[:, :, :, ::2]
    dense = strided.contiguous()
    assert torch.equal(_run(new, strided), _run(new, dense))
    _check_output(_run(new, strided), _run(ref, dense), dense, ref, backend)
    cl = base.to(memory_format=torch.channels_last)
    assert torch.equal(_run(new, cl), _run(new, base))
    _check_output(_run(new, cl), _run(ref, base), base, ref, backend)


@needs_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_input_unchanged_side_stream_graph_and_repeatable(backend, tf32_default):
    ref, new = _cuda_models(12, backend=backend)
    x = make_input((4, 16, 96, 130), seed=7, device="cuda")
    x_before = x.clone()
    first = _run(new, x)
    assert torch.equal(x, x_before), "forward changed its input"
    _check_output(first, _run(ref, x), x, ref, backend)
    for _ in range(3):
        assert torch.equal(_run(new, x), first), "output is not bitwise repeatable"

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = _run(new, x)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(on_side, first), "a side stream gave another result"

    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _run(new, static_x)
    fresh = make_input(x.shape, seed=8, device="cuda")
    static_x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, _run(new, fresh)), "graph replay differs from eager"
    assert not torch.equal(static_out, first)


@needs_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_offsets_past_2_pow_31(backend, tf32_default):
    """An input with more than 2^31 elements (and, for card, an intermediate too): the last images must be right."""
    n = 2100
    shape = (n, 16, 256, 256)
    assert n * 16 * 256 * 256 > 2**31
    ref, new = _cuda_models(13, backend=backend)
    x = make_input(shape, seed=15, device="cuda")
    got = _run(new, x)
    for sl in (slice(0, 2), slice(n - 2, n)):
        _check_output(got[sl], _run(ref, x[sl]), x[sl], ref, backend)
    del x, got
    torch.cuda.empty_cache()


@needs_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_autograd_on_gpu(backend, tf32_default):
    ref, new = _cuda_models(14, backend=backend)
    x = make_input((2, 16, 20, 24), seed=9, device="cuda").requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    out_ref, out_new = ref(x), new(x2)
    assert out_new.requires_grad
    _check_output(out_new.detach(), out_ref.detach(), x.detach(), ref, backend)
    grad_out = torch.randn_like(out_ref)
    out_ref.backward(grad_out)
    out_new.backward(grad_out)
    assert torch.allclose(x.grad, x2.grad, atol=1e-5, rtol=1e-4)
    assert torch.allclose(ref.conv.weight.grad, new.conv.weight.grad, atol=1e-4, rtol=1e-4)
    assert torch.allclose(ref.conv.bias.grad, new.conv.bias.grad, atol=1e-4, rtol=1e-4)


@needs_cuda
def test_gpu_bad_inputs():
    _, new = _cuda_models()
    with pytest.raises(ValueError, match=r"expects input on cuda:0 .* got cpu"):
        new(torch.rand(1, 16, 8, 8))
    with pytest.raises(ValueError, match=r"supported on cuda: torch.float32\), got torch.float16"):
        new(torch.rand(1, 16, 8, 8, device="cuda").half())


@needs_cuda
def test_sass_uses_tensor_cores_without_local_memory():
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump is not on PATH")
    lib = model_new._ext.__file__
    sass = subprocess.run([cuobjdump, "--dump-sass", lib], capture_output=True, text=True, timeout=300).stdout
    functions = {f.split()[0]: f for f in re.split(r"\n\s*Function : ", sass)[1:]}
    mma_sync = [f for name, f in functions.items() if "conv3x3_min_tanh2_mma_sync_kernel" in name]
    wgmma = [f for name, f in functions.items() if "conv3x3_min_tanh2_wgmma_kernel" in name]
    assert len(mma_sync) == 1 and "HMMA" in mma_sync[0], "the mma.sync kernel has no HMMA"
    if torch.cuda.get_device_capability() == (9, 0):
        assert len(wgmma) == 1 and "HGMMA" in wgmma[0], "the wgmma kernel has no HGMMA"
    assert not re.search(r"\b(LDL|STL)\b", sass), "a kernel uses local memory"
