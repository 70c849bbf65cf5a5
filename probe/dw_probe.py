"""dW kernels: correctness spot checks and timing at N=128 (walker vs tensor cores), reference TF32 dW error."""
import sys, time, torch
sys.path.insert(0, ".")
import harness, model_new, reference

torch.manual_seed(0)
dev = "cuda"
_, new = harness.make_models(5, device=dev)
w, b = new.conv.weight.detach(), new.conv.bias.detach()


def run(n, precision, profile=None, reps=15):
    spec = harness.PRECISIONS[precision]
    torch.backends.cudnn.allow_tf32 = spec.allow_tf32
    x = harness.make_input((n, 16, 256, 256), seed=3, device=dev).to(spec.dtype)
    ww, bb = w.to(spec.dtype), b.to(spec.dtype)
    ctx = harness.emulated(profile) if profile else torch.no_grad()
    with ctx:
        out, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, ww, bb, 0)
        g = torch.randn_like(out)
        f = lambda: torch.ops.kb25.conv_min_tanh2_backward(g, x, ww, argmin, pre_min, False, True, True)
        fx = lambda: torch.ops.kb25.conv_min_tanh2_backward(g, x, ww, argmin, pre_min, True, False, False)
        grads = f()
        torch.cuda.synchronize()
        t = harness.summarize(harness.time_cuda(f, trials=reps))
        tx = harness.summarize(harness.time_cuda(fx, trials=reps))
    return x, ww, argmin, pre_min, g, grads, t, tx

for precision, profile in [("tf32", None), ("tf32", "T4"), ("bf16", None)]:
    try:
        x, ww, argmin, pre_min, g, grads, t, tx = run(128, precision, profile)
        print(f"N=128 {precision:12s} profile={profile}: dW+db {t} ms; dX {tx} ms", flush=True)
    except Exception as e:
        print("FAIL", precision, profile, repr(e)[:500], flush=True)
    del x
    torch.cuda.empty_cache()

# accuracy at N=4: ours (tensor cores, TF32) vs reference cuDNN TF32 vs float64
for precision in ["tf32", "bf16"]:
    spec = harness.PRECISIONS[precision]
    torch.backends.cudnn.allow_tf32 = spec.allow_tf32
    x = harness.make_input((4, 16, 256, 256), seed=7, device=dev).to(spec.dtype)
    ww, bb = w.to(spec.dtype), b.to(spec.dtype)
    out, argmin, pre_min = model_new.conv_min_tanh2_with_argmin(x, ww, bb, 0)
    g = torch.randn_like(out)
    _, dw, db = torch.ops.kb25.conv_min_tanh2_backward(g, x, ww, argmin, pre_min, False, True, True)
    truth = harness.routed_float64_grads(x, ww, argmin, pre_min, g)
    tf = harness.routed_float64_grads(x, ww, argmin, pre_min, g, harness.round_tf32)[1]
    ref = reference.Model(16, 64, 3).to(dev).to(spec.dtype)
    ref.load_state_dict(new.state_dict())
    xr = x.clone()
    ref.zero_grad()
    ref(xr).backward(g)
    t64 = harness.float64_grads(x, ww, bb, g)
    print(f"{precision}: ours dw vs routed64 {harness.relative_error(dw, truth[1]):.2e}, vs tf32-operand "
          f"{harness.relative_error(dw, tf):.2e}; db {harness.relative_error(db, truth[2]):.2e}; reference dw vs "
          f"float64 {harness.relative_error(ref.conv.weight.grad, t64[1]):.2e}, db {harness.relative_error(ref.conv.bias.grad, t64[2]):.2e}",
          flush=True)
