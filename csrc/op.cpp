// The C++ op: input checks, the backend decision table, the CUDA paths, registration.
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Context.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <atomic>
#include <memory>
#include <mutex>

#include "generated/config.h"

namespace {

// Messages are put together from strings only. Streaming a number in this library (c10::str, operator<< on an
// int or on sizes) crashed on a machine whose runtime libstdc++ was older than the compiler's headers: the
// number formatting instantiated here used the compiler's locale facets, not the process's.
std::string num(int64_t v) { return std::to_string(v); }

std::string shape_str(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + num(sizes[i]);
  return s + "]";
}

std::string dtype_name(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

bool supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

int elem_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kb25::kElemFloat32;
    case at::kDouble: return kb25::kElemFloat64;
    case at::kHalf: return kb25::kElemFloat16;
    default: return kb25::kElemBfloat16;
  }
}

// The GPU the chooser decides for: the device's own profile (torch reads its properties once per device), or,
// while emulate_device() (python/ops.py) has set one, that profile: a testing aid with which one GPU stands in for
// GPUs it can imitate (no wgmma, less shared memory). Process-wide, not per thread: autograd's backward runs on
// threads of its own and must decide as the forward did.
std::atomic<bool> emulating{false};
std::mutex emulation_mutex;
kb25::DeviceProfile emulated{};

// A device's properties, read once and kept, as at::cuda::getDeviceProperties keeps them. Not through
// ATen/cuda/CUDAContext.h: it includes cuBLAS's, cuSPARSE's and cuSOLVER's headers, which a CUDA install of the
// compiler and runtime alone lacks, and there the extension did not build
// (test_host_code_needs_no_cuda_math_library_headers).
const cudaDeviceProp& device_props(int device) {
  struct Entry {
    std::once_flag once;
    cudaDeviceProp props{};
    cudaError_t err = cudaSuccess;
  };
  static const int count = c10::cuda::device_count();
  static const std::unique_ptr<Entry[]> entries(new Entry[count > 0 ? count : 1]);
  TORCH_CHECK(device >= 0 && device < count,
              "ModelNew expects a visible CUDA device, got device " + num(device) + " of " + num(count));
  Entry& e = entries[device];
  std::call_once(e.once, [&] { e.err = cudaGetDeviceProperties(&e.props, device); });
  TORCH_CHECK(e.err == cudaSuccess, "ModelNew: cudaGetDeviceProperties failed: " + std::string(cudaGetErrorString(e.err)));
  return e.props;
}

// The current device's SM count and stream, for the launchers.
int current_sm_count() { return device_props(c10::cuda::current_device()).multiProcessorCount; }
cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

kb25::DeviceProfile real_profile(int device) {
  const cudaDeviceProp& props = device_props(device);
  kb25::DeviceProfile p{props.major * 10 + props.minor, (int)props.sharedMemPerBlockOptin, false};
#ifdef KB25_BUILT_FOR_SM90A
  p.wgmma_built = p.sm == 90;
#endif
  return p;
}

kb25::DeviceProfile device_profile(int device) {
  if (emulating.load(std::memory_order_acquire)) {
    const std::lock_guard<std::mutex> lock(emulation_mutex);
    if (emulating.load(std::memory_order_relaxed)) return emulated;
  }
  return real_profile(device);
}

std::string profile_str(const kb25::DeviceProfile& p) {
  return "sm_" + num(p.sm) + " with " + num(p.smem_optin) + " bytes of shared memory per block" +
         (p.wgmma_built ? " and wgmma" : "");
}

// The reference conv runs in TF32 exactly when cuDNN runs it (cuDNN enabled) and TF32 is allowed for cuDNN convs:
// the test cuDNN's own conv applies.
bool conv_runs_in_tf32() {
  const auto& ctx = at::globalContext();
  return ctx.userEnabledCuDNN() && ctx.allowTF32CuDNN(at::Float32Op::CONV);
}

bool fused_shape(const at::Tensor& x, const at::Tensor& weight) {
  return x.dim() == 4 && weight.size(0) == KB25_FUSED_COUT && weight.size(1) == KB25_FUSED_CIN &&
         weight.size(2) == KB25_FUSED_KSIZE && weight.size(3) == KB25_FUSED_KSIZE;
}

// The precision in which the reference computes a conv of this dtype (its index in PRECISIONS), or -1 where no fused
// kernel has it. float32 follows the reference conv: TF32 when it would run in TF32, else strict fp32.
int precision_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return conv_runs_in_tf32() ? kb25::kPrecisionTf32 : kb25::kPrecisionStrictFp32;
    case at::kBFloat16: return kb25::kPrecisionBf16;
    case at::kHalf: return kb25::kPrecisionFp16;
    default: return -1;
  }
}

// A float32 x that a kernel rounds to the 16-bit weights' dtype (run_fused_kernel, fused_kernel()).
bool casts_input(const at::Tensor& x, const at::Tensor& weight) {
  const at::ScalarType w = weight.scalar_type();
  return x.scalar_type() == at::kFloat && (w == at::kBFloat16 || w == at::kHalf);
}

// The fused kernel that computes a call in `dtype` as the reference would on this GPU (or the emulated one), or -1;
// and for a guarded kernel its guard on the same GPU (else -1). x's dtype is the one the kernel reads.
std::pair<int, int> fused_kernels_for(const at::Tensor& x, const at::Tensor& weight, at::ScalarType dtype,
                                      bool mma_sync_only) {
  const int precision = precision_of(dtype);
  if (!fused_shape(x, weight) || precision < 0) return {-1, -1};
  const kb25::DeviceProfile device = device_profile(x.get_device());
  const int kernel = choose_fused_kernel(precision, elem_code(x.scalar_type()), device, mma_sync_only);
  if (kernel < 0 || !kb25::kFusedKernelGuarded[kernel]) return {kernel, -1};
  const int guard = choose_guard_kernel(kernel, device);
  TORCH_CHECK(guard >= 0, "ModelNew: no guard kernel for " + std::string(kb25::kFusedKernelNames[kernel]) + " on " +
                              profile_str(device));
  return {kernel, guard};
}

// x's dtype sets the precision, except where a float32 x comes with 16-bit weights: theirs does.
std::pair<int, int> fused_kernels_for(const at::Tensor& x, const at::Tensor& weight, bool mma_sync_only) {
  return fused_kernels_for(x, weight, casts_input(x, weight) ? weight.scalar_type() : x.scalar_type(), mma_sync_only);
}

// The output's dtype of a fused kernel: its precision's (a kernel that rounds a float32 x writes bf16 or fp16).
at::ScalarType output_dtype(int kernel) {
  switch (kb25::kFusedKernelPrecision[kernel]) {
    case kb25::kPrecisionBf16: return at::kBFloat16;
    case kb25::kPrecisionFp16: return at::kHalf;
    default: return at::kFloat;
  }
}

}  // namespace

// The same checks, in the same order and words, as check_input() in python/ops.py (the CPU and fake kernels); the
// tests run one table of bad inputs through both. cast_input: a cast-input call (conv_min_tanh2_cast_input), whose x
// is float32 and whose weights are bfloat16 or float16.
void check_input(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, bool cast_input = false) {
  TORCH_CHECK_VALUE(x.dim() == 3 || x.dim() == 4,
                    "ModelNew expects a 3-D (C, H, W) or 4-D (N, C, H, W) input, got shape " + shape_str(x.sizes()));
  TORCH_CHECK_VALUE(x.device() == weight.device(), "ModelNew expects input on " + weight.device().str() +
                                                       " (the device of its weights), got " + x.device().str());
  if (cast_input) {
    TORCH_CHECK_VALUE(casts_input(x, weight),
                      "ModelNew's cast-input call expects a torch.float32 input and torch.bfloat16 or torch.float16 "
                      "weights, got " + dtype_name(x.scalar_type()) + " and " + dtype_name(weight.scalar_type()));
  }
  TORCH_CHECK_VALUE(cast_input || (x.scalar_type() == weight.scalar_type() && supported_dtype(x.scalar_type())),
                    "ModelNew expects input of its weights' dtype " + dtype_name(weight.scalar_type()) +
                        " (supported: " KB25_SUPPORTED_DTYPES "), got " + dtype_name(x.scalar_type()));
  TORCH_CHECK_VALUE(weight.dim() == 4 && x.size(-3) == weight.size(1),
                    "ModelNew expects " + num(weight.size(1)) + " input channels, got " + num(x.size(-3)));
  TORCH_CHECK_VALUE(x.size(-2) >= weight.size(2) && x.size(-1) >= weight.size(3),
                    "ModelNew expects H >= " + num(weight.size(2)) + " and W >= " + num(weight.size(3)) +
                        " (the kernel size), got H=" + num(x.size(-2)) + ", W=" + num(x.size(-1)));
  TORCH_CHECK_VALUE(bias.dim() == 1 && bias.size(0) == weight.size(0) && bias.device() == weight.device() &&
                        bias.scalar_type() == weight.scalar_type(),
                    "ModelNew expects a bias of shape [" + num(weight.size(0)) + "] like its weights, got " +
                        shape_str(bias.sizes()) + " " + dtype_name(bias.scalar_type()) + " on " +
                        bias.device().str());
}

bool wgmma_available() {
  const kb25::DeviceProfile p = device_profile(c10::cuda::current_device());
  return p.wgmma_built && p.sm == 90;
}

// emulate_device() (python/ops.py) sets and clears the profile. It may only narrow the GPU at hand: every kernel the
// chooser then picks must launch on it.
void set_device_emulation(int64_t major, int64_t minor, int64_t smem_optin) {
  const kb25::DeviceProfile real = real_profile(c10::cuda::current_device());
  TORCH_CHECK_VALUE(major >= 0 && minor >= 0 && minor < 10,
                    "emulate_device expects a capability (major, minor) with 0 <= minor < 10, got (" + num(major) +
                        ", " + num(minor) + ")");
  TORCH_CHECK_VALUE(smem_optin > 0 && smem_optin <= real.smem_optin,
                    "emulate_device expects smem_optin of 1.." + num(real.smem_optin) +
                        " bytes (this GPU's limit: what it chooses must launch here), got " + num(smem_optin));
  const kb25::DeviceProfile profile{(int)(major * 10 + minor), (int)smem_optin, major == 9 && minor == 0};
  // Whatever the chooser may pick for the emulated GPU must launch on this one (a kernel compiled out below sm_80,
  // a wgmma kernel off sm_90, more shared memory than it has would not).
  for (int k = 0; k < kb25::kFusedKernelCount; ++k) {
    TORCH_CHECK_VALUE(!fused_kernel_fits(k, profile) || fused_kernel_fits(k, real),
                      "emulate_device(capability=(" + num(major) + ", " + num(minor) + "), smem_optin=" +
                          num(smem_optin) + ") could choose " + kb25::kFusedKernelNames[k] +
                          ", which this GPU cannot launch: it is " + profile_str(real));
  }
  const std::lock_guard<std::mutex> lock(emulation_mutex);
  emulated = profile;
  emulating.store(true, std::memory_order_release);
}

void clear_device_emulation() {
  const std::lock_guard<std::mutex> lock(emulation_mutex);
  emulating.store(false, std::memory_order_release);
}

// What a call runs: the backend, and for a fused one the kernel (its index in FUSED_KERNELS; -1 otherwise) and, for a
// guarded kernel, its guard (else -1).
struct Choice {
  int64_t backend;
  int kernel;
  int guard = -1;
};

// The decision table of backend "auto" on CUDA (docs/design.md, "The backend decision table"); a forced backend is
// checked here. Run once per call: the op, resolve_backend() and fused_kernel() all read its answer.
Choice choose(const at::Tensor& x, const at::Tensor& weight, int64_t requested) {
  TORCH_CHECK_VALUE(requested >= 0 && requested < kb25::kBackendCount,
                    "ModelNew backend code must be 0.." + num(kb25::kBackendCount - 1) + ", got " + num(requested));
  if (requested == kb25::kBackendCudnnEpilogue) return {requested, -1};
  const bool mma_sync = requested == kb25::kBackendFusedMmaSync;
  const auto [kernel, guard] = fused_kernels_for(x, weight, mma_sync);
  if (requested == kb25::kBackendAuto) {
    return kernel >= 0 ? Choice{kb25::kBackendFused, kernel, guard} : Choice{kb25::kBackendCudnnEpilogue, -1};
  }
  TORCH_CHECK_VALUE(kernel >= 0,
                    "ModelNew backend '" + std::string(kb25::kBackendNames[requested]) + "' needs a 4-D input and a " +
                        num(KB25_FUSED_CIN) + "->" + num(KB25_FUSED_COUT) + " " + num(KB25_FUSED_KSIZE) + "x" +
                        num(KB25_FUSED_KSIZE) +
                        " conv in float32, bfloat16 or float16 on an sm_80+ GPU with shared memory for one of its "
                        "kernels; got a " + num(x.dim()) + "-D " + dtype_name(x.scalar_type()) + " input, weight " +
                        shape_str(weight.sizes()) + ", TF32 convs " +
                        (conv_runs_in_tf32() ? "allowed" : "not allowed") + ", on " +
                        profile_str(device_profile(x.get_device())));
  return {requested, kernel, guard};
}

int64_t resolve_backend(const at::Tensor& x, const at::Tensor& weight, int64_t requested) {
  return choose(x, weight, requested).backend;
}

// Which fused kernel a call with this backend runs: its index in FUSED_KERNELS, or -1 when none does.
int64_t fused_kernel(const at::Tensor& x, const at::Tensor& weight, int64_t backend) {
  return choose(x, weight, backend).kernel;
}

// (N, 16, H, W) -> (N, 1, H-2, W-2) in one kernel, in its precision's dtype (x's, but where it rounds x). With `save`, the kernel also writes
// each output pixel's argmin channel (uint8) and its min before the tanhs (float32), for the backward; else those
// two come back undefined (nothing allocated: the inference call's host time). A guarded kernel (fp32 x on fp16
// operands: Tf32OnF16, Fp32OnF16x3) lists the images it cannot compute exactly in a guard buffer, and its guard kernel `guard`, launched
// after it in the same stream, recomputes them (with none listed it returns at once; -1: not launched, for the
// tests). The buffer comes back as the fourth tensor (undefined for an unguarded kernel).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_conv3x3_min_tanh2_guarded(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int kernel, int guard_kernel, bool save) {
  // The kernel reads the weights and the bias in x's dtype (a 16-bit kernel that rounds float32 x rounds them too).
  const auto as_x = [&](const at::Tensor& t) {
    return (t.scalar_type() == x.scalar_type() ? t : t.to(x.scalar_type())).contiguous();
  };
  const at::Tensor xc = x.contiguous(), wc = as_x(weight), bc = as_x(bias);
  const int64_t N = xc.size(0), H = xc.size(2), W = xc.size(3);
  TORCH_CHECK_VALUE(H <= INT32_MAX && W <= INT32_MAX, "ModelNew expects H and W below 2^31, got " + shape_str(xc.sizes()));
  const std::vector<int64_t> sizes{N, 1, H - (KB25_FUSED_KSIZE - 1), W - (KB25_FUSED_KSIZE - 1)};
  at::Tensor out = at::empty(sizes, xc.options().dtype(output_dtype(kernel)));
  at::Tensor argmin = save ? at::empty(sizes, xc.options().dtype(at::kByte)) : at::Tensor();
  at::Tensor pre_min = save ? at::empty(sizes, xc.options().dtype(at::kFloat)) : at::Tensor();
  const bool guarded = kb25::kFusedKernelGuarded[kernel];
  // The guard buffer zeroed by a memset in the stream (at::zeros adds a fill_ dispatch and its kernel launch).
  at::Tensor guard = guarded ? at::empty({1 + 2 * N}, xc.options().dtype(at::kInt)) : at::Tensor();
  if (guarded) {
    const cudaError_t err = cudaMemsetAsync(guard.data_ptr<int>(), 0, guard.nbytes(), current_stream());
    if (err != cudaSuccess) (void)cudaGetLastError();  // not left for the next launch's check to report as its own
    TORCH_CHECK(err == cudaSuccess, "ModelNew: the guard buffer's memset failed: " + std::string(cudaGetErrorString(err)));
  }
  const auto launch = [&](int k) {
    const cudaError_t err = launch_fused_conv3x3_min_tanh2(
        k, xc.data_ptr(), wc.data_ptr(), bc.data_ptr(), out.data_ptr(), save ? argmin.data_ptr() : nullptr,
        save ? pre_min.data_ptr<float>() : nullptr, guarded ? guard.data_ptr<int>() : nullptr, N, (int)H, (int)W,
        current_sm_count(), current_stream());
    TORCH_CHECK(err == cudaSuccess, "ModelNew: the fused kernel " + std::string(kb25::kFusedKernelNames[k]) +
                                        " did not launch: " + std::string(cudaGetErrorString(err)));
  };
  launch(kernel);
  if (guarded && guard_kernel >= 0) launch(guard_kernel);
  if (save && kb25::kFusedKernelPrecision[kernel] == kb25::kPrecisionStrictFp32) {  // the backward's minima, to 0.5 ulp
    const cudaError_t err = launch_conv3x3_min_refine(xc.data_ptr<float>(), wc.data_ptr<float>(), bc.data_ptr<float>(),
                                                      argmin.data_ptr<uint8_t>(), pre_min.data_ptr<float>(), N, (int)H,
                                                      (int)W, current_sm_count(), current_stream());
    TORCH_CHECK(err == cudaSuccess, "ModelNew: the strict minima's kernel did not launch: " +
                                        std::string(cudaGetErrorString(err)));
  }
  return {out, argmin, pre_min, guard};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_conv3x3_min_tanh2(const at::Tensor& x, const at::Tensor& weight,
                                                                       const at::Tensor& bias, const Choice& choice,
                                                                       bool save) {
  auto result = fused_conv3x3_min_tanh2_guarded(x, weight, bias, choice.kernel, choice.guard, save);
  return {std::get<0>(result), std::get<1>(result), std::get<2>(result)};
}

// cuDNN's conv through ATen (every torch.backends.cudnn setting applies), then one kernel: min over dim 1 (channels
// of a batched output, rows of an unbatched one, as torch.min(dim=1) in the reference), tanh, tanh. With `save`
// (a batched output), also the argmin and min that torch.min gives, as the fused kernel saves them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cudnn_conv_then_epilogue(const at::Tensor& x, const at::Tensor& weight,
                                                                        const at::Tensor& bias, bool save) {
  const at::Tensor y = at::conv2d(x.contiguous(), weight, bias).contiguous();
  std::vector<int64_t> out_sizes = y.sizes().vec();
  out_sizes[1] = 1;
  at::Tensor out = at::empty(out_sizes, y.options());
  const int64_t outer = y.size(0), reduce = y.size(1);
  const int64_t inner = outer * reduce == 0 ? 0 : y.numel() / (outer * reduce);
  const cudaError_t err = launch_min_dim1_tanh2(elem_code(y.scalar_type()), y.data_ptr(), out.data_ptr(), outer,
                                                reduce, inner, current_sm_count(), current_stream());
  TORCH_CHECK(err == cudaSuccess, "ModelNew: the epilogue kernel did not launch: " + std::string(cudaGetErrorString(err)));
  if (!save) return {out, at::Tensor(), at::Tensor()};
  const auto [values, indices] = at::min(y, 1, /*keepdim=*/true);
  return {out, indices.to(at::kByte), values.to(at::kFloat)};
}

// Whether the current GPU itself (whatever is emulated) can launch a fused kernel (its index in FUSED_TABLE).
bool fused_kernel_launches(int64_t kernel) {
  return fused_kernel_fits((int)kernel, real_profile(c10::cuda::current_device()));
}

// Checks a call of one named fused kernel (run_fused_kernel*); returns the GPU it runs on.
kb25::DeviceProfile check_named_kernel(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                       int64_t kernel) {
  check_input(x, weight, bias, casts_input(x, weight));
  TORCH_CHECK_VALUE(kernel >= 0 && kernel < kb25::kFusedKernelCount,
                    "run_fused_kernel expects a kernel code 0.." + num(kb25::kFusedKernelCount - 1) + ", got " +
                        num(kernel));
  const std::string name = kb25::kFusedKernelNames[kernel];
  TORCH_CHECK_VALUE(x.is_cuda() && fused_shape(x, weight) &&
                        precision_of(weight.scalar_type()) == kb25::kFusedKernelPrecision[kernel] &&
                        elem_code(x.scalar_type()) == kb25::kFusedKernelInput[kernel],
                    "run_fused_kernel(" + name + ") expects a 4-D CUDA input of its input dtype, weights of its " +
                        "precision and a " + num(KB25_FUSED_CIN) + "->" + num(KB25_FUSED_COUT) + " conv, got a " +
                        num(x.dim()) + "-D " + dtype_name(x.scalar_type()) + " input on " + x.device().str() +
                        ", " + dtype_name(weight.scalar_type()) + " weights, TF32 convs " +
                        (conv_runs_in_tf32() ? "allowed" : "not allowed"));
  const kb25::DeviceProfile real = real_profile(x.get_device());
  TORCH_CHECK_VALUE(fused_kernel_fits((int)kernel, real),
                    "run_fused_kernel(" + name + ") needs " + num(fused_kernel_smem_bytes((int)kernel)) +
                        " bytes of shared memory per block and its MMA; got " + profile_str(real));
  return real;
}

// One named fused kernel (its index in FUSED_TABLE), for tests and benchmarks: it must compute the weights' precision,
// take x's dtype (float32 x with 16-bit weights: a kernel that rounds x itself) and launch on this GPU itself (whatever is emulated). A guarded kernel runs with its guard for this GPU,
// or (with_guard false) alone. Returns the output and the guard buffer: [0] how many images the kernel listed,
// [1, 1 + N) which (an undefined tensor for an unguarded kernel).
std::tuple<at::Tensor, at::Tensor> run_fused_kernel_guarded(const at::Tensor& x, const at::Tensor& weight,
                                                            const at::Tensor& bias, int64_t kernel, bool with_guard) {
  const kb25::DeviceProfile real = check_named_kernel(x, weight, bias, kernel);
  const c10::cuda::CUDAGuard guard(x.device());
  const int guard_kernel = with_guard ? choose_guard_kernel((int)kernel, real) : -1;
  auto result = fused_conv3x3_min_tanh2_guarded(x, weight, bias, (int)kernel, guard_kernel, false);
  return {std::get<0>(result), std::get<3>(result)};
}

// The saving variant of one named fused kernel (tests): the output, each pixel's argmin channel (uint8) and pre-tanh
// min (float32); a guarded kernel runs with its guard, as ModelNew runs it.
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_fused_kernel_saving(const at::Tensor& x, const at::Tensor& weight,
                                                                       const at::Tensor& bias, int64_t kernel) {
  const kb25::DeviceProfile real = check_named_kernel(x, weight, bias, kernel);
  const c10::cuda::CUDAGuard guard(x.device());
  auto result = fused_conv3x3_min_tanh2_guarded(x, weight, bias, (int)kernel, choose_guard_kernel((int)kernel, real),
                                                true);
  return {std::get<0>(result), std::get<1>(result), std::get<2>(result)};
}

at::Tensor run_fused_kernel(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t kernel) {
  return std::get<0>(run_fused_kernel_guarded(x, weight, bias, kernel, true));
}

// The CUDA kernel of the op kb25::conv_min_tanh2; ModelNew also calls it directly in eager mode.
at::Tensor conv_min_tanh2(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t backend) {
  check_input(x, weight, bias);
  TORCH_CHECK_VALUE(x.is_cuda(), "ModelNew's CUDA kernel needs CUDA tensors, got " + x.device().str());
  const c10::cuda::CUDAGuard guard(x.device());
  const Choice choice = choose(x, weight, backend);
  if (choice.kernel < 0) return std::get<0>(cudnn_conv_then_epilogue(x, weight, bias, false));
  return std::get<0>(fused_conv3x3_min_tanh2(x, weight, bias, choice, false));
}

// x, weight and bias .to(dtype), then the op's CUDA kernel, for a float32 x and float32 (or already `dtype`) weights,
// dtype bfloat16 or float16 (autocast's call, python/ops.py): the fused kernel of that dtype with a float32 input
// rounds x, the weights and the bias itself as it reads them (round to nearest even, as .to() does), so no cast kernel
// runs; where that kernel does not run (another backend, shape or GPU), they are cast and the call goes the op's way.
// The output is the op's on the cast tensors, bit for bit.
at::Tensor conv_min_tanh2_cast_input(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                     at::ScalarType dtype, int64_t backend) {
  TORCH_CHECK_VALUE((dtype == at::kBFloat16 || dtype == at::kHalf) &&
                        (weight.scalar_type() == at::kFloat || weight.scalar_type() == dtype),
                    "ModelNew's cast-input call expects dtype torch.bfloat16 or torch.float16 and weights of "
                    "torch.float32 or that dtype, got " + dtype_name(dtype) + " and " +
                        dtype_name(weight.scalar_type()));
  check_input(x, weight, bias, /*cast_input=*/weight.scalar_type() == dtype);
  TORCH_CHECK_VALUE(x.is_cuda(), "ModelNew's CUDA kernel needs CUDA tensors, got " + x.device().str());
  TORCH_CHECK_VALUE(backend >= 0 && backend < kb25::kBackendCount,
                    "ModelNew backend code must be 0.." + num(kb25::kBackendCount - 1) + ", got " + num(backend));
  const c10::cuda::CUDAGuard guard(x.device());
  if (backend != kb25::kBackendCudnnEpilogue) {
    const auto [kernel, guard_kernel] = fused_kernels_for(x, weight, dtype, backend == kb25::kBackendFusedMmaSync);
    if (kernel >= 0) {
      const Choice choice{backend == kb25::kBackendAuto ? kb25::kBackendFused : backend, kernel, guard_kernel};
      return std::get<0>(fused_conv3x3_min_tanh2(x, weight, bias, choice, false));
    }
  }
  return conv_min_tanh2(x.to(dtype), weight.to(dtype), bias.to(dtype), backend);
}

// Whether a call's backward runs from a saved argmin (the kernels of the fused shape, in float32, bfloat16, float16;
// whichever backend ran the forward). Else autograd recomputes the reference's chain. saves_argmin() in
// python/ops.py (the fake kernel) decides the same from shapes and dtypes alone.
bool saves_argmin(const at::Tensor& x, const at::Tensor& weight) {
  const auto t = x.scalar_type();
  return fused_shape(x, weight) && (t == at::kFloat || t == at::kHalf || t == at::kBFloat16);
}

// The CUDA kernel of kb25::conv_min_tanh2_with_argmin: the op's output, and where saves_argmin() holds, the argmin
// channel (uint8) and pre-tanh min (float32) of each output pixel (else two empty tensors).
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_min_tanh2_with_argmin(const at::Tensor& x, const at::Tensor& weight,
                                                                          const at::Tensor& bias, int64_t backend) {
  check_input(x, weight, bias);
  TORCH_CHECK_VALUE(x.is_cuda(), "ModelNew's CUDA kernel needs CUDA tensors, got " + x.device().str());
  const c10::cuda::CUDAGuard guard(x.device());
  const Choice choice = choose(x, weight, backend);
  const bool save = saves_argmin(x, weight);
  auto result = choice.kernel < 0 ? cudnn_conv_then_epilogue(x, weight, bias, save)
                                  : fused_conv3x3_min_tanh2(x, weight, bias, choice, save);
  if (!save) {  // an op returns defined tensors: empty ones say "nothing saved"
    std::get<1>(result) = at::empty({0}, x.options().dtype(at::kByte));
    std::get<2>(result) = at::empty({0}, x.options().dtype(at::kFloat));
  }
  return result;
}

// The CUDA kernel of kb25::conv_min_tanh2_backward: the gradients of x, the weight and the bias (each only where
// asked for, else empty) from the output's gradient and the forward's saved argmin and pre-tanh min. Deterministic.
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_min_tanh2_backward(const at::Tensor& grad, const at::Tensor& x,
                                                                       const at::Tensor& weight,
                                                                       const at::Tensor& argmin,
                                                                       const at::Tensor& pre_min, bool need_input,
                                                                       bool need_weight, bool need_bias) {
  TORCH_CHECK_VALUE(x.is_cuda() && saves_argmin(x, weight),
                    "conv_min_tanh2_backward expects a 4-D CUDA input of float32, bfloat16 or float16 and a " +
                        num(KB25_FUSED_CIN) + "->" + num(KB25_FUSED_COUT) + " " + num(KB25_FUSED_KSIZE) + "x" +
                        num(KB25_FUSED_KSIZE) + " weight, got a " + num(x.dim()) + "-D " +
                        dtype_name(x.scalar_type()) + " input on " + x.device().str() + ", weight " +
                        shape_str(weight.sizes()));
  const std::vector<int64_t> out_sizes{x.size(0), 1, x.size(2) - (KB25_FUSED_KSIZE - 1), x.size(3) - (KB25_FUSED_KSIZE - 1)};
  const auto expect = [&](const at::Tensor& t, at::ScalarType dtype, const char* what) {
    TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(out_sizes) && t.scalar_type() == dtype && t.device() == x.device(),
                      "conv_min_tanh2_backward expects " + std::string(what) + " of shape " + shape_str(out_sizes) +
                          " " + dtype_name(dtype) + " on " + x.device().str() + ", got " + shape_str(t.sizes()) + " " +
                          dtype_name(t.scalar_type()) + " on " + t.device().str());
  };
  expect(grad, x.scalar_type(), "the output's gradient");
  expect(argmin, at::kByte, "the saved argmin");
  expect(pre_min, at::kFloat, "the saved pre-tanh min");
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type() && weight.device() == x.device(),
                    "conv_min_tanh2_backward expects the weight in the input's dtype and device, got " +
                        dtype_name(weight.scalar_type()) + " on " + weight.device().str());
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), gc = grad.contiguous();
  const at::Tensor ac = argmin.contiguous(), mc = pre_min.contiguous();
  const int64_t N = xc.size(0), H = xc.size(2), W = xc.size(3);
  TORCH_CHECK_VALUE(H <= INT32_MAX && W <= INT32_MAX, "ModelNew expects H and W below 2^31, got " + shape_str(xc.sizes()));
  const int elem = elem_code(xc.scalar_type());
  const int num_sms = current_sm_count();
  const cudaStream_t stream = current_stream();
  const auto none = [&] { return at::empty({0}, xc.options()); };
  at::Tensor dw = need_weight ? at::empty(wc.sizes(), wc.options()) : none();
  at::Tensor db = need_bias ? at::empty({wc.size(0)}, wc.options()) : none();
  if (need_weight || need_bias) {
    // The weight gradient in the reference's precision: TF32 products (TF32-rounded operands on the tensor cores)
    // where its conv runs in TF32, and for 16-bit inputs; every product in fp32 for strict fp32 and before sm_80.
    const kb25::DeviceProfile profile = device_profile(xc.get_device());
    const bool tensor_cores = profile.sm >= 80 && (xc.scalar_type() != at::kFloat || conv_runs_in_tf32());
    const int kernel = choose_grad_weight_kernel(tensor_cores, profile.smem_optin);
    int blocks = 0;
    const cudaError_t blocks_err =
        conv3x3_min_tanh2_grad_weight_blocks(elem, N, (int)H, (int)W, num_sms, kernel, &blocks);
    TORCH_CHECK(blocks_err == cudaSuccess,
                "ModelNew: the weight-gradient kernel's occupancy query failed: " + std::string(cudaGetErrorString(blocks_err)));
    if (blocks == 0) {  // no output pixel: nothing flows back
      if (need_weight) dw.zero_();
      if (need_bias) db.zero_();
    } else {
      at::Tensor partial = at::empty({(int64_t)blocks * conv3x3_min_tanh2_grad_weight_partial_floats()},
                                     xc.options().dtype(at::kFloat));
      const cudaError_t err = launch_conv3x3_min_tanh2_grad_weight(
          elem, kernel, xc.data_ptr(), gc.data_ptr(), mc.data_ptr<float>(), ac.data_ptr<uint8_t>(),
          partial.data_ptr<float>(), blocks, need_weight ? dw.data_ptr() : nullptr,
          need_bias ? db.data_ptr() : nullptr, N, (int)H, (int)W, stream);
      TORCH_CHECK(err == cudaSuccess, "ModelNew: the weight-gradient kernels did not launch: " + std::string(cudaGetErrorString(err)));
    }
  }
  // dX after dW: the weight gradient's partials are freed before dX (the size of x) is allocated, so the peak
  // holds one of them, not both.
  at::Tensor dx = need_input ? at::empty(xc.sizes(), xc.options()) : none();
  if (need_input) {
    const cudaError_t err = launch_conv3x3_min_tanh2_grad_input(elem, gc.data_ptr(), mc.data_ptr<float>(),
                                                                ac.data_ptr<uint8_t>(), wc.data_ptr(), dx.data_ptr(), N,
                                                                (int)H, (int)W, num_sms, stream);
    TORCH_CHECK(err == cudaSuccess, "ModelNew: the input-gradient kernel did not launch: " + std::string(cudaGetErrorString(err)));
  }
  return {dx, dw, db};
}

namespace {

// The reference's chain from its min on, for a backward with nothing saved or one that must itself be
// differentiable (create_graph=True): recompute the conv and the argmin that torch.min picks, tanh_backward twice
// at the pre-tanh min, the gradient scattered to the argmin (zeros elsewhere), then the conv's dense backward (so
// 0 * inf is NaN, as in the reference). python/ops.py's reference_backward, in ATen ops that autograd records.
// An unbatched input's min runs over dim 1 of its 3-D output (the rows), as the reference's does.
std::vector<at::Tensor> reference_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                                           const at::Tensor& bias, std::array<bool, 3> needs) {
  const bool batched = x.dim() == 4;
  const at::Tensor x4 = batched ? x : x.unsqueeze(0), grad4 = batched ? grad_out : grad_out.unsqueeze(0);
  const int64_t dim = batched ? 1 : 2;
  const auto [pre_min, argmin] = at::min(at::conv2d(x4, weight, bias), dim, /*keepdim=*/true);
  const at::Tensor t1 = at::tanh(pre_min), t2 = at::tanh(t1);
  const at::Tensor grad_m = at::tanh_backward(at::tanh_backward(grad4, t2), t1);
  const std::vector<int64_t> y_sizes{x4.size(0), weight.size(0), x4.size(2) - weight.size(2) + 1,
                                     x4.size(3) - weight.size(3) + 1};
  const at::Tensor grad_y = at::zeros(y_sizes, grad_m.options()).scatter_(dim, argmin, grad_m);
  auto [gx, gw, gb] = at::convolution_backward(grad_y, x4, weight, std::vector<int64_t>{weight.size(0)}, {1, 1},
                                               {0, 0}, {1, 1}, false, {0, 0}, 1, needs);
  if (needs[0] && !batched) gx = gx.squeeze(0);
  return {needs[0] ? gx : at::Tensor(), needs[1] ? gw : at::Tensor(), needs[2] ? gb : at::Tensor()};
}

// An eager training step's forward and backward as a C++ autograd function: the saving forward's kernels, then
// the backward op's, with no Python on either way (ModelNew.forward takes it for plain CUDA tensors in eager mode
// once forwards save). The custom op's Python layers, or a Python autograd.Function, cost a small batch's step more
// host time than its GPU work.
struct SavingStep : public torch::autograd::Function<SavingStep> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, int64_t backend) {
    auto [out, argmin, pre_min] = conv_min_tanh2_with_argmin(x, weight, bias, backend);
    ctx->save_for_backward({x, weight, bias, argmin, pre_min});
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &bias = saved[2], &argmin = saved[3], &pre_min = saved[4];
    const std::array<bool, 3> needs{ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2)};
    std::vector<at::Tensor> result;
    if (argmin.numel() == 0 || at::GradMode::is_enabled()) {
      result = reference_backward(grads[0], x, weight, bias, needs);
    } else {
      auto [dx, dw, db] = conv_min_tanh2_backward(grads[0], x, weight, argmin, pre_min, needs[0], needs[1], needs[2]);
      result = {needs[0] ? dx : at::Tensor(), needs[1] ? dw : at::Tensor(), needs[2] ? db : at::Tensor()};
    }
    result.emplace_back();  // the backend
    return result;
  }
};

}  // namespace

// ModelNew's eager training forward: SavingStep's output, whose backward runs the backward op's kernels.
at::Tensor conv_min_tanh2_saving_step(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                      int64_t backend) {
  return SavingStep::apply(x, weight, bias, backend);
}

TORCH_LIBRARY_IMPL(KB25_OP_NAMESPACE, CUDA, m) {
  m.impl(KB25_OP_NAME, TORCH_FN(conv_min_tanh2));
  m.impl(KB25_OP_NAME "_with_argmin", TORCH_FN(conv_min_tanh2_with_argmin));
  m.impl(KB25_OP_NAME "_backward", TORCH_FN(conv_min_tanh2_backward));
}
