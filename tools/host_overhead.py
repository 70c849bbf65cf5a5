"""Host time per ModelNew call (tiny input, so the GPU work is negligible): what a timed forward pays on the CPU."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import harness  # noqa: E402
import model_new  # noqa: E402

_, new = harness.make_models(0, device="cuda")
x = harness.make_input((1, 16, 8, 8), device="cuda")
w, b = new.conv.weight.detach(), new.conv.bias.detach()
calls = {
    "ModelNew(x), no_grad": lambda: new(x),
    "extension call only": lambda: model_new._ext.conv3x3_min_tanh2_tf32(x, w, b, "auto"),
}
with torch.no_grad():
    for name, fn in calls.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000):
            fn()
        torch.cuda.synchronize()
        print(f"{name:24s} {(time.perf_counter() - t) / 2000 * 1e6:6.1f} us per call", flush=True)
