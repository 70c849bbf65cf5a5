// The conv as an implicit GEMM over rows of a slot: K order, slot layout, tile sizes.
#pragma once

#include "precision.cuh"

namespace kb25 {

// Where a step's results go: its output row, and when autograd will need them (kSave), the argmin channel and the
// min before the tanhs of each of its pixels (nullptr otherwise).
template <class Elem>
struct RowOut {
  Elem* out;
  unsigned char* argmin;
  float* pre_min;
};

// K is ordered (tap, channel): k-step ks covers channels (ks % kKStepsPerTap) * kMmaK .. + kMmaK - 1 of tap
// ks / kKStepsPerTap = kh*3 + kw. A consumer is one warpgroup; one step is one output row segment of kTileCols pixels
// x all kCout channels, computed from a ring of input rows (slots) in shared memory. A slot is laid out
// [copy][channel group][column][kGroupChannels channels]: 16 bytes per (group, column), so 8 consecutive columns of
// one group are one 8 x 16-byte core matrix wherever they start. Every tap's operand is then a plain wgmma
// descriptor into the slot, and mma.sync's fragment loads hit 32 distinct banks.
template <class Precision_, int kTileCols_, bool kMmaReadsSlots_>
struct ConvGeometry {
  using Precision = Precision_;
  using Elem = typename Precision::Elem;        // the output; the weights and the bias as the MMAs take them
  using XElem = typename Precision::XElem;      // x: Elem, or float32 that the producer rounds to MmaElem
  // The weights and the bias as the kernel reads them: x's type (Precision::param() makes them Elem)
  using ParamElem = XElem;
  using MmaElem = typename Precision::MmaElem;  // the slots and the tensor cores (fp16 for Tf32OnF16's fp32 x)
  static constexpr int kCin = KB25_FUSED_CIN;
  static constexpr int kCout = KB25_FUSED_COUT;
  static constexpr int kKsize = KB25_FUSED_KSIZE;
  static constexpr int kTaps = kKsize * kKsize;
  static constexpr int kWarpgroup = 128;  // threads of one consumer (and of the producer warpgroup)
  static constexpr int kTileCols = kTileCols_;
  // wgmma: the tensor cores read the slots themselves; mma.sync loads them into registers first.
  static constexpr bool kMmaReadsSlots = kMmaReadsSlots_;
  // Three products with the split on the way into shared memory: two operand copies (big, small) per slot. Where
  // the MMA reads the slots (wgmma), and where the slots narrow x (fp16 parts); mma.sync's 3xTF32 keeps raw fp32 in
  // the slot and splits each fragment in registers.
  static constexpr int kCopies =
      kMmaReadsSlots || sizeof(MmaElem) < sizeof(XElem) ? Precision::Multiply::kCopies : 1;
  static constexpr bool kSplitInSlot = kCopies == 2;
  static constexpr int kInCols = kTileCols + kKsize - 1;  // input columns one step reads
  static constexpr int kMmaK = Precision::kMmaK;
  static constexpr int kKStepsPerTap = kCin / kMmaK;
  static constexpr int kKSteps = kTaps * kKStepsPerTap;
  static constexpr int kGroupChannels = 16 / (int)sizeof(MmaElem);
  static constexpr int kGroups = kCin / kGroupChannels;
  // Columns per group in a slot: a row segment, and for 16-bit an offset of 4 columns modulo 8 between the two
  // groups (the producer's stores rely on it).
  static constexpr int kPitchCols = kTileCols + (sizeof(MmaElem) == 2 ? 12 : kTileCols <= 64 ? 4 : 8);
  static constexpr int kGroupBytes = kPitchCols * 16;
  static constexpr int kCopyBytes = kGroups * kGroupBytes;
  static constexpr int kSlotBytes = kCopies * kCopyBytes;
  static_assert(kCin % kMmaK == 0 && kMmaK == 2 * kGroupChannels, "a k-step is two core matrices along K");
  static_assert(kPitchCols >= kInCols, "a slot holds a whole input row segment");
  __host__ __device__ static int col_blocks(int OW) { return (OW + kTileCols - 1) / kTileCols; }
};

}  // namespace kb25
