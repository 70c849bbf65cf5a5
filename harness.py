"""Shared by the tests and the benchmark: seeded construction, inputs, truth, comparison, timing."""
import statistics

import torch

import reference

# KernelBench's fp32 tolerance.
ATOL = RTOL = 1e-4
STRICT_ATOL = STRICT_RTOL = 1e-5


def make_models(seed=0, init_inputs=None, device="cpu", **new_kwargs):
    """Model and ModelNew built after the same seed, as KernelBench builds them."""
    import model_new

    init_inputs = list(init_inputs or reference.get_init_inputs())
    torch.manual_seed(seed)
    ref = reference.Model(*init_inputs).to(device)
    torch.manual_seed(seed)
    new = model_new.ModelNew(*init_inputs, **new_kwargs).to(device)
    return ref, new


def make_input(shape=None, seed=0, device="cpu", dtype=torch.float32):
    """torch.rand input like reference.get_inputs(), drawn fresh from `seed` (generated on `device`)."""
    if shape is None:
        shape = (reference.batch_size, reference.in_channels, reference.height, reference.width)
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(shape, generator=gen, device=device, dtype=dtype)


def round_tf32(t):
    """Round float32 values to TF32 (10 mantissa bits), to nearest with ties away: cvt.rna.tf32.f32."""
    bits = t.to(torch.float32).contiguous().view(torch.int32)
    finite = torch.isfinite(t)
    rounded = ((bits + 0x1000) & ~0x1FFF).view(torch.float32)
    return torch.where(finite, rounded, t.to(torch.float32))


def truncate_tf32(t):
    """Drop the 13 low mantissa bits (what a kernel that skips rounding feeds the tensor cores)."""
    bits = t.to(torch.float32).contiguous().view(torch.int32)
    return (bits & ~0x1FFF).view(torch.float32)


def float64_forward(x, weight, bias, operands=None):
    """The model's math in float64; `operands` (round_tf32, truncate_tf32) maps x and weight first."""
    import model_new

    if operands is not None:
        x, weight = operands(x), operands(weight)
    return model_new.torch_forward(x.double(), weight.double(), bias.double())


def wrong_variants():
    """Known-wrong implementations the checks must reject: name -> fn(x, weight, bias)."""
    import torch.nn.functional as F

    def max_instead_of_min(x, w, b):
        return torch.tanh(torch.tanh(torch.max(F.conv2d(x, w, b), dim=1, keepdim=True)[0]))

    def bias_dropped(x, w, b):
        return torch.tanh(torch.tanh(torch.min(F.conv2d(x, w), dim=1, keepdim=True)[0]))

    def one_tanh(x, w, b):
        return torch.tanh(torch.min(F.conv2d(x, w, b), dim=1, keepdim=True)[0])

    def truncated_tf32(x, w, b):
        return float64_forward(x, w, b, operands=truncate_tf32).to(x.dtype)

    return {
        "max_instead_of_min": max_instead_of_min,
        "bias_dropped": bias_dropped,
        "one_tanh": one_tanh,
        "truncated_tf32": truncated_tf32,
    }


def compare(out, ref, atol=ATOL, rtol=RTOL):
    """(ok, max_abs_diff): same shape and dtype, NaN exactly where the reference has NaN, allclose elsewhere."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return False, float("inf")
    out64, ref64 = out.double(), ref.double()
    if not torch.equal(torch.isnan(out64), torch.isnan(ref64)):
        return False, float("nan")
    diff = (out64 - ref64).abs().nan_to_num(nan=0.0)
    max_abs = float(diff.max()) if diff.numel() else 0.0
    return bool(torch.allclose(out64, ref64, atol=atol, rtol=rtol, equal_nan=True)), max_abs


def max_abs_error(out, truth):
    return float((out.double() - truth.double()).abs().max())


def poison_cuda_allocator(nbytes):
    """Fill a freed block of the caching allocator with NaN so that an output it hands out next and a kernel
    forgets to write shows up as NaN."""
    block = torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")
    del block


def l2_flush_buffer(device=None):
    """A buffer at least twice the L2 (and at least 256 MiB); writing it evicts whatever a trial left in L2."""
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 0) or 64 * 2**20
    return torch.empty(max(2 * l2, 256 * 2**20) // 4, dtype=torch.float32, device=device)


def time_cuda(fn, trials=25, warmup=3):
    """Per-trial device times in ms (CUDA events), with an L2 flush before each trial."""
    flush = l2_flush_buffer()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(trials)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(trials)]
    for start, end in zip(starts, ends):
        flush.fill_(1.0)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def summarize(times):
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "trials": len(times)}


# The problem's arithmetic: 2 * M * N * K with M output pixels, N output channels, K = Cin * 3 * 3.
def problem_flops(n, c_in, h, w, c_out=reference.out_channels, k=reference.kernel_size):
    return 2.0 * n * (h - k + 1) * (w - k + 1) * c_out * c_in * k * k
