// The row-streaming wgmma mainloop and epilogue (sm_90a): each step is one input row, A = its 64 pixels, B = the
// weights of all three kernel rows, so that three output rows' accumulators rotate through one N = 192 MMA.
#pragma once

#include "geometry.cuh"
#include "mainloop_wgmma.cuh"

namespace kb25 {

// Input row t of a column strip adds kernel row kh = 0 to output row t, kh = 1 to t - 1 and kh = 2 to t - 2. A
// consumer keeps those three output rows' sums in one m64n192 accumulator: N block b (channels 64 b .. 64 b + 63 of
// the MMA's N) holds the output row whose index within the window is b mod 3 (the window: the consumer's run of
// steps down one strip, its first input row index 0). A row's step is three MMAs, one per column tap kw: A = the
// slot's 64 pixels from column kw (K = its 16 channels; the slot's groups are the K halves, 8 pixels a 128-byte core
// matrix, as the saving variants' pixel rows read it), B = the weights of tap kw for all three blocks, in the
// rotation r = t mod 3 that gives block b kernel row (r - b) mod 3. After step t, block (t + 1) mod 3 holds output row
// t - 2 complete: the epilogue takes each pixel's min from registers, writes it, and resets the block to the bias
// for output row t + 1. Against the channel-major layout (WgmmaMainloop: M = the 64 channels, N = 256 pixels, a lane
// butterfly for the min) a thread holds 16 channels of each of 2 pixels: the min is 15 mins and 2 quad shuffle steps
// a pixel, and the saving variant's argmin a scan in registers (docs/perf-notes.md, "Tensor cores: rate, tile shape,
// issue order": rotate_rate).
// One product only (OneProduct); the 3 x 3 x 16 x 192 weight tiles (54 KB of fp16) are staged once per CTA.
template <class Geometry_>
struct WgmmaRowsMainloop {
  using Geometry = Geometry_;
  using Precision = typename Geometry::Precision;
  using Elem = typename Geometry::Elem;
  using ParamElem = typename Geometry::ParamElem;
  using MmaElem = typename Geometry::MmaElem;
  using Multiply = typename Precision::Multiply;
  static_assert(Multiply::kCopies == 1 && Geometry::kKStepsPerTap == 1, "one product, one k16 step a tap");
  static_assert(Geometry::kTileCols == 64 && Geometry::kCout == 64 && Geometry::kKsize == 3,
                "an m64 MMA covers the tile's pixels; three blocks of the 64 channels");
  static constexpr int kBlocks = Geometry::kKsize;         // output rows in flight
  static constexpr int kN = kBlocks * Geometry::kCout;      // 192
  static constexpr int kNBlocks = kN / 8;                   // n8 blocks of the accumulator
  static constexpr int kBlockN8 = Geometry::kCout / 8;      // n8 blocks of one output row's block
  using Accum = float[kNBlocks][4];
  static constexpr int kBKBytes = kN * 16;                  // B's K-direction core matrices (the two k halves)
  static constexpr int kTapBytes = 2 * kBKBytes;            // one (rotation, kw) tile: 16 k x 192 n
  static constexpr int kWeightBytes = kBlocks * Geometry::kKsize * kTapBytes;
  static constexpr int kScratchOffset = kWeightBytes;       // then the precision's scratch words (scale, guard flag)
  static constexpr int kSmemBytes = kScratchOffset + Precision::kScratchBytes;
  static constexpr int kRegisters = kNBlocks * 4 + 2 * kBlockN8;  // the accumulators and the thread's 16 biases
  // A row's slot is free once its own step's MMAs have landed: the ring needs no slot for a window.
  static constexpr bool kReleasesOldestEarly = true;
  static constexpr bool kWaitsForNewest = false;
  static constexpr bool kPixelRowsFit = false;

  const uint64_t weights;  // descriptor of rotation 0, tap 0
  // The thread's channels' biases, scaled as the weights (Precision::scale): channel 8 i + 2 t + e at 2 i + e.
  float bias[2 * kBlockN8];

  __device__ WgmmaRowsMainloop(const unsigned char* smem, const ParamElem* __restrict__ b, int ctid)
      : weights(wgmma_desc(smem, kBKBytes, 128)) {
    const int t = ctid & 3;
    const float scale = Precision::scale_of(scratch(smem));
#pragma unroll
    for (int i = 0; i < kBlockN8; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        bias[2 * i + e] = Precision::scale(convert<float>(Precision::param(b[8 * i + 2 * t + e])), scale);
  }
  __host__ __device__ static const uint32_t* scratch(const unsigned char* smem) {
    return reinterpret_cast<const uint32_t*>(smem + kScratchOffset);
  }
  // Where B element (n, k) of rotation r's tap kw sits (in MmaElem units): K-major core matrices, 8 n x 16 bytes.
  __host__ __device__ static constexpr int b_index(int r, int kw, int n, int k) {
    return ((r * Geometry::kKsize + kw) * kTapBytes + (k / 8) * kBKBytes + (n / 8) * 128 + (n % 8) * 16) /
               (int)sizeof(MmaElem) + k % 8;
  }
  // The weights, written by all of the CTA's threads before they split into roles: each weight once per rotation
  // (weight (co, ci, kh, kw) at n = 64 ((r - kh) mod 3) + co, k = ci of rotation r's tap kw). The precision's scale
  // first (find_scale), and its flag raised where a weight or the bias does not carry (Precision::inexact).
  template <int kThreads>
  __device__ static void stage_shared(unsigned char* smem, const ParamElem* __restrict__ w,
                                      const ParamElem* __restrict__ b) {
    constexpr int kCin = Geometry::kCin, kCout = Geometry::kCout, kK = Geometry::kKsize;
    MmaElem* const a = reinterpret_cast<MmaElem*>(smem);
    uint32_t* const flags = reinterpret_cast<uint32_t*>(smem + kScratchOffset);
    const float scale = Precision::template find_scale<kThreads>(w, kCout * kCin * Geometry::kTaps, b, kCout, flags);
    bool inexact = false;
    // Item i: weight (co, ci, tap) in w's own order, so that the loads are coalesced.
    stage_batched<kThreads, kCout * kCin * Geometry::kTaps>(
        [&](int i) { return Precision::param(w[i]); },
        [&](int i, Elem v) {
          const int tap = i % Geometry::kTaps, ci = (i / Geometry::kTaps) % kCin, co = i / (Geometry::kTaps * kCin);
          const int kh = tap / kK, kw = tap % kK;
          inexact |= Precision::inexact(v, scale);
          const Elem scaled = Precision::scale(v, scale);
#pragma unroll
          for (int r = 0; r < kBlocks; ++r)
            Multiply::template store_weight<Precision>(a, b_index(r, kw, Geometry::kCout * ((r - kh + kK) % kK) + co, ci),
                                                       0, scaled);
        });
    if (threadIdx.x < kCout) inexact |= Precision::inexact_bias(b[threadIdx.x], scale);
    if (inexact) atomicOr(flags + 1, 1u);
    fence_proxy_async();  // published to wgmma by the barrier before the roles split
  }
  // Input row `slot` (rotation r = its index in the window mod 3) into all three blocks: three MMAs, issued and
  // committed; finish() waits for them.
  __device__ void start(Accum& acc, const unsigned char* slot, int r) const {
    const uint64_t a = wgmma_desc(slot, Geometry::kGroupBytes, 128);
    const uint64_t b = weights + (uint64_t)((r * Geometry::kKsize * kTapBytes) >> 4);
    pin(acc);
    wgmma_fence();
#pragma unroll
    for (int kw = 0; kw < Geometry::kKsize; ++kw)
      wgmma_async(acc, a + ((kw * 16) >> 4), b + ((kw * kTapBytes) >> 4), Operand<MmaElem>{});
    wgmma_commit();
  }
  __device__ static void finish(Accum& acc) {
    wgmma_wait<0>();
    pin(acc);
  }
  // Block kB starts output row anew: its accumulators become the bias (moves in asm, so that ptxas keeps them out of
  // the wgmma's registers' way rather than merging copies).
  template <int kB>
  __device__ void reset(Accum& acc) const {
#pragma unroll
    for (int i = 0; i < kBlockN8; ++i)
#pragma unroll
      for (int q = 0; q < 4; ++q)
        asm volatile("mov.b32 %0, %1;\n" : "=f"(acc[kB * kBlockN8 + i][q]) : "f"(bias[2 * i + (q & 1)]));
  }
  // Every accumulator to zero once, before the first window (the blocks of rows before it take sums that no one
  // reads).
  __device__ static void clear(Accum& acc) {
#pragma unroll
    for (int j = 0; j < kNBlocks; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) asm volatile("mov.b32 %0, 0;\n" : "=f"(acc[j][q]));
  }
};

// The row-streaming epilogue: block kB's output row from registers, in two halves. reduce() runs as soon as the row's
// MMAs have landed and reads the accumulators: lane (g, t) of warp w holds pixels 16 w + g (accumulator elements 0, 1)
// and 16 w + g + 8 (2, 3), channels 8 i + 2 t + (e & 1) in acc[8 kB + i]; each pixel's min over the thread's 16
// channels (saving: and its channel, scanned in channel order as torch.min picks it, scan_min). write() runs while the
// next row's MMAs are in flight and touches no accumulator: two quad steps (lanes xor 1 each keep one of the two
// pixels, lanes xor 2 exchange it), so lane t ends with pixel 16 w + g + 8 (t & 1) over all 64 channels; lanes t = 0,
// 1 write it (a warp's store: 16 consecutive pixels). Nothing in shared memory.
template <class Mainloop, bool kSave>
struct WgmmaRowsEpilogue {
  using Geometry = typename Mainloop::Geometry;
  using Precision = typename Geometry::Precision;
  using Elem = typename Geometry::Elem;
  static constexpr int kSmemBytes = 0;
  static constexpr bool kHandsOff = false;
  static constexpr int kHandOffStages = 0;
  static constexpr bool kPixelRows = false;
  static constexpr bool kStagesPacked = false;
  float out_scale = 1.f;  // what each pixel's min is multiplied by (Precision::unscale; Tf32OnF16: 2^-s)
  const int ctid;
  __device__ explicit WgmmaRowsEpilogue(int ctid_) : ctid(ctid_) {}
  // A reduced row between its two halves: the thread's two pixels' minima (and channels, kSave).
  struct Partial {
    float m[2];
    int c[2];
  };

  template <int kB>
  __device__ Partial reduce(const typename Mainloop::Accum& acc) const {
    constexpr int kN8 = Mainloop::kBlockN8;
    const int t = ctid & 3;
    Partial p;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (kSave) {
        p.m[h] = acc[kB * kN8][2 * h];
        p.c[h] = 2 * t;
#pragma unroll
        for (int k = 1; k < 2 * kN8; ++k)  // channel 8 (k / 2) + 2 t + k % 2, ascending
          scan_min(p.m[h], p.c[h], acc[kB * kN8 + k / 2][2 * h + k % 2], 8 * (k / 2) + 2 * t + k % 2);
      } else {  // two chains (even and odd channels) for the scheduler
        float even = acc[kB * kN8][2 * h], odd = acc[kB * kN8][2 * h + 1];
#pragma unroll
        for (int i = 1; i < kN8; ++i) {
          even = nan_min(even, acc[kB * kN8 + i][2 * h]);
          odd = nan_min(odd, acc[kB * kN8 + i][2 * h + 1]);
        }
        p.m[h] = nan_min(even, odd);
        p.c[h] = 0;
      }
    }
    return p;
  }

  __device__ void write(const Partial& p, const RowOut<Elem>& dst, int col0, int OW) const {
    const int lane = ctid & 31, warp = ctid >> 5, g = lane >> 2, t = lane & 3;
    // Lanes xor 1: lane t keeps pixel t & 1 and takes its partner's value of it.
    const int h = t & 1;
    float v = h ? p.m[1] : p.m[0];
    int channel = h ? p.c[1] : p.c[0];
    const float got = __shfl_xor_sync(0xffffffffu, h ? p.m[0] : p.m[1], 1);
    if constexpr (kSave) {
      keep_min(v, channel, got, __shfl_xor_sync(0xffffffffu, h ? p.c[0] : p.c[1], 1));
      keep_min(v, channel, __shfl_xor_sync(0xffffffffu, v, 2), __shfl_xor_sync(0xffffffffu, channel, 2));
    } else {
      v = nan_min(v, got);
      v = nan_min(v, __shfl_xor_sync(0xffffffffu, v, 2));
    }
    const int col = col0 + 16 * warp + g + 8 * h;
    if (t < 2 && col < OW) {
      float min = Precision::unscale(v, out_scale);
      if constexpr (kSave) {
        dst.argmin[col] = (unsigned char)channel;
        dst.pre_min[col] = min;
      }
      if constexpr (sizeof(Elem) == 2) min = convert<float>(convert<Elem>(min));  // the 16-bit kernels' rounding
      dst.out[col] = convert<Elem>(tanh2<Precision::kTanhApprox>(min));
    }
  }
};

}  // namespace kb25
