// FusedTraits: one fused kernel's configuration (MMA, precision, tile, roles, ring), its shared-memory
// layout and budgets, and the instantiations of the table.
#pragma once

#include <cstddef>

#include "epilogue_mma_sync.cuh"
#include "epilogue_wgmma.cuh"
#include "producer.cuh"
#include "ring.cuh"
#include "scheduler.cuh"

namespace kb25 {

enum class MmaKind { kMmaSync, kWgmma };

// A CTA (one per SM) is kProducerWarps producer warps and kConsumers consumer warpgroups. Each consumer has its own
// range of steps and its own ring of kRing input-row slots with a full and an empty mbarrier each; the producer's
// warps are split evenly between the consumers. With no producer warps (mma.sync), each consumer loads its own rows
// into its 3 slots (SelfFeed): that leaves the register file to two consumer warps per scheduler.
template <MmaKind kMma, class Precision, int kTileCols, int kConsumers_, int kProducerWarps, int kRing_, class Schedule_>
struct FusedTraits : ConvGeometry<Precision, kTileCols, kMma == MmaKind::kWgmma> {
  using Geometry = ConvGeometry<Precision, kTileCols, kMma == MmaKind::kWgmma>;
  static constexpr bool kUsesWgmma = kMma == MmaKind::kWgmma;
  using Mainloop = std::conditional_t<kUsesWgmma, WgmmaMainloop<Geometry>, MmaSyncMainloop<Geometry>>;
  // kSave: the variant that also writes each pixel's argmin channel and pre-tanh min (autograd will need them).
  // Both variants share one shared-memory layout.
  template <bool kSave>
  using EpilogueFor = std::conditional_t<kUsesWgmma, WgmmaEpilogue<Mainloop, kSave, Schedule_>,
                                         MmaSyncEpilogue<Mainloop, kSave, Schedule_>>;
  using Schedule = Schedule_;
  using Epilogue = EpilogueFor<false>;
  static_assert(EpilogueFor<true>::kSmemBytes == Epilogue::kSmemBytes, "one layout for both variants");
  using Ring = RowRing<kRing_, Geometry::kSlotBytes>;
  static constexpr int kConsumers = kConsumers_;
  static constexpr int kProducers = kProducerWarps * 32;  // threads; the consumers' warpgroups follow them
  static constexpr int kThreads = kProducers + kConsumers * Geometry::kWarpgroup;
  // No producer warps: each consumer warpgroup loads its own rows (mma.sync only: it reads its operands into
  // registers, so the slot of the window's oldest row is free once the step's first kernel row has been read).
  static constexpr bool kSelfFed = kProducerWarps == 0;
  static constexpr int kProducerThreads = kSelfFed ? Geometry::kWarpgroup : kProducers / kConsumers;  // per consumer
  static_assert(!kSelfFed || (!kUsesWgmma && kRing_ == Geometry::kKsize), "self-fed: mma.sync, the window's slots only");
  static_assert(kProducerWarps % kConsumers == 0, "the producer's warps split evenly between the consumers");
  static_assert(!kUsesWgmma || kProducers % Geometry::kWarpgroup == 0, "wgmma warpgroups start at a multiple of 4 warps");
  using Producer = RowProducer<Geometry, kProducerThreads>;
  // The 3-row window, the row being stored, and slots to spare: each spare lets the producer store a row one step
  // earlier, once the consumer has released that slot's previous row. A mainloop that releases the window's oldest
  // row as soon as its MMAs have read it (Mainloop::kReleasesOldestEarly) lets the producer store into that slot
  // while the step's other MMAs run: 3 slots are enough.
  static constexpr int kRing = kRing_;
  static_assert(kRing >= Geometry::kKsize + (Mainloop::kReleasesOldestEarly ? 0 : 1), "the window and the row being stored");
  // A CTA's shared memory: per consumer its ring of input-row slots and its epilogue's buffers (both variants of a
  // kernel share one layout); then what the consumers share (the mainloop's weights); then the ring's mbarriers; then,
  // where the producer's threads write the consumer's steps (Schedule::kHanded), a (full, empty) mbarrier pair per
  // staged buffer. What a kernel does not use is a zero-length array (a GNU extension nvcc and clang accept), so
  // every member sits where the kernels were tuned.
  struct alignas(16) ConsumerStorage {
    unsigned char ring[kRing][Geometry::kSlotBytes];
    unsigned char epilogue[Epilogue::kSmemBytes];
  };
  struct SharedStorage {
    ConsumerStorage consumers[kConsumers];
    alignas(16) unsigned char mainloop[Mainloop::kSmemBytes];
    alignas(8) uint64_t ring_barriers[kConsumers][kRing][2];                   // (full, empty) per slot
    uint64_t stage_barriers[kConsumers][Epilogue::kHandOffStages][2];          // (full, empty) per staged buffer
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(sizeof(ConsumerStorage) == kRing * Geometry::kSlotBytes + Epilogue::kSmemBytes, "no padding");
  // The kernel addresses the members by these byte offsets from the dynamic shared memory's start.
  static constexpr int kRingBytes = offsetof(ConsumerStorage, epilogue);
  static constexpr int kConsumerBytes = sizeof(ConsumerStorage);
  static constexpr int kSharedOffset = offsetof(SharedStorage, mainloop);
  static constexpr int kBarrierOffset = offsetof(SharedStorage, ring_barriers);
  static constexpr int kStageBarrierOffset = offsetof(SharedStorage, stage_barriers);
  static_assert(kSmemBytes <= kMaxSmemPerBlock, "shared memory: more than any GPU gives a block");
  // Registers: every thread gets the CTA's share of the file. What a consumer keeps live across its loop (the
  // accumulators and the fragments of one k-step; the weights stay in shared memory) plus about 16, or a producer
  // thread (one row's items in flight) plus about 24, for addresses and loop state must fit. ptxas reports the real
  // count and a CPU test requires no spills.
  static constexpr int kRegisterBudget = (65536 / kThreads < 255 ? 65536 / kThreads : 255) / 8 * 8;
  static_assert(Mainloop::kRegisters + (kSelfFed ? Producer::kRegisters : 0) + 16 <= kRegisterBudget,
                "register budget of a consumer");
  static_assert(Producer::kRegisters + 24 <= kRegisterBudget, "register budget of a producer thread");
};

}  // namespace kb25

#include "generated/fused_table.cuh"
