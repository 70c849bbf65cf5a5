// 1-D Winograd F(2, 3) along the rows against direct convolution, for strict fp32 on fp16 parts and for the 16-bit
// kernels (docs/perf-notes.md, Next (c)): the rate of each form's consumer step with its epilogue, two consumer
// warpgroups a CTA, one CTA a SM, no producer (the operands stay in shared memory), fp16 operands that are small
// random values.
// - direct (the strict kernel's step, 128 pixels): 9 k-steps x 3 products, m64n128k16, A = the weights' hi or lo copy
//   and B = x's hi or lo copy, both from shared memory; the big products into one accumulator, the two small ones into
//   another (64 registers each); epilogue: big + small * 2^-11 (64 FFMA), the min over the thread's 2 channels, the
//   3-step halving butterfly, 4 minima a lane into shared memory, a named barrier, the min over the 4 warps.
// - winograd (128 pixels = 64 tiles of 2): 4 points x 3 kernel rows x 3 products, m64n64k16 (N = the 64 tiles, K = the
//   16 input channels): U_hi x V_hi and U_hi x V_lo with U_hi from registers (48 a thread, held for the run), U_lo x
//   V_hi with U_lo from shared memory; one accumulator a point (4 x 32 registers), all three products in it; epilogue:
//   A^T M (y0 = M0 + M1 + M2, y1 = M1 - M2 - M3: 128 FADD a thread), then the same min, butterfly and barrier.
//   `winograd, A smem` reads U_hi from shared memory too. The rate model reuses U_hi for U_hi x V_lo; a kernel with one
//   accumulator a point needs a third copy there, U_hi * 2^-11, which fits in shared memory but not in registers (96
//   weight registers beside 128 accumulators), so `A smem` is the form such a kernel could take.
// - 16-bit direct (the bf16 / fp16 kernels' step, 256 pixels): 10 k-steps (9 taps, the bias) of m64n256k16, one
//   product, both operands from shared memory; epilogue: the same fp32 reduce for each 128-pixel half (the kernels
//   themselves pack their minima to 16 bits first, which this does not model).
// - 16-bit winograd (128 pixels): the winograd form with one product (U_hi x V_hi, 12 MMAs) and the same epilogue.
// - `packed`: the 16-bit forms with the 16-bit kernels' reduce instead (reduce_packed_and_meet); `handed`: the same,
//   ending at the stores of the packed minima, as where other threads write the step (no barrier, no min over warps).
// The `mma` rows skip the epilogue (one min and the barrier only). Each prints cycles per 128 pixels and consumer (of
// warpgroup 0 of block 0 only: with an epilogue, not the kernel's time) and the whole problem's time at the measured
// rate (8,258,048 pixels; it moves with the clock, so compare rows of one run).
//
//     nvcc -O3 -gencode=arch=compute_90a,code=sm_90a tools/experiments/winograd1d_rate.cu -o winograd1d_rate
//     ./winograd1d_rate
#include <cstdio>

#include "winograd_step.cuh"  // wgmma_ops.cuh (smem_u32, desc, wgmma_ss, nan_min, pin), tanh_approx, best_ms

template <bool kAcc>
__device__ __forceinline__ void wgmma_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b, Shape<64>) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, %37, 1, 1, 0;\n"
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(kAcc ? 1 : 0));
}

// The sum of every accumulator: after an `mma` row's loop, so that ptxas keeps every MMA (it drops an MMA chain whose
// results nothing reads).
template <int kN>
__device__ __forceinline__ float sum_all(const float (&acc)[kN][4]) {
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kN; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) sum += acc[j][i];
  return sum;
}
// 32 minima a thread (its 2 channels' min of 32 pixels) through the butterfly, into the step's partials; the barrier;
// each thread's pixel's min over the 4 warps.
__device__ __forceinline__ float reduce_and_meet(float (&v)[32], float* red, int s, int wg, int warp, int lane,
                                                 int ctid) {
  const int g = lane >> 2;
  fold<16>(v, g & 1, 4);
  fold<8>(v, (g >> 1) & 1, 8);
  fold<4>(v, (g >> 2) & 1, 16);
  float* const buf = red + (s & 1) * 1024;
  *reinterpret_cast<float4*>(buf + warp * 128 + lane * 4) = make_float4(v[0], v[1], v[2], v[3]);
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
  const float m = nan_min(nan_min(buf[ctid], buf[128 + ctid]), nan_min(buf[256 + ctid], buf[384 + ctid]));
  return tanh_approx(tanh_approx(m));
}

// The 16-bit kernels' reduce: 32 minima a thread rounded to bf16, two pixels a word, one butterfly step (xor 4), 8
// words a lane into shared memory, the barrier, then each thread the min over 4 warps of 2 words (4 pixels).
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ uint32_t min2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("min.NaN.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
template <bool kMeet = true>
__device__ __forceinline__ float reduce_packed_and_meet(float (&v)[32], float* red, int s, int wg, int warp, int lane,
                                                        int ctid) {
  uint32_t w[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) w[i] = pack2(v[2 * i], v[2 * i + 1]);
  const bool upper = (lane >> 2) & 1;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t send = upper ? w[i] : w[i + 8], keep = upper ? w[i + 8] : w[i];
    w[i] = min2(keep, __shfl_xor_sync(0xffffffffu, send, 4));
  }
  uint32_t* const buf = reinterpret_cast<uint32_t*>(red) + (s & 1) * 1024;
  *reinterpret_cast<uint4*>(buf + warp * 256 + lane * 8) = make_uint4(w[0], w[1], w[2], w[3]);
  *reinterpret_cast<uint4*>(buf + warp * 256 + lane * 8 + 4) = make_uint4(w[4], w[5], w[6], w[7]);
  if constexpr (!kMeet) return 0.f;  // the rest handed to other threads (not modelled)
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
  uint2 m = *reinterpret_cast<const uint2*>(buf + ctid * 2);
#pragma unroll
  for (int q = 1; q < 4; ++q) {
    const uint2 o = *reinterpret_cast<const uint2*>(buf + q * 256 + ctid * 2);
    m.x = min2(m.x, o.x);
    m.y = min2(m.y, o.y);
  }
  const uint32_t mm = min2(m.x, m.y);
  return tanh_approx(tanh_approx(__uint_as_float(mm << 16))) +
         tanh_approx(tanh_approx(__uint_as_float(mm & 0xFFFF0000u)));
}

// A timed row: its step (the strict direct one, the 16-bit direct one, or Winograd's points), what follows the MMAs
// (nothing but a min and the barrier, the fp32 butterfly, the 16-bit packed reduce, or that reduce handed off), and
// for Winograd its products (3: strict on fp16 parts; 1: 16-bit) and whether U_hi comes from registers.
enum Step { kStrictDirect, kDirect16, kWinograd };
enum Reduce { kMinOnly, kFp32Butterfly, kPackedMeet, kPackedHanded };
constexpr int kGroups = 2;
// Shared memory. Direct: the weights (9 k-steps x hi, lo: 36 KB), then per group 3 rows x (hi, lo) x [2 k groups]
// [136 columns][8 channels] (4,352 B a copy). Winograd: U_lo, then U_hi (12 x 2 KB each), then per group 3 rows x 4
// points x (hi, lo) x [2 k groups][64 tiles][8 channels] (2 KB a copy). Then each group's partials, 2 x 512 floats.
constexpr int kDirectShared = 36 * 1024, kRowCopy = 4352, kDirectGroup = 6 * kRowCopy;
constexpr int kWinoShared = 48 * 1024, kWinoGroup = 48 * 1024;
constexpr int kRedBytes = 8192;
template <Step S>
__host__ __device__ constexpr int smem_bytes() {
  return S != kWinograd ? kDirectShared + kGroups * (kDirectGroup + kRedBytes)
                        : kWinoShared + kGroups * (kWinoGroup + kRedBytes);
}

template <Step S, Reduce R, int kProducts = 3, bool kARegs = false>
__global__ void __launch_bounds__(kGroups * 128, 1) rate(float* out, long long* cycles, int steps) {
  extern __shared__ __align__(128) unsigned char sm[];
  constexpr bool kDirectForm = S != kWinograd;
  constexpr bool kHanded = R == kPackedHanded;
  constexpr bool kPacked = R == kPackedMeet || R == kPackedHanded;
  constexpr bool kEpilogue = R != kMinOnly;
  constexpr int kShared = kDirectForm ? kDirectShared : kWinoShared;
  constexpr int kGroupBytes = kDirectForm ? kDirectGroup : kWinoGroup;
  for (int i = threadIdx.x; i < smem_bytes<S>() / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(sm)[i] = 0x1C001C00u ^ ((i * 2654435761u) & 0x007F007Fu);  // small fp16 pairs
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int wg = threadIdx.x / 128, ctid = threadIdx.x % 128, warp = ctid >> 5, lane = ctid & 31;
  const uint32_t shared = smem_u32(sm), group = shared + kShared + wg * kGroupBytes;
  float* const red = reinterpret_cast<float*>(sm + kShared + kGroups * kGroupBytes + wg * kRedBytes);
  float keep = 0.f;
  const long long t0 = clock64();
  if constexpr (S == kDirect16) {
    float acc[32][4];
    for (int s = 0; s < steps; ++s) {
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int ks = 0; ks < 10; ++ks) {  // 9 taps and the bias's k-step
        const int kh = ks % 9 / 3, kw = ks % 3;
        const uint64_t w = desc(shared + ks * 2048, 1024, 128);
        const uint64_t x = desc(group + (2 * kh) * kRowCopy + kw * 16, kRowCopy / 2, 128);
        if (ks == 0) wgmma_ss<false>(acc, w, x, Shape<256>{}); else wgmma_ss<true>(acc, w, x, Shape<256>{});
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      pin(acc);
      if constexpr (kEpilogue) {  // two 128-pixel halves, each as the other forms reduce a step
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float v[32];
#pragma unroll
          for (int j = 0; j < 16; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) v[2 * j + e] = nan_min(acc[16 * half + j][e], acc[16 * half + j][2 + e]);
          if constexpr (kPacked) {
            keep += reduce_packed_and_meet<!kHanded>(v, red, 2 * s + half, wg, warp, lane, ctid);
          } else {
            keep += reduce_and_meet(v, red, 2 * s + half, wg, warp, lane, ctid);
          }
        }
      } else {
        keep = nan_min(keep, acc[0][0] + acc[31][3]);
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
      }
    }
    if constexpr (!kEpilogue) keep += sum_all(acc);
  } else if constexpr (kDirectForm) {
    float big[16][4], small[16][4];
    for (int s = 0; s < steps; ++s) {
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int ks = 0; ks < 9; ++ks) {
        const int kh = ks / 3, kw = ks % 3;
        const uint64_t w_hi = desc(shared + ks * 2048, 1024, 128), w_lo = desc(shared + 18432 + ks * 2048, 1024, 128);
        const uint64_t x_hi = desc(group + (2 * kh) * kRowCopy + kw * 16, kRowCopy / 2, 128);
        const uint64_t x_lo = desc(group + (2 * kh + 1) * kRowCopy + kw * 16, kRowCopy / 2, 128);
        if (ks == 0) {
          wgmma_ss<false>(big, w_hi, x_hi, Shape<128>{});
          wgmma_ss<false>(small, w_lo, x_hi, Shape<128>{});
        } else {
          wgmma_ss<true>(big, w_hi, x_hi, Shape<128>{});
          wgmma_ss<true>(small, w_lo, x_hi, Shape<128>{});
        }
        wgmma_ss<true>(small, w_hi, x_lo, Shape<128>{});
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      pin(big);
      pin(small);
      if constexpr (kEpilogue) {
        float v[32];
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            v[2 * j + e] = nan_min(fmaf(small[j][e], 0x1p-11f, big[j][e]),
                                   fmaf(small[j][2 + e], 0x1p-11f, big[j][2 + e]));
        keep += reduce_and_meet(v, red, s, wg, warp, lane, ctid);
      } else {
        keep = nan_min(keep, big[0][0] + small[15][3]);
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
      }
    }
    if constexpr (!kEpilogue) keep += sum_all(big) + sum_all(small);
  } else {
    // U_hi's A fragments [point][kernel row], 4 registers each, small fp16 values.
    uint32_t u_hi[4][3][4];
#pragma unroll
    for (int p = 0; p < 4; ++p)
#pragma unroll
      for (int kh = 0; kh < 3; ++kh)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          u_hi[p][kh][e] = 0x1C001C00u ^ ((((p * 3 + kh) * 4 + e) * 40503u + ctid * 977u) & 0x007F007Fu);
    const float bias = 0.01f * (warp + 1);
    float acc[4][8][4];
#pragma unroll
    for (int p = 0; p < 4; ++p)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("mov.b32 %0, 0;" : "=f"(acc[p][j][i]));
    for (int s = 0; s < steps; ++s) {
      if constexpr (kEpilogue) {
        // The bias: point 1's accumulators (M1 enters both outputs with +1).
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) asm volatile("mov.b32 %0, %1;" : "=f"(acc[1][j][i]) : "f"(bias));
      }
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int kh = 0; kh < 3; ++kh)
#pragma unroll
        for (int prod = 0; prod < kProducts; ++prod)
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            const uint32_t v_hi = group + ((kh * 4 + p) * 2) * 2048, v_lo = v_hi + 2048;
            const uint64_t b = desc(prod == 2 ? v_lo : v_hi, 1024, 128);
            const bool first = kEpilogue && kh == 0 && prod == 0 && p != 1;
            if (prod == 1 || !kARegs) {
              const uint64_t a = desc(shared + (prod == 1 ? 0 : 24576) + (p * 3 + kh) * 2048, 1024, 128);
              if (first) wgmma_ss<false>(acc[p], a, b, Shape<64>{}); else wgmma_ss<true>(acc[p], a, b, Shape<64>{});
            } else {
              if (first) {
                wgmma_rs<false>(acc[p], u_hi[p][kh], b, Shape<64>{});
              } else {
                wgmma_rs<true>(acc[p], u_hi[p][kh], b, Shape<64>{});
              }
            }
          }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
      for (int p = 0; p < 4; ++p) pin(acc[p]);
      if constexpr (kEpilogue) {
        // Element (j, i): channel g (i = 0, 1) or g + 8 (2, 3), tile 8 j + 2 t + (i & 1); its outputs 2 tile and
        // 2 tile + 1.
        float v[32];
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float y0[2], y1[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int i = 2 * h + e;
              y0[h] = (acc[0][j][i] + acc[1][j][i]) + acc[2][j][i];
              y1[h] = (acc[1][j][i] - acc[2][j][i]) - acc[3][j][i];
            }
            v[4 * j + 2 * e] = nan_min(y0[0], y0[1]);
            v[4 * j + 2 * e + 1] = nan_min(y1[0], y1[1]);
          }
        if constexpr (kPacked) {
          keep += reduce_packed_and_meet<!kHanded>(v, red, s, wg, warp, lane, ctid);
        } else {
          keep += reduce_and_meet(v, red, s, wg, warp, lane, ctid);
        }
      } else {
        keep = nan_min(keep, acc[0][0][0] + acc[3][7][3]);
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
      }
    }
    if constexpr (!kEpilogue) {
#pragma unroll
      for (int p = 0; p < 4; ++p) keep += sum_all(acc[p]);
    }
  }
  const long long t1 = clock64();
  out[blockIdx.x * blockDim.x + threadIdx.x] = keep;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <Step S, Reduce R, int kProducts = 3, bool kARegs = false>
void run(const char* what, int sms, float* out, long long* cycles) {
  constexpr int kPixels = S == kDirect16 ? 256 : 128;  // a step's
  constexpr int kSteps = 256000 / kPixels;
  auto kernel = rate<S, R, kProducts, kARegs>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<S>());
  kernel<<<sms, kGroups * 128, smem_bytes<S>()>>>(out, cycles, 20);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    printf("%s: %s\n", what, cudaGetErrorString(cudaGetLastError()));
    return;
  }
  const float best = best_ms([&] { kernel<<<sms, kGroups * 128, smem_bytes<S>()>>>(out, cycles, kSteps); });
  long long c;
  cudaMemcpy(&c, cycles, sizeof(c), cudaMemcpyDeviceToHost);
  const double pixels = (double)kPixels * kSteps * kGroups;  // per SM
  printf("%-22s %7.1f cycles per 128-pixel step and consumer (block 0), %.3f ms for the whole problem\n", what,
         (double)c / kSteps * 128 / kPixels, best / (pixels * sms) * 8258048.0);
}

int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out;
  long long* cycles;
  cudaMalloc(&out, sms * kGroups * 128 * sizeof(float));
  cudaMalloc(&cycles, sms * sizeof(long long));
  for (int rep = 0; rep < 2; ++rep) {
    run<kStrictDirect, kMinOnly>("direct, mma", sms, out, cycles);
    run<kStrictDirect, kFp32Butterfly>("direct", sms, out, cycles);
    run<kWinograd, kMinOnly, 3, true>("winograd, mma", sms, out, cycles);
    run<kWinograd, kFp32Butterfly, 3, true>("winograd", sms, out, cycles);
    run<kWinograd, kMinOnly>("winograd, A smem, mma", sms, out, cycles);
    run<kWinograd, kFp32Butterfly>("winograd, A smem", sms, out, cycles);
    run<kDirect16, kMinOnly>("16-bit direct, mma", sms, out, cycles);
    run<kDirect16, kFp32Butterfly>("16-bit direct", sms, out, cycles);
    run<kWinograd, kMinOnly, 1, true>("16-bit winograd, mma", sms, out, cycles);
    run<kWinograd, kFp32Butterfly, 1, true>("16-bit winograd", sms, out, cycles);
    run<kDirect16, kPackedMeet>("16-bit direct, packed", sms, out, cycles);
    run<kWinograd, kPackedMeet, 1, true>("16-bit winograd, packed", sms, out, cycles);
    run<kDirect16, kPackedHanded>("16-bit direct, handed", sms, out, cycles);
    run<kWinograd, kPackedHanded, 1, true>("16-bit winograd, handed", sms, out, cycles);
  }
  return 0;
}
