// The backward from the saved argmin and pre-tanh min: dX, dW and db, deterministic.
#pragma once

#include "mma_atoms.cuh"
#include "numerics.cuh"
#include "precision.cuh"
#include "scheduler.cuh"

namespace kb25 {

// For v: e = exp(-2|v|) by ex2 and r = 1 / (1 + e) by rcp, on the SFU, from which tanh(v) = +-(1 - e) r and
// 1 - tanh(v)^2 = 4 e r^2, where tanhf evaluates an exp branch and a polynomial and selects. gm's factor this way is
// within about 2e-6 relative of float64's for |m| < 9 (mean 1.3e-7 below 1, where tanhf's route has 5e-8), also
// where tanh(m) nears 1 and 1 - tanhf(m)^2 cancels (|m| in [3, 6): up to 2.4e-3; [6, 9): up to 96%), so there gm is
// nearer float64's than the fp32 reference's is (tools/experiments/min_grad_error.py, a CPU simulation: ex2's error
// drawn within the PTX ISA's bound; with ex2's and rcp's both at their extremes, 1.9e-6). v = NaN gives NaN, +-inf
// e = 0.
__device__ __forceinline__ void tanh_terms(float v, float& e, float& r) {
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(e) : "f"(-2.8853900817779268f * fabsf(v)));  // -2 log2(e) |v|
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(1.f + e));
}

// With t1 = tanh(m), t2 = tanh(t1) at a pixel's saved min m, its gradient gm = g * (1 - t2^2) * (1 - t1^2) (the two
// tanh_backward steps of the reference, in its order) flows to its argmin channel k only. Everything in fp32; one
// rounding to the element type at the end. The reference's sums are dense (zeros times the other channels), and
// 0 * inf or 0 * NaN is NaN there: the kernels reproduce that where an input or a weight is not finite. Where
// tanhf(m) is +-1 (|m| >= 9.0109138, 0x41102CB4) the fp32 reference's 1 - t1^2 is 0, and so is the inner factor
// here: an infinite g gives NaN there and an infinity one float lower, as in the fp32 reference's chain. (A bf16
// reference's tanh is 1 from |m| of about 3.5 on; gm is fp32 here in every precision.)
__device__ __forceinline__ float min_grad(float g, float m) {
  float e, r;
  tanh_terms(m, e, r);
  const float t1 = copysignf((1.f - e) * r, m);
  float inner = 4.f * e * r * r;
  inner = fabsf(m) >= 9.0109138f ? 0.f : inner;  // a NaN m keeps its NaN
  tanh_terms(t1, e, r);
  const float outer = 4.f * e * r * r;
  return g * outer * inner;
}

// Strict fp32's saved pre-tanh min, recomputed at the pixel's argmin channel and rounded once: a compensated fp32 dot
// product (Dot2: each product's error by fma, each sum's by TwoSum, added apart), as accurate as a sum in twice fp32's
// precision, without float64 (1/64 rate on many GPUs). The 3xTF32 tensor cores' sums drop small * small and
// accumulate in the tensor cores' fp32 (which does not round to nearest): the kernel's minima are about 2.4 times as
// far from float64 as cuDNN's fp32 conv's (relative L2, H200), and gm, so every gradient, would carry that. A min that
// is not finite, or whose recomputation is not (0 * inf), stays the kernel's. One thread a pixel; the weights in
// shared memory, rows padded to an odd stride so that lanes of different k read different banks.
__global__ void __launch_bounds__(256) conv3x3_min_refine_kernel(const float* __restrict__ x,
                                                                 const float* __restrict__ w,
                                                                 const float* __restrict__ b,
                                                                 const unsigned char* __restrict__ argmin,
                                                                 float* __restrict__ pre_min, int64_t N, int H, int W) {
  constexpr int kCin = KB25_FUSED_CIN, kCout = KB25_FUSED_COUT, kKsize = KB25_FUSED_KSIZE;
  constexpr int kRow = kCin * kKsize * kKsize;  // a channel's weights, in the weight's order (c, i, j)
  constexpr int kStride = kRow + 1;
  __shared__ float ws[kCout * kStride];
  __shared__ float bs[kCout];
  for (int i = threadIdx.x; i < kCout * kRow; i += blockDim.x) ws[i / kRow * kStride + i % kRow] = w[i];
  if (threadIdx.x < kCout) bs[threadIdx.x] = b[threadIdx.x];
  __syncthreads();
  const int OH = H - (kKsize - 1), OW = W - (kKsize - 1);
  const int64_t total = N * OH * OW;
  for (int64_t p = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; p < total; p += gridDim.x * (int64_t)blockDim.x) {
    if (!isfinite(pre_min[p])) continue;
    const int ox = (int)(p % OW), oy = (int)(p / OW % OH);
    const int64_t n = p / ((int64_t)OW * OH);
    const float* const xp = x + (n * kCin * H + oy) * (int64_t)W + ox;
    const float* const wk = ws + argmin[p] * kStride;
    float sum = bs[argmin[p]], err = 0.f;
#pragma unroll 4
    for (int c = 0; c < kCin; ++c) {
#pragma unroll
      for (int t = 0; t < kKsize * kKsize; ++t) {
        const float a = wk[c * kKsize * kKsize + t], v = xp[((int64_t)c * H + t / kKsize) * W + t % kKsize];
        // _rn intrinsics: nvcc must not contract these into fmas, or the error terms are not exact
        const float prod = __fmul_rn(a, v), prod_err = fmaf(a, v, -prod);
        const float s = __fadd_rn(sum, prod), z = __fsub_rn(s, sum);
        err += __fadd_rn(__fsub_rn(sum, __fsub_rn(s, z)), __fsub_rn(prod, z)) + prod_err;
        sum = s;
      }
    }
    const float m = sum + err;
    if (isfinite(m)) pre_min[p] = m;
  }
}

struct GradGeometry {
  static constexpr int kCin = KB25_FUSED_CIN, kCout = KB25_FUSED_COUT, kKsize = KB25_FUSED_KSIZE;
  static constexpr int kTaps = kKsize * kKsize;
  static constexpr int kEntries = kCin * kTaps;  // a weight row: (c, i, j), in the weight's order
};

// A backward CTA's step: row `row` of column strip cb of image n, rows fastest, so that consecutive steps go down a
// strip. Found by divisions for a range's first step, then advanced from step to step: 64-bit divisions take hundreds
// of cycles each.
struct StripStep {
  int64_t n;
  int cb, row;
  __device__ static StripStep of(int64_t s, int rows, int col_blocks) {
    return {s / ((int64_t)rows * col_blocks), (int)((s / rows) % col_blocks), (int)(s % rows)};
  }
  __device__ StripStep following(int rows, int col_blocks) const {
    StripStep t = *this;
    if (++t.row == rows) {
      t.row = 0;
      if (++t.cb == col_blocks) {
        t.cb = 0;
        ++t.n;
      }
    }
    return t;
  }
};

// dX[c, y, q] = sum over taps (i, j) with p = (y - i, q - j) inside the output of gm[p] * W[k(p), c, i, j]: a gather,
// no atomics. A step is one input row segment of kCols columns; a thread owns one column and its 16 channels.
struct GradInput : GradGeometry {
  static constexpr int kCols = 256, kThreads = kCols;
  static constexpr int kTileCols = kCols + kKsize - 1;
  // Shared memory: the weights as [tap][k][c] (fp32; a row of 16 channels is 4 chunks of 16 bytes, chunk c4 stored
  // at c4 ^ ((k >> 1) & 3), so that rows of different k spread over 8 chunk positions of the banks: the lanes of a
  // warp read rows of their own pixels' k), each tap's kCout rows followed by a row of zeros (k = kZeroRow), which a
  // tap outside the output reads, so that every tap runs the same code, without a branch; then per weight column
  // (c, tap) a mask of the channels k whose weight there is not finite; then a ring of the (gm, k) of output rows,
  // row oy in slot oy & (kRing - 1). A step reads kKsize rows and stores one; with one slot more than it reads, the
  // store of step s + 1 lands in the slot step s - 1 read last, so one barrier a step separates them.
  static constexpr int kRing = 4;
  static_assert(kRing > kKsize && (kRing & (kRing - 1)) == 0, "a spare slot, and a mask for the index");
  static constexpr int kZeroRow = kCout, kWeightRows = kCout + 1;
  static constexpr int kWeightBytes = kTaps * kWeightRows * kCin * 4;
  static constexpr int kMaskBytes = kEntries * 8;
  static constexpr int kSmemBytes = kWeightBytes + kMaskBytes + kRing * kTileCols * 8;
  __device__ static int slot(int oy) { return oy & (kRing - 1); }  // oy >= -(kKsize - 1); two's complement
  __device__ static int chunk(int k, int c4) { return c4 ^ ((k >> 1) & 3); }
};

// Three CTAs an SM (80 registers a thread): two left the SM's loads and barriers less to overlap, four (64 registers)
// made each step slower.
template <class Elem>
__global__ void __launch_bounds__(GradInput::kThreads, 3)
    conv3x3_min_tanh2_grad_input_kernel(const Elem* __restrict__ g, const float* __restrict__ pre_min,
                                        const unsigned char* __restrict__ argmin, const Elem* __restrict__ w,
                                        Elem* __restrict__ dx, int H, int W, int64_t total_steps) {
  using G = GradInput;
  extern __shared__ __align__(128) unsigned char smem[];
  float4* const ws = reinterpret_cast<float4*>(smem);
  uint64_t* const bad_w = reinterpret_cast<uint64_t*>(smem + G::kWeightBytes);
  float2* const tile = reinterpret_cast<float2*>(smem + G::kWeightBytes + G::kMaskBytes);  // (gm, k as float)
  // Staging: thread (k, c) pairs, all nine taps of each (its loads in flight together).
  constexpr int kPairs = G::kCout * G::kCin, kPairsPerThread = kPairs / G::kThreads;
  static_assert(kPairs % G::kThreads == 0, "whole pairs per thread");
#pragma unroll 1
  for (int r = 0; r < kPairsPerThread; ++r) {
    const int pair = threadIdx.x + r * G::kThreads, k = pair / G::kCin, c = pair % G::kCin;
    float v[G::kTaps];
#pragma unroll
    for (int tap = 0; tap < G::kTaps; ++tap) v[tap] = convert<float>(w[(k * G::kCin + c) * G::kTaps + tap]);
#pragma unroll
    for (int tap = 0; tap < G::kTaps; ++tap) {
      reinterpret_cast<float*>(ws + (tap * G::kWeightRows + k) * 4 + G::chunk(k, c / 4))[c % 4] = v[tap];
    }
  }
  static_assert(G::kThreads >= G::kTaps * 4, "a thread for each 16-byte chunk of the zero rows");
  if (threadIdx.x < G::kTaps * 4) ws[((threadIdx.x >> 2) * G::kWeightRows + G::kZeroRow) * 4 + (threadIdx.x & 3)] = {};
  __syncthreads();
  bool any_bad = false;
  for (int e = threadIdx.x; e < G::kEntries; e += blockDim.x) {
    const int c = e / G::kTaps, tap = e % G::kTaps;
    uint64_t bad = 0;
    for (int k = 0; k < G::kCout; ++k) {
      if (!isfinite(reinterpret_cast<const float*>(ws + (tap * G::kWeightRows + k) * 4 + G::chunk(k, c / 4))[c % 4])) {
        bad |= 1ull << k;
      }
    }
    bad_w[e] = bad;
    any_bad |= bad != 0;
  }
  any_bad = __syncthreads_or(any_bad);

  const int OH = H - (G::kKsize - 1), OW = W - (G::kKsize - 1);
  const int col_blocks = (W + G::kCols - 1) / G::kCols;
  int64_t begin, end;
  step_range(total_steps, blockIdx.x, gridDim.x, begin, end);
  // Steps go down a column strip: step s is input row s % H of strip (s / H) % col_blocks of image s / (H *
  // col_blocks), so consecutive steps of a range share two of their three output rows. The (gm, k) of output row oy,
  // columns q0 - (kKsize - 1) .. q0 + kCols - 1, sit in ring slot G::slot(oy) of `tile`: each output pixel's gm is
  // computed once a strip, and a step brings in one new row (oy = y), loaded two steps ahead.
  constexpr int kPerThread = (G::kTileCols + G::kThreads - 1) / G::kThreads;
  // A row's loads, held in registers from their issue to the step that stores them: two such, a row two steps ahead.
  struct Row {
    Elem g[kPerThread];
    float m[kPerThread];
    int k[kPerThread];
  };
  const auto load_row = [&](Row& r, int64_t n, int cb, int oy) {
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const int at = threadIdx.x + u * G::kThreads, ox = cb * G::kCols - (G::kKsize - 1) + at;
      r.k[u] = G::kZeroRow;
      if (at < G::kTileCols && oy >= 0 && oy < OH && ox >= 0 && ox < OW) {
        const int64_t pix = (n * OH + oy) * OW + ox;
        r.g[u] = g[pix];
        r.m[u] = pre_min[pix];
        r.k[u] = argmin[pix];
      }
    }
  };
  const auto store_row = [&](const Row& r, int oy) {
    float2* const slot = tile + G::slot(oy) * G::kTileCols;
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const int at = threadIdx.x + u * G::kThreads;
      if (at < G::kTileCols) {
        const bool inside = r.k[u] != G::kZeroRow;
        slot[at] = make_float2(inside ? min_grad(convert<float>(r.g[u]), r.m[u]) : 0.f, __int_as_float(r.k[u]));
      }
    }
  };
  StripStep strip = StripStep::of(begin, H, col_blocks);  // an input row: strip.row is y
  // Step s stores row y from one of two Rows, loaded two steps before (a strip's first step: loaded now, with its two
  // rows above), then loads into it row y + 2 of the same strip for step s + 2. A strip's first step also loads row
  // y + 1 into the other, which step s - 1, the last of another strip, left unloaded. (16-bit g: each row's loads a
  // step ahead and a second barrier a step read 10% slower; float32 g, whose dX writes twice the bytes, 1%.)
  Row row_a, row_b;
  const auto step = [&](int64_t s, Row& mine, Row& other) {
    const int y = strip.row, cb = strip.cb, q0 = cb * G::kCols;
    const int64_t n = strip.n;
    if (s == begin || y == 0) {  // a strip's first step here: its three output rows
      __syncthreads();  // over slots the last step may still be reading
      for (int i = G::kKsize - 1; i >= 0; --i) {
        load_row(mine, n, cb, y - i);
        store_row(mine, y - i);
      }
      if (s + 1 < end && y + 1 < H) load_row(other, n, cb, y + 1);
    } else {
      store_row(mine, y);
    }
    __syncthreads();
    if (s + 2 < end && y + 2 < H) load_row(mine, n, cb, y + 2);
    const int q = q0 + threadIdx.x;
    if (q < W) {
      float acc[G::kCin];
#pragma unroll
      for (int c = 0; c < G::kCin; ++c) acc[c] = 0.f;
#pragma unroll
      for (int tap = 0; tap < G::kTaps; ++tap) {  // a tap outside the output: gm 0 times the zero row
        const int i = tap / G::kKsize, j = tap % G::kKsize;
        const float2 v = tile[G::slot(y - i) * G::kTileCols + threadIdx.x + (G::kKsize - 1) - j];
        const int k = __float_as_int(v.y);
        const float4* const row = ws + (tap * G::kWeightRows + k) * 4;
#pragma unroll
        for (int c4 = 0; c4 < G::kCin / 4; ++c4) {
          const float4 wv = row[G::chunk(k, c4)];
          acc[4 * c4] = fmaf(v.x, wv.x, acc[4 * c4]);
          acc[4 * c4 + 1] = fmaf(v.x, wv.y, acc[4 * c4 + 1]);
          acc[4 * c4 + 2] = fmaf(v.x, wv.z, acc[4 * c4 + 2]);
          acc[4 * c4 + 3] = fmaf(v.x, wv.w, acc[4 * c4 + 3]);
        }
      }
      if (any_bad) {  // the reference's 0 * W[k', c, i, j] for every k' other than k(p): NaN where that W is not finite
#pragma unroll 1
        for (int tap = 0; tap < G::kTaps; ++tap) {
          const int i = tap / G::kKsize, j = tap % G::kKsize;
          const int k = __float_as_int(tile[G::slot(y - i) * G::kTileCols + threadIdx.x + (G::kKsize - 1) - j].y);
          const uint64_t others = k == G::kZeroRow ? 0 : ~(1ull << k);
#pragma unroll
          for (int c = 0; c < G::kCin; ++c) {
            if (bad_w[c * G::kTaps + tap] & others) acc[c] = __int_as_float(0x7fffffff);
          }
        }
      }
#pragma unroll
      for (int c = 0; c < G::kCin; ++c) dx[((n * G::kCin + c) * H + y) * W + q] = convert<Elem>(acc[c]);
    }
    strip = strip.following(H, col_blocks);
  };
  for (int64_t s = begin; s < end; s += 2) {
    step(s, row_a, row_b);
    if (s + 1 < end) step(s + 1, row_b, row_a);
  }
}

// dW[k, c, i, j] = sum over the pixels p whose argmin is k of gm[p] * x[c, p + (i, j)]; db[k] = sum of those gm[p].
// Each CTA walks its own range of steps (kCols output columns of one row; consecutive steps are consecutive rows of
// one column strip) and sums into its partial [kCout][kEntries + 1] in shared memory, written out once;
// grad_weight_reduce_kernel then adds the partials in CTA order. Every sum runs in a fixed order: the same bits
// from run to run, no atomics on floats. The input rows sit in a ring of kKsize slots (each row is loaded once per
// strip, and the next step's row and pixels are in flight while this step is summed). Within a step the pixels are
// sorted by k (stably); walker e (one weight entry (c, i, j), or the bias for e = kEntries) runs through each present
// k's pixels four at a time into a register, then adds it to the partial.
struct GradWeight : GradGeometry {
  static constexpr int kCols = 128, kThreads = 160;
  static constexpr int kXCols = kCols + kKsize - 1;
  static constexpr int kXPitch = kXCols + 1;  // 131 = 3 mod 32: the walkers' loads of one pixel spread over the banks
  static constexpr int kWalkers = kEntries + 1;
  static constexpr int kPartial = kEntries + 1;
  static constexpr int kSortWarps = kCols / 32;
  static constexpr int kRowItems = kCin * kXCols;  // one input row of every channel
  static constexpr int kRowPerThread = (kRowItems + kThreads - 1) / kThreads;
  static constexpr int kXBytes = kKsize * kCin * kXPitch * 4;  // [slot][c][kXPitch]
  static constexpr int kSumBytes = kCout * kPartial * 4;
  static constexpr int kListBytes = kCols * 8;
  static constexpr int kHistBytes = (kSortWarps * kCout + kCout + 1 + kCout + 1) * 4;  // hist, start, present k
  static constexpr int kSmemBytes = kXBytes + kSumBytes + kListBytes + kHistBytes;
  static_assert(kThreads >= kWalkers && kThreads == 32 * (kSortWarps + 1) && kCout == 64, "layout");
};

// The end of both dW kernels: entry e's sums made NaN for the k its walk poisoned (the reference's 0 * NaN), then
// the CTA's partial [kCout][kPartial] from shared memory to its place in `partial`.
__device__ __forceinline__ void write_partial(float* sums, uint64_t poisoned, int e, float* __restrict__ partial) {
  using G = GradWeight;
  if (e < G::kEntries) {
    for (int kk = 0; kk < G::kCout; ++kk) {
      if ((poisoned >> kk) & 1) sums[kk * G::kPartial + e] = __int_as_float(0x7fffffff);
    }
  }
  __syncthreads();
  float* const mine = partial + (int64_t)blockIdx.x * G::kCout * G::kPartial;
  for (int at = threadIdx.x; at < G::kCout * G::kPartial; at += blockDim.x) mine[at] = sums[at];
}

template <class Elem>
__global__ void __launch_bounds__(GradWeight::kThreads, 3)
    conv3x3_min_tanh2_grad_weight_kernel(const Elem* __restrict__ x, const Elem* __restrict__ g,
                                         const float* __restrict__ pre_min, const unsigned char* __restrict__ argmin,
                                         float* __restrict__ partial, int H, int W, int64_t total_steps) {
  using G = GradWeight;
  extern __shared__ __align__(128) unsigned char smem[];
  float* const xs = reinterpret_cast<float*>(smem);                                       // [slot][c][kXPitch]
  float* const sums = reinterpret_cast<float*>(smem + G::kXBytes);                        // [k][kPartial]
  int2* const list = reinterpret_cast<int2*>(smem + G::kXBytes + G::kSumBytes);           // (t, gm) sorted by k
  int* const hist = reinterpret_cast<int*>(smem + G::kXBytes + G::kSumBytes + G::kListBytes);  // [warp][k]
  int* const start = hist + G::kSortWarps * G::kCout;  // [k]; start[kCout] = the step's pixel count
  int* const present = start + G::kCout + 1;           // the k with pixels, in order; present[kCout] = how many
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < G::kCout * G::kPartial; i += blockDim.x) sums[i] = 0.f;
  // Walker e: its entry (c, i, j), and the channels whose sum met a non-finite input at a pixel of another argmin
  // (0 * inf or 0 * NaN in the reference's dense sum): NaN at the end.
  const int e = threadIdx.x, walker_c = e / G::kTaps, walker_i = e % G::kTaps / G::kKsize, walker_j = e % G::kKsize;
  uint64_t poisoned = 0;

  const int OH = H - (G::kKsize - 1), OW = W - (G::kKsize - 1);
  const int col_blocks = (OW + G::kCols - 1) / G::kCols;
  int64_t begin, end;
  step_range(total_steps, blockIdx.x, gridDim.x, begin, end);
  // Input row y of the strip into registers (row_next), then into its ring slot y % kKsize.
  float row_next[G::kRowPerThread];
  // Bit i: this thread stored a non-finite input into ring slot i (it stores the same positions of every row, so the
  // bit is exact for its part of the row the slot holds now; a row's bit lives as long as the row does).
  uint32_t bad_slots = 0;
  const auto load_row = [&](int64_t n, int cb, int y) {
#pragma unroll
    for (int u = 0; u < G::kRowPerThread; ++u) {
      const int at = threadIdx.x + u * G::kThreads, c = at / G::kXCols, col = cb * G::kCols + at % G::kXCols;
      row_next[u] = 0.f;
      if (at < G::kRowItems && col < W) row_next[u] = convert<float>(x[((n * G::kCin + c) * H + y) * W + col]);
    }
  };
  const auto store_row = [&](int y) {
    float* const slot = xs + (y % G::kKsize) * G::kCin * G::kXPitch;
    bool bad = false;
#pragma unroll
    for (int u = 0; u < G::kRowPerThread; ++u) {
      const int at = threadIdx.x + u * G::kThreads;
      if (at < G::kRowItems) {
        slot[(at / G::kXCols) * G::kXPitch + at % G::kXCols] = row_next[u];
        bad |= !isfinite(row_next[u]);
      }
    }
    const uint32_t bit = 1u << (y % G::kKsize);
    bad_slots = bad ? bad_slots | bit : bad_slots & ~bit;
  };
  // The step's pixels (sorting warps, one per thread): raw loads in flight ahead of their use.
  Elem g_next{};
  float m_next = 0.f;
  int k_next = -1;
  const auto load_pixel = [&](StripStep t) {
    const int ox = t.cb * G::kCols + threadIdx.x;
    k_next = -1;
    if (warp < G::kSortWarps && ox < OW) {
      const int64_t pix = (t.n * OH + t.row) * OW + ox;
      g_next = g[pix];
      m_next = pre_min[pix];
      k_next = argmin[pix];
    }
  };
  StripStep step = StripStep::of(begin, OH, col_blocks);
  if (begin < end) load_pixel(step);
  for (int64_t s = begin; s < end; ++s, step = step.following(OH, col_blocks)) {
    const int oy = step.row, cb = step.cb;
    const int64_t n = step.n;
    const int count = min(G::kCols, OW - cb * G::kCols);
    if (s == begin || oy == 0) {  // a new strip: its window's three rows
      for (int i = 0; i < G::kKsize; ++i) {
        load_row(n, cb, oy + i);
        store_row(oy + i);
      }
    }
    // Sort: each sorting warp counts its 32 pixels per k (one match per value), the counts give every k's start,
    // and a pixel's place is its k's start, the pixels of that k in earlier warps, and the lanes below it.
    for (int at = threadIdx.x; at < G::kSortWarps * G::kCout; at += blockDim.x) hist[at] = 0;
    __syncthreads();
    const int k = k_next;
    const float gm = k >= 0 ? min_grad(convert<float>(g_next), m_next) : 0.f;
    int below = 0;
    if (warp < G::kSortWarps) {
      const unsigned peers = __match_any_sync(0xffffffffu, k);
      below = __popc(peers & ((1u << lane) - 1));
      if (k >= 0 && below == 0) hist[warp * G::kCout + k] = __popc(peers);
    }
    // A non-finite input anywhere in the step's window (its three rows, whenever they were stored).
    const bool bad_x = __syncthreads_or(bad_slots != 0);
    if (warp == G::kSortWarps) {  // start[k], the exclusive prefix of the counts; the present k, in order
      int c0 = 0, c1 = 0;
#pragma unroll
      for (int w = 0; w < G::kSortWarps; ++w) {
        c0 += hist[w * G::kCout + 2 * lane];
        c1 += hist[w * G::kCout + 2 * lane + 1];
      }
      int incl = c0 + c1;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int up = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += up;
      }
      start[2 * lane] = incl - c0 - c1;
      start[2 * lane + 1] = incl - c1;
      const unsigned has0 = __ballot_sync(0xffffffffu, c0 > 0), has1 = __ballot_sync(0xffffffffu, c1 > 0);
      const unsigned lower = (1u << lane) - 1;
      const int at = __popc(has0 & lower) + __popc(has1 & lower);
      if (c0 > 0) present[at] = 2 * lane;
      if (c1 > 0) present[at + (c0 > 0)] = 2 * lane + 1;
      if (lane == 31) {
        start[G::kCout] = incl;
        present[G::kCout] = __popc(has0) + __popc(has1);
      }
    }
    __syncthreads();
    if (k >= 0) {
      int place = start[k] + below;
      for (int w = 0; w < warp; ++w) place += hist[w * G::kCout + k];
      list[place] = make_int2(threadIdx.x, __float_as_int(gm));
    }
    __syncthreads();
    // The next step's row and pixels, in flight while this step is summed.
    const bool next_continues = s + 1 < end && oy + 1 < OH;
    if (next_continues) load_row(n, cb, oy + G::kKsize);
    if (s + 1 < end) load_pixel(step.following(OH, col_blocks));
    if (e < G::kWalkers) {
      const bool is_bias = e == G::kEntries;
      const float* const my_x = xs + ((oy + walker_i) % G::kKsize * G::kCin + walker_c) * G::kXPitch + walker_j;
      const int kinds = present[G::kCout];
      for (int q = 0; q < kinds; ++q) {
        const int kk = present[q], to = start[kk + 1];
        float acc = 0.f;
        int at = start[kk];
        for (; at + 4 <= to; at += 4) {
          int2 item[4];
          float xv[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) item[u] = list[at + u];
#pragma unroll
          for (int u = 0; u < 4; ++u) xv[u] = is_bias ? 1.f : my_x[item[u].x];
#pragma unroll
          for (int u = 0; u < 4; ++u) acc = fmaf(__int_as_float(item[u].y), xv[u], acc);
          if (bad_x) {
#pragma unroll
            for (int u = 0; u < 4; ++u) poisoned |= isfinite(xv[u]) ? 0 : ~(1ull << kk);
          }
        }
        for (; at < to; ++at) {
          const int2 item = list[at];
          const float xv = is_bias ? 1.f : my_x[item.x];
          acc = fmaf(__int_as_float(item.y), xv, acc);
          if (bad_x && !isfinite(xv)) poisoned |= ~(1ull << kk);
        }
        sums[kk * G::kPartial + e] += acc;
      }
    }
    __syncthreads();  // the walk is done with row oy's slot
    if (next_continues) store_row(oy + G::kKsize);
  }
  write_partial(sums, poisoned, e, partial);
}

// The OR and the largest of v over the warp's 32 lanes (every lane active): redux.sync on sm_80+, where the tensor-core
// kernels run; shuffles elsewhere, so that the source compiles for every arch.
__device__ __forceinline__ uint32_t warp_or(uint32_t v) {
#if KB25_HAS_FUSED
  return __reduce_or_sync(0xffffffffu, v);
#else
#pragma unroll
  for (int d = 16; d > 0; d /= 2) v |= __shfl_xor_sync(0xffffffffu, v, d);
  return v;
#endif
}
__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
#if KB25_HAS_FUSED
  return __reduce_max_sync(0xffffffffu, v);
#else
#pragma unroll
  for (int d = 16; d > 0; d /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, d));
  return v;
#endif
}

// The tensor-core dW's gm operand (grad_weight_fed.cuh). gm is scaled by 2^scale (exact), scale putting the largest
// finite |gm| of a step (256 pixels of one output row) in [2^14, 2^15): the operand is gm * 2^scale rounded to TF32
// (cvt.rna), in fp16 (hi); the step's sums are unscaled in fp32 as they are added. So a step's gm keeps TF32's class
// down to 2^-28 of its largest, and a gm below 2^-38 of it is lost (as in any fp32 sum that holds the largest), a
// step apart from every other step's range. The scale stays within [-126, 126]: a largest |gm| up to fp32's largest
// fits, and 2^-scale is a normal float. db keeps what hi leaves too (lo = gm * 2^scale - hi, times 2^11, in fp16):
// about 22 bits of each gm, as an fp32 sum does.
struct GradScale {
  __device__ static float pow2(int s) { return __int_as_float((127 + s) << 23); }  // -126 <= s <= 126
  // The operand scale from the largest finite |gm| (bits): that |gm| times 2^scale in [2^14, 2^15), and 2^-scale a
  // normal float.
  __device__ static int operand_scale(uint32_t largest) {
    return max(-126, min(126, 141 - max((int)(largest >> 23), 1)));
  }
  // A pixel's gm * 2^scale as the operands carry it: hi = rounded to TF32 (cvt.rna), in fp16; lo = what hi leaves,
  // times 2^11, in fp16 (0 where gm is not finite). Each in the low half of its word.
  __device__ static void split_gm(float scaled, uint32_t& hi, uint32_t& lo) {
    hi = Native16<__half>::pack2(round_to_tf32(scaled), 0.f) & 0xFFFFu;
    const float rest = scaled - __half2float(__ushort_as_half((unsigned short)hi));
    lo = isfinite(scaled) ? Native16<__half>::pack2(rest * 2048.f, 0.f) & 0xFFFFu : 0u;
  }
};

// The partials of `blocks` CTAs added in a fixed order; dw [k][entries] and db [k] (either may be null) in Elem. A
// CTA takes kReduceOutputs consecutive outputs; slice s of them adds the partials s, s + kReduceSlices, ... in
// order (many loads in flight a thread, not one chain of `blocks` loads), then slice 0 adds the slices in order.
// The order depends on `blocks` only: the same bits from run to run.
inline constexpr int kReduceOutputs = 32, kReduceSlices = 8;
template <class Elem>
__global__ void __launch_bounds__(kReduceOutputs * kReduceSlices) conv3x3_min_tanh2_grad_weight_reduce_kernel(
    const float* __restrict__ partial, int blocks, Elem* __restrict__ dw, Elem* __restrict__ db) {
  using G = GradWeight;
  __shared__ double slices[kReduceSlices][kReduceOutputs];
  const int o = threadIdx.x % kReduceOutputs, s = threadIdx.x / kReduceOutputs;
  const int at = blockIdx.x * kReduceOutputs + o;
  const bool inside = at < G::kCout * G::kPartial;
  const int64_t pitch = G::kCout * G::kPartial;
  const float* const p = partial + (inside ? at : 0);
  double sum = 0.0;  // in double: a few hundred partials, some of which cancel
  int b = s;
  constexpr int kInFlight = 8;
  for (; b + (kInFlight - 1) * kReduceSlices < blocks; b += kInFlight * kReduceSlices) {
    float v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) v[u] = p[(b + u * kReduceSlices) * pitch];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) sum += v[u];
  }
  for (; b < blocks; b += kReduceSlices) sum += p[b * pitch];
  slices[s][o] = sum;
  __syncthreads();
  if (s != 0 || !inside) return;
#pragma unroll
  for (int t = 1; t < kReduceSlices; ++t) sum += slices[t][o];
  const int k = at / G::kPartial, e = at % G::kPartial;
  if (e < G::kEntries) {
    if (dw) dw[k * G::kEntries + e] = convert<Elem>(sum);
  } else if (db) {
    db[k] = convert<Elem>(sum);
  }
}

}  // namespace kb25
