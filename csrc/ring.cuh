// The row ring: a consumer's input rows in shared-memory slots, handed over by full/empty mbarriers.
#pragma once

#include "device.cuh"

namespace kb25 {

// A consumer's input rows pass through kSlots shared-memory slots, each with a full and an empty mbarrier. Row d (the
// d-th row the consumer receives; 32-bit counters never wrap: a consumer receives fewer than 2^32 rows, which would
// take over 10^14 input bytes) lives in slot index(d); its use of the slot is phase(d). The producer acquires a
// slot (waits until the consumer has released its previous row), stores the row and commits it; the consumer waits
// for it, reads it and releases it. kAsyncReaders: the consumer reads the slots by wgmma (the async proxy), so a commit
// first publishes the rows' generic-proxy stores to it; a consumer that reads by ldmatrix or plain loads (the fed dW,
// the mma.sync kernels with producer warps) needs only the mbarrier's release and acquire.
template <int kSlots, int kSlotBytes, bool kAsyncReaders = true>
struct RowRing {
  unsigned char* const slots;
  uint64_t* const bars;  // (full, empty) per slot
  __device__ static uint32_t index(uint32_t d) { return d % kSlots; }
  __device__ static uint32_t phase(uint32_t d) { return (d / kSlots) & 1; }
  __device__ static void init(uint64_t* bars, int producers, int consumers) {
    for (int i = 0; i < kSlots; ++i) {
      mbarrier_init(bars + 2 * i, producers);
      mbarrier_init(bars + 2 * i + 1, consumers);
    }
  }
  __device__ unsigned char* slot(uint32_t d) const { return slots + index(d) * kSlotBytes; }
  __device__ uint64_t* full(uint32_t d) const { return bars + 2 * index(d); }
  __device__ uint64_t* empty(uint32_t d) const { return full(d) + 1; }
  // On a fresh barrier the phase before phase 0 counts as completed: the first pass over the ring does not wait.
  __device__ void acquire(uint32_t d) const { mbarrier_wait(empty(d), phase(d) ^ 1); }
  __device__ void commit(uint32_t d) const {
    if constexpr (kAsyncReaders) fence_proxy_async();  // the rows' generic-proxy stores, published to wgmma
    mbarrier_arrive(full(d));
  }
  __device__ void wait(uint32_t d) const { mbarrier_wait(full(d), phase(d)); }
  __device__ void release(uint32_t d) const { mbarrier_arrive(empty(d)); }
  // Release where `when` holds, by a predicated arrive rather than a branch around it.
  __device__ void release_if(bool when, uint32_t d) const { mbarrier_arrive_if(empty(d), when); }
};

}  // namespace kb25
