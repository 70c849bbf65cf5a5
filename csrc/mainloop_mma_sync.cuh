// The mma.sync mainloop (any sm_80+ GPU): one step's MMAs, operands loaded into registers.
#pragma once

#include "geometry.cuh"
#include "mma_atoms.cuh"

namespace kb25 {

// mma.sync (any sm_80+ GPU), every precision: m16n8k8 TF32 (3xTF32 too), m16n8k16 bf16 / fp16. A consumer's 4 warps
// each take kWarpCols pixels (kMTiles m16 tiles) x all kCout channels (kCout / 8 n8 tiles), so the min over channels
// stays in registers. A (pixels x k) comes from the slot by ldmatrix: one x4 per m16 tile and k-step, its 8-row
// matrices being 8 consecutive 16-byte columns of one channel group (128 contiguous bytes: no bank conflict). B (the
// weights) is staged once per CTA in the order the MMA reads it. Three products (3xTF32, fp16 parts): the weights
// are staged split (a big and a small copy) and the two small products go to an accumulator of their own; 3xTF32's
// slot keeps raw fp32 (the shared memory of TF32) and each A fragment is split in registers, while fp16 parts come
// split from the slot's two copies (kSplitInSlot), each fragment by its own ldmatrix. MMAs read their operands from
// registers, so the window's oldest row is free as soon as the first kernel row's k-steps have loaded it.
template <class Geometry_>
struct MmaSyncMainloop {
  using Geometry = Geometry_;
  using Precision = typename Geometry::Precision;
  using Elem = typename Geometry::Elem;
  using ParamElem = typename Geometry::ParamElem;
  using MmaElem = typename Geometry::MmaElem;
  using Multiply = typename Precision::Multiply;
  static_assert(!Geometry::kSplitInSlot || sizeof(MmaElem) == 2, "mma.sync splits 3xTF32 input operands in registers");
  static constexpr bool kReleasesOldestEarly = true;
  static constexpr int kWarpCols = Geometry::kTileCols / 4;
  static constexpr int kMTiles = kWarpCols / 16;
  static constexpr int kNTiles = Geometry::kCout / 8;
  static constexpr int kPerWord = 4 / (int)sizeof(MmaElem);  // elements per operand register
  using Accum = float[kMTiles][kNTiles][4];
  static constexpr int kWeightWords = Geometry::kKSteps * (kNTiles / 2) * 32 * 4;  // one copy
  static constexpr int kWeightCopies = Multiply::kCopies;
  // The weights (big, then small for 3xTF32), then the bias in fp32 as C fragments: float4 (nt * 4 + t) holds
  // b[8 nt + 2t], b[8 nt + 2t + 1] twice (rows g and g + 8), the C operand of an n-tile's first MMA.
  static constexpr int kBiasQuads = Geometry::kCout / 2;
  // After them, the precision's scratch words (Tf32OnF16: the weights' scale and the guard's flag).
  static constexpr int kScratchOffset = kWeightCopies * kWeightWords * 4 + kBiasQuads * 16;
  static constexpr int kSmemBytes = kScratchOffset + Precision::kScratchBytes;
  // Live across a k-step: the accumulators (twice for 3xTF32), the k-step's B fragments, one A (3xTF32, and the
  // first k-step, whose MMAs go n-tile by n-tile: every A, 3xTF32 big and small; the first k-step also one bias
  // fragment).
  static constexpr int kRegisters =
      kWeightCopies * (kMTiles * kNTiles * 4 + kNTiles * 2) + (kWeightCopies == 2 ? 8 * kMTiles : 4);
  static_assert(kWarpCols % 16 == 0 && kMTiles >= 1, "whole m16 tiles per warp");
  static_assert(Geometry::kCout % 16 == 0, "weight fragments are read as pairs of n8 tiles");

  const uint32_t* wsm;
  const float* bsm;
  const int ctid;

  __device__ MmaSyncMainloop(const unsigned char* smem, const ParamElem* __restrict__, int ctid_)
      : wsm(reinterpret_cast<const uint32_t*>(smem)),
        bsm(reinterpret_cast<const float*>(smem) + kWeightCopies * kWeightWords), ctid(ctid_) {}
  // Word ((ks * kNTiles/2 + q) * 32 + lane) * 4 + e holds, for lane (g = lane/4, t = lane%4), register e & 1 of the
  // B fragment of n-tile 2q + e/2: column n = g, rows k = kPerWord * t + kMmaK/2 * (e & 1) + h for its element h.
  // One conflict-free 16-byte load per lane and pair of n-tiles.
  // A loop of one load and one store (kThreads unused): with stage_batched, as the wgmma mainloop stages, ptxas
  // scheduled the self-fed 16-bit kernel's loop otherwise (245 registers instead of 243) and sm80_bf16 ran 8% slower
  // (docs/perf-notes.md, "Producer and loads").
  // Tf32OnF16 first finds the scale of the weights and the bias (the bias is staged times it), and raises its scratch flag where a weight
  // or the bias does not carry exactly (UnscaledOperands: scale 1, nothing to raise).
  template <int kThreads>
  __device__ static void stage_shared(unsigned char* smem, const ParamElem* __restrict__ w,
                                      const ParamElem* __restrict__ b) {
    MmaElem* const wdst = reinterpret_cast<MmaElem*>(smem);
    uint32_t* const flags = reinterpret_cast<uint32_t*>(smem + kScratchOffset);
    const float scale = Precision::template find_scale<kThreads>(
        w, Geometry::kCout * Geometry::kCin * Geometry::kTaps, b, Geometry::kCout, flags);
    bool inexact = false;
    for (int i = threadIdx.x; i < kWeightWords * kPerWord; i += blockDim.x) {
      const int h = i % kPerWord, word = i / kPerWord;
      const int e = word & 3, lane = (word >> 2) & 31;
      const int q = (word >> 7) % (kNTiles / 2);
      const int ks = (word >> 7) / (kNTiles / 2);
      const int co = (2 * q + (e >> 1)) * 8 + (lane >> 2);
      const int ci = (ks % Geometry::kKStepsPerTap) * Geometry::kMmaK + kPerWord * (lane & 3) +
                     Geometry::kMmaK / 2 * (e & 1) + h;
      const Elem v = Precision::param(w[(co * Geometry::kCin + ci) * Geometry::kTaps + ks / Geometry::kKStepsPerTap]);
      inexact |= Precision::inexact(v, scale);
      Multiply::template store_weight<Precision>(wdst, i, kWeightWords * kPerWord, Precision::scale(v, scale));
    }
    float* const bdst = reinterpret_cast<float*>(smem) + kWeightCopies * kWeightWords;
    for (int i = threadIdx.x; i < kBiasQuads * 4; i += blockDim.x)
      bdst[i] = Precision::scale(convert<float>(Precision::param(b[i / 4 * 2 + (i & 1)])), scale);
    if (threadIdx.x < Geometry::kCout) inexact |= Precision::inexact_bias(b[threadIdx.x], scale);
    if (inexact) atomicOr(flags + 1, 1u);
  }
  __host__ __device__ static const uint32_t* scratch(const unsigned char* smem) {
    return reinterpret_cast<const uint32_t*>(smem + kScratchOffset);
  }

  // C fragment: lane (g, t) holds c0, c1 = C[g][2t, 2t+1] and c2, c3 = C[g+8][2t, 2t+1] of each n8 tile (rows are
  // pixels, columns channels). The bias enters as the C operand of each accumulator's first MMA (3xTF32's small
  // products start from zero the same way): no instructions to set the accumulators. release_oldest() runs once the
  // first kernel row's k-steps have loaded their A.
  // The whole window is there before start() (kWaitsForNewest false): its first k-step reads row 0 at once.
  static constexpr bool kWaitsForNewest = false;
  template <class Release, class WaitNewest>
  __device__ void start(Accum& acc, unsigned char* const (&rows)[3], int col0, int OW, const Release& release_oldest,
                        const WaitNewest&) {
    const int lane = ctid & 31, warp_col = (ctid >> 5) * kWarpCols;
    if (col0 + warp_col >= OW) {  // this warp's pixels are all past the edge: nothing is stored, but the reduce reads
#pragma unroll                    // defined values
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
      release_oldest();
      return;
    }
    Small small;
    // ldmatrix row of this lane: matrix lane / 8 (pixels + 8 for odd matrices, the next channel group for 2 and 3).
    const uint32_t lane_offset = (lane >> 4) * Geometry::kGroupBytes + (warp_col + (lane & 15)) * 16;
    // The first k-step with C = the bias (tap 0 on its own).
    {
      const uint32_t row0 = smem_u32(rows[0]) + lane_offset;
      k_step<true>(acc, small, row0, 0, lane);
#pragma unroll
      for (int kb = 1; kb < Geometry::kKStepsPerTap; ++kb)
        k_step<false>(acc, small, row0 + 2 * kb * Geometry::kGroupBytes, kb, lane);
    }
    // Three products run one tap per trip (they already give ptxas enough to interleave; unrolled whole it hoists
    // loads until it spills); the others unroll every k-step.
#pragma unroll(kWeightCopies == 2 ? 1 : Geometry::kTaps - 1)
    for (int tap = 1; tap < Geometry::kTaps; ++tap) {
      const int kh = tap / 3, kw = tap % 3;
      const uint32_t row = smem_u32(kh == 0 ? rows[0] : kh == 1 ? rows[1] : rows[2]) + lane_offset + kw * 16;
#pragma unroll
      for (int kb = 0; kb < Geometry::kKStepsPerTap; ++kb)
        k_step<false>(acc, small, row + 2 * kb * Geometry::kGroupBytes, tap * Geometry::kKStepsPerTap + kb, lane);
      // Every ldmatrix of row 0 (taps 0-2) precedes the arrive in program order (both are volatile asm), and the
      // arrive releases at CTA scope: the producer, which acquires it, cannot overwrite the slot before those reads.
      if (tap == 2) release_oldest();
    }
    Multiply::mma_sync_end(acc, small);
  }
  using Small = float[kMTiles][kNTiles][4];  // the small products, where the multiply has them (else unused, free)
  // One k-step's MMAs over the A fragments at a_addr (m-tile mt at + 256 mt bytes). kFirst: the accumulators' first
  // MMA, C = the bias (and 0 for the small products), n-tile by n-tile so that one bias fragment is live at a time.
  template <bool kFirst>
  __device__ void k_step(Accum& acc, Small& small, uint32_t a_addr, int ks, int lane) const {
    uint32_t bw[kNTiles][2], bs[kNTiles][2];  // the big parts, and the small where the multiply has them
    load_b(bw, ks, lane, 0);
    if constexpr (kWeightCopies == 2 || kFirst) {
      uint32_t a[kMTiles][4], as[kMTiles][4];
      if constexpr (kWeightCopies == 2) load_b(bs, ks, lane, kWeightWords);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        ldmatrix_x4(a[mt], a_addr + mt * 16 * 16);
        if constexpr (Geometry::kSplitInSlot) {
          ldmatrix_x4(as[mt], a_addr + mt * 16 * 16 + Geometry::kCopyBytes);
        } else if constexpr (kWeightCopies == 2) {
          Multiply::split_fragment(a[mt], as[mt]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const float4 bias = kFirst ? bias_fragment(nt, lane) : float4{};
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          Multiply::template mma_sync_tile<MmaElem, kFirst>(acc[mt][nt], small[mt][nt], a[mt], as[mt], bw[nt], bs[nt],
                                                           bias);
        }
      }
    } else {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        uint32_t a[4];
        ldmatrix_x4(a, a_addr + mt * 16 * 16);
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) mma_sync(acc[mt][nt], a, bw[nt][0], bw[nt][1], Operand<MmaElem>{});
      }
    }
  }
  // The bias C fragment of n-tile nt, read every step (volatile asm: not hoisted out of the step loop, so the bias
  // holds no registers across it).
  __device__ float4 bias_fragment(int nt, int lane) const {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(smem_u32(bsm + (nt * 4 + (lane & 3)) * 4)));
    return v;
  }
  template <class Release>
  __device__ void finish(Accum&, const Release&) {}
  // The B fragments of k-step ks (from the weight copy at word offset `copy`), two registers per n-tile.
  template <int kN>
  __device__ void load_b(uint32_t (&b)[kN][2], int ks, int lane, int copy) const {
    const uint4* wq = reinterpret_cast<const uint4*>(wsm + copy) + ks * (kNTiles / 2) * 32 + lane;
#pragma unroll
    for (int q = 0; q < kNTiles / 2; ++q) {
      const uint4 v = wq[q * 32];
      b[2 * q][0] = v.x;
      b[2 * q][1] = v.y;
      b[2 * q + 1][0] = v.z;
      b[2 * q + 1][1] = v.w;
    }
  }
};

}  // namespace kb25
