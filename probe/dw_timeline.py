"""Per-phase SM cycles of the tensor-core dW kernel (lane 0 of each warp, summed over CTAs), from a stamped copy."""
import os, sys, tempfile, importlib.util, torch
HERE = os.getcwd()
sys.path.insert(0, HERE)
text = open(os.path.join(HERE, "model_new.py")).read()
PH = 8
edits = [
    ('EXTENSION_NAME = "kb25_conv_min_tanh2"\n', 'EXTENSION_NAME = "kb25_conv_min_tanh2_dwprobe"\n', 1),
    ('extern "C" int fused_kernel_smem_bytes(int kernel);\n',
     'extern "C" int fused_kernel_smem_bytes(int kernel);\nextern "C" long long dw_stamp(int i);\n', 2),
    ('"run_fused_kernel", "fused_kernel_smem_bytes", "fused_kernel_launches"]',
     '"run_fused_kernel", "fused_kernel_smem_bytes", "fused_kernel_launches", "dw_stamp"]', 1),
    ("template <class Elem>\n__global__ void __launch_bounds__(GradWeightMma::kThreads, GradWeightMma::kMinBlocks)",
     "__device__ unsigned long long kb25_dw[64];\n"
     'extern "C" long long dw_stamp(int i) {\n'
     "  static unsigned long long host[64];\n"
     "  if (i < 0) { for (auto& h : host) h = 0; return cudaMemcpyToSymbol(kb25_dw, host, sizeof(host)) == cudaSuccess ? 0 : -1; }\n"
     "  if (i == 0 && cudaMemcpyFromSymbol(host, kb25_dw, sizeof(host)) != cudaSuccess) return -1;\n"
     "  return (long long)host[i];\n}\n"
     "template <class Elem>\n__global__ void __launch_bounds__(GradWeightMma::kThreads, GradWeightMma::kMinBlocks)", 1),
    ("  if (begin < end) load_pixel(step);\n  int written = -1;",
     "  if (begin < end) load_pixel(step);\n  int written = -1;\n"
     "  unsigned long long ph[8] = {0,0,0,0,0,0,0,0}; long long tp = clock64();\n"
     "#define KB25_PH(k) { long long nw = clock64(); ph[k] += nw - tp; tp = nw; }", 1),
    ("      }\n    }\n    const int k = k_next;\n",
     "      }\n    }\n    KB25_PH(0)\n    const int k = k_next;\n", 1),
    ("    if (s + 1 < end) load_pixel(following(step));\n    if (threadIdx.x < G::kCols) {",
     "    if (s + 1 < end) load_pixel(following(step));\n    KB25_PH(1)\n    if (threadIdx.x < G::kCols) {", 1),
    ("    const bool walk = __syncthreads_or(bad_slots != 0);\n",
     "    KB25_PH(2)\n    const bool walk = __syncthreads_or(bad_slots != 0);\n    KB25_PH(3)\n", 1),
    ("    __syncthreads();  // the step is done with row oy's slot and the tiles\n",
     "    KB25_PH(4)\n    __syncthreads();  // the step is done with row oy's slot and the tiles\n    KB25_PH(5)\n", 1),
    ("    if (next_continues) store_row(oy + G::kKsize);\n  }\n  // acc[b][j]: rows k",
     "    if (next_continues) store_row(oy + G::kKsize);\n    KB25_PH(6)\n  }\n"
     "  if ((threadIdx.x & 31) == 0) for (int q = 0; q < 8; ++q) atomicAdd(&kb25_dw[(threadIdx.x >> 5) * 8 + q], ph[q]);\n"
     "  if (threadIdx.x == 0) atomicAdd(&kb25_dw[63], (unsigned long long)(end - begin));\n"
     "  // acc[b][j]: rows k", 1),
]
for a, b, c in edits:
    assert text.count(a) == c, (a[:80], text.count(a))
    text = text.replace(a, b)
tmp = tempfile.mkdtemp()
path = os.path.join(tmp, "model_dwprobe.py")
open(path, "w").write(text)
spec = importlib.util.spec_from_file_location("model_dwprobe", path)
m = importlib.util.module_from_spec(spec)
sys.modules["model_dwprobe"] = m
spec.loader.exec_module(m)
import reference
ext = m._ext
for precision, dtype in (("tf32", torch.float32), ("bf16", torch.bfloat16)):
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(5)
    new = reference.Model(16, 64, 3).cuda().to(dtype)
    w, b = new.conv.weight.detach(), new.conv.bias.detach()
    x = torch.rand(128, 16, 256, 256, device="cuda").to(dtype)
    out, argmin, pre_min = m.conv_min_tanh2_with_argmin(x, w, b, 0)
    g = torch.randn_like(out)
    f = lambda: torch.ops.kb25.conv_min_tanh2_backward(g, x, w, argmin, pre_min, False, True, True)
    f(); torch.cuda.synchronize()
    ext.dw_stamp(-1)
    torch.cuda.synchronize()
    f(); torch.cuda.synchronize()
    ext.dw_stamp(0)
    steps = ext.dw_stamp(63)
    print(f"{precision}: steps {steps}; cycles per step per warp by phase (0 top, 1 gm+loads, 2 tiles, 3 sync, 4 mma, 5 endsync, 6 clear+store, 7 -)")
    for wp in range(6):
        vals = [ext.dw_stamp(wp * 8 + k) / steps for k in range(8)]
        print(f"  warp {wp}: " + " ".join(f"{v:7.0f}" for v in vals) + f"  total {sum(vals):7.0f}")
    hist = torch.bincount(argmin.flatten().long(), minlength=64)
    top = hist.topk(8)
    print("  argmin top channels", top.indices.tolist(), (top.values.float() / hist.sum()).tolist())
    del x
