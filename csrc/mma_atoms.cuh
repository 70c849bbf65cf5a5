// Tensor-core instructions: mma.sync and wgmma wrappers, ldmatrix, wgmma fences and descriptors.
#pragma once

#include "device.cuh"

namespace kb25 {

// ================================================================ MMA atoms
// Selects an MMA wrapper (wgmma and mma.sync) by operand type.
template <class Elem>
struct Operand {};

// mma.sync m16n8kK, row.col, fp32 accumulate: K = 8 for TF32, 16 for bf16/fp16. Every operand register holds 4 bytes
// (one TF32 value or two 16-bit ones), so the fragments have the same shape for every type: A four registers (rows
// g and g + 8, the k-halves in turn), B two, C/D four (rows g, g + 8; columns 2t, 2t + 1).
// Four 8x8 matrices of 16-bit elements (= 8 rows x 16 bytes each) from shared memory; lane 8i + r gives row r of
// matrix i, and register i of lane 4r + c gets bytes 4c..4c+3 of that row. For the A fragment: matrix 0 = rows 0-7,
// k-half 0; 1 = rows 8-15, k-half 0; 2 = rows 0-7, k-half 1; 3 = rows 8-15, k-half 1, for TF32 and 16-bit alike.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
#if KB25_HAS_FUSED
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}

// The same loads transposed: register i of lane 4r + c gets the elements at rows 2 c and 2 c + 1 of column r of
// matrix i: the B fragment of mma.sync m16n8k16 from a matrix stored with k down its rows (two matrices: k 0-7, 8-15).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
#if KB25_HAS_FUSED
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t addr) {
#if KB25_HAS_FUSED
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
#endif
}

// Warpgroup MMA runs asynchronously: registers it accumulates into must stay untouched until wgmma.wait_group;
// fence_operand() pins a value in its registers across that window.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// Shared-memory matrix descriptor, no swizzle: start address, then the byte offsets between 8-row x 16-byte core
// matrices along K (leading) and along M/N (stride), each field in 16-byte units.
__device__ __forceinline__ uint64_t wgmma_desc(const void* smem, uint32_t k_offset_bytes, uint32_t mn_offset_bytes) {
  return (uint64_t)((smem_u32(smem) >> 4) & 0x3FFF) | ((uint64_t)((k_offset_bytes >> 4) & 0x3FFF) << 16) |
         ((uint64_t)((mn_offset_bytes >> 4) & 0x3FFF) << 32);
}

}  // namespace kb25

#include "generated/mma_sync_atoms.cuh"
#include "generated/wgmma_atoms.cuh"
