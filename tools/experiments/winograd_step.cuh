// What the Winograd rate probes share (winograd_rate.cu on mma.sync, winograd_wgmma_rate.cu on wgmma, both F(2x2, 3x3);
// winograd1d_rate.cu): wgmma_ops.cuh, the bf16x2 input transform of a 4x4 patch, the fp32 output transform, tanh and
// the timing loop.
#pragma once

#include "wgmma_ops.cuh"

__device__ __forceinline__ uint32_t badd(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("add.rn.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ uint32_t bsub(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("sub.rn.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ float tanh_approx(float v) {
  asm("tanh.approx.f32 %0, %0;\n" : "+f"(v));
  return v;
}

// B^T d B of a 4x4 patch of a channel pair (bf16x2 words d[4 i + j], row i, column j): v[xi], point xi = 4 i + j.
// 32 add/sub.bf16x2.
__device__ __forceinline__ void input_transform(const uint32_t (&d)[16], uint32_t (&v)[16]) {
  uint32_t t[16];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    t[0 * 4 + j] = bsub(d[0 * 4 + j], d[2 * 4 + j]);
    t[1 * 4 + j] = badd(d[1 * 4 + j], d[2 * 4 + j]);
    t[2 * 4 + j] = bsub(d[2 * 4 + j], d[1 * 4 + j]);
    t[3 * 4 + j] = bsub(d[1 * 4 + j], d[3 * 4 + j]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[i * 4 + 0] = bsub(t[i * 4 + 0], t[i * 4 + 2]);
    v[i * 4 + 1] = badd(t[i * 4 + 1], t[i * 4 + 2]);
    v[i * 4 + 2] = bsub(t[i * 4 + 2], t[i * 4 + 1]);
    v[i * 4 + 3] = bsub(t[i * 4 + 1], t[i * 4 + 3]);
  }
}

// A^T M A of one tile and channel (M[xi] = m[xi]): its 2x2 outputs, 24 adds.
__device__ __forceinline__ void output_transform(const float (&m)[16], float (&y)[4]) {
  float r0[4], r1[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float s = m[4 + j] + m[8 + j], d = m[4 + j] - m[8 + j];
    r0[j] = m[j] + s;
    r1[j] = d - m[12 + j];
  }
  const float s0 = r0[1] + r0[2], d0 = r0[1] - r0[2], s1 = r1[1] + r1[2], d1 = r1[1] - r1[2];
  y[0] = r0[0] + s0;
  y[1] = d0 - r0[3];
  y[2] = r1[0] + s1;
  y[3] = d1 - r1[3];
}

// The best of 7 timed launches (CUDA events), after the caller's warm-up.
template <class Launch>
float best_ms(const Launch& launch) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float best = 1e30f;
  for (int r = 0; r < 7; ++r) {
    cudaEventRecord(e0);
    launch();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    if (ms < best) best = ms;
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return best;
}
