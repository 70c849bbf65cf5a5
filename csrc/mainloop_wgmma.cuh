// The wgmma mainloop (sm_90a): one step's MMAs over a 3-row window, operands in shared memory.
#pragma once

#include "geometry.cuh"
#include "mma_atoms.cuh"

namespace kb25 {

// Element i (< kCount) of what the CTA's kThreads threads stage into shared memory: store(i, load(i)). Each thread
// issues all of its loads before its first store, so that they wait for memory once together: a loop of a load and a
// store waits for each load in turn, 24 of them a thread in the wgmma kernels, which took about 2% of the 16-bit one
// (docs/perf-notes.md, "Producer and loads").
template <int kThreads, int kCount, class Load, class Store>
__device__ __forceinline__ void stage_batched(const Load& load, const Store& store) {
  constexpr int kPer = (kCount + kThreads - 1) / kThreads;
  constexpr bool kWhole = kCount % kThreads == 0;  // no bounds check: no branches between the loads
  decltype(load(0)) v[kPer];
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    const int i = threadIdx.x + r * kThreads;
    if (kWhole || i < kCount) v[r] = load(i);
  }
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    const int i = threadIdx.x + r * kThreads;
    if (kWhole || i < kCount) store(i, v[r]);
  }
}

// What a mainloop offers (this one and MmaSyncMainloop): stage_shared() writes what the consumers share (weights)
// before the roles split; start(acc, rows, col0, OW, release_oldest, wait_newest) issues the MMAs of one step over the
// three slots of rows oy..oy+2 (kWaitsForNewest: the caller has waited for the two older rows only, and start() calls
// wait_newest() before the MMAs that read the newest; otherwise all three are there and it never calls it);
// finish(acc, release_oldest) waits for them, and the step's sums are in acc, bias included. Each calls
// release_oldest() once per step, as soon as the window's oldest row has been read (kReleasesOldestEarly: during
// start). wgmma runs asynchronously between the two, while the consumer writes its previous step (where its producer
// threads write the steps, HandedWrites, the consumer has nothing to write there); mma.sync has issued everything
// when start() returns.

// wgmma (sm_90a), operands swapped: A = the weights (M = the 64 output channels), B = the tile's input pixels (N)
// x kMmaK channels from the slot; both from shared memory, one instruction per k-step. The weights are
// staged once per CTA as K-major core matrices: rows 8m..8m+7, k-elements 16 bytes' worth (kGroupChannels) at
// ks * kAStepBytes + j * kAKBytes + m * 128, j the k half. TF32 rounds them to nearest; Tf32x3 stores big, then
// small, and adds small(w) * big(x) and big(w) * small(x), B from the slot's second copy. One instruction covers the
// whole tile (N = kTileCols): the weights are read once per k-step (two 128-column parts, each reduced while the
// other multiplied, were slower: docs/perf-notes.md, "wgmma mainloop"). The first k-step's MMA starts the
// accumulators from zero (scale-d 0). TF32 and 16-bit: the tensor cores add the bias, one more MMA a step
// (kBiasByMma), where 128 adds a thread after the wait would hold up the next step's issue (Tf32x3 starts from moves:
// its small products have an accumulator of their own).
template <class Geometry_>
struct WgmmaMainloop {
  using Geometry = Geometry_;
  using Precision = typename Geometry::Precision;
  using Elem = typename Geometry::Elem;
  using ParamElem = typename Geometry::ParamElem;
  using MmaElem = typename Geometry::MmaElem;
  using Multiply = typename Precision::Multiply;
  static_assert(Multiply::kCopies == Geometry::kCopies, "wgmma reads every part of an operand from shared memory");
  static constexpr int kNBlocks = Geometry::kTileCols / 8;  // n8 blocks of the accumulator
  using Accum = float[kNBlocks][4];
  static_assert(Geometry::kCout == 64, "one m64 wgmma covers all output channels");
  static constexpr int kAKBytes = Geometry::kCout * 16;
  static constexpr int kAStepBytes = 2 * kAKBytes;
  // The bias enters through the tensor cores as one more k-step after the others: A = the bias in its first k
  // columns and zeros in the others, B = the tag's ones (both staged with the weights; Precision::bias_part, ones).
  // 16-bit: the bias in k column 0. TF32: the bias as three TF32 parts in k columns 0..2 (split_tf32_bias), whose sum
  // is the fp32 bias (exactly where |bias| >= 2^-113). TF32 on fp16 operands: the scaled bias as three fp16 parts
  // against B rows 1, 2^-11, 2^-22. The products (part x its B value, 0 x B) are exact; the tensor cores add them into D with their
  // own fp32 accumulation, which may differ from an fp32 add in the last bit (the saving and inference variants
  // share it, so their outputs stay equal). finish() adds nothing: one MMA a step instead of 128 adds a thread that
  // wait for the MMAs (docs/perf-notes.md, "Bias through the tensor cores"). Tf32x3 starts its accumulators from the
  // bias instead.
  static constexpr bool kBiasByMma = Multiply::kBiasByMma;
  static constexpr int kWeightBytes = (Geometry::kKSteps + (kBiasByMma ? 1 : 0)) * kAStepBytes;  // one copy
  // B of the bias k-step (A with kPixelRows), N x K, needs no layout: its descriptor's core matrices, along K and
  // along N, are kOnesStride bytes apart (overlapping), so every 16 bytes the MMA reads hold k rows 0 ..
  // kGroupChannels - 1 of one column, the same pattern wherever it looks (a whole N x K tile would not fit beside
  // TF32's five slots).
  static constexpr int kOnesStride = 16;
  static constexpr int kOnesBytes = kBiasByMma ? (Geometry::kTileCols / 8) * kOnesStride + 128 : 0;
  // The ones come first and the weights after them: compute-sanitizer sizes the ones operand as a dense N x K tile
  // (8 KB) from its start, which then stays inside the CTA's shared memory (after the weights it ran past the end).
  static_assert(kOnesBytes % 128 == 0, "the weights 128-byte aligned after the ones");
  static_assert(!kBiasByMma || kWeightBytes + kOnesBytes >= Geometry::kTileCols * Geometry::kMmaK * (int)sizeof(MmaElem),
                "a dense ones tile's room");
  // After the weights, the precision's scratch words (Tf32OnF16, Fp32OnF16x3: the weights' scale and the guard's flag).
  static constexpr int kScratchOffset = Multiply::kCopies * kWeightBytes + kOnesBytes;
  static constexpr int kSmemBytes = kScratchOffset + Precision::kScratchBytes;
  static constexpr int kRegisters = Multiply::kCopies * kNBlocks * 4;

  const uint64_t weights;  // descriptor of k-step 0
  // What turns the weights' descriptor into one kBytes further on (or back, kBytes < 0: the ones just before the
  // weights) with strides kKStride and kNStride: added to it modulo 2^64, each field comes out right, as none of them
  // goes below zero (the weights' start field is at least kOnesBytes / 16, their strides at least the new ones).
  // Every argument is a multiple of 16.
  __host__ __device__ static constexpr uint64_t weights_to(int kBytes, int kKStride, int kNStride) {
    return (uint64_t)(kBytes / 16) + ((uint64_t)((kKStride - kAKBytes) / 16) << 16) +
           ((uint64_t)((kNStride - 128) / 16) << 32);
  }
  float bias_lo = 0.f, bias_hi = 0.f;  // Tf32x3: the accumulators' start
  // Tf32x3 accumulates the two small products apart and adds them at the end: the tensor cores' fp32 accumulation
  // loses up to an ulp of the accumulator per instruction, so the big sum gets 18 instructions instead of 54.
  typename Multiply::template WgmmaSmall<kNBlocks> acc_small;

  // D fragment rows: warp w of the warpgroup holds output channels 16w + g and 16w + g + 8. ctid: the thread within
  // its warpgroup.
  __device__ WgmmaMainloop(const unsigned char* smem, const ParamElem* __restrict__ b, int ctid)
      : weights(wgmma_desc(smem + kOnesBytes, kAKBytes, 128)) {
    if constexpr (!kBiasByMma) {
      const int warp = ctid >> 5, g = (ctid & 31) >> 2;
      const float scale = Precision::scale_of(scratch(smem));
      bias_lo = Precision::scale(convert<float>(Precision::param(b[warp * 16 + g])), scale);
      bias_hi = Precision::scale(convert<float>(Precision::param(b[warp * 16 + g + 8])), scale);
    }
  }
  __host__ __device__ static const uint32_t* scratch(const unsigned char* smem) {
    return reinterpret_cast<const uint32_t*>(smem + kScratchOffset);
  }
  // The weights (and for kBiasByMma the bias k-step's A and the ones), written by all of the CTA's threads before
  // they split into roles.
  // Tf32OnF16 and Fp32OnF16x3 first find the scale of the weights and the bias, and raise their scratch flag where a
  // weight or the bias does not carry (UnscaledOperands: scale 1, nothing to raise).
  template <int kThreads>
  __device__ static void stage_shared(unsigned char* smem, const ParamElem* __restrict__ w,
                                      const ParamElem* __restrict__ b) {
    constexpr int kGC = Geometry::kGroupChannels;
    MmaElem* const a = reinterpret_cast<MmaElem*>(smem + kOnesBytes);
    uint32_t* const flags = reinterpret_cast<uint32_t*>(smem + kScratchOffset);
    const float scale = Precision::template find_scale<kThreads>(
        w, Geometry::kCout * Geometry::kCin * Geometry::kTaps, b, Geometry::kCout, flags);
    bool inexact = false;
    stage_batched<kThreads, Geometry::kKSteps * Geometry::kCout * Geometry::kMmaK>(
        [&](int i) {
          const int ks = i / (Geometry::kCout * Geometry::kMmaK), co = (i / Geometry::kMmaK) % Geometry::kCout;
          const int ci = (ks % Geometry::kKStepsPerTap) * Geometry::kMmaK + i % Geometry::kMmaK;
          return Precision::param(w[(co * Geometry::kCin + ci) * Geometry::kTaps + ks / Geometry::kKStepsPerTap]);
        },
        [&](int i, Elem v) {
          const int ks = i / (Geometry::kCout * Geometry::kMmaK), co = (i / Geometry::kMmaK) % Geometry::kCout;
          const int kk = i % Geometry::kMmaK;
          const int at = (ks * kAStepBytes + (kk / kGC) * kAKBytes + (co / 8) * 128 + (co % 8) * 16) / (int)sizeof(MmaElem) +
                         kk % kGC;
          inexact |= Precision::inexact(v, scale);
          Multiply::template store_weight<Precision>(a, at, kWeightBytes / (int)sizeof(MmaElem), Precision::scale(v, scale));
        });
    if (threadIdx.x < Geometry::kCout) inexact |= Precision::inexact_bias(b[threadIdx.x], scale);
    if (inexact) atomicOr(flags + 1, 1u);
    if constexpr (kBiasByMma) {
      stage_batched<kThreads, Geometry::kCout * Geometry::kMmaK>(
          [&](int i) { return Precision::param(b[i / Geometry::kMmaK]); },
          [&](int i, Elem bias) {
            const int co = i / Geometry::kMmaK, kk = i % Geometry::kMmaK;
            a[(Geometry::kKSteps * kAStepBytes + (kk / kGC) * kAKBytes + (co / 8) * 128 + (co % 8) * 16) /
                  (int)sizeof(MmaElem) + kk % kGC] = Precision::template bias_part<MmaElem>(bias, scale, kk);
          });
      // Every 16 bytes of B hold k rows 0..kGC - 1 of one column (the descriptor's core matrices overlap).
      for (int i = threadIdx.x; i < kOnesBytes / (int)sizeof(MmaElem); i += kThreads)
        reinterpret_cast<MmaElem*>(smem)[i] = Precision::template ones<MmaElem>(i % kGC);
    }
    fence_proxy_async();  // published to wgmma by the barrier before the roles split
  }

  // Its MMAs read the window until finish(): the oldest row is released there. kWaitsForNewest: the window's newest
  // row is waited for (wait_newest) only before its first k-step, so that the MMAs over the two older rows, which
  // earlier steps waited for, are issued first and run while the consumer waits (TF32 -1%, 16-bit -0.5%; 3xTF32 +9%,
  // so it waits for the whole window first: docs/perf-notes.md, "wgmma mainloop").
  static constexpr bool kReleasesOldestEarly = false;
  static constexpr bool kWaitsForNewest = Multiply::kIssuesBeforeNewest;
  // kPixelRows (the saving variants of the one-product kernels): the operands swap back, A = 64 pixels of the slot
  // (M) and B = the weights (N = the 64 channels), kTileCols / 64 instructions a k-step. A thread then holds all 16
  // of its channels' values of a pixel, in channel order, and finds the argmin among them without shuffles (the
  // channel-carrying lane butterfly ran the saving variant at 2.5-3.3 times the inference one: docs/perf-notes.md,
  // "Training and the saving forward"). The tensor cores read 1.6 times the shared-memory bytes a k-step (each
  // N = 64 MMA reads A and B), which the inference variants, paced by the MMAs, would pay for.
  static constexpr bool kPixelRowsFit = kBiasByMma && Geometry::kTileCols % 64 == 0;
  static constexpr int kPixelTiles = Geometry::kTileCols / 64;
  // Sub-tile s of a pixel-row accumulator: pixels 64 s .. 64 s + 63, float[8][4] (the N = 64 D fragment).
  __device__ static float (&pixel_tile(Accum& acc, int s))[8][4] {
    return *reinterpret_cast<float(*)[8][4]>(&acc[8 * s]);
  }
  template <bool kPixelRows = false, class Release, class WaitNewest>
  __device__ void start(Accum& acc, unsigned char* const (&rows)[3], int, int, const Release&,
                        const WaitNewest& wait_newest) {
    static_assert(!kPixelRows || kPixelRowsFit, "pixel rows: one product, whole 64-pixel sub-tiles");
    uint64_t desc[3];
#pragma unroll
    for (int kh = 0; kh < 3; ++kh) desc[kh] = wgmma_desc(rows[kh], Geometry::kGroupBytes, 128);
    Multiply::wgmma_begin(acc, acc_small, bias_lo, bias_hi);
    pin(acc);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < Geometry::kKSteps; ++ks) {
      const int tap = ks / Geometry::kKStepsPerTap, kb = ks % Geometry::kKStepsPerTap;
      if (kWaitsForNewest && ks == 6 * Geometry::kKStepsPerTap) {  // taps 6-8 read the newest row
        wait_newest();
        wgmma_fence();
      }
      // B for k-step (kh, kw, kb): groups 2kb, 2kb+1 of row oy + kh (K-direction core matrices kGroupBytes apart),
      // starting kw columns in (N-direction core matrices 128 bytes apart).
      const uint64_t b = desc[tap / 3] + ((2 * kb * Geometry::kGroupBytes + (tap % 3) * 16) >> 4);
      const uint64_t a = weights + ((ks * kAStepBytes) >> 4);
      if constexpr (kPixelRows) {  // A = 64 pixels (1024 bytes a sub-tile along the slot's columns), B = the weights
#pragma unroll
        for (int s = 0; s < kPixelTiles; ++s) {
          if (ks == 0) {
            wgmma_async<false>(pixel_tile(acc, s), b + ((s * 1024) >> 4), a, Operand<MmaElem>{});
          } else {
            wgmma_async(pixel_tile(acc, s), b + ((s * 1024) >> 4), a, Operand<MmaElem>{});
          }
        }
      } else if (ks == 0) {  // the precision's products (the small parts kWeightBytes and kCopyBytes after the big ones)
        Multiply::template wgmma_k_step<MmaElem, true>(acc, acc_small, a, b, kWeightBytes >> 4,
                                                       Geometry::kCopyBytes >> 4);
      } else {
        Multiply::template wgmma_k_step<MmaElem, false>(acc, acc_small, a, b, kWeightBytes >> 4,
                                                        Geometry::kCopyBytes >> 4);
      }
    }
    if constexpr (kBiasByMma) {
      // The ones' descriptor from the weights': kOnesBytes before them, both strides kOnesStride instead of kAKBytes
      // and 128.
      constexpr uint64_t kOnes = weights_to(-kOnesBytes, kOnesStride, kOnesStride);
      const uint64_t bias = weights + ((Geometry::kKSteps * kAStepBytes) >> 4);
      if constexpr (kPixelRows) {  // A = the ones (every 16 bytes alike, so any M reads the same), B = the bias parts
#pragma unroll
        for (int s = 0; s < kPixelTiles; ++s) wgmma_async(pixel_tile(acc, s), weights + kOnes, bias, Operand<MmaElem>{});
      } else {
        wgmma_async(acc, bias, weights + kOnes, Operand<MmaElem>{});
      }
    }
    wgmma_commit();
  }
  // The step's products have landed in acc; the window's oldest row is free.
  template <class Release>
  __device__ void finish(Accum& acc, const Release& release_oldest) {
    wgmma_wait<0>();
    release_oldest();
    pin(acc);
    Multiply::wgmma_end(acc, acc_small);
  }
};

}  // namespace kb25
