// The wgmma epilogue: the min over 64 channels, tanh, tanh and the store of a step.
#pragma once

#include "mainloop_wgmma.cuh"

namespace kb25 {

// Min over the 64 channels (NaN wins), tanh, tanh, in fp32; one rounding to the output type (16-bit: the min is
// rounded to it as well, see kPacked).
// wgmma D fragment: lane (g, t) of warp w holds channels 16w+g (i = 0, 1) and 16w+g+8 (i = 2, 3) at pixels
// 8j + 2t + (i & 1). The min over the thread's two channels leaves 2 * kNBlocks values. Two halves: reduce() reads
// the accumulators and leaves partial minima in the step's buffer in shared memory; write() (the consumer's named
// barrier, the rest of the min, tanh, tanh, store) runs one step later, while the next step's MMAs are in flight.
// Two buffers, used in turn (one per step), so a buffer is refilled only after the barrier of the other one, which
// every thread reaches after reading it. The handed inference kernels (kHandsOff: 16-bit, and TF32 on fp16 operands)
// hand the write to the producer's threads instead (write_handed, HandedWrites), through kStages buffers with
// mbarriers; so do their saving variants.
// - Saving, one-product kernels (kPixelRows): the MMAs run with pixels as rows (WgmmaMainloop::start), so each thread
//   holds 16 channels of 8 pixel rows and finds each one's min and argmin in registers, then over its quad
//   (reduce_pixel_rows): no channel carried through a butterfly.
// - fp32 minima (TF32, 3xTF32, and 3xTF32's saving variant): three butterfly steps over g (lanes xor 4, 8, 16) each
//   keep half of the values and fold in the partner's other half, so every lane ends with the warp's minima (its 16
//   channels) of kFinal pixels, having shuffled 2 * kNBlocks - kFinal values instead of all of them three times. The
//   4 warps' minima meet in the buffer, its rows skewed per 32 pixels (kSkew) so that the stores do not collide in a
//   bank; the write takes the min over the 4 for each of its pixels.
// - 16-bit, not saving (kPacked): the thread's minima rounded to the element type, two pixels a word, then one
//   butterfly step (lanes xor 4: lane groups g and g ^ 1, each keeping half of the blocks). Each warp stores them with
//   stmatrix, transposed, so that a 16-byte row holds the 4 group pairs' minima of two pixels kTileCols / 2 apart;
//   the write (the producer's threads) takes the min over those 4 warps x 4 words, both pixels at once. Against the
//   full butterfly: 16 shuffles, 32 selects, 16 packed mins and 4 stores instead of 28, 56, 28 and 4 between the
//   MMAs' wait and the next issue, and 4 16-byte loads and 15 packed mins instead of 4 loads and 3 mins in the write;
//   with no butterfly step at all, 8 stores and 8 loads and twice the staged bytes (docs/perf-notes.md, "Epilogue
//   and the handed write").
template <class Mainloop, bool kSave, class Schedule>
struct WgmmaEpilogue {
  using Geometry = typename Mainloop::Geometry;
  static constexpr int kTileCols = Geometry::kTileCols;
  static constexpr int kNBlocks = Mainloop::kNBlocks;
  static constexpr int kFinal = 2 * kNBlocks / 8;  // pixels per lane after the butterfly
  using Precision = typename Geometry::Precision;
  using Elem = typename Geometry::Elem;
  // A handed schedule's staged buffers: 16-bit elements stage their minima rounded to the element type, two to a
  // word (Precision::pack2 / min2); fp32 elements (TF32 on fp16 operands) stage the butterfly's fp32 minima.
  static constexpr bool kStagesPacked = Schedule::kHanded && sizeof(Elem) == 2;
  static constexpr bool kPacked = !kSave && kStagesPacked;
  // Butterfly buffers: each 32 pixels of a row start kSkew floats further on, so that a half-warp's float2 stores
  // touch each bank once (its four lane groups 8 kFinal pixels apart: with 8 floats of skew per 32 pixels, kFinal = 8
  // put two of them on the same banks, 1.08 M excess wavefronts in the TF32 kernel). 3xTF32's saving variant's 2-byte
  // channel stores beside them (kFinal = 4, skew 8) hit each bank once; at a skew of 4 they were 2-way conflicted.
  static constexpr int kSkew = kFinal != 8 ? 8 : 4;
  static constexpr int kRedPitch = kTileCols + kTileCols / 32 * kSkew;
  static constexpr int kBufferFloats = 4 * kRedPitch;
  // Two butterfly buffers of minima, then two of their channels (one byte each, saving only: within the warp, or
  // 0..63 with kPixelRows).
  static constexpr int kButterflyBytes = 2 * kBufferFloats * 4 + (2 * kBufferFloats + 15) / 16 * 16;
  // kPixelRows (the saving variants of the one-product kernels, WgmmaMainloop::start): lane (g, t) of warp w holds
  // pixels 64 s + 16 w + g (i = 0, 1) and + 8 (i = 2, 3) of sub-tile s, channels 8 j + 2 t + (i & 1) in acc[8 s + j].
  // Each pixel's min and argmin come whole out of the reduce: one value and one channel a pixel in a buffer's first
  // row (kRedPitch floats) and, after it, its second (the channels, a byte each).
  static constexpr bool kPixelRows = kSave && Mainloop::kPixelRowsFit;
  // A staged buffer: packed, 16 bytes a pixel pair (p, p + kTileCols / 2) and warp; else one butterfly buffer (the
  // 4 warps' minima of each pixel: staging the minima before the butterfly's last step or two, 8 or 16 a pixel, was
  // 7-12% slower, docs/perf-notes.md, "Epilogue and the handed write"; kPixelRows: each pixel's min and channel).
  static constexpr int kStageBytes = kStagesPacked ? kTileCols / 2 * 4 * 16 : kBufferFloats * 4;
  // kHandsOff (the handed schedule, both variants): the consumer only stages a step's minima (saving: and their
  // channels, kPixelRows); its producer threads write the step (write_handed), kStages buffers, each with a full
  // mbarrier (the consumer's threads arrive once they have staged it) and an empty one (the producer's threads arrive
  // once they have written it). Otherwise the consumer writes each step itself under the next step's MMAs, from two
  // buffers.
  static constexpr bool kHandsOff = Schedule::kHanded;
  static_assert(!kHandsOff || !kSave || kPixelRows, "a handed saving variant stages whole pixels");
  static_assert(!kPixelRows || kStageBytes >= kRedPitch * 5, "a pixel-row stage: the minima, then their channels");
  static constexpr int kStages = Schedule::kBuffers;
  static constexpr int kHandOffStages = Schedule::kHanded ? kStages : 0;  // (full, empty) barrier pairs, both variants
  // Per consumer, one layout for both variants of a kernel (handed: the stage buffers only).
  static constexpr int kSmemBytes = kHandsOff ? kStages * kStageBytes : kButterflyBytes;
  static_assert(kFinal % 2 == 0, "float2 stores");
  float* const red;
  unsigned char* const red_channel;
  uint64_t* const stage_bars;  // kHandsOff: (full, empty) per staged buffer
  const int barrier_id, ctid;
  int turn = 0;
  uint32_t staged = 0;  // kHandsOff: steps staged (the consumer) or written (the producer) so far
  float out_scale = 1.f;  // what each pixel's min is multiplied by (Precision::unscale; Tf32OnF16: 2^-s)
  __device__ WgmmaEpilogue(unsigned char* smem, int consumer, int ctid_, uint64_t* stage_bars_ = nullptr)
      : red(reinterpret_cast<float*>(smem)), red_channel(smem + 2 * kBufferFloats * 4), stage_bars(stage_bars_),
        barrier_id(1 + consumer), ctid(ctid_) {}
  __device__ uint64_t* stage_full(uint32_t j) const { return stage_bars + 2 * (j % kStages); }
  __device__ uint64_t* stage_empty(uint32_t j) const { return stage_full(j) + 1; }
  __device__ const unsigned char* stage_buffer(uint32_t j) const {
    return reinterpret_cast<const unsigned char*>(red) + (j % kStages) * kStageBytes;
  }
  __device__ static int skewed(int pixel) { return pixel + kSkew * (pixel >> 5); }
  // kSave without kPixelRows (3xTF32) carries each value's channel within the warp (0..15) along, a byte each, kPer
  // to a register (ch[i / kPer], bits kBits * (i % kPer) for value i): the accumulators are still live while the
  // butterfly starts.
  static constexpr int kPer = 4;
  static constexpr int kBits = 32 / kPer;
  static constexpr uint32_t kMask = (1u << kBits) - 1;
  static constexpr int kChannelWords = kSave ? 2 * kNBlocks / kPer : 1;
  __device__ static uint32_t channel_of(uint32_t word, int e) { return (word >> kBits * e) & kMask; }
  template <int kHalf>
  __device__ static void fold(float (&v)[2 * kNBlocks], uint32_t (&ch)[kChannelWords], bool upper, int lane_mask) {
    static_assert(!kSave || kHalf % kPer == 0, "whole channel words");
#pragma unroll
    for (int i = 0; i < kHalf; i += kPer) {
      uint32_t send_ch = 0, keep_ch = 0, got_ch = 0, kept_ch = 0;
      if constexpr (kSave) {
        send_ch = upper ? ch[i / kPer] : ch[(i + kHalf) / kPer];
        keep_ch = upper ? ch[(i + kHalf) / kPer] : ch[i / kPer];
        got_ch = __shfl_xor_sync(0xffffffffu, send_ch, lane_mask);
      }
#pragma unroll
      for (int e = 0; e < kPer && i + e < kHalf; ++e) {
        const float send = upper ? v[i + e] : v[i + e + kHalf], keep = upper ? v[i + e + kHalf] : v[i + e];
        const float got = __shfl_xor_sync(0xffffffffu, send, lane_mask);
        if constexpr (kSave) {
          float kept = keep;
          int channel = channel_of(keep_ch, e);
          keep_min(kept, channel, got, channel_of(got_ch, e));
          v[i + e] = kept;
          kept_ch |= (uint32_t)channel << kBits * e;
        } else {
          v[i + e] = nan_min(keep, got);
        }
      }
      if constexpr (kSave) ch[i / kPer] = kept_ch;
    }
  }

  // What a reduced step keeps in registers until its write: nothing, its partial minima wait in shared memory.
  struct Partial {};
  // The part that reads the accumulators: the min over the thread's two channels, then either (kPacked) those
  // minima packed, folded once across lane pairs and staged, or the butterfly and the warp's minima (and their
  // channels within the warp, kSave), into this step's buffer (kHandsOff: staged for the producer's threads).
  __device__ Partial reduce(const typename Mainloop::Accum& acc) {
    const int lane = ctid & 31, warp = ctid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int first = kFinal * (((g >> 2) & 1) + 2 * ((g >> 1) & 1) + 4 * (g & 1));
    if constexpr (kPixelRows) {
      if constexpr (kHandsOff) {
        unsigned char* const buffer = const_cast<unsigned char*>(stage_buffer(staged));
        reduce_pixel_rows(acc, g, t, warp, reinterpret_cast<float*>(buffer), buffer + kRedPitch * 4, [&] {
          mbarrier_wait(stage_empty(staged), ((staged / kStages) & 1) ^ 1);  // see kPacked
        });
        mbarrier_arrive(stage_full(staged));
        ++staged;
      } else {
        reduce_pixel_rows(acc, g, t, warp, red + turn * kBufferFloats, red_channel + turn * kBufferFloats, [] {});
      }
    } else if constexpr (kPacked) {
      uint32_t v[kNBlocks];  // v[j]: pixels 8j + 2t (low half) and 8j + 2t + 1, lane group g
#pragma unroll
      for (int j = 0; j < kNBlocks; ++j)
        v[j] = Precision::pack2(nan_min(acc[j][0], acc[j][2]), nan_min(acc[j][1], acc[j][3]));
      // One fold over lane groups g and g ^ 1 (lane xor 4): odd g keeps the upper half of the blocks, even g the
      // lower; u[k] is block kHalf (g & 1) + k's minima over the two groups.
      constexpr int kHalf = kNBlocks / 2;
      const bool upper = g & 1;
      uint32_t u[kHalf];
#pragma unroll
      for (int k = 0; k < kHalf; ++k) {
        const uint32_t send = upper ? v[k] : v[k + kHalf], keep = upper ? v[k + kHalf] : v[k];
        u[k] = Precision::min2(keep, __shfl_xor_sync(0xffffffffu, send, 4));
      }
      // Store s takes u[4s + q] as matrix q: its row i holds, for pair p = 8(4s + q) + i, the even lane groups'
      // minima of pixel p and the odd ones' of pixel p + kHalf * 8 (word m: groups 2m, 2m + 1 of both), stored at
      // stage_offset(p, warp); lane 8q + i gives that address, 2048 s bytes on from store 0's.
      const int q = lane >> 3, i = lane & 7;
      // The buffer free again: its last step written (by the producer threads; on a fresh barrier the first
      // kStages pass).
      mbarrier_wait(stage_empty(staged), ((staged / kStages) & 1) ^ 1);
      const uint32_t at = smem_u32(stage_buffer(staged)) + stage_offset(8 * q + i, warp);
#pragma unroll
      for (int s = 0; s < kHalf / 4; ++s)
        stmatrix_x4_trans(at + s * 2048, u[4 * s], u[4 * s + 1], u[4 * s + 2], u[4 * s + 3]);
      mbarrier_arrive(stage_full(staged));
      ++staged;
    } else if constexpr (kHandsOff) {
      mbarrier_wait(stage_empty(staged), ((staged / kStages) & 1) ^ 1);
      reduce_unpacked(acc, g, t, warp, first, staged % kStages);
      mbarrier_arrive(stage_full(staged));
      ++staged;
    } else {
      reduce_unpacked(acc, g, t, warp, first, turn);
    }
    return {};
  }
  // kPixelRows: each pixel's min and argmin (torch.min's, precedes()) into `minima` and `channels` at skewed(p). The
  // thread scans its 16 channels of each of its 8 pixel rows in channel order (8 j + 2 t + e), a channel taken only
  // where it strictly precedes the one held (a guarded kernel by scan_min_finite: an image with an input, weight or
  // bias its operands do not carry, or one not finite, is listed and rewritten by its guard, so its kept sums hold
  // no NaN); then two shuffle steps over the quad (lanes xor 1, xor 2), each keeping half of the rows, take the min
  // over the quad's 4 channel sets, so lane t ends with sub-tile 2 (t & 1) + (t >> 1), both of its rows.
  // before_stores() runs between that and the stores (the wait for a free stage buffer).
  template <class BeforeStores>
  __device__ void reduce_pixel_rows(const typename Mainloop::Accum& acc, int g, int t, int warp, float* minima,
                                    unsigned char* channels, const BeforeStores& before_stores) const {
    constexpr int kRows = 2 * Mainloop::kPixelTiles;  // row 2 s + h: pixel 64 s + 16 w + g + 8 h
    static_assert(kRows == 8, "two quad steps leave two rows a lane");
    float m[kRows];
    int c[kRows];
#pragma unroll
    for (int s = 0; s < Mainloop::kPixelTiles; ++s)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float best = acc[8 * s][2 * h];
        int channel = 2 * t;
#pragma unroll
        for (int k = 1; k < 16; ++k) {  // channel 8 (k / 2) + 2 t + k % 2, ascending
          const float v = acc[8 * s + k / 2][2 * h + k % 2];
          const int at = 8 * (k / 2) + 2 * t + k % 2;
          if constexpr (Precision::kGuardsRange) {
            scan_min_finite(best, channel, v, at);
          } else {
            scan_min(best, channel, v, at);
          }
        }
        m[2 * s + h] = best;
        c[2 * s + h] = channel;
      }
    // Quad step over lane bit b (mask 1 << b): lanes with the bit set keep the upper half of the rows.
#pragma unroll
    for (int b = 0, half = kRows / 2; b < 2; ++b, half /= 2) {
      const bool upper = (t >> b) & 1;
#pragma unroll
      for (int i = 0; i < half; ++i) {
        const float send = upper ? m[i] : m[i + half], keep = upper ? m[i + half] : m[i];
        const int send_c = upper ? c[i] : c[i + half], keep_c = upper ? c[i + half] : c[i];
        float kept = keep;
        int kept_c = keep_c;
        keep_min(kept, kept_c, __shfl_xor_sync(0xffffffffu, send, 1 << b),
                 __shfl_xor_sync(0xffffffffu, send_c, 1 << b));
        m[i] = kept;
        c[i] = kept_c;
      }
    }
    before_stores();
    const int s = 2 * (t & 1) + (t >> 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int at = skewed(64 * s + 16 * warp + g + 8 * h);
      minima[at] = m[h];
      channels[at] = (unsigned char)c[h];
    }
  }
  // The min over the thread's two channels and the butterfly, into butterfly buffer `buffer` (kBufferFloats floats
  // each; the channels at red_channel, kSave).
  __device__ void reduce_unpacked(const typename Mainloop::Accum& acc, int g, int t, int warp, int first,
                                  int buffer) const {
    float v[2 * kNBlocks];  // v[2j + e]: pixel 8j + 2t + e
    uint32_t ch[kChannelWords];
#pragma unroll
    for (int j = 0; j < kNBlocks; ++j) {
      const float(&a)[4] = acc[j];
      if constexpr (kSave) {
        if ((2 * j) % kPer == 0) ch[2 * j / kPer] = 0;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          int channel = g;
          v[2 * j + e] = a[e];
          keep_min(v[2 * j + e], channel, a[e + 2], g + 8);
          ch[(2 * j + e) / kPer] |= (uint32_t)channel << kBits * ((2 * j + e) % kPer);
        }
      } else {
        v[2 * j] = nan_min(a[0], a[2]);
        v[2 * j + 1] = nan_min(a[1], a[3]);
      }
    }
    // Step b (lane bit 2 + b): lanes with g bit b set keep the upper half. After the three steps v[i] holds value
    // i + kFinal * (bit2 + 2 * bit1 + 4 * bit0) of the start, with bit_b = (g >> b) & 1.
    fold<kNBlocks>(v, ch, g & 1, 4);
    fold<kNBlocks / 2>(v, ch, (g >> 1) & 1, 8);
    fold<kNBlocks / 4>(v, ch, (g >> 2) & 1, 16);
    float* const row = red + buffer * kBufferFloats + warp * kRedPitch;
    unsigned char* const row_ch = red_channel + buffer * kBufferFloats + warp * kRedPitch;
#pragma unroll
    for (int i = 0; i < kFinal; i += 2) {
      const int pixel = 8 * ((first + i) / 2) + 2 * t;
      *reinterpret_cast<float2*>(row + skewed(pixel)) = make_float2(v[i], v[i + 1]);
      if constexpr (kSave) {  // the two pixels' channels, a byte each
        const uint32_t w = ch[i / kPer] >> kBits * (i % kPer);
        *reinterpret_cast<uint16_t*>(row_ch + skewed(pixel)) = (uint16_t)((w & kMask) | ((w >> kBits) & kMask) << 8);
      }
    }
  }
  // 16-bit, not saving (run by the producer's threads, write_handed): a pixel pair a call (kTileCols = 2 x
  // kWarpgroup), p and p + kWarpgroup: the pair's 4 staged chunks (one a warp, 16-byte loads), 15 packed mins down to
  // one word (pixel p in the low half, p + kWarpgroup in the high), and a store of each pixel. Two pixels at once
  // against one a trip: bf16 and fp16 3-4% faster; the TF32 kernel with float2 loads and stores was 1.5% slower, so
  // it keeps one pixel a trip (docs/perf-notes.md, "Epilogue and the handed write").
  static_assert(!kPacked || kTileCols == 2 * Geometry::kWarpgroup, "a packed tile is two pixels a thread");
  // Where warp w's 16 bytes of pixel pair p sit in a staged buffer: the pair owns the 64 bytes at 64 p, the warps'
  // chunks in it permuted by p / 2 (w ^ (p >> 1)). Then a stmatrix row set (8 consecutive pairs of one warp) hits 8
  // distinct 16-byte bank groups, and so do a quarter-warp's loads in the write (8 consecutive pairs, chunk k ^ (p
  // >> 1) of each in trip k).
  __host__ __device__ static constexpr int stage_offset(int p, int w) { return 64 * p + 16 * ((w ^ (p >> 1)) & 3); }
  __host__ __device__ static constexpr bool stores_2048_apart() {
    for (int p = 0; p < 32; ++p)
      for (int w = 0; w < 4; ++w)
        if (stage_offset(p + 32, w) != stage_offset(p, w) + 2048) return false;
    return true;
  }
  static_assert(kNBlocks % 8 == 0 && stores_2048_apart(), "a stmatrix store's rows 2048 bytes on from the last's");
  __device__ static void write_pair(const unsigned char* buffer, const RowOut<Elem>& dst, int col0, int OW, int p) {
    const int col = col0 + p;
    if (col >= OW) return;
    // The pair's 4 chunks, chunk k ^ (p >> 1) in trip k (which warp is which does not matter to the min).
    const unsigned char* const pair = buffer + 64 * p;
    uint4 x[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = *reinterpret_cast<const uint4*>(pair + 16 * ((k ^ (p >> 1)) & 3));
#pragma unroll
    for (int k = 0; k < 4; k += 2) {
      x[k].x = Precision::min2(x[k].x, x[k + 1].x);
      x[k].y = Precision::min2(x[k].y, x[k + 1].y);
      x[k].z = Precision::min2(x[k].z, x[k + 1].z);
      x[k].w = Precision::min2(x[k].w, x[k + 1].w);
    }
    const uint32_t m = Precision::min2(Precision::min2(Precision::min2(x[0].x, x[2].x), Precision::min2(x[0].y, x[2].y)),
                                       Precision::min2(Precision::min2(x[0].z, x[2].z), Precision::min2(x[0].w, x[2].w)));
    Elem e[2];
    memcpy(e, &m, sizeof(m));
    dst.out[col] = convert<Elem>(tanh2<Precision::kTanhApprox>(convert<float>(e[0])));
    if (col + Geometry::kWarpgroup < OW)
      dst.out[col + Geometry::kWarpgroup] = convert<Elem>(tanh2<Precision::kTanhApprox>(convert<float>(e[1])));
  }
  // The fp32 minima of pixel `at` (skewed) over the 4 warps of a butterfly buffer, unscaled: the pixel's min.
  __device__ float min_of_warps(const float* buffer, int at) const {
    return Precision::unscale(nan_min(nan_min(buffer[at], buffer[kRedPitch + at]),
                                      nan_min(buffer[2 * kRedPitch + at], buffer[3 * kRedPitch + at])),
                              out_scale);
  }
  // The min of pixel `at` (skewed) and its channel, as torch.min picks them (NaN first, then the lowest channel of
  // equal values): kPixelRows staged whole; else over the 4 warps of a butterfly buffer (16 w + the staged channel
  // within warp w). Unscaled; the output it gives: tanh twice, 16-bit from the min rounded to the element type, as
  // the inference variant's (kPacked).
  __device__ void write_saved(const float* minima, const unsigned char* channels, int at, const RowOut<Elem>& dst,
                              int col) const {
    float m = minima[at];
    int channel = channels[at];
    if constexpr (!kPixelRows) {
#pragma unroll
      for (int w = 1; w < 4; ++w) keep_min(m, channel, minima[w * kRedPitch + at], 16 * w + channels[w * kRedPitch + at]);
    }
    m = Precision::unscale(m, out_scale);
    dst.argmin[col] = (unsigned char)channel;
    dst.pre_min[col] = m;
    if constexpr (kStagesPacked) m = convert<float>(convert<Elem>(m));
    dst.out[col] = convert<Elem>(tanh2<Precision::kTanhApprox>(m));
  }
  // kHandsOff: the producer's threads write step `staged` (the next, in order) once the consumer has staged it:
  // packed, the pairs p = ptid, ptid + kApart, ... each; fp32 minima (and kSave their channels), the pixels p = ptid,
  // ptid + kApart, ...
  template <int kApart>
  __device__ void write_handed(const RowOut<Elem>& dst, int col0, int OW, int ptid) {
    mbarrier_wait(stage_full(staged), (staged / kStages) & 1);
    const unsigned char* const buffer = stage_buffer(staged);
    if constexpr (kPacked) {
#pragma unroll
      for (int p = ptid; p < kTileCols / 2; p += kApart) write_pair(buffer, dst, col0, OW, p);
    } else if constexpr (kSave) {
      const float* const minima = reinterpret_cast<const float*>(buffer);
#pragma unroll
      for (int p = ptid; p < kTileCols; p += kApart) {
        const int col = col0 + p;
        if (col < OW) write_saved(minima, buffer + kRedPitch * 4, skewed(p), dst, col);
      }
    } else {
      const float* const minima = reinterpret_cast<const float*>(buffer);
#pragma unroll
      for (int p = ptid; p < kTileCols; p += kApart) {
        const int col = col0 + p;
        if (col < OW) dst.out[col] = convert<Elem>(tanh2<Precision::kTanhApprox>(min_of_warps(minima, skewed(p))));
      }
    }
    mbarrier_arrive(stage_empty(staged));
    ++staged;
  }
  // The rest, which the consumer runs while the next step's MMAs are in flight: once all 4 warps have written, the
  // min over them (warp w holds channels 16w..16w+15), tanh, tanh and the store.
  __device__ void write(const Partial&, const RowOut<typename Geometry::Elem>& dst, int col0, int OW) {
    if constexpr (!kHandsOff) {  // (kHandsOff: the producer's threads write the step)
      float* const buffer = red + turn * kBufferFloats;
      const unsigned char* const buffer_ch = red_channel + turn * kBufferFloats;
      turn ^= 1;
      named_barrier<Geometry::kWarpgroup>(barrier_id);
      // Saving runs one pixel a trip: the next step's accumulators are live here and leave no register to spare.
#pragma unroll(kSave ? 1 : kTileCols / Geometry::kWarpgroup)
      for (int p = ctid; p < kTileCols; p += Geometry::kWarpgroup) {
        const int col = col0 + p;
        if (col < OW) {
          const int at = skewed(p);
          if constexpr (kSave) {
            write_saved(buffer, buffer_ch, at, dst, col);
          } else {  // fp32 minima (the packed ones take write_pair)
            const float m = min_of_warps(buffer, at);
            dst.out[col] = convert<typename Geometry::Elem>(tanh2<Precision::kTanhApprox>(m));
          }
        }
      }
    }
  }
};

}  // namespace kb25
