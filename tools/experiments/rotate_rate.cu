// wgmma throughput of three layouts for the fused kernel's step, with each step's channel min modelled (docs/perf-
// notes.md, "Tensor cores: rate, tile shape, issue order"; v38). Two (or three) consumer warpgroups per SM, operands in
// shared memory without swizzle, no producer, one CTA per SM:
// - the inference kernels' layout: A = the weights (M = 64 channels), B = 256 pixels, 10 k-steps of m64n256k16; the
//   min across lanes by the 3-step halving butterfly;
// - rows streamed: A = 64 pixels, B = 192 channels (three output rows' 64, rotating through one accumulator), 3
//   k-steps a row; the completed row's min in registers and 2 quad shuffles, its accumulators reset to the bias;
// - pixels as rows: 4 x m64n64k16 a k-step (A = 64 pixels, B = the 64 channels), the min in registers.
// Each prints cycles per 256 pixels of block 0 and the whole problem's time at the measured rate.
//
//     nvcc -O3 -gencode=arch=compute_90a,code=sm_90a tools/experiments/rotate_rate.cu -o rotate_rate && ./rotate_rate
#include <cstdio>

#include "wgmma_ops.cuh"  // Shape, smem_u32, desc, wgmma_ss, nan_min, pin

enum Kind { kCur, kCurNone, kRot, kRotNone, kPix, kPixNone };
// kCur: N = 256, 10 k-steps, the lane butterfly (64 folds, 3 halving steps, 8 stores); kRot: N = 192, 3 k-steps, the
// completed row's block reduced in registers + 2 quad shuffles, 2 stores, reset to the bias by moves (asm, so that
// ptxas does not merge the copies and inject warpgroup.arrive); kPix: 4 x N = 64 sub-tiles, 10 k-steps; the *None
// kinds skip the reduce.
template <Kind K, int kGroups>
__global__ void __launch_bounds__(kGroups * 128, 1) rate(float* out, long long* cycles, int steps) {
  extern __shared__ __align__(128) unsigned char sm[];
  constexpr int kOpBytes = 48 * 1024;  // per group: operands
  for (int i = threadIdx.x; i < kGroups * kOpBytes / 4 + 4096; i += blockDim.x)
    reinterpret_cast<uint32_t*>(sm)[i] = 0x1C001C00u ^ ((i * 2654435761u) & 0x007F007Fu);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int wg = threadIdx.x / 128, ctid = threadIdx.x % 128, lane = ctid & 31, g = lane >> 2, t = lane & 3;
  const uint32_t base = smem_u32(sm + wg * kOpBytes);
  float* const red = reinterpret_cast<float*>(sm + kGroups * kOpBytes) + wg * 1024;
  float keep = 0.f;
  const long long t0 = clock64();
  if constexpr (K == kCur || K == kCurNone) {
    float acc[32][4];
    for (int s = 0; s < steps; ++s) {
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int k = 0; k < 10; ++k) {
        const uint64_t a = desc(base + (k % 3) * 2048, 1024, 128);        // weights 64 x 16
        const uint64_t b = desc(base + 8192 + (k % 3) * 16, 4288, 128);  // pixels
        if (k == 0) wgmma_ss<false>(acc, a, b, Shape<256>{}); else wgmma_ss<true>(acc, a, b, Shape<256>{});
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      pin(acc);
      if constexpr (K == kCur) {
        float v[64];
#pragma unroll
        for (int j = 0; j < 32; ++j) { v[2 * j] = nan_min(acc[j][0], acc[j][2]); v[2 * j + 1] = nan_min(acc[j][1], acc[j][3]); }
        fold<32>(v, g & 1, 4);
        fold<16>(v, (g >> 1) & 1, 8);
        fold<8>(v, (g >> 2) & 1, 16);
#pragma unroll
        for (int i = 0; i < 8; i += 2)
          *reinterpret_cast<float2*>(red + ((ctid * 8 + i + s) & 1023 & ~1)) = make_float2(v[i], v[i + 1]);
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
      } else {
        keep = nan_min(keep, acc[lane][0]);
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
      }
    }
    keep += red[ctid];
  } else if constexpr (K == kRot || K == kRotNone) {
    float acc[24][4];
    float bias[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) bias[i] = red[i * 32 + lane];
#pragma unroll
    for (int j = 0; j < 24; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) asm volatile("mov.b32 %0, 0;" : "=f"(acc[j][i]));
    for (int s = 0; s < steps; s += 3) {
#pragma unroll
      for (int p = 0; p < 3; ++p) {
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int k = 0; k < 3; ++k) {
          const uint64_t a = desc(base + 16 * k, 4288, 128);  // pixels, 64 x 16, shifted k columns
          const uint64_t b = desc(base + 12288 + k * 10240 + p * 1024, 5120, 128);  // 192 of 320 rotated channels
          wgmma_ss<true>(acc, a, b, Shape<192>{});
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        pin(acc);
        if constexpr (K == kRot) {
          const int bb = (p + 1) % 3;
          float m0 = acc[8 * bb][0], m1 = acc[8 * bb][2];
          float a0 = acc[8 * bb][1], a1 = acc[8 * bb][3];
#pragma unroll
          for (int j = 1; j < 8; ++j) {
            m0 = nan_min(m0, acc[8 * bb + j][0]); a0 = nan_min(a0, acc[8 * bb + j][1]);
            m1 = nan_min(m1, acc[8 * bb + j][2]); a1 = nan_min(a1, acc[8 * bb + j][3]);
          }
          m0 = nan_min(m0, a0); m1 = nan_min(m1, a1);
          m0 = nan_min(m0, __shfl_xor_sync(0xffffffffu, m0, 1));
          m1 = nan_min(m1, __shfl_xor_sync(0xffffffffu, m1, 1));
          m0 = nan_min(m0, __shfl_xor_sync(0xffffffffu, m0, 2));
          m1 = nan_min(m1, __shfl_xor_sync(0xffffffffu, m1, 2));
          if (t == 0) { red[(16 * (ctid >> 5) + g + s) & 1023] = m0; red[(16 * (ctid >> 5) + g + 8 + s) & 1023] = m1; }
#pragma unroll
          for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int i = 0; i < 4; ++i) asm volatile("mov.b32 %0, %1;" : "=f"(acc[8 * bb + j][i]) : "f"(bias[2 * j + (i & 1)]));
          }
        } else {
          keep = nan_min(keep, acc[lane % 24][0]);
        }
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
      }
    }
#pragma unroll
    for (int j = 0; j < 24; ++j) keep += acc[j][0] + acc[j][3];
    keep += red[ctid];
  } else {
    float acc[32][4];
    for (int s = 0; s < steps; ++s) {
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int k = 0; k < 10; ++k) {
        const uint64_t b = desc(base + (k % 3) * 2048, 1024, 128);        // weights 64 x 16
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint64_t a = desc(base + 8192 + (k % 3) * 16 + q * 1024, 4288, 128);  // pixels
          float(&d)[8][4] = *reinterpret_cast<float(*)[8][4]>(&acc[8 * q]);
          if (k == 0) wgmma_ss<false>(d, a, b, Shape<64>{}); else wgmma_ss<true>(d, a, b, Shape<64>{});
        }
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      pin(acc);
      if constexpr (K == kPix) {
        float m[8];
#pragma unroll
        for (int q = 0; q < 4; ++q)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float x0 = acc[8 * q][2 * h], x1 = acc[8 * q][2 * h + 1];
#pragma unroll
            for (int j = 1; j < 8; ++j) { x0 = nan_min(x0, acc[8 * q + j][2 * h]); x1 = nan_min(x1, acc[8 * q + j][2 * h + 1]); }
            m[2 * q + h] = nan_min(x0, x1);
          }
        fold<4>(m, t & 1, 1);
        fold<2>(m, (t >> 1) & 1, 2);
        red[(ctid * 2 + s) & 1023] = m[0];
        red[(ctid * 2 + 1 + s) & 1023] = m[1];
      } else {
        keep = nan_min(keep, acc[lane][0]);
      }
      asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
    }
    keep += red[ctid];
  }
  const long long t1 = clock64();
  out[blockIdx.x * blockDim.x + threadIdx.x] = keep;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <Kind K, int kGroups>
void run(const char* what, int sms, float* out, long long* cycles) {
  const int smem = kGroups * 48 * 1024 + 16384 + 128;
  auto kernel = rate<K, kGroups>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  // pixels a step: kCur/kPix 256, kRot 64 (a step = 3 rotating sub-steps of 64 pixels each counted separately)
  const int steps = (K == kRot || K == kRotNone) ? 12000 : 3000;
  const double px_per_step = (K == kRot || K == kRotNone) ? 64 : 256;
  kernel<<<sms, kGroups * 128, smem>>>(out, cycles, 30);
  if (cudaDeviceSynchronize() != cudaSuccess) { printf("%s: %s\n", what, cudaGetErrorString(cudaGetLastError())); return; }
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0); cudaEventCreate(&e1);
  float best = 1e30f;
  for (int trial = 0; trial < 5; ++trial) {
    cudaEventRecord(e0);
    kernel<<<sms, kGroups * 128, smem>>>(out, cycles, steps);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1);
    best = ms < best ? ms : best;
  }
  long long c;
  cudaMemcpy(&c, cycles, sizeof(c), cudaMemcpyDeviceToHost);
  const double pixels = px_per_step * steps * kGroups;  // per SM
  printf("%-36s groups=%d: %8.1f cycles per 256 px per SM (block 0), %.3f ms for the model's 8.26M px x 132 SMs\n",
         what, kGroups, c / pixels * 256.0, best / (pixels * sms) * 8258048.0);
}
int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out; long long* cycles;
  cudaMalloc(&out, sms * 512 * sizeof(float)); cudaMalloc(&cycles, sms * sizeof(long long));
  run<kCurNone, 2>("N=256 x10, no reduce", sms, out, cycles);
  run<kCur, 2>("N=256 x10, lane butterfly", sms, out, cycles);
  run<kRotNone, 2>("N=192 x3 rotating, no reduce", sms, out, cycles);
  run<kRot, 2>("N=192 x3 rotating, in-thread min", sms, out, cycles);
  run<kRotNone, 3>("N=192 x3 rotating, no reduce", sms, out, cycles);
  run<kRot, 3>("N=192 x3 rotating, in-thread min", sms, out, cycles);
  run<kPixNone, 2>("4 x N=64 x10 pixel rows, no reduce", sms, out, cycles);
  run<kPix, 2>("4 x N=64 x10 pixel rows, in-thread min", sms, out, cycles);
  return 0;
}
