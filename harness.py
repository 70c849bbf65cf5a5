"""Shared by the tests and the benchmark: seeded construction, inputs, truth, comparison, timing."""
import collections
import statistics

import torch

import reference

# KernelBench's fp32 tolerance.
ATOL = RTOL = 1e-4
STRICT_ATOL = STRICT_RTOL = 1e-5
LOW_PRECISION_TOL = 1e-2  # KernelBench's tolerance for bf16 and fp16
# TF32 dW on the tensor cores against the float64 chain on TF32-rounded operands (routed_float64_grads with
# round_tf32): that chain's gm is float64's rounded to float32, the kernel's is computed in float32, and where the two
# differ by an ulp near a TF32 rounding boundary one product moves by 2^-11 (about 1e-5 in all).
TF32_OPERAND_TOL = 5e-5

# The model's precisions, as the tests, the benchmark and the tools name them. allow_tf32: the setting of
# torch.backends.cudnn.allow_tf32; tol: atol = rtol against the reference in that precision; truth_bound: the fused
# kernel's largest error against the float64 truth, in units of the reference's own.
Precision = collections.namedtuple("Precision", "allow_tf32 dtype tol truth_bound")
PRECISIONS = {
    "tf32": Precision(True, torch.float32, ATOL, 1.5),  # PyTorch's default for float32
    "strict_fp32": Precision(False, torch.float32, STRICT_ATOL, 2.0),
    "bf16": Precision(True, torch.bfloat16, LOW_PRECISION_TOL, 1.0),
    "fp16": Precision(True, torch.float16, LOW_PRECISION_TOL, 1.0),
}

# GPUs that model_new.emulate_device() imitates on the GPU at hand: compute capability, and the shared memory one
# block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin, bytes; CUDA programming guide).
DeviceProfile = collections.namedtuple("DeviceProfile", "capability smem_optin")
DEVICE_PROFILES = {
    "T4": DeviceProfile((7, 5), 64 * 1024),
    "A100": DeviceProfile((8, 0), 163 * 1024),
    "A10G": DeviceProfile((8, 6), 99 * 1024),
    "L40S": DeviceProfile((8, 9), 99 * 1024),
    "H100": DeviceProfile((9, 0), 227 * 1024),
    "B200": DeviceProfile((10, 0), 227 * 1024),
    "RTX5090": DeviceProfile((12, 0), 99 * 1024),
}


def emulated(profile):
    """model_new.emulate_device for a DEVICE_PROFILES name."""
    import model_new

    capability, smem_optin = DEVICE_PROFILES[profile]
    return model_new.emulate_device(capability=capability, smem_optin=smem_optin)


# The CUDA cases the tests, tools/sanitize.py, tools/run_once.py, tools/kernel_sweep.py and tools/mutants.py share, by
# key: every CUDA backend in every precision ("<backend>-<precision>": what the backend picks on this GPU), and every
# fused kernel by name ("kernel-<name>": that instantiation, where this GPU can launch it), from model_new's tables.
Case = collections.namedtuple("Case", "key backend precision kernel")


def cases():
    import model_new

    if tuple(PRECISIONS) != model_new.PRECISIONS:  # the kernel table names precisions by model_new's names
        raise ValueError(f"harness.PRECISIONS expects model_new.PRECISIONS {model_new.PRECISIONS}, got "
                         f"{tuple(PRECISIONS)}")
    backends = [b for b in model_new.OP_BACKENDS if b != "auto"]
    out = [Case(f"{b}-{p}", b, p, None) for b in backends for p in PRECISIONS]
    out += [Case(f"kernel-{k.name}", "kernel", k.precision, k.name) for k in model_new.FUSED_TABLE]
    return {c.key: c for c in out}


CASES = cases()


def case_model(case, seed=0):
    """(reference, fn) for a case, both in its precision, on the GPU; fn(x) runs the case's path with grad off (a
    kernel that rounds a float32 x itself gets x in float32, exactly). Sets torch.backends.cudnn.allow_tf32 for the
    precision (the caller restores it)."""
    import model_new

    precision = PRECISIONS[case.precision]
    torch.backends.cudnn.allow_tf32 = precision.allow_tf32
    backend = "auto" if case.backend == "kernel" else case.backend
    ref, new = (m.to(precision.dtype) for m in make_models(seed, device="cuda", backend=backend))
    if case.kernel is None:
        def fn(x):
            with torch.no_grad():
                return new(x)
    else:
        row = model_new.FUSED_TABLE[model_new.FUSED_KERNELS.index(case.kernel)]
        input_dtype = model_new.INPUT_DTYPES[row.input]

        def fn(x):
            with torch.no_grad():
                return model_new.run_fused_kernel(x.to(input_dtype), new.conv.weight, new.conv.bias, case.kernel)
    fn.model = new
    return ref, fn


def make_reference(seed=0, init_inputs=None, device="cpu"):
    """Model built after `seed`, as KernelBench builds it (the parameters are drawn on the CPU, then moved)."""
    torch.manual_seed(seed)
    return reference.Model(*(init_inputs or reference.get_init_inputs())).to(device)


def make_models(seed=0, init_inputs=None, device="cpu", **new_kwargs):
    """Model and ModelNew built after the same seed, as KernelBench builds them."""
    import model_new

    init_inputs = list(init_inputs or reference.get_init_inputs())
    ref = make_reference(seed, init_inputs, device)
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
    """The truth: reference.Model itself, run in float64 with these parameters. `operands` (round_tf32,
    truncate_tf32) maps x and weight first, to emulate what a tensor-core conv feeds its multipliers."""
    if operands is not None:
        x, weight = operands(x), operands(weight)
    c_out, c_in, k = weight.shape[0], weight.shape[1], weight.shape[2]
    model = reference.Model(c_in, c_out, k).to(device=x.device, dtype=torch.float64)
    with torch.no_grad():
        model.conv.weight.copy_(weight)
        model.conv.bias.copy_(bias)
        return model(x.double())


def float64_grads(x, weight, bias, grad_out):
    """The truth's gradients: reference.Model in float64 (inputs and the output's gradient widened), by autograd.
    (x, weight, bias) gradients."""
    c_out, c_in, k = weight.shape[0], weight.shape[1], weight.shape[2]
    model = reference.Model(c_in, c_out, k).to(device=x.device, dtype=torch.float64)
    with torch.no_grad():
        model.conv.weight.copy_(weight)
        model.conv.bias.copy_(bias)
    x64 = x.detach().double().requires_grad_(True)
    model(x64).backward(grad_out.double())
    return x64.grad, model.conv.weight.grad, model.conv.bias.grad


def routed_float64_grads(x, weight, argmin, pre_min, grad_out, weight_operands=None):
    """The reference's backward chain in float64 through a given argmin and pre-tanh min (one per output pixel, as
    the fused forward saves them): model_new.backward_through_argmin on widened tensors. (x, weight, bias).
    `weight_operands` (round_tf32): the weight gradient's products on operands so mapped, x and the gradient at the
    argmin (that one in float32 first), as a TF32 weight-gradient conv multiplies them; the sums in float64."""
    import model_new

    grads = model_new.backward_through_argmin(grad_out.double(), x.double(), weight.double(), argmin.long(),
                                              pre_min.double(), [True, True, True])
    if weight_operands is None:
        return grads
    t1 = torch.tanh(pre_min.double())
    grad_m = torch.ops.aten.tanh_backward(torch.ops.aten.tanh_backward(grad_out.double(), torch.tanh(t1)), t1)
    grad_m = weight_operands(grad_m.float()).double()
    grad_y = grad_m.new_zeros(grad_m.shape[0], weight.shape[0], *grad_m.shape[2:]).scatter_(1, argmin.long(), grad_m)
    dw = torch.ops.aten.convolution_backward(grad_y, weight_operands(x.float()).double(), weight.double(),
                                             [weight.shape[0]], [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                             [False, True, False])[1]
    return grads[0], dw, grads[2]


def relative_error(got, truth):
    """||got - truth|| / ||truth|| in float64 over the finite entries of truth; inf where the NaN patterns differ or
    an infinite entry of truth is not the same infinity in got."""
    got, truth = got.double(), truth.double()
    infinite = torch.isinf(truth)
    if not torch.equal(torch.isnan(got), torch.isnan(truth)) or not torch.equal(got[infinite], truth[infinite]):
        return float("inf")
    finite = torch.isfinite(truth)
    diff = (got[finite] - truth[finite]).norm().item()
    scale = truth[finite].norm().item()
    return diff / scale if scale > 0 else diff


def coherent_tf32_rounding_case(seed, shape=(2, 16, 24, 24), c_out=64, k=3):
    """(x, weight, bias) on which TF32 operand rounding errors add up instead of cancelling: every x of input
    channel c sits 0.45 of a TF32 step from a TF32 value, on the side given by s_c = +-1, and every weight of that
    channel has sign s_c. Round-to-nearest then moves each product w*x by -|w| * 0.45 step, the same sign for all
    144 products of an output, about 1.6e-3 in all: exact fp32 lands far outside 1e-4 of a TF32 conv, on every seed.
    Magnitudes are random; the conv sums stay near 0, where tanh(tanh()) passes errors on almost unchanged."""
    gen = torch.Generator().manual_seed(seed)
    n, c_in, h, w = shape
    sign = torch.where(torch.arange(c_in) % 2 == 0, 1.0, -1.0)
    step = 2.0**-11  # TF32 step (10 mantissa bits) for values in [0.5, 1)
    grid = 0.5 + torch.randint(1, 1023, (n, c_in, h, w), generator=gen) * step
    x = (grid + sign.view(1, c_in, 1, 1) * 0.45 * step).float()
    magnitude = 0.02 + 0.06 * torch.rand((c_out, c_in, k, k), generator=gen)
    weight = (magnitude * sign.view(1, c_in, 1, 1)).float()
    bias = (0.1 * torch.rand(c_out, generator=gen) - 0.05).float()
    return x, weight, bias


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


def l2_flush_buffer(device="cuda"):
    """A buffer on the GPU, at least twice its L2 (and at least 256 MiB); writing it evicts whatever a trial left in
    L2. It must live on the device: a host buffer leaves L2 as it was and makes the GPU idle while the CPU fills it,
    so the trial that follows starts on an idle GPU and pays the host's launch latency."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"l2_flush_buffer: expected a CUDA device, got {device}")
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 0) or 64 * 2**20
    return torch.empty(max(2 * l2, 256 * 2**20) // 4, dtype=torch.float32, device=device)


def host_us_per_call(fn, calls=100, bursts=50):
    """Host (CPU) microseconds per call of an asynchronous GPU function: each burst of `calls` launches is timed on
    the host clock with no synchronisation inside it (the GPU drains the queue in between), median over bursts.
    The launch queue holds about a thousand launches, so a burst never blocks on the GPU."""
    import time

    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(bursts):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def measure_host_us(model):
    """Host microseconds per call, tiny input, grad disabled: ModelNew(x), the op's CUDA kernel called directly,
    the same op through the dispatcher (torch.ops, as compiled graphs call it), and a baseline torch op."""
    import model_new

    x = make_input((1, 16, 8, 8), device="cuda")
    w, b = model.conv.weight.detach(), model.conv.bias.detach()
    code = model_new.OP_BACKENDS.index("auto")
    calls = {
        "model_new": lambda: model(x),
        "extension_call": lambda: model_new._ext.conv_min_tanh2(x, w, b, code),
        "op_call": lambda: model_new.conv_min_tanh2(x, w, b, code),
        # the machine's own cost of one tiny torch op (allocate the output, launch one kernel): host speed varies
        # between machines by tens of percent, so read the rows above against this one
        "torch_relu_baseline": lambda: torch.relu(x),
    }
    with torch.no_grad():
        return {name: host_us_per_call(fn) for name, fn in calls.items()}


# The fused backward op's (need dX, need dW, need db) for each part a training step's kernels time on its own.
BACKWARD_PARTS = {"grad_weight": (False, True, True), "grad_input": (True, False, False)}


def time_cuda(fn, trials=25, warmup=3, before=None):
    """Per-trial device times in ms (CUDA events), with an L2 flush (a GPU write of a buffer twice the L2) queued
    before each trial; `before` replaces that flush with another untimed step."""
    return time_cuda_rounds({"fn": fn}, trials=trials, warmup=warmup, rounds=1, before=before)["fn"]


def round_order(names, trials, rounds):
    """The order in which time_cuda_rounds times its callables: `rounds` rounds, each taking every name in turn for
    its share of the trials (the shares differ by at most one), forward in even rounds and backward in odd ones, so
    that each name sits as early and as late as any other on average. A list of (name, trials in a row)."""
    names = list(names)
    rounds = max(1, min(rounds, trials))
    order = []
    for r in range(rounds):
        share = trials // rounds + (r < trials % rounds)
        order += [(name, share) for name in (names if r % 2 == 0 else names[::-1])]
    return order


def time_cuda_rounds(fns, trials=25, warmup=3, rounds=5, before=None):
    """time_cuda for several callables whose times are compared with each other ({name: fn} -> {name: per-trial
    ms}): their trials interleaved in rounds (round_order) instead of one callable's after another's. The GPU's clock
    drifts over a run (a row timed after a block of heavy kernels reads several percent slower than the same kernel
    timed earlier), and interleaving gives every callable the same share of each stretch. `before` as time_cuda's."""
    if before is None:
        flush = l2_flush_buffer()
        before = lambda: flush.fill_(1.0)  # noqa: E731
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    events = []
    for name, count in round_order(fns, trials, rounds):
        for _ in range(count):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before()
            start.record()
            fns[name]()
            end.record()
            events.append((name, start, end))
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for name, start, end in events:
        times[name].append(start.elapsed_time(end))
    return times


def summarize(times):
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "trials": len(times)}


# The problem's arithmetic: 2 * M * N * K with M output pixels, N output channels, K = Cin * 3 * 3.
def problem_flops(n, c_in, h, w, c_out=reference.out_channels, k=reference.kernel_size):
    return 2.0 * n * (h - k + 1) * (w - k + 1) * c_out * c_in * k * k
