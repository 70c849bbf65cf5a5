// What every kernel builds on: the arch switches, conversions between element types, and PTX
// wrappers for the synchronisation and data-movement instructions the kernels use.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>
#include "generated/config.h"

namespace kb25 {

// Between element types by the conversion intrinsics (round to nearest even), never by the 16-bit types' operators
// and constructors: torch's extension build defines __CUDA_NO_HALF_CONVERSIONS__ and its kin, and a load_inline
// that puts torch's headers before this source (torch without no_implicit_headers) has cuda_fp16.h and cuda_bf16.h
// included under them, where those operators do not exist.
template <class To, class From>
__host__ __device__ __forceinline__ To convert(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (std::is_same_v<From, __half>) {
    return static_cast<To>(__half2float(v));
  } else if constexpr (std::is_same_v<From, __nv_bfloat16>) {
    return static_cast<To>(__bfloat162float(v));
  } else if constexpr (std::is_same_v<To, __half>) {
    if constexpr (std::is_same_v<From, double>) return __double2half(v);
    else return __float2half_rn(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, __nv_bfloat16>) {
    if constexpr (std::is_same_v<From, double>) return __double2bfloat16(v);
    else return __float2bfloat16_rn(static_cast<float>(v));
  } else {
    return static_cast<To>(v);
  }
}

// wgmma exists only in code compiled for sm_90a; elsewhere the wgmma kernels are empty and never launched. The
// fused kernels need sm_80 (mbarrier, cvt.rna.tf32, TF32 and bf16 mma.sync, min.NaN): compiled for an older GPU
// (sm_75) they are empty too, and the chooser never picks them there.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KB25_HAS_WGMMA 1
#else
#define KB25_HAS_WGMMA 0
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define KB25_HAS_FUSED 0
#else
#define KB25_HAS_FUSED 1
#endif
inline constexpr bool kHasWgmma = KB25_HAS_WGMMA;
inline constexpr bool kHasFused = KB25_HAS_FUSED;
// The largest shared memory a block may opt in to on any GPU (sm_90, sm_100: 227 KB); whether a kernel fits the GPU
// at hand is the chooser's question (choose_fused_kernel), asked at run time.
inline constexpr int kMaxSmemPerBlock = 227 * 1024;
// What the arch being compiled gives a block where it is known to be less (CUDA programming guide): a fused kernel
// that asks for more is compiled out there, since the chooser never picks it on such a GPU.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 890 || __CUDA_ARCH__ == 1200 || \
                               __CUDA_ARCH__ == 1210)
inline constexpr int kArchSmemPerBlock = 99 * 1024;
#elif defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 800 || __CUDA_ARCH__ == 870)
inline constexpr int kArchSmemPerBlock = 163 * 1024;
#else
inline constexpr int kArchSmemPerBlock = kMaxSmemPerBlock;
#endif

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Generic-proxy writes to shared memory become visible to wgmma (the async proxy) after this and a barrier. Before
// sm_90 there is no async proxy (and no wgmma) to publish to.
__device__ __forceinline__ void fence_proxy_async() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// mbarriers (sm_80+): the producer/consumer hand-offs. wait(parity) returns once the phase of that parity has
// completed; on a fresh barrier the phase "before" phase 0 counts as completed, so waiting on parity 1 passes.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared.b64 state, [%0];\n}\n" ::"r"(smem_u32(bar))
               : "memory");
}
__device__ __forceinline__ void mbarrier_arrive_if(uint64_t* bar, bool when) {
  asm volatile("{\n .reg .pred p;\n .reg .b64 state;\n setp.ne.b32 p, %1, 0;\n"
               " @p mbarrier.arrive.shared.b64 state, [%0];\n}\n" ::"r"(smem_u32(bar)), "r"((int)when) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
#if __CUDA_ARCH__ >= 900
  asm volatile("{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared.b64 done, [%0], %1;\n"
               " @!done bra WAIT;\n}\n" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
#else
  asm volatile("{\n .reg .pred done;\n WAIT:\n mbarrier.test_wait.parity.shared.b64 done, [%0], %1;\n"
               " @!done bra WAIT;\n}\n" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
#endif
}
// Asynchronous copies (sm_80+): 16 bytes from global memory into shared memory through L2 only (.cg), grouped by
// commit; wait_all waits for every group this thread committed. A thread that reads back only what it copied itself
// needs no barrier.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
// A barrier for the kThreads threads of one consumer warpgroup (id 0 is __syncthreads()).
template <int kThreads>
__device__ __forceinline__ void named_barrier(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

// Four 8x8 matrices of 16-bit elements from the mma fragment layout (register i: row lane / 4, columns 2 (lane % 4)
// and + 1 of matrix i) into shared memory transposed: row r of matrix i (column r of the fragment) goes to the
// 16 bytes at lane 8i + r's address. sm_90.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
#if __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
#endif
}

}  // namespace kb25
