"""ModelNew against reference.Model. CPU tests run everywhere; GPU tests need CUDA and skip with a reason."""
import math
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zlib

import pytest
import torch

import harness
import model_new
import reference
from harness import compare, make_input, make_models

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
CUDA_BACKENDS = ["fused", "fused_mma_sync", "cudnn_epilogue"]
TF32_EMULATION_TOL = 5e-5  # fused output vs the float64 TF32 round-to-nearest emulation: fp32 accumulation only
LOW_PRECISION_TOL = harness.LOW_PRECISION_TOL
LOW_PRECISION = [torch.bfloat16, torch.float16]
FULL_SHAPE = (reference.batch_size, reference.in_channels, reference.height, reference.width)
OP = model_new.conv_min_tanh2
AUTO = model_new.OP_BACKENDS.index("auto")


# The shared CUDA cases (harness.CASES), by key: fused and cudnn_epilogue in every precision, and every fused kernel
# by name. fused_mma_sync-<precision> is left out here: on any GPU it runs one of the kernel cases (the decision-table
# test checks which).
CASE_KEYS = [k for k, c in harness.CASES.items() if c.backend != "fused_mma_sync"]


@pytest.fixture
def tf32_default():
    """Run with PyTorch's default conv precision (TF32) and restore whatever was set before."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True
    yield
    torch.backends.cudnn.allow_tf32 = saved


def _run(model, x):
    with torch.no_grad():
        return model(x)


# The checks of the sources, the documents and the results (tests/test_sources.py, tests/test_docs.py), collected
# here so that this file stays the one test entry (README, .ci/run). First in the run: their nvcc builds then overlap
# the CPU tests' builds (tests/builds.py), which run in the background from the first test on.
def _collect(module):
    globals().update({name: value for name, value in vars(module).items() if name.startswith("test_")})


import tests.test_docs  # noqa: E402
import tests.test_sources  # noqa: E402

_collect(tests.test_sources)
_collect(tests.test_docs)


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


def test_forward_uses_the_parameters_of_the_moment():
    """forward reads the live parameter dict: a weight assigned, a conv replaced, or a state_dict loaded after
    construction is what the next call uses."""
    ref, new = make_models(20)
    x = make_input((2, 16, 9, 9), seed=7)
    first = _run(new, x)
    new.conv.weight = torch.nn.Parameter(new.conv.weight.detach() * -1)
    ref.conv.weight = torch.nn.Parameter(ref.conv.weight.detach() * -1)
    assert torch.equal(_run(new, x), _run(ref, x)) and not torch.equal(_run(new, x), first)
    new.conv = torch.nn.Conv2d(16, 64, 3)
    ref.load_state_dict(new.state_dict())
    assert torch.equal(_run(new, x), _run(ref, x))
    new.load_state_dict(make_models(21)[0].state_dict())
    assert torch.equal(_run(new, x), _run(make_models(21)[0], x))


@pytest.mark.parametrize("shape", [(2, 16, 12, 12), (1, 16, 3, 3), (3, 16, 9, 21), (2, 16, 33, 5), (16, 12, 10)])
def test_cpu_matches_reference(shape):
    ref, new = make_models(11)
    for seed in range(3):
        x = make_input(shape, seed=100 + seed)
        got, want = _run(new, x), _run(ref, x)
        assert got.shape == want.shape
        ok, err = compare(got, want)
        assert ok, f"max abs diff {err}"


def test_unbatched_input_takes_the_min_over_rows_like_the_reference():
    """A 3-D input is one unbatched image: the conv gives (64, OH, OW) and the reference's min over dim 1 runs over
    the rows, giving (64, 1, OW). A drop-in must do the same, not treat the input as a batch of one."""
    ref, new = make_models(12)
    x = make_input((16, 12, 10), seed=3)
    got, want = _run(new, x), _run(ref, x)
    assert want.shape == (64, 1, 8) and got.shape == want.shape
    assert torch.equal(got, want)
    batch_of_one = _run(ref, x.unsqueeze(0))
    assert batch_of_one.shape == (1, 1, 10, 8)  # what the other reading would give: a different answer


def test_cpu_other_channel_counts_and_float64():
    ref, new = make_models(2, init_inputs=[3, 5, 3])
    x = make_input((2, 3, 10, 11), seed=1)
    assert compare(_run(new, x), _run(ref, x))[0]
    ref, new = ref.double(), new.double()
    x = x.double()
    assert compare(_run(new, x), _run(ref, x), atol=1e-12, rtol=1e-12)[0]


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_cpu_low_precision_models(dtype):
    """A model converted with .to(dtype) takes and returns that dtype; on the CPU it runs the reference's ops."""
    ref, new = make_models(13)
    ref, new = ref.to(dtype), new.to(dtype)
    x = make_input((2, 16, 14, 15), seed=4).to(dtype)
    got, want = _run(new, x), _run(ref, x)
    assert got.dtype == dtype
    assert compare(got, want, atol=LOW_PRECISION_TOL, rtol=LOW_PRECISION_TOL)[0]


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_cpu_autocast_behaves_as_the_reference(dtype):
    """Under torch.autocast("cpu", dtype), ModelNew's op casts its arguments as conv2d's are cast: the reference's
    dtype and values, with grad and without, and float32 gradients for the float32 parameters."""
    ref, new = make_models(8)
    x = make_input((2, 16, 9, 11), seed=6)
    for grad in (False, True):
        with torch.autocast("cpu", dtype=dtype), torch.set_grad_enabled(grad):
            got, want = new(x), ref(x)
        assert got.dtype == want.dtype == dtype
        assert torch.equal(got, want)
    got.float().sum().backward()
    want.float().sum().backward()
    assert new.conv.weight.grad.dtype == torch.float32
    assert torch.equal(new.conv.weight.grad, ref.conv.weight.grad)


def test_forward_under_autograd_follows_the_saving_switch():
    """model_new.save_in_forward picks the op a forward under autograd records (the inference op, whose backward runs
    the saving forward, or the saving op); a second execution of the file (as KernelBench runs it) shares the switch
    with the first, whose backward the op keeps."""
    import runpy

    previous = model_new.save_in_forward()
    try:
        _, new = make_models(9)
        x = make_input((2, 16, 7, 9), seed=2).requires_grad_(True)
        model_new.save_in_forward(False)
        assert "conv_min_tanh2_default" in new(x).grad_fn.name()
        model_new.save_in_forward(True)
        assert "conv_min_tanh2_with_argmin" in new(x).grad_fn.name()
        again = runpy.run_path(model_new.__file__)
        assert again["save_in_forward"]() is True
        again["save_in_forward"](False)
        assert model_new.save_in_forward() is False
        with pytest.raises(TypeError, match="save_in_forward expects a bool, got 1"):
            model_new.save_in_forward(1)
    finally:
        model_new.save_in_forward(previous)


def test_cpu_saving_op_saves_nothing_and_recomputes():
    """On the CPU the op ModelNew records for autograd saves no argmin (empty tensors) and its backward recomputes
    the reference's chain; its fake kernel agrees on the shapes."""
    ref, _ = make_models(9)
    w, b = ref.conv.weight.detach(), ref.conv.bias.detach()
    x = make_input((2, 16, 7, 9), seed=2)
    out, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, AUTO)
    assert torch.equal(out, model_new.reference_math(x, w, b))
    assert argmin.numel() == 0 and argmin.dtype == torch.uint8 and pre_min.numel() == 0
    assert not model_new.saves_argmin(x, w)
    results = torch.library.opcheck(model_new.conv_min_tanh2_with_argmin,
                                    tuple(t.clone().requires_grad_(True) for t in (x, w, b)) + (AUTO,))
    assert set(results.values()) == {"SUCCESS"}, results


@pytest.mark.parametrize("shape", [(2, 16, 9, 9), (16, 9, 7)])
def test_cpu_autograd_matches_reference(shape):
    ref, new = make_models(5)
    x = make_input(shape, seed=3).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    grad_out = torch.randn_like(ref(x))
    ref(x).backward(grad_out)
    new(x2).backward(grad_out)
    assert torch.allclose(x.grad, x2.grad, atol=1e-6, rtol=1e-5)
    assert torch.allclose(ref.conv.weight.grad, new.conv.weight.grad, atol=1e-6, rtol=1e-5)
    assert torch.allclose(ref.conv.bias.grad, new.conv.bias.grad, atol=1e-6, rtol=1e-5)


def test_backward_formula_matches_autograd():
    """The op's backward (recompute the conv, scatter through the argmin, two tanh_backward, the conv's backward)
    gives autograd's gradients of the reference math, each input alone and all together."""
    ref, _ = make_models(6)
    w, b = ref.conv.weight.detach(), ref.conv.bias.detach()
    x = make_input((2, 16, 8, 10), seed=4)
    grad_out = torch.randn(2, 1, 6, 8, generator=torch.Generator().manual_seed(1))
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    want = torch.autograd.grad(model_new.reference_math(*leaves), leaves, grad_out)
    for needs in ([True, True, True], [True, False, False], [False, True, False], [False, False, True]):
        got = model_new.reference_backward(grad_out, x, w, b, needs)
        for g, e, need in zip(got, want, needs):
            assert (g is None) == (not need)
            if need:
                assert torch.allclose(g, e, atol=1e-6, rtol=1e-5)


BAD_INPUTS = [
    ("not a tensor", lambda d: [[1.0]], TypeError, r"expects a torch\.Tensor, got list"),
    ("2-D", lambda d: torch.rand(16, 8, device=d), ValueError, r"3-D \(C, H, W\) or 4-D .* got shape \[16, 8\]"),
    ("5-D", lambda d: torch.rand(1, 1, 16, 8, 8, device=d), ValueError, r"got shape \[1, 1, 16, 8, 8\]"),
    ("float16 vs float32 weights", lambda d: torch.rand(1, 16, 8, 8, device=d).to(torch.float16), ValueError,
     r"weights' dtype torch\.float32 \(supported: torch\.float32, torch\.float64, torch\.float16, "
     r"torch\.bfloat16\), got torch\.float16"),
    ("int", lambda d: torch.ones(1, 16, 8, 8, dtype=torch.int32, device=d), ValueError, r"got torch\.int32"),
    ("float64 vs float32 weights", lambda d: torch.rand(1, 16, 8, 8, device=d).double(), ValueError,
     r"got torch\.float64"),
    ("channels", lambda d: torch.rand(1, 8, 8, 8, device=d), ValueError, r"expects 16 input channels, got 8"),
    ("unbatched channels", lambda d: torch.rand(8, 8, 8, device=d), ValueError, r"expects 16 input channels, got 8"),
    ("small H", lambda d: torch.rand(1, 16, 2, 8, device=d), ValueError, r"H >= 3 and W >= 3 .* got H=2, W=8"),
    ("small W", lambda d: torch.rand(1, 16, 8, 1, device=d), ValueError, r"got H=8, W=1"),
]


@pytest.mark.parametrize("name,make,exc,pattern", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_refused_with_a_clear_message(name, make, exc, pattern):
    _, new = make_models(0)
    with pytest.raises(exc, match=pattern):
        new(make("cpu"))


def test_input_on_another_device_is_refused():
    _, new = make_models(0)
    with pytest.raises(ValueError, match=r"expects input on cpu \(the device of its weights\), got meta"):
        new(torch.rand(1, 16, 8, 8, device="meta"))


def test_backend_setting_is_validated():
    _, new = make_models(0)
    with pytest.raises(ValueError, match="backend must be one of"):
        new.backend = "fast"
    with pytest.raises(ValueError, match="backend must be one of"):
        make_models(0, backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        new.backend = "card"  # a former name of cudnn_epilogue, no longer accepted
    for backend in ("fused", "fused_mma_sync", "cudnn_epilogue"):
        new.backend = backend
        with pytest.raises(ValueError, match=f"backend '{backend}' needs CUDA input, got cpu"):
            new(torch.rand(1, 16, 4, 4))


def test_op_refuses_an_unknown_backend_code():
    _, new = make_models(0)
    w, b = new.conv.weight.detach(), new.conv.bias.detach()
    for code in (-1, len(model_new.OP_BACKENDS)):
        with pytest.raises(ValueError, match=rf"backend code must be 0\.\.3, got {code}"):
            OP(torch.rand(1, 16, 4, 4), w, b, code)
        with pytest.raises(ValueError, match=rf"backend code must be 0\.\.3, got {code}"):
            OP(torch.rand(1, 16, 4, 4, device="meta"), w.to("meta"), b.to("meta"), code)  # the fake kernel
    if HAS_CUDA:
        with pytest.raises(ValueError, match=r"backend code must be 0\.\.3, got 7"):
            OP(torch.rand(1, 16, 4, 4, device="cuda"), w.cuda(), b.cuda(), 7)


def test_backend_on_cpu_is_the_reference_math():
    _, new = make_models(0)
    x = torch.rand(1, 16, 4, 4)
    assert new.resolve_backend(x) == "torch"
    new.backend = "torch"
    assert new.resolve_backend(x) == "torch"


OPCHECK_CASES = [
    ("fp32", (2, 16, 7, 9), torch.float32, False),
    ("fp32 grad", (2, 16, 7, 9), torch.float32, True),
    ("unbatched grad", (16, 6, 5), torch.float32, True),
    ("bf16", (2, 16, 6, 6), torch.bfloat16, False),
]


def _opcheck(device, shape, dtype, grad):
    ref, _ = make_models(17)
    w = ref.conv.weight.detach().to(device=device, dtype=dtype)
    b = ref.conv.bias.detach().to(device=device, dtype=dtype)
    x = make_input(shape, seed=2).to(device=device, dtype=dtype)
    if grad:
        x, w, b = (t.clone().requires_grad_(True) for t in (x, w, b))
    results = torch.library.opcheck(OP, (x, w, b, AUTO))
    assert set(results.values()) == {"SUCCESS"}, results


@pytest.mark.parametrize("name,shape,dtype,grad", OPCHECK_CASES, ids=[c[0] for c in OPCHECK_CASES])
def test_opcheck_cpu(name, shape, dtype, grad):
    """torch.library.opcheck: schema, autograd registration, fake kernel against the real one, AOT dispatch."""
    _opcheck("cpu", shape, dtype, grad)


def test_compile_fullgraph_cpu():
    """Dynamo traces ModelNew.forward to the op in one graph (fullgraph raises on any break), forward and backward."""
    torch._dynamo.reset()
    ref, new = make_models(18)
    compiled = torch.compile(new, fullgraph=True, backend="aot_eager")
    x = make_input((2, 16, 10, 12), seed=5)
    assert compare(_run(compiled, x), _run(ref, x))[0]
    x1, x2 = (x.clone().requires_grad_(True) for _ in range(2))
    compiled(x1).sum().backward()
    ref(x2).sum().backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-6, rtol=1e-5)


def test_round_tf32_is_round_to_nearest_ties_away():
    one_ulp = 2.0**-10  # TF32 keeps 10 mantissa bits
    vals = torch.tensor([1.0, 1.0 + one_ulp / 2, 1.0 + one_ulp / 4, -(1.0 + one_ulp / 2), 1.0 + 0.75 * one_ulp])
    want = torch.tensor([1.0, 1.0 + one_ulp, 1.0, -(1.0 + one_ulp), 1.0 + one_ulp])
    assert torch.equal(harness.round_tf32(vals), want)
    assert torch.equal(harness.truncate_tf32(vals), torch.tensor([1.0, 1.0, 1.0, -1.0, 1.0]))
    special = torch.tensor([float("inf"), -float("inf"), float("nan")])
    got = harness.round_tf32(special)
    assert got[0] == float("inf") and got[1] == -float("inf") and torch.isnan(got[2])


def test_float64_truth_is_the_reference_module(monkeypatch):
    """The truth the GPU tests use is reference.Model run in float64, not code from model_new: breaking model_new's
    math leaves it unchanged."""
    ref, _ = make_models(19)
    x = make_input((2, 16, 9, 9), seed=6)
    w, b = ref.conv.weight.detach(), ref.conv.bias.detach()
    truth = harness.float64_forward(x, w, b)
    assert truth.dtype == torch.float64
    assert torch.equal(truth, ref.double()(x.double()))
    monkeypatch.setattr(model_new, "reference_math", lambda x, w, b: torch.zeros(1))
    assert torch.equal(harness.float64_forward(x, w, b.clone()), truth)


def _tf32_setup(seed, shape):
    ref, _ = make_models(seed)
    w, b = ref.conv.weight.detach(), ref.conv.bias.detach()
    x = make_input(shape, seed=seed + 1)
    return x, w, b, harness.float64_forward(x, w, b, operands=harness.round_tf32).float()


def test_checker_rejects_known_wrong_variants():
    """The comparison used everywhere must pass an independent right answer and fail each known-wrong variant.
    Reference: the float64 TF32 (round-to-nearest) emulation, i.e. what cuDNN computes on the GPU by default.
    The right answer: torch's fp32 CPU conv on operands rounded to TF32 (another code path, fp32 accumulation)."""
    x, w, b, tf32_ref = _tf32_setup(21, (4, 16, 48, 48))
    right = model_new.reference_math(harness.round_tf32(x), harness.round_tf32(w), b)
    ok, err = compare(right, tf32_ref)
    assert ok and err < 1e-5, f"the check rejected a right answer (max abs diff {err})"
    for name, variant in harness.wrong_variants().items():
        ok, err = compare(variant(x, w, b), tf32_ref)
        assert not ok, f"the check accepted the wrong variant {name} (max abs diff {err})"
    nan_out = tf32_ref.clone()
    nan_out[0, 0, 0, 0] = float("nan")
    assert not compare(nan_out, tf32_ref)[0]
    assert not compare(tf32_ref[:, :, :-1], tf32_ref)[0]


@pytest.mark.parametrize("seed", range(3))
def test_exact_fp32_misses_the_tf32_reference(seed):
    """Why the fused kernel must round its operands like cuDNN: an exact fp32 conv is too far from the TF32
    reference. On random inputs the gap sits near the tolerance (max 2.5e-4 at the full problem); here the inputs
    make the rounding errors add up, so it fails by a wide margin on every seed, as does truncation."""
    x, w, b = harness.coherent_tf32_rounding_case(seed)
    tf32_ref = harness.float64_forward(x, w, b, operands=harness.round_tf32).float()
    exact = harness.float64_forward(x, w, b).float()
    bound = harness.ATOL + harness.RTOL * tf32_ref.double().abs()
    assert float(((exact.double() - tf32_ref.double()).abs() / bound).max()) > 3
    assert not compare(exact, tf32_ref)[0]
    assert not compare(harness.wrong_variants()["truncated_tf32"](x, w, b), tf32_ref)[0]
    assert compare(model_new.reference_math(harness.round_tf32(x), harness.round_tf32(w), b), tf32_ref)[0]


@pytest.mark.parametrize("argv, message", [
    (["--trials", "5"], "--trials must be at least 20"),
    (["--spread-processes", "2"], "--spread-processes must be 0 or at least 3, got 2"),
])
def test_bench_refuses_too_few_trials_or_processes(argv, message):
    """A spread over fewer than 3 processes, or a median of fewer than 20 trials, is refused before anything runs."""
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench.py")
    proc = subprocess.run([sys.executable, bench, *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_bench_names_a_commit_only_for_its_own_tree(tmp_path):
    """bench.py records HEAD only where the tracked files are HEAD's (results/, which runs write, aside): a tree
    copied beside an older .git names none."""
    import bench

    if shutil.which("git") is None:
        pytest.skip("needs git")

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
                       cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "results").mkdir()
    (tmp_path / "kernel.cu").write_text("a")
    (tmp_path / "results" / "gpu.json").write_text("{}")
    git("add", "kernel.cu", "results/gpu.json")
    git("commit", "-q", "-m", "a")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / "notes.txt").write_text("untracked")
    (tmp_path / "results" / "gpu.json").write_text('{"ms": 1}')
    assert bench.current_commit(str(tmp_path)) == head
    (tmp_path / "kernel.cu").write_text("b")
    assert bench.current_commit(str(tmp_path)) is None


def test_bench_keeps_other_tools_sections_of_its_own_commit_only():
    """A results file's sections from other tools (KernelBench's) stay through a new bench.py run at the same commit
    and go at another, where they would describe code that no longer runs; without a commit nothing is kept."""
    import bench

    earlier = {"commit": "aaaaaaa", "ms": {"model_new": 1.0}, "kernelbench": {"fp32": {"correct": True}}}
    run = {"commit": "aaaaaaa", "ms": {"model_new": 0.5}}
    assert bench.keep_other_tools(earlier, run) == {**run, "kernelbench": {"fp32": {"correct": True}}}
    assert bench.keep_other_tools(earlier, {**run, "commit": "bbbbbbb"}) == {**run, "commit": "bbbbbbb"}
    assert bench.keep_other_tools({**earlier, "commit": None}, {**run, "commit": None}) == {**run, "commit": None}


def test_interleaved_timing_gives_every_callable_the_same_places():
    """harness.round_order, the order of time_cuda_rounds (bench.py's portability rows, training kernels and
    autocast ratio): every callable gets its trials, each round takes every callable once, and over the rounds each
    one's mean place in the run is the same, so a clock that drifts over the run favours none of them."""
    names = ["a", "b", "c"]
    for trials, rounds in ((25, 5), (20, 4), (12, 6), (10, 4), (3, 5), (1, 3)):
        order = harness.round_order(names, trials, rounds)
        assert {name: sum(c for n, c in order if n == name) for name in names} == dict.fromkeys(names, trials), order
        used = min(rounds, trials)
        for r in range(used):
            assert sorted(n for n, _ in order[r * 3:(r + 1) * 3]) == names, order
        # the trials' mean position (0 = first trial timed) is the same for every name when the rounds pair up
        if used % 2 == 0 and trials % used == 0:
            place, at = {n: 0.0 for n in names}, 0
            for n, c in order:
                place[n] += sum(range(at, at + c)) / trials
                at += c
            assert len({round(v, 9) for v in place.values()}) == 1, (trials, rounds, place)


def test_every_timed_trial_follows_its_own_flush(monkeypatch):
    """harness.time_cuda and time_cuda_rounds (every time bench.py reports): the warm-up calls, then for each trial
    the L2 flush (or `before`), the start event, the call, the end event, in that order; the times come back by name.
    Run on the CPU with the GPU's events, flush and synchronize recorded instead of run."""
    log = []

    class Event:
        def __init__(self, enable_timing):
            self.at = None

        def record(self):
            self.at = len(log)
            log.append("start" if len([e for e in log if e in ("start", "end")]) % 2 == 0 else "end")

        def elapsed_time(self, end):
            return float(end.at - self.at)

    class Flush:
        def fill_(self, value):
            log.append("flush")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    monkeypatch.setattr(harness, "l2_flush_buffer", lambda: Flush())
    times = harness.time_cuda(lambda: log.append("a"), trials=3, warmup=2)
    assert log == ["a", "a", "sync"] + ["flush", "start", "a", "end"] * 3 + ["sync"], log
    assert times == [2.0, 2.0, 2.0]
    log.clear()
    harness.time_cuda(lambda: log.append("a"), trials=2, warmup=0, before=lambda: log.append("other"))
    assert log == ["sync"] + ["other", "start", "a", "end"] * 2 + ["sync"], log
    log.clear()
    times = harness.time_cuda_rounds({"a": lambda: log.append("a"), "b": lambda: log.append("b")}, trials=2,
                                     warmup=1, rounds=2)
    assert log == ["a", "b", "sync"] + [x for n in "abba" for x in ("flush", "start", n, "end")] + ["sync"], log
    assert times == {"a": [2.0, 2.0], "b": [2.0, 2.0]}


def test_bench_times_every_eager_training_step_before_any_compile(monkeypatch):
    """bench.py's training forms: the reference's and ModelNew's eager steps all come before the first torch.compile
    (a compiled process issues eager calls slower, which ModelNew's host-bound N = 32 step would show), and each form
    gets all three times and both peaks. Run on the CPU at a small shape, with the timer, the peak and torch.compile
    recorded instead of run; then the parent's reading of the child process's output (bench_training_steps)."""
    import json
    import types

    import bench

    events = []

    def time_cuda(step, trials, warmup):
        step()
        events.append("time")
        return [1.0, 2.0, 4.0]

    def compile_(model, *args, **kwargs):
        events.append("compile")
        return model

    monkeypatch.setattr(harness, "time_cuda", time_cuda)
    monkeypatch.setattr(bench, "_peak_mb", lambda step, clear: (clear(), step(), 3.0)[-1])
    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(bench, "TRAIN_FORM_NS", (2,))
    args = types.SimpleNamespace(seed=0, trials=25, warmup=1)
    forms = bench.time_training_forms(args, reference.get_init_inputs(), (2, 16, 10, 12), device="cpu")
    kinds = len(bench.TRAIN_FORMS) * len(bench.TRAIN_FORM_PRECISIONS)
    assert events == ["time"] * (3 * kinds) + ["compile", "time"] * kinds, events  # 3: PyTorch's floor as well
    assert len(forms) == kinds
    for form in forms:
        assert form["ms"] == {"reference": 2.0, "model_new": 2.0, "pytorch_floor": 2.0, "reference_compiled": 2.0}, form
        assert form["peak_mb"] == {"reference": 3.0, "model_new": 3.0} and form["vs_reference"] == 1.0, form
    # A child's stdout lines, or its last lines and stderr where it fails.
    assert bench.run_python("import sys; print(sys.argv[1:])", 7, "a") == ["['7', 'a']"]
    with pytest.raises(RuntimeError, match="(?s)half done.*ZeroDivisionError"):
        bench.run_python("print('half done'); 1 / 0")
    # The parent takes the child's marked line, whatever else the child printed after it, and passes the rest on.
    marked = bench.TRAINING_MARK + json.dumps({"training": {"n": 2}, "forms": forms})
    child = subprocess.CompletedProcess([], 0, f"[training] a\n{marked}\nworker\n", "")
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: child)
    logged = []
    monkeypatch.setattr(bench, "log", logged.append)
    assert bench.bench_training_steps(args) == ({"n": 2}, forms) and logged == ["[training] a", "worker"]
    child.stdout = "[training] a\n"
    with pytest.raises(RuntimeError, match="printed no line starting 'TRAINING_JSON '"):
        bench.bench_training_steps(args)


def test_cuda_source_has_no_torch_headers():
    assert not any("torch" in inc or "ATen" in inc or "c10" in inc
                   for inc in re.findall(r"#include\s*[<\"]([^>\"]+)", model_new.cuda_source()))


def _top_level_args(text, open_at):
    """Arguments of the call whose '(' is at text[open_at], split at top-level commas (strings respected)."""
    args, depth, start, i, quote = [], 0, open_at + 1, open_at, None
    while True:
        c = text[i]
        if quote:
            quote = None if c == quote and text[i - 1] != "\\" else quote
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return args + [text[start:i].strip()]
        elif c == "," and depth == 1:
            args.append(text[start:i].strip())
            start = i + 1
        i += 1


def test_cpp_error_messages_are_single_prebuilt_strings():
    """Every TORCH_CHECK in the C++ op takes one message argument built from strings (std::to_string for numbers).
    Variadic messages stream numbers through this library's own ostream code, which crashed (segfault, not an
    error) on a GPU machine whose runtime libstdc++ is older than the compiler's headers."""
    src = model_new.cpp_source()
    calls = [m for m in re.finditer(r"\bTORCH_CHECK\w*\s*\(", src)]
    assert len(calls) >= 10
    for m in calls:
        args = _top_level_args(src, m.end() - 1)
        assert len(args) == 2, f"{m.group(0)} with {len(args)} arguments: {args}"


def test_every_mutant_edits_the_current_source():
    """tools/mutants.py breaks model_new.py by textual edits; each text must still be there exactly once, and each
    test it names must exist, or the mutation run on a GPU machine stops or misses before testing anything."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools"))
    import mutants

    with open(model_new.__file__) as f:
        text = f.read()
    here = os.path.dirname(os.path.abspath(__file__))
    collected = set(subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                    "test_correctness.py"], cwd=here, capture_output=True, text=True,
                                   timeout=300).stdout.split())
    for name, (original, mutated, tests) in mutants.MUTANTS.items():
        assert text.count(original) == 1, f"mutant {name}: its text is in model_new.py {text.count(original)} times"
        assert original != mutated and tests
        for test in tests:  # a node id that pytest does not collect would be "not found", an error, not a catch
            assert f"test_correctness.py::{test}" in collected, f"mutant {name}: no test {test}"


def test_timeline_stamps_the_current_source():
    """tools/experiments/timeline.py stamps a copy of model_new.py by textual edits: each anchor must be there exactly
    once, so that every stamp it reports is where its name says (the consumer's six a step, the producer's four a
    row)."""
    sys.path.insert(0, os.path.join(HERE, "tools", "experiments"))
    import timeline

    with open(model_new.__file__) as f:
        text = f.read()
    stamped = timeline.stamped_source(text)
    assert [stamped.count(f"KB25_STAMP({k});") for k in range(6)] == [1] * 6
    assert [stamped.count(f"KB25_PSTAMP({k});") for k in range(4)] == [1] * 4
    assert 'EXTENSION_NAME = "kb25_conv_min_tanh2_timeline"' in stamped
    with pytest.raises(ValueError, match="expected 1 copy of 'ring.commit"):
        timeline.stamped_source(text.replace("    ring.commit(d);\n", "    ring.commit(d) ;\n"))
    # its report assumes two consumers fed by producer warps: any other kernel is refused in one line, before a build
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(timeline.__file__), "timeline.py"), "sm80_bf16"],
                          capture_output=True, text=True, timeout=120)
    wgmma = ", ".join(k.name for k in model_new.FUSED_TABLE if k.mma == "wgmma")
    assert proc.returncode == 2 and f"expected a wgmma kernel ({wgmma}), got 'sm80_bf16'" in proc.stderr, proc.stderr


def test_dw_timeline_stamps_the_current_source():
    """tools/experiments/dw_timeline.py stamps the fed weight gradient the same way: each anchor exactly once, so that
    the producer's seven stamps a row and each consumer warp's five a step are where their names say (the chunk loop's
    end twice: a row warp's and the bias warp's)."""
    sys.path.insert(0, os.path.join(HERE, "tools", "experiments"))
    import dw_timeline

    with open(model_new.__file__) as f:
        text = f.read()
    stamped = dw_timeline.stamped_source(text)
    assert [stamped.count(f"KB25_PSTAMP({k});") for k in range(7)] == [1] * 7
    assert [stamped.count(f"KB25_CSTAMP({k});") for k in range(5)] == [1, 1, 2, 1, 1]
    assert 'EXTENSION_NAME = "kb25_conv_min_tanh2_dw_timeline"' in stamped
    with pytest.raises(ValueError, match="expected 1 copy of 'named_barrier"):
        dw_timeline.stamped_source(text.replace("G::kProducerBarrier);\n          uint64_t held = 0;",
                                                "G::kProducerBarrier);\n          uint64_t held  = 0;"))


def test_argmin_ties_probe_gives_design_mds_shares():
    """tools/experiments/argmin_ties.py, whose shares design.md quotes (the pixels where a 16-bit reference's torch.min
    routes the gradient elsewhere than float64's argmin, which the saving forward follows), gives them again on one
    image: bf16 0.04% with the benchmark's weights and 0.8-0.9% with seed 1's, fp16 0.005% and 0.1%."""
    sys.path.insert(0, os.path.join(HERE, "tools", "experiments"))
    import argmin_ties

    share = {(name, seed): argmin_ties.differing_fraction(seed, 4, 1, dtype)
             for name, dtype in argmin_ties.DTYPES.items() for seed in (0, 1)}
    assert 2e-4 < share["bf16", 0] < 1e-3 and 6e-3 < share["bf16", 1] < 1.1e-2, share
    assert 2e-5 < share["fp16", 0] < 1e-4 and 6e-4 < share["fp16", 1] < 1.5e-3, share


@pytest.mark.parametrize("args, exc, pattern", [
    (((8,), 1024), TypeError, r"capability=\(major, minor\) as two ints, got \(8,\)"),
    (((8, 6.0), 1024), TypeError, r"as two ints, got \(8, 6\.0\)"),
    (((8, True), 1024), TypeError, r"as two ints, got \(8, True\)"),
    (("8.6", 1024), TypeError, r"as two ints, got '8\.6'"),
    (((8, 6), 99.0), TypeError, r"smem_optin as an int \(bytes\), got 99\.0"),
])
def test_emulate_device_refuses_malformed_profiles(args, exc, pattern):
    """Checked in Python before anything reaches the extension, on every machine."""
    with pytest.raises(exc, match=pattern):
        model_new.emulate_device(*args)


@pytest.mark.skipif(HAS_CUDA, reason="checks the message given where no extension is built")
def test_emulate_device_without_the_extension_says_so():
    with pytest.raises(RuntimeError, match="emulate_device needs the CUDA extension"):
        model_new.emulate_device(capability=(8, 6), smem_optin=101376)


def test_harness_precisions_are_model_news():
    """The cases table joins harness.PRECISIONS (tolerances) with FUSED_TABLE (precision names): one list of names."""
    assert tuple(harness.PRECISIONS) == model_new.PRECISIONS
    assert {k.precision for k in model_new.FUSED_TABLE} == set(model_new.PRECISIONS)
    assert {p for p, _, _ in model_new.PRECISION_TAGS} == set(model_new.PRECISIONS)
    assert set(model_new.PRECISION_TAGS) == {(k.precision, k.operand, k.input) for k in model_new.FUSED_TABLE}
    kernel_cases = {c.kernel for c in harness.CASES.values() if c.backend == "kernel"}
    assert kernel_cases == set(model_new.FUSED_KERNELS)


def test_import_without_cuda_builds_nothing_and_runs_on_the_cpu():
    """In a process that sees no GPU, importing model_new compiles nothing and the CPU path still matches."""
    code = ("import torch, model_new, harness; assert not torch.cuda.is_available(); "
            "assert not model_new.extension_available(); ref, new = harness.make_models(0); "
            "x = harness.make_input((2, 16, 7, 7)); "
            "assert harness.compare(new(x), ref(x))[0]; print('ok')")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.abspath(__file__)), env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def _submission_code():
    """model_new.py as KernelBench's static checker reads it: the text with # and // comments cut off each line."""
    with open(model_new.__file__) as f:
        text = f.read()
    return "\n".join(re.split(r"#|//", line, maxsplit=1)[0] for line in text.split("\n"))


def test_submission_has_no_fallback_constructs():
    """KernelBench rejects a submission whose text has try/except or pass (a fallback could hide behind them),
    threads, or tensor subclasses; it needs a __global__ kernel and load_inline. Checked here on every machine;
    tools/kernelbench_eval.py runs KernelBench's own checker."""
    code = _submission_code()
    for pattern in (r"\btry\s*:", r"\bexcept\b", r"\bpass\b", r"\bthreading\b", r"multiprocessing",
                    r"concurrent\.futures", r"_make_subclass", r"class\s+\w+.*\((torch\.)?Tensor\)"):
        assert not re.search(pattern, code), f"model_new.py matches {pattern!r}"
    assert "__global__" in code and "load_inline" in code


@pytest.mark.skipif(not os.environ.get("KERNELBENCH_DIR"), reason="KERNELBENCH_DIR (a KernelBench checkout) not set")
def test_kernelbench_static_checker_accepts_the_submission():
    """KernelBench's own static checker: valid with no errors for fp32, bf16 and fp16, and each warning it gives
    is listed, with its reason, in the README."""
    import importlib.util

    path = os.path.join(os.environ["KERNELBENCH_DIR"], "src", "kernelbench", "kernel_static_checker.py")
    spec = importlib.util.spec_from_file_location("kernel_static_checker", path)  # the one file, not the package
    checker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checker)
    validate_kernel_static = checker.validate_kernel_static

    with open(model_new.__file__) as f:
        code = f.read()
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")) as f:
        readme = f.read()
    for precision in ("fp32", "bf16", "fp16"):
        valid, errors, warnings = validate_kernel_static(code, backend="cuda", precision=precision)
        assert valid and not errors, (precision, errors)
        for warning in warnings:
            assert warning in readme, f"{precision}: warning {warning!r} is not explained in README.md"


def _nvcc(std="c++17"):
    """nvcc with torch's flags, under C++ standard `std` (None: no -std, nvcc's default unless more flags give one)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS  # the flags torch's extension build adds

    # Without --expt-relaxed-constexpr, which torch adds: the source is meant to build with plain nvcc too
    # (cuda_source()), and with it a host-only constexpr function called from device code would go unnoticed.
    return [nvcc, *([f"-std={std}"] if std else []), "-O3",
            *(f for f in COMMON_NVCC_FLAGS if f != "--expt-relaxed-constexpr")]


# The compiler runs of the CPU tests below, each once a session and side by side (tests/builds.py): the session's
# first test starts every one that the selected tests will wait for (_start_builds), and each test asserts on its own.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "tests"))
import builds  # noqa: E402

BUILDS = builds.Jobs()
# Start order: the host programs first (the first test to wait needs them), then the longest builds.
PRIORITY = {"host": 1, "torch_headers": 2, "source": 3, "toolkit": 4, "split": 5, "other": 6}
SOURCE_TARGETS = builds.SourceTargets(BUILDS, model_new.cuda_source, _nvcc)


@pytest.fixture(scope="session", autouse=True)
def _start_builds(request):
    """At the session's first test, starts the builds that the selected tests will wait for, so that they run side by
    side and beside the tests that need none; at its end, stops what is left. A build that cannot start here (no
    nvcc, no g++) is left to its test, which says why."""
    wanted = {}
    for item in request.session.items:
        wanted.setdefault(getattr(item, "originalname", item.name), []).append(
            getattr(getattr(item, "callspec", None), "params", {}))
    starters = [
        ("test_cuda_source_compiles_for_every_arch_without_spills", lambda p: _start_host_programs(PRIORITY["host"])),
        ("test_chooser_picks_only_kernels_each_arch_can_launch", lambda p: _start_host_programs(PRIORITY["host"])),
        ("test_argmin_order_is_torch_mins_in_any_fold_order", lambda p: _start_host_programs(PRIORITY["host"])),
        ("test_grad_weight_chooser_picks_built_b_where_two_ctas_fit", lambda p: _start_host_programs(PRIORITY["host"])),
        ("test_cuda_source_compiles_after_torchs_headers", lambda p: model_new._cuda_std() == "c++20" and _nvcc(None)
         and TORCH_HEADERS.start([q["arch"] for q in p], PRIORITY["torch_headers"])),
        ("test_cuda_source_compiles_for_every_arch_without_spills", lambda p: SOURCE_TARGETS.start(
            [(q["arch"], q["std"]) for q in p], PRIORITY["source"])),
        ("test_device_code_builds_with_cuda_12_8", lambda p: _start_toolkit_builds([q["arch"] for q in p],
                                                                                   PRIORITY["toolkit"])),
        ("test_split_tf32_bias_on_every_float", lambda p: _start_split_slices(PRIORITY["split"])),
        ("test_build_finds_the_cuda_toolkit_where_torchs_guess_has_no_headers",
         lambda p: _start_toolkit_syntax_check(PRIORITY["other"])),
        ("test_rate_tools_compile_without_spills", lambda p: [_start_rate_tool(q["tool"], PRIORITY["other"])
                                                              for q in p]),
        ("test_host_code_needs_no_cuda_math_library_headers",
         lambda p: _start_host_code(HOST_CODE_INCLUDES, priority=PRIORITY["other"])),
    ]
    for name, start in starters:
        if name in wanted:
            try:
                start(wanted[name])
            except (Exception, pytest.skip.Exception):
                pass  # the test starts it again and reports what fails
    yield
    BUILDS.close()


def _ptxas_report(arch="90a", std="c++17"):
    """What `nvcc -c -gencode=arch=compute_<arch>,code=sm_<arch> -Xptxas -v` prints for the CUDA source under `std`:
    ptxas's report of every kernel. Built once a session for all the tests that read it (tests/builds.py)."""
    _nvcc(std)  # skips where there is no nvcc
    returncode, report = SOURCE_TARGETS.report(arch, std)
    assert returncode == 0, report
    return report


# The host programs (tests/host/*.cpp: smem, chooser, argmin, split; main.cpp picks one by its first argument),
# appended to the CUDA source and built once into one executable. Its device code never runs and the host code is the
# same whatever the target (it sees no __CUDA_ARCH__), so the target is the cheapest: sm_75's PTX, where the fused
# kernels are empty.
HOST_PROGRAMS = ["smem.cpp", "chooser.cpp", "argmin.cpp", "split.cpp", "main.cpp"]
HOST_PROGRAM_TARGET = "-gencode=arch=compute_75,code=compute_75"


def _build_host_programs(flags):
    directory = BUILDS.directory("host")
    src, exe = os.path.join(directory, "host.cu"), os.path.join(directory, "host")
    parts = [model_new.cuda_source()]
    for name in HOST_PROGRAMS:
        path = os.path.join(HERE, "tests", "host", name)
        with open(path) as f:
            parts.append(f'#line 1 "{path}"\n{f.read()}')
    with open(src, "w") as f:
        f.write("\n".join(parts))
    proc = BUILDS.run([*flags, HOST_PROGRAM_TARGET, src, "-o", exe], timeout=600)
    assert proc.returncode == 0, proc.stderr
    return exe


def _start_host_programs(priority=builds.URGENT):
    flags = _nvcc()  # skips where there is no nvcc
    return BUILDS.submit(("host-programs",), lambda: _build_host_programs(flags), priority)


def _host_program(*args, input=None, timeout=60):
    """The stdout of the host program args[0] (tests/host/) run with the other args, and `input` on its stdin."""
    _start_host_programs()
    exe = BUILDS.result(("host-programs",), None)
    return subprocess.run([exe, *args], input=input, capture_output=True, text=True, timeout=timeout,
                          check=True).stdout


def _ptxas_kernels(report):
    """ptxas's report split per kernel (mangled name -> its lines), after checking that it has no warning and that
    no kernel uses a stack frame or spills."""
    assert "warning" not in report.lower(), report
    blocks = re.split(r"ptxas info\s*: Compiling entry function ", report)[1:]
    kernels = {b.split("'")[1]: b for b in blocks}
    for name, block in kernels.items():
        assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", block), f"{name}\n{block}"
    return kernels


# Every arch the issue of portability names (torch's CUDA builds target these); sm_90 is built as sm_90a.
BUILD_ARCHS = ["75", "80", "86", "89", "90a", "100", "120"]


@pytest.fixture(scope="module")
def fused_smem_bytes():
    """Each FUSED_TABLE row's shared memory per CTA, from the CUDA source's host code (no GPU needed)."""
    out = _host_program("smem", str(len(model_new.FUSED_TABLE))).split()
    assert len(out) == len(model_new.FUSED_KERNELS), out
    return dict(zip(model_new.FUSED_KERNELS, map(int, out)))


# The C++ standards the source is built under: model_new passes C++20 (torch 2.14's headers refuse C++17), C++17 for a
# torch built with CUDA 11, whose nvcc has no C++20.
CXX_STANDARDS = ["c++17", "c++20"]


@pytest.mark.parametrize("std", CXX_STANDARDS)
@pytest.mark.parametrize("arch", BUILD_ARCHS)
def test_cuda_source_compiles_for_every_arch_without_spills(arch, std, fused_smem_bytes):
    """The CUDA source compiles for each arch and standard with no warning, stack frame or spill: the fused kernels
    where the arch has their instructions (mma.sync from sm_80, wgmma on sm_90a) and gives a block their shared
    memory, empty elsewhere; the epilogue kernel everywhere."""
    report = _ptxas_report(arch, std)
    kernels = _ptxas_kernels(report)
    fused = {_instantiation(k): b for k, b in kernels.items() if "conv3x3_min_tanh2_kernel" in k}
    # each table row, once for inference and once saving the argmin for the backward
    assert sorted(fused) == sorted((k, save) for k in model_new.FUSED_KERNELS for save in (False, True)), list(kernels)
    epilogues = [k for k in kernels if "min_dim1_tanh2_kernel" in k]
    assert len(epilogues) == 2 * len(model_new.SUPPORTED_DTYPES), epilogues  # vector and scalar per element type
    # the backward's kernels, one per element type; on the tensor cores, the fed weight gradient (its one-hot B built by
    # its consumers, or by its producer)
    dtypes = len(model_new.ARGMIN_BACKWARD_DTYPES)
    for part, count in (("grad_input_kernel", dtypes), ("grad_weight_kernel", dtypes),
                        ("grad_weight_fed_kernel", 2 * dtypes), ("grad_weight_reduce_kernel", dtypes)):
        assert len([k for k in kernels if f"conv3x3_min_tanh2_{part}" in k]) == count, (part, list(kernels))
    # the fed dW with B built by its producer is compiled in only where two of its CTAs fit an SM (sm_90, sm_100), empty
    # elsewhere; the other wherever the fused kernels are
    fed = {k: int(re.search(r"Used (\d+) registers", b).group(1)) for k, b in kernels.items() if "grad_weight_fed" in k}
    for k, used in fed.items():
        built_b = re.search(r"Lb([01])E", k).group(1) == "1"
        compiled_in = arch in ("90a", "100") if built_b else arch != "75"
        assert (used >= 64) if compiled_in else (used < 16), (arch, k, used)
    regs = {k: int(re.search(r"Used (\d+) registers", b).group(1)) for k, b in fused.items()}
    for row in model_new.FUSED_TABLE:
        runs_here = arch == "90a" if row.mma == "wgmma" else arch != "75"
        runs_here &= fused_smem_bytes[row.name] <= SMEM_OPTIN_BY_ARCH[int(arch.rstrip("a"))]
        # A kernel compiled in holds its accumulators in registers (64 channels x tile columns over the 128 threads of
        # a consumer, twice for 3xTF32); one compiled out is an empty body.
        acc = 64 * row.tile_cols // 128 * (2 if row.precision == "strict_fp32" else 1)
        for save in (False, True):
            key = (row.name, save)
            assert (regs[key] >= acc) if runs_here else (regs[key] < 16), (arch, key, fused[key])
    if arch == "90a":
        # ptxas notes (C75xx, "Potential Performance Loss") when it serialises wgmma, e.g. for accumulator registers
        # touched while their MMAs may still run, or wgmma issued under a branch it cannot prove uniform.
        assert "potential performance loss" not in report.lower(), report


def test_only_the_wgmma_rings_fence_the_async_proxy():
    """A row ring's commit publishes the producer's shared-memory stores to the async proxy (fence.proxy.async) only
    where the consumer reads the slots by wgmma (ring.cuh, kAsyncReaders): in the sm_90a PTX every wgmma fused kernel
    fences at its setup and at its commits, and the mma.sync kernels and the fed dW (ldmatrix and plain loads, which
    the mbarrier's release and acquire order) never do (docs/design.md, the fed dW)."""
    _ptxas_report("90a", "c++17")  # skips where there is no nvcc; the build is the compile test's
    ptx = SOURCE_TARGETS.ptx("90a", "c++17")
    entries = re.split(r"\n\s*// \.globl\s+", ptx)[1:]
    fences = {e.split("\n", 1)[0].strip(): e.count("fence.proxy.async") for e in entries}
    wgmma = {row.name for row in model_new.FUSED_TABLE if row.mma == "wgmma"}
    fused = {k: n for k, n in fences.items() if "conv3x3_min_tanh2_kernel" in k}
    fed = {k: n for k, n in fences.items() if "grad_weight_fed_kernel" in k}
    assert len(fused) == 2 * len(model_new.FUSED_TABLE) and len(fed) == 2 * len(model_new.ARGMIN_BACKWARD_DTYPES)
    for k, n in fused.items():
        assert (n >= 2) if _instantiation(k)[0] in wgmma else (n == 0), (k, n)
    assert not any(fed.values()), fed


RATE_TOOLS = ["hmma_rate.cu", "wgmma_rate.cu", "rotate_rate.cu", "winograd_rate.cu", "winograd_wgmma_rate.cu",
              "winograd1d_rate.cu"]


def _start_rate_tool(tool, priority=builds.URGENT):
    src = os.path.join(HERE, "tools", "experiments", tool)
    cmd = [_nvcc()[0], "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", src, "-o",
           os.path.join(BUILDS.directory("rate"), tool[:-len(".cu")])]
    return BUILDS.submit(("rate", tool), lambda: BUILDS.run(cmd, timeout=300), priority)


@pytest.mark.parametrize("tool", RATE_TOOLS)
def test_rate_tools_compile_without_spills(tool):
    """The tensor-core rate probes of tools/experiments/ (docs/perf-notes.md quotes their output) still build for
    sm_90a, with no spill: a spilled accumulator would time local memory, not the tensor cores."""
    _start_rate_tool(tool)
    proc = BUILDS.result(("rate", tool), None)
    assert proc.returncode == 0, proc.stderr[-4000:]
    spills = re.findall(r"(\d+) bytes spill stores", proc.stderr)
    assert spills and all(n == "0" for n in spills), proc.stderr[-4000:]


@pytest.mark.parametrize("cuda, std", [("13.0", "c++20"), ("12.8", "c++20"), ("12.0", "c++20"), ("11.8", "c++17"),
                                       (None, "c++20")])
def test_build_standard_follows_the_cuda_torch_was_built_with(monkeypatch, cuda, std):
    """model_new's nvcc flags carry C++20 (torch 2.14's headers refuse nvcc's default C++17), C++17 only for a torch
    built with CUDA 11 (no C++20 in its nvcc), whatever torch headers are installed."""
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert model_new._cuda_cflags(["-gencode=arch=compute_86,code=sm_86"]) == \
        ["-O3", f"-std={std}", "-Xcompiler", "-fvisibility=hidden", "-gencode=arch=compute_86,code=sm_86"]


# Headers of the CUDA math libraries, which ATen/cuda/CUDAContext.h includes (CUDAContextLight.h).
CUDA_MATH_LIBRARY_HEADER = re.compile(r"\b(?:cublas|cusparse|cusolver|cudss)\w*\.h\b")


def test_host_code_needs_no_cuda_math_library_headers():
    """The C++ side of the extension (cpp_source, as load_inline compiles it) includes torch's headers and the CUDA
    runtime's, not those of cuBLAS, cuSPARSE, cuSOLVER or cuDSS: a CUDA install of the compiler and runtime alone
    (beside a CUDA build of torch, whose libraries come as wheels) lacks them, and there the build, and so the import
    of model_new, failed on every GPU. g++ lists what the source includes (-M), missing headers too (-MG)."""
    proc = _compile_host_code(HOST_CODE_INCLUDES)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = sorted(set(CUDA_MATH_LIBRARY_HEADER.findall(proc.stdout)))
    assert not found, f"the host code includes {found}"


HOST_CODE_INCLUDES = ["-M", "-MG"]  # g++ lists what the source includes, missing headers too
HOST_CODE_SYNTAX = ["-fsyntax-only"]


def _start_host_code(flags, include_dirs=(), priority=builds.URGENT):
    """g++ on the C++ side of the extension (cpp_source, after torch/extension.h, as load_inline compiles it) with
    torch's include paths, Python's (pybind11 needs it) and include_dirs: its key in BUILDS."""
    from torch.utils.cpp_extension import include_paths

    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not on PATH")
    key = ("g++", tuple(flags), tuple(include_dirs))
    includes = [*include_paths(), sysconfig.get_paths()["include"], *include_dirs]

    def compile():
        src = os.path.join(BUILDS.directory(f"g++-{abs(hash(key))}"), "main.cpp")
        with open(src, "w") as f:
            f.write("#include <torch/extension.h>\n" + model_new.cpp_source())
        return BUILDS.run([gxx, "-std=c++20", *flags, *(f"-I{p}" for p in includes), src], timeout=300)

    BUILDS.submit(key, compile, priority)
    return key


def _compile_host_code(flags, include_dirs=()):
    """The CompletedProcess of _start_host_code's g++ run, once a session for each set of flags and include_dirs."""
    return BUILDS.result(_start_host_code(flags, include_dirs), None)


def _toolkit_home(home):
    """A CUDA home as torch guesses it from a wrapper nvcc (bin/nvcc a script running the real one, no include/), and
    model_new._toolkit_paths of it."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    wrapper = home / "bin" / "nvcc"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f'#!/bin/sh\nexec "{os.path.realpath(nvcc)}" "$@"\n')
    wrapper.chmod(0o755)
    return model_new._toolkit_paths(str(home))


def _cuda_macros_stub():
    """A directory that holds an empty c10/cuda/impl/cuda_cmake_macros.h (generated at torch's build; a CPU wheel
    ships without it) where torch's include paths lack it, else None."""
    from torch.utils.cpp_extension import include_paths

    macros = "c10/cuda/impl/cuda_cmake_macros.h"
    if any(os.path.isfile(os.path.join(p, macros)) for p in include_paths()):
        return None
    stub = BUILDS.directory("stub")
    os.makedirs(os.path.dirname(os.path.join(stub, macros)), exist_ok=True)
    with open(os.path.join(stub, macros), "w"):
        pass
    return stub


def _start_toolkit_syntax_check(priority):
    import pathlib

    include_dirs, _ = _toolkit_home(pathlib.Path(BUILDS.directory("cuda-home-start")))
    stub = _cuda_macros_stub()
    _start_host_code(HOST_CODE_SYNTAX, [*include_dirs, *([stub] if stub else [])], priority)


def test_build_finds_the_cuda_toolkit_where_torchs_guess_has_no_headers(tmp_path):
    """torch takes the CUDA toolkit (CUDA_HOME) to be two levels above the nvcc on PATH. For an nvcc that is a wrapper
    script outside the toolkit (/usr/local/bin/nvcc running /usr/local/cuda-13.0/bin/nvcc) that is a directory with no
    CUDA headers, and the C++ side of the build failed there ("cuda_runtime.h: No such file"), on every GPU. Here such
    a home (bin/nvcc a wrapper script, no include/): model_new._toolkit_paths must name nvcc's own include and library
    directories (cuda_runtime.h, libcudart), and the C++ source must compile with them. Where the home holds the
    headers it adds nothing."""
    import glob

    include_dirs, library_dirs = _toolkit_home(tmp_path / "home")
    assert any(os.path.isfile(os.path.join(d, "cuda_runtime.h")) for d in include_dirs), include_dirs
    assert any(glob.glob(os.path.join(d, "libcudart.so*")) for d in library_dirs), library_dirs
    stub = _cuda_macros_stub()
    proc = _compile_host_code(HOST_CODE_SYNTAX, [*include_dirs, *([stub] if stub else [])])
    assert proc.returncode == 0, proc.stderr[-4000:]
    full = tmp_path / "full"
    (full / "include").mkdir(parents=True)
    (full / "include" / "cuda_runtime.h").write_text("")
    assert model_new._toolkit_paths(str(full)) == ([], [])


# torch 2.14's check in ATen.h, which refuses C++17 (its headers are not installed here: CI installs 2.13's)
NEWER_TORCH_HEADER_CHECK = "#if !defined(_MSC_VER) && __cplusplus < 202002L\n#error C++20 or later compatible compiler " \
                           "is required to use ATen.\n#endif"


def _torch_headers_build(archs, directory):
    """The command of test_cuda_source_compiles_after_torchs_headers for archs (its source written to directory)."""
    from torch.utils.cpp_extension import include_paths

    src = os.path.join(directory, "cuda.cu")
    with open(src, "w") as f:
        f.write("\n".join([NEWER_TORCH_HEADER_CHECK, "#include <torch/types.h>", "#include <cuda.h>",
                           "#include <cuda_runtime.h>", model_new.cuda_source()]))
    flags = model_new._cuda_cflags([f"-gencode=arch=compute_{arch},code=sm_{arch}" for arch in archs])
    return [*_nvcc(None), *(f"-I{p}" for p in include_paths()), *flags, "-c", src, "-o",
            os.path.join(directory, "cuda.o")]


# One nvcc run for every arch (the host code, torch's headers the most of it, compiled once); where it fails, each
# arch again alone, so that each test reports its own.
TORCH_HEADERS = builds.PerArch(BUILDS, "torch-headers", _torch_headers_build, timeout=900)
NEWER_GPU_ARCHS = ["86", "100", "120"]  # the GPUs only emulated on the GPU at hand, one per generation


@pytest.mark.parametrize("arch", NEWER_GPU_ARCHS)
def test_cuda_source_compiles_after_torchs_headers(arch):
    """What load_inline compiles on a torch without its no_implicit_headers option (pyproject allows torch >= 2.4):
    torch's headers first, then the CUDA source, under torch's flags and model_new's own, whose standard must be one
    that every torch's headers accept: those installed here, and torch 2.14's check, which refuses C++17 (nvcc's
    default). cuda_fp16.h and cuda_bf16.h are then included under __CUDA_NO_HALF_CONVERSIONS__ and its kin, with no
    conversion operators, so the source converts between element types by intrinsics (with the operators it failed
    to build there, on every arch)."""
    if model_new._cuda_std() != "c++20":
        pytest.skip("torch built with CUDA 11: its nvcc has no C++20, and torch 2.14's headers are not for it")
    returncode, output = TORCH_HEADERS.result(arch)
    assert returncode == 0, output[-4000:]


sys.path.insert(0, os.path.join(HERE, "tools"))
TOOLKIT_BUILDS = {}  # arch -> the key of the job that builds it with CUDA 12.8


def _start_toolkit_builds(archs, priority=builds.URGENT):
    """One job for archs: fetch CUDA 12.8's NVRTC and ptxas, then build each arch in turn (NVRTC runs in this
    process). The C++ standard is taken here, in the test's thread: cuda_std patches torch.version for a moment."""
    import toolkit_build

    archs = tuple(a for a in archs if a not in TOOLKIT_BUILDS)
    if not archs:
        return
    std = toolkit_build.cuda_std("12.8")

    def build():
        root = toolkit_build.fetch("12.8")
        directory = BUILDS.directory(f"toolkit-12.8-{'-'.join(archs)}")
        return {arch: toolkit_build.build(root, "12.8", arch, directory, std) for arch in archs}

    BUILDS.submit(("toolkit", "12.8", archs), build, priority)
    TOOLKIT_BUILDS.update({arch: ("toolkit", "12.8", archs) for arch in archs})


@pytest.mark.parametrize("arch", NEWER_GPU_ARCHS)
def test_device_code_builds_with_cuda_12_8(arch):
    """What a GPU user builds with is the CUDA their torch was built with (torch's cu126 and cu128 wheels: CUDA 12),
    where CI's nvcc is 13.0: every kernel of the CUDA source built by CUDA 12.8's front end (NVRTC, from PyPI) and
    ptxas, with no error, no missing kernel, stack frame or spill (tools/toolkit_build.py; host code not covered)."""
    import toolkit_build

    _start_toolkit_builds([arch])
    try:
        problems, report = BUILDS.result(TOOLKIT_BUILDS[arch], None)[arch]
    except toolkit_build.FetchError as e:
        pytest.skip(f"CUDA 12.8's NVRTC and ptxas could not be fetched from PyPI: {e}")
    assert not problems, f"{problems}\n{report[-4000:]}"


@pytest.mark.parametrize("args, expected", [
    (["--cuda", "13.0", "--arch", "86"], "--cuda: expected a CUDA 11 or 12 release such as 12.8, got '13.0'"),
    (["--cuda", "12.8", "--arch", "sm_86"], "--arch: expected a compute capability such as 86 or 100, got 'sm_86'"),
])
def test_toolkit_build_refuses_bad_arguments_in_one_line(tmp_path, args, expected):
    """tools/toolkit_build.py: a release it cannot fetch or an arch nvcc does not spell so is an argument error (exit
    2, one line naming what was expected and what came), before anything is fetched or any directory made."""
    tool = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools", "toolkit_build.py")
    workdir = tmp_path / "work"
    proc = subprocess.run([sys.executable, tool, *args, "--workdir", str(workdir)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.strip().splitlines()[-1].endswith(expected), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not workdir.exists()


def _instantiation(mangled):
    """(FUSED_TABLE name, saves the argmin) of a mangled conv3x3_min_tanh2_kernel<FusedTraits<...>, kSave>: the row
    that tools/machine_code.py reads off its template arguments."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools"))
    import machine_code

    table = machine_code.tag_table(model_new)
    name = machine_code.kernel_names([mangled], table)[mangled]
    assert name.startswith("fused/"), (mangled, name)
    parts = name.split("/")
    return parts[1], len(parts) == 3


# The shared memory one block may opt in to, by arch (CUDA programming guide, compute capabilities table).
SMEM_OPTIN_BY_ARCH = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024,
                      90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024}
# Emulated sm_90 GPUs with less shared memory a block than an H100 (emulate_device may narrow it): between the guarded
# kernels' needs and their guards' (sm90_f16x3 121,488 B, sm90_tf32x3 225,920 B), and below both.
SM90_SMEM_SWEEP = [99 * 1024, 130 * 1024, 200 * 1024, 225 * 1024]


def test_chooser_picks_only_kernels_each_arch_can_launch():
    """The chooser (choose_fused_kernel, host code of the CUDA source) asked for every arch, precision, input dtype and
    backend: what it picks fits that arch's shared memory, is a wgmma kernel only on sm_90 with sm_90a code, is
    nothing below sm_80 and nothing for a (precision, input) that no row has, and exists for every (precision, input)
    of the table on every sm_80+ arch (fused everywhere from sm_80, autocast's float32 input included). A guarded
    kernel is picked only with a guard of its precision and MMA that fits too, also on sm_90 GPUs with less shared
    memory than the guard needs."""
    archs = sorted(SMEM_OPTIN_BY_ARCH.items()) + [(90, smem) for smem in SM90_SMEM_SWEEP]
    dtypes = model_new.SUPPORTED_DTYPES
    stdin = f"{len(model_new.PRECISIONS)} {len(dtypes)}\n" + "".join(f"{sm} {smem}\n" for sm, smem in archs)
    out = _host_program("chooser", input=stdin).split("\n")
    rows = [tuple(int(v) for v in line.split()) for line in out if line.strip()]
    assert len(rows) == len(archs) * 2 * len(model_new.PRECISIONS) * len(dtypes) * 2
    optins = [smem for _, smem in archs for _ in range(2 * len(model_new.PRECISIONS) * len(dtypes) * 2)]
    pairs = {(k.precision, model_new.INPUT_DTYPES[k.input]) for k in model_new.FUSED_TABLE}
    for (sm, wgmma_built, precision, input_code, mma_sync_only, kernel, smem, guard, guard_smem), optin in zip(rows, optins):
        where = (sm, optin, wgmma_built, model_new.PRECISIONS[precision], dtypes[input_code], mma_sync_only)
        if sm < 80 or (model_new.PRECISIONS[precision], dtypes[input_code]) not in pairs:
            assert kernel == -1, where
            continue
        assert kernel >= 0, f"nothing fused for {where}"
        row = model_new.FUSED_TABLE[kernel]
        assert row.precision == model_new.PRECISIONS[precision], (where, row)
        assert model_new.INPUT_DTYPES[row.input] == dtypes[input_code], (where, row)
        assert 0 < smem <= optin, (where, row, smem)
        wgmma_here = sm == 90 and wgmma_built and not mma_sync_only
        assert row.mma == "mma_sync" or wgmma_here, (where, row)
        if optin == SMEM_OPTIN_BY_ARCH[sm]:  # the GPUs as they are: wgmma wherever it can run
            assert row.mma == ("wgmma" if wgmma_here else "mma_sync"), (where, row)
        if row.tag in model_new.GUARDED_TAGS:
            assert guard >= 0, f"{row.name} picked without a guard for {where}"
            guard_row = model_new.FUSED_TABLE[guard]
            assert guard_row.name in model_new.GUARD_KERNELS and (guard_row.precision, guard_row.mma) == \
                (row.precision, row.mma), (where, row, guard_row)
            assert 0 < guard_smem <= optin, (where, guard_row, guard_smem)
        else:
            assert guard == -1, (where, row, guard)


def test_grad_weight_chooser_picks_built_b_where_two_ctas_fit():
    """The dW chooser (choose_grad_weight_kernel, host code of the CUDA source) for every arch's shared memory and the
    emulated sm_90 sweep: the walkers without tensor cores; with them the fed kernel, its B built by its producer
    exactly where two such CTAs fit an SM (an SM holds the opt-in and 1 KB more, 1 KB reserved a CTA: sm_90 and
    sm_100 at 227 KB), and two CTAs of whichever fed kernel it picks always fit."""
    archs = sorted(SMEM_OPTIN_BY_ARCH.items()) + [(90, smem) for smem in SM90_SMEM_SWEEP]
    out = _host_program("chooser", "dw", input="".join(f"{sm} {smem}\n" for sm, smem in archs))
    rows = [tuple(int(v) for v in line.split()) for line in out.split("\n") if line.strip()]
    assert len(rows) == 2 * len(archs), out
    assert {k for optin, tc, k, _ in rows if tc and optin == 227 * 1024} == {2}
    assert {k for optin, tc, k, _ in rows if tc and optin <= 163 * 1024} == {1}
    built_b_bytes = next(b for _, tc, k, b in rows if k == 2)  # the built-B kernel's shared memory a CTA
    for optin, tensor_cores, kernel, smem in rows:
        if not tensor_cores:
            assert kernel == 0, (optin, kernel)
            continue
        assert kernel == (2 if 2 * (built_b_bytes + 1024) <= optin + 1024 else 1), (optin, kernel)
        if optin >= 163 * 1024:  # the 99 KB GPUs hold one fed CTA an SM
            assert 2 * (smem + 1024) <= optin + 1024, (optin, kernel, smem)


def test_argmin_order_is_torch_mins_in_any_fold_order():
    """keep_min (the saving epilogues' combine, host code of the CUDA source) folded over 64-channel pixels in three
    orders (in order, reversed, a butterfly: the kernels fold across lanes and warps in orders of their own), and
    scan_min (the in-register scans) in channel order, give torch.min's value and index: a NaN first (the lowest channel among NaNs), then the smallest value, ties to the
    lowest channel. So does scan_min_finite (the guarded kernels' scan) on the pixels without a NaN. Pixels drawn from
    a few values (many ties, NaN, +-inf, +-0) and from random floats."""
    gen = torch.Generator().manual_seed(0)
    numbers = torch.tensor([float("-inf"), float("inf"), -1.0, -0.5, -0.0, 0.0, 0.5, 1.0])
    pools = [numbers, torch.cat([numbers, torch.tensor([float("nan")])]), torch.tensor([0.0, 1.0]),
             torch.tensor([float("nan"), 0.0])]  # ties among numbers, NaN among them, few values, NaN or zero
    rows = [pool[torch.randint(len(pool), (n,), generator=gen)] for pool in pools for n in (1, 2, 3, 5, 16, 64)
            for _ in range(20)]
    rows += [torch.randn(64, generator=gen) for _ in range(50)]
    assert sum(not r.isnan().any() and (r == r.min()).sum() > 1 for r in rows) > 100  # ties at the min, no NaN
    stdin = "".join(f"{len(r)} " + " ".join(f"{b & 0xFFFFFFFF:08x}" for b in r.view(torch.int32).tolist()) + "\n"
                    for r in rows)
    out = _host_program("argmin", input=stdin)
    results = [line.split() for line in out.splitlines()]
    assert len(results) == len(rows) and all(len(got) == 10 for got in results)
    for r, got in zip(rows, results):
        value, index = torch.min(r, dim=0)
        checked = got if not r.isnan().any() else got[:8]  # scan_min_finite's pair only where no NaN
        for bits, channel in zip(checked[0::2], checked[1::2]):
            folded = torch.tensor([int(bits, 16)], dtype=torch.int64).to(torch.int32).view(torch.float32)[0]
            assert int(channel) == int(index), (r.tolist(), got)
            assert (folded.isnan() and value.isnan()) or folded == value, (r.tolist(), got)


# The split check's 2^32 bit patterns in as many slices as BUILDS has workers, run side by side.
SPLIT_SLICES = BUILDS.workers


def _split_slice(exe, i):
    proc = BUILDS.run([exe, "split", str(i), str(SPLIT_SLICES)], timeout=600)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, proc.stdout, proc.stderr)
    return proc.stdout.split()


def _start_split_slices(priority=builds.URGENT):
    _start_host_programs(priority)
    return [BUILDS.submit(("split", i, SPLIT_SLICES), lambda exe, i=i: _split_slice(exe, i), priority,
                          after=("host-programs",)) for i in range(SPLIT_SLICES)]


def test_split_tf32_bias_on_every_float():
    """The wgmma TF32 kernel adds the fp32 bias through the tensor cores as three TF32 parts (split_tf32_bias, host
    code of the CUDA source). Over all 2^32 bit patterns: the parts as a tensor core reads them sum to the bias
    exactly (within 2^-136 below |bias| = 2^-113, where TF32 has no room for the last bits), part 0 never overflows,
    an infinity is part 0 alone and a NaN stays a NaN."""
    _start_split_slices()
    slices = [BUILDS.result(("split", i, SPLIT_SLICES), None) for i in range(SPLIT_SLICES)]  # checked, bad, first
    bad = sum(int(s[1]) for s in slices)
    assert sum(int(s[0]) for s in slices) == 2 ** 32
    assert bad == 0, f"{bad} bit patterns split wrong, the first 0x{next(s[2] for s in slices if int(s[1]))}"


# ================================================================================================ GPU tests
def _cuda_models(seed=0, **kw):
    return make_models(seed, device="cuda", **kw)


def _case(key, seed):
    """(case, reference, fn, dtype) for a case key: the reference and the case's path in its precision (the TF32 flag
    set for the test; tf32_default restores it). A kernel case skips where this GPU cannot launch that kernel."""
    case = harness.CASES[key]
    if case.kernel is not None and not model_new.fused_kernel_launches(case.kernel):
        pytest.skip(f"this GPU cannot launch {case.kernel}")
    ref, fn = harness.case_model(case, seed)
    dtype = harness.PRECISIONS[case.precision].dtype
    if case.backend == "fused":  # the fused backend must run a fused kernel of this precision on every sm_80+ GPU
        assert fn.model.fused_kernel(torch.empty(1, 16, 3, 3, device="cuda", dtype=dtype)) in \
            [k.name for k in model_new.FUSED_TABLE if k.precision == case.precision]
    return case, ref, fn, dtype


def _check_output(got, want, x, ref, backend, mode="tf32"):
    """cudnn_epilogue runs the reference's own cuDNN conv, so it must match the reference at 1e-4 everywhere.
    The fused kernels compute a TF32 conv with round-to-nearest operands. cuDNN runs the reference in TF32 at the
    problem size (test_full_size_matches_reference insists on it), but for some small shapes it picks a
    full-fp32 algorithm even with TF32 allowed; there the two differ by the TF32 rounding itself (~2e-4). So a
    fused output must match the TF32 emulation to 5e-5, and the reference at 1e-4 wherever the reference is TF32,
    else at the TF32-vs-fp32 distance (5e-4)."""
    if backend == "cudnn_epilogue":
        tol = harness.ATOL if mode in ("tf32", "strict_fp32") else harness.PRECISIONS[mode].tol
        ok, diff = compare(got, want, atol=tol, rtol=tol)
        assert ok, f"cudnn_epilogue: max abs diff {diff} vs the reference"
        return
    if mode != "tf32":  # strict fp32 at 1e-5 of the strict reference; bf16 / fp16 at KernelBench's 1e-2
        tol = harness.PRECISIONS[mode].tol
        ok, diff = compare(got, want, atol=tol, rtol=tol)
        assert ok, f"{backend} {mode}: max abs diff {diff} vs the reference"
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
    assert model_new.extension_available()


def test_l2_flush_buffer_is_on_the_gpu_and_twice_its_l2(monkeypatch):
    """The timer's flush must write GPU memory: a host buffer (bench.py's first flush: torch.empty with no device)
    leaves L2 as it was and lets the GPU idle while the CPU fills it. Checked on any machine by intercepting the
    allocation, and for real where a GPU is present."""
    import types

    made = {}

    def fake_empty(*size, **kwargs):
        made.update(size=size, **kwargs)
        return "buffer"

    if HAS_CUDA:
        flush = harness.l2_flush_buffer()
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        assert flush.is_cuda and flush.numel() * flush.element_size() >= 2 * l2, (flush.device, flush.numel())
    fake_props = types.SimpleNamespace(L2_cache_size=50 << 20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: fake_props)
    monkeypatch.setattr(torch, "empty", fake_empty)
    assert harness.l2_flush_buffer() == "buffer"
    device = made.get("device")
    assert device is not None and torch.device(device).type == "cuda", f"flush buffer allocated on {device!r}"
    assert made["size"][0] * 4 >= 256 << 20
    with pytest.raises(ValueError, match="expected a CUDA device, got cpu"):
        harness.l2_flush_buffer("cpu")


def _expected_kernel(precision, mma_sync_only=False):
    """What this GPU must run, written out by hand (not from the table): wgmma on sm_90 unless mma.sync is forced;
    else the mma.sync kernel. TF32 runs on fp16 operands everywhere, strict fp32 on fp16 parts."""
    if torch.cuda.get_device_capability() == (9, 0) and not mma_sync_only:
        return {"tf32": "sm90_tf32_f16", "strict_fp32": "sm90_f16x3", "bf16": "sm90_bf16",
                "fp16": "sm90_fp16"}[precision]
    return {"tf32": "sm80_tf32_f16", "strict_fp32": "sm80_f16x3", "bf16": "sm80_bf16", "fp16": "sm80_fp16"}[precision]


@needs_cuda
def test_auto_backend_decision_table_on_gpu(tf32_default):
    """The C++ table: fused for a batched input of the 16->64 3x3 conv in float32 (TF32 or strict, as the reference
    conv would run), bfloat16 or float16; cudnn_epilogue for everything else; a forced fused backend refuses what it
    cannot run. fused_mma_sync runs the mma.sync kernel of the same precision."""
    _, new = _cuda_models()
    x = torch.rand(1, 16, 4, 4, device="cuda")
    assert new.resolve_backend(x) == "fused"
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert model_new.fused_mma_kind() == ("wgmma" if hopper else "mma_sync")
    assert new.fused_kernel(x) == _expected_kernel("tf32")
    assert new.resolve_backend(x[0]) == "cudnn_epilogue"  # unbatched: the min runs over rows
    assert new.fused_kernel(x[0]) is None
    torch.backends.cudnn.allow_tf32 = False
    assert new.resolve_backend(x) == "fused"
    assert new.fused_kernel(x) == _expected_kernel("strict_fp32")
    new.backend = "fused_mma_sync"  # strict fp32 on mma.sync too: three products, never plain TF32
    assert new.fused_kernel(x) == _expected_kernel("strict_fp32", mma_sync_only=True)
    new.backend = "auto"
    torch.backends.cudnn.allow_tf32 = True
    saved_enabled = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = False  # the native conv runs in plain fp32
    assert new.fused_kernel(x) == _expected_kernel("strict_fp32")
    torch.backends.cudnn.enabled = saved_enabled
    conv_settings = getattr(torch.backends.cudnn, "conv", None)
    if conv_settings is not None and hasattr(conv_settings, "fp32_precision"):
        saved = conv_settings.fp32_precision
        conv_settings.fp32_precision = "ieee"
        assert new.fused_kernel(x) == _expected_kernel("strict_fp32")
        conv_settings.fp32_precision = saved
    assert new.resolve_backend(x) == "fused"
    new.backend = "fused_mma_sync"
    assert new.fused_kernel(x) == _expected_kernel("tf32", mma_sync_only=True)
    new.backend = "auto"
    for dtype, mode in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        new.to(dtype)
        assert new.resolve_backend(x.to(dtype)) == "fused"
        assert new.fused_kernel(x.to(dtype)) == _expected_kernel(mode)
        new.backend = "fused_mma_sync"
        assert new.fused_kernel(x.to(dtype)) == f"sm80_{mode}"
        new.backend = "auto"
    new.double()
    assert new.resolve_backend(x.double()) == "cudnn_epilogue"
    for backend in ("fused", "fused_mma_sync"):
        new.backend = backend
        with pytest.raises(ValueError, match=rf"backend '{backend}' needs a 4-D input and a 16->64 3x3 conv in "
                                             r"float32, bfloat16 or float16 .*; got a 4-D torch\.float64 input, "
                                             r"weight \[64, 16, 3, 3\], TF32 convs allowed, on sm_\d+ with \d+ bytes"):
            new(x.double())
    new.backend = "auto"
    _, other = _cuda_models(0, init_inputs=[16, 32, 3])
    assert other.resolve_backend(x) == "cudnn_epilogue"


# What each GPU profile (harness.DEVICE_PROFILES) runs per precision: None is cudnn_epilogue. Written out by hand, not
# derived from the table, so that a change of the chooser's answers shows here.
_SM80 = {"tf32": "sm80_tf32_f16", "strict_fp32": "sm80_f16x3", "bf16": "sm80_bf16", "fp16": "sm80_fp16"}
PROFILE_KERNELS = {
    "T4": dict.fromkeys(harness.PRECISIONS),
    "A100": _SM80,
    "A10G": _SM80,
    "L40S": _SM80,
    "H100": {"tf32": "sm90_tf32_f16", "strict_fp32": "sm90_f16x3", "bf16": "sm90_bf16", "fp16": "sm90_fp16"},
    "B200": _SM80,
    "RTX5090": _SM80,
}
PROFILE_SHAPES = [FULL_SHAPE, (3, 16, 67, 300), (2, 16, 259, 130), (2, 16, 40, 600)]
_profile_truth = {}


def _problem(precision, shape):
    """(reference, x, its output, float64 truth) per precision and shape, computed once for all profiles."""
    key = (precision, shape)
    if key not in _profile_truth:
        spec = harness.PRECISIONS[precision]
        torch.backends.cudnn.allow_tf32 = spec.allow_tf32
        ref, _ = _cuda_models(40)
        ref = ref.to(spec.dtype)
        x = make_input(shape, seed=41, device="cuda").to(spec.dtype)
        want = _run(ref, x)
        truth = harness.float64_forward(x, ref.conv.weight.detach(), ref.conv.bias.detach())
        _profile_truth[key] = (ref, x, want, truth)
    return _profile_truth[key]


@needs_cuda
@pytest.mark.parametrize("profile", list(PROFILE_KERNELS))
def test_device_profiles_choose_and_compute_right(profile, tf32_default):
    """Under emulate_device, for each GPU profile and precision: the kernel chosen (a fused one on every sm_80+ GPU,
    in every precision, fitting its shared memory); the output against the reference at the problem size and on
    ragged shapes (1e-4 TF32, 1e-5 strict against the strict reference, 1e-2 bf16/fp16; TF32 as _check_output
    says, since cuDNN runs some small shapes in full fp32); and, at the problem size, no further from the float64
    truth than the precision's bound times the reference's own error."""
    if not model_new.fused_kernel_launches("sm90_tf32") and profile == "H100":
        pytest.skip("the H100 profile needs an sm_90 GPU")
    capability, smem = harness.DEVICE_PROFILES[profile]
    for precision, expected in PROFILE_KERNELS[profile].items():
        spec = harness.PRECISIONS[precision]
        for shape in PROFILE_SHAPES:
            ref, x, want, truth = _problem(precision, shape)
            torch.backends.cudnn.allow_tf32 = spec.allow_tf32
            _, new = _cuda_models(40)
            new = new.to(spec.dtype)
            with model_new.emulate_device(capability=capability, smem_optin=smem):
                assert new.fused_kernel(x) == expected, (profile, precision)
                assert new.resolve_backend(x) == ("cudnn_epilogue" if expected is None else "fused")
                harness.poison_cuda_allocator(want.numel() * 4)
                got = _run(new, x)
            if expected is not None:
                assert model_new.fused_kernel_smem_bytes(expected) <= smem
            _check_output(got, want, x, ref, "cudnn_epilogue" if expected is None else expected, precision)
            if shape != FULL_SHAPE:
                continue
            err, ref_err = harness.max_abs_error(got, truth), harness.max_abs_error(want, truth)
            bound = spec.truth_bound if expected is not None else 1.0
            assert err <= bound * ref_err, \
                f"{profile} {precision} {shape} ({expected}): error vs float64 {err} > {bound} x reference's {ref_err}"


@needs_cuda
def test_emulate_device_nests_restores_and_refuses_what_cannot_launch(tf32_default):
    _, new = _cuda_models()
    x = torch.rand(1, 16, 4, 4, device="cuda")
    real = new.fused_kernel(x)
    with harness.emulated("A10G"):
        assert new.fused_kernel(x) == "sm80_tf32_f16" and model_new.fused_mma_kind() == "mma_sync"
        with harness.emulated("T4"):
            assert new.fused_kernel(x) is None and new.resolve_backend(x) == "cudnn_epilogue"
        assert new.fused_kernel(x) == "sm80_tf32_f16"
    assert new.fused_kernel(x) == real
    too_much = torch.cuda.get_device_properties(0).shared_memory_per_block_optin + 1
    with pytest.raises(ValueError, match=rf"emulate_device expects smem_optin of 1\.\.\d+ bytes .*got {too_much}"):
        with model_new.emulate_device(capability=(8, 0), smem_optin=too_much):
            pass
    if torch.cuda.get_device_capability() != (9, 0):
        with pytest.raises(ValueError, match=r"could choose sm90_\w+, which this GPU cannot launch"):
            with harness.emulated("H100"):
                pass
    assert new.fused_kernel(x) == real  # a refused emulation leaves nothing behind


@needs_cuda
@pytest.mark.parametrize("seed", range(5))
def test_full_size_matches_reference(seed, tf32_default):
    """The full problem, fresh inputs per seed, against the reference, the float64 truth and the TF32 emulation.
    This is the test that catches a fused kernel that stops rounding its operands (cvt.rna dropped, i.e. truncated
    TF32): that output is about 8e-4 from the emulation here, 16x the 5e-5 allowed, and fails the 1e-4 check."""
    ref, new = _cuda_models(seed)
    x = make_input(FULL_SHAPE, seed=1000 + seed, device="cuda")
    w, b = ref.conv.weight.detach(), ref.conv.bias.detach()
    want = _run(ref, x)
    truth = harness.float64_forward(x, w, b)
    tf32_truth = harness.float64_forward(x, w, b, operands=harness.round_tf32)
    ref_err = harness.max_abs_error(want, truth)
    assert harness.max_abs_error(want, tf32_truth) <= TF32_EMULATION_TOL, "the reference is not TF32 here"
    outputs = {}
    fused_bound = harness.PRECISIONS["tf32"].truth_bound
    for backend, err_factor in (("fused", fused_bound), ("fused_mma_sync", fused_bound), ("cudnn_epilogue", 1.0)):
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
@pytest.mark.parametrize("mode", ["strict_fp32", "bf16", "fp16"])
def test_other_precisions_full_size(mode, tf32_default):
    """The full problem in strict fp32 (TF32 off), bf16 and fp16 (a model converted with .to(dtype)), fresh inputs
    per seed: the output has the reference's dtype, is within 1e-5 (strict) or KernelBench's 1e-2 of the
    reference in that precision, and is no further from the float64 truth than 2x (strict) or 1x the reference's
    own error. Every backend: the fused kernel, the mma.sync one, and cuDNN + epilogue (which must match the
    reference at the same tolerance)."""
    spec = harness.PRECISIONS[mode]
    tol, bound = spec.tol, spec.truth_bound
    for backend in ("fused", "fused_mma_sync", "cudnn_epilogue"):
        torch.backends.cudnn.allow_tf32 = spec.allow_tf32
        ref, new = (m.to(spec.dtype) for m in _cuda_models(30, backend=backend))
        for seed in range(2):
            x = make_input(FULL_SHAPE, seed=2000 + seed, device="cuda").to(spec.dtype)
            want = _run(ref, x)
            harness.poison_cuda_allocator(want.numel() * 4)
            got = _run(new, x)
            assert got.dtype == spec.dtype and got.shape == want.shape
            ok, diff = compare(got, want, atol=tol, rtol=tol)
            assert ok, f"{backend} {mode}: max abs diff {diff} vs the reference"
            truth = harness.float64_forward(x, ref.conv.weight.detach(), ref.conv.bias.detach())
            err, ref_err = harness.max_abs_error(got, truth), harness.max_abs_error(want, truth)
            assert err <= bound * ref_err, \
                f"{backend} {mode}: error vs float64 {err} > {bound} x the reference's {ref_err}"
            del x, want, got, truth


@needs_cuda
def test_float64_on_cuda_matches_the_reference():
    ref, new = _cuda_models(31)
    ref, new = ref.double(), new.double()
    x = make_input((3, 16, 40, 70), seed=3, device="cuda").double()
    got, want = _run(new, x), _run(ref, x)
    assert got.dtype == torch.float64
    assert compare(got, want, atol=1e-12, rtol=1e-12)[0]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *LOW_PRECISION], ids=str)
def test_unbatched_input_on_gpu(dtype, tf32_default):
    """(C, H, W) in, (64, 1, W-2) out: the min over the conv output's rows, as the reference computes it."""
    ref, new = _cuda_models(32)
    ref, new = ref.to(dtype), new.to(dtype)
    tol = LOW_PRECISION_TOL if dtype in LOW_PRECISION else harness.ATOL
    for shape in ((16, 12, 10), (16, 256, 256), (16, 3, 300)):
        x = make_input(shape, seed=4, device="cuda").to(dtype)
        got, want = _run(new, x), _run(ref, x)
        assert got.shape == want.shape == (64, 1, shape[2] - 2) and got.dtype == dtype
        ok, diff = compare(got, want, atol=tol, rtol=tol)
        assert ok, f"{shape}: max abs diff {diff}"


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
    (5, 16, 40, 600),  # ranges run from one column block into the next, for 40 to 376 consumers (3 images: none at 264)
    (2, 16, 301, 19),
    (1, 16, 3, 1000),  # one output row
    (5, 16, 4, 6),  # W % 4 != 0 and W % 4 == 0 mixed with tiny sizes
    (64, 16, 20, 19),  # many short strips, odd width: consumers run several steps and cross strips (element path)
    (0, 16, 8, 8),  # an empty batch
]


@needs_cuda
@pytest.mark.parametrize("key", CASE_KEYS)
@pytest.mark.parametrize("shape", EDGE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_edge_shapes(shape, key, tf32_default):
    case, ref, fn, dtype = _case(key, 8)
    for seed in range(2):
        x = make_input(shape, seed=seed, device="cuda").to(dtype)
        want = _run(ref, x)
        harness.poison_cuda_allocator(want.numel() * 4)
        _check_output(fn(x), want, x, ref, case.backend, case.precision)


@needs_cuda
@pytest.mark.parametrize("key", CASE_KEYS)
@pytest.mark.parametrize("layout", ["aligned", "by_element"])
def test_nan_and_inf_inputs(key, layout, tf32_default):
    """Both of the producer's paths: rows of whole 16-byte chunks (width 64), loaded a chunk at a time and converted by
    the fast rounding after a NaN check; and rows that are not (width 70), loaded and converted element by element."""
    case, ref, fn, dtype = _case(key, 9)
    x = make_input((2, 16, 64, 64 if layout == "aligned" else 70), seed=5, device="cuda").to(dtype)
    flat = x.view(-1)
    idx = torch.randperm(flat.numel(), device="cuda")[:60]
    flat[idx[:20]] = float("nan")
    flat[idx[20:40]] = float("inf")
    flat[idx[40:]] = -float("inf")
    # NaNs of other bit patterns than Python's: every bit set (either sign), as CUDA's own arithmetic makes them; an
    # integer add on the operand bits (TF32 rounding done by hand) would carry them out to a zero.
    bits = flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[flat.element_size()])
    bits[idx[:7]] = -1
    bits[idx[7:14]] = torch.iinfo(bits.dtype).max
    want, got = _run(ref, x), fn(x)
    assert torch.isnan(want).any() and torch.isfinite(want).any()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN positions differ from the reference"
    _check_output(got, want, x, ref, case.backend, case.precision)


# fp32 paths: TF32 keeps an operand's 19 top bits and the tensor cores ignore the 13 low ones, so a NaN whose payload
# sits only in those reads as infinity unless made canonical first (cvt.rna.tf32.f32 as ptxas builds it keeps such a
# NaN's top bits, an infinity's).
FP32_KEYS = [k for k in CASE_KEYS if harness.CASES[k].precision in ("tf32", "strict_fp32")]


@needs_cuda
@pytest.mark.parametrize("key", FP32_KEYS)
@pytest.mark.parametrize("where", ["input", "weight", "late_item", "all_bits", "all_bits_by_element"])
def test_nan_with_only_low_payload_bits_stays_nan(key, where, tf32_default):
    """NaNs with payload only in the 13 low bits (0x7f800001, 0xff801000): in the input, NaN at every output pixel it
    feeds; in a weight, NaN everywhere (its output channel is NaN at every pixel, and the min propagates it). Checked
    against float64 truth and the reference (the fused TF32 kernels gave tanh(tanh(+-inf)) there before the
    producers made NaNs canonical). late_item: rows of 264 columns, the NaNs in input columns 256 and 257, which the
    first 256-column tile loads as its late item (the chunk past the tile, loaded after the slot wait). all_bits: the
    NaNs with every bit set (0x7fffffff, 0xffffffff: CUDA's own arithmetic makes them), each the only non-finite input
    of its image, in rows of whole 16-byte chunks and (by_element, width 21) not: TF32 rounding by an integer add on
    the bits carries them out to a zero, which lists nothing for the guard to recompute."""
    case, ref, fn, dtype = _case(key, 9)
    width = {"late_item": 264, "all_bits_by_element": 21}.get(where, 20)
    x = make_input((2, 16, 20, width), seed=5, device="cuda").to(dtype)
    if where != "weight":
        col_a, col_b = (256, 257) if where == "late_item" else (5, 7)
        bits = x.view(torch.int32)
        all_bits = where.startswith("all_bits")
        bits[0, 3, 5, col_a] = 0x7FFFFFFF if all_bits else 0x7F800001
        bits[1, 9, 12, col_b] = -1 if all_bits else -8384512  # 0xffffffff, 0xff801000
    else:
        with torch.no_grad():
            for m in (ref, fn.model):
                m.conv.weight.view(torch.int32)[5, 3, 1, 1] = 0x7F800001
    w, b = ref.conv.weight.detach().double().cpu(), ref.conv.bias.detach().double().cpu()
    truth = torch.tanh(torch.tanh(torch.conv2d(x.double().cpu(), w, b).min(dim=1, keepdim=True).values))
    assert torch.isnan(truth).sum() == (truth.numel() if where == "weight" else 2 * 9)
    want, got = _run(ref, x), fn(x)
    assert torch.equal(torch.isnan(got).cpu(), torch.isnan(truth)), \
        f"{key}: NaN at {int(torch.isnan(got).sum())} pixels, float64 truth has {int(torch.isnan(truth).sum())}"
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN positions differ from the reference"


@needs_cuda
@pytest.mark.parametrize("key", CASE_KEYS)
def test_nan_wins_over_inf_channels_in_the_min(key, tf32_default):
    """One output pixel whose 64 channels mix NaN with +-inf: +inf on input channel 0 and -inf on channel 1 at one
    position, so output channel o sees w[o,0]*inf - w[o,1]*inf: NaN where the two weights share a sign, +-inf
    where they do not. torch.min gives NaN there; a min that drops NaN (fminf) would give tanh(tanh(-inf))."""
    case, ref, fn, dtype = _case(key, 33)
    x = make_input((1, 16, 8, 8), seed=6, device="cuda").to(dtype)
    x[0, 0, 3, 3], x[0, 1, 3, 3] = float("inf"), -float("inf")
    w, b = ref.conv.weight.detach().double().cpu(), ref.conv.bias.detach().double().cpu()
    channels = torch.conv2d(x.double().cpu(), w, b)[0, :, 2, 2]  # output pixel (2, 2) sees (3, 3) through tap (1, 1)
    assert torch.isnan(channels).any() and torch.isinf(channels).any(), "the pixel does not mix NaN and inf"
    want, got = _run(ref, x), fn(x)
    assert torch.isnan(want[0, 0, 2, 2]), "the reference does not propagate NaN here"
    assert torch.isnan(got[0, 0, 2, 2]), f"{key} dropped the NaN channel: got {float(got[0, 0, 2, 2])}"
    assert torch.equal(torch.isnan(got), torch.isnan(want))


@needs_cuda
@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp16"])
def test_saving_forward_takes_the_first_nan_channel(precision, tf32_default):
    """The saving forward on the pixel of test_nan_wins_over_inf_channels_in_the_min (channels NaN or +-inf, by the
    signs of two weights): torch.min's min is NaN and its argmin the first NaN channel, also where numbers follow that
    channel in a thread's own scan (the pixel-row saving epilogue). In TF32 the infinite inputs go to the guard, whose
    saving variant computes the image."""
    spec = harness.PRECISIONS[precision]
    torch.backends.cudnn.allow_tf32 = spec.allow_tf32
    ref, _ = _cuda_models(33)
    ref = ref.to(spec.dtype)
    x = make_input((1, 16, 8, 8), seed=6, device="cuda").to(spec.dtype)
    x[0, 0, 3, 3], x[0, 1, 3, 3] = float("inf"), -float("inf")
    w, b = ref.conv.weight.detach(), ref.conv.bias.detach()
    channels = torch.conv2d(x.double(), w.double(), b.double())[0, :, 2, 2]
    first_nan = int(torch.isnan(channels).nonzero()[0])
    # the wgmma pixel-row scan: the thread holding channel c holds every channel of the same (c % 8) // 2
    later = [c for c in range(first_nan + 1, 64) if (c % 8) // 2 == (first_nan % 8) // 2]
    assert not torch.isnan(channels[later]).all(), "no number after the first NaN channel in its thread's scan"
    out, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, AUTO)
    assert torch.isnan(pre_min[0, 0, 2, 2]) and torch.isnan(out[0, 0, 2, 2]), float(pre_min[0, 0, 2, 2])
    assert int(argmin[0, 0, 2, 2]) == first_nan, (int(argmin[0, 0, 2, 2]), first_nan)
    assert torch.equal(torch.isnan(out), torch.isnan(_run(ref, x)))


@needs_cuda
@pytest.mark.parametrize("profile", ["H100", "A100"])
@pytest.mark.parametrize("precision", ["tf32", "strict_fp32", "bf16", "fp16"])
def test_saving_forward_ties_go_to_the_first_channel(precision, profile, tf32_default):
    """Zero weights and equal biases in every precision: all 64 channels tie at every pixel, and the saving forward's
    argmin is torch.min's, channel 0, its pre-tanh min the bias (a later channel of an equal value never takes it,
    in the pixel-row scan, the lane butterfly or the mma.sync epilogue)."""
    if profile == "H100" and not model_new.fused_kernel_launches("sm90_tf32"):
        pytest.skip("the H100 profile needs an sm_90 GPU")
    spec = harness.PRECISIONS[precision]
    torch.backends.cudnn.allow_tf32 = spec.allow_tf32
    x = make_input((2, 16, 21, 140), seed=63, device="cuda").to(spec.dtype)
    w = torch.zeros(64, 16, 3, 3, device="cuda", dtype=spec.dtype)
    b = torch.full((64,), 0.375, device="cuda", dtype=spec.dtype)
    with harness.emulated(profile):
        _, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, AUTO)
    assert int(argmin.max()) == 0, f"{precision} {profile}: a tie went to channel {int(argmin.max())}"
    assert bool((pre_min == 0.375).all()), (precision, profile)


@needs_cuda
@pytest.mark.parametrize("weight", ["inf", "tf32_overflow"])
@pytest.mark.parametrize("profile", ["H100", "A100"])
def test_an_infinite_weight_beside_zero_weights_gives_torch_mins(profile, weight, tf32_default):
    """One infinite weight (inf, or the largest finite float, 0x7F7FFFFF, which TF32's rounding takes to infinity),
    every other weight and the bias 0 (so the weights' scale carries all of them): at its tap an input of 0 makes the
    channel NaN (0 * inf), one of 1e-30 (below fp16's subnormals) +-inf, a number +-inf. The TF32 forwards, inference
    and saving, give the float64 truth's output over the TF32-rounded weights (NaN where it has NaN; computed on the
    CPU, where no transform mixes the infinity into other sums) and torch.min's argmin (the NaN channel, else the
    first of the smallest): the carrier sends every image to its guard."""
    if profile == "H100" and not model_new.fused_kernel_launches("sm90_tf32"):
        pytest.skip("the H100 profile needs an sm_90 GPU")
    torch.backends.cudnn.allow_tf32 = True
    w, b = torch.zeros(64, 16, 3, 3, device="cuda"), torch.zeros(64, device="cuda")
    w[5, 3, 1, 2] = float("inf") if weight == "inf" else torch.finfo(torch.float32).max
    assert torch.isinf(harness.round_tf32(w[5, 3, 1, 2]))
    x = torch.randn(3, 16, 20, 70, generator=torch.Generator("cuda").manual_seed(65), device="cuda")
    tap = x[:, 3, 1:-1, 2:]  # the input each output pixel meets at the infinite weight
    tap[0, ::3, ::5] = 0.0
    tap[1, 1::4, ::3] = 1e-30
    tap[1, 2::4, 1::3] = -1e-30
    tap[2] = 0.0
    w_tf32 = harness.round_tf32(w).cpu()
    channels = torch.conv2d(x.double().cpu(), w_tf32.double(), b.double().cpu())
    want_min, want_argmin = (t.cuda() for t in channels.min(dim=1, keepdim=True))
    want = harness.float64_forward(x.cpu(), w_tf32, b.cpu()).float().cuda()
    assert want.isnan().any() and (want_min == -float("inf")).any() and (want_min == 0).any()
    assert torch.equal(want.isnan(), want_min.isnan())
    with harness.emulated(profile):
        inference = model_new.conv_min_tanh2(x, w, b, AUTO)
        out, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, AUTO)
    for name, got in (("inference", inference), ("saving", out)):
        assert torch.equal(got.isnan(), want.isnan()), f"{profile} {name}: NaN where the reference has none, or none"
        assert torch.allclose(got, want, atol=1e-6, equal_nan=True), f"{profile} {name}"
    assert torch.equal(pre_min.isnan(), want_min.isnan()), profile
    assert torch.equal(pre_min.nan_to_num(), want_min.float().nan_to_num()), profile
    assert torch.equal(argmin.long(), want_argmin), profile


BIAS_CASES = {
    # needs 21 significant bits: rounded to TF32 (either way) it is 4.9e-4 off, 1.2e-4 after the tanhs
    "beyond_tf32": -(1 + 2.0 ** -11 + 2.0 ** -20),
    # the largest finite magnitude: a split whose first part rounds up to infinity leaves inf - inf (NaN) for the rest
    "largest": -3.4028234663852886e38,
    "infinite": -float("inf"),
    "nan_low_payload": None,  # 0x7F800001: reads as infinity to a tensor core unless made canonical
}


@needs_cuda
@pytest.mark.parametrize("key", FP32_KEYS)
@pytest.mark.parametrize("bias", list(BIAS_CASES))
def test_bias_enters_as_the_fp32_value(key, bias, tf32_default):
    """Zero weights: every output pixel is tanh(tanh(min of the bias)), here the bias of channel 37 (the others lie
    in [0.5, 2]). The fp32 paths must add the bias as the fp32 value it is (the wgmma TF32 kernel adds it through the
    tensor cores as three TF32 parts); checked against float64 truth at 1e-6, NaN where it is NaN."""
    case, ref, fn, dtype = _case(key, 41)
    b = torch.rand(64, generator=torch.Generator().manual_seed(9)) * 1.5 + 0.5
    if BIAS_CASES[bias] is None:
        b.view(torch.int32)[37] = 0x7F800001
    else:
        b[37] = BIAS_CASES[bias]
    with torch.no_grad():
        for m in (ref, fn.model):
            m.conv.weight.zero_()
            m.conv.bias.copy_(b)
    truth = torch.tanh(torch.tanh(b.double().min() if bias != "nan_low_payload" else torch.tensor(float("nan"))))
    x = make_input((2, 16, 9, 300), seed=8, device="cuda")
    got = fn(x).double().cpu()
    if torch.isnan(truth):
        assert torch.isnan(got).all(), f"{key}: {int((~torch.isnan(got)).sum())} pixels not NaN"
    else:
        diff = float((got - truth).abs().max())
        assert diff <= 1e-6, f"{key}: {diff} from tanh(tanh({float(b[37])}))"


# The fused paths (cudnn_epilogue is the reference's own math, two roundings included).
SIXTEEN_BIT_KEYS = [k for k in CASE_KEYS
                    if harness.CASES[k].precision in ("bf16", "fp16") and harness.CASES[k].backend != "cudnn_epilogue"]
FUSED_FP32_KEYS = [k for k in FP32_KEYS if harness.CASES[k].backend != "cudnn_epilogue"]


def _one_tap_models(key, seed):
    """(case, reference, fn, dtype) of _case with one weight of 1 (every output channel, input channel 0, tap (0, 0)),
    every other weight and the bias 0: output pixel (i, j) is tanh(tanh(x[:, 0, i, j])), the min of 64 equal values,
    with nothing rounded on the way but the input as the kernel takes it."""
    case, ref, fn, dtype = _case(key, seed)
    with torch.no_grad():
        for m in (ref, fn.model):
            m.conv.weight.zero_()
            m.conv.weight[:, 0, 0, 0] = 1.0
            m.conv.bias.zero_()
    return case, ref, fn, dtype


def _ulps(got, truth, dtype):
    """|got - truth| in units of dtype's spacing at the float64 truth (below the normal range: the subnormal one)."""
    info = torch.finfo(dtype)
    return (got.double() - truth).abs() / (torch.exp2(torch.floor(torch.log2(truth.abs().clamp_min(info.tiny)))) * info.eps)


@needs_cuda
@pytest.mark.parametrize("key", SIXTEEN_BIT_KEYS)
def test_16bit_tanh2_of_every_value(key, tf32_default):
    """Every finite value m of the element type as some pixel's min (one weight of 1 in channel 0's first tap, the
    rest 0, bias 0: output pixel (i, j) is tanh(tanh(x[0, 0, i, j])) with no conv rounding), through each 16-bit path.
    The output must be within one ulp of the float64 tanh(tanh(m)) for every m, and no further than the reference's
    worst (its two roundings, each tanh rounded to the element type). The 16-bit kernels take tanh.approx.f32 twice
    (relative error below 2^-10.98 each): for bf16 a quarter of an ulp at most before the one rounding."""
    case, ref, fn, dtype = _one_tap_models(key, 43)
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    values = torch.where(torch.isfinite(values), values, torch.ones((), dtype=dtype))
    x = make_input((1, 16, 258, 258), seed=13, device="cuda").to(dtype)
    x[0, 0, :256, :256] = values.view(256, 256).cuda()
    m = x[0, 0, :256, :256].double().cpu()
    truth = torch.tanh(torch.tanh(m))
    want = _run(ref, x)[0, 0].cpu()
    harness.poison_cuda_allocator(want.numel() * 2)
    got = _run(fn, x)[0, 0].cpu()
    assert got.dtype == dtype
    err, ref_err = _ulps(got, truth, dtype), _ulps(want, truth, dtype)
    worst = int(err.argmax())
    print(f"{key}: max {float(err.max()):.3f} ulp ({int((err > 0.5).sum())} values over half an ulp), the "
          f"reference's {float(ref_err.max()):.3f} ({int((ref_err > 0.5).sum())})")
    assert float(err.max()) <= 1.0, \
        f"{key}: tanh(tanh({float(m.view(-1)[worst])})) = {float(got.view(-1)[worst])}, {float(err.max())} ulp off"
    assert float(err.max()) <= float(ref_err.max()), f"{key}: {float(err.max())} ulp, the reference {float(ref_err.max())}"


@needs_cuda
@pytest.mark.parametrize("key", FUSED_FP32_KEYS)
def test_fp32_tanh2_error(key, tf32_default):
    """tanh(tanh(m)) for 65,536 values of m in [-6, 6] through each fp32 fused path (one weight of 1): within 2^-20 of
    float64, as tanhf twice is (2 fp32 ulps each). The SFU's tanh.approx.f32, which the 16-bit kernels take, put
    strict fp32's full-problem output 8.7e-6 from float64 (the bound of that test: 8.7e-7): not for fp32 outputs. m is
    what the kernel multiplies: x rounded to TF32 (to nearest) for TF32; x for 3xTF32, whose big + small split leaves
    it within about |x| 2^-22 (small is rounded to TF32), inside the bound."""
    case, ref, fn, dtype = _one_tap_models(key, 44)
    x = make_input((1, 16, 258, 258), seed=14, device="cuda")
    x[0, 0, :256, :256] = torch.linspace(-6.0, 6.0, 65536, device="cuda").view(256, 256)
    m = x[0, 0, :256, :256].double().cpu()
    if case.precision == "tf32":
        m = harness.round_tf32(m.float()).double()
    harness.poison_cuda_allocator(256 * 256 * 4)
    got = _run(fn, x)[0, 0].double().cpu()
    err = (got - torch.tanh(torch.tanh(m))).abs()
    bound = 2.0 ** -20
    worst = int(err.argmax())
    print(f"{key}: max {float(err.max()):.3e} (2^{math.log2(max(float(err.max()), 2.0 ** -149)):.1f})")
    assert float(err.max()) <= bound, f"{key}: tanh(tanh({float(m.view(-1)[worst])})) {float(err.max())} off"


STRICT_KEYS = [k for k in CASE_KEYS
               if harness.CASES[k].precision == "strict_fp32" and harness.CASES[k].backend != "cudnn_epilogue"]


@needs_cuda
@pytest.mark.parametrize("key", STRICT_KEYS)
def test_strict_fp32_infinite_input_with_tf32_exact_weights(key, tf32_default):
    """3xTF32 splits each weight into big + small. Weights that TF32 holds exactly have no small part, and an
    infinite input times a zero small weight would be NaN where the reference's fp32 product is an infinity. Here
    every weight is TF32-exact and a few inputs are +inf: the reference's min is -inf there (tanh(tanh) = -0.76),
    never NaN, and so must every strict kernel's be."""
    case, ref, fn, dtype = _case(key, 36)
    with torch.no_grad():
        for m in (ref, fn.model):
            m.conv.weight.copy_(harness.round_tf32(ref.conv.weight))
    x = make_input((2, 16, 20, 30), seed=12, device="cuda")
    x[0, 3, 5, 7] = x[1, 10, 12, 20] = x[1, 0, 0, 0] = float("inf")
    want, got = _run(ref, x), fn(x)
    assert not torch.isnan(want).any() and (want == float(torch.tanh(torch.tanh(torch.tensor(-float("inf")))))).any()
    _check_output(got, want, x, ref, case.backend, case.precision)


@needs_cuda
@pytest.mark.parametrize("key", STRICT_KEYS)
def test_strict_fp32_infinite_weight_with_tf32_exact_inputs(key, tf32_default):
    """The same the other way round: every input TF32-exact (no small part) and one weight -inf. The reference's
    channel then holds -inf wherever its input is positive (its min is -inf there), NaN where it is 0; a zero small
    input part would make small(x) * big(w) = 0 * inf = NaN everywhere in that channel."""
    case, ref, fn, dtype = _case(key, 37)
    with torch.no_grad():
        for m in (ref, fn.model):
            m.conv.weight[5, 3, 1, 2] = -float("inf")
    x = harness.round_tf32(make_input((2, 16, 20, 30), seed=13, device="cuda"))
    want, got = _run(ref, x), fn(x)
    assert (want == float(torch.tanh(torch.tanh(torch.tensor(-float("inf")))))).float().mean() > 0.9
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN positions differ from the reference"
    _check_output(got, want, x, ref, case.backend, case.precision)


@needs_cuda
@pytest.mark.parametrize("key", CASE_KEYS)
def test_noncontiguous_and_channels_last(key, tf32_default):
    case, ref, fn, dtype = _case(key, 10)
    base = make_input((2, 16, 50, 140), seed=6, device="cuda").to(dtype)
    strided = base[:, :, :, ::2]
    dense = strided.contiguous()
    assert torch.equal(fn(strided), fn(dense))
    _check_output(fn(strided), _run(ref, dense), dense, ref, case.backend, case.precision)
    cl = base.to(memory_format=torch.channels_last)
    assert torch.equal(fn(cl), fn(base))
    _check_output(fn(cl), _run(ref, base), base, ref, case.backend, case.precision)


@needs_cuda
@pytest.mark.parametrize("key", CASE_KEYS)
def test_input_unchanged_side_stream_graph_and_repeatable(key, tf32_default):
    case, ref, fn, dtype = _case(key, 12)
    x = make_input((4, 16, 96, 130), seed=7, device="cuda").to(dtype)
    x_before = x.clone()
    first = fn(x)
    assert torch.equal(x, x_before), "forward changed its input"
    _check_output(first, _run(ref, x), x, ref, case.backend, case.precision)
    for _ in range(3):
        assert torch.equal(fn(x), first), "output is not bitwise repeatable"

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = fn(x)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(on_side, first), "a side stream gave another result"

    new = fn.model
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(static_x)  # eager: the op's CUDA kernel called directly (or the named kernel)
        static_op_out = OP(static_x, new.conv.weight.detach(), new.conv.bias.detach(), new._op_backend)  # dispatcher
    fresh = make_input(x.shape, seed=8, device="cuda").to(dtype)
    static_x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, fn(fresh)), "graph replay differs from eager"
    if case.kernel is None:
        assert torch.equal(static_op_out, static_out)
    assert not torch.equal(static_out, first)


@needs_cuda
@pytest.mark.parametrize("key", CASE_KEYS)
def test_offsets_past_2_pow_31(key, tf32_default):
    """An input with more than 2^31 elements (and, for cudnn_epilogue, an intermediate too): the last images must
    be right."""
    n = 2100
    shape = (n, 16, 256, 256)
    assert n * 16 * 256 * 256 > 2**31
    case, ref, fn, dtype = _case(key, 13)
    x = make_input(shape, seed=15, device="cuda").to(dtype)
    got = fn(x)
    for sl in (slice(0, 2), slice(n - 2, n)):
        _check_output(got[sl], _run(ref, x[sl]), x[sl], ref, case.backend, case.precision)
    del x, got
    torch.cuda.empty_cache()


@needs_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_autograd_on_gpu(backend, tf32_default):
    """Each backend's forward with grad gives its inference output, and the gradients are the float64 chain's through
    the argmin it saved (cudnn_epilogue: torch.min's own; dW in TF32 on the tensor cores: _check_weight_grad)."""
    ref, new = _cuda_models(14, backend=backend)
    x = make_input((2, 16, 20, 24), seed=9, device="cuda")
    x2 = x.clone().requires_grad_(True)
    out_ref, out_new = _run(ref, x), new(x2)
    assert out_new.requires_grad
    assert torch.equal(out_new.detach(), _run(new, x))
    _check_output(out_new.detach(), out_ref, x, ref, backend)
    grad_out = torch.randn_like(out_ref)
    out_new.backward(grad_out)
    w, b = new.conv.weight.detach(), new.conv.bias.detach()
    _, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, model_new.OP_BACKENDS.index(backend))
    if backend == "cudnn_epilogue":
        assert torch.equal(argmin.long(), torch.conv2d(x, w, b).argmin(1, keepdim=True))
    want = harness.routed_float64_grads(x, w, argmin, pre_min, grad_out)
    dw = new.conv.weight.grad
    tol = {"x": 1e-5, "b": 1e-5, "w": _check_weight_grad(dw, x, w, argmin, pre_min, grad_out, None, "tf32", backend)}
    for name, got, truth in zip("xwb", (x2.grad, dw, new.conv.bias.grad), want):
        assert harness.relative_error(got, truth) <= tol[name], name


@needs_cuda
@pytest.mark.parametrize("name,make,exc,pattern", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_gpu_bad_input_gets_the_same_message(name, make, exc, pattern):
    """On CUDA the checks are the C++ op's: the same table must give the same errors as on the CPU."""
    _, new = _cuda_models()
    with pytest.raises(exc, match=pattern):
        new(make("cuda"))


@needs_cuda
def test_gpu_input_on_another_device_is_refused():
    _, new = _cuda_models()
    with pytest.raises(ValueError, match=r"expects input on cuda:0 \(the device of its weights\), got cpu"):
        new(torch.rand(1, 16, 8, 8))
    cpu_model = make_models(0)[1]
    with pytest.raises(ValueError, match=r"expects input on cpu \(the device of its weights\), got cuda:0"):
        cpu_model(torch.rand(1, 16, 8, 8, device="cuda"))


@needs_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_direct_call_and_dispatcher_agree(backend, tf32_default):
    """ModelNew's eager shortcut and the torch.library op run the same C++ function: bitwise equal outputs."""
    _, new = _cuda_models(34, backend=backend)
    x = make_input((2, 16, 40, 300), seed=10, device="cuda")
    w, b = new.conv.weight.detach(), new.conv.bias.detach()
    code = model_new.OP_BACKENDS.index(backend)
    direct = model_new._ext.conv_min_tanh2(x, w, b, code)
    assert torch.equal(_run(new, x), direct)
    assert torch.equal(OP(x, w, b, code), direct)


@needs_cuda
@pytest.mark.parametrize("name,shape,dtype,grad", OPCHECK_CASES, ids=[c[0] for c in OPCHECK_CASES])
def test_opcheck_gpu(name, shape, dtype, grad, tf32_default):
    _opcheck("cuda", shape, dtype, grad)


@needs_cuda
def test_compile_fullgraph_gpu(tf32_default):
    """torch.compile(fullgraph=True) with inductor: one graph, the fused op inside, the reference's answer."""
    torch._dynamo.reset()
    ref, new = _cuda_models(35)
    compiled = torch.compile(new, fullgraph=True)
    x = make_input((8, 16, 64, 300), seed=11, device="cuda")
    got = _run(compiled, x)
    assert torch.equal(got, _run(new, x))
    _check_output(got, _run(ref, x), x, ref, "fused")


@needs_cuda
def test_sass_uses_tensor_cores_without_local_memory():
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump is not on PATH")
    lib = model_new._ext.__file__
    sass = subprocess.run([cuobjdump, "--dump-sass", lib], capture_output=True, text=True, timeout=300).stdout
    functions = {f.split()[0]: f for f in re.split(r"\n\s*Function : ", sass)[1:]}
    fused = {_instantiation(name): f for name, f in functions.items() if "conv3x3_min_tanh2_kernel" in name}
    assert sorted(fused) == sorted((k, save) for k in model_new.FUSED_KERNELS for save in (False, True)), list(functions)
    for (name, save), f in fused.items():
        row = model_new.FUSED_TABLE[model_new.FUSED_KERNELS.index(name)]
        if row.mma == "mma_sync":
            assert "HMMA" in f and "LDSM" in f, f"{name} (save {save}): no HMMA or ldmatrix"
        elif torch.cuda.get_device_capability() == (9, 0):
            assert "HGMMA" in f, f"the {name} kernel (save {save}) has no HGMMA"
    assert not re.search(r"\b(LDL|STL)\b", sass), "a kernel uses local memory"


# ================================================================================================ training
# The backward from the saved argmin (kb25::conv_min_tanh2_with_argmin, kb25::conv_min_tanh2_backward), on every kind
# of GPU through emulate_device: H100 runs the wgmma kernels' saving variants, A100 the mma.sync ones, A10G the 99 KB
# strict one, T4 cuDNN + torch.min's argmin. Every profile runs the same backward kernels.
TRAIN_PROFILES = ["H100", "A100", "A10G", "T4"]
# Ragged shapes: a second column block that is partly empty (dW steps are 256 columns on the tensor cores, 128 on
# the CUDA cores; dX steps 256) with rows of whole 16-byte loads in every dtype (the first), the smallest input, one
# tall and narrow; all but the first are loaded element by element in 16-bit.
# The last has many steps per backward CTA (the dW row ring and both kernels' prefetches).
TRAIN_SHAPES = [(3, 16, 37, 296), (2, 16, 19, 131), (1, 16, 3, 3), (2, 16, 70, 5), (16, 16, 258, 130)]
# Gradients through our argmin against the float64 chain through the same argmin (relative, per tensor): fp32 sums
# for float32; one rounding to the element type for 16-bit.
ROUTED_TOL = {"tf32": 1e-5, "strict_fp32": 1e-5, "bf16": 1e-2, "fp16": 2e-3}
# The weight gradient runs on the tensor cores (mma.sync on TF32-rounded or 16-bit operands) on every sm_80+ profile
# but in strict fp32; T4 (sm_75) and strict fp32 sum every product in fp32. In TF32 it is then held to the float64
# chain on TF32-rounded operands (x and the gradient at the argmin, harness.round_tf32), and to the plain float64
# chain with TF32's own error (two operands rounded to 11 bits).
TF32_WEIGHT_GRAD_TOL = 2e-3


def _weight_grad_on_tensor_cores(profile, precision):
    return profile != "T4" and precision != "strict_fp32"


def _check_weight_grad(dw, x, w, argmin, pre_min, g, profile, precision, where):
    """dW in TF32 on the tensor cores: the TF32-operand chain's within harness.TF32_OPERAND_TOL, the plain chain's
    within TF32_WEIGHT_GRAD_TOL. Returns the tolerance for the plain chain."""
    if precision != "tf32" or not _weight_grad_on_tensor_cores(profile, precision):
        return ROUTED_TOL[precision]
    tf32_dw = harness.routed_float64_grads(x, w, argmin, pre_min, g, weight_operands=harness.round_tf32)[1]
    err = harness.relative_error(dw, tf32_dw)
    assert err <= harness.TF32_OPERAND_TOL, f"{where}: dw against the TF32-operand chain: {err}"
    return TF32_WEIGHT_GRAD_TOL
# The saved pre-tanh min against the float64 conv's min: TF32 operand rounding, fp32 sums otherwise. Where the best
# two channels of the float64 conv are further apart than ARGMIN_GAP, the saved argmin must be float64's.
PRE_MIN_TOL = {"tf32": 5e-3, "strict_fp32": 1e-5, "bf16": 1e-4, "fp16": 1e-4}
ARGMIN_GAP = {"tf32": 2e-3, "strict_fp32": 1e-5, "bf16": 1e-5, "fp16": 1e-5}


def _leaves(x, new):
    return x.detach().clone().requires_grad_(True), new.conv.weight, new.conv.bias


def _train_setup(profile, precision, shape, seed):
    """(model, x, grad_out, spec) on the GPU in the precision; the caller enters the profile's emulation."""
    if profile == "H100" and not model_new.fused_kernel_launches("sm90_tf32"):
        pytest.skip("the H100 profile needs an sm_90 GPU")
    spec = harness.PRECISIONS[precision]
    torch.backends.cudnn.allow_tf32 = spec.allow_tf32
    _, new = _cuda_models(seed)
    new = new.to(spec.dtype)
    x = make_input(shape, seed=seed + 1, device="cuda").to(spec.dtype)
    oh, ow = shape[2] - 2, shape[3] - 2
    g = torch.randn(shape[0], 1, oh, ow, generator=torch.Generator("cuda").manual_seed(seed + 2), device="cuda")
    return new, x, g.to(spec.dtype), spec


_FORWARD_MODE = {"saving": None}  # set by the forward_mode fixture: what _grads runs the forward with


@pytest.fixture(params=[False, True], ids=["inference_forward", "saving_forward"])
def forward_mode(request):
    """Run a training test with forwards under autograd running the inference kernel (the backward then runs the
    saving forward itself) and again with the forward saving (model_new.save_in_forward); restore the switch."""
    previous = model_new.save_in_forward()
    _FORWARD_MODE["saving"] = request.param
    yield request.param
    _FORWARD_MODE["saving"] = None
    model_new.save_in_forward(previous)


def _grads(new, x, g):
    """(out, dx, dw, db) of one forward and backward through ModelNew (parameter grads cleared first), with the
    forward the forward_mode fixture asks for, if any."""
    if _FORWARD_MODE["saving"] is not None:
        model_new.save_in_forward(_FORWARD_MODE["saving"])
    new.zero_grad(set_to_none=True)
    xg = x.detach().clone().requires_grad_(True)
    out = new(xg)
    out.backward(g)
    return out.detach(), xg.grad, new.conv.weight.grad, new.conv.bias.grad


@needs_cuda
@pytest.mark.parametrize("profile", TRAIN_PROFILES)
def test_training_backward_follows_the_saved_argmin(profile, forward_mode, tf32_default):
    """For each precision and ragged shape: the saving forward gives the inference output bit for bit; a fused
    kernel's argmin is the float64 conv's wherever the best two channels are apart by more than the precision's
    error, and its pre-tanh min the float64 min (cudnn_epilogue, T4: torch.min's own on cuDNN's conv); and the
    gradients of x, weight and bias are the float64 chain's through that argmin."""
    for precision in harness.PRECISIONS:
        for shape in TRAIN_SHAPES:
            new, x, g, spec = _train_setup(profile, precision, shape, seed=60)
            w, b = new.conv.weight.detach(), new.conv.bias.detach()
            with harness.emulated(profile):
                expected = PROFILE_KERNELS[profile][precision]
                assert new.fused_kernel(x) == expected
                out, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, AUTO)
                assert torch.equal(out, _run(new, x)), (profile, precision, shape)
                _, dx, dw, db = _grads(new, x, g)
            y64 = torch.conv2d(x.double(), w.double(), b.double())
            best2 = y64.topk(2, dim=1, largest=False).values
            if expected is None:  # cudnn_epilogue: torch.min's own argmin and min of cuDNN's conv in this dtype
                values, indices = torch.conv2d(x, w, b).min(1, keepdim=True)
                assert torch.equal(argmin.long(), indices) and torch.equal(pre_min, values.float())
            else:
                clear = (best2[:, 1:] - best2[:, :1]) > ARGMIN_GAP[precision]
                assert clear.float().mean() > 0.5, f"too few pixels with a clear argmin: {clear.float().mean()}"
                assert torch.equal(argmin.long()[clear], y64.argmin(1, keepdim=True)[clear]), (profile, precision,
                                                                                                shape)
                assert (pre_min.double() - best2[:, :1]).abs().max() <= PRE_MIN_TOL[precision], (profile, precision,
                                                                                                   shape)
            want = harness.routed_float64_grads(x, w, argmin, pre_min, g)
            where = f"{profile} {precision} {shape}"
            tol = {"x": ROUTED_TOL[precision], "b": ROUTED_TOL[precision],
                   "w": _check_weight_grad(dw, x, w, argmin, pre_min, g, profile, precision, where)}
            for name, got, truth in zip("xwb", (dx, dw, db), want):
                assert got.dtype == spec.dtype and got.shape == truth.shape
                err = harness.relative_error(got, truth)
                assert err <= tol[name], f"{where} d{name}: {err}"


# Ragged shapes for one kernel's saving variant: tiles cut by the image's right edge (64-, 128- and 256-column tiles),
# a width whose rows are not 16-byte aligned (element-by-element loads), and enough rows that consumer ranges start
# and end inside column strips.
KERNEL_SAVING_SHAPES = [(3, 16, 37, 300), (2, 16, 70, 131), (5, 16, 131, 70)]


@needs_cuda
@pytest.mark.parametrize("kernel", model_new.FUSED_KERNELS)
def test_every_kernels_saving_variant_follows_float64(kernel, tf32_default):
    """Each fused kernel's saving variant run by name (the chooser takes one kernel a precision; this reaches the
    others too): its output is its inference variant's bit for bit, its argmin the float64 conv's wherever the best
    two channels are apart by more than the precision's error, and its pre-tanh min the float64 min (of x as the
    kernel reads it: a 16-bit kernel with a float32 input rounds x to its dtype)."""
    row = _row(kernel)
    if not model_new.fused_kernel_launches(kernel):
        pytest.skip(f"{kernel} does not launch on this GPU")
    torch.backends.cudnn.allow_tf32 = row.precision != "strict_fp32"
    dtype = harness.PRECISIONS[row.precision].dtype
    _, new = harness.make_models(62, device="cuda")
    w, b = (t.detach().to(dtype) for t in (new.conv.weight, new.conv.bias))
    for i, shape in enumerate(KERNEL_SAVING_SHAPES):
        x = harness.make_input(shape, seed=63 + i, device="cuda", dtype=model_new.INPUT_DTYPES[row.input])
        out, argmin, pre_min = model_new.run_fused_kernel_saving(x, w, b, kernel)
        assert torch.equal(out, model_new.run_fused_kernel(x, w, b, kernel)), (kernel, shape)
        y64 = torch.conv2d(x.to(dtype).double(), w.double(), b.double())
        best2 = y64.topk(2, dim=1, largest=False).values
        clear = (best2[:, 1:] - best2[:, :1]) > ARGMIN_GAP[row.precision]
        assert clear.float().mean() > 0.5, f"too few pixels with a clear argmin: {clear.float().mean()}"
        assert torch.equal(argmin.long()[clear], y64.argmin(1, keepdim=True)[clear]), (kernel, shape)
        assert (pre_min.double() - best2[:, :1]).abs().max() <= PRE_MIN_TOL[row.precision], (kernel, shape)


@needs_cuda
@pytest.mark.parametrize("precision", list(harness.PRECISIONS))
def test_training_gradients_no_further_from_float64_than_the_reference(precision, tf32_default):
    """At a size where cuDNN runs the reference in its precision (TF32 for float32 by default): the gradients of x,
    weight and bias are no further from the float64 truth than 2x the reference's own. Near-tie pixels, where the
    argmin of a TF32 or 16-bit conv can differ from float64's, are where both are off. Errors at fp32's rounding
    level (below 1e-6, strict fp32) pass as well: there both are exact but for the order of their sums."""
    new, x, g, spec = _train_setup("H100" if model_new.fused_kernel_launches("sm90_tf32") else "A100", precision,
                                   (4, 16, 256, 256), seed=61)
    ref = reference.Model(16, 64, 3).cuda().to(spec.dtype)
    ref.load_state_dict(new.state_dict())
    _, dx, dw, db = _grads(new, x, g)
    out_ref, *ref_grads = _grads(ref, x, g)
    w, b = new.conv.weight.detach(), new.conv.bias.detach()
    truth = harness.float64_grads(x, w, b, g)
    if precision == "tf32":  # the comparison means something only where the reference's conv is TF32
        assert (out_ref.double() - harness.float64_forward(x, w, b)).abs().max() > 2e-5, "the reference ran in fp32"
    for name, got, ref_grad, t in zip("xwb", (dx, dw, db), ref_grads, truth):
        err, ref_err = harness.relative_error(got, t), harness.relative_error(ref_grad, t)
        assert err <= max(2 * ref_err, 1e-6), f"{precision} d{name}: {err} vs the reference's {ref_err}"


@needs_cuda
@pytest.mark.parametrize("profile", ["H100", "A100"])
def test_strict_saving_forward_minima_are_fp32_roundings(profile, tf32_default):
    """Strict fp32: the saving forward's pre-tanh minima, from which the backward's gm comes, are the float64 conv at
    their argmin channel rounded once (within 0.5 ulp where finite), so no further from float64 than cuDNN's fp32
    conv (relative L2); the input gradient is then no further from float64 than the reference's. The 3xTF32 tensor
    cores' own minima are about 2.4 times as far as cuDNN's (and the input gradient twice as far)."""
    new, x, g, _ = _train_setup(profile, "strict_fp32", (4, 16, 130, 261), seed=66)
    w, b = new.conv.weight.detach(), new.conv.bias.detach()
    with harness.emulated(profile):
        _, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, AUTO)
        _, dx, _, _ = _grads(new, x, g)
    conv64 = torch.nn.functional.conv2d(x.double(), w.double(), b.double())
    at_argmin = conv64.gather(1, argmin.long()).float()
    ulp = torch.nextafter(at_argmin.abs(), torch.full_like(at_argmin, float("inf"))) - at_argmin.abs()
    assert ((pre_min - at_argmin).abs() <= ulp).all()  # a compensated sum rounded once: within an ulp of float64's
    ref = reference.Model(16, 64, 3).cuda()
    ref.load_state_dict(new.state_dict())
    ref_min = torch.nn.functional.conv2d(x, w, b).min(1, keepdim=True)[0]
    truth_min = conv64.min(1, keepdim=True)[0]
    assert harness.relative_error(pre_min, truth_min) <= harness.relative_error(ref_min, truth_min)
    _, ref_dx, _, _ = _grads(ref, x, g)
    truth_dx = harness.float64_grads(x, w, b, g)[0]
    err, ref_err = harness.relative_error(dx, truth_dx), harness.relative_error(ref_dx, truth_dx)
    assert err <= ref_err, f"dx {err} vs the reference's {ref_err}"


@needs_cuda
@pytest.mark.parametrize("profile", ["H100", "A100", "T4"])
def test_training_ties_go_to_the_first_channel(profile, tf32_default):
    """Zero weights and equal biases: every channel ties at every pixel. torch.min picks the first channel, so every
    gradient flows to channel 0; the float64 truth breaks the tie the same way."""
    new, x, g, _ = _train_setup(profile, "tf32", (2, 16, 21, 140), seed=62)
    with torch.no_grad():
        new.conv.weight.zero_()
        new.conv.bias.fill_(0.3)
    w, b = new.conv.weight.detach(), new.conv.bias.detach()
    with harness.emulated(profile):
        _, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, AUTO)
        _, dx, dw, db = _grads(new, x, g)
    assert int(argmin.max()) == 0
    tol = {"x": 1e-5, "b": 1e-5, "w": _check_weight_grad(dw, x, w, argmin, pre_min, g, profile, "tf32", profile)}
    for name, got, truth in zip("xwb", (dx, dw, db), harness.float64_grads(x, w, b, g)):
        assert harness.relative_error(got, truth) <= tol[name], name
    assert db[1:].abs().max() == 0 and dw[1:].abs().max() == 0  # nothing reaches the other channels


@needs_cuda
@pytest.mark.parametrize("profile", ["H100", "A100", "T4"])
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_training_weight_gradient_scales_with_the_output_gradient(profile, precision, tf32_default):
    """The output's gradient times 2^60 or 2^-60: gm scales by the same power of two, so dW and db scale exactly, bit
    for bit, whatever scale the tensor cores' fp16 operands are carried at. Then one image scaled and the other not
    (a CTA's steps see gradients 2^60 apart): dW within the precision's error of the float64 chain."""
    new, x, g, spec = _train_setup(profile, precision, (2, 16, 40, 150), seed=66)
    with harness.emulated(profile):
        _, _, dw, db = _grads(new, x, g)
        w, b = new.conv.weight.detach(), new.conv.bias.detach()
        _, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, AUTO)
        for scale in (2.0**60, 2.0**-60, 2.0**118):  # 2^118: the tensor cores' operand scale near its low end
            _, _, dw_scaled, db_scaled = _grads(new, x, g * scale)
            assert torch.equal(dw_scaled.float(), dw.float() * scale), (scale, "dw")
            assert torch.equal(db_scaled.float(), db.float() * scale), (scale, "db")
            mixed = g.clone()
            mixed[1] *= scale
            _, _, dw_mixed, _ = _grads(new, x, mixed)
            want = harness.routed_float64_grads(x, w, argmin, pre_min, mixed)[1]
            tol = TF32_WEIGHT_GRAD_TOL if _weight_grad_on_tensor_cores(profile, precision) else ROUTED_TOL[precision]
            assert harness.relative_error(dw_mixed, want) <= max(tol, ROUTED_TOL[precision]), (scale, "dw mixed")
        tiny = g * 2.0**-120  # the operand scale at its upper clamp: 2^-scale must stay a normal float, not 0
        _, _, dw_tiny, db_tiny = _grads(new, x, tiny)
        want = harness.routed_float64_grads(x, w, argmin, pre_min, tiny)
        tol = TF32_WEIGHT_GRAD_TOL if _weight_grad_on_tensor_cores(profile, precision) else ROUTED_TOL[precision]
        assert harness.relative_error(dw_tiny, want[1]) <= max(tol, ROUTED_TOL[precision]), "dw at 2^-120"
        assert harness.relative_error(db_tiny, want[2]) <= ROUTED_TOL[precision], "db at 2^-120"


@needs_cuda
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "offset"])
def test_training_weight_gradient_scale_sees_every_element_of_g(precision, aligned, tf32_default):
    """The tensor cores' operand scale is each step's, from its largest |gm|. One element of g 2^20 above the rest, at
    each of the first 8 pixels (producer warp 0) and at the last one (warp 1), in g 16-byte aligned and one element
    off: a pixel the step's scale does not see would overflow fp16 once scaled, or be unscaled by another warp's
    scale, and dW would be wrong."""
    new, x, g, _ = _train_setup("A100", precision, (2, 16, 21, 37), seed=68)  # 2 * 19 * 35 pixels: a tail of 2
    w, b = new.conv.weight.detach(), new.conv.bias.detach()
    with harness.emulated("A100"):
        _, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, AUTO)
        backward = torch.ops.kb25.conv_min_tanh2_backward
        for at in list(range(8)) + [g.numel() - 1]:
            spiked = g.clone()
            spiked.view(-1)[at] = 2.0**20
            if not aligned:
                holder = torch.empty(g.numel() + 1, dtype=g.dtype, device=g.device)
                holder[1:] = spiked.view(-1)
                spiked = holder[1:].view(g.shape)
            assert (spiked.data_ptr() % 16 == 0) == aligned
            _, dw, db = backward(spiked, x, w, argmin, pre_min, False, True, True)
            want = harness.routed_float64_grads(x, w, argmin, pre_min, spiked)
            assert torch.isfinite(dw).all() and torch.isfinite(db).all(), (at, "not finite")
            tol = TF32_WEIGHT_GRAD_TOL if precision == "tf32" else ROUTED_TOL[precision]
            assert harness.relative_error(dw, want[1]) <= tol, (at, "dw")
            assert harness.relative_error(db, want[2]) <= ROUTED_TOL[precision], (at, "db")


@needs_cuda
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize("profile", ["H100", "A100"])
def test_training_weight_gradient_infinite_g_keeps_its_steps_finite_gm(profile, precision, tf32_default):
    """An infinite element of g: its channel's dW and db are infinite, as in the float64 chain, and every other
    channel keeps the step's finite gm. The tensor cores' operand scale is each step's, from its largest finite |gm|;
    one taken over the infinity would scale the step's finite gm to zeros (a step is a 38th of this shape's sums)."""
    new, x, g, _ = _train_setup(profile, precision, (2, 16, 21, 37), seed=69)
    w, b = new.conv.weight.detach(), new.conv.bias.detach()
    with harness.emulated(profile):
        _, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, AUTO)
        g[1, 0, 7, 11] = float("inf")
        _, dw, db = torch.ops.kb25.conv_min_tanh2_backward(g, x, w, argmin, pre_min, False, True, True)
    want = harness.routed_float64_grads(x, w, argmin, pre_min, g)
    assert torch.isinf(want[1]).any() and torch.isinf(dw).any(), "no infinite dW"
    tol = TF32_WEIGHT_GRAD_TOL if _weight_grad_on_tensor_cores(profile, precision) else ROUTED_TOL[precision]
    assert harness.relative_error(dw, want[1]) <= max(tol, ROUTED_TOL[precision]), "dw"
    assert harness.relative_error(db, want[2]) <= ROUTED_TOL[precision], "db"


def _first_saturated_tanh():
    """The bits of the least float32 m > 0 whose -m's tanh, torch's on the GPU, is -1 (at m - 1 ulp it is above -1)."""
    bits = torch.arange(0x41100000, 0x41110000, dtype=torch.int32, device="cuda")  # m in [9, 9.0625)
    t = torch.tanh(-bits.view(torch.float32))
    assert bool((t[1:] <= t[:-1]).all()) and bool((t == -1).any()) and float(t[0]) > -1, "saturates in (-9.0625, -9]"
    return int(bits[t == -1][0])


@needs_cuda
@pytest.mark.parametrize("precision,min_at", [("tf32", "far"), ("strict_fp32", "far"), ("bf16", "far"),
                                              ("tf32", "first_saturated"), ("strict_fp32", "first_saturated"),
                                              ("tf32", "last_unsaturated"), ("strict_fp32", "last_unsaturated")])
@pytest.mark.parametrize("profile", ["H100", "A100"])
def test_training_infinite_g_where_tanh_saturates_as_in_the_reference(profile, precision, min_at, tf32_default):
    """Where tanh(m) is -1 the reference's gm = g * (1 - t2^2) * (1 - t1^2) is 0, and an infinite g makes it NaN (inf
    * 0); one float nearer 0, where tanh(m) is not -1, it is an infinity. Weights 0 and channel 0's bias m, the others
    0: every pixel's min is m, at channel 0. m = -20 (far: the float64 chain's 1 - tanh(m)^2 is 2e-17, fp32's and
    bf16's are 0), or in fp32 at the GPU's tanh saturation: the first float whose tanh is -1, and the last before it.
    dW and db as the reference's: channel 0 all NaN (saturated) or infinite (not), the rest 0. dX as the dense chain's:
    NaN on the 16 channels of the pixel's 3 x 3 taps (inf * 0), 0 elsewhere; not compared with the reference's own dX,
    whose NaN pattern is cuDNN's algorithm's (a Winograd or FFT one spreads a NaN over a tile)."""
    new, x, g, spec = _train_setup(profile, precision, (2, 16, 12, 20), seed=73)
    m = -20.0
    if min_at != "far":
        first = _first_saturated_tanh()
        m = -torch.tensor([first if min_at == "first_saturated" else first - 1], dtype=torch.int32).view(
            torch.float32).item()
    with torch.no_grad():
        new.conv.weight.zero_()
        new.conv.bias.zero_()
        new.conv.bias[0] = m
    g[1, 0, 4, 9] = float("inf")
    ref = reference.Model(16, 64, 3).cuda().to(spec.dtype)
    ref.load_state_dict(new.state_dict())
    with harness.emulated(profile):
        _, dx, dw, db = _grads(new, x, g)
        _, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, new.conv.weight.detach(),
                                                                  new.conv.bias.detach(), AUTO)
    assert bool((pre_min == new.conv.bias[0]).all()) and not bool(argmin.any()), "the saved min is m at channel 0"
    _, _, *want = _grads(ref, x, g)
    for name, got, ref_grad in zip("wb", (dw, db), want):
        assert torch.equal(got.isnan(), ref_grad.isnan()), name
        assert torch.equal(got.nan_to_num(), ref_grad.nan_to_num()), name
    if min_at == "last_unsaturated":
        assert bool(dw[0].isposinf().all()) and bool(db[0].isposinf()), "an infinite gm where tanh(m) is not -1"
    else:
        assert bool(dw[0].isnan().all()) and bool(db[0].isnan()), "NaN gm where tanh(m) is -1"
    taps = torch.zeros_like(dx, dtype=torch.bool)
    taps[1, :, 4:7, 9:12] = True
    assert torch.equal(dx.isnan(), taps), "dX's NaN"
    assert not bool(dx.nan_to_num().any()), "dX elsewhere"


@needs_cuda
@pytest.mark.parametrize("profile", ["H100", "A100"])
@pytest.mark.parametrize("case", ["tiny_x", "small_x", "tiny_x_one_image", "dust_x"])
@pytest.mark.parametrize("width", [150, 152], ids=["by_element", "aligned"])
def test_training_weight_gradient_keeps_its_precision_at_extreme_ranges(profile, case, width, tf32_default):
    """The tensor cores' fp16 operands keep 2^-24 steps. Where all of x is tiny (rand * 1e-6) its steps are summed in
    fp32; x = rand * 1e-3 (a twentieth of it below fp16's normals) stays on the tensor cores within TF32's class; one
    tiny image beside a normal one mixes the two; x = rand * 1e-8, all below 2^-24 (zeros in fp16), is walked too.
    Rows loaded element by element (width 150) and in 16-byte chunks (152): the producer folds each its own way. dW
    against the float64 chain (and on TF32-rounded operands, where the tensor cores ran alone), db and dX within
    fp32's bound."""
    new, x, g, _ = _train_setup(profile, "tf32", (2, 16, 40, width), seed=67)
    with torch.no_grad():
        if case == "tiny_x":
            x *= 1e-6
        elif case == "dust_x":
            x *= 1e-8
        elif case == "small_x":
            x *= 1e-3
        else:
            x[1] *= 1e-6
            g[0] = 0  # dW then comes from the tiny image alone (beside image 0's it would weigh 1e-6)
    with harness.emulated(profile):
        _, dx, dw, db = _grads(new, x, g)
        w = new.conv.weight.detach()
        _, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, new.conv.bias.detach(), AUTO)
    want = harness.routed_float64_grads(x, w, argmin, pre_min, g)
    where = f"{profile} {case}"
    tol = {"x": 1e-5, "b": 1e-5,
           "w": TF32_WEIGHT_GRAD_TOL if case != "small_x" else
           _check_weight_grad(dw, x, w, argmin, pre_min, g, profile, "tf32", where)}
    for name, got, truth in zip("xwb", (dx, dw, db), want):
        err = harness.relative_error(got, truth)
        assert err <= tol[name], f"{where} d{name}: {err}"
    if case != "small_x":  # walked: every product in fp32
        assert harness.relative_error(dw, want[1]) <= 1e-5, where


@needs_cuda
@pytest.mark.parametrize("profile", ["H100", "A100"])
def test_training_weight_gradient_with_many_channels_a_step(profile, tf32_default):
    """Signed normal x spreads the argmins over the channels, so that a step of 256 pixels holds more than 8 distinct
    k (the fed dW then takes a batch for each 8 of them, where torch.rand's argmins need one) and the row's last step
    fewer; 2,048 steps, so that each CTA runs several down a strip and reuses its slots: dW against the TF32-operand
    chain, db and dX within fp32's bound."""
    shape = (8, 16, 130, 300)
    new, _, g, _ = _train_setup(profile, "tf32", shape, seed=69)
    x = torch.randn(shape, generator=torch.Generator("cuda").manual_seed(70), device="cuda")
    w, b = new.conv.weight.detach(), new.conv.bias.detach()
    with harness.emulated(profile):
        _, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, AUTO)
        _, dx, dw, db = _grads(new, x, g)
    steps = argmin[..., :256].flatten(0, 2)
    distinct = max(len(torch.unique(row)) for row in steps)
    assert distinct > 16, f"a step's distinct argmins: at most {distinct}, want more than two batches"
    want = harness.routed_float64_grads(x, w, argmin, pre_min, g)
    tol = {"x": 1e-5, "b": 1e-5, "w": _check_weight_grad(dw, x, w, argmin, pre_min, g, profile, "tf32", profile)}
    for name, got, truth in zip("xwb", (dx, dw, db), want):
        err = harness.relative_error(got, truth)
        assert err <= tol[name], f"{profile} d{name}: {err}"


@needs_cuda
@pytest.mark.parametrize("profile", ["H100", "A100"])
def test_training_16bit_weight_gradient_walks_tiny_rows(profile, tf32_default):
    """bf16 x all far below fp16's normals (rand * 1e-7): the fed weight gradient carries bf16 x in fp16, whose
    2^-24 steps would round most of it to 0 or 6e-8, so its windows are summed in fp32 instead, and dW is the float64
    chain's within bf16's one rounding."""
    new, x, g, _ = _train_setup(profile, "bf16", (2, 16, 40, 152), seed=68)
    with torch.no_grad():
        x *= 1e-7
    w, b = new.conv.weight.detach(), new.conv.bias.detach()
    with harness.emulated(profile):
        _, _, dw, _ = _grads(new, x, g)
        _, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, AUTO)
    want = harness.routed_float64_grads(x, w, argmin, pre_min, g)[1]
    err = harness.relative_error(dw, want)
    assert err <= ROUTED_TOL["bf16"], f"{profile}: dw {err}"


@needs_cuda
@pytest.mark.parametrize("precision", ["strict_fp32", "tf32", "fp16"])
@pytest.mark.parametrize("profile", ["H100", "A100"])
@pytest.mark.parametrize("shape", [(2, 16, 20, 30), (16, 16, 258, 136)], ids=["one_step", "many_steps"])
def test_training_nan_and_inf_get_the_reference_gradients(profile, shape, precision, forward_mode, tf32_default):
    """NaN inputs: NaN where the reference's dense chain has NaN (dW for every channel at the NaN's taps: 0 * NaN; dX
    around it), its values elsewhere; on a shape where each backward CTA runs many steps, with NaNs in interior rows
    (each input row stays in the dW window for three steps). An infinite weight: 0 * inf is NaN in the reference's
    dX wherever that weight's tap reaches a pixel whose argmin is another channel; where the tap's input is 0, that
    channel alone is NaN at the pixel, and the saved argmin is that channel (NaN wins). Compared with the float64
    chain through the saved argmin (near-ties of a large shape could route a pixel differently from the reference's
    own conv), and on the small shape with the reference itself (float32 only: with the infinite weight, cuDNN's fp16
    backward gave dX another NaN pattern than the float64 chain on the H200, which the kernels match). Strict fp32
    runs the CUDA-core weight gradient; TF32 and fp16 the fed tensor-core one, whose steps with a NaN in their
    window are summed by its fp32 walkers."""
    new, x, g, spec = _train_setup(profile, precision, shape, seed=63)
    n, _, h, w = shape
    x[0, 3, h // 4, w // 4] = float("nan")
    x[n - 1, 10, h - 2, w - 1] = float("nan")
    x[n // 2, 7, h // 2, w // 2] = float("nan")
    ref = reference.Model(16, 64, 3).cuda().to(spec.dtype)
    for poison_weight in (False, True):
        if poison_weight:
            x = x.nan_to_num(0.5)
            x[0, 3, 4, 6] = 0.0  # the pixel (3, 5) of image 0 reads x[0, 3, 4, 6] at tap (1, 1): 0 * inf = NaN
            with torch.no_grad():
                new.conv.weight[5, 3, 1, 1] = float("inf")
        ref.load_state_dict(new.state_dict())
        with harness.emulated(profile):
            _, dx, dw, db = _grads(new, x, g)
            _, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, new.conv.weight.detach(),
                                                                      new.conv.bias.detach(), AUTO)
        if poison_weight:
            assert int(argmin[0, 0, 3, 5]) == 5
        w = new.conv.weight.detach()
        routed = harness.routed_float64_grads(x, w, argmin, pre_min, g)
        # With NaN inputs TF32's dW mixes the walkers' fp32 products (steps with a NaN in their window) with TF32
        # ones: held to the plain chain alone.
        tol = {"x": ROUTED_TOL[precision], "b": ROUTED_TOL[precision],
               "w": _check_weight_grad(dw, x, w, argmin, pre_min, g, profile, precision, str(poison_weight))
               if poison_weight or precision != "tf32" else TF32_WEIGHT_GRAD_TOL}
        for name, got, want in zip("xwb", (dx, dw, db), routed):
            assert torch.equal(got.isnan(), want.isnan()), (poison_weight, name, "float64 chain")
            assert harness.relative_error(got, want) <= tol[name], (poison_weight, name)
        if shape == (2, 16, 20, 30) and precision != "fp16":
            _, *ref_grads = _grads(ref, x, g)
            for name, got, want in zip("xwb", (dx, dw, db), ref_grads):
                assert torch.equal(got.isnan(), want.isnan()), (poison_weight, name, "reference")
                if precision == "fp16":  # its argmin comes from fp16-rounded channels: near-ties route elsewhere
                    continue
                # the reference's own TF32 convs (dX too) are TF32_WEIGHT_GRAD_TOL from the float64 chain
                ref_tol = 1e-4 if precision == "strict_fp32" else TF32_WEIGHT_GRAD_TOL
                assert harness.relative_error(got, want) <= ref_tol, (poison_weight, name)
        assert dx.isnan().any() and (dw.isnan().any() or poison_weight)


@needs_cuda
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_grad_input_tap_outside_the_output_adds_nothing(precision, forward_mode, tf32_default):
    """A tap outside the output adds nothing to dX, even where its weight is infinite in every channel. With
    W[:, 3, 1, 1] = inf every pixel's channels are +inf (x > 0), so gm = 0, and the reference's dX of channel 3 is
    NaN (0 * inf) exactly on the cells that tap (1, 1) reaches: all but the border, which stays 0. dX reads a row of
    zeros for a tap outside the output; a channel's row there would make the border NaN."""
    new, x, g, _ = _train_setup("H100", precision, (2, 16, 20, 30), seed=71)
    with torch.no_grad():
        new.conv.weight[:, 3, 1, 1] = float("inf")
    _, dx, _, _ = _grads(new, x, g)
    w = new.conv.weight.detach()
    _, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, new.conv.bias.detach(), AUTO)
    want = harness.routed_float64_grads(x, w, argmin, pre_min, g)[0]
    assert torch.equal(dx.isnan(), want.isnan())
    interior = torch.zeros_like(dx[:, 3], dtype=torch.bool)
    interior[:, 1:-1, 1:-1] = True
    assert torch.equal(dx[:, 3].isnan(), interior), "channel 3: NaN inside, finite on the border"
    assert torch.equal(dx[:, 3][~interior], torch.zeros_like(dx[:, 3][~interior]))


def _ranges_cross_strips(images, out_rows, col_blocks, ctas, after):
    """Whether some CTA's range of backward steps (step_range over (image, column strip, output row)) holds the last
    step of one column strip and the first `after` steps of the next."""
    total = images * col_blocks * out_rows
    ranges = [(total * b // ctas, total * (b + 1) // ctas) for b in range(min(ctas, total))]
    starts = [(n * col_blocks + cb) * out_rows for n in range(images) for cb in range(1, col_blocks)]
    return any(begin < s and s + after <= end for begin, end in ranges for s in starts)


@needs_cuda
@pytest.mark.parametrize("profile", ["H100", "A100"])
def test_training_weight_gradient_ignores_an_earlier_strips_infinities(profile, tf32_default):
    """The fed TF32 dW keeps each input row in a ring slot (4 of them). A row of a strip that ends within the tile (W =
    508: the second 256-column strip holds 252 input columns) leaves its slot's last chunk (columns 256-259)
    unstored, and the taps of the pixels past the row's end (254, 255) read it, times B's zeros. The producer zeroes
    it: otherwise it keeps what the slot held in the strip before. Here an infinity at input column 256 of each
    image's last row (row 129, which the next strip's row 3 replaces in its slot): the reference's dW is NaN at that
    tap row alone (dW[:, 3, 2, :], 0 * inf at the pixels that read it), and a kept chunk would add NaNs at rows 0
    and 1 (the steps whose window holds row 3 there). The shape leaves some CTA running from a strip's last step
    into three steps of the next for a grid of one or two CTAs an SM."""
    shape = (7, 16, 130, 508)
    n, _, h, w = shape
    new, x, g, _ = _train_setup(profile, "tf32", shape, seed=69)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if not all(_ranges_cross_strips(n, h - 2, 2, k * sms, after=3) for k in (1, 2)):
        pytest.skip(f"with {sms} SMs no backward CTA runs across a strip's end at {shape}")
    x[:, 3, h - 1, 256] = float("inf")
    with harness.emulated(profile):
        _, dx, dw, db = _grads(new, x, g)
        _, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, new.conv.weight.detach(),
                                                                  new.conv.bias.detach(), AUTO)
    routed = harness.routed_float64_grads(x, new.conv.weight.detach(), argmin, pre_min, g)
    tol = {"x": ROUTED_TOL["tf32"], "w": TF32_WEIGHT_GRAD_TOL, "b": ROUTED_TOL["tf32"]}
    for name, got, want in zip("xwb", (dx, dw, db), routed):
        assert torch.equal(got.isnan(), want.isnan()), (profile, name, int(got.isnan().sum()), int(want.isnan().sum()))
        assert harness.relative_error(got, want) <= tol[name], (profile, name)
    assert dw[:, 3, 2].isnan().all() and not dw[:, 3, :2].isnan().any()


@needs_cuda
@pytest.mark.parametrize("profile", ["H100", "A100"])
def test_training_parts_retain_graph_noncontiguous_grad_and_determinism(profile, forward_mode, tf32_default):
    """Only the gradients asked for (x alone, the weights alone), each equal to the full backward's; retain_graph
    (a second backward adds the same again); a non-contiguous output gradient; and two runs equal bit for bit with
    torch.use_deterministic_algorithms(True)."""
    new, x, g, _ = _train_setup(profile, "tf32", (3, 16, 37, 300), seed=64)
    with harness.emulated(profile):
        _, dx, dw, db = _grads(new, x, g)
        new.zero_grad(set_to_none=True)
        new.requires_grad_(False)
        xg = x.clone().requires_grad_(True)
        new(xg).backward(g)
        assert torch.equal(xg.grad, dx) and new.conv.weight.grad is None and new.conv.bias.grad is None
        new.requires_grad_(True)
        out = new(x)
        out.backward(g, retain_graph=True)
        assert torch.equal(new.conv.weight.grad, dw) and torch.equal(new.conv.bias.grad, db)
        out.backward(g)
        assert torch.equal(new.conv.weight.grad, 2 * dw) and torch.equal(new.conv.bias.grad, 2 * db)
        strided = torch.zeros(g.shape[0], 1, g.shape[3], g.shape[2], device="cuda", dtype=g.dtype).transpose(2, 3)
        strided.copy_(g)
        assert not strided.is_contiguous()
        assert all(torch.equal(a, b) for a, b in zip(_grads(new, x, strided)[1:], (dx, dw, db)))
        torch.use_deterministic_algorithms(True)
        try:
            again = _grads(new, x, g)[1:]
        finally:
            torch.use_deterministic_algorithms(False)
        assert all(torch.equal(a, b) for a, b in zip(again, (dx, dw, db)))


@needs_cuda
@pytest.mark.parametrize("saving", [False, True])
def test_training_double_backward_follows_the_reference(saving, tf32_default):
    """create_graph=True (a gradient penalty): the backward is then the reference's chain in torch ops, so second
    derivatives exist and equal the reference's (strict fp32: the same ops on both sides)."""
    previous = model_new.save_in_forward()
    model_new.save_in_forward(saving)
    try:
        new, x, g, _ = _train_setup("A100", "strict_fp32", (2, 16, 9, 11), seed=65)
        ref = reference.Model(16, 64, 3).cuda()
        ref.load_state_dict(new.state_dict())
        for model in (new, ref):
            model.zero_grad(set_to_none=True)
            xg = x.clone().requires_grad_(True)
            out = model(xg)
            if model is new and saving:  # the C++ SavingStep, whose backward then recomputes the reference's chain
                assert "SavingStep" in out.grad_fn.name(), out.grad_fn.name()
            (dx,) = torch.autograd.grad(out, xg, g, create_graph=True)
            dx.pow(2).sum().backward()
        assert torch.allclose(new.conv.weight.grad, ref.conv.weight.grad, atol=1e-6, rtol=1e-5)
        assert torch.allclose(new.conv.bias.grad, ref.conv.bias.grad, atol=1e-6, rtol=1e-5)
    finally:
        model_new.save_in_forward(previous)


@needs_cuda
@pytest.mark.parametrize("case", ["float64", "unbatched"])
def test_eager_step_that_saves_nothing_follows_the_reference(case, tf32_default):
    """An eager training call that saves no argmin (float64; an unbatched input, whose min runs over the conv
    output's rows) still goes through the C++ SavingStep, whose backward then recomputes the reference's chain in
    ATen ops: the x, weight and bias gradients are the reference's."""
    previous = model_new.save_in_forward()
    model_new.save_in_forward(True)
    try:
        dtype = torch.float64 if case == "float64" else torch.float32
        ref, new = (m.to(dtype) for m in _cuda_models(71))
        x = make_input((2, 16, 9, 11) if case == "float64" else (16, 9, 11), seed=71, device="cuda").to(dtype)
        grads = []
        for model in (new, ref):
            model.zero_grad(set_to_none=True)
            xg = x.clone().requires_grad_(True)
            out = model(xg)
            if model is new:
                assert "SavingStep" in out.grad_fn.name(), out.grad_fn.name()
            g = torch.randn(out.shape, generator=torch.Generator("cuda").manual_seed(72), device="cuda", dtype=dtype)
            out.backward(g)
            grads.append((xg.grad, model.conv.weight.grad, model.conv.bias.grad))
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        for name, got, want in zip(("x", "weight", "bias"), *grads):
            assert torch.allclose(got, want, atol=tol, rtol=tol), f"{case}: {name}"
    finally:
        model_new.save_in_forward(previous)


@needs_cuda
def test_training_saves_in_forward_from_the_first_backward_on(tf32_default):
    """A process starts with forwards under autograd running the inference kernel (KernelBench times ModelNew with
    grad enabled and never calls backward); the first backward runs the saving forward itself and switches later
    forwards to saving. Both give the same gradients, bit for bit."""
    previous = model_new.save_in_forward()
    try:
        new, x, g, _ = _train_setup("A100", "tf32", (2, 16, 37, 300), seed=69)
        with harness.emulated("A100"):
            model_new.save_in_forward(False)
            xg = x.clone().requires_grad_(True)
            out = new(xg)
            assert "conv_min_tanh2_default" in out.grad_fn.name() and not model_new.save_in_forward()
            out.backward(g)
            assert model_new.save_in_forward()
            saved = new(xg)
            name = saved.grad_fn.name()  # the saving op's node, or its eager form's (the C++ SavingStep)
            assert "conv_min_tanh2_with_argmin" in name or "SavingStep" in name, name
            first = (xg.grad, new.conv.weight.grad, new.conv.bias.grad)
            again = _grads(new, x, g)[1:]
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    finally:
        model_new.save_in_forward(previous)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_saving_op_gpu(dtype, tf32_default):
    """opcheck on the op ModelNew records for autograd (its backward the fused one) and on that backward op."""
    ref, _ = make_models(17)
    w, b = (t.detach().to(device="cuda", dtype=dtype).requires_grad_(True) for t in (ref.conv.weight, ref.conv.bias))
    x = make_input((2, 16, 7, 9), seed=2, device="cuda").to(dtype).requires_grad_(True)
    results = torch.library.opcheck(model_new.conv_min_tanh2_with_argmin, (x, w, b, AUTO))
    assert set(results.values()) == {"SUCCESS"}, results
    out, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, w, b, AUTO)
    g = torch.randn_like(out)
    backward = torch.ops.kb25.conv_min_tanh2_backward.default
    results = torch.library.opcheck(backward, (g, x.detach(), w.detach(), argmin, pre_min, True, False, True),
                                    test_utils=("test_schema", "test_faketensor"))
    assert set(results.values()) == {"SUCCESS"}, results


@needs_cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_autocast_runs_the_16bit_kernel_and_returns_the_reference_dtype(dtype, tf32_default):
    """Under torch.autocast("cuda", dtype) ModelNew casts as conv2d does: the reference's dtype, its values at 1e-2,
    a 16-bit fused kernel (forcing the fused backend: only a kernel of that dtype can give that dtype), with grad
    and without; the float32 parameters get float32 gradients close to the reference's."""
    ref, new = _cuda_models(66)
    x = make_input((4, 16, 40, 300), seed=67, device="cuda")
    for backend in ("auto", "fused"):
        new.backend = backend
        for grad in (False, True):
            new.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dtype), torch.set_grad_enabled(grad):
                got, want = new(x), ref(x)
            assert got.dtype == want.dtype == dtype
            assert compare(got.float(), want.float(), atol=LOW_PRECISION_TOL, rtol=LOW_PRECISION_TOL)[0]
            if grad:
                got.float().sum().backward()
                want.float().sum().backward()
                assert new.conv.weight.grad.dtype == torch.float32
                assert harness.relative_error(new.conv.weight.grad, ref.conv.weight.grad) < 0.05
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    assert new.fused_kernel(x.to(dtype)) in [k.name for k in model_new.FUSED_TABLE if k.precision == precision]


@needs_cuda
def test_training_under_compile_and_cuda_graphs(tf32_default):
    """The saving op and its backward under torch.compile(fullgraph=True) (inductor) and captured in CUDA graphs
    (torch.cuda.make_graphed_callables: forward and backward replayed): the eager step's gradients, bit for bit."""
    torch._dynamo.reset()
    new, x, g, _ = _train_setup("H100" if model_new.fused_kernel_launches("sm90_tf32") else "A100", "tf32",
                                (2, 16, 40, 300), seed=68)
    _, dx, dw, db = _grads(new, x, g)
    compiled = torch.compile(new, fullgraph=True)
    for _ in range(2):
        got = _grads(compiled, x, g)
        assert all(torch.equal(a, b) for a, b in zip(got[1:], (dx, dw, db)))
    xg = x.clone().requires_grad_(True)
    graphed = torch.cuda.make_graphed_callables(new, (xg,))
    for _ in range(2):
        new.zero_grad(set_to_none=True)
        xg.grad = None
        graphed(xg).backward(g)
        assert torch.equal(xg.grad, dx) and torch.equal(new.conv.weight.grad, dw) and torch.equal(new.conv.bias.grad, db)


# ------------------------------------------------------------------- fp16 operands for fp32 inputs, and their guards
# TF32 on fp16 operands (the TF32 products) and strict fp32 on fp16 hi/lo parts (three products): each lists the
# images it cannot carry, and its guard (TF32, 3xTF32) recomputes them.
GUARDED = [k.name for k in model_new.FUSED_TABLE if k.tag in model_new.GUARDED_TAGS]
GUARDED_TF32 = [k for k in GUARDED if model_new.FUSED_TABLE[model_new.FUSED_KERNELS.index(k)].precision == "tf32"]
GUARDED_STRICT = [k for k in GUARDED if model_new.FUSED_TABLE[model_new.FUSED_KERNELS.index(k)].precision == "strict_fp32"]
GUARDS = list(model_new.GUARD_KERNELS)


def _row(name):
    return model_new.FUSED_TABLE[model_new.FUSED_KERNELS.index(name)]


def _guard_of(name):
    """The kernel that guards `name` on this GPU: the first guard of the same precision and MMA that launches here."""
    return next(k for k in GUARDS if (_row(k).precision, _row(k).mma) == (_row(name).precision, _row(name).mma)
                and model_new.fused_kernel_launches(k))


def _guarded_or_skip(name):
    """Skips where this GPU cannot launch `name`; else sets the conv precision that it computes (TF32 convs allowed
    for TF32, not for strict fp32: run_fused_kernel checks it; the tf32_default fixture restores it)."""
    if not model_new.fused_kernel_launches(name):
        pytest.skip(f"{name} does not launch on this GPU")
    torch.backends.cudnn.allow_tf32 = _row(name).precision == "tf32"


def _case_seed(*key):
    """A seed of its own for each case, the same in every process (str hashes are salted per process)."""
    return zlib.crc32(repr(key).encode()) % 1000


def _bit_equal(a, b):
    """The same dtype and the same values, NaN where the other has NaN (a NaN's payload aside)."""
    return a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.nan_to_num(a),
                                                                                     torch.nan_to_num(b))


def _distribution(kind, shape, seed):
    """Inputs for the carrier: torch.rand; signed normal; tiny (x 1e-3: some below fp16's normal range); all below
    fp16's normal range (x 6e-5); ties (every value halfway between two TF32 values, where rounding to nearest even
    and ties away differ); wide (magnitudes 2^-14 .. 2^8, signed)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "rand":
        return torch.rand(shape, generator=gen, device="cuda")
    if kind == "normal":
        return torch.randn(shape, generator=gen, device="cuda")
    if kind == "tiny":
        return torch.rand(shape, generator=gen, device="cuda") * 1e-3
    if kind == "subnormal":
        return torch.rand(shape, generator=gen, device="cuda") * 6e-5
    if kind == "dust":  # below 2^-25: fp16 rounds them to 0 (strict's hi parts)
        return torch.rand(shape, generator=gen, device="cuda") * 1e-9
    if kind == "ties":
        return _ties(shape, gen, 10)
    if kind == "wide":
        return _log_uniform(shape, gen, -14, 8)
    raise ValueError(kind)


def _ties(shape, gen, bits):
    """Signed values in [1, 2) halfway between two neighbours of a type with `bits` mantissa bits."""
    k = torch.randint(0, 2 ** bits, shape, generator=gen, device="cuda").float()
    sign = torch.randint(0, 2, shape, generator=gen, device="cuda").float() * 2 - 1
    return sign * (1 + (2 * k + 1) * 2.0 ** -(bits + 1))


def _log_uniform(shape, gen, lo, hi):
    """Signed magnitudes 2^lo .. 2^hi, log-uniform."""
    e = torch.rand(shape, generator=gen, device="cuda") * (hi - lo) + lo
    sign = torch.randint(0, 2, shape, generator=gen, device="cuda").float() * 2 - 1
    return sign * torch.exp2(e)


@needs_cuda
@pytest.mark.parametrize("kind", ["rand", "normal", "tiny", "subnormal", "ties", "wide"])
@pytest.mark.parametrize("name", GUARDED_TF32)
def test_tf32_on_fp16_operands_gives_the_tf32_products(name, kind, tf32_default):
    """The guarded kernels multiply TF32-rounded operands (ties away) on fp16 tensor cores: against the float64
    forward of the TF32-rounded x and weight, within fp32 accumulation noise (2e-6 of the sums' scale), plus, where
    x lies below fp16's normal range, 2^-24 per input times the largest sum of |w| over a channel (the precision
    contract). (Against the reference itself: the full-size tests; cuDNN runs some small shapes in full fp32.) Ragged
    shapes: tiles cut by the image's edge, W not a multiple of 4 (element loads)."""
    _guarded_or_skip(name)
    _, new = _cuda_models(7)
    w, b = new.conv.weight.detach(), new.conv.bias.detach()
    if kind == "wide":
        w = w / 256
    for shape in [(3, 16, 37, 301), (2, 16, 9, 258), (2, 16, 6, 7)]:
        x = _distribution(kind, shape, seed=_case_seed(kind, shape))
        out, listed = model_new.run_guarded_kernel(x, w, b, name, True)
        assert listed.numel() == 0, (kind, shape, listed)
        truth = harness.float64_forward(x, w, b, operands=harness.round_tf32)
        scale = max(1.0, float(truth.abs().max()))
        bound = 2e-6 * scale
        if kind in ("tiny", "subnormal"):
            bound += 2.0 ** -24 * float(harness.round_tf32(w).abs().sum(dim=(1, 2, 3)).max())
        err = harness.max_abs_error(out, truth)
        assert err <= bound, f"{name} {kind} {shape}: {err} from the TF32 products' float64 forward (bound {bound})"


@needs_cuda
@pytest.mark.parametrize("kind", ["rand", "normal", "tiny", "subnormal", "dust", "ties", "wide"])
@pytest.mark.parametrize("name", GUARDED_STRICT)
def test_strict_on_fp16_parts_gives_fp32_products(name, kind, tf32_default):
    """Strict fp32 on fp16 hi/lo parts: against the float64 forward of x and the weights as they are, no further
    than twice what its guard (3xTF32, the same three-product scheme on TF32 parts) is, plus the contract's 2^-36 per
    input times the largest sum of |w| over a channel; and within 1e-6 of the sums' scale. Inputs all below fp16's
    normal range (x 6e-5), or all below 2^-25 (x 1e-9, whose hi parts are 0), list every image, which the guard then
    computes. Ties: halfway between two fp16 values. Widths 301, 258, 7 (element loads) and 260 (16-byte loads)."""
    # (the same distributions as the TF32 carrier's test, _distribution)
    _guarded_or_skip(name)
    _, new = _cuda_models(7)
    w, b = new.conv.weight.detach(), new.conv.bias.detach()
    if kind == "wide":
        w = w / 256
    floor = 2.0 ** -36 * float(w.abs().sum(dim=(1, 2, 3)).max())
    for shape in [(3, 16, 37, 301), (2, 16, 9, 258), (2, 16, 6, 7), (2, 16, 9, 260)]:
        x = _distribution(kind, shape, seed=_case_seed(kind, shape))
        out, listed = model_new.run_guarded_kernel(x, w, b, name, True)
        guard = model_new.run_fused_kernel(x, w, b, _guard_of(name))
        if kind in ("subnormal", "dust"):
            assert sorted(listed.tolist()) == list(range(shape[0])), (shape, listed)
            assert _bit_equal(out, guard)
            continue
        assert listed.numel() == 0, (kind, shape, listed)
        truth = harness.float64_forward(x, w, b)
        err, guard_err = harness.max_abs_error(out, truth), harness.max_abs_error(guard, truth)
        assert err <= 2 * guard_err + floor, f"{name} {kind} {shape}: {err} from float64, 3xTF32 {guard_err}"
        assert err <= 1e-6 * max(1.0, float(truth.abs().max())), f"{name} {kind} {shape}: {err} from float64"


@needs_cuda
@pytest.mark.parametrize("name", GUARDED)
def test_guard_lists_and_recomputes_inputs_fp16_does_not_hold(name, tf32_default):
    """Inputs whose TF32 (or fp16 hi) value fp16 does not hold (65520 rounds to 65536, 1e30, +-inf, NaN), in one row
    of one image, over one image's rows, in several images; tiny ones (1e-6, 1e-30) beside normal ones and 65504's
    neighbour 65000 that it does hold. Alone, the kernel lists exactly the images with such inputs, each once, and
    leaves the others as its guarded run leaves them (the guard's path missed there); with its guard, each listed
    image is bit for bit what the guard kernel (TF32, 3xTF32) gives it (NaN where it has NaN: the guard's path hit)."""
    _guarded_or_skip(name)
    _, new = _cuda_models(8)
    w, b = new.conv.weight.detach(), new.conv.bias.detach()
    x = make_input((7, 16, 21, 262), seed=9, device="cuda")
    x[0, 4, 3, 5], x[0, 9, 20, 261], x[0, 0, 0, 0] = 1e-6, 1e-30, 65000.0  # in range
    x[1, 3, 7, 11] = 65520.0
    x[2, 0, 0, 0], x[2, 15, 20, 261] = float("inf"), -float("inf")
    x[4, 5, 10, 20], x[4, 6, 10, 21] = float("nan"), -1e30
    x[5, :, :, 100] = -70000.0  # every row of the image
    x[6, 2, 12, 7] = 65504.0  # fp16's largest: it fits, and may go to the guard all the same
    raw, listed = model_new.run_guarded_kernel(x, w, b, name, False)
    listed = listed.tolist()
    assert len(listed) == len(set(listed)), listed
    assert {1, 2, 4, 5} <= set(listed) <= {1, 2, 4, 5, 6}, listed
    full, again = model_new.run_guarded_kernel(x, w, b, name, True)
    assert sorted(again.tolist()) == sorted(listed)
    tf32 = model_new.run_fused_kernel(x, w, b, _guard_of(name))
    for n in range(x.shape[0]):
        if n in listed:
            assert _bit_equal(full[n], tf32[n]), n
            if n != 6:  # inputs fp16 does not hold: the guard changed the image (65504 it holds, so maybe not)
                assert not torch.equal(torch.nan_to_num(raw[n]), torch.nan_to_num(full[n])), n
        else:
            assert torch.equal(raw[n], full[n]), n
    assert full[4].isnan().any()  # the NaN input's pixels


@needs_cuda
@pytest.mark.parametrize("case", ["tiny", "huge", "bias_large", "zero", "wide", "nan_weight", "nan_bias", "bias_lost",
                                  "inf_weight", "inf_bias"])
@pytest.mark.parametrize("name", GUARDED)
def test_weight_scale_carries_weights_or_lists_every_image(name, case, tf32_default):
    """The weights are scaled by a power of two into fp16's range and the scale is undone after the min: tiny
    (x 1e-20) and huge (x 1e20) weights, a bias 1e4 times the weights, all-zero weights give the kernel's products
    (TF32: the TF32-rounded operands'; strict: the operands' own) within 1e-6 of the output's scale from the guard
    kernel's and 2e-6 of the float64 forward, nothing listed. Weights fp16 cannot hold at any one scale (one
    weight 2^40 times the rest), a NaN or infinite weight or bias (beside zero weights, which the scale carries), or
    a bias that the scale would take below fp32's normal range (weights x 1e20, bias x 1e-25) list every image, and
    the output is the guard kernel's."""
    strict = _row(name).precision == "strict_fp32"
    _guarded_or_skip(name)
    _, new = _cuda_models(10)
    w, b = new.conv.weight.detach().clone(), new.conv.bias.detach().clone()
    if case == "tiny":
        w, b = w * 1e-20, b * 1e-20
    elif case == "huge":
        w, b = w * 1e20, b * 1e20
    elif case == "bias_large":
        b = b * 1e4
    elif case == "zero":
        w = torch.zeros_like(w)
    elif case == "wide":
        w[3, 2, 1, 1] = 2.0 ** 40
    elif case == "nan_weight":
        w[5, 0, 0, 0] = float("nan")
    elif case == "nan_bias":
        b[7] = float("nan")
    elif case == "bias_lost":
        w, b = w * 1e20, b * 1e-25
    elif case == "inf_weight":  # the scale carries the other weights and the bias (all 0) and the infinity too
        w, b = torch.zeros_like(w), torch.zeros_like(b)
        w[5, 0, 0, 0] = float("inf")
    elif case == "inf_bias":  # alone, so that the scale carries every other bias
        w, b = torch.zeros_like(w), torch.zeros_like(b)
        b[7] = float("inf")
    x = make_input((3, 16, 20, 70), seed=11, device="cuda")
    out, listed = model_new.run_guarded_kernel(x, w, b, name, True)
    tf32 = model_new.run_fused_kernel(x, w, b, _guard_of(name))
    if case in ("wide", "nan_weight", "nan_bias", "bias_lost", "inf_weight", "inf_bias"):
        assert sorted(listed.tolist()) == [0, 1, 2]
        assert _bit_equal(out, tf32)
    else:
        assert listed.numel() == 0
        scale = float(tf32.abs().max()) or 1.0
        assert harness.max_abs_error(out, tf32) <= 1e-6 * scale, case
        truth = harness.float64_forward(x, w, b, operands=None if strict else harness.round_tf32)
        assert harness.max_abs_error(out, truth) <= 2e-6 * scale, case


@needs_cuda
def test_guard_runs_in_one_stream_under_cuda_graphs(tf32_default):
    """The guard needs nothing from the host: a captured call replays with new inputs, listing and recomputing
    what each replay's input needs (none, then one image, which then is bit for bit the TF32 kernel's)."""
    _, new = _cuda_models(12)
    w, b = new.conv.weight.detach(), new.conv.bias.detach()
    x = make_input((3, 16, 20, 70), seed=12, device="cuda")
    kernel = new.fused_kernel(x)
    assert kernel in GUARDED, kernel
    static = x.clone()
    with torch.no_grad():
        new(static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = new(static)
    for poke in (False, True):
        fresh = make_input((3, 16, 20, 70), seed=13 + poke, device="cuda")
        if poke:
            fresh[1, 2, 3, 4] = float("inf")
        static.copy_(fresh)
        graph.replay()
        with torch.no_grad():
            want = new(fresh)
        assert _bit_equal(out, want)
        if poke:
            assert _bit_equal(out[1], model_new.run_fused_kernel(fresh, w, b, _guard_of(kernel))[1])


# ------------------------------------------------------------------------------ autocast: x rounded by the kernel
CAST_INPUT = [k.name for k in model_new.FUSED_TABLE if k.input == "fp32" and k.precision in ("bf16", "fp16")]


def _native_of(name):
    """The 16-bit kernel of the same MMA and precision that takes x in its own dtype."""
    row = model_new.FUSED_TABLE[model_new.FUSED_KERNELS.index(name)]
    return next(k.name for k in model_new.FUSED_TABLE
                if (k.mma, k.precision, k.input) == (row.mma, row.precision, row.precision))


def _cast_input_distribution(kind, shape, seed, dtype):
    """float32 inputs for the kernels that round x themselves: torch.rand; signed normal; ties (every value halfway
    between two values of dtype, where rounding to nearest even, ties away and truncation all differ); wide
    (magnitudes 2^-30 .. 2^17: fp16 subnormals, flushes and overflows); special (+-inf, NaN, 65504, 65519.99 and
    65520 (fp16's largest, the last value that rounds to it, the first that overflows), 1e-30, mixed into one row, one
    image, and across images)."""
    if kind in ("rand", "normal"):
        return _distribution(kind, shape, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "ties":
        return _ties(shape, gen, 7 if dtype == torch.bfloat16 else 10)
    if kind == "wide":
        return _log_uniform(shape, gen, -30, 17)
    if kind == "special":
        x = torch.rand(shape, generator=gen, device="cuda")
        values = [float("inf"), float("-inf"), float("nan"), 65504.0, 65519.99, 65520.0, -65520.0, 1e-30]
        for i, v in enumerate(values):
            x[i % shape[0], i % shape[1], (3 * i) % shape[2], (7 * i) % shape[3]] = v
        x[0, 1, 2, :4] = torch.tensor(values[:4])  # several in one row
        return x
    raise ValueError(kind)


@needs_cuda
@pytest.mark.parametrize("kind", ["rand", "normal", "ties", "wide", "special"])
@pytest.mark.parametrize("name", CAST_INPUT)
def test_cast_input_kernel_equals_the_16bit_kernel_on_the_cast_input(name, kind, tf32_default):
    """A kernel that reads float32 x and rounds it to bf16 / fp16 itself gives, bit for bit, what the 16-bit kernel of
    the same MMA gives on x.to(dtype) (round to nearest even; overflow to inf, NaN kept). Ragged shapes: tiles cut by
    the image's edge, W not a multiple of 4 (element loads)."""
    if not model_new.fused_kernel_launches(name):
        pytest.skip(f"{name} does not launch on this GPU")
    row = model_new.FUSED_TABLE[model_new.FUSED_KERNELS.index(name)]
    dtype = model_new.INPUT_DTYPES[row.precision]
    _, new = _cuda_models(71)
    w, b = new.conv.weight.detach().to(dtype), new.conv.bias.detach().to(dtype)
    for shape in [(3, 16, 37, 301), (2, 16, 9, 258), (2, 16, 6, 7)]:
        x = _cast_input_distribution(kind, shape, seed=_case_seed(kind, shape), dtype=dtype)
        got = model_new.run_fused_kernel(x, w, b, name)
        want = model_new.run_fused_kernel(x.to(dtype), w, b, _native_of(name))
        assert _bit_equal(got, want), f"{name} {kind} {shape}: {harness.max_abs_error(got, want)} from the cast's"


@needs_cuda
@pytest.mark.parametrize("profile", ["H100", "A100", "A10G"])
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_autocast_rounds_x_in_the_kernel(dtype, profile, tf32_default):
    """Under torch.autocast("cuda", dtype), in eager inference, ModelNew runs the kernel that rounds x, the weights
    and the bias itself: one kernel, no cast kernel, the output equal bit for bit to the cast-then-kernel call;
    fused_kernel() names that kernel."""
    if profile == "H100" and not model_new.fused_kernel_launches("sm90_bf16"):
        pytest.skip("this GPU has no wgmma")
    _, new = _cuda_models(72)
    x = make_input((3, 16, 37, 301), seed=73, device="cuda")
    with harness.emulated(profile), torch.no_grad():
        with torch.autocast("cuda", dtype=dtype):
            kernel = new.fused_kernel(x)
            got = new(x)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                new(x)
        want = model_new._ext.conv_min_tanh2(x.to(dtype), new.conv.weight.to(dtype), new.conv.bias.to(dtype), 0)
    assert kernel in CAST_INPUT and model_new.FUSED_TABLE[model_new.FUSED_KERNELS.index(kernel)].precision == \
        {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype], kernel
    assert _bit_equal(got, want)
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    fused = [k for k in kernels if "conv3x3_min_tanh2_kernel" in k]
    assert len(fused) == 1 and len(kernels) == 1, kernels


@needs_cuda
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_autocast_with_weights_of_the_other_16bit_type(dtype, tf32_default):
    """A model already in the other 16-bit type under autocast to dtype: autocast casts its weights to dtype, and the
    kernel that rounds float32 x runs on them: the output equals the cast-then-kernel call's, and fused_kernel() names
    that kernel."""
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    _, new = _cuda_models(76)
    new = new.to(other)
    x = make_input((2, 16, 21, 77), seed=77, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        kernel = new.fused_kernel(x)
        got = new(x)
    w, b = new.conv.weight.detach().to(dtype), new.conv.bias.detach().to(dtype)
    want = model_new._ext.conv_min_tanh2(x.to(dtype), w, b, 0)
    assert kernel in CAST_INPUT, kernel
    assert _bit_equal(got, want)


def _cast_weights(kind, weight, bias, dtype):
    """float32 weights and bias for the autocast kernels' own rounding: ties (each halfway between two values of
    dtype, scaled to the weights' range), wide (magnitudes 2^-30 .. 2^17: subnormals, flushes, fp16 overflows), and
    one NaN weight."""
    gen = torch.Generator(device="cuda").manual_seed(81)
    if kind == "ties":
        bits = 7 if dtype == torch.bfloat16 else 10
        return _ties(weight.shape, gen, bits) * 2.0 ** -4, _ties(bias.shape, gen, bits) * 2.0 ** -3
    if kind == "wide":
        return _log_uniform(weight.shape, gen, -30, 17), _log_uniform(bias.shape, gen, -30, 17)
    if kind == "nan":
        weight = weight.clone()
        weight[5, 3, 1, 2] = float("nan")
        return weight, bias
    raise ValueError(kind)


@needs_cuda
@pytest.mark.parametrize("kind", ["ties", "wide", "nan"])
@pytest.mark.parametrize("profile", ["H100", "A100"])
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_autocast_kernel_rounds_the_weights_as_the_cast(dtype, profile, kind, tf32_default):
    """The autocast kernel reads the float32 weights and bias and rounds them as autocast's .to(dtype) does (to
    nearest even; fp16 overflows to inf, a NaN stays one): its output equals, bit for bit, the 16-bit kernel's on the
    cast weights and x, on weights where truncation, ties away and ties to even differ."""
    if profile == "H100" and not model_new.fused_kernel_launches("sm90_bf16"):
        pytest.skip("this GPU has no wgmma")
    _, new = _cuda_models(74)
    weight, bias = _cast_weights(kind, new.conv.weight.detach(), new.conv.bias.detach(), dtype)
    with torch.no_grad():
        new.conv.weight.copy_(weight)
        new.conv.bias.copy_(bias)
    x = make_input((2, 16, 21, 77), seed=75, device="cuda")
    with harness.emulated(profile), torch.no_grad():
        with torch.autocast("cuda", dtype=dtype):
            kernel = new.fused_kernel(x)
            got = new(x)
        want = model_new._ext.conv_min_tanh2(x.to(dtype), weight.to(dtype), bias.to(dtype), 0)
    assert kernel in CAST_INPUT, kernel
    assert kind != "nan" or bool(got.isnan().any()), kind
    assert _bit_equal(got, want), f"{kernel} {kind}: {harness.max_abs_error(got.float(), want.float())}"
