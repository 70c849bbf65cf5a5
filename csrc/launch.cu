// The CUDA translation unit (no torch headers: plain nvcc compiles it): the kernels, and their launchers on raw
// pointers and the current stream, declared in generated/config.h for the C++ op.
#include <atomic>
#include <mutex>

#include "backward.cuh"
#include "grad_weight_fed.cuh"
#include "fused_kernel.cuh"
#include "min_epilogue.cuh"

// Launchers: raw pointers, the current stream.

namespace kb25 {
// What a fused kernel needs of a GPU, from its traits: can_implement() says no before anything launches.
struct FusedRequirements {
  int min_sm;  // major * 10 + minor
  bool wgmma;  // sm_90 exactly, code built for sm_90a
  int smem_bytes;
};
template <class Traits>
constexpr FusedRequirements requirements_of() {
  return {Traits::kUsesWgmma ? 90 : 80, Traits::kUsesWgmma, Traits::kSmemBytes};
}
}  // namespace kb25

// Whether a GPU described by `device` can launch it: the arch, the MMA, and the shared memory a block may opt in to.
static bool can_implement(const kb25::FusedRequirements& r, const kb25::DeviceProfile& device) {
  if (r.wgmma && !(device.sm == 90 && device.wgmma_built)) return false;
  return device.sm >= r.min_sm && r.smem_bytes <= device.smem_optin;
}

// Opting in to more than 48 KB of shared memory is per device and sticks: once per device and kernel, by the first
// thread that launches it there (the others wait at the mutex); a failed opt-in is tried again next time.
template <auto kKernel>
static cudaError_t opt_in_shared_memory(int bytes) {
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> opted_in[kMaxDevices];
  static std::mutex opt_in_mutex;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  auto opt_in = [&] { return cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes); };
  if (device >= kMaxDevices) return opt_in();
  if (!opted_in[device].load(std::memory_order_acquire)) {
    const std::lock_guard<std::mutex> lock(opt_in_mutex);
    if (!opted_in[device].load(std::memory_order_relaxed)) {
      err = opt_in();
      if (err == cudaSuccess) opted_in[device].store(true, std::memory_order_release);
    }
  }
  return err;
}

// How many CTAs of a kernel fit on one SM at once (its shared memory opted in first): asked once per device.
template <auto kKernel>
static cudaError_t resident_ctas_per_sm(int threads, int smem_bytes, int* per_sm) {
  cudaError_t err = opt_in_shared_memory<kKernel>(smem_bytes);
  if (err != cudaSuccess) return err;
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices];  // 0: not asked yet
  int device = 0;
  err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < kMaxDevices && (*per_sm = known[device].load(std::memory_order_relaxed)) > 0) return cudaSuccess;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kKernel, threads, smem_bytes);
  if (err != cudaSuccess) return err;
  if (*per_sm < 1) *per_sm = 1;
  if (device < kMaxDevices) known[device].store(*per_sm, std::memory_order_relaxed);
  return cudaSuccess;
}

template <class Traits, bool kSave>
static cudaError_t launch_fused_variant(const void* x, const void* w, const void* b, void* out, void* argmin,
                                        float* pre_min, int* guard, int64_t N, int H, int W, int num_sms,
                                        cudaStream_t stream) {
  using Elem = typename Traits::Elem;
  using XElem = typename Traits::XElem;
  using ParamElem = typename Traits::ParamElem;
  const int OH = H - (Traits::kKsize - 1), OW = W - (Traits::kKsize - 1);
  const int64_t steps = N * Traits::col_blocks(OW) * OH;
  if (steps <= 0) return cudaSuccess;
  constexpr auto kernel = kb25::conv3x3_min_tanh2_kernel<Traits, kSave>;
  const cudaError_t err = opt_in_shared_memory<kernel>(Traits::kSmemBytes);
  if (err != cudaSuccess) return err;
  const int grid = (int)(steps < num_sms ? steps : num_sms);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(
      static_cast<const XElem*>(x), static_cast<const ParamElem*>(w), static_cast<const ParamElem*>(b),
      static_cast<Elem*>(out),
      static_cast<unsigned char*>(argmin), pre_min, H, W, steps, guard);
  return cudaGetLastError();
}

// argmin and pre_min both null: the inference variant; both set: the one that saves them for the backward.
template <class Traits>
static cudaError_t launch_fused(const void* x, const void* w, const void* b, void* out, void* argmin, float* pre_min,
                                int* guard, int64_t N, int H, int W, int num_sms, cudaStream_t stream) {
  if ((argmin == nullptr) != (pre_min == nullptr)) return cudaErrorInvalidValue;
  return argmin ? launch_fused_variant<Traits, true>(x, w, b, out, argmin, pre_min, guard, N, H, W, num_sms, stream)
                : launch_fused_variant<Traits, false>(x, w, b, out, argmin, pre_min, guard, N, H, W, num_sms, stream);
}

// The table's kernels (generated/fused_table.cuh), in its order: what each needs of a GPU, and its launcher.
static constexpr kb25::FusedRequirements kFusedRequirements[] = {
#define KB25_REQUIREMENTS(Traits) kb25::requirements_of<kb25::Traits>(),
    KB25_FUSED_KERNELS(KB25_REQUIREMENTS)
#undef KB25_REQUIREMENTS
};
using FusedLauncher = cudaError_t (*)(const void*, const void*, const void*, void*, void*, float*, int*, int64_t, int,
                                      int, int, cudaStream_t);
static constexpr FusedLauncher kFusedLaunchers[] = {
#define KB25_LAUNCHER(Traits) launch_fused<kb25::Traits>,
    KB25_FUSED_KERNELS(KB25_LAUNCHER)
#undef KB25_LAUNCHER
};
static_assert(sizeof(kFusedLaunchers) / sizeof(kFusedLaunchers[0]) == kb25::kFusedKernelCount, "one per kernel");

// The first kernel of the table for this precision and input that the GPU can launch, and, where it is guarded, whose
// guard it can launch too (an emulated sm_90 with less shared memory than the guard needs takes the next row).
extern "C" int choose_fused_kernel(int precision, int input, kb25::DeviceProfile device, bool mma_sync_only) {
  for (int k = 0; k < kb25::kFusedKernelCount; ++k) {
    if (kb25::kFusedKernelPrecision[k] != precision || kb25::kFusedKernelInput[k] != input ||
        (mma_sync_only && kFusedRequirements[k].wgmma))
      continue;
    if (can_implement(kFusedRequirements[k], device) &&
        (!kb25::kFusedKernelGuarded[k] || choose_guard_kernel(k, device) >= 0))
      return k;
  }
  return -1;
}

// A guarded kernel's guard: the first kernel of the table that recomputes listed images, with the same precision and
// MMA, that the GPU can launch.
extern "C" int choose_guard_kernel(int kernel, kb25::DeviceProfile device) {
  if (kernel < 0 || kernel >= kb25::kFusedKernelCount || !kb25::kFusedKernelGuarded[kernel]) return -1;
  for (int k = 0; k < kb25::kFusedKernelCount; ++k) {
    if (kb25::kFusedKernelGuards[k] && kb25::kFusedKernelPrecision[k] == kb25::kFusedKernelPrecision[kernel] &&
        kFusedRequirements[k].wgmma == kFusedRequirements[kernel].wgmma && can_implement(kFusedRequirements[k], device))
      return k;
  }
  return -1;
}

extern "C" bool fused_kernel_fits(int kernel, kb25::DeviceProfile device) {
  return kernel >= 0 && kernel < kb25::kFusedKernelCount && can_implement(kFusedRequirements[kernel], device);
}

extern "C" int fused_kernel_smem_bytes(int kernel) {
  return kernel >= 0 && kernel < kb25::kFusedKernelCount ? kFusedRequirements[kernel].smem_bytes : -1;
}

extern "C" cudaError_t launch_fused_conv3x3_min_tanh2(int kernel, const void* x, const void* w, const void* b,
                                                      void* out, void* argmin, float* pre_min, int* guard, int64_t N,
                                                      int H, int W, int num_sms, cudaStream_t stream) {
  if (kernel < 0 || kernel >= kb25::kFusedKernelCount) return cudaErrorInvalidValue;
  return kFusedLaunchers[kernel](x, w, b, out, argmin, pre_min, guard, N, H, W, num_sms, stream);
}

template <class Elem>
static cudaError_t launch_min_dim1_tanh2_typed(const void* y_, void* out_, int64_t outer, int64_t reduce,
                                               int64_t inner, int num_sms, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(Elem);
  const Elem* y = static_cast<const Elem*>(y_);
  Elem* out = static_cast<Elem*>(out_);
  const bool vec = (inner % kVec == 0) && ((reinterpret_cast<uintptr_t>(y) & 15) == 0) &&
                   ((reinterpret_cast<uintptr_t>(out) & 15) == 0);
  const int64_t work = outer * (vec ? inner / kVec : inner);
  if (work <= 0 || reduce <= 0) return cudaSuccess;
  const int threads = 256;
  const int64_t wanted = (work + threads - 1) / threads;
  const int64_t cap = (int64_t)num_sms * 16;
  const int grid = (int)(wanted < cap ? wanted : cap);
  if (vec) {
    kb25::min_dim1_tanh2_kernel<Elem, kVec><<<grid, threads, 0, stream>>>(y, out, outer, reduce, inner);
  } else {
    kb25::min_dim1_tanh2_kernel<Elem, 1><<<grid, threads, 0, stream>>>(y, out, outer, reduce, inner);
  }
  return cudaGetLastError();
}

extern "C" cudaError_t launch_min_dim1_tanh2(int elem, const void* y, void* out, int64_t outer, int64_t reduce,
                                             int64_t inner, int num_sms, cudaStream_t stream) {
  switch (elem) {
    case kb25::kElemFloat32:
      return launch_min_dim1_tanh2_typed<float>(y, out, outer, reduce, inner, num_sms, stream);
    case kb25::kElemFloat64:
      return launch_min_dim1_tanh2_typed<double>(y, out, outer, reduce, inner, num_sms, stream);
    case kb25::kElemFloat16:
      return launch_min_dim1_tanh2_typed<__half>(y, out, outer, reduce, inner, num_sms, stream);
    case kb25::kElemBfloat16:
      return launch_min_dim1_tanh2_typed<__nv_bfloat16>(y, out, outer, reduce, inner, num_sms, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// The backward's launchers, for float32, bfloat16 and float16 (the fused precisions).
template <template <class> class Launch, class... Args>
static cudaError_t by_elem(int elem, Args... args) {
  switch (elem) {
    case kb25::kElemFloat32: return Launch<float>::run(args...);
    case kb25::kElemFloat16: return Launch<__half>::run(args...);
    case kb25::kElemBfloat16: return Launch<__nv_bfloat16>::run(args...);
    default: return cudaErrorInvalidValue;
  }
}

extern "C" cudaError_t launch_conv3x3_min_refine(const float* x, const float* w, const float* b,
                                                 const unsigned char* argmin, float* pre_min, int64_t N, int H, int W,
                                                 int num_sms, cudaStream_t stream) {
  const int64_t pixels = N * (H - (KB25_FUSED_KSIZE - 1)) * (int64_t)(W - (KB25_FUSED_KSIZE - 1));
  if (pixels <= 0) return cudaSuccess;
  const int64_t blocks = (pixels + 255) / 256, cap = 8 * (int64_t)num_sms;
  kb25::conv3x3_min_refine_kernel<<<(int)(blocks < cap ? blocks : cap), 256, 0, stream>>>(x, w, b, argmin, pre_min, N,
                                                                                          H, W);
  return cudaGetLastError();
}

template <class Elem>
struct LaunchGradInput {
  static cudaError_t run(const void* g, const float* pre_min, const unsigned char* argmin, const void* w, void* dx,
                         int64_t N, int H, int W, int num_sms, cudaStream_t stream) {
    using G = kb25::GradInput;
    const int64_t steps = N * H * ((W + G::kCols - 1) / G::kCols);
    if (steps <= 0) return cudaSuccess;
    constexpr auto kernel = kb25::conv3x3_min_tanh2_grad_input_kernel<Elem>;
    int per_sm = 0;
    const cudaError_t err = resident_ctas_per_sm<kernel>(G::kThreads, G::kSmemBytes, &per_sm);
    if (err != cudaSuccess) return err;
    const int64_t cap = (int64_t)num_sms * per_sm;
    kernel<<<(int)(steps < cap ? steps : cap), G::kThreads, G::kSmemBytes, stream>>>(
        static_cast<const Elem*>(g), pre_min, argmin, static_cast<const Elem*>(w), static_cast<Elem*>(dx), H, W, steps);
    return cudaGetLastError();
  }
};

extern "C" cudaError_t launch_conv3x3_min_tanh2_grad_input(int elem, const void* g, const float* pre_min,
                                                           const unsigned char* argmin, const void* w, void* dx,
                                                           int64_t N, int H, int W, int num_sms,
                                                           cudaStream_t stream) {
  return by_elem<LaunchGradInput>(elem, g, pre_min, argmin, w, dx, N, H, W, num_sms, stream);
}

// The steps of a dW kernel whose steps are kCols output columns of one row.
template <int kCols = kb25::GradWeight::kCols>
static int64_t grad_weight_steps(int64_t N, int H, int W) {
  using G = kb25::GradWeight;
  const int OH = H - (G::kKsize - 1), OW = W - (G::kKsize - 1);
  return OH > 0 && OW > 0 ? N * OH * ((OW + kCols - 1) / kCols) : 0;
}

enum GradWeightKernel { kGradWeightWalkers = 0, kGradWeightFed = 1, kGradWeightFedBuiltB = 2 };
static bool is_grad_weight_kernel(int kernel) { return kernel >= kGradWeightWalkers && kernel <= kGradWeightFedBuiltB; }

extern "C" int choose_grad_weight_kernel(bool tensor_cores, int smem_optin) {
  if (!tensor_cores) return kGradWeightWalkers;
  return kb25::GradWeightFed<true>::two_fit(smem_optin) ? kGradWeightFedBuiltB : kGradWeightFed;
}

// CTAs an SM of the dW kernel `kernel` (GradWeightKernel) for x of type Elem.
template <class Elem>
struct GradWeightPerSm {
  template <bool kBuiltB>
  static cudaError_t fed(int* per_sm) {
    using Fed = kb25::GradWeightFedOf<Elem, kBuiltB>;
    return resident_ctas_per_sm<kb25::conv3x3_min_tanh2_grad_weight_fed_kernel<Elem, kBuiltB>>(
        Fed::kThreads, Fed::kSmemBytes, per_sm);
  }
  static cudaError_t run(int kernel, int* per_sm) {
    using Walk = kb25::GradWeight;
    if (kernel == kGradWeightWalkers) {
      return resident_ctas_per_sm<kb25::conv3x3_min_tanh2_grad_weight_kernel<Elem>>(Walk::kThreads, Walk::kSmemBytes,
                                                                                   per_sm);
    }
    return kernel == kGradWeightFedBuiltB ? fed<true>(per_sm) : fed<false>(per_sm);
  }
};

// As many CTAs as fit on the GPU at once (each sums a share of the steps into its own partial), or fewer with fewer
// steps. Fixed for a GPU, shape and kernel: the sums' order, and so their bits, do not change from run to run. The
// kernel: choose_grad_weight_kernel's.
extern "C" cudaError_t conv3x3_min_tanh2_grad_weight_blocks(int elem, int64_t N, int H, int W, int num_sms,
                                                            int kernel, int* blocks) {
  if (!is_grad_weight_kernel(kernel)) return cudaErrorInvalidValue;
  int per_sm = 0;
  const cudaError_t err = by_elem<GradWeightPerSm>(elem, kernel, &per_sm);
  if (err != cudaSuccess) return err;
  const int64_t steps = grad_weight_steps(N, H, W), cap = (int64_t)num_sms * per_sm;
  *blocks = (int)(steps < cap ? steps : cap);
  return cudaSuccess;
}

// A CTA's partial [kCout][kPartial].
extern "C" int conv3x3_min_tanh2_grad_weight_partial_floats() {
  return kb25::GradWeight::kCout * kb25::GradWeight::kPartial;
}

template <class Elem>
struct LaunchGradWeight {
  // The fed kernel, with B built by its producer or not (grad_weight_fed.cuh).
  template <bool kBuiltB>
  static cudaError_t launch_fed(const Elem* x, const Elem* g, const float* pre_min, const unsigned char* argmin,
                                float* partial, int blocks, int H, int W, int64_t fed_steps, cudaStream_t stream) {
    using F = kb25::GradWeightFedOf<Elem, kBuiltB>;
    constexpr auto kernel = kb25::conv3x3_min_tanh2_grad_weight_fed_kernel<Elem, kBuiltB>;
    const cudaError_t err = opt_in_shared_memory<kernel>(F::kSmemBytes);
    if (err != cudaSuccess) return err;
    kernel<<<blocks, F::kThreads, F::kSmemBytes, stream>>>(x, g, pre_min, argmin, partial, H, W, fed_steps);
    return cudaSuccess;
  }
  static cudaError_t run(int kernel_kind, const void* x, const void* g, const float* pre_min,
                         const unsigned char* argmin, float* partial, int blocks, void* dw, void* db, int64_t N, int H,
                         int W, cudaStream_t stream) {
    using G = kb25::GradWeight;
    const int64_t steps = grad_weight_steps(N, H, W);
    if (!is_grad_weight_kernel(kernel_kind)) return cudaErrorInvalidValue;
    if (blocks <= 0 || blocks > steps) return steps == 0 && blocks == 0 ? cudaSuccess : cudaErrorInvalidValue;
    const auto* const xe = static_cast<const Elem*>(x);
    const auto* const ge = static_cast<const Elem*>(g);
    if (kernel_kind != kGradWeightWalkers) {
      // Its steps are twice as wide: no more CTAs than steps (fewer partials to add; still fixed for a shape).
      const int64_t fed_steps = grad_weight_steps<kb25::GradWeightFed<false>::kCols>(N, H, W);
      blocks = (int)(fed_steps < blocks ? fed_steps : blocks);
      const auto launch = kernel_kind == kGradWeightFedBuiltB ? launch_fed<true> : launch_fed<false>;
      const cudaError_t err = launch(xe, ge, pre_min, argmin, partial, blocks, H, W, fed_steps, stream);
      if (err != cudaSuccess) return err;
    } else {
      constexpr auto kernel = kb25::conv3x3_min_tanh2_grad_weight_kernel<Elem>;
      const cudaError_t err = opt_in_shared_memory<kernel>(G::kSmemBytes);
      if (err != cudaSuccess) return err;
      kernel<<<blocks, G::kThreads, G::kSmemBytes, stream>>>(xe, ge, pre_min, argmin, partial, H, W, steps);
    }
    const int outputs = G::kCout * G::kPartial;
    constexpr int kPerCta = kb25::kReduceOutputs;
    kb25::conv3x3_min_tanh2_grad_weight_reduce_kernel<Elem>
        <<<(outputs + kPerCta - 1) / kPerCta, kPerCta * kb25::kReduceSlices, 0, stream>>>(
        partial, blocks, static_cast<Elem*>(dw), static_cast<Elem*>(db));
    return cudaGetLastError();
  }
};

extern "C" cudaError_t launch_conv3x3_min_tanh2_grad_weight(int elem, int kernel, const void* x, const void* g,
                                                            const float* pre_min, const unsigned char* argmin,
                                                            float* partial, int blocks, void* dw, void* db, int64_t N,
                                                            int H, int W, cudaStream_t stream) {
  return by_elem<LaunchGradWeight>(elem, kernel, x, g, pre_min, argmin, partial, blocks, dw, db, N, H, W,
                                   stream);
}
