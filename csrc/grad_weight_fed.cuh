// dW and db on the fp16 tensor cores, fed by the forward's producer and row ring: float32 x (TF32), bf16 and fp16 x.
#pragma once

#include "backward.cuh"
#include "producer.cuh"
#include "ring.cuh"

namespace kb25 {

// The producer's tag for the fed dW: Tf32OnF16's narrowing (x rounded as the TF32 conv rounds it, then an fp16 value
// exactly in fp16's normal range), with a fold that lets a row be walked instead of listing an image: the largest
// |x| (fp32 bits; a NaN above every number) of what a thread stored. A row whose largest
// input rounds to 65504 or more (or is +-inf or NaN: fp16 does not hold it), or that is nonzero but all below 2^-10
// (where fp16's 2^-24 steps would cost more than TF32's rounding), has every step whose window holds it summed in
// fp32 from global memory instead. A row with an input of 2^-10 or more keeps its inputs below 2^-14 within 2^-24 of
// their TF32 value (rounded to fp16's subnormal spacing), under 2^-14 of its largest.
struct Tf32OnF16Walked : Tf32OnF16 {
  static constexpr uint32_t kTooLarge = 0x477FD000u;  // 65488: rounds (ties away) to 65504 in TF32
  static constexpr uint32_t kSmallRow = 0x3A800000u;  // 2^-10
  __device__ static uint32_t range_fold(uint32_t range, uint32_t, uint32_t lo, uint32_t hi) {
    return max(range, max(lo & 0x7FFFFFFFu, hi & 0x7FFFFFFFu));
  }
  // A largest |x| (of a thread's share, or of a row) that walks.
  __device__ static bool range_lists(uint32_t largest) {
    return largest >= kTooLarge || (largest != 0 && largest < kSmallRow);
  }
  // The fold's largest |x|, as fp32 bits: the fold itself.
  __device__ static uint32_t largest(uint32_t range) { return range; }
};

// The producer's tag for the fed dW of 16-bit x: the slots hold fp16, as for float32 x. bf16 x is converted (refit2:
// exact within fp16's normal range; below it, to fp16's subnormal spacing; 65536 and above become infinities), fp16
// x goes as it is. The fold is the largest magnitude of each half of the thread's raw words (fold2, 16-bit bits), and
// largest() turns it into what Tf32OnF16Walked's bounds (kTooLarge, kSmallRow) read: bf16's as fp32 bits, so a row
// walks where it holds a value fp16 does not (65536 and above, +-inf, NaN) or is nonzero but all below 2^-10; fp16's
// so that only a row with an infinity or a NaN walks (fp16 x is exact in the slots).
template <class XElem_>
struct Sixteen2F16Walked : Native16<__half> {
  static_assert(std::is_same_v<XElem_, __nv_bfloat16> || std::is_same_v<XElem_, __half>, "bf16 or fp16 x");
  using XElem = XElem_;
  static constexpr bool kRefits16 = true;
  static constexpr bool kBf16X = std::is_same_v<XElem_, __nv_bfloat16>;
  static constexpr uint32_t kTooLarge = Tf32OnF16Walked::kTooLarge, kSmallRow = Tf32OnF16Walked::kSmallRow;
  // Two x values (a word, lo in the low half) as two fp16 values.
  __device__ static uint32_t refit2(uint32_t w) {
    if constexpr (kBf16X) return pack2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
    return w;
  }
  __device__ static uint32_t fold2(uint32_t range, uint32_t w) { return __vmaxu2(range, w & 0x7FFF7FFFu); }
  __device__ static uint32_t largest(uint32_t range) {
    const uint32_t m = max(range & 0xFFFFu, range >> 16);
    if constexpr (kBf16X) return m << 16;
    // fp16 x is exact in the slots: only an infinity or a NaN walks, never a row of tiny values
    return m >= 0x7C00u ? 0x7F800000u : m != 0 ? kSmallRow : 0u;
  }
};

// The fed dW's producer tag for x of type Elem.
template <class Elem>
using FedTag = std::conditional_t<std::is_same_v<Elem, float>, Tf32OnF16Walked, Sixteen2F16Walked<Elem>>;

// dW^T for one input row offset i: D[c][k] = sum over pixels p of x[c, p + (i, j)] * G[p][k], G the one-hot (pixels x
// k) matrix that holds gm at (p, k(p)). mma.sync m16n8k16: A = x^T (16 channels x 16 pixels of one tap, by
// ldmatrix.trans from the slot, whose layout is the forward's), B = G's 16 pixels x 8 columns, built in registers
// from the step's pixel record. B's columns are ranks, not k: the producer lists the k the step's pixels hold, in
// order, and gives each pixel the rank of its k in that list, so that one batch of 8 ranks covers a step that holds
// up to 8 distinct k (torch.rand's argmins put 87-100% of the pixels on one channel and a few stray ones elsewhere)
// and a step whose pixels hold all 64 takes 8. A batch multiplies every chunk of 16 pixels once a tap, with no test
// (a chunk without the batch's ranks has B = 0), even chunks into one set of accumulators and odd ones into another,
// so that a warp has six chains of MMAs and a pair's loads run ahead of its MMAs; the two sets' 24 accumulators a
// thread go into the CTA's sums at the ranks' k after the batch (fixed order: deterministic). B is built once for all
// three taps of a warp.
//
// A CTA is kProducerWarps warps that run the forward's RowProducer over the CTA's steps (each step one output row
// segment of 256 columns, consecutive steps down a column strip, so each input row is loaded once a strip), and
// kConsumerWarps warps that sum: warp i < 3 owns input row offset i (all 16 channels, the three j: 3 taps of m16n8
// accumulators a batch), warp 3 the bias. The rows pass through the forward's RowRing (full and empty mbarriers a
// slot), so no warp waits for another but at a slot. With a step's newest row the producer also stores the step's
// pixel record in the same slot: each pixel's gm * 2^scale rounded to TF32 (cvt.rna) in fp16 (hi) with its k and
// rank, what hi leaves of it times 2^11 in fp16 (lo, for db, which keeps about 22 bits a term as an fp32 sum does),
// the k of each rank, each producer warp's set of k and largest finite |gm|, and the step's scale (GradScale: from
// the step's largest |gm|, so no pass over g comes first; a walked step reads gm's parts from global memory). At
// 78 KB two CTAs fit an SM on every sm_80+ GPU but the 99 KB ones.
// With kBuiltB (where two CTAs fit an SM: 86 KB, 110 KB with float32 x's staging and db's rows; sm_90, sm_100) the
// producer also writes each step's B for ranks 0-7 (one 16-byte row a pixel: its hi at its rank's column, zeros
// elsewhere) into one of two buffers, and a row warp reads a pair of chunks' B fragments with one ldmatrix.trans
// instead of building them from the record; a step with more than 8 ranks builds the later batches' as without.
// db on the tensor cores: A = ones in k columns 0-7 and 2^-11 in 8-15, B = the hi of 8 pixels above their lo, each
// masked to its rank: two accumulators (pixels 0-7 and 8-15 of each chunk), sum of (hi + lo * 2^-11) a rank, two MMAs
// a chunk and batch. For float32 x (kBuiltBLo) the producer writes db's rows too, lo in place of hi, and the bias
// warp reads both rows of a chunk pair by ldmatrix.trans against A = ones: four MMAs and two loads a chunk pair.
// A row warp keeps rank 0's sums in registers from step to step while rank 0's k stays the same.
template <class XElem, bool kBuiltB_>
struct GradWeightFedOf : GradGeometry {
  static constexpr bool kBuiltB = kBuiltB_;
  using Tag = FedTag<XElem>;
  using Geometry = ConvGeometry<Tag, 256, false>;
  static constexpr int kCols = Geometry::kTileCols;
  static constexpr int kProducerWarps = 4, kProducerThreads = 32 * kProducerWarps;
  static constexpr int kRowWarps = kKsize;                   // warp i sums input row offset i
  static constexpr int kConsumerWarps = kRowWarps + 1;       // and one the bias
  static constexpr int kConsumerThreads = 32 * kConsumerWarps;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  static constexpr int kMinBlocks = 2;
  using Producer = RowProducer<Geometry, kProducerThreads>;
  static constexpr int kChunk = 16, kChunks = kCols / kChunk;
  static constexpr int kPixelsPerThread = kCols / kProducerThreads;
  static constexpr int kPartial = GradWeight::kPartial;
  // A slot: the input row in the forward's layout, then the pixel record of the step whose newest row it is, then
  // the row's walk word.
  // uint32 [kCols]: hi | k << 16 | rank << 24 (k and rank 0xFF: no pixel)
  static constexpr int kHkOffset = Geometry::kSlotBytes;
  static constexpr int kLoOffset = kHkOffset + 4 * kCols;       // uint16 [kCols]: lo
  static constexpr int kKOfRankOffset = kLoOffset + 2 * kCols;  // uint8 [kCout]: the k of each rank
  // uint64 a producer warp: the set of k its pixels hold (bit k)
  static constexpr int kHeldOffset = (kKOfRankOffset + kCout + 7) / 8 * 8;
  // uint32 a producer warp: (the row's number from 1) << 3 | its share's bits (kTooLargeBit, kLargeBit, kNonzeroBit)
  static constexpr int kWalkOffset = kHeldOffset + 8 * kProducerWarps;
  // uint32 a producer warp: the largest finite |gm| of its pixels of the step (bits); then the step's operand scale
  // (int, GradScale::operand_scale of the step's largest)
  static constexpr int kLargestOffset = kWalkOffset + 4 * kProducerWarps;
  static constexpr int kScaleOffset = kLargestOffset + 4 * kProducerWarps;
  static constexpr uint32_t kTooLargeBit = 1, kLargeBit = 2, kNonzeroBit = 4;
  static constexpr uint32_t kNoPixel = 0xFFFF0000u;
  static constexpr int kSlotBytes = (kScaleOffset + 4 + 15) / 16 * 16;
  static constexpr int kProducerBarrier = 1;  // named barrier of the producer warps (0 is __syncthreads)
  static constexpr int kSlots = 4;  // the 3-row window and the row being stored
  using Ring = RowRing<kSlots, kSlotBytes, false>;  // read by ldmatrix and plain loads: no proxy fence
  static constexpr int kRingBytes = kSlots * kSlotBytes;
  static constexpr int kSumBytes = kCout * kPartial * 4;
  static constexpr int kPoisonBytes = kPartial * 8;
  // the late items' channel vectors of the row being stored, from the lanes that load them to the threads that store
  // them
  static constexpr int kLateOffset = (kRingBytes + kSumBytes + kPoisonBytes + 15) / 16 * 16;
  static constexpr int kLateBytes = Producer::kLate * Producer::kChannels * 16;
  static constexpr int kBarrierOffset = kLateOffset + kLateBytes;
  // the ring's mbarriers, then (kBuiltB) two steps' B: [kCols pixels][8 ranks] fp16 each. Two
  // are enough: the producer writes step t's B once it holds the slot of step t's newest row, whose previous row (4
  // rows back) every consumer releases only after step t - 2 (kSlots = 4, a step releases its window's oldest row).
  static constexpr int kBBytes = kCols * 16;
  static constexpr int kBOffset = (kBarrierOffset + kSlots * 16 + 127) / 128 * 128;
  // (kBuiltBLo) and two steps' B of db's lo parts, the same rows with each pixel's lo in place of its hi: the bias
  // warp reads both by ldmatrix.trans as the row warps read B.
  static constexpr int kBLoOffset = kBOffset + 2 * kBBytes;
  // kStaged (float32 x, with kBuiltB): the producer copies the next row's body and late vectors (cp.async) into a
  // staging area while it stores the row before, so that a CTA has two rows in flight with one row's registers: its
  // body, [item][channel][thread] (each thread reads back what it copied), then one 16-byte word a lane of warp 0.
  // 16-bit x (half the bytes a row) reads slower staged (docs/perf-notes.md, "Training and the saving forward"): it
  // loads into registers, as without kBuiltB.
  static constexpr bool kStaged = kBuiltB && std::is_same_v<XElem, float>;
  // The bias warp's B built by the producer too (float32 x's, whose consumers set the step: dW + db -7% against B
  // built from the record); 16-bit x's producer, which sets its step, reads 1-2% slower writing those rows.
  static constexpr bool kBuiltBLo = kStaged;
  static constexpr int kStageOffset = kBuiltBLo ? kBLoOffset + 2 * kBBytes : kBLoOffset;
  static constexpr int kLateStageOffset = kStageOffset + Producer::kStageBytes;
  static constexpr int kStageBytes = Producer::kStageBytes + 32 * 16;
  static constexpr int kSmemBytes = kStaged    ? kStageOffset + kStageBytes
                                    : kBuiltB ? kStageOffset
                                              : kBarrierOffset + kSlots * 16;
  static constexpr uint32_t kOnes = 0x3C003C00u;   // two fp16 ones
  static constexpr uint32_t kSmall = 0x10001000u;  // two fp16 2^-11
  static_assert(kCin == 16 && kKsize == 3 && kCout == 64 && Geometry::kGroups == 2, "A: the two channel groups");
  static_assert(kProducerThreads >= kCout, "a producer thread a rank's k (and kCout == 64: a 64-bit set of k)");
  static_assert(kCols % (kProducerThreads * 2) == 0 && kProducerThreads % 32 == 0, "pixels: two chunks a warp an iteration");
  static_assert(kThreads >= kPartial, "a thread an entry for write_partial");
  static_assert(Producer::kLate * Producer::kChannels <= 32, "the late items' vectors: a lane each of warp 0");
  static_assert(kRingBytes % 16 == 0 && kBarrierOffset % 8 == 0, "alignment");
  // Two CTAs an SM where a block may opt in to `smem_optin` bytes: an SM holds smem_optin and 1 KB more (sm_80: 163 +
  // 1 KB; sm_90, sm_100: 227 + 1), 1 KB of it reserved a CTA.
  __host__ __device__ static constexpr bool two_fit(int smem_optin) {
    return 2 * (kSmemBytes + 1024) <= smem_optin + 1024;
  }
  static_assert(two_fit(kBuiltB ? kMaxSmemPerBlock : 163 * 1024),
                "two CTAs an SM: on sm_80 without kBuiltB, on sm_90 and sm_100 with");
  static_assert(kSlots == 4 && kChunks % 2 == 0, "kBuiltB: two B buffers; chunks in pairs");
  static_assert(kChunks * kChunk + kKsize - 1 <= Geometry::kPitchCols, "every tap of every chunk inside the slot");
};
// Threads and step width are the same for every x type; float32 x's shared memory is the most (its staging area),
// so where its kernel fits two CTAs an SM, every x type's does.
template <bool kBuiltB>
using GradWeightFed = GradWeightFedOf<float, kBuiltB>;
static_assert(GradWeightFedOf<__half, true>::kSmemBytes <= GradWeightFed<true>::kSmemBytes &&
                  GradWeightFedOf<__nv_bfloat16, true>::kSmemBytes <= GradWeightFed<true>::kSmemBytes &&
                  GradWeightFedOf<__half, false>::kSmemBytes == GradWeightFed<false>::kSmemBytes &&
                  GradWeightFedOf<__nv_bfloat16, false>::kSmemBytes == GradWeightFed<false>::kSmemBytes,
              "float32 x's kernel needs the most shared memory");

template <class Elem, bool kBuiltB>
__global__ void __launch_bounds__(GradWeightFed<kBuiltB>::kThreads, GradWeightFed<kBuiltB>::kMinBlocks)
    conv3x3_min_tanh2_grad_weight_fed_kernel(const Elem* __restrict__ x, const Elem* __restrict__ g,
                                             const float* __restrict__ pre_min,
                                             const unsigned char* __restrict__ argmin, float* __restrict__ partial,
                                             int H, int W, int64_t total_steps) {
  // With kBuiltB, compiled only where two CTAs fit an SM (sm_90, sm_100; choose_grad_weight_kernel picks it only
  // there).
  if constexpr (kHasFused && (!kBuiltB || GradWeightFed<true>::two_fit(kArchSmemPerBlock))) {
    using G = GradWeightFedOf<Elem, kBuiltB>;
    extern __shared__ __align__(128) unsigned char smem[];
    float* const sums = reinterpret_cast<float*>(smem + G::kRingBytes);  // [k][kPartial]: every step's, as it ends
    uint64_t* const poison = reinterpret_cast<uint64_t*>(smem + G::kRingBytes + G::kSumBytes);  // per entry: k made NaN
    uint64_t* const bars = reinterpret_cast<uint64_t*>(smem + G::kBarrierOffset);
    const typename G::Ring ring{smem, bars};
    const auto walk_words = [](const unsigned char* slot) {
      return reinterpret_cast<uint32_t*>(const_cast<unsigned char*>(slot) + G::kWalkOffset);
    };
    // Whether the row in `slot` walks its windows: its producer warps' bits, ORed (the tag's range_lists).
    const auto row_walks = [&](const unsigned char* slot) {
      uint32_t bits = 0;
#pragma unroll
      for (int w = 0; w < G::kProducerWarps; ++w) bits |= walk_words(slot)[w];
      return (bits & G::kTooLargeBit) || ((bits & G::kNonzeroBit) && !(bits & G::kLargeBit));
    };
    // How many distinct k the pixels of the step whose record `slot` holds have: its ranks.
    const auto step_ranks = [](const unsigned char* slot) {
      const uint64_t* const held_words = reinterpret_cast<const uint64_t*>(slot + G::kHeldOffset);
      uint64_t held = 0;
#pragma unroll
      for (int w = 0; w < G::kProducerWarps; ++w) held |= held_words[w];
      return __popcll(held);
    };
    // The ring zeroed (the walk words among it): the slots' columns past the input rows are read, times B's zeros,
    // by the taps of pixels past the row; they must hold no infinity or NaN.
    for (int i = threadIdx.x; i < G::kRingBytes / 16; i += blockDim.x) reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
    for (int i = threadIdx.x; i < G::kCout * G::kPartial; i += blockDim.x) sums[i] = 0.f;
    for (int i = threadIdx.x; i < G::kPartial; i += blockDim.x) poison[i] = 0;
    if (threadIdx.x == 0) G::Ring::init(bars, G::kProducerThreads, G::kConsumerThreads);
    __syncthreads();
    const int OH = H - (G::kKsize - 1), OW = W - (G::kKsize - 1);
    const int col_blocks = (OW + G::kCols - 1) / G::kCols;
    int64_t begin, end;
    step_range(total_steps, blockIdx.x, gridDim.x, begin, end);
    const int lane = threadIdx.x & 31;

    if (threadIdx.x < G::kProducerThreads) {
      // The producer: each row of the CTA's steps (RowCursor) into its slot by the forward's RowProducer; with a
      // step's newest row, the step's pixel record. A row's loads are all issued before the wait for its slot: its
      // body (in registers), its late items (a channel vector a lane of warp 0, handed to the threads that store
      // them through shared memory, so that no warp waits for a load after the slot wait) and, with a step's newest
      // row, the step's record. With kStaged, a row further ahead: its body and late vectors copied into the staging
      // area and its record loaded while the row before is stored. Loading a row ahead in registers (two rows, with
      // setmaxnreg moving registers from the consumer warpgroup) and a deeper ring (6 slots) both read slower
      // (docs/perf-notes.md, "Training and the saving forward").
      const int ptid = threadIdx.x, warp = ptid >> 5;
      const typename G::Producer producer(x, H, W, ptid);
      // A row to load: where it is, and whether it is a step's newest (it carries the step's record).
      struct Fetch {
        const Elem* x_img;
        int64_t out_row;  // the step's output row, from its pixel 0 (record)
        int y, col0;
        bool valid, record;
      };
      // What a row's loads bring: the body, this lane's late channel vector, this thread's pixels of the step
      // (ptid + kProducerThreads u).
      struct Loaded {
        typename G::Producer::Row row;
        uint4 late;
        float gv[G::kPixelsPerThread], mv[G::kPixelsPerThread];
        int kv[G::kPixelsPerThread];
      };
      const bool late_lane = warp == 0 && lane < G::Producer::kLate * G::Producer::kChannels;
      uint4* const late_stage = reinterpret_cast<uint4*>(smem + G::kLateOffset);
      RowCursor ahead(begin, end, OH, col_blocks);
      uint32_t records = 0;  // steps whose record is stored (kBuiltB: the B buffer is records % 2)
      const auto fetch = [&]() {
        Fetch f{x, 0, 0, 0, ahead.valid(), false};
        if (f.valid) {
          const StepWalker& at = ahead.at;
          f.record = ahead.r + 1 == ahead.count();
          f.x_img = x + at.n * G::kCin * ((int64_t)H * W);
          f.out_row = (at.n * OH + at.oy) * (int64_t)OW + at.cb * G::kCols;
          f.y = ahead.y();
          f.col0 = at.cb * G::kCols;
          ahead.next();
        }
        return f;
      };
      const auto load_record = [&](const Fetch& f, Loaded& in) {
        if (f.record) {
#pragma unroll
          for (int u = 0; u < G::kPixelsPerThread; ++u) {
            const int ox = f.col0 + ptid + G::kProducerThreads * u;
            in.kv[u] = -1;
            in.gv[u] = in.mv[u] = 0.f;
            if (ox < OW) {
              in.gv[u] = convert<float>(g[f.out_row + ptid + G::kProducerThreads * u]);
              in.mv[u] = pre_min[f.out_row + ptid + G::kProducerThreads * u];
              in.kv[u] = argmin[f.out_row + ptid + G::kProducerThreads * u];
            }
          }
        }
      };
      const auto store = [&](const Fetch& f, Loaded& in, uint32_t row_no) {
        const int col0 = f.col0;
        ring.acquire(row_no);
        unsigned char* const slot = ring.slot(row_no);
        uint32_t stored;
        if (producer.vec16) {
          // Chunks past the row's end hold the image's first chunk, re-read (RowProducer::item_source): zeros instead,
          // so that they neither meet B's zeros as an infinity nor count in the row's largest |x|.
#pragma unroll
          for (int k = 0; k < G::Producer::kMine; ++k) {
            int grp, chunk;
            G::Producer::place(ptid + k * G::kProducerThreads, grp, chunk);
            if (col0 + G::Producer::kVec * chunk >= W) {
#pragma unroll
              for (int c = 0; c < G::Producer::kChannels; ++c) in.row.raw[k][c] = make_uint4(0, 0, 0, 0);
            }
          }
          stored = producer.store_body(in.row, slot);
          if (producer.reaches_late(col0)) {
            // The late items' channel vectors, from the lanes that loaded them to the threads that store them.
            if (late_lane) late_stage[lane] = in.late;
            __syncwarp();
            if (ptid < G::Producer::kLate) {
              uint4 raw[G::Producer::kChannels];
#pragma unroll
              for (int c = 0; c < G::Producer::kChannels; ++c) raw[c] = late_stage[ptid * G::Producer::kChannels + c];
              stored = producer.store_late(raw, slot, stored);
            }
            __syncwarp();  // read before the next row's late vectors are staged
          }
        } else {
          stored = producer.copy_folded_by_element(f.x_img, f.y, col0, slot);
        }
        const uint32_t largest = warp_max(G::Tag::largest(stored));
        if (producer.vec16 && !producer.reaches_late(col0) && ptid < G::Producer::kLate) {
          // The row ends within the tile: the late chunk's columns, which pixels past the row read (times B's zeros),
          // zeroed rather than left to an earlier row's infinities.
          unsigned char* const late = slot + ptid * G::Geometry::kGroupBytes +
                                      (G::Producer::kChunks - 1) * G::Producer::kVec * 16;
#pragma unroll
          for (int i = 0; i < G::Producer::kVec; ++i) reinterpret_cast<uint4*>(late)[i] = make_uint4(0, 0, 0, 0);
        }
        if (lane == 0) {
          walk_words(slot)[warp] = (row_no + 1) << 3 | (largest >= G::Tag::kTooLarge ? G::kTooLargeBit : 0u) |
                                   (largest >= G::Tag::kSmallRow ? G::kLargeBit : 0u) |
                                   (largest != 0 ? G::kNonzeroBit : 0u);
        }
        if (f.record) {
          uint32_t* const hk = reinterpret_cast<uint32_t*>(slot + G::kHkOffset);
          uint16_t* const lo = reinterpret_cast<uint16_t*>(slot + G::kLoOffset);
          // The set of k the step's pixels hold and their largest finite |gm|: each warp's, then all of them (the
          // producer warps' barrier).
          uint32_t held_lo = 0, held_hi = 0, largest = 0;
          float gm[G::kPixelsPerThread];
#pragma unroll
          for (int u = 0; u < G::kPixelsPerThread; ++u) {
            const int k = in.kv[u];
            if (k >= 0) (k < 32 ? held_lo : held_hi) |= 1u << (k & 31);
            gm[u] = k >= 0 ? min_grad(in.gv[u], in.mv[u]) : 0.f;
            const uint32_t magnitude = __float_as_uint(gm[u]) & 0x7FFFFFFFu;
            if (magnitude < 0x7F800000u) largest = max(largest, magnitude);
          }
          held_lo = warp_or(held_lo);
          held_hi = warp_or(held_hi);
          largest = warp_max(largest);
          uint64_t* const held_words = reinterpret_cast<uint64_t*>(slot + G::kHeldOffset);
          uint32_t* const largest_words = reinterpret_cast<uint32_t*>(slot + G::kLargestOffset);
          if (lane == 0) {
            held_words[warp] = (uint64_t)held_hi << 32 | held_lo;
            largest_words[warp] = largest;
          }
          named_barrier<G::kProducerThreads>(G::kProducerBarrier);
          uint64_t held = 0;  // the step's set of k: every producer warp's
#pragma unroll
          for (int w = 0; w < G::kProducerWarps; ++w) {
            held |= held_words[w];
            largest = max(largest, largest_words[w]);
          }
          // The step's operand scale: its largest finite |gm| times 2^scale in [2^14, 2^15); the consumers undo it
          // in fp32 as they add the step's sums.
          const int scale = GradScale::operand_scale(largest);
          const float up = GradScale::pow2(scale);
          if (ptid == 0) *reinterpret_cast<int*>(slot + G::kScaleOffset) = scale;
          if (ptid < G::kCout && ((held >> ptid) & 1u)) {
            slot[G::kKOfRankOffset + __popcll(held & ((1ull << ptid) - 1))] = (unsigned char)ptid;
          }
#pragma unroll
          for (int u = 0; u < G::kPixelsPerThread; ++u) {
            const int p = ptid + G::kProducerThreads * u;
            const int k = in.kv[u];
            const float scaled = gm[u] * up;
            uint32_t hi, small;
            GradScale::split_gm(scaled, hi, small);
            const uint32_t rank = k >= 0 ? __popcll(held & ((1ull << k) - 1)) : 0u;
            hk[p] = k >= 0 ? hi | (uint32_t)k << 16 | rank << 24 : G::kNoPixel;
            lo[p] = (uint16_t)(k >= 0 ? small : 0u);
            if constexpr (G::kBuiltB) {
              // B's row of pixel p for ranks 0-7: hi at its rank's column (word rank / 2, half rank % 2); db's row
              // the same with lo
              const bool in_b = k >= 0 && rank < 8;
              const uint32_t shift = 16 * (rank & 1), w = rank >> 1;
              const uint32_t v = in_b ? hi << shift : 0u, v_lo = in_b ? small << shift : 0u;
              const int buffer = (records & 1) * G::kBBytes;
              reinterpret_cast<uint4*>(smem + G::kBOffset + buffer)[p] =
                  make_uint4(w == 0 ? v : 0u, w == 1 ? v : 0u, w == 2 ? v : 0u, w == 3 ? v : 0u);
              if constexpr (G::kBuiltBLo) {
                reinterpret_cast<uint4*>(smem + G::kBLoOffset + buffer)[p] =
                    make_uint4(w == 0 ? v_lo : 0u, w == 1 ? v_lo : 0u, w == 2 ? v_lo : 0u, w == 3 ? v_lo : 0u);
              }
            }
          }
          ++records;
        }
        ring.commit(row_no);
      };
      const auto issue = [&](const Fetch& f, Loaded& in) {
        if (producer.vec16) {
          producer.load(in.row, f.x_img, f.y, f.col0);
          if (late_lane && producer.reaches_late(f.col0))
            in.late = producer.load_late_vector(lane / G::Producer::kChannels, lane % G::Producer::kChannels, f.x_img,
                                                f.y, f.col0);
        }
        load_record(f, in);
      };
      if (G::kStaged && producer.vec16) {
        // The next row's copies are issued once this row is in registers, before this row is stored: they land while
        // the producer stores this row and waits for the next one's slot. Its record's loads go with them, into
        // `next`.
        const uint32_t stage = smem_u32(smem + G::kStageOffset);
        const uint32_t late_at = smem_u32(smem + G::kLateStageOffset) + lane * 16;
        const auto stage_row = [&](const Fetch& f, Loaded& into) {
          producer.stage(stage, f.x_img, f.y, f.col0);
          if (late_lane && producer.reaches_late(f.col0)) {
            cp_async16(late_at, producer.late_vector(lane / G::Producer::kChannels, lane % G::Producer::kChannels,
                                                     f.x_img, f.y, f.col0));
          }
          cp_async_commit();
          load_record(f, into);
        };
        Loaded in, next;
        Fetch f = fetch();
        if (f.valid) stage_row(f, in);
        for (uint32_t row_no = 0; f.valid; ++row_no) {
          const Fetch after = fetch();
          cp_async_wait_all();
          producer.read_staged(in.row, stage);
          if (late_lane && producer.reaches_late(f.col0)) in.late = lds128(late_at);
          if (after.valid) stage_row(after, next);
          store(f, in, row_no);
#pragma unroll
          for (int u = 0; u < G::kPixelsPerThread; ++u) {
            in.gv[u] = next.gv[u];
            in.mv[u] = next.mv[u];
            in.kv[u] = next.kv[u];
          }
          f = after;
        }
      } else {
        Loaded in;
        for (uint32_t row_no = 0;; ++row_no) {
          const Fetch f = fetch();
          if (!f.valid) break;
          issue(f, in);
          store(f, in, row_no);
        }
      }
    } else {
      // The consumers: each step's window (rows oy, oy + 1, oy + 2) and its pixel record (in the newest row's slot).
      const int cw = (threadIdx.x - G::kProducerThreads) >> 5;  // 0..2: input row offset; 3: the bias
      const int gq = lane >> 2, tq = lane & 3;
      // A walked step: this lane's entries, (c, cw, j) for idx = lane and lane + 32 below 48 (c = idx / 3, j = idx % 3),
      // or for the bias warp's lane 0 the bias; the k each one's walk made NaN (the reference's 0 * inf).
      const int walk_entries = cw < G::kRowWarps ? (lane + 32 < G::kCin * G::kKsize ? 2 : 1) : (lane == 0 ? 1 : 0);
      uint64_t poisoned[2] = {0, 0};
      const auto entry_of = [&](int q) {
        const int idx = lane + 32 * q;
        return cw < G::kRowWarps ? (idx / G::kKsize) * G::kTaps + cw * G::kKsize + idx % G::kKsize : (int)G::kEntries;
      };
      // ldmatrix rows of this lane for A: matrix m = lane / 8 (0: channels 0-7, pixels 0-7; 1: channels 8-15,
      // pixels 0-7; 2, 3: pixels 8-15), its row lane % 8 a pixel (a column of the slot), 16 bytes of one group.
      const int a_pixel = (lane & 7) + 8 * (lane >> 4), a_group = (lane >> 3) & 1;
      StepWalker at(begin, OH, col_blocks);
      uint32_t rows = 0;  // rows received so far: the window is rows - 3 .. rows - 1
      uint32_t walks = 0;  // bit i: row rows - 1 - i walks its windows (row_walks, read once a row)
      // A row warp's rank-0 sums (lanes with tq = 0: entries (gq, cw, j) and (gq + 8, cw, j)) stay in registers from
      // step to step while rank 0's k does not change (torch.rand's argmins: nearly always), and go into the CTA's
      // sums when it changes and after the last step, in an order fixed by the data (deterministic).
      float carry[2][G::kKsize] = {};
      int carry_k = -1;
      const auto flush_carry = [&]() {
        if (carry_k < 0) return;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float* const at_k = sums + carry_k * G::kPartial + (gq + 8 * h) * G::kTaps + cw * G::kKsize;
#pragma unroll
          for (int j = 0; j < G::kKsize; ++j) {
            at_k[j] += carry[h][j];
            carry[h][j] = 0.f;
          }
        }
      };
      for (int64_t step = begin; step < end; ++step, at.advance()) {
        const int fresh = RowCursor::new_rows(step == begin || at.oy == 0);
        for (int i = 0; i < fresh; ++i, ++rows) {
          ring.wait(rows);
          walks = walks << 1 | (row_walks(ring.slot(rows)) ? 1u : 0u);
        }
        const unsigned char* const newest = ring.slot(rows - 1);
        const uint32_t* const hk = reinterpret_cast<const uint32_t*>(newest + G::kHkOffset);
        // A batch's sums go into the CTA's, unscaled (the step's operand scale), beside the walked steps' (another
        // lane of this warp walks each entry: a __syncwarp after every step).
        const float down = GradScale::pow2(-*reinterpret_cast<const int*>(newest + G::kScaleOffset));
        const int col0 = at.cb * G::kCols, count = min(G::kCols, OW - col0);
        if (walks & 7u) {  // a row of the window walks
          // Every entry's sum in fp32, pixel by pixel, the inputs and gm from global memory (as the walkers sum).
          const int64_t out_row = (at.n * OH + at.oy) * (int64_t)OW + col0;
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            if (q >= walk_entries) break;
            const int e = entry_of(q);
            const bool is_bias = e == G::kEntries;
            const int c = e / G::kTaps, j = e % G::kKsize;
            const Elem* const xr = is_bias ? x : x + ((at.n * G::kCin + c) * H + at.oy + cw) * (int64_t)W + col0 + j;
#pragma unroll 1
            for (int t = 0; t < count; ++t) {
              const int kk = (int)((hk[t] >> 16) & 0xFFu);
              const float xv = is_bias ? 1.f : convert<float>(xr[t]);
              const float gm = min_grad(convert<float>(g[out_row + t]), pre_min[out_row + t]);
              sums[kk * G::kPartial + e] = fmaf(gm, xv, sums[kk * G::kPartial + e]);
              if (!isfinite(xv)) poisoned[q] |= ~(1ull << kk);
            }
          }
        } else if (cw < G::kRowWarps) {
          const unsigned char* const k_of_rank = newest + G::kKOfRankOffset;
          const int ranks = step_ranks(newest);
          const uint32_t a_base = smem_u32(ring.slot(rows - 3 + cw)) + a_group * G::Geometry::kGroupBytes + a_pixel * 16;
          for (int batch = 0; 8 * batch < ranks; ++batch) {
            // Even chunks into acc[0], odd ones into acc[1]: two independent chains of MMAs a tap (in one chain each
            // MMA waits for the one before).
            float acc[2][G::kKsize][4] = {};
            // Chunk c's three taps times B (b0, b1: this lane's fragment) into `into`.
            const auto multiply = [&](int c, float (&into)[G::kKsize][4], uint32_t b0, uint32_t b1) {
              uint32_t xa[G::kKsize][4];
#pragma unroll
              for (int j = 0; j < G::kKsize; ++j) ldmatrix_x4_trans(xa[j], a_base + (c * G::kChunk + j) * 16);
#pragma unroll
              for (int j = 0; j < G::kKsize; ++j) mma_sync(into[j], xa[j], b0, b1, Operand<__half>{});
            };
            // Chunk c with B built from the record.
            const auto chunk = [&](int c, float (&into)[G::kKsize][4]) {
              // pixels 2t, 2t + 1 and 2t + 8, 2t + 9 of the chunk: B's k rows of this lane
              const uint2 w01 = *reinterpret_cast<const uint2*>(hk + c * G::kChunk + 2 * tq);
              const uint2 w89 = *reinterpret_cast<const uint2*>(hk + c * G::kChunk + 2 * tq + 8);
              const uint32_t target = 8 * batch + gq;  // B's column gq: rank 8 batch + gq
              const uint32_t b0 = __byte_perm(w01.x >> 24 == target ? w01.x : 0u, w01.y >> 24 == target ? w01.y : 0u,
                                              0x5410);
              const uint32_t b1 = __byte_perm(w89.x >> 24 == target ? w89.x : 0u, w89.y >> 24 == target ? w89.y : 0u,
                                              0x5410);
              multiply(c, into, b0, b1);
            };
            // Every chunk in pairs, with no test, so that a pair's loads run ahead of its MMAs: a chunk that holds
            // none of the batch's ranks (or no pixel: past the row's end) has B = 0 and adds nothing; its taps read
            // the slot's columns, which hold no infinity or NaN unless the step walks.
            if (G::kBuiltB && batch == 0) {
              // B from the producer's rows: matrices 0, 1 (pixels 0-7, 8-15 of chunk c) and 2, 3 (chunk c + 1)
              const uint32_t b_base = smem_u32(smem + G::kBOffset + ((step - begin) & 1) * G::kBBytes) + lane * 16;
#pragma unroll 2
              for (int c = 0; c * G::kChunk < count; c += 2) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, b_base + c * G::kChunk * 16);
                multiply(c, acc[0], b[0], b[1]);
                multiply(c + 1, acc[1], b[2], b[3]);
              }
            } else {
#pragma unroll 2
              for (int c = 0; c * G::kChunk < count; c += 2) {
                chunk(c, acc[0]);
                chunk(c + 1, acc[1]);
              }
            }
            // acc[h][j] row c = gq (+ 8), column 2 tq (+ 1): rank 8 batch + column, entry (c, cw, j). Rank 0 (batch
            // 0, tq = 0, even r) into the carry; a carry of another k first into the sums, before the other lanes
            // add theirs (one of which may be that k's).
            const bool carries = batch == 0 && tq == 0;
            if (carries && k_of_rank[0] != carry_k) {
              flush_carry();
              carry_k = k_of_rank[0];
            }
            __syncwarp();
            // The lane's entries in the CTA's sums (each (k, c, j) its own: distinct ranks have distinct k) all read
            // first, then added and stored: no entry's read waits for another's store.
            bool to_sums[4];
            float* at_k[4];
            float held_sum[4][G::kKsize];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int rank = 8 * batch + 2 * tq + (r & 1), c = gq + 8 * (r >> 1);
              to_sums[r] = rank < ranks && !(carries && (r & 1) == 0);
              at_k[r] = sums + (to_sums[r] ? k_of_rank[rank] : 0) * G::kPartial + c * G::kTaps + cw * G::kKsize;
#pragma unroll
              for (int j = 0; j < G::kKsize; ++j) held_sum[r][j] = to_sums[r] ? at_k[r][j] : 0.f;
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              float add[G::kKsize];
#pragma unroll
              for (int j = 0; j < G::kKsize; ++j) add[j] = acc[0][j][r] + acc[1][j][r];
              if (carries && (r & 1) == 0) {  // rank 0 (ranks >= 1)
#pragma unroll
                for (int j = 0; j < G::kKsize; ++j) carry[r >> 1][j] = fmaf(add[j], down, carry[r >> 1][j]);
              } else if (to_sums[r]) {
#pragma unroll
                for (int j = 0; j < G::kKsize; ++j) at_k[r][j] = fmaf(add[j], down, held_sum[r][j]);
              }
            }
          }
        } else {
          // db: k columns 0-7 of A ones and 8-15 2^-11; B's k rows 2t, 2t + 1 the hi of pixels 2t, 2t + 1 (first MMA;
          // 2t + 8, 2t + 9 the second), rows 2t + 8, 2t + 9 their lo, each zero but in its pixel's rank's column.
          const unsigned char* const k_of_rank = newest + G::kKOfRankOffset;
          const int ranks = step_ranks(newest);
          const uint16_t* const lo = reinterpret_cast<const uint16_t*>(newest + G::kLoOffset);
          const uint32_t a[4] = {G::kOnes, G::kOnes, G::kSmall, G::kSmall};
          for (int batch = 0; 8 * batch < ranks; ++batch) {
            // Pixels 0-7 of each chunk into acc[0], 8-15 into acc[1]: two chains of MMAs instead of one.
            float acc[2][4] = {};
            const auto chunk = [&](int c) {
              const uint2 w01 = *reinterpret_cast<const uint2*>(hk + c * G::kChunk + 2 * tq);
              const uint2 w89 = *reinterpret_cast<const uint2*>(hk + c * G::kChunk + 2 * tq + 8);
              const uint32_t l01 = *reinterpret_cast<const uint32_t*>(lo + c * G::kChunk + 2 * tq);
              const uint32_t l89 = *reinterpret_cast<const uint32_t*>(lo + c * G::kChunk + 2 * tq + 8);
              const uint32_t h01 = __byte_perm(w01.x, w01.y, 0x5410), h89 = __byte_perm(w89.x, w89.y, 0x5410);
              const uint32_t target = 8 * batch + gq;
              const uint32_t m01 = (w01.x >> 24 == target ? 0x0000FFFFu : 0u) | (w01.y >> 24 == target ? 0xFFFF0000u : 0u);
              const uint32_t m89 = (w89.x >> 24 == target ? 0x0000FFFFu : 0u) | (w89.y >> 24 == target ? 0xFFFF0000u : 0u);
              mma_sync(acc[0], a, h01 & m01, l01 & m01, Operand<__half>{});
              mma_sync(acc[1], a, h89 & m89, l89 & m89, Operand<__half>{});
            };
            if (G::kBuiltBLo && batch == 0) {
              // B from the producer's rows, hi and lo, a chunk pair by two ldmatrix.trans (as the row warps read B),
              // against A = ones: every row of D is the sum of the 16 pixels' hi (lo) a rank. Four chains: hi and lo
              // of even and odd chunks; lo's sums scaled by 2^-11 after, even chunks into acc[0], odd into acc[1].
              const int buffer = ((step - begin) & 1) * G::kBBytes + lane * 16;
              const uint32_t hi_base = smem_u32(smem + G::kBOffset + buffer);
              const uint32_t lo_base = smem_u32(smem + G::kBLoOffset + buffer);
              const uint32_t ones[4] = {G::kOnes, G::kOnes, G::kOnes, G::kOnes};
              float parts[4][4] = {};
#pragma unroll 2
              for (int c = 0; c * G::kChunk < count; c += 2) {
                uint32_t bh[4], bl[4];
                ldmatrix_x4_trans(bh, hi_base + c * G::kChunk * 16);
                ldmatrix_x4_trans(bl, lo_base + c * G::kChunk * 16);
                mma_sync(parts[0], ones, bh[0], bh[1], Operand<__half>{});
                mma_sync(parts[1], ones, bh[2], bh[3], Operand<__half>{});
                mma_sync(parts[2], ones, bl[0], bl[1], Operand<__half>{});
                mma_sync(parts[3], ones, bl[2], bl[3], Operand<__half>{});
              }
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                acc[0][r] = parts[0][r] + parts[2][r] * 0x1p-11f;
                acc[1][r] = parts[1][r] + parts[3][r] * 0x1p-11f;
              }
            } else {
              // Every chunk, with no test (as the row warps).
#pragma unroll 4
              for (int c = 0; c * G::kChunk < count; ++c) chunk(c);
            }
            // row 0 (lanes 0-3): column 2 tq (+ 1), rank 8 batch + column
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int rank = 8 * batch + 2 * tq + r;
              if (gq != 0 || rank >= ranks) continue;
              float* const at_k = sums + k_of_rank[rank] * G::kPartial + G::kEntries;
              *at_k = fmaf(acc[0][r] + acc[1][r], down, *at_k);
            }
          }
        }
        __syncwarp();  // this step's sums before another lane's next ones
        ring.release(rows - 3);
        if (step + 1 == end || at.oy + 1 == OH) {  // the next step starts a new window
          ring.release(rows - 2);
          ring.release(rows - 1);
        }
      }
      if (cw < G::kRowWarps && tq == 0) flush_carry();
#pragma unroll
      for (int q = 0; q < 2; ++q)
        if (q < walk_entries) poison[entry_of(q)] = poisoned[q];
    }
    __syncthreads();
    write_partial(sums, threadIdx.x < G::kPartial ? poison[threadIdx.x] : 0, threadIdx.x, partial);
  } else {
    __trap();  // compiled for an arch without mma.sync on fp16 or mbarriers, or with kBuiltB where two CTAs do not fit
               // an SM: the launcher never picks it there
  }
}

}  // namespace kb25
