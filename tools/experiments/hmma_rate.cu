// mma.sync throughput on this GPU (TF32 m16n8k8, bf16 m16n8k16): warps per scheduler, loop order, and operands held
// in registers or loaded from shared memory each k-step (ldmatrix.x4 for A, 16-byte loads for B, as the fused
// mma.sync kernels do). One CTA per SM. docs/perf-notes.md (v16) quotes its output.
//
//     nvcc -O3 -arch=sm_90a tools/experiments/hmma_rate.cu -o hmma_rate && ./hmma_rate
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
template <bool kBf16>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kBf16)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// MT m-tiles x 8 n-tiles per warp; kSmem: A by ldmatrix.x4 and B by LDS.128 each k-step (as the fused kernel);
// kNOuter: n-tile outer loop (B reused over the m-tiles) instead of m-tile outer (A reused over the n-tiles).
template <int MT, bool kSmem, bool kNOuter, bool kBf16>
__global__ void rate(float* out, int iters) {
  __shared__ __align__(16) uint32_t sm[8192];
  for (int i = threadIdx.x; i < 8192; i += blockDim.x) sm[i] = 0x3f800000u ^ (i * 2654435761u & 0x007fe000u);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float acc[MT][8][4];
  for (int m = 0; m < MT; ++m) for (int n = 0; n < 8; ++n) for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.f;
  uint32_t a[MT][4], b[8][2];
  for (int m = 0; m < MT; ++m) for (int e = 0; e < 4; ++e) a[m][e] = sm[(m * 4 + e) * 32 + lane];
  for (int n = 0; n < 8; ++n) for (int e = 0; e < 2; ++e) b[n][e] = sm[1024 + (n * 2 + e) * 32 + lane];
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(sm) + ((warp & 3) * 2048 + lane * 16);
  for (int it = 0; it < iters; ++it) {
    if constexpr (kSmem) {
      const uint32_t off = (it & 7) * 256;
#pragma unroll
      for (int m = 0; m < MT; ++m)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(a[m][0]), "=r"(a[m][1]), "=r"(a[m][2]), "=r"(a[m][3]) : "r"(base + off + m * 512));
#pragma unroll
      for (int q = 0; q < 4; ++q)
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(b[2 * q][0]), "=r"(b[2 * q][1]), "=r"(b[2 * q + 1][0]), "=r"(b[2 * q + 1][1])
                     : "r"(base + 16384 + off + q * 512));
    }
    if constexpr (kNOuter) {
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int m = 0; m < MT; ++m) mma<kBf16>(acc[m][n], a[m], b[n][0], b[n][1]);
    } else {
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < 8; ++n) mma<kBf16>(acc[m][n], a[m], b[n][0], b[n][1]);
    }
  }
  float s = 0.f;
  for (int m = 0; m < MT; ++m) for (int n = 0; n < 8; ++n) for (int e = 0; e < 4; ++e) s += acc[m][n][e];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
template <int MT, bool kSmem, bool kNOuter, bool kBf16>
void run(const char* name, int warps_per_sm, float* out, int sms) {
  const int iters = 4096;
  auto k = rate<MT, kSmem, kNOuter, kBf16>;
  k<<<sms, warps_per_sm * 32>>>(out, 16);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0); cudaEventCreate(&e1);
  float best = 1e30f;
  for (int r = 0; r < 5; ++r) {
    cudaEventRecord(e0);
    k<<<sms, warps_per_sm * 32>>>(out, iters);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1);
    if (ms < best) best = ms;
  }
  const double flop = 2.0 * 16 * 8 * (kBf16 ? 16 : 8) * MT * 8 * (double)iters * warps_per_sm * sms;
  cudaError_t err = cudaGetLastError();
  printf("%-4s MT=%d %-4s %-7s warps/SM=%2d: %7.1f TFLOP/s %s\n", kBf16 ? "bf16" : "tf32", MT, kSmem ? "smem" : "regs",
         kNOuter ? "n-outer" : "m-outer", warps_per_sm, flop / best / 1e9, err ? cudaGetErrorString(err) : "");
}
int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out; cudaMalloc(&out, sms * 1024 * 4);
  for (int w : {4, 8}) {
    run<4, false, false, false>("", w, out, sms);
    run<4, false, true, false>("", w, out, sms);
    run<4, true, false, false>("", w, out, sms);
    run<4, true, true, false>("", w, out, sms);
    run<4, false, false, true>("", w, out, sms);
    run<4, true, false, true>("", w, out, sms);
    run<4, true, true, true>("", w, out, sms);
  }
  for (int w : {12, 16}) {
    run<2, false, false, false>("", w, out, sms);
    run<2, true, false, false>("", w, out, sms);
    run<2, false, false, true>("", w, out, sms);
    run<2, true, false, true>("", w, out, sms);
  }
  return 0;
}
