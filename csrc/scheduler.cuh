// Which steps (output row segments) each consumer computes, and in which order its input rows arrive.
#pragma once

#include "device.cuh"

namespace kb25 {

// Step s = (n * col_blocks + cb) * OH + oy, the output row fastest: consecutive steps slide a 3-row input window
// down one column block of one image. Each consumer walks a contiguous range of steps; it divides once, then counts.
struct StepWalker {
  int oy, cb;
  int64_t n;
  const int OH, col_blocks;
  __device__ StepWalker(int64_t s, int OH_, int col_blocks_) : OH(OH_), col_blocks(col_blocks_) {
    oy = (int)(s % OH);
    cb = (int)((s / OH) % col_blocks);
    n = s / OH / col_blocks;
  }
  __device__ void advance() {
    if (++oy == OH) {
      oy = 0;
      if (++cb == col_blocks) {
        cb = 0;
        ++n;
      }
    }
  }
};

// Consumer `worker` of `workers` (kConsumers per CTA) takes steps [begin, end).
__device__ __forceinline__ void step_range(int64_t total, int64_t worker, int64_t workers, int64_t& begin,
                                           int64_t& end) {
  begin = total * worker / workers;
  end = total * (worker + 1) / workers;
}

// The input rows a consumer's steps bring in, in the order it uses them: the 3-row window at the first step of its
// range and of every strip (oy == 0), then one row (oy + 2) per step. The producer walks it; the consumer counts it.
struct RowCursor {
  StepWalker at;
  int64_t left;  // steps left, this one included
  bool first;    // the range's first step
  int r;
  __device__ RowCursor(int64_t begin, int64_t end, int OH, int col_blocks)
      : at(begin, OH, col_blocks), left(end - begin), first(true), r(0) {}
  __device__ static int new_rows(bool first_of_strip) { return first_of_strip ? KB25_FUSED_KSIZE : 1; }
  __device__ int count() const { return new_rows(first || at.oy == 0); }
  __device__ bool valid() const { return left > 0; }
  __device__ int y() const { return at.oy + KB25_FUSED_KSIZE - count() + r; }
  __device__ void next() {
    if (++r == count()) {
      r = 0;
      --left;
      first = false;
      at.advance();
    }
  }
};

// How a consumer's steps reach memory (FUSED_TABLE's write and write_buffers columns). kInline: the consumer writes
// each step itself, while the next step's MMAs run. kHanded (wgmma): its inference variant stages each step's minima
// (16-bit: packed two to a word; TF32 on fp16 operands: the butterfly's fp32 minima of the 4 warps), its saving
// variant each pixel's min and argmin, into one of kBuffers buffers, and its producer threads write them
// (HandedWrites).
enum class WriteSchedule { kInline, kHanded };
template <WriteSchedule kWrite, int kBuffers_>
struct Schedule {
  static constexpr bool kHanded = kWrite == WriteSchedule::kHanded;
  static constexpr int kBuffers = kBuffers_;
};

}  // namespace kb25
