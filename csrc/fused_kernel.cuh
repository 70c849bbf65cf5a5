// The fused kernel: conv on tensor cores, bias, min over channels, tanh, tanh, in one pass.
#pragma once

#include "traits.cuh"

namespace kb25 {

// The images a kernel computes, and a guarded kernel's list (Tf32OnF16, Fp32OnF16x3). guard: [0] how many images are listed, [1, 1 + N) their
// indices, [1 + N, 1 + 2N) a flag per image (the launcher zeroes [0] and the flags). A carrier (kGuardsRange) lists
// the image of every row it stores with an input that its fp16 operands do not carry, each image once, or every image
// where the weights or the bias do not; its guard launched after it (kRecomputesListed<Traits>) computes just the listed
// images, the i-th step range's image being listed[i]: the same kernel, on a batch of the listed images. Without a
// guard every image is computed, n being itself.
struct Images {
  const int* listed;  // kRecomputesListed with a guard: the images to compute; else nullptr
  int* guard;         // kGuardsRange: where to list the images it cannot compute; else nullptr
  int count;          // N
  __device__ int64_t operator()(int64_t n) const { return listed != nullptr ? listed[n] : n; }
  __device__ void list(int64_t n) const {
    if (atomicExch(guard + 1 + count + n, 1) == 0) guard[1 + atomicAdd(guard, 1)] = (int)n;
  }
};

// A producer thread's walk over one consumer's rows: row d's loads are issued before the wait for its slot, so they
// land while the consumer frees it. Where the producer's threads write the consumer's steps (HandedWrites), the
// writer does so at each step's first row, before the slot wait (aligned rows: while the row's loads are in flight).
template <class Traits, bool kVec16, class Writer>
__device__ __forceinline__ void produce_rows(const typename Traits::Producer& producer, RowCursor ahead,
                                             const typename Traits::XElem* __restrict__ x, int H, int W,
                                             const typename Traits::Ring& ring, Writer& writer, const Images& images) {
  typename Traits::Producer::Row row;
  for (uint32_t d = 0; ahead.valid(); ++d) {
    const int64_t n = images(ahead.at.n);
    const typename Traits::XElem* const x_img = x + n * Traits::kCin * ((int64_t)H * W);
    const int y = ahead.y(), col0 = ahead.at.cb * Traits::kTileCols;
    const bool step_starts = ahead.r == 0;
    ahead.next();
    if constexpr (kVec16) producer.load(row, x_img, y, col0);
    if (step_starts) writer.step();
    ring.acquire(d);
    const bool out_of_range = kVec16 ? producer.store(row, ring.slot(d), x_img, y, col0)
                                     : producer.copy_by_element(x_img, y, col0, ring.slot(d));
    if (out_of_range) images.list(n);
    ring.commit(d);
  }
  writer.drain();
}

// Where the consumer writes its own steps (Epilogue::kHandsOff false): nothing for the producer to write.
struct NoWrites {
  __device__ void step() {}
  __device__ void drain() {}
};

// Epilogue::kHandsOff: a producer thread also writes its consumer's steps, in order, kLag steps behind the rows it
// stores (step j at step j + kLag's first row, while that row's loads are in flight), and the last kLag after its
// last row. It waits for the consumer to have staged step j; the consumer stages step j + kStages into the same
// buffer only after it has received step j + kLag's rows (kLag <= kStages), which the producer stores after writing
// step j, so the consumer's wait for the buffer never waits (it states the order the ring already gives). kLag 1
// starves the consumer: the producer stores step k's row only once the consumer has staged step k - 1 (+7%); 2 ran
// 0.7-0.8% faster than 3, a 5th buffer with lag 4 (and one ring slot fewer to fit it) 3.6% slower than 3
// (docs/perf-notes.md, "Epilogue and the handed write"). kLag 0 would deadlock: step k's row would wait for step k
// to be staged.
template <class Traits, bool kSave>
struct HandedWrites {
  using Elem = typename Traits::Elem;
  using Epilogue = typename Traits::template EpilogueFor<kSave>;
  static constexpr uint32_t kLag = 2;
  static_assert(kLag >= 1 && kLag <= Epilogue::kStages,
                "a row stored before its step is waited for, a buffer written before it is staged into again");
  Epilogue epilogue;
  StepWalker at;  // the next step to write
  uint32_t seen = 0;
  const uint32_t steps;
  Elem* const out;
  unsigned char* const argmin;  // kSave: the saved argmin and pre-tanh min
  float* const pre_min;
  const int OH, OW, ptid;
  const Images images;
  __device__ HandedWrites(unsigned char* consumer_smem, uint64_t* stage_bars, int c, int ptid_, int64_t begin,
                          int64_t end, Elem* out_, unsigned char* argmin_, float* pre_min_, int OH_, int OW_,
                          int col_blocks, const Images& images_)
      : epilogue(consumer_smem + Traits::kRingBytes, c, ptid_, stage_bars), at(begin, OH_, col_blocks),
        steps((uint32_t)(end - begin)), out(out_), argmin(argmin_), pre_min(pre_min_), OH(OH_), OW(OW_), ptid(ptid_),
        images(images_) {}
  __device__ void write() {
    const int64_t row = (images(at.n) * OH + at.oy) * (int64_t)OW;
    const RowOut<Elem> dst{out + row, kSave ? argmin + row : nullptr, kSave ? pre_min + row : nullptr};
    epilogue.template write_handed<Traits::kProducerThreads>(dst, at.cb * Traits::kTileCols, OW, ptid);
    at.advance();
  }
  __device__ void step() {
    if (seen++ >= kLag) write();
  }
  __device__ void drain() {
    while (epilogue.staged < steps) write();
  }
};

// The rows of a self-fed consumer (Traits::kSelfFed): window() loads (at a strip's start) and names the step's three
// slots, release_oldest() runs once the MMAs have read the window's oldest row, end_step() once they have read all of
// it. The consumer warpgroup loads its own rows into the window's three slots, no mbarriers. At a strip's start it
// fills all three; then each step, once every warp has read the window's oldest
// row (the named barrier in release_oldest, which also publishes the row stored one step before), it stores the
// next step's new row, loaded into registers a step ahead, into that slot, and issues the loads of the row after it.
// Aligned rows (kVec16) take no branch there, so ptxas can interleave the stores with the MMAs that follow: where no
// step of this strip follows, the row goes to a slot that the next window refills, and loads past the image's last
// row read that row instead. 3xTF32 keeps a branch there: without it, ptxas for sm_100 spills.
template <class Traits, bool kVec16>
struct SelfFeed {
  using Elem = typename Traits::XElem;  // x's element type
  static constexpr int kK = Traits::kKsize;
  static constexpr bool kBranch = Traits::Precision::Multiply::kCopies == 2;
  const typename Traits::Producer& producer;
  const Elem* const x;
  const int H, W, barrier_id;
  unsigned char* const slots;
  const Images images;
  const Elem* x_img;
  uint32_t rows;  // rows stored so far: the window is rows - 3 .. rows - 1
  typename Traits::Producer::Row next;  // kVec16: the next step's new row, in flight
  __device__ SelfFeed(const typename Traits::Producer& producer_, const Elem* x_, int H_, int W_, int consumer,
                      unsigned char* slots_, const Images& images_)
      : producer(producer_), x(x_), H(H_), W(W_), barrier_id(1 + consumer), slots(slots_), images(images_), x_img(x_),
        rows(0) {}
  // A row of step `at`'s image stored with an input out of the slots' range lists that image (Images::list).
  __device__ void stored(bool out_of_range, const StepWalker& at) const {
    if (out_of_range) images.list(images(at.n));
  }
  __device__ unsigned char* slot(uint32_t d) const { return slots + (d % kK) * Traits::kSlotBytes; }
  __device__ void window(const StepWalker& at, int col0, bool strip_starts, unsigned char* (&w)[3]) {
    x_img = x + images(at.n) * Traits::kCin * ((int64_t)H * W);
    if (strip_starts) {  // a new window: every warp is done with the old one, then all three rows
      named_barrier<Traits::kWarpgroup>(barrier_id);
      for (int i = 0; i < kK; ++i, ++rows) {
        if constexpr (kVec16) {
          producer.load(next, x_img, at.oy + i, col0);
          stored(producer.store(next, slot(rows), x_img, at.oy + i, col0), at);
        } else {
          stored(producer.copy_by_element(x_img, at.oy + i, col0, slot(rows)), at);
        }
      }
      named_barrier<Traits::kWarpgroup>(barrier_id);
      if constexpr (kVec16) producer.load(next, x_img, min(at.oy + kK, H - 1), col0);
    }
    for (int i = 0; i < 3; ++i) w[i] = slot(rows - 3 + i);
  }
  __device__ void release_oldest(const StepWalker& at, int col0, bool strip_ends) {
    named_barrier<Traits::kWarpgroup>(barrier_id);
    if constexpr (kVec16) {
      if (kBranch && strip_ends) return;
      stored(producer.store(next, slot(rows), x_img, min(at.oy + kK, H - 1), col0), at);
      producer.load(next, x_img, min(at.oy + kK + 1, H - 1), col0);
    } else if (!strip_ends) {  // the next step goes on down this strip: it needs row oy + 3
      stored(producer.copy_by_element(x_img, at.oy + kK, col0, slot(rows)), at);
    }
  }
  __device__ void end_step(bool strip_ends) { rows += !strip_ends; }
};

// A self-fed consumer's walk over its steps [begin, end): take the step's window from the feed, issue the MMAs over
// it, write the previous step while the tail of the tensor pipe's queue drains, let the feed refill the oldest slot
// once the MMAs have read it, and reduce the step. The producer-fed consumers (in the kernel) walk their steps the
// same way with their ring; their loop stays written out there: expressed through this function, with the ring as a
// feed, ptxas scheduled sm90_tf32x3 differently and it ran 7% slower (1.098 against 1.023 ms; docs/perf-notes.md,
// "3xTF32").
template <class Traits, bool kSave, class Feed>
__device__ __forceinline__ void consume_steps(Feed& feed, int c, int ctid, int64_t begin, int64_t end,
                                              const typename Traits::ParamElem* __restrict__ b,
                                              typename Traits::Elem* __restrict__ out, unsigned char* __restrict__ argmin,
                                              float* __restrict__ pre_min, int OH, int OW, int col_blocks,
                                              unsigned char* consumer_smem, unsigned char* shared,
                                              const Images& images) {
  using Elem = typename Traits::Elem;
  typename Traits::Mainloop mainloop(shared, b, ctid);
  using Epilogue = typename Traits::template EpilogueFor<kSave>;
  Epilogue epilogue(consumer_smem + Traits::kRingBytes, c, ctid);
  epilogue.out_scale = Traits::Precision::scale_of(Traits::Mainloop::scratch(shared), -1);
  StepWalker at(begin, OH, col_blocks);
  // The previous step, reduced but not yet written.
  typename Epilogue::Partial pending;
  int64_t pending_row = 0;  // the output row's first pixel (the pointers are rebuilt from it: fewer registers)
  int pending_col0 = 0;
  const auto row_out = [&](int64_t row) {
    return RowOut<Elem>{out + row, kSave ? argmin + row : nullptr, kSave ? pre_min + row : nullptr};
  };
  const int steps = (int)(end - begin);  // a consumer's range is a few hundred steps
  for (int i = 0; i < steps; ++i, at.advance()) {
    const int col0 = at.cb * Traits::kTileCols;
    const bool strip_ends = i + 1 == steps || at.oy + 1 == OH;
    unsigned char* window[3];
    feed.window(at, col0, i == 0 || at.oy == 0, window);
    typename Traits::Mainloop::Accum acc;
    // The MMAs have read the window's oldest row (no later step uses it): the mainloop calls this once per step, as
    // soon as it may.
    const auto release_oldest = [&] { feed.release_oldest(at, col0, strip_ends); };
    mainloop.start(acc, window, col0, OW, release_oldest, [] {});  // the feed has stored the whole window
    if (i != 0) epilogue.write(pending, row_out(pending_row), pending_col0, OW);
    mainloop.finish(acc, release_oldest);
    feed.end_step(strip_ends);
    pending = epilogue.reduce(acc);
    pending_row = (images(at.n) * OH + at.oy) * (int64_t)OW;
    pending_col0 = col0;
  }
  if (steps > 0) epilogue.write(pending, row_out(pending_row), pending_col0, OW);
}

// Persistent, one CTA per SM. Where the CTA has producer warps, they walk each consumer's rows (RowCursor,
// produce_rows()): load row d into registers, wait until the consumer has released the slot's previous row, store it
// there (handed write schedule: and write the consumer's steps, HandedWrites). Each consumer walks its steps: wait for
// the step's new rows, issue the MMAs over the 3-row window (wgmma TF32 and 16-bit: those over the two older rows
// before waiting for the newest), write the previous step while they run (handed: no write, its producer threads do
// it), release the rows no later step needs once the MMAs have read them, and reduce the step. Without
// producer warps each consumer loads its own rows (SelfFeed, consume_steps()).
template <class Traits, bool kSave>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    conv3x3_min_tanh2_kernel(const typename Traits::XElem* __restrict__ x,
                             const typename Traits::ParamElem* __restrict__ w,
                             const typename Traits::ParamElem* __restrict__ b, typename Traits::Elem* __restrict__ out,
                             unsigned char* __restrict__ argmin, float* __restrict__ pre_min, int H, int W,
                             int64_t total_steps, int* __restrict__ guard) {
  if constexpr (kHasFused && (!Traits::kUsesWgmma || kHasWgmma) && Traits::kSmemBytes <= kArchSmemPerBlock) {
    using Elem = typename Traits::Elem;
    using Ring = typename Traits::Ring;
    using Precision = typename Traits::Precision;
    // A guard kernel with a guard computes the listed images only (Images), and returns at once where none is.
    if constexpr (kRecomputesListed<Traits>) {
      if (guard != nullptr) {
        const int listed = guard[0];
        if (listed == 0) return;
        total_steps = listed * ((int64_t)(H - (Traits::kKsize - 1)) * Traits::col_blocks(W - (Traits::kKsize - 1)));
      }
    }
    extern __shared__ __align__(128) unsigned char smem[];
    // Traits::SharedStorage's members, by their offsets.
    unsigned char* const shared = smem + Traits::kSharedOffset;
    uint64_t* const barriers = reinterpret_cast<uint64_t*>(smem + Traits::kBarrierOffset);
    auto ring = [&](int c) { return Ring{smem + c * Traits::kConsumerBytes, barriers + c * Traits::kRing * 2}; };
    uint64_t* const stage_bars = reinterpret_cast<uint64_t*>(smem + Traits::kStageBarrierOffset);
    constexpr int kStagePairs = Traits::Epilogue::kHandOffStages;
    if (!Traits::kSelfFed && threadIdx.x == 0) {
      for (int c = 0; c < Traits::kConsumers; ++c) Ring::init(ring(c).bars, Traits::kProducerThreads, Traits::kWarpgroup);
      for (int i = 0; i < Traits::kConsumers * kStagePairs; ++i) {
        mbarrier_init(stage_bars + 2 * i, Traits::kWarpgroup);
        mbarrier_init(stage_bars + 2 * i + 1, Traits::kProducerThreads);
      }
    }
    Traits::Mainloop::template stage_shared<Traits::kThreads>(shared, w, b);
    __syncthreads();

    const int OH = H - (Traits::kKsize - 1), OW = W - (Traits::kKsize - 1);
    const Images images{kRecomputesListed<Traits> && guard != nullptr ? guard + 1 : nullptr,
                        Precision::kGuardsRange ? guard : nullptr,
                        Precision::kGuardsRange ? (int)(total_steps / ((int64_t)OH * Traits::col_blocks(OW))) : 0};
    if constexpr (Precision::kGuardsRange) {
      if (Traits::Mainloop::scratch(shared)[1] != 0) {  // the weights or the bias do not carry: list every image
        if (blockIdx.x == 0) {
          for (int i = threadIdx.x; i < images.count; i += blockDim.x) guard[1 + i] = i;
          if (threadIdx.x == 0) guard[0] = images.count;
        }
        return;
      }
    }
    // Consumer c of this CTA takes steps [begin, end) of the grid's kConsumers * gridDim.x ranges.
    const auto consumer_range = [&](int c, int64_t& begin, int64_t& end) {
      step_range(total_steps, (int64_t)blockIdx.x * Traits::kConsumers + c, (int64_t)gridDim.x * Traits::kConsumers,
                 begin, end);
    };
    const int col_blocks = Traits::col_blocks(OW);
    if constexpr (Traits::kSelfFed) {
      const int c = threadIdx.x / Traits::kWarpgroup, ctid = threadIdx.x % Traits::kWarpgroup;
      int64_t begin, end;
      consumer_range(c, begin, end);
      const typename Traits::Producer producer(x, H, W, ctid);
      const auto consume = [&](auto& feed) {
        consume_steps<Traits, kSave>(feed, c, ctid, begin, end, b, out, argmin, pre_min, OH, OW, col_blocks,
                                     smem + c * Traits::kConsumerBytes, shared, images);
      };
      if (producer.vec16) {
        SelfFeed<Traits, true> feed(producer, x, H, W, c, smem + c * Traits::kConsumerBytes, images);
        consume(feed);
      } else {
        SelfFeed<Traits, false> feed(producer, x, H, W, c, smem + c * Traits::kConsumerBytes, images);
        consume(feed);
      }
    } else if (threadIdx.x < Traits::kProducers) {
      const int c = threadIdx.x / Traits::kProducerThreads;
      int64_t begin, end;
      consumer_range(c, begin, end);
      const int ptid = threadIdx.x % Traits::kProducerThreads;
      const typename Traits::Producer producer(x, H, W, ptid);
      const RowCursor rows(begin, end, OH, col_blocks);
      const auto produce = [&](auto& writer) {
        if (producer.vec16) {
          produce_rows<Traits, true>(producer, rows, x, H, W, ring(c), writer, images);
        } else {
          produce_rows<Traits, false>(producer, rows, x, H, W, ring(c), writer, images);
        }
      };
      if constexpr (Traits::template EpilogueFor<kSave>::kHandsOff) {
        HandedWrites<Traits, kSave> writer(smem + c * Traits::kConsumerBytes, stage_bars + 2 * kStagePairs * c, c,
                                           ptid, begin, end, out, argmin, pre_min, OH, OW, col_blocks, images);
        writer.epilogue.out_scale = Precision::scale_of(Traits::Mainloop::scratch(shared), -1);
        produce(writer);
      } else {
        NoWrites writer;
        produce(writer);
      }
    } else {
      // The handed-write inference kernels' step loop differs in two ways (docs/perf-notes.md, "Epilogue and the handed
      // write"): the thread index goes through an empty asm, so that the compiler cannot re-read %tid.x (SR_TID.X) at
      // each step's top, where the read's latency sat between the reduce and the next step's first MMA (the inline
      // TF32 and 3xTF32 kernels were slower with it); and a strip's end releases by predicated arrivals rather than a
      // branch around them. Their saving variants keep the plain loop (their epilogue is another one, and not timed
      // with it).
      constexpr bool kHandedLoop = Traits::Schedule::kHanded && !kSave;
      unsigned tid = threadIdx.x;
      if constexpr (kHandedLoop) asm volatile("" : "+r"(tid));
      const int c = (tid - Traits::kProducers) / Traits::kWarpgroup;
      const int ctid = (tid - Traits::kProducers) % Traits::kWarpgroup;
      int64_t begin, end;
      consumer_range(c, begin, end);
      const Ring rows_in = ring(c);
      typename Traits::Mainloop mainloop(shared, b, ctid);
      using Epilogue = typename Traits::template EpilogueFor<kSave>;
      Epilogue epilogue(rows_in.slots + Traits::kRingBytes, c, ctid, stage_bars + 2 * kStagePairs * c);
      epilogue.out_scale = Precision::scale_of(Traits::Mainloop::scratch(shared), -1);
      StepWalker at(begin, OH, col_blocks);
      uint32_t rows = 0;  // rows received so far: the window is rows - 3 .. rows - 1
      // The previous step, reduced but not yet written: its write runs while this step's MMAs are in flight (wgmma),
      // so the tensor cores do not idle through the epilogue (handed: the producer's threads write it). No
      // MMA stays in flight across the loop's back edge.
      typename Epilogue::Partial pending;
      int64_t pending_row = 0;  // the output row's first pixel (the pointers are rebuilt from it: fewer registers)
      int pending_col0 = 0;
      const auto row_out = [&](int64_t row) {
        return RowOut<Elem>{out + row, kSave ? argmin + row : nullptr, kSave ? pre_min + row : nullptr};
      };
      for (int64_t s = begin; s < end; ++s, at.advance()) {
        // The step's new rows; with kWaitsForNewest the newest is waited for inside start(), where its MMAs begin.
        const int fresh = RowCursor::new_rows(s == begin || at.oy == 0);
        const int now = Traits::Mainloop::kWaitsForNewest ? fresh - 1 : fresh;
        for (int i = 0; i < now; ++i, ++rows) rows_in.wait(rows);
        rows += fresh - now;
        const uint32_t newest = rows - 1;
        const bool strip_ends = s + 1 == end || at.oy + 1 == OH;
        typename Traits::Mainloop::Accum acc;
        unsigned char* const window[3] = {rows_in.slot(rows - 3), rows_in.slot(rows - 2), rows_in.slot(rows - 1)};
        const int col0 = at.cb * Traits::kTileCols;
        // The MMAs have read the window's oldest row (no later step uses it): free its slot. The mainloop calls this
        // once per step, as soon as it may.
        const auto release_oldest = [&] { rows_in.release(rows - 3); };
        if constexpr (Epilogue::kPixelRows) {
          mainloop.template start<true>(acc, window, col0, OW, release_oldest, [&] { rows_in.wait(newest); });
        } else {
          mainloop.start(acc, window, col0, OW, release_oldest, [&] { rows_in.wait(newest); });
        }
        if (s != begin) epilogue.write(pending, row_out(pending_row), pending_col0, OW);
        mainloop.finish(acc, release_oldest);
        // At a strip's end the next step starts a new window: free the other two rows as well (handed inference: by
        // predicated arrivals rather than a branch around them).
        if constexpr (kHandedLoop) {
          rows_in.release_if(strip_ends, rows - 2);
          rows_in.release_if(strip_ends, rows - 1);
        } else if (strip_ends) {
          rows_in.release(rows - 2);
          rows_in.release(rows - 1);
        }
        pending = epilogue.reduce(acc);
        pending_row = (images(at.n) * OH + at.oy) * (int64_t)OW;
        pending_col0 = col0;
      }
      if (begin < end) epilogue.write(pending, row_out(pending_row), pending_col0, OW);
    }
  } else {
    // Compiled out for this arch (no such MMA, or more shared memory than it gives a block): the chooser never picks
    // it here; were it launched all the same, fail loudly rather than leave the output unwritten.
    __trap();
  }
}

}  // namespace kb25
