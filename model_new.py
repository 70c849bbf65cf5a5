"""Drop-in replacement for reference.Model: Conv2d(16->64, 3x3) -> min over dim 1 -> tanh -> tanh.

Read top to bottom: constants -> CUDA source (traits, device helpers, kernels, launchers; no torch headers) ->
C++ op (input checks, the backend decision table, the two CUDA paths) -> build at import -> the torch.library
op (CPU kernel, fake kernel, autograd) -> ModelNew.

Backends (ModelNew.backend, or the `backend=` keyword):
  "fused"           one kernel: implicit-GEMM conv on TF32 tensor cores (operands rounded to nearest, as cuDNN
                    does), bias, NaN-propagating min over the 64 output channels, tanh, tanh; the activation never
                    reaches memory. CUDA float32, 16->64 channels, 3x3, batched input. wgmma on sm_90 (H100/H200),
                    mma.sync on other sm_80+ GPUs.
  "fused_mma_sync"  the same kernel on mma.sync everywhere (the portable variant; kept for comparison).
  "cudnn_epilogue"  cuDNN's conv through ATen (honours every torch.backends.cudnn setting) + one kernel for the min
                    over dim 1 and the two tanh, templated on float32, float64, float16 and bfloat16. ("card" is
                    an accepted alias, its former name.)
  "torch"           the reference math in torch ops (any device).
  "auto"            (default) decided per call by the table in resolve_backend() (C++): fused when the input is a
                    batched CUDA float32 tensor, the conv is 16->64 3x3 and the reference conv would run in TF32;
                    cudnn_epilogue for every other CUDA input; on the CPU the reference math.

The forward is one torch.library op, kb25::conv_min_tanh2(x, weight, bias, backend): CUDA kernel in C++, CPU
kernel in torch ops, a fake kernel for tracing, and an autograd formula. torch.compile(fullgraph=True) and CUDA
graphs see that op. In eager mode, with nothing to record for autograd, ModelNew calls the op's CUDA kernel
directly: the same C++ function, without the dispatcher's Python layers (a few microseconds per call).
"""
import inspect

import torch
import torch.nn as nn

# ------------------------------------------------------------------------------------------------ constants
FUSED_IN_CHANNELS = 16
FUSED_OUT_CHANNELS = 64
FUSED_KERNEL_SIZE = 3
# The op's backend argument: code = position. "torch" never reaches the op (it is the torch math itself).
OP_BACKENDS = ("auto", "fused", "fused_mma_sync", "cudnn_epilogue")
BACKENDS = OP_BACKENDS + ("torch",)
BACKEND_ALIASES = {"card": "cudnn_epilogue"}
# Element types of the epilogue kernel; code = position. Also the dtypes ModelNew accepts.
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
EXTENSION_NAME = "kb25_conv_min_tanh2"
OP_NAMESPACE = "kb25"
OP_NAME = "conv_min_tanh2"
OP_SCHEMA = "(Tensor x, Tensor weight, Tensor bias, int backend) -> Tensor"


def _camel(name):
    return "".join(part.capitalize() for part in name.split("_"))


def _shared_declarations():
    """Everything both translation units must agree on, written once: the fused shape, the backend and element
    codes, the names printed in errors, and the launchers' signatures (a mismatch with their definitions in the
    CUDA source is a compile error)."""
    backends = "\n".join(f"inline constexpr int64_t kBackend{_camel(n)} = {i};" for i, n in enumerate(OP_BACKENDS))
    names = ", ".join(f'"{n}"' for n in OP_BACKENDS)
    elems = "\n".join(f"inline constexpr int kElem{_camel(str(d).split('.')[1])} = {i};" for i, d in enumerate(SUPPORTED_DTYPES))
    supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
    return f"""#include <cstdint>
#include <cuda_runtime.h>
#define KB25_FUSED_CIN {FUSED_IN_CHANNELS}
#define KB25_FUSED_COUT {FUSED_OUT_CHANNELS}
#define KB25_FUSED_KSIZE {FUSED_KERNEL_SIZE}
#define KB25_OP_NAMESPACE {OP_NAMESPACE}
#define KB25_OP_NAME "{OP_NAME}"
#define KB25_SUPPORTED_DTYPES "{supported}"
namespace kb25 {{
{backends}
inline constexpr int kBackendCount = {len(OP_BACKENDS)};
inline constexpr const char* kBackendNames[] = {{{names}}};
{elems}
}}  // namespace kb25
extern "C" cudaError_t launch_conv3x3_min_tanh2_tf32(const float* x, const float* w, const float* b, float* out,
                                                     int64_t N, int H, int W, bool use_wgmma, int num_sms,
                                                     cudaStream_t stream);
extern "C" cudaError_t launch_min_dim1_tanh2(int elem, const void* y, void* out, int64_t outer, int64_t reduce,
                                             int64_t inner, int num_sms, cudaStream_t stream);
"""


# ------------------------------------------------------------------------------------------------ CUDA source
CUDA_SOURCE = r"""
// torch's extension build defines __CUDA_NO_HALF_CONVERSIONS__ and its kin for its own headers; this file includes
// none of them and converts between element types with the ordinary constructors and conversion operators.
#undef __CUDA_NO_HALF_OPERATORS__
#undef __CUDA_NO_HALF_CONVERSIONS__
#undef __CUDA_NO_HALF2_OPERATORS__
#undef __CUDA_NO_BFLOAT16_CONVERSIONS__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
@SHARED_DECLARATIONS@
namespace kb25 {

// ================================================================ traits
enum class OperandPrecision { kTF32RoundNearest };  // strict fp32 (3xTF32), bf16 and fp16 slot in here

// What both fused kernels share. K is ordered (kh, kw, ci): k-step ks covers channels (ks % (kCin/8)) * 8 .. +7
// of tap ks / (kCin/8) = kh*3 + kw. A CTA is one warpgroup; one CTA step is one output row segment of kTileCols
// pixels x all kCout channels, computed from a ring of input rows in shared memory.
template <int kCin_, int kCout_>
struct FusedShape {
  static constexpr int kCin = kCin_;
  static constexpr int kCout = kCout_;
  static constexpr OperandPrecision kPrecision = OperandPrecision::kTF32RoundNearest;
  static constexpr int kKsize = 3;
  static constexpr int kTaps = kKsize * kKsize;
  static constexpr int kKSteps = kCin * kTaps / 8;
  static constexpr int kThreads = 128;
  static constexpr int kMinBlocksPerSm = 2;  // two CTAs per SM: one computes while the other loads or reduces
  static constexpr int kTileCols = 256;
  static constexpr int kInCols = kTileCols + kKsize - 1;  // input columns one step reads
  static_assert(kCin % 8 == 0, "input channels must fill whole k8 steps");
  static_assert(kPrecision == OperandPrecision::kTF32RoundNearest, "only TF32 round-to-nearest is implemented");
};

// mma.sync m16n8k8 (any sm_80+ GPU). Each warp: 64 pixels (4 m16 tiles) x all kCout channels (kCout/8 n8 tiles),
// so the min over channels stays in registers. A (pixels x channels) and B (weights) both from shared memory.
template <int kCin_, int kCout_>
struct MmaSyncTraits : FusedShape<kCin_, kCout_> {
  using S = FusedShape<kCin_, kCout_>;
  static constexpr int kWarpCols = S::kTileCols / 4;
  static constexpr int kMTiles = kWarpCols / 16;
  static constexpr int kNTiles = S::kCout / 8;
  static constexpr int kChunksPerRow = (S::kInCols + 3) / 4;  // 16-byte chunks of one channel row
  // Slot layout [channel][kPitch]. The 4 lanes of a quad read 4 consecutive channels at one pixel: a pitch of
  // 8 (mod 32) words puts a warp's 32 A-fragment loads in 32 distinct banks.
  static constexpr int kPitch = ((kChunksPerRow * 4 + 23) / 32) * 32 + 8;
  static constexpr int kPrefetch = 1;
  static constexpr int kRing = S::kKsize + kPrefetch;
  static constexpr int kSlotFloats = S::kCin * kPitch;
  static constexpr int kWeightFloats = S::kKSteps * 32 * kNTiles * 2;
  static constexpr size_t kSmemBytes = (size_t)(kRing * kSlotFloats + kWeightFloats + S::kCout) * sizeof(float);
  static_assert(S::kCout % 16 == 0, "weight fragments are read as pairs of n8 tiles");
  static_assert(kMTiles == 4, "the epilogue gives one m16 tile to each lane of a quad");
  static_assert(kPitch % 32 == 8 && kPitch >= kChunksPerRow * 4, "pitch must be 8 mod 32 and hold a row");
};

// wgmma m64n256k8 (sm_90a), operands swapped: A = weights (M = 64 output channels) in registers for the whole
// kernel, B = input pixels (N = 256) x 8 channels from shared memory. One instruction per k-step, no A loads.
template <int kCin_, int kCout_>
struct WgmmaTraits : FusedShape<kCin_, kCout_> {
  using S = FusedShape<kCin_, kCout_>;
  static constexpr int kGroups = S::kCin / 4;  // 4 channels = 16 bytes = one core-matrix row
  // Slot layout [group][column][4 channels]: 8 consecutive columns of one group are one 8 x 16-byte core matrix,
  // whatever column they start at, so every tap's B operand is a plain descriptor into the slot.
  static constexpr int kPitchCols = 264;
  static constexpr int kGroupBytes = kPitchCols * 16;
  static constexpr int kSlotFloats = kGroups * kPitchCols * 4;
  static constexpr int kPrefetch = 2;
  static constexpr int kRing = S::kKsize + kPrefetch;
  static constexpr int kNBlocks = S::kTileCols / 8;  // n8 blocks of the accumulator
  static constexpr int kRedRows = 16;               // cross-warp min: 4 warps x 4 lane pairs
  static constexpr int kRedPitch = S::kTileCols + 8;  // rows 8 words apart: 2-way conflicts at most
  static constexpr size_t kSmemBytes = (size_t)(kRing * kSlotFloats + kRedRows * kRedPitch) * sizeof(float);
  static_assert(S::kCout == 64 && S::kTileCols == 256, "one m64n256k8 per k-step");
  static_assert(kPitchCols >= S::kInCols, "a slot holds a whole input row segment");
};

// wgmma exists only in code compiled for sm_90a; elsewhere its kernel body is empty and never launched.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KB25_HAS_WGMMA 1
#else
#define KB25_HAS_WGMMA 0
#endif

// ================================================================ device helpers
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// cp.async with a source size of 0 writes zeros: columns past the image edge arrive as 0.
__device__ __forceinline__ void cp_async_16(float* dst, const float* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_4(float* dst, const float* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Round to nearest, ties away: what cuDNN's TF32 conv does to its operands (truncation would be 8e-4 off).
__device__ __forceinline__ float round_to_tf32(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(v));
  return __uint_as_float(r);
}
__device__ __forceinline__ float4 round_to_tf32(float4 v) {
  return make_float4(round_to_tf32(v.x), round_to_tf32(v.y), round_to_tf32(v.z), round_to_tf32(v.w));
}

// torch.min semantics: NaN wins (fminf would drop it).
__device__ __forceinline__ float nan_min(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float tanh2(float v) { return tanhf(tanhf(v)); }

// D += A * B for one m16n8k8 TF32 tile, fp32 accumulate.
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], float b0, float b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}

// Warpgroup MMA runs asynchronously: registers it accumulates into must stay untouched until wgmma.wait_group;
// fence_operand() pins a value in its registers across that window.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// Shared-memory matrix descriptor, no swizzle: start address, then the byte offsets between 8-row x 16-byte core
// matrices along K (leading) and along M/N (stride), each field in 16-byte units.
__device__ __forceinline__ uint64_t wgmma_desc(const void* smem, uint32_t k_offset_bytes, uint32_t mn_offset_bytes) {
  return (uint64_t)((smem_u32(smem) >> 4) & 0x3FFF) | ((uint64_t)((k_offset_bytes >> 4) & 0x3FFF) << 16) |
         ((uint64_t)((mn_offset_bytes >> 4) & 0x3FFF) << 32);
}

@WGMMA_M64N256K8@

// Step s = (n * col_blocks + cb) * OH + oy, the output row fastest: consecutive steps slide a 3-row input window
// down one column block of one image. A CTA walks a contiguous range of steps; it divides once, then counts.
struct StepWalker {
  int oy, cb;
  int64_t n;
  const int OH, col_blocks;
  __device__ StepWalker(int64_t s, int OH_, int col_blocks_) : OH(OH_), col_blocks(col_blocks_) {
    oy = (int)(s % OH);
    cb = (int)((s / OH) % col_blocks);
    n = s / OH / col_blocks;
  }
  __device__ void advance() {
    if (++oy == OH) {
      oy = 0;
      if (++cb == col_blocks) {
        cb = 0;
        ++n;
      }
    }
  }
};

__device__ __forceinline__ void cta_step_range(int64_t total, int64_t& begin, int64_t& end) {
  begin = total * blockIdx.x / gridDim.x;
  end = total * (blockIdx.x + 1) / gridDim.x;
}

// ================================================================ mma.sync kernel
// Producer: starts the copy of input row y (every channel; columns col0 .. col0 + 4*kChunksPerRow - 1) into a
// slot laid out [channel][kPitch]. Thread tid owns chunks tid, tid + kThreads, ...; round_row() visits the same
// chunks, so a thread may round its own chunks once its copies have landed, without a barrier in between.
template <class T>
__device__ __forceinline__ void load_input_row(float* slot, const float* __restrict__ x_img, int y, int col0, int H,
                                               int W, bool vec16) {
  const int64_t plane = (int64_t)H * W;
  for (int c = threadIdx.x; c < T::kCin * T::kChunksPerRow; c += T::kThreads) {
    const int ci = c / T::kChunksPerRow;
    const int j = c - ci * T::kChunksPerRow;
    const int col = col0 + 4 * j;
    const float* src = x_img + ci * plane + (int64_t)y * W + col;
    float* dst = slot + ci * T::kPitch + 4 * j;
    if (vec16) {
      const bool valid = col < W;  // W % 4 == 0 here: a chunk is wholly inside or wholly outside
      cp_async_16(dst, valid ? src : x_img, valid);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool valid = col + e < W;
        cp_async_4(dst + e, valid ? src + e : x_img, valid);
      }
    }
  }
  cp_async_commit();
}

template <class T>
__device__ __forceinline__ void round_row(float* slot) {
  for (int c = threadIdx.x; c < T::kCin * T::kChunksPerRow; c += T::kThreads) {
    const int ci = c / T::kChunksPerRow;
    float4* p = reinterpret_cast<float4*>(slot + ci * T::kPitch + 4 * (c - ci * T::kChunksPerRow));
    *p = round_to_tf32(*p);
  }
}

// Weights go to shared memory once per CTA, rounded, in the order the MMA reads them: float
// ((ks * kNTiles/2 + q) * 32 + lane) * 4 + e holds, for lane (g = lane/4, t = lane%4), the B-fragment element
// b[e&1] of n-tile 2q + e/2, i.e. B[k = t + 4*(e&1)][n = g]: one conflict-free 16-byte load per n-tile pair.
template <class T>
__device__ void stage_weights(float* wsm, float* bsm, const float* __restrict__ w, const float* __restrict__ b) {
  for (int i = threadIdx.x; i < T::kWeightFloats; i += T::kThreads) {
    const int e = i & 3, lane = (i >> 2) & 31;
    const int q = (i >> 7) % (T::kNTiles / 2);
    const int ks = (i >> 7) / (T::kNTiles / 2);
    const int co = (2 * q + (e >> 1)) * 8 + (lane >> 2);
    const int ci = (ks % (T::kCin / 8)) * 8 + (lane & 3) + 4 * (e & 1);
    wsm[i] = round_to_tf32(w[(co * T::kCin + ci) * T::kTaps + ks / (T::kCin / 8)]);
  }
  for (int i = threadIdx.x; i < T::kCout; i += T::kThreads) bsm[i] = b[i];
}

// Consumer, one warp. A fragment (m16n8k8, row-major): lane (g, t) holds a0 = A[g][t], a1 = A[g+8][t],
// a2 = A[g][t+4], a3 = A[g+8][t+4], where A[pixel p][k] sits at a_rows[kh][cb*8*kPitch + p + kw] (a_rows already
// point at channel t, pixel g of this warp).
template <class T>
__device__ __forceinline__ void conv_tile_mma(float (&acc)[T::kMTiles][T::kNTiles][4],
                                              const float* const (&a_rows)[3], const float* wsm, int lane) {
#pragma unroll
  for (int ks = 0; ks < T::kKSteps; ++ks) {
    const float4* wq = reinterpret_cast<const float4*>(wsm) + ks * (T::kNTiles / 2) * 32 + lane;
    float4 bq[T::kNTiles / 2];
#pragma unroll
    for (int q = 0; q < T::kNTiles / 2; ++q) bq[q] = wq[q * 32];
    const int tap = ks / (T::kCin / 8), cb = ks % (T::kCin / 8);
    const float* a_ptr = a_rows[tap / 3] + cb * 8 * T::kPitch + tap % 3;
#pragma unroll
    for (int mt = 0; mt < T::kMTiles; ++mt) {
      const uint32_t a[4] = {__float_as_uint(a_ptr[mt * 16]), __float_as_uint(a_ptr[mt * 16 + 8]),
                             __float_as_uint(a_ptr[mt * 16 + 4 * T::kPitch]),
                             __float_as_uint(a_ptr[mt * 16 + 8 + 4 * T::kPitch])};
#pragma unroll
      for (int q = 0; q < T::kNTiles / 2; ++q) {
        mma_m16n8k8_tf32(acc[mt][2 * q], a, bq[q].x, bq[q].y);
        mma_m16n8k8_tf32(acc[mt][2 * q + 1], a, bq[q].z, bq[q].w);
      }
    }
  }
}

// C fragment: lane (g, t) holds c0, c1 = C[g][2t, 2t+1] and c2, c3 = C[g+8][2t, 2t+1] of each n8 tile.
template <class T>
__device__ __forceinline__ void init_acc_with_bias(float (&acc)[T::kMTiles][T::kNTiles][4], const float* bsm,
                                                   int lane) {
#pragma unroll
  for (int nt = 0; nt < T::kNTiles; ++nt) {
    const float2 bb = *reinterpret_cast<const float2*>(bsm + nt * 8 + 2 * (lane & 3));
#pragma unroll
    for (int mt = 0; mt < T::kMTiles; ++mt) {
      acc[mt][nt][0] = bb.x;
      acc[mt][nt][1] = bb.y;
      acc[mt][nt][2] = bb.x;
      acc[mt][nt][3] = bb.y;
    }
  }
}

// Epilogue: min over the lane's 2*kNTiles channels of pixels g and g+8, then over the quad (xor 1, 2): every lane
// of the quad ends with the minima over all kCout channels. Lane t then stores m-tile t: coalesced stores.
template <class T>
__device__ __forceinline__ void min_tanh2_store(const float (&acc)[T::kMTiles][T::kNTiles][4], float* out_row,
                                                int warp_col0, int OW, int lane) {
  const int g = lane >> 2, t = lane & 3;
  float lo_t = 0.f, hi_t = 0.f;
#pragma unroll
  for (int mt = 0; mt < T::kMTiles; ++mt) {
    float lo = nan_min(acc[mt][0][0], acc[mt][0][1]);
    float hi = nan_min(acc[mt][0][2], acc[mt][0][3]);
#pragma unroll
    for (int nt = 1; nt < T::kNTiles; ++nt) {
      lo = nan_min(lo, nan_min(acc[mt][nt][0], acc[mt][nt][1]));
      hi = nan_min(hi, nan_min(acc[mt][nt][2], acc[mt][nt][3]));
    }
    lo = nan_min(lo, __shfl_xor_sync(0xffffffffu, lo, 1));
    hi = nan_min(hi, __shfl_xor_sync(0xffffffffu, hi, 1));
    lo = nan_min(lo, __shfl_xor_sync(0xffffffffu, lo, 2));
    hi = nan_min(hi, __shfl_xor_sync(0xffffffffu, hi, 2));
    if (mt == t) {
      lo_t = lo;
      hi_t = hi;
    }
  }
  const int col = warp_col0 + t * 16 + g;
  if (col < OW) out_row[col] = tanh2(lo_t);
  if (col + 8 < OW) out_row[col + 8] = tanh2(hi_t);
}

// Persistent. The next input row is prefetched (cp.async) while the current one is computed; a strip change
// (new image or column block) refills the window synchronously.
template <class T>
__global__ void __launch_bounds__(T::kThreads, T::kMinBlocksPerSm)
    conv3x3_min_tanh2_mma_sync_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                      const float* __restrict__ b, float* __restrict__ out, int H, int W,
                                      int64_t total_steps) {
  extern __shared__ __align__(128) float smem[];
  float* ring = smem;
  float* wsm = ring + T::kRing * T::kSlotFloats;
  float* bsm = wsm + T::kWeightFloats;
  const int OH = H - (T::kKsize - 1), OW = W - (T::kKsize - 1);
  const int col_blocks = (OW + T::kTileCols - 1) / T::kTileCols;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool vec16 = (W % 4 == 0) && ((reinterpret_cast<uintptr_t>(x) & 15) == 0);
  auto slot = [&](int y) { return ring + (y % T::kRing) * T::kSlotFloats; };

  stage_weights<T>(wsm, bsm, w, b);  // published by the barrier of the first window fill

  int64_t s_begin, s_end;
  cta_step_range(total_steps, s_begin, s_end);
  StepWalker at(s_begin, OH, col_blocks);
  for (int64_t s = s_begin; s < s_end; ++s, at.advance()) {
    const int oy = at.oy, col0 = at.cb * T::kTileCols;
    const float* x_img = x + at.n * T::kCin * ((int64_t)H * W);
    if (s == s_begin || oy == 0) {
      for (int r = 0; r < T::kKsize; ++r) load_input_row<T>(slot(oy + r), x_img, oy + r, col0, H, W, vec16);
      cp_async_wait<0>();
      for (int r = 0; r < T::kKsize; ++r) round_row<T>(slot(oy + r));
      __syncthreads();
    }
    // Row oy+3 goes to the slot that row oy-1 used; the barrier that closed the last step freed it.
    const bool prefetch = (s + 1 < s_end) && (oy + 1 < OH);
    if (prefetch) load_input_row<T>(slot(oy + T::kKsize), x_img, oy + T::kKsize, col0, H, W, vec16);

    const int warp_col = warp * T::kWarpCols;
    if (col0 + warp_col < OW) {
      float acc[T::kMTiles][T::kNTiles][4];
      init_acc_with_bias<T>(acc, bsm, lane);
      const int lane_offset = (lane & 3) * T::kPitch + warp_col + (lane >> 2);
      const float* const a_rows[3] = {slot(oy) + lane_offset, slot(oy + 1) + lane_offset, slot(oy + 2) + lane_offset};
      conv_tile_mma<T>(acc, a_rows, wsm, lane);
      min_tanh2_store<T>(acc, out + (at.n * OH + oy) * (int64_t)OW, col0 + warp_col, OW, lane);
    }
    if (prefetch) {
      cp_async_wait<0>();
      round_row<T>(slot(oy + T::kKsize));
    }
    __syncthreads();
  }
}

// ================================================================ wgmma kernel
// Producer: starts the copy of input row y into a slot laid out [group][column][4 channels]. Item (group,
// column) is one 16-byte chunk gathered from 4 channel planes; consecutive threads take consecutive columns, so
// each of the 4 copies is coalesced across the warp. round_row_grouped() visits the same items per thread.
template <class T>
__device__ __forceinline__ void load_row_grouped(float* slot, const float* __restrict__ x_img, int y, int col0, int H,
                                                 int W) {
  const int64_t plane = (int64_t)H * W;
  const float* src_row = x_img + (int64_t)y * W + col0;
  for (int item = threadIdx.x; item < T::kGroups * T::kInCols; item += T::kThreads) {
    const int grp = item / T::kInCols, col = item - grp * T::kInCols;
    const bool valid = col0 + col < W;
    float* dst = slot + (grp * T::kPitchCols + col) * 4;
#pragma unroll
    for (int c = 0; c < 4; ++c) cp_async_4(dst + c, valid ? src_row + (grp * 4 + c) * plane + col : x_img, valid);
  }
  cp_async_commit();
}

template <class T>
__device__ __forceinline__ void round_row_grouped(float* slot) {
  for (int item = threadIdx.x; item < T::kGroups * T::kInCols; item += T::kThreads) {
    const int grp = item / T::kInCols, col = item - grp * T::kInCols;
    float4* p = reinterpret_cast<float4*>(slot + (grp * T::kPitchCols + col) * 4);
    *p = round_to_tf32(*p);
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // wgmma reads the slot through the async proxy
}

// A operand for the whole kernel: warp w holds output channels (rows) 16w + g and 16w + g + 8 at k = t and t + 4
// of every k-step, in the m16n8k8 A-fragment order a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4).
template <class T>
__device__ __forceinline__ void load_weight_fragments(uint32_t (&wa)[T::kKSteps][4], const float* __restrict__ w) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int ks = 0; ks < T::kKSteps; ++ks) {
    const int tap = ks / (T::kCin / 8), ci = (ks % (T::kCin / 8)) * 8 + t;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int co = warp * 16 + g + 8 * (i & 1);
      wa[ks][i] = __float_as_uint(round_to_tf32(__ldg(w + (co * T::kCin + ci + 4 * (i >> 1)) * T::kTaps + tap)));
    }
  }
}

// Consumer: 18 back-to-back m64n256k8 into one accumulator, then one wait. B for k-step (kh, kw, cb): the slot of
// input row oy + kh, channel groups 2cb and 2cb+1 (K-direction core matrices kGroupBytes apart), starting kw
// columns in (N-direction core matrices 8 columns = 128 bytes apart).
template <class T>
__device__ __forceinline__ void conv_row_wgmma(float (&acc)[T::kNBlocks][4], const uint32_t (&wa)[T::kKSteps][4],
                                               const float* const (&rows)[3]) {
  uint64_t desc[3];
#pragma unroll
  for (int kh = 0; kh < 3; ++kh) desc[kh] = wgmma_desc(rows[kh], T::kGroupBytes, 128);
#pragma unroll
  for (int j = 0; j < T::kNBlocks; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) fence_operand(acc[j][i]);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < T::kKSteps; ++ks) {
    const int tap = ks / (T::kCin / 8), cb = ks % (T::kCin / 8);
    const uint32_t offset_16b = (2 * cb * T::kGroupBytes + (tap % 3) * 16) >> 4;
    wgmma_m64n256k8_tf32(acc, wa[ks], desc[tap / 3] + offset_16b);
  }
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < T::kNBlocks; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) fence_operand(acc[j][i]);
}

// Epilogue. D fragment: lane (g, t) of warp w holds channels 16w+g (i = 0, 1) and 16w+g+8 (i = 2, 3) at pixels
// 8j + 2t + (i & 1). Min over its two channels, then with lane g^1 (xor 4); the 16 partial minima per pixel
// (4 warps x 4 lane pairs) meet in shared memory, where each thread finishes 2 pixels.
template <class T>
__device__ __forceinline__ void min_tanh2_store_wgmma(const float (&acc)[T::kNBlocks][4], float* red, float* out_row,
                                                      int col0, int OW) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  float* red_row = red + (warp * 4 + (g >> 1)) * T::kRedPitch + 2 * t;
#pragma unroll
  for (int j = 0; j < T::kNBlocks; ++j) {
    float m0 = nan_min(acc[j][0], acc[j][2]);
    float m1 = nan_min(acc[j][1], acc[j][3]);
    m0 = nan_min(m0, __shfl_xor_sync(0xffffffffu, m0, 4));
    m1 = nan_min(m1, __shfl_xor_sync(0xffffffffu, m1, 4));
    if ((j >= T::kNBlocks / 2) == (g & 1)) *reinterpret_cast<float2*>(red_row + 8 * j) = make_float2(m0, m1);
  }
  __syncthreads();
  const int p = 2 * threadIdx.x;
  float2 v = *reinterpret_cast<const float2*>(red + p);
#pragma unroll
  for (int r = 1; r < T::kRedRows; ++r) {
    const float2 u = *reinterpret_cast<const float2*>(red + r * T::kRedPitch + p);
    v.x = nan_min(v.x, u.x);
    v.y = nan_min(v.y, u.y);
  }
  if (col0 + p < OW) out_row[col0 + p] = tanh2(v.x);
  if (col0 + p + 1 < OW) out_row[col0 + p + 1] = tanh2(v.y);
}

// Persistent. Two rows are prefetched ahead (cp.async groups, one per row); a strip change refills the window
// synchronously.
template <class T>
__global__ void __launch_bounds__(T::kThreads, T::kMinBlocksPerSm)
    conv3x3_min_tanh2_wgmma_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                   const float* __restrict__ b, float* __restrict__ out, int H, int W,
                                   int64_t total_steps) {
#if KB25_HAS_WGMMA
  extern __shared__ __align__(128) float smem[];
  float* ring = smem;
  float* red = ring + T::kRing * T::kSlotFloats;
  const int OH = H - (T::kKsize - 1), OW = W - (T::kKsize - 1);
  const int col_blocks = (OW + T::kTileCols - 1) / T::kTileCols;
  auto slot = [&](int y) { return ring + (y % T::kRing) * T::kSlotFloats; };

  uint32_t wa[T::kKSteps][4];
  load_weight_fragments<T>(wa, w);
  const int co = (threadIdx.x >> 5) * 16 + ((threadIdx.x & 31) >> 2);
  const float bias_lo = __ldg(b + co), bias_hi = __ldg(b + co + 8);

  int64_t s_begin, s_end;
  cta_step_range(total_steps, s_begin, s_end);
  StepWalker at(s_begin, OH, col_blocks);
  for (int64_t s = s_begin; s < s_end; ++s, at.advance()) {
    const int oy = at.oy, col0 = at.cb * T::kTileCols;
    const float* x_img = x + at.n * T::kCin * ((int64_t)H * W);
    const bool has_next = (s + 1 < s_end) && (oy + 1 < OH);   // step s+1 needs row oy+3
    const bool has_next2 = (s + 2 < s_end) && (oy + 2 < OH);  // step s+2 needs row oy+4
    if (s == s_begin || oy == 0) {
      for (int r = 0; r < T::kKsize; ++r) load_row_grouped<T>(slot(oy + r), x_img, oy + r, col0, H, W);
      cp_async_wait<0>();
      for (int r = 0; r < T::kKsize; ++r) round_row_grouped<T>(slot(oy + r));
      __syncthreads();
      if (has_next) load_row_grouped<T>(slot(oy + 3), x_img, oy + 3, col0, H, W);
    }
    // Row oy+4 goes to the slot that row oy-1 used; the barrier that closed the last step freed it.
    if (has_next2) load_row_grouped<T>(slot(oy + 4), x_img, oy + 4, col0, H, W);

    float acc[T::kNBlocks][4];
#pragma unroll
    for (int j = 0; j < T::kNBlocks; ++j) {
      acc[j][0] = acc[j][1] = bias_lo;
      acc[j][2] = acc[j][3] = bias_hi;
    }
    const float* const rows[3] = {slot(oy), slot(oy + 1), slot(oy + 2)};
    conv_row_wgmma<T>(acc, wa, rows);
    min_tanh2_store_wgmma<T>(acc, red, out + (at.n * OH + oy) * (int64_t)OW, col0, OW);
    if (has_next) {
      if (has_next2) {
        cp_async_wait<1>();  // row oy+3 has landed; oy+4 may still be in flight
      } else {
        cp_async_wait<0>();
      }
      round_row_grouped<T>(slot(oy + 3));
    }
    __syncthreads();
  }
#endif
}

// ================================================================ epilogue after a library conv
// What the reference does after its conv: torch.min over dim 1 (the channels of a batched conv output, the rows
// of an unbatched one), tanh, tanh. y is viewed as [outer][reduce][inner] (contiguous), out as [outer][inner].
// Each thread reduces kVec adjacent inner elements, one 16-byte load per reduce step where the rows are aligned;
// a warp reads consecutive vectors of one row per load, so every load is coalesced. The min is taken on values
// widened to the math type (exact); each tanh result is rounded to the element type, as torch rounds it.
template <class Elem>
struct MathOf {
  using type = float;  // float, half and bfloat16: torch computes their tanh in float
};
template <>
struct MathOf<double> {
  using type = double;
};

__device__ __forceinline__ double nan_min(double a, double b) { return (a < b || a != a) ? a : b; }
__device__ __forceinline__ float tanh_of(float v) { return tanhf(v); }
__device__ __forceinline__ double tanh_of(double v) { return tanh(v); }

template <class Elem, int kVec>
struct alignas(sizeof(Elem) * kVec) ElemVec {
  Elem v[kVec];
};

template <class Elem, int kVec>
__global__ void __launch_bounds__(256) min_dim1_tanh2_kernel(const Elem* __restrict__ y, Elem* __restrict__ out,
                                                             int64_t outer, int64_t reduce, int64_t inner) {
  using Math = typename MathOf<Elem>::type;
  using V = ElemVec<Elem, kVec>;
  const int64_t groups = inner / kVec;
  const int64_t total = outer * groups;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t o = i / groups;
    const int64_t p = (i - o * groups) * kVec;
    const V* src = reinterpret_cast<const V*>(y + o * reduce * inner + p);
    const V first = src[0];
    Math m[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) m[e] = static_cast<Math>(first.v[e]);
#pragma unroll 4
    for (int64_t r = 1; r < reduce; ++r) {
      const V u = src[r * groups];
#pragma unroll
      for (int e = 0; e < kVec; ++e) m[e] = nan_min(m[e], static_cast<Math>(u.v[e]));
    }
    V res;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const Elem t1 = static_cast<Elem>(tanh_of(m[e]));
      res.v[e] = static_cast<Elem>(tanh_of(static_cast<Math>(t1)));
    }
    *reinterpret_cast<V*>(out + o * inner + p) = res;
  }
}

}  // namespace kb25

// ================================================================ launchers (raw pointers, current stream)
template <class T, class Kernel>
static cudaError_t launch_persistent(Kernel kernel, const float* x, const float* w, const float* b, float* out,
                                     int64_t N, int H, int W, int num_sms, cudaStream_t stream) {
  const int OH = H - (T::kKsize - 1), OW = W - (T::kKsize - 1);
  const int64_t steps = N * ((OW + T::kTileCols - 1) / T::kTileCols) * OH;
  if (steps <= 0) return cudaSuccess;
  // Opting in to more than 48 KB of shared memory is per device and sticks: do it once per device and kernel.
  static bool smem_opted_in[64] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= 64 || !smem_opted_in[device]) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)T::kSmemBytes);
    if (err != cudaSuccess) return err;
    if (device < 64) smem_opted_in[device] = true;
  }
  const int64_t resident = (int64_t)num_sms * T::kMinBlocksPerSm;
  const int grid = (int)(steps < resident ? steps : resident);
  kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(x, w, b, out, H, W, steps);
  return cudaGetLastError();
}

// use_wgmma: the caller has checked that the device is sm_90 and this code was built for sm_90a.
extern "C" cudaError_t launch_conv3x3_min_tanh2_tf32(const float* x, const float* w, const float* b, float* out,
                                                     int64_t N, int H, int W, bool use_wgmma, int num_sms,
                                                     cudaStream_t stream) {
  using Wg = kb25::WgmmaTraits<KB25_FUSED_CIN, KB25_FUSED_COUT>;
  using Ms = kb25::MmaSyncTraits<KB25_FUSED_CIN, KB25_FUSED_COUT>;
  if (use_wgmma) {
    return launch_persistent<Wg>(kb25::conv3x3_min_tanh2_wgmma_kernel<Wg>, x, w, b, out, N, H, W, num_sms, stream);
  }
  return launch_persistent<Ms>(kb25::conv3x3_min_tanh2_mma_sync_kernel<Ms>, x, w, b, out, N, H, W, num_sms, stream);
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
"""

def _wgmma_m64n256k8_source():
    """The m64n256k8 wrapper: 128 accumulator operands are written out here rather than by hand."""
    d_regs = ", ".join(f"%{i}" for i in range(128))
    d_ops = ", ".join(f'"+f"(d[{i // 4}][{i % 4}])' for i in range(128))
    return f"""// D(64 x 256) += A(64 x 8, registers: this warp's 16 rows) * B(8 x 256, shared memory, K-major).
__device__ __forceinline__ void wgmma_m64n256k8_tf32(float (&d)[32][4], const uint32_t (&a)[4], uint64_t desc_b) {{
#if KB25_HAS_WGMMA
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 {{{d_regs}}}, {{%128, %129, %130, %131}}, %132, 1, 1, 1;\\n"
      : {d_ops}
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
#endif
}}"""


# ------------------------------------------------------------------------------------------------ C++ op
CPP_SOURCE = r"""
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
@SHARED_DECLARATIONS@
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

bool wgmma_available_on(int device) {
#ifdef KB25_BUILT_FOR_SM90A
  const auto* props = at::cuda::getDeviceProperties(device);
  return props->major == 9 && props->minor == 0;
#else
  return false;
#endif
}

// The reference conv runs in TF32 exactly when cuDNN runs it (cuDNN enabled) and TF32 is allowed for cuDNN convs:
// the test cuDNN's own conv applies.
bool conv_runs_in_tf32() {
  const auto& ctx = at::globalContext();
  return ctx.userEnabledCuDNN() && ctx.allowTF32CuDNN(at::Float32Op::CONV);
}

bool fused_supports(const at::Tensor& x, const at::Tensor& weight) {
  return x.dim() == 4 && x.scalar_type() == at::kFloat && weight.size(0) == KB25_FUSED_COUT &&
         weight.size(1) == KB25_FUSED_CIN && weight.size(2) == KB25_FUSED_KSIZE && weight.size(3) == KB25_FUSED_KSIZE;
}

}  // namespace

// The same checks, in the same order and words, as check_input() in model_new.py (the CPU and fake kernels); the
// tests run one table of bad inputs through both.
void check_input(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK_VALUE(x.dim() == 3 || x.dim() == 4,
                    "ModelNew expects a 3-D (C, H, W) or 4-D (N, C, H, W) input, got shape " + shape_str(x.sizes()));
  TORCH_CHECK_VALUE(x.device() == weight.device(), "ModelNew expects input on " + weight.device().str() +
                                                       " (the device of its weights), got " + x.device().str());
  TORCH_CHECK_VALUE(x.scalar_type() == weight.scalar_type() && supported_dtype(x.scalar_type()),
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

bool wgmma_available() { return wgmma_available_on(c10::cuda::current_device()); }

// The decision table of backend "auto" on CUDA (README, "Which path runs"); a forced backend is checked here.
int64_t resolve_backend(const at::Tensor& x, const at::Tensor& weight, int64_t requested) {
  TORCH_CHECK_VALUE(requested >= 0 && requested < kb25::kBackendCount,
                    "ModelNew backend code must be 0.." + num(kb25::kBackendCount - 1) + ", got " + num(requested));
  if (requested == kb25::kBackendAuto) {
    return fused_supports(x, weight) && conv_runs_in_tf32() ? kb25::kBackendFused : kb25::kBackendCudnnEpilogue;
  }
  if (requested == kb25::kBackendFused || requested == kb25::kBackendFusedMmaSync) {
    TORCH_CHECK_VALUE(fused_supports(x, weight),
                      "ModelNew backend '" + std::string(kb25::kBackendNames[requested]) +
                          "' needs a 4-D float32 input and a " + num(KB25_FUSED_CIN) + "->" + num(KB25_FUSED_COUT) +
                          " " + num(KB25_FUSED_KSIZE) + "x" + num(KB25_FUSED_KSIZE) + " conv, got a " +
                          num(x.dim()) + "-D " + dtype_name(x.scalar_type()) + " input and weight " +
                          shape_str(weight.sizes()));
  }
  return requested;
}

// (N, 16, H, W) -> (N, 1, H-2, W-2) in one kernel, TF32 operands rounded to nearest.
at::Tensor fused_conv3x3_min_tanh2(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                   bool use_wgmma) {
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), bc = bias.contiguous();
  const int64_t N = xc.size(0), H = xc.size(2), W = xc.size(3);
  TORCH_CHECK_VALUE(H <= INT32_MAX && W <= INT32_MAX, "ModelNew expects H and W below 2^31, got " + shape_str(xc.sizes()));
  at::Tensor out = at::empty({N, 1, H - (KB25_FUSED_KSIZE - 1), W - (KB25_FUSED_KSIZE - 1)}, xc.options());
  const cudaError_t err = launch_conv3x3_min_tanh2_tf32(
      xc.data_ptr<float>(), wc.data_ptr<float>(), bc.data_ptr<float>(), out.data_ptr<float>(), N, (int)H, (int)W,
      use_wgmma, at::cuda::getCurrentDeviceProperties()->multiProcessorCount, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "ModelNew: the fused kernel did not launch: " + std::string(cudaGetErrorString(err)));
  return out;
}

// cuDNN's conv through ATen (every torch.backends.cudnn setting applies), then one kernel: min over dim 1 (channels
// of a batched output, rows of an unbatched one, as torch.min(dim=1) in the reference), tanh, tanh.
at::Tensor cudnn_conv_then_epilogue(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const at::Tensor y = at::conv2d(x.contiguous(), weight, bias).contiguous();
  std::vector<int64_t> out_sizes = y.sizes().vec();
  out_sizes[1] = 1;
  at::Tensor out = at::empty(out_sizes, y.options());
  const int64_t outer = y.size(0), reduce = y.size(1);
  const int64_t inner = outer * reduce == 0 ? 0 : y.numel() / (outer * reduce);
  const cudaError_t err = launch_min_dim1_tanh2(elem_code(y.scalar_type()), y.data_ptr(), out.data_ptr(), outer,
                                                reduce, inner, at::cuda::getCurrentDeviceProperties()->multiProcessorCount,
                                                at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "ModelNew: the epilogue kernel did not launch: " + std::string(cudaGetErrorString(err)));
  return out;
}

// The CUDA kernel of the op kb25::conv_min_tanh2; ModelNew also calls it directly in eager mode.
at::Tensor conv_min_tanh2(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t backend) {
  check_input(x, weight, bias);
  TORCH_CHECK_VALUE(x.is_cuda(), "ModelNew's CUDA kernel needs CUDA tensors, got " + x.device().str());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t chosen = resolve_backend(x, weight, backend);
  if (chosen == kb25::kBackendCudnnEpilogue) return cudnn_conv_then_epilogue(x, weight, bias);
  return fused_conv3x3_min_tanh2(x, weight, bias, chosen == kb25::kBackendFused && wgmma_available_on(x.get_device()));
}

TORCH_LIBRARY_IMPL(KB25_OP_NAMESPACE, CUDA, m) { m.impl(KB25_OP_NAME, TORCH_FN(conv_min_tanh2)); }
"""

EXTENSION_FUNCTIONS = ["conv_min_tanh2", "resolve_backend", "wgmma_available"]


def cuda_source():
    """The complete CUDA translation unit (no torch headers: plain nvcc compiles it)."""
    src = CUDA_SOURCE.replace("@SHARED_DECLARATIONS@", _shared_declarations())
    return src.replace("@WGMMA_M64N256K8@", _wgmma_m64n256k8_source())


def cpp_source():
    return CPP_SOURCE.replace("@SHARED_DECLARATIONS@", _shared_declarations())


# ------------------------------------------------------------------------------------------------ build at import
def _arch_flags():
    """nvcc targets for the visible GPUs; sm_90 is built as sm_90a so that the wgmma kernel exists there."""
    flags, defines = [], []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
        flag = f"-gencode=arch=compute_{arch},code=sm_{arch}"
        if flag not in flags:
            flags.append(flag)
        if arch == "90a" and not defines:
            defines.append("-DKB25_BUILT_FOR_SM90A")
    return flags, defines


def _build_extension():
    """Compile once per source version (torch caches the build). Only where CUDA is available: a failed build
    raises here, at import, with the compiler's message."""
    if not torch.cuda.is_available():
        return None
    from torch.utils.cpp_extension import load_inline

    extra = {}
    if "no_implicit_headers" in inspect.signature(load_inline).parameters:
        extra["no_implicit_headers"] = True  # the sources include what they use; keeps torch out of the .cu
    arch_flags, cpp_defines = _arch_flags()
    return load_inline(
        name=EXTENSION_NAME,
        cpp_sources=[cpp_source()],
        cuda_sources=[cuda_source()],
        functions=EXTENSION_FUNCTIONS,
        extra_cflags=["-O3", *cpp_defines],
        extra_cuda_cflags=["-O3", "-std=c++17", *arch_flags],
        verbose=False,
        **extra,
    )


_ext = _build_extension()


def extension_available():
    return _ext is not None


# ------------------------------------------------------------------------------------------------ the op
def check_input(x, weight, bias):
    """The input checks of the CPU and fake kernels: the same order and words as check_input() in the C++ op."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"ModelNew expects a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (3, 4):
        raise ValueError(f"ModelNew expects a 3-D (C, H, W) or 4-D (N, C, H, W) input, got shape {list(x.shape)}")
    if x.device != weight.device:
        raise ValueError(f"ModelNew expects input on {weight.device} (the device of its weights), got {x.device}")
    if x.dtype != weight.dtype or x.dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise ValueError(f"ModelNew expects input of its weights' dtype {str(weight.dtype)} "
                         f"(supported: {supported}), got {str(x.dtype)}")
    if weight.dim() != 4 or x.shape[-3] != weight.shape[1]:
        raise ValueError(f"ModelNew expects {weight.shape[1]} input channels, got {x.shape[-3]}")
    kh, kw = weight.shape[2], weight.shape[3]
    if x.shape[-2] < kh or x.shape[-1] < kw:
        raise ValueError(f"ModelNew expects H >= {kh} and W >= {kw} (the kernel size), "
                         f"got H={x.shape[-2]}, W={x.shape[-1]}")
    if bias.dim() != 1 or bias.shape[0] != weight.shape[0] or bias.device != weight.device or bias.dtype != weight.dtype:
        raise ValueError(f"ModelNew expects a bias of shape [{weight.shape[0]}] like its weights, got "
                         f"{list(bias.shape)} {str(bias.dtype)} on {bias.device}")


def reference_math(x, weight, bias):
    """The reference's forward in torch ops: conv (valid, stride 1), min over dim 1 (keepdim), tanh, tanh."""
    y = torch.conv2d(x, weight, bias)
    return torch.tanh(torch.tanh(torch.min(y, dim=1, keepdim=True)[0]))


def output_shape(x, weight):
    """(N, 1, H-k+1, W-k+1) for a batched input; (C_out, 1, W-k+1) for an unbatched one, whose dim 1 is the rows."""
    oh, ow = x.shape[-2] - weight.shape[2] + 1, x.shape[-1] - weight.shape[3] + 1
    return (x.shape[0], 1, oh, ow) if x.dim() == 4 else (weight.shape[0], 1, ow)


def reference_backward(grad_out, x, weight, bias, needs_grad):
    """Gradients of reference_math by its own chain: recompute the conv, scatter through the argmin that torch.min
    picks, tanh_backward twice, then the conv's backward. Nothing is kept from the forward but its inputs."""
    batched = x.dim() == 4
    x4 = x if batched else x.unsqueeze(0)
    grad4 = grad_out if batched else grad_out.unsqueeze(0)
    dim = 1 if batched else 2  # dim 1 of the unbatched output is the rows
    y = torch.conv2d(x4, weight, bias)
    m, argmin = torch.min(y, dim=dim, keepdim=True)
    t1 = torch.tanh(m)
    t2 = torch.tanh(t1)
    grad_m = torch.ops.aten.tanh_backward(torch.ops.aten.tanh_backward(grad4, t2), t1)
    grad_y = torch.zeros_like(y).scatter_(dim, argmin, grad_m)
    grads = torch.ops.aten.convolution_backward(
        grad_y, x4, weight, [weight.shape[0]], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, list(needs_grad))
    gx, gw, gb = (g if need else None for g, need in zip(grads, needs_grad))  # masked ones may come back as zeros
    if gx is not None and not batched:
        gx = gx.squeeze(0)
    return gx, gw, gb


def _backend_name(code):
    """The op's backend argument, checked as the C++ op checks it."""
    if not 0 <= code < len(OP_BACKENDS):
        raise ValueError(f"ModelNew backend code must be 0..{len(OP_BACKENDS) - 1}, got {code}")
    return OP_BACKENDS[code]


def _conv_min_tanh2_cpu(x, weight, bias, backend):
    check_input(x, weight, bias)
    name = _backend_name(backend)
    if name != "auto":
        raise ValueError(f"ModelNew backend {name!r} needs CUDA input, got {x.device}")
    return reference_math(x, weight, bias)


def _conv_min_tanh2_fake(x, weight, bias, backend):
    check_input(x, weight, bias)
    _backend_name(backend)
    return x.new_empty(output_shape(x, weight))


def _setup_context(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.save_for_backward(x, weight, bias)


def _backward(ctx, grad_out):
    x, weight, bias = ctx.saved_tensors
    return (*reference_backward(grad_out, x, weight, bias, ctx.needs_input_grad[:3]), None)


def _define_op():
    """Declare kb25::conv_min_tanh2 and its CPU, fake and autograd kernels (the CUDA kernel is the C++ function
    conv_min_tanh2, registered by the extension). Once per process: the registrations live as long as the process,
    so a second execution of this file (KernelBench executes its text once per evaluation) finds the op in place."""
    op = torch.library.custom_op(f"{OP_NAMESPACE}::{OP_NAME}", _conv_min_tanh2_cpu, mutates_args=(),
                                 device_types="cpu", schema=OP_SCHEMA)
    op.register_fake(_conv_min_tanh2_fake)
    op.register_autograd(_backward, setup_context=_setup_context)


if not hasattr(getattr(torch.ops, OP_NAMESPACE), OP_NAME):
    _define_op()
conv_min_tanh2 = getattr(getattr(torch.ops, OP_NAMESPACE), OP_NAME).default


def fused_mma_kind():
    """Which tensor-core instruction the 'fused' backend uses on the current device."""
    return "wgmma" if _ext.wgmma_available() else "mma_sync"


# ------------------------------------------------------------------------------------------------ module
class ModelNew(nn.Module):
    """Drop-in for reference.Model: same constructor, parameters, state_dict and output."""

    def __init__(self, in_channels, out_channels, kernel_size, *, backend="auto"):
        super().__init__()
        # Holds the parameters (same names, shapes and seeded init as the reference's); forward never calls it.
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.backend = backend

    @property
    def backend(self):
        return self._backend

    @backend.setter
    def backend(self, value):
        name = BACKEND_ALIASES.get(value, value)
        if name not in BACKENDS:
            raise ValueError(f"ModelNew backend must be one of {BACKENDS} (or an alias in {tuple(BACKEND_ALIASES)}), "
                             f"got {value!r}")
        self._backend = name
        self._op_backend = OP_BACKENDS.index(name) if name in OP_BACKENDS else None

    def resolve_backend(self, x):
        """Which backend runs for this input (auto resolved by the C++ decision table on CUDA)."""
        if self._op_backend is None or x.device.type != "cuda":
            return self._backend if self._op_backend is None else "torch"
        return OP_BACKENDS[_ext.resolve_backend(x, self.conv.weight, self._op_backend)]

    def forward(self, x):
        # The live parameter dict, read directly: nn.Module.__getattr__ costs about 0.6 us a lookup, three per call
        # (conv, weight, bias). .to(), load_state_dict and assignment all update this same dict.
        params = self._modules["conv"]._parameters
        weight, bias = params["weight"], params["bias"]
        backend = self._op_backend
        if backend is None:
            check_input(x, weight, bias)
            return reference_math(x, weight, bias)
        if (not torch.compiler.is_compiling() and type(x) is torch.Tensor and x.is_cuda
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad))):
            return _ext.conv_min_tanh2(x, weight, bias, backend)  # the op's CUDA kernel, called directly
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"ModelNew expects a torch.Tensor, got {type(x).__name__}")
        return conv_min_tanh2(x, weight, bias, backend)
