// FusedTraits: one fused kernel's configuration (MMA, precision, tile, roles, ring), its shared-memory
// layout and budgets, and the instantiations of the table.
#pragma once

#include "epilogue_mma_sync.cuh"
#include "epilogue_wgmma.cuh"
#include "producer.cuh"
#include "ring.cuh"
#include "scheduler.cuh"

namespace kb25 {

enum class MmaKind { kMmaSync, kWgmma };

// Shared memory, one struct a kernel: per consumer its ring of input-row slots and its epilogue's buffers; then what
// the consumers share (the mainloop's weights); then the ring's (full, empty) mbarriers per slot; then, where the
// producer's threads write the consumer's steps (Schedule::kHanded), a (full, empty) mbarrier pair per staged buffer.
// A part that a kernel does not have is left out by a specialization (no zero-length arrays: NVRTC refuses them), so
// every member sits where the kernels were tuned.
template <int kSlots, int kSlotBytes, int kEpilogueBytes>
struct alignas(16) ConsumerStorage {
  unsigned char ring[kSlots][kSlotBytes];
  unsigned char epilogue[kEpilogueBytes];
};
template <int kSlots, int kSlotBytes>
struct alignas(16) ConsumerStorage<kSlots, kSlotBytes, 0> {  // mma.sync: its epilogue works in registers
  unsigned char ring[kSlots][kSlotBytes];
};
template <class Consumer, int kConsumers, int kSharedBytes, int kSlots, int kStagePairs>
struct SharedStorage {
  Consumer consumers[kConsumers];
  alignas(16) unsigned char mainloop[kSharedBytes];
  alignas(8) uint64_t ring_barriers[kConsumers][kSlots][2];
  uint64_t stage_barriers[kConsumers][kStagePairs][2];
};
template <class Consumer, int kConsumers, int kSharedBytes, int kSlots>
struct SharedStorage<Consumer, kConsumers, kSharedBytes, kSlots, 0> {  // the consumer writes its own steps
  Consumer consumers[kConsumers];
  alignas(16) unsigned char mainloop[kSharedBytes];
  alignas(8) uint64_t ring_barriers[kConsumers][kSlots][2];
};

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
  using Ring = RowRing<kRing_, Geometry::kSlotBytes, kUsesWgmma>;
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
  // A CTA's shared memory (SharedStorage, above), one layout for both variants of a kernel.
  using ConsumerStorage = kb25::ConsumerStorage<kRing, Geometry::kSlotBytes, Epilogue::kSmemBytes>;
  using SharedStorage = kb25::SharedStorage<ConsumerStorage, kConsumers, Mainloop::kSmemBytes, kRing,
                                            Epilogue::kHandOffStages>;
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  // The kernel addresses the members by these byte offsets from the dynamic shared memory's start: the sizes of the
  // members before each, as they lie back to back (every size is a multiple of 16; asserted: no padding anywhere).
  static constexpr int kRingBytes = sizeof(ConsumerStorage::ring);
  static constexpr int kConsumerBytes = sizeof(ConsumerStorage);
  static constexpr int kSharedOffset = sizeof(SharedStorage::consumers);
  static constexpr int kBarrierOffset = kSharedOffset + sizeof(SharedStorage::mainloop);
  static constexpr int kStageBarrierOffset = kBarrierOffset + sizeof(SharedStorage::ring_barriers);
  static_assert(kConsumerBytes == kRingBytes + Epilogue::kSmemBytes &&
                kSmemBytes == kStageBarrierOffset + kConsumers * Epilogue::kHandOffStages * 2 * 8,
                "SharedStorage's members back to back");
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

// Whether a kernel of the table is a guard (kFusedKernelGuards): with a guard buffer it computes only the images a
// guarded kernel of its precision and MMA listed (Images). The generated table sets it for those rows alone, so the
// kernels that guard nothing carry no code for it.
template <class Traits>
inline constexpr bool kRecomputesListed = false;

}  // namespace kb25

#include "generated/fused_table.cuh"
