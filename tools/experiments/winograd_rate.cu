// The rate of a fused Winograd F(2x2, 3x3) step in bf16 on mma.sync, with the work around its MMAs modelled (issue
// "fewer multiplies"; docs/perf-notes.md, Next (c)). No producer and no real geometry: the question is what the SM's
// issue and shared memory allow once the MMAs are 2.25x fewer than direct convolution's.
//
// A step is 16 tiles (2x2 outputs each, 64 output pixels) x 64 channels, taken by a group of 4 warps, one 16-channel
// chunk each. Per warp and step, as a fused kernel would do it:
// - input transform (kFull): its quarter of the next step's V = B^T d B, 4 tiles x 16 channels as bf16x2 pairs (a
//   4x4 patch a lane: 4 LDS.128, 32 add/sub.bf16x2, 16 STS.32 into the next step's V buffer);
// - 16 points xi: ldmatrix.x4 of V_xi (16 tiles x 16 channels), two m16n8k16 MMAs against U_xi (the transformed
//   weights, 16 channels x 8 outputs, held in registers for the whole run); each accumulator gets one MMA a step
//   (K = 16), C = 0, or the bias at xi = (1, 1), where A^T . A adds it to all four outputs;
// - output transform A^T M A in fp32 (24 adds a tile and channel), the min over the lane's 4 channels, 2 halving
//   quad shuffles, 2 partial minima a lane into shared memory, one named barrier per group and step;
// - the group's 64 pixels: min over the 4 chunks, tanh.approx twice, one store.
// kMmaOnly keeps just the ldmatrix and the MMAs (accumulating across steps); kNoInput leaves out the input transform.
// The grid is one CTA of 2 groups per SM, and each group runs its share of the full problem's 129,032 steps (N = 128,
// 254 x 254 outputs), so the time printed is the whole problem's at this rate.
//
//     nvcc -O3 -arch=sm_90a tools/experiments/winograd_rate.cu -o winograd_rate && ./winograd_rate
#include <cstdio>

#include "winograd_step.cuh"

enum Kind { kMmaOnly, kNoInput, kFull };
constexpr int kGroups = 2, kWarps = 4 * kGroups, kSteps = 129032;
// Shared memory per group: V double-buffered (2 x 16 xi x 512 B), the patches the input transform reads (8 KB), the
// partial minima double-buffered (2 x 4 warps x 64 floats).
constexpr int kVBytes = 16 * 512, kXBytes = 8192, kPartBytes = 4 * 64 * 4;
constexpr int kGroupBytes = 2 * kVBytes + kXBytes + 2 * kPartBytes;

__device__ __forceinline__ void mma_acc(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_c(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], float c0, float c1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%10,%11};\n"
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c0), "f"(c1));
}
// V_xi's 16 x 32-byte rows (tiles), the two 16-byte halves swapped on rows 4-7 and 12-15: conflict-free ldmatrix.
__device__ __forceinline__ uint32_t v_offset(int xi, int tile, int half) {
  return xi * 512 + tile * 32 + ((half ^ ((tile >> 2) & 1)) << 4);
}

// One lane's patch of a channel pair transformed (input_transform) into the V buffer at vbuf.
__device__ __forceinline__ void transform_into(const uint32_t (&d)[16], unsigned char* vbuf, int tile, int pair) {
  uint32_t v[16];
  input_transform(d, v);
#pragma unroll
  for (int xi = 0; xi < 16; ++xi)
    *reinterpret_cast<uint32_t*>(vbuf + v_offset(xi, tile, pair >> 2) + (pair & 3) * 4) = v[xi];
}

template <Kind kKind>
__global__ void __launch_bounds__(kWarps * 32, 1) winograd(float* out, int steps) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, group = warp >> 2, chunk = warp & 3;
  unsigned char* const gsm = smem + group * kGroupBytes;
  unsigned char* const xbuf = gsm + 2 * kVBytes;
  float* const part = reinterpret_cast<float*>(xbuf + kXBytes);
  for (int i = threadIdx.x; i < kGroups * kGroupBytes / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(smem)[i] = 0x3c003c00u ^ ((i * 2654435761u) & 0x003f003fu);  // small bf16 pairs
  __syncthreads();
  // U_xi for this warp's 16 channels: two n8 tiles, two registers each.
  uint32_t b[16][2][2];
#pragma unroll
  for (int xi = 0; xi < 16; ++xi)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) b[xi][nt][e] = 0x3c003c00u ^ (((xi * 4 + nt * 2 + e) * 40503u + lane * 977u + chunk) & 0x001f001fu);
  const float bias0 = 0.01f * chunk, bias1 = 0.02f * chunk;
  float acc[16][2][4];
#pragma unroll
  for (int xi = 0; xi < 16; ++xi)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) acc[xi][nt][0] = acc[xi][nt][1] = acc[xi][nt][2] = acc[xi][nt][3] = 0.f;
  const int tile_in = chunk * 4 + (lane >> 3), pair_in = lane & 7;
  const uint32_t lane_a = (lane & 15) * 32 + ((((lane >> 4) ^ ((lane >> 2) & 1))) << 4);
  float* const dst = out + (blockIdx.x * kGroups + group) * 64;
  for (int s = 0; s < steps; ++s) {
    unsigned char* const vcur = gsm + (s & 1) * kVBytes;
    if constexpr (kKind == kFull) {
      uint32_t d[16];
#pragma unroll
      for (int q = 0; q < 4; ++q)  // [q][the group's 128 lanes]: a warp reads 512 contiguous bytes
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(d[q * 4 + 0]), "=r"(d[q * 4 + 1]), "=r"(d[q * 4 + 2]), "=r"(d[q * 4 + 3])
                     : "r"(smem_u32(xbuf) + (q * 128 + tile_in * 8 + pair_in) * 16));
      transform_into(d, gsm + ((s + 1) & 1) * kVBytes, tile_in, pair_in);
    }
#pragma unroll
    for (int xi = 0; xi < 16; ++xi) {
      uint32_t a[4];
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                   : "r"(smem_u32(vcur) + xi * 512 + lane_a));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        if constexpr (kKind == kMmaOnly) {
          mma_acc(acc[xi][nt], a, b[xi][nt]);
        } else {
          mma_c(acc[xi][nt], a, b[xi][nt], xi == 5 ? bias0 : 0.f, xi == 5 ? bias1 : 0.f);
        }
      }
    }
    if constexpr (kKind != kMmaOnly) {
      // Lane (g, t): tiles g and g + 8, channels 8 nt + 2t + (0, 1) of the chunk; the min over those 4 channels of
      // each of the 2 x 4 outputs.
      float mn[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // accumulator element: tile g (0, 1) or g + 8 (2, 3), channel 2t + (i & 1)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          float m[16], y[4];
#pragma unroll
          for (int xi = 0; xi < 16; ++xi) m[xi] = acc[xi][nt][i];
          output_transform(m, y);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            float& slot = mn[(i >> 1) * 4 + k];
            slot = (i & 1) == 0 && nt == 0 ? y[k] : nan_min(slot, y[k]);
          }
        }
      }
      // Halving quad shuffles: xor 1 keeps 4 of the 8, xor 2 keeps 2.
      const bool up1 = lane & 1, up2 = lane & 2;
      float h[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float send = up1 ? mn[i] : mn[i + 4], keep = up1 ? mn[i + 4] : mn[i];
        h[i] = nan_min(keep, __shfl_xor_sync(0xffffffffu, send, 1));
      }
      float q[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float send = up2 ? h[i] : h[i + 2], keep = up2 ? h[i + 2] : h[i];
        q[i] = nan_min(keep, __shfl_xor_sync(0xffffffffu, send, 2));
      }
      float* const pbuf = part + (s & 1) * 256;
      *reinterpret_cast<float2*>(pbuf + chunk * 64 + lane * 2) = make_float2(q[0], q[1]);
      asm volatile("bar.sync %0, 128;\n" ::"r"(1 + group) : "memory");
      if (lane < 16) {
        const int px = chunk * 16 + lane;
        float v = nan_min(nan_min(pbuf[px], pbuf[64 + px]), nan_min(pbuf[128 + px], pbuf[192 + px]));
        dst[px] = tanh_approx(tanh_approx(v));
      }
    }
  }
  if constexpr (kKind == kMmaOnly) {
    float sum = 0.f;
#pragma unroll
    for (int xi = 0; xi < 16; ++xi)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) sum += acc[xi][nt][0] + acc[xi][nt][1] + acc[xi][nt][2] + acc[xi][nt][3];
    dst[threadIdx.x & 63] = sum;
  }
}

template <Kind kKind>
void run(const char* name, float* out, int sms) {
  const int steps = (kSteps + sms * kGroups - 1) / (sms * kGroups);
  const int smem = kGroups * kGroupBytes;
  auto k = winograd<kKind>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  k<<<sms, kWarps * 32, smem>>>(out, 8);
  const float best = best_ms([&] { k<<<sms, kWarps * 32, smem>>>(out, steps); });
  cudaError_t err = cudaGetLastError();
  const double mma_flop = 2.0 * 16 * 64 * 16 * 16 * (double)steps * sms * kGroups;  // 16 xi x [16 x 16] x [16 x 64]
  printf("%-9s %d steps a group: %.4f ms for the whole problem, MMAs at %.0f TFLOP/s %s\n", name, steps, best,
         mma_flop / best / 1e9, err ? cudaGetErrorString(err) : "");
}

int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out;
  cudaMalloc(&out, sms * kGroups * 64 * 4 * 4);
  for (int rep = 0; rep < 2; ++rep) {
    run<kMmaOnly>("mma only", out, sms);
    run<kNoInput>("no input", out, sms);
    run<kFull>("full", out, sms);
  }
  return 0;
}
