// The rate of the wgmma form of a fused Winograd F(2x2, 3x3) bf16 step (docs/perf-notes.md, Next (c)): M = the 64
// output channels, the transformed weights U_xi as A from registers (4 a point, 64 registers held for the whole run),
// N = 16 tiles, V_xi (16 channels x 16 tiles, 512 B a point) as B from shared memory, one m64n16k16 a point with
// scale-d 0 (K = 16: each accumulator takes one MMA a step), 128 accumulator registers a thread.
// Two consumer warpgroups a CTA, one CTA a SM, each warpgroup its share of the full problem's 129,032 steps of 16
// tiles (64 output pixels); no producer. Per step and warpgroup:
// - kMmaOnly: the 16 MMAs (accumulating across steps, scale-d 1), committed and waited for;
// - kFull: the 16 MMAs (the bias as the accumulators of (1, 1), which A^T . A adds to all four outputs), then the
//   output transform A^T M A in fp32 (24 adds a channel and tile: 8 pairs a thread), the min over the thread's 2
//   channels, a 3-step halving butterfly over the 8 lane groups, 2 partial minima a lane into shared memory, a named
//   barrier, the min over the 4 warps, tanh.approx twice and a store;
// - kFullInput: kFull, and each thread first transforms its share of the next step's V (one tile and channel pair:
//   its 4x4 patch by 4 LDS.128, B^T d B by 32 add/sub.bf16x2, 16 STS.32), a fence to the async proxy before the
//   barrier that precedes the next step's MMAs (otherwise V stays as staged).
// The two warpgroups are not made to take turns: each runs its steps, so one's transform can overlap the other's MMAs.
//
//     nvcc -O3 -gencode=arch=compute_90a,code=sm_90a tools/experiments/winograd_wgmma_rate.cu -o winograd_wgmma_rate
//     ./winograd_wgmma_rate
#include <cstdio>

#include "winograd_step.cuh"

enum Kind { kMmaOnly, kFull, kFullInput };
constexpr int kConsumers = 2, kSteps = 129032;
// Per consumer: V (16 points of 512 B) twice, the patches the input transform reads, the partial minima twice.
constexpr int kVBytes = 16 * 512, kXBytes = 8192, kPartBytes = 2 * 4 * 64 * 4;
constexpr int kConsumerBytes = 2 * kVBytes + kXBytes + kPartBytes;

template <int kScaleD>
__device__ __forceinline__ void wgmma(float (&d)[8], const uint32_t (&a)[4], uint64_t b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, "
               "{%8, %9, %10, %11}, %12, %13, 1, 1, 0;\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(kScaleD));
}
// One thread's patch of a channel pair transformed (input_transform) into the V buffer at vbuf: point xi's word of
// (tile, pair) at [k group = pair / 4][tile][8 channels], 512 B a point.
__device__ __forceinline__ void transform_into(const uint32_t (&d)[16], unsigned char* vbuf, int tile, int pair) {
  uint32_t v[16];
  input_transform(d, v);
#pragma unroll
  for (int xi = 0; xi < 16; ++xi)
    *reinterpret_cast<uint32_t*>(vbuf + xi * 512 + (pair >> 2) * 256 + tile * 16 + (pair & 3) * 4) = v[xi];
}

template <Kind kKind>
__global__ void __launch_bounds__(kConsumers * 128, 1) winograd(float* out, int steps) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int consumer = threadIdx.x >> 7, ctid = threadIdx.x & 127, warp = ctid >> 5, lane = ctid & 31;
  unsigned char* const csm = smem + consumer * kConsumerBytes;
  unsigned char* const xbuf = csm + 2 * kVBytes;
  float* const part = reinterpret_cast<float*>(xbuf + kXBytes);
  for (int i = threadIdx.x; i < kConsumers * kConsumerBytes / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(smem)[i] = 0x3c003c00u ^ ((i * 2654435761u) & 0x003f003fu);  // small bf16 pairs
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  // U_xi's A fragment: rows (channels) 16 warp + lane / 4 (+ 8), columns (input channels) 2 (lane % 4) (+ 1, + 8).
  uint32_t a[16][4];
#pragma unroll
  for (int xi = 0; xi < 16; ++xi)
#pragma unroll
    for (int e = 0; e < 4; ++e) a[xi][e] = 0x3c003c00u ^ (((xi * 4 + e) * 40503u + ctid * 977u) & 0x001f001fu);
  const float bias_lo = 0.01f * (warp + 1), bias_hi = 0.02f * (warp + 1);
  float acc[16][8];
#pragma unroll
  for (int xi = 0; xi < 16; ++xi)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[xi][i] = 0.f;
  const uint32_t vbase = smem_u32(csm);
  float* const dst = out + (blockIdx.x * kConsumers + consumer) * 64;
  for (int s = 0; s < steps; ++s) {
    const uint32_t vcur = vbase + (kKind == kFullInput ? (s & 1) * kVBytes : 0);
    if constexpr (kKind == kFullInput) {
      uint32_t d[16];
#pragma unroll
      for (int q = 0; q < 4; ++q)  // [q][the warpgroup's 128 threads]: a warp reads 512 contiguous bytes
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(d[q * 4 + 0]), "=r"(d[q * 4 + 1]), "=r"(d[q * 4 + 2]), "=r"(d[q * 4 + 3])
                     : "r"(smem_u32(xbuf) + (q * 128 + ctid) * 16));
      transform_into(d, csm + ((s + 1) & 1) * kVBytes, ctid >> 3, ctid & 7);
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    if constexpr (kKind != kMmaOnly) {
      // The bias: the accumulators of point (1, 1), rows g (elements 0, 1, 4, 5) and g + 8 (2, 3, 6, 7).
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[5][i] = (i & 2) ? bias_hi : bias_lo;
    }
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int xi = 0; xi < 16; ++xi) {
      const uint64_t b = desc(vcur + xi * 512, 256, 128);  // [k group][16 tiles][8 channels]
      if (kKind == kMmaOnly || xi == 5) {
        wgmma<1>(acc[xi], a[xi], b);
      } else {
        wgmma<0>(acc[xi], a[xi], b);
      }
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    pin(acc);
    if constexpr (kKind != kMmaOnly) {
      // Lane (g, t) holds channels g, g + 8 (of the warp's 16) x tiles 2t, 2t + 1, 2t + 8, 2t + 9: element
      // 4 j + 2 h + c is channel g + 8 h, tile 8 j + 2 t + c. The min over its two channels of each tile's 4 outputs.
      float mn[16];  // [tile (j, c)][output]
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float y0[4], y1[4], m[16];
#pragma unroll
          for (int xi = 0; xi < 16; ++xi) m[xi] = acc[xi][4 * j + c];
          output_transform(m, y0);
#pragma unroll
          for (int xi = 0; xi < 16; ++xi) m[xi] = acc[xi][4 * j + 2 + c];
          output_transform(m, y1);
#pragma unroll
          for (int k = 0; k < 4; ++k) mn[(2 * j + c) * 4 + k] = nan_min(y0[k], y1[k]);
        }
      // Halving butterfly over the 8 lane groups (channels): xor 4, 8, 16 keep 8, 4, 2 of the 16.
      float h8[8], h4[4], h2[2];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const bool up = lane & 4;
        const float send = up ? mn[i] : mn[i + 8], keep = up ? mn[i + 8] : mn[i];
        h8[i] = nan_min(keep, __shfl_xor_sync(0xffffffffu, send, 4));
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bool up = lane & 8;
        const float send = up ? h8[i] : h8[i + 4], keep = up ? h8[i + 4] : h8[i];
        h4[i] = nan_min(keep, __shfl_xor_sync(0xffffffffu, send, 8));
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const bool up = lane & 16;
        const float send = up ? h4[i] : h4[i + 2], keep = up ? h4[i + 2] : h4[i];
        h2[i] = nan_min(keep, __shfl_xor_sync(0xffffffffu, send, 16));
      }
      // Double-buffered by step: the next step's barrier orders this buffer's reads before its next writes.
      float* const pbuf = part + (s & 1) * 256;
      *reinterpret_cast<float2*>(pbuf + warp * 64 + lane * 2) = make_float2(h2[0], h2[1]);
      asm volatile("bar.sync %0, 128;\n" ::"r"(1 + consumer) : "memory");
      if (ctid < 64) {
        const float v = nan_min(nan_min(pbuf[ctid], pbuf[64 + ctid]), nan_min(pbuf[128 + ctid], pbuf[192 + ctid]));
        dst[ctid] = tanh_approx(tanh_approx(v));
      }
    }
  }
  if constexpr (kKind == kMmaOnly) {
    float sum = 0.f;
#pragma unroll
    for (int xi = 0; xi < 16; ++xi)
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += acc[xi][i];
    dst[ctid & 63] = sum;
  }
}

template <Kind kKind>
void run(const char* name, float* out, int sms) {
  const int steps = (kSteps + sms * kConsumers - 1) / (sms * kConsumers);
  const int smem = kConsumers * kConsumerBytes;
  auto k = winograd<kKind>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  k<<<sms, kConsumers * 128, smem>>>(out, 8);
  const float best = best_ms([&] { k<<<sms, kConsumers * 128, smem>>>(out, steps); });
  cudaError_t err = cudaGetLastError();
  const double mma_flop = 2.0 * 64 * 16 * 16 * 16 * (double)steps * sms * kConsumers;  // 16 points x m64n16k16
  printf("%-9s %d steps a warpgroup: %.4f ms for the whole problem, MMAs at %.0f TFLOP/s %s\n", name, steps, best,
         mma_flop / best / 1e9, err ? cudaGetErrorString(err) : "");
}

int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out;
  cudaMalloc(&out, sms * kConsumers * 64 * 4 * 4);
  for (int rep = 0; rep < 2; ++rep) {
    run<kMmaOnly>("mma only", out, sms);
    run<kFull>("full", out, sms);
    run<kFullInput>("+ input", out, sms);
  }
  return 0;
}
