// The mma.sync epilogue: the min over 64 channels in registers and shuffles, tanh, tanh, store.
#pragma once

#include "mainloop_mma_sync.cuh"

namespace kb25 {

// mma.sync: min over the lane's 2*kNTiles channels of pixels g and g+8, then over the quad (xor 1, 2): every lane
// of the quad ends with the minima over all kCout channels of each m-tile. Lane t then stores m-tiles t, t + 4, ...:
// 8 consecutive pixels per quad position, coalesced across the warp.
template <class Mainloop, bool kSave, class Schedule>
struct MmaSyncEpilogue {
  static_assert(!Schedule::kHanded, "mma.sync writes each step from registers");
  using Geometry = typename Mainloop::Geometry;
  static constexpr int kMTiles = Mainloop::kMTiles;
  static constexpr int kMine = (kMTiles + 3) / 4;  // m-tiles a lane stores
  static constexpr int kSmemBytes = 0;
  static constexpr bool kHandsOff = false;
  static constexpr bool kPixelRows = false;  // (the wgmma epilogue's saving layout: mma.sync has pixel rows already)
  static constexpr int kHandOffStages = 0;
  const int ctid;
  float out_scale = 1.f;  // what each pixel's min is multiplied by (Precision::unscale; Tf32OnF16: 2^-s)
  __device__ MmaSyncEpilogue(unsigned char*, int, int ctid_, uint64_t* = nullptr) : ctid(ctid_) {}

  struct Partial {
    float lo[kMine], hi[kMine];  // the minima of pixels 16 mt + g and 16 mt + g + 8, mt = t + 4i
    int lo_ch[kSave ? kMine : 1], hi_ch[kSave ? kMine : 1];  // kSave: their channels
  };
  __device__ Partial reduce(const typename Mainloop::Accum& acc) const {
    const int t = ctid & 3;
    Partial part;
#pragma unroll
    for (int i = 0; i < kMine; ++i) part.lo[i] = part.hi[i] = 0.f;
    if constexpr (kSave) {
#pragma unroll
      for (int i = 0; i < kMine; ++i) part.lo_ch[i] = part.hi_ch[i] = 0;
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      float lo, hi;
      int lo_ch = 2 * t, hi_ch = 2 * t;  // kSave: lane t holds channels 8 nt + 2t + (0, 1)
      if constexpr (kSave) {
        lo = acc[mt][0][0];
        hi = acc[mt][0][2];
#pragma unroll
        for (int nt = 0; nt < Mainloop::kNTiles; ++nt) {
#pragma unroll
          for (int e = nt == 0 ? 1 : 0; e < 2; ++e) {
            keep_min(lo, lo_ch, acc[mt][nt][e], 8 * nt + 2 * t + e);
            keep_min(hi, hi_ch, acc[mt][nt][2 + e], 8 * nt + 2 * t + e);
          }
        }
#pragma unroll
        for (int mask = 1; mask <= 2; mask *= 2) {
          const float lo_got = __shfl_xor_sync(0xffffffffu, lo, mask), hi_got = __shfl_xor_sync(0xffffffffu, hi, mask);
          const int lo_got_ch = __shfl_xor_sync(0xffffffffu, lo_ch, mask);
          const int hi_got_ch = __shfl_xor_sync(0xffffffffu, hi_ch, mask);
          keep_min(lo, lo_ch, lo_got, lo_got_ch);
          keep_min(hi, hi_ch, hi_got, hi_got_ch);
        }
      } else {
        lo = nan_min(acc[mt][0][0], acc[mt][0][1]);
        hi = nan_min(acc[mt][0][2], acc[mt][0][3]);
#pragma unroll
        for (int nt = 1; nt < Mainloop::kNTiles; ++nt) {
          lo = nan_min(lo, nan_min(acc[mt][nt][0], acc[mt][nt][1]));
          hi = nan_min(hi, nan_min(acc[mt][nt][2], acc[mt][nt][3]));
        }
        lo = nan_min(lo, __shfl_xor_sync(0xffffffffu, lo, 1));
        hi = nan_min(hi, __shfl_xor_sync(0xffffffffu, hi, 1));
        lo = nan_min(lo, __shfl_xor_sync(0xffffffffu, lo, 2));
        hi = nan_min(hi, __shfl_xor_sync(0xffffffffu, hi, 2));
      }
      if (mt % 4 == t) {
        part.lo[mt / 4] = lo;
        part.hi[mt / 4] = hi;
        if constexpr (kSave) {
          part.lo_ch[mt / 4] = lo_ch;
          part.hi_ch[mt / 4] = hi_ch;
        }
      }
    }
    return part;
  }
  __device__ void write(const Partial& part, const RowOut<typename Geometry::Elem>& dst, int col0, int OW) {
    using Elem = typename Geometry::Elem;
    const int lane = ctid & 31;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < kMine; ++i) {
      const int mt = t + 4 * i;
      const int col = col0 + (ctid >> 5) * Mainloop::kWarpCols + mt * 16 + g;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int at = col + 8 * half;
        const float m = Geometry::Precision::unscale(half ? part.hi[i] : part.lo[i], out_scale);
        if constexpr (kSave) {
          if (mt < kMTiles && at < OW) {
            dst.out[at] = convert<Elem>(tanh2<Geometry::Precision::kTanhApprox>(m));
            dst.argmin[at] = (unsigned char)(half ? part.hi_ch[i] : part.lo_ch[i]);
            dst.pre_min[at] = m;
          }
        } else {  // tanh2 whether or not the pixel is stored: a predicated store, no branch around the math
          const Elem v = convert<Elem>(tanh2<Geometry::Precision::kTanhApprox>(m));
          if (mt < kMTiles && at < OW) dst.out[at] = v;
        }
      }
    }
  }
};

}  // namespace kb25
