// wgmma throughput on this GPU, for the questions the fused kernel's epilogue raises (docs/perf-notes.md, v20):
// how fast one warpgroup's chain of bf16 m64nNk16 runs for N = 64, 128, 256; what a second and third warpgroup add;
// and what other instructions cost the tensor cores: min instructions on the accumulators after each step's wait
// (the reduce), independent ALU instructions between the issue and the wait (the write), and a warpgroup that only
// issues ALU, shuffle or shared-memory instructions beside two MMA warpgroups. A step is 10 wgmma (9 k-steps and the
// bias step of the 16-bit kernels), their operands from shared memory without swizzle, as the fused kernel's. One CTA
// per SM. The last rows read B as the fused kernel does (kTaps): core matrices along K one slot group (4288 bytes)
// apart and each tap's start shifted by 16 bytes a column (kw = k-step % 3), so that two of three start off a
// 128-byte line.
//
//     nvcc -O3 -gencode=arch=compute_90a,code=sm_90a tools/experiments/wgmma_rate.cu -o wgmma_rate && ./wgmma_rate
#include <cstdio>

#include "wgmma_ops.cuh"  // Shape, smem_u32, desc (its bf16 wgmma wrappers below)
template <bool kAccumulate>
__device__ __forceinline__ void wgmma(float (&d)[8][4], uint64_t a, uint64_t b, Shape<64>) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, %34, 1, 1, 0, 0;\n"
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
               : "l"(a), "l"(b), "n"(kAccumulate ? 1 : 0));
}
template <bool kAccumulate>
__device__ __forceinline__ void wgmma(float (&d)[16][4], uint64_t a, uint64_t b, Shape<128>) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, %66, 1, 1, 0, 0;\n"
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
               : "l"(a), "l"(b), "n"(kAccumulate ? 1 : 0));
}
template <bool kAccumulate>
__device__ __forceinline__ void wgmma(float (&d)[32][4], uint64_t a, uint64_t b, Shape<256>) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, %130, 1, 1, 0, 0;\n"
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])
               : "l"(a), "l"(b), "n"(kAccumulate ? 1 : 0));
}

// A from registers (the m64 x k16 fragment: 4 registers a thread, the mma.sync A layout), B from shared memory.
__device__ __forceinline__ void wgmma_rs(float (&d)[32][4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, 1, 1, 1, 0;\n"
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// volatile, unlike wgmma_ops.cuh's nan_min: the noise rows' mins stay issued whatever ptxas could prove of them.
__device__ __forceinline__ float nan_min_kept(float a, float b) {
  float r;
  asm volatile("min.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

enum Noise { kNone, kAlu, kShfl, kShared, kSharedWide };
// A from shared memory (a descriptor, as the fused kernel) or from registers (loaded once).
enum AFrom { kASmem, kARegs };
// B as a dense tile (kDense), or as the fused kernel's slot: K stride 4288 bytes, start + 16 kw bytes (kTaps).
enum BLayout { kDense, kTaps };
constexpr int kKSteps = 10, kTiles = 3;  // k-steps a step; distinct operand tiles, used in turn
constexpr int kATileBytes = 64 * 16 * 2;

// kGroups MMA warpgroups, each a chain of `steps` steps into its own accumulators: issue, kWindow independent ALU
// instructions (after a barrier of the warpgroup and a shared load, as the kernel's write), wait, kReduce min
// instructions over the accumulators. With kNoise, one more warpgroup issues that kind
// of instruction until the MMA warpgroups are done.
template <int N, BLayout kB>
__host__ __device__ constexpr int b_tile_bytes() { return kB == kDense ? N * 16 * 2 : (4288 + N * 16 + 32 + 127) / 128 * 128; }

template <int N, int kGroups, int kReduce, int kWindow, Noise kNoise, BLayout kB = kDense, AFrom kA = kASmem>
__global__ void __launch_bounds__((kGroups + (kNoise != kNone)) * 128, 1) rate(float* out, long long* cycles, int steps) {
  extern __shared__ __align__(128) unsigned char sm[];
  constexpr int kBTileBytes = b_tile_bytes<N, kB>();
  volatile int* const done = reinterpret_cast<volatile int*>(sm + kTiles * (kATileBytes + kGroups * kBTileBytes));
  float* const scratch = const_cast<float*>(reinterpret_cast<volatile float*>(done + 32));
  const int tiles_bytes = kTiles * (kATileBytes + kGroups * kBTileBytes);
  for (int i = threadIdx.x; i < tiles_bytes / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(sm)[i] = 0x3C003C00u ^ ((i * 2654435761u) & 0x007F007Fu);  // bf16 pairs near 1/128
  for (int i = threadIdx.x; i < 4096; i += blockDim.x) scratch[i] = 0.f;
  if (threadIdx.x == 0) *done = 0;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg < kGroups) {
    // Every step accumulates into acc: with a step that started from zero (scale-d 0) and nothing reading it, ptxas
    // drops the earlier steps' MMAs as dead.
    float acc[N / 8][4];
#pragma unroll
    for (int j = 0; j < N / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    // 16 independent min chains: the reduce's mins are independent of each other (a rate, not a latency).
    float m[16], w[4] = {1.f, 2.f, 3.f, (float)threadIdx.x};
#pragma unroll
    for (int i = 0; i < 16; ++i) m[i] = 0.f;
    const uint32_t a0 = smem_u32(sm), b0 = smem_u32(sm + kTiles * kATileBytes + wg * kTiles * kBTileBytes);
    // kARegs: each tile's A fragment read once from shared memory into 4 registers a thread.
    uint32_t a_regs[kTiles][4];
#pragma unroll
    for (int t = 0; t < kTiles; ++t)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        a_regs[t][r] = reinterpret_cast<const uint32_t*>(sm + t * kATileBytes)[(threadIdx.x % 128) * 4 + r];
    const long long t0 = clock64();
    for (int s = 0; s < steps; ++s) {
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int k = 0; k < kKSteps; ++k) {
        // A: 64 x 16, K-major: core matrices 128 bytes apart along M, 1024 along K. B: N x 16, 16 N bytes along K.
        const uint64_t a = desc(a0 + (k % kTiles) * kATileBytes, 1024, 128);
        const uint64_t b = kB == kDense ? desc(b0 + (k % kTiles) * kBTileBytes, 16 * N, 128)
                                        : desc(b0 + (k % kTiles) * kBTileBytes + 16 * (k % 3), 4288, 128);
        if constexpr (kA == kARegs) {
          static_assert(N == 256, "A from registers: N = 256 only");
          wgmma_rs(acc, a_regs[k % kTiles], b);
        } else {
          wgmma<true>(acc, a, b, Shape<N>{});
        }
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      // ptxas would hoist independent FMAs between the wgmma instructions. The fused kernel's write starts with a
      // barrier of the warpgroup and works on what it loads after it, which keeps it after the issue: so does this.
      if constexpr (kWindow > 0) {
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
        const float z = reinterpret_cast<volatile float*>(scratch)[threadIdx.x % 128];
#pragma unroll
        for (int i = 0; i < kWindow; ++i) w[i % 4] = __fmaf_rn(w[i % 4], 1.0001f, z);
      }
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
      for (int i = 0; i < kReduce; ++i) m[i % 16] = nan_min_kept(m[i % 16], acc[(i / 4) % (N / 8)][i % 4]);
    }
    const long long t1 = clock64();
    __syncwarp();
    if (threadIdx.x % 128 == 0) atomicAdd(const_cast<int*>(done), 1);
    float s = w[0] + w[1] + w[2] + w[3];
#pragma unroll
    for (int i = 0; i < 16; ++i) s += m[i];
#pragma unroll
    for (int j = 0; j < N / 8; ++j) s += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
    if (threadIdx.x == 0) cycles[blockIdx.x] = (t1 - t0) / steps;
  } else if constexpr (kNoise != kNone) {
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = (float)(threadIdx.x + i);
    while (*done < kGroups) {
#pragma unroll
      for (int r = 0; r < 8; ++r)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if constexpr (kNoise == kAlu) v[i] = nan_min_kept(v[i] * 1.0001f, v[(i + 1) % 8]);
          if constexpr (kNoise == kShfl) v[i] = __shfl_xor_sync(0xffffffffu, v[i], 4 << (i % 3)) + 1.f;
          if constexpr (kNoise == kSharedWide) {  // independent 16-byte loads, 128 contiguous bytes a quarter-warp
            uint4 q;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w)
                         : "r"(smem_u32(scratch) + 16 * (((threadIdx.x % 128) + 128 * i + 8 * r) % 1024)));
            v[i] += __uint_as_float(q.x ^ q.y ^ q.z ^ q.w);
          }
          if constexpr (kNoise == kShared) {
            scratch[(threadIdx.x % 128) * 9 % 1024 + i] = v[i];
            v[i] = scratch[((threadIdx.x % 128) * 9 + 64) % 1024 + i] + 1.f;
          }
        }
    }
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) s += v[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  }
}

template <int N, int kGroups, int kReduce, int kWindow, Noise kNoise, BLayout kB = kDense, AFrom kA = kASmem>
void run(const char* what, int sms, float* out, long long* cycles) {
  constexpr int kBTileBytes = b_tile_bytes<N, kB>();
  const int smem = kTiles * (kATileBytes + kGroups * kBTileBytes) + 128 + 4096 * 4;
  auto kernel = rate<N, kGroups, kReduce, kWindow, kNoise, kB, kA>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const int threads = (kGroups + (kNoise != kNone)) * 128, steps = 4000;
  kernel<<<sms, threads, smem>>>(out, cycles, 100);  // warm-up
  if (cudaDeviceSynchronize() != cudaSuccess) {
    printf("%s N=%d groups=%d: %s\n", what, N, kGroups, cudaGetErrorString(cudaGetLastError()));
    return;
  }
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float best = 1e30f;
  for (int trial = 0; trial < 5; ++trial) {
    cudaEventRecord(e0);
    kernel<<<sms, threads, smem>>>(out, cycles, steps);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    best = ms < best ? ms : best;
  }
  long long c;
  cudaMemcpy(&c, cycles, sizeof(c), cudaMemcpyDeviceToHost);
  const double flop = 2.0 * 64 * N * 16 * kKSteps * (double)steps * kGroups * sms;
  const cudaError_t err = cudaGetLastError();
  printf("%-44s N=%3d groups=%d reduce=%3d window=%3d: %6.1f TFLOP/s, %5lld cycles a step (block 0) %s\n", what, N,
         kGroups, kReduce, kWindow, flop / (best * 1e-3) / 1e12, c, err == cudaSuccess ? "" : cudaGetErrorString(err));
}

int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out;
  long long* cycles;
  cudaMalloc(&out, sms * 512 * sizeof(float));
  cudaMalloc(&cycles, sms * sizeof(long long));
  // One chain: is a warpgroup's stream bound per instruction or per FLOP?
  run<64, 1, 0, 0, kNone>("one chain", sms, out, cycles);
  run<128, 1, 0, 0, kNone>("one chain", sms, out, cycles);
  run<256, 1, 0, 0, kNone>("one chain", sms, out, cycles);
  // More chains.
  run<128, 2, 0, 0, kNone>("two chains", sms, out, cycles);
  run<256, 2, 0, 0, kNone>("two chains", sms, out, cycles);
  run<64, 3, 0, 0, kNone>("three chains", sms, out, cycles);
  run<128, 3, 0, 0, kNone>("three chains", sms, out, cycles);
  // The fused kernel's shape (two chains of N = 256): instructions after the wait (the reduce) ...
  run<256, 2, 64, 0, kNone>("two chains, mins after the wait", sms, out, cycles);
  run<256, 2, 160, 0, kNone>("two chains, mins after the wait", sms, out, cycles);
  run<256, 2, 320, 0, kNone>("two chains, mins after the wait", sms, out, cycles);
  // ... between the issue and the wait (the write) ...
  run<256, 2, 0, 1, kNone>("two chains, the window's barrier and load", sms, out, cycles);
  run<256, 2, 0, 64, kNone>("two chains, FMAs before the wait", sms, out, cycles);
  run<256, 2, 0, 160, kNone>("two chains, FMAs before the wait", sms, out, cycles);
  run<256, 2, 0, 320, kNone>("two chains, FMAs before the wait", sms, out, cycles);
  // ... and from a warpgroup of their own.
  run<256, 2, 0, 0, kAlu>("two chains + an ALU warpgroup", sms, out, cycles);
  run<256, 2, 0, 0, kShfl>("two chains + a shuffle warpgroup", sms, out, cycles);
  run<256, 2, 0, 0, kShared>("two chains + a shared-memory warpgroup", sms, out, cycles);
  // Three chains of N = 128 with the reduce: one reducing while two multiply?
  run<128, 3, 80, 0, kNone>("three chains, mins after the wait", sms, out, cycles);
  // B read as the fused kernel reads its slots: does a start off the 128-byte line cost the tensor cores?
  run<256, 1, 0, 0, kNone, kTaps>("one chain, B as the kernel's taps", sms, out, cycles);
  run<256, 2, 0, 0, kNone, kTaps>("two chains, B as the kernel's taps", sms, out, cycles);
  run<256, 2, 64, 0, kNone, kTaps>("two chains, B as the kernel's taps, mins", sms, out, cycles);
  // A from registers (the weights held by the consumers): does it cost the tensor cores, alone or beside other
  // shared-memory traffic, compared with A from shared memory (the rows above)?
  run<256, 1, 0, 0, kNone, kDense, kARegs>("one chain, A from registers", sms, out, cycles);
  run<256, 2, 0, 0, kNone, kTaps, kARegs>("two chains, taps, A from registers", sms, out, cycles);
  run<256, 2, 64, 0, kNone, kTaps, kARegs>("two chains, taps, A from registers, mins", sms, out, cycles);
  run<256, 2, 0, 0, kSharedWide, kTaps, kASmem>("two chains, taps, A smem + 16-byte loads", sms, out, cycles);
  run<256, 2, 0, 0, kSharedWide, kTaps, kARegs>("two chains, taps, A regs + 16-byte loads", sms, out, cycles);
  return 0;
}
