// The producer: input row segments from global memory into a slot's layout.
#pragma once

#include "geometry.cuh"

namespace kb25 {

// One producer for every precision. An input row segment (kCin channel rows, kInCols columns from col0) is kItems items
// (group, chunk): kGroupChannels channels x kVec columns, one 16-byte load per channel. fp32: consecutive threads take
// consecutive chunks of one group; 16-bit: the two groups alternate (threads 2i, 2i + 1 take chunk i), so a
// quarter-warp is 2 groups x 4 chunks. Either way every load is coalesced. load() brings a thread's items into
// registers; store() turns them into the slot layout: it transposes the kGroupChannels channel vectors in registers
// (fp32 per 4-column piece, with the precision's conversion: TF32 rounding; for 3xTF32 the split into copy 0 (big) and
// copy 1 (small) where the MMA reads shared memory, raw fp32 where it splits in registers) and writes one 16-byte
// column at a time. Those writes land 16 * kVec bytes apart across the lanes, so each lane writes its columns in
// another order and 8 lanes hit 8 distinct 16-byte bank groups: fp32 starts each lane at another column (a rotation by
// the chunk); 16-bit writes column jj ^ (chunk & 3) at store jj, with its two groups 4 columns apart modulo 8
// (kPitchCols), the column's half of a word picked by the byte permute's selector and only the word pairs swapped by
// selects. A thread stores only what it loaded: no barrier between the two, and shared memory sees each row once. Where
// chunks are not 16-byte aligned (W % kVec != 0, or x itself) the items are loaded element by element.
template <class Geometry, int kThreads>
struct RowProducer {
  using Elem = typename Geometry::XElem;  // x's element type
  using Precision = typename Geometry::Precision;
  using Bits = std::conditional_t<sizeof(Elem) == 4, uint32_t, uint16_t>;
  // Elements per 16 bytes of x: the columns of one item's channel. kChannels: the channels of one slot column (as
  // many, except where fp32 x goes into fp16 slots, kNarrows: 4 columns x 8 channels an item).
  static constexpr int kVec = 16 / (int)sizeof(Elem);
  static constexpr int kChannels = Geometry::kGroupChannels;
  static constexpr bool kNarrows = sizeof(Elem) > sizeof(typename Geometry::MmaElem);
  static constexpr int kChunks = (Geometry::kInCols + kVec - 1) / kVec;
  static constexpr int kItems = Geometry::kGroups * kChunks;
  // The last chunk of each group (its columns reach only the tile's last kKsize - 1 pixels, which exist only where
  // the row goes on past the tile) are the late items: items kBody.., one each for threads 0 .., loaded after the
  // wait for the slot. The body, every other item, is kMine per thread, in flight in registers across that wait.
  static constexpr int kBody = Geometry::kGroups * (kChunks - 1);
  static constexpr int kMine = (kBody + kThreads - 1) / kThreads;
  static constexpr int kLate = kItems - kBody;
  static constexpr bool kInterleaved = sizeof(Elem) == 2;
  static constexpr int kRegisters = kMine * kChannels * 4;  // one row in flight
  static_assert(kLate <= kThreads, "one late item per thread at most");
  static_assert((kChunks - 1) * kVec >= Geometry::kTileCols, "the body covers every stored pixel's own column");
  static_assert(kChunks * kVec <= Geometry::kPitchCols, "a stored chunk stays inside the slot");
  static_assert(!kInterleaved || (Geometry::kGroups == 2 && Geometry::kPitchCols % 8 == 4),
                "16-bit: two groups, 4 columns apart modulo 8");
  struct Row {
    uint4 raw[kMine][kChannels];  // [item][channel]: kVec columns
  };
  const int64_t plane;
  const int W, tid;
  const bool vec16;
  __device__ RowProducer(const Elem* x, int H, int W_, int tid_)
      : plane((int64_t)H * W_), W(W_), tid(tid_),
        vec16(W_ % kVec == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0) {}

  __device__ static void place(int item, int& grp, int& chunk) {
    if (item >= kBody) {
      grp = item - kBody;
      chunk = kChunks - 1;
    } else if constexpr (kInterleaved) {
      grp = item % Geometry::kGroups;
      chunk = item / Geometry::kGroups;
    } else {
      grp = item / (kChunks - 1);
      chunk = item - grp * (kChunks - 1);
    }
  }
  // Row y of the image from col0, in the first channel of group grp.
  __device__ const Bits* group_row(const Elem* __restrict__ x_img, int y, int col0, int grp) const {
    return reinterpret_cast<const Bits*>(x_img) + (int64_t)y * W + col0 + grp * kChannels * plane;
  }
  // Item `item`'s kChannels channel vectors, loaded in program order (volatile). Only where the chunks are 16-byte
  // aligned (vec16): then W % kVec == 0 and a chunk is wholly inside or wholly outside the row. Outside, the loads
  // read the image's first chunk instead (no branch around them); those columns reach only pixels past OW, which
  // are never stored.
  __device__ void load_item(uint4 (&raw)[kChannels], int item, const Elem* __restrict__ x_img, int y, int col0) const {
    const Bits* src = item_source(item, x_img, y, col0);
#pragma unroll
    for (int c = 0; c < kChannels; ++c, src += plane) raw[c] = load_streaming(src);
  }
  // Where item `item`'s first channel vector lies (the image's first chunk where the chunk is past the row's end).
  __device__ const Bits* item_source(int item, const Elem* __restrict__ x_img, int y, int col0) const {
    int grp, chunk;
    place(item, grp, chunk);
    const int col = kVec * chunk;
    const Bits* src = group_row(x_img, y, col0, grp) + col;
    return col0 + col >= W ? reinterpret_cast<const Bits*>(x_img) : src;
  }
  // load() by asynchronous copies, for a caller that keeps a row in flight without registers: the thread's body items
  // into its own 16-byte words at `base` ([item][channel][thread], kStageBytes), then read_staged() brings them
  // into a Row once the copies have landed (cp_async_wait_all). Only where vec16.
  static constexpr int kStageBytes = kMine * kChannels * kThreads * 16;
  __device__ void stage(uint32_t base, const Elem* __restrict__ x_img, int y, int col0) const {
#pragma unroll
    for (int k = 0; k < kMine; ++k) {
      if (!mine(k)) continue;
      const Bits* src = item_source(tid + k * kThreads, x_img, y, col0);
#pragma unroll
      for (int c = 0; c < kChannels; ++c, src += plane)
        cp_async16(base + ((k * kChannels + c) * kThreads + tid) * 16, src);
    }
  }
  __device__ void read_staged(Row& row, uint32_t base) const {
#pragma unroll
    for (int k = 0; k < kMine; ++k)
#pragma unroll
      for (int c = 0; c < kChannels; ++c)
        if (mine(k)) row.raw[k][c] = lds128(base + ((k * kChannels + c) * kThreads + tid) * 16);
  }
  // Into the slot layout: transpose the kChannels channel vectors, convert, write 16-byte columns. Returns `range`
  // with, where x narrows, what it stored folded in (Precision::range_fold: each narrowed word with the two input words
  // it came from), where a 16-bit tag refits x (Precision::kRefits16, the fed dW's) its raw words (fold2); unchanged
  // otherwise.
  __device__ uint32_t store_item(const uint4 (&raw)[kChannels], int item, unsigned char* slot, uint32_t range) const {
    int grp, chunk;
    place(item, grp, chunk);
    unsigned char* dst = slot + grp * Geometry::kGroupBytes + chunk * kVec * 16;
    if constexpr (kInterleaved) {
      // Column c of the chunk: word c / 2 of every channel vector, half c % 2. Store jj writes column jj ^ x: the
      // words swapped in pairs where x & 2, the halves picked by the permute's selector where x & 1.
      const int x = chunk & 3;
      const bool swap = x & 2;
      const uint32_t sel_even = (x & 1) ? 0x7632 : 0x5410, sel_odd = sel_even ^ 0x2222;
      uint32_t w[kVec][4];
#pragma unroll
      for (int c = 0; c < kVec; ++c) {
        if constexpr (Precision::kRefits16) {  // the fed dW's 16-bit x: its magnitudes folded
          range = Precision::fold2(Precision::fold2(Precision::fold2(Precision::fold2(range, raw[c].x), raw[c].y),
                                                    raw[c].z), raw[c].w);
        }
        w[c][0] = swap ? raw[c].y : raw[c].x;
        w[c][1] = swap ? raw[c].x : raw[c].y;
        w[c][2] = swap ? raw[c].w : raw[c].z;
        w[c][3] = swap ? raw[c].z : raw[c].w;
      }
#pragma unroll
      for (int jj = 0; jj < kVec; ++jj) {
        const int q = jj >> 1;
        const uint32_t sel = (jj & 1) ? sel_odd : sel_even;
        uint4 col = make_uint4(__byte_perm(w[0][q], w[1][q], sel), __byte_perm(w[2][q], w[3][q], sel),
                               __byte_perm(w[4][q], w[5][q], sel), __byte_perm(w[6][q], w[7][q], sel));
        if constexpr (Precision::kRefits16) {  // into fp16
          col = make_uint4(Precision::refit2(col.x), Precision::refit2(col.y), Precision::refit2(col.z),
                           Precision::refit2(col.w));
        }
        store_column(dst + (jj ^ x) * 16, col);
      }
    } else if constexpr (kNarrows) {
      static_assert(!Precision::kFastNeedsNoNaN, "a narrowing tag converts NaNs as they come (the element path too)");
      // One 4-column piece, as below, but narrowed first (Precision::narrow2: column c's 8 channels, two to a word,
      // rounded to TF32 or as .to() rounds, as fp16 or bf16): the rotation then moves 16 words instead of 32.
      // Split in the slot (Fp32OnF16x3): the lo parts (Precision::rest2) into copy 1, rotated alike.
      const int r = (chunk >> 1) & 3;
      uint32_t q[4][4];  // [column][channel pair]
#pragma unroll
      for (int col = 0; col < 4; ++col) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          q[col][k] = Precision::narrow2(word(raw[2 * k], col), word(raw[2 * k + 1], col));
          range = Precision::range_fold(range, q[col][k], word(raw[2 * k], col), word(raw[2 * k + 1], col));
        }
      }
      store_rotated(dst, q, r);
      if constexpr (Geometry::kSplitInSlot) {
#pragma unroll
        for (int col = 0; col < 4; ++col)
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            q[col][k] = Precision::rest2(word(raw[2 * k], col), word(raw[2 * k + 1], col), q[col][k]);
            range = Precision::range_fold(range, q[col][k], 0u, 0u);  // lo: nonzero where hi rounded a value to 0
          }
        store_rotated(dst + Geometry::kCopyBytes, q, r);
      }
      return range;
    } else {
      // One 4-column piece: lane starts at column r = chunk / 2 (mod 4), so 8 lanes (8 chunks) hit 8 bank groups.
      // Store jj writes column (jj + r) & 3: each channel vector's words rotated by r (two conditional swaps, which
      // compile to selects; a pick by a runtime index compiles to branches).
      const int r = (chunk >> 1) & 3;
      uint32_t w[kChannels][4];
#pragma unroll
      for (int c = 0; c < kChannels; ++c) {
        const bool half = r & 2, one = r & 1;
        const uint32_t h0 = half ? raw[c].z : raw[c].x, h1 = half ? raw[c].w : raw[c].y;
        const uint32_t h2 = half ? raw[c].x : raw[c].z, h3 = half ? raw[c].y : raw[c].w;
        w[c][0] = one ? h1 : h0;
        w[c][1] = one ? h2 : h1;
        w[c][2] = one ? h3 : h2;
        w[c][3] = one ? h0 : h3;
      }
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
        store_column(dst + ((jj + r) & 3) * 16, make_uint4(w[0][jj], w[1][jj], w[2][jj], w[3][jj]));
    }
    return range;
  }
  __device__ static uint32_t word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }
  // A narrowed 4-column piece q[column][channel pair], column c stored at ((c - r) & 3): the words rotated by r (two
  // conditional swaps, which compile to selects).
  __device__ static void store_rotated(unsigned char* dst, const uint32_t (&q)[4][4], int r) {
    const bool half = r & 2, one = r & 1;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      uint32_t v[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t h0 = half ? q[(jj + 2) & 3][k] : q[jj][k], h1 = half ? q[(jj + 3) & 3][k] : q[(jj + 1) & 3][k];
        v[k] = one ? h1 : h0;
      }
      *reinterpret_cast<uint4*>(dst + ((jj + r) & 3) * 16) = make_uint4(v[0], v[1], v[2], v[3]);
    }
  }
  // A whole row. Aligned: its loads are issued before the caller waits for the slot (the row is in flight in
  // registers), then stored. Element by element (the rare path): each element is loaded, converted and stored in
  // turn, zero past the row's end; slow, and next to no registers.
  __device__ void load(Row& row, const Elem* __restrict__ x_img, int y, int col0) const {
#pragma unroll
    for (int k = 0; k < kMine; ++k)
      if (mine(k)) load_item(row.raw[k], tid + k * kThreads, x_img, y, col0);
  }
  // Item tid + k * kThreads is part of the body (where the body is not whole items per thread, the last round
  // leaves some threads without one).
  __device__ bool mine(int k) const { return kBody % kThreads == 0 || tid + k * kThreads < kBody; }
  // The body, then this thread's late item if the row reaches it. Where the tag's fast conversion needs NaN-free
  // words, an item with a NaN in it has its NaNs made quiet first (each item on its own: a store waits only for its
  // own item's loads). Returns whether what this thread stored holds an input outside the range of the slots' type
  // (Precision::kGuardsRange; false otherwise).
  __device__ bool store(Row& row, unsigned char* slot, const Elem* __restrict__ x_img, int y, int col0) const {
    return out_of_range(store_folded(row, slot, x_img, y, col0));
  }
  // The same stores; returns the tag's fold of what this thread stored (Precision::range_fold) itself.
  __device__ uint32_t store_folded(Row& row, unsigned char* slot, const Elem* __restrict__ x_img, int y,
                                   int col0) const {
    uint32_t range = store_body(row, slot);
    if (tid < kLate && reaches_late(col0)) {
      uint4 raw[kChannels];
      load_item(raw, kBody + tid, x_img, y, col0);
      range = store_late(raw, slot, range);
    }
    return range;
  }
  // The body alone, for a caller that brings the late items itself (store_late): the fold of what it stored.
  __device__ uint32_t store_body(Row& row, unsigned char* slot) const {
    uint32_t range = 0;
#pragma unroll
    for (int k = 0; k < kMine; ++k)
      if (mine(k)) range = store_item(quieted(row.raw[k]), tid + k * kThreads, slot, range);
    return range;
  }
  // Late item `tid` (tid < kLate), its channel vectors in `raw`, stored as store_folded stores it.
  __device__ uint32_t store_late(uint4 (&raw)[kChannels], unsigned char* slot, uint32_t range) const {
    return store_item(quieted(raw), kBody + tid, slot, range);
  }
  // Whether the row reaches the tile's last chunk (the late items): only then are they loaded and stored.
  __device__ bool reaches_late(int col0) const { return col0 + (kChunks - 1) * kVec < W; }
  // Channel c of late item i (16 bytes), for a caller that spreads the late items' loads over kLate * kChannels
  // threads; only where the row reaches them (reaches_late) and vec16.
  __device__ uint4 load_late_vector(int i, int c, const Elem* __restrict__ x_img, int y, int col0) const {
    return load_streaming(late_vector(i, c, x_img, y, col0));
  }
  __device__ const Bits* late_vector(int i, int c, const Elem* __restrict__ x_img, int y, int col0) const {
    return group_row(x_img, y, col0, i) + kVec * (kChunks - 1) + c * plane;
  }
  __device__ static bool out_of_range(uint32_t range) {
    if constexpr (kNarrows) return Precision::range_lists(range);
    return false;
  }
  // The item, every NaN in it made 0x7FC00000 where the tag's fast conversion needs NaN-free words (never for 16-bit
  // elements): a NaN that the fast TF32 rounding keeps a NaN (the canonical one, every payload bit set, would carry
  // out). One compare for two words; the rare item with a NaN takes a select a word.
  __device__ static const uint4 (&quieted(uint4 (&raw)[kChannels]))[kChannels] {
    if constexpr (sizeof(Elem) == 4) {
      if constexpr (Geometry::Precision::kFastNeedsNoNaN) {
        bool nan = false;
#pragma unroll
        for (int c = 0; c < kChannels; ++c) nan |= either_nan(raw[c].x, raw[c].y) | either_nan(raw[c].z, raw[c].w);
        if (nan) {
#pragma unroll
          for (int c = 0; c < kChannels; ++c) {
            raw[c].x = quiet_nan(raw[c].x), raw[c].y = quiet_nan(raw[c].y);
            raw[c].z = quiet_nan(raw[c].z), raw[c].w = quiet_nan(raw[c].w);
          }
        }
      }
    }
    return raw;
  }
  __device__ static uint32_t quiet_nan(uint32_t v) { return isnan(__uint_as_float(v)) ? 0x7FC00000u : v; }
  // Returns whether an input it stored is out of the slots' range, as store() does.
  __device__ bool copy_by_element(const Elem* __restrict__ x_img, int y, int col0, unsigned char* slot) const {
    return out_of_range(copy_folded_by_element(x_img, y, col0, slot));
  }
  // The same copy; returns the tag's fold of what this thread stored, as store_folded() does.
  __device__ uint32_t copy_folded_by_element(const Elem* __restrict__ x_img, int y, int col0,
                                             unsigned char* slot) const {
    uint32_t range = 0;
#pragma unroll 1
    for (int item = tid; item < kItems; item += kThreads) {
      int grp, chunk;
      place(item, grp, chunk);
      const Bits* src = group_row(x_img, y, col0, grp);
      unsigned char* const dst = slot + grp * Geometry::kGroupBytes;
#pragma unroll 1
      for (int c = 0; c < kChannels; ++c, src += plane) {
#pragma unroll
        for (int i0 = 0; i0 < kVec; ++i0) {
          const int i = kVec * chunk + i0;
          const Bits e = col0 + i < W ? load_element(src + i) : Bits(0);
          if constexpr (kNarrows) {
            const uint32_t h = Precision::narrow2(e, 0) & 0xFFFFu;
            range = Precision::range_fold(range, h, e, 0u);
            *reinterpret_cast<uint16_t*>(dst + i * 16 + c * 2) = (uint16_t)h;
            if constexpr (Geometry::kSplitInSlot) {
              const uint32_t lo = Precision::rest2(e, 0, h) & 0xFFFFu;
              range = Precision::range_fold(range, lo, 0u, 0u);
              *reinterpret_cast<uint16_t*>(dst + Geometry::kCopyBytes + i * 16 + c * 2) = (uint16_t)lo;
            }
          } else if constexpr (sizeof(Elem) == 4) {
            const uint32_t w[1] = {e};
            put<true>(dst + i * 16 + c * 4, w);
          } else if constexpr (Precision::kRefits16) {
            range = Precision::fold2(range, e);
            *reinterpret_cast<Bits*>(dst + i * 16 + c * 2) = (Bits)Precision::refit2(e);
          } else {
            *reinterpret_cast<Bits*>(dst + i * 16 + c * 2) = e;
          }
        }
      }
    }
    return range;
  }
  // Read once, through L2 only (.cg): the loads do not go through L1, which the wgmma operand reads and the stores
  // to shared memory keep busy (docs/perf-notes.md, "Producer and loads"; the rare element loads keep the
  // non-allocating L1 path).
  __device__ static uint4 load_streaming(const void* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
  }
  __device__ static uint32_t load_element(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
    return v;
  }
  __device__ static uint16_t load_element(const uint16_t* p) {
    uint16_t v;
    asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
    return v;
  }
  // kN elements into copy 0 at dst, converted by the precision's tag: what the tensor cores get (TF32 rounding, by
  // to_tensor_core where kExact, else by the fast conversion of NaN-free words; raw where 3xTF32 splits in
  // registers), or, where 3xTF32 splits on the way into shared memory, big into copy 0 and small into copy 1. 16-bit
  // elements go as they are.
  template <bool kExact, int kN>
  __device__ static void put(unsigned char* dst, const uint32_t (&v)[kN]) {
    using Precision = typename Geometry::Precision;
    uint32_t out[kN];
    if constexpr (Geometry::kSplitInSlot) {
      uint32_t small[kN];
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        float b, sm;
        Precision::split(__uint_as_float(v[i]), b, sm);
        out[i] = __float_as_uint(b);
        small[i] = __float_as_uint(sm);
      }
      store_words(dst, out);
      store_words(dst + Geometry::kCopyBytes, small);
      return;
    } else if constexpr (kExact) {
#pragma unroll
      for (int i = 0; i < kN; ++i) out[i] = __float_as_uint(Precision::to_tensor_core(__uint_as_float(v[i])));
    } else if constexpr (Geometry::kMmaReadsSlots) {
      Precision::to_slot(v, out);
    } else {
      Precision::to_registers(v, out);
    }
    store_words(dst, out);
  }
  template <int kN>
  __device__ static void store_words(unsigned char* dst, const uint32_t (&v)[kN]) {
    if constexpr (kN == 4) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(v[0], v[1], v[2], v[3]);
    } else {
      *reinterpret_cast<uint32_t*>(dst) = v[0];
    }
  }
  __device__ static void store_column(unsigned char* dst, uint4 v) {
    if constexpr (sizeof(Elem) == 4) {
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
      put<false>(dst, w);
    } else {
      *reinterpret_cast<uint4*>(dst) = v;
    }
  }
};

}  // namespace kb25
