// ModelNew's kernels alone, without torch: each forward and backward kernel the extension launches, on inputs made
// here, timed with CUDA events (an L2 flush before each trial), with a checksum of what it wrote. Built by
// tools/kernels_alone.py on the CUDA source of a model_new.py (KB25_KERNELS_SOURCE, included first), with the
// extension's nvcc flags, so that the machine code it times is that file's; two builds compare kernel variants in
// seconds of GPU time, where loading each variant as an extension builds it first.
//
//   kernels_alone [--trials T] [--shape N,H,W] [--only SUBSTRING] [--profile SM,SMEM_OPTIN] [--params spread]
//
// One line a case: "<case> <kernel> <median ms> <min ms> <checksum>". The cases: for each precision, the inference
// forward, the saving forward, dX and dW + db (the latter two from the saving forward's argmin and minima, with g
// uniform in [0, 1)); the autocast kernels' forward. Inputs: x uniform in [0, 1) as torch.rand; the benchmark's
// weight and bias (KB25_PARAMS, written by the build from reference.Model's seeded init), since the argmins, and so
// the backward kernels' times, depend on them (rounded to nearest even for 16-bit cases, as .to(dtype) rounds).
// Their argmins are 98% one channel (1.4 distinct channels a 32-pixel row segment); `--params spread` draws another
// weight and bias uniform in +-1/12, as Conv2d's init does, whose argmins spread over 38 channels (6.6 a segment),
// as other seeds' draws do.
#include KB25_KERNELS_SOURCE
#include KB25_PARAMS

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "kernels_alone: %s failed: %s\n", what, cudaGetErrorString(err));
  std::exit(1);
}

__device__ uint32_t mix32(uint64_t v) {
  v ^= v >> 33;
  v *= 0xff51afd7ed558ccdull;
  v ^= v >> 33;
  v *= 0xc4ceb9fe1a85ec53ull;
  return (uint32_t)(v ^ (v >> 33));
}

template <class T>
__device__ T from_float(float v);
template <>
__device__ float from_float<float>(float v) { return v; }
template <>
__device__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// p[i] = lo + (hi - lo) * u, u uniform in [0, 1) on a 2^-24 grid, from a hash of (seed, i).
template <class T>
__global__ void fill_uniform(T* p, int64_t n, uint32_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float u = (mix32(((uint64_t)seed << 40) ^ (uint64_t)i) >> 8) * (1.f / 16777216.f);
    p[i] = from_float<T>(lo + (hi - lo) * u);
  }
}

// p[i] = the float32 with bit pattern bits[i], in T.
template <class T>
__global__ void fill_bits(T* p, const unsigned* bits, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    p[i] = from_float<T>(__uint_as_float(bits[i]));
  }
}

// A checksum of n bytes: the sum of a hash of each (byte, position). Integer sums do not depend on the order in which
// the threads add them, so the checksum is the same from run to run for the same bytes.
__global__ void checksum_bytes(const unsigned char* p, int64_t n, unsigned long long* sum) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    local += mix32(((uint64_t)i << 8) | p[i]);
  }
  atomicAdd(sum, local);
}

struct Buffer {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Buffer(size_t n) : bytes(n) { check(cudaMalloc(&p, n > 0 ? n : 1), "cudaMalloc"); }
  ~Buffer() { cudaFree(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

size_t elem_bytes(int elem) { return elem == kb25::kElemFloat32 ? 4 : 2; }

void fill(const Buffer& b, int elem, uint32_t seed, float lo, float hi) {
  const int64_t n = (int64_t)(b.bytes / elem_bytes(elem));
  switch (elem) {
    case kb25::kElemFloat32: fill_uniform<<<1024, 256>>>(b.as<float>(), n, seed, lo, hi); break;
    case kb25::kElemFloat16: fill_uniform<<<1024, 256>>>(b.as<__half>(), n, seed, lo, hi); break;
    default: fill_uniform<<<1024, 256>>>(b.as<__nv_bfloat16>(), n, seed, lo, hi); break;
  }
  check(cudaGetLastError(), "fill");
}

// w and b: the benchmark's parameters (the weight's 64 x 16 x 3 x 3 values, then the bias's 64), in T.
template <class T>
void fill_params_as(const Buffer& w, const Buffer& b) {
  constexpr int64_t kWeights = 64 * 16 * 9;
  static_assert(sizeof(kBenchmarkParams) == (kWeights + 64) * sizeof(unsigned), "the weight's values, then the bias's");
  Buffer bits(sizeof(kBenchmarkParams));
  check(cudaMemcpy(bits.p, kBenchmarkParams, bits.bytes, cudaMemcpyHostToDevice), "the parameters");
  fill_bits<<<64, 256>>>(w.as<T>(), bits.as<unsigned>(), kWeights);
  fill_bits<<<1, 64>>>(b.as<T>(), bits.as<unsigned>() + kWeights, 64);
  check(cudaDeviceSynchronize(), "fill the parameters");
}

void fill_params(const Buffer& w, const Buffer& b, int elem) {
  switch (elem) {
    case kb25::kElemFloat32: fill_params_as<float>(w, b); break;
    case kb25::kElemFloat16: fill_params_as<__half>(w, b); break;
    default: fill_params_as<__nv_bfloat16>(w, b); break;
  }
}

unsigned long long checksum(const std::vector<const Buffer*>& buffers) {
  Buffer sum(sizeof(unsigned long long));
  unsigned long long total = 0;
  for (const Buffer* b : buffers) {
    check(cudaMemset(sum.p, 0, sizeof(unsigned long long)), "cudaMemset");
    checksum_bytes<<<1024, 256>>>(b->as<unsigned char>(), (int64_t)b->bytes, sum.as<unsigned long long>());
    unsigned long long part = 0;
    check(cudaMemcpy(&part, sum.p, sizeof(part), cudaMemcpyDeviceToHost), "checksum");
    total = total * 1000003ull + part;
  }
  return total;
}

struct Options {
  int trials = 25;
  int64_t N = 128;
  int H = 256, W = 256;
  std::string only;
  bool spread = false;  // --params spread: weight and bias from fill(), not the benchmark's
  bool profile_given = false;
  kb25::DeviceProfile profile{};
};

// harness.l2_flush_buffer's size: twice the GPU's L2, and at least 256 MiB.
size_t flush_bytes() {
  int device = 0, l2 = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device), "cudaDeviceGetAttribute");
  return std::max<size_t>(2 * (size_t)l2, 256u << 20);
}

struct Timer {
  const Options& opt;
  Buffer flush{flush_bytes()};
  cudaEvent_t start, stop;
  explicit Timer(const Options& o) : opt(o) {
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
  }
  // Median and least of opt.trials timed calls of `run` (three untimed first), each after an L2 flush.
  template <class F>
  std::pair<float, float> time(F&& run) {
    std::vector<float> ms;
    for (int t = 0; t < opt.trials + 3; ++t) {
      check(cudaMemsetAsync(flush.p, t & 0xff, flush.bytes), "flush");
      check(cudaEventRecord(start), "cudaEventRecord");
      run();
      check(cudaEventRecord(stop), "cudaEventRecord");
      check(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float v = 0.f;
      check(cudaEventElapsedTime(&v, start, stop), "cudaEventElapsedTime");
      if (t >= 3) ms.push_back(v);
    }
    std::sort(ms.begin(), ms.end());
    return {ms[ms.size() / 2], ms[0]};
  }
};

void report(const char* name, const char* kernel, std::pair<float, float> ms, unsigned long long sum) {
  std::printf("%-22s %-26s %.4f %.4f %016llx\n", name, kernel, ms.first, ms.second, sum);
  std::fflush(stdout);
}

bool wanted(const Options& opt, const std::string& name) {
  return opt.only.empty() || name.find(opt.only) != std::string::npos;
}

// One precision's forward kernels (inference and saving) and, where `train`, its backward kernels.
void run_precision(const Options& opt, Timer& timer, const char* label, int precision, int x_elem, bool train) {
  const std::string base = label;
  const bool want_forward = wanted(opt, base + "/forward"), want_saving = train && wanted(opt, base + "/saving");
  const bool want_dx = train && wanted(opt, base + "/grad_input");
  const bool want_dw = train && wanted(opt, base + "/grad_weight");
  if (!(want_forward || want_saving || want_dx || want_dw)) return;
  int sms = 0, device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  const int kernel = choose_fused_kernel(precision, x_elem, opt.profile, false);
  if (kernel < 0) {
    std::printf("%-22s none on this profile\n", (base + "/forward").c_str());
    return;
  }
  const int guard_kernel = choose_guard_kernel(kernel, opt.profile);
  const char* name = kb25::kFusedKernelNames[kernel];
  const int out_elem = precision == kb25::kPrecisionBf16   ? kb25::kElemBfloat16
                       : precision == kb25::kPrecisionFp16 ? kb25::kElemFloat16
                                                           : kb25::kElemFloat32;
  const int64_t N = opt.N, pixels = N * (opt.H - 2) * (int64_t)(opt.W - 2);
  const size_t xb = elem_bytes(x_elem);
  Buffer x(N * 16 * (size_t)opt.H * opt.W * xb), w(64 * 16 * 9 * xb), b(64 * xb);
  fill(x, x_elem, 1, 0.f, 1.f);
  if (opt.spread) {
    fill(w, x_elem, 2, -1.f / 12, 1.f / 12);
    fill(b, x_elem, 3, -1.f / 12, 1.f / 12);
  } else {
    fill_params(w, b, x_elem);
  }
  Buffer out(pixels * elem_bytes(out_elem)), argmin(pixels), pre_min(pixels * 4), guard((1 + 2 * N) * 4);
  const bool guarded = kb25::kFusedKernelGuarded[kernel];
  const auto forward = [&](bool save) {
    if (guarded) check(cudaMemsetAsync(guard.p, 0, guard.bytes), "guard memset");
    const auto launch = [&](int k) {
      check(launch_fused_conv3x3_min_tanh2(k, x.p, w.p, b.p, out.p, save ? argmin.p : nullptr,
                                           save ? pre_min.as<float>() : nullptr, guarded ? guard.as<int>() : nullptr,
                                           N, opt.H, opt.W, sms, 0),
            "the fused kernel");
    };
    launch(kernel);
    if (guarded && guard_kernel >= 0) launch(guard_kernel);
    if (save && precision == kb25::kPrecisionStrictFp32) {
      check(launch_conv3x3_min_refine(x.as<float>(), w.as<float>(), b.as<float>(), argmin.as<unsigned char>(),
                                      pre_min.as<float>(), N, opt.H, opt.W, sms, 0),
            "the strict minima's kernel");
    }
  };
  check(cudaMemset(out.p, 0xff, out.bytes), "poison");
  if (want_forward) {
    const auto ms = timer.time([&] { forward(false); });
    report((base + "/forward").c_str(), name, ms, checksum({&out}));
  }
  if (!(want_saving || want_dx || want_dw)) return;
  check(cudaMemset(argmin.p, 0xff, argmin.bytes), "poison");
  forward(true);
  check(cudaDeviceSynchronize(), "the saving forward");
  if (want_saving) {
    const auto ms = timer.time([&] { forward(true); });
    report((base + "/saving").c_str(), name, ms, checksum({&out, &argmin, &pre_min}));
  }
  Buffer g(pixels * xb);
  fill(g, x_elem, 4, 0.f, 1.f);
  if (want_dx) {
    Buffer dx(x.bytes);
    check(cudaMemset(dx.p, 0xff, dx.bytes), "poison");
    const auto ms = timer.time([&] {
      check(launch_conv3x3_min_tanh2_grad_input(x_elem, g.p, pre_min.as<float>(), argmin.as<unsigned char>(), w.p,
                                                dx.p, N, opt.H, opt.W, sms, 0),
            "dX");
    });
    report((base + "/grad_input").c_str(), "grad_input", ms, checksum({&dx}));
  }
  if (want_dw) {
    const bool tensor_cores = opt.profile.sm >= 80 && precision != kb25::kPrecisionStrictFp32;
    const int dw_kernel = choose_grad_weight_kernel(tensor_cores, opt.profile.smem_optin);
    int blocks = 0;
    check(conv3x3_min_tanh2_grad_weight_blocks(x_elem, N, opt.H, opt.W, sms, dw_kernel, &blocks), "dW's blocks");
    Buffer partial((size_t)blocks * conv3x3_min_tanh2_grad_weight_partial_floats() * 4), dw(w.bytes), db(b.bytes);
    const auto ms = timer.time([&] {
      check(launch_conv3x3_min_tanh2_grad_weight(x_elem, dw_kernel, x.p, g.p, pre_min.as<float>(),
                                                 argmin.as<unsigned char>(), partial.as<float>(), blocks, dw.p, db.p,
                                                 N, opt.H, opt.W, 0),
            "dW");
    });
    static const char* const kKinds[] = {"grad_weight/walkers", "grad_weight/fed", "grad_weight/fed_built_b"};
    report((base + "/grad_weight").c_str(), kKinds[dw_kernel], ms, checksum({&dw, &db}));
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    long long n = 0;
    int h = 0, w = 0, sm = 0, smem = 0;
    if (a == "--trials" && v && std::sscanf(v, "%d", &opt.trials) == 1 && opt.trials > 0) {
      ++i;
    } else if (a == "--shape" && v && std::sscanf(v, "%lld,%d,%d", &n, &h, &w) == 3 && n > 0 && h >= 3 && w >= 3) {
      opt.N = n, opt.H = h, opt.W = w, ++i;
    } else if (a == "--only" && v) {
      opt.only = v, ++i;
    } else if (a == "--profile" && v && std::sscanf(v, "%d,%d", &sm, &smem) == 2) {
      opt.profile_given = true, opt.profile.sm = sm, opt.profile.smem_optin = smem, ++i;
    } else if (a == "--params" && v && std::string(v) == "spread") {
      opt.spread = true, ++i;
    } else {
      std::fprintf(stderr,
                   "kernels_alone: expected --trials T (T > 0), --shape N,H,W (N > 0, H and W >= 3), --only SUBSTRING, "
                   "--profile SM,SMEM_OPTIN or --params spread, got %s\n",
                   a.c_str());
      return 2;
    }
  }
  int device = 0;
  cudaDeviceProp props;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaGetDeviceProperties(&props, device), "cudaGetDeviceProperties");
  const kb25::DeviceProfile real{props.major * 10 + props.minor, (int)props.sharedMemPerBlockOptin, false};
  if (!opt.profile_given) opt.profile = real;
#ifdef KB25_BUILT_FOR_SM90A
  opt.profile.wgmma_built = opt.profile.sm == 90 && real.sm == 90;
#endif
  std::printf("# %s, profile sm_%d with %d bytes of shared memory per block%s; shape %lld,%d,%d; %s parameters; "
              "%d trials\n",
              props.name, opt.profile.sm, opt.profile.smem_optin, opt.profile.wgmma_built ? " and wgmma" : "",
              (long long)opt.N, opt.H, opt.W, opt.spread ? "spread" : "the benchmark's", opt.trials);
  Timer timer(opt);
  run_precision(opt, timer, "tf32", kb25::kPrecisionTf32, kb25::kElemFloat32, true);
  run_precision(opt, timer, "strict", kb25::kPrecisionStrictFp32, kb25::kElemFloat32, true);
  run_precision(opt, timer, "bf16", kb25::kPrecisionBf16, kb25::kElemBfloat16, true);
  run_precision(opt, timer, "fp16", kb25::kPrecisionFp16, kb25::kElemFloat16, true);
  run_precision(opt, timer, "autocast_bf16", kb25::kPrecisionBf16, kb25::kElemFloat32, false);
  run_precision(opt, timer, "autocast_fp16", kb25::kPrecisionFp16, kb25::kElemFloat32, false);
  check(cudaDeviceSynchronize(), "the last kernel");
  return 0;
}
