// The multiply-add atoms a precision tag picks (CUTLASS's OpMultiplyAdd and OpMultiplyAddFastF32): how a weight is
// stored for the tensor cores, and which MMAs one k-step issues, on wgmma and on mma.sync.
#pragma once

#include "mma_atoms.cuh"
#include "numerics.cuh"

namespace kb25 {

// Pins a value in its registers across the window in which wgmma may still write them.
template <int kN>
__device__ __forceinline__ void pin(float (&acc)[kN][4]) {
#pragma unroll
  for (int j = 0; j < kN; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) fence_operand(acc[j][i]);
}

// One product per operand pair, as the operands come to the tensor cores (TF32 rounded to nearest, bf16, fp16; TF32
// on fp16 operands). wgmma: the accumulators start from the first k-step's product (scale-d 0) and the bias enters by
// one more MMA (the tag's bias_part and ones).
struct OneProduct {
  static constexpr int kCopies = 1;  // a stored operand is one value
  static constexpr bool kBiasByMma = true;
  // wgmma: the MMAs over the window's two older rows are issued before the wait for its newest row (TF32 -1%, 16-bit
  // -0.5%; docs/perf-notes.md, "wgmma mainloop").
  static constexpr bool kIssuesBeforeNewest = true;
  template <class Tag, class O, class E>
  __device__ static void store_weight(O* dst, int at, int, E v) {
    dst[at] = Tag::to_tensor_core(v);
  }
  // The bias comes from its MMA: nothing to start from.
  template <int kN, class Small>
  __device__ static void wgmma_begin(float (&)[kN][4], Small&, float, float) {}
  // The k-step's MMA: D = A * B at the first k-step, D += A * B otherwise.
  template <class Elem, bool kFirst, int kN, class Small>
  __device__ static void wgmma_k_step(float (&acc)[kN][4], Small&, uint64_t a, uint64_t b, uint64_t, uint64_t) {
    if constexpr (kFirst) {
      wgmma_async<false>(acc, a, b, Operand<Elem>{});
    } else {
      wgmma_async(acc, a, b, Operand<Elem>{});
    }
  }
  template <int kN, class Small>
  __device__ static void wgmma_end(float (&)[kN][4], Small&) {}
  // mma.sync: one m16n8 tile's product; at the first k-step C = the bias.
  template <class Elem, bool kFirst, class Small>
  __device__ static void mma_sync_tile(float (&acc)[4], Small&, const uint32_t (&a)[4], const uint32_t (&)[4],
                                       const uint32_t (&bw)[2], const uint32_t (&)[2], float4 bias) {
    if constexpr (kFirst) {
      mma_sync(acc, a, bw[0], bw[1], bias, Operand<Elem>{});
    } else {
      mma_sync(acc, a, bw[0], bw[1], Operand<Elem>{});
    }
  }
  template <class Accum, class Small>
  __device__ static void mma_sync_end(Accum&, Small&) {}
  template <int kN>
  using WgmmaSmall = float[1][4];  // no small products
};

// Strict fp32 by three products: v = big + small; big*big + big*small + small*big, small*small dropped. The two small
// products go to an accumulator of their own and join the big one at the step's end: the tensor cores' fp32
// accumulation loses up to an ulp of the accumulator per instruction, so the big sum gets a third of the instructions.
// Inputs are split by the producer into two slot copies (wgmma, and fp16 parts on mma.sync) or, 3xTF32 on mma.sync,
// in registers after the fragment load.
// kSmallExp: the small parts are stored times 2^-kSmallExp (fp16 parts: 2^11, so that they stay normal fp16 values),
// and their sum is multiplied by 2^kSmallExp (exact) before it joins (3xTF32: 0, TF32 parts as they are).
template <int kSmallExp>
struct ThreeProductsScaled {
  static constexpr int kCopies = 2;  // a stored operand is big, then small
  // wgmma: the accumulators start from the bias (moves), the small products from zero.
  static constexpr bool kBiasByMma = false;
  // wgmma: the whole window is waited for before the first MMA (issuing the older rows' MMAs first ran 9% slower;
  // docs/perf-notes.md, "3xTF32").
  static constexpr bool kIssuesBeforeNewest = false;
  template <class Tag, class O, class E>
  __device__ static void store_weight(O* dst, int at, int copy_elems, E v) {  // O: the MMA's element, E: float
    O big, small;
    Tag::split_weight(v, big, small);
    dst[at] = big;
    dst[at + copy_elems] = small;
  }
  // The accumulators from the bias (rows g, g + 8 of the warp's 16 channels), the small products from zero.
  template <int kN>
  __device__ static void wgmma_begin(float (&acc)[kN][4], float (&small)[kN][4], float bias_lo, float bias_hi) {
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      acc[j][0] = acc[j][1] = bias_lo;
      acc[j][2] = acc[j][3] = bias_hi;
      small[j][0] = small[j][1] = small[j][2] = small[j][3] = 0.f;
    }
    pin(small);
  }
  // small(w) * big(x), big(w) * small(x), big(w) * big(x): a_small and b_small are the descriptors' offsets to the
  // small copies.
  template <class Elem, bool kFirst, int kN>
  __device__ static void wgmma_k_step(float (&acc)[kN][4], float (&small)[kN][4], uint64_t a, uint64_t b,
                                      uint64_t a_small, uint64_t b_small) {
    wgmma_async(small, a + a_small, b, Operand<Elem>{});
    wgmma_async(small, a, b + b_small, Operand<Elem>{});
    wgmma_async(acc, a, b, Operand<Elem>{});
  }
  template <int kN>
  __device__ static void wgmma_end(float (&acc)[kN][4], float (&small)[kN][4]) {
    pin(small);
#pragma unroll
    for (int j = 0; j < kN; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][i] += unscaled_small(small[j][i]);
  }
  __device__ static float unscaled_small(float v) {
    if constexpr (kSmallExp == 0) {
      return v;
    } else {
      return v * (kSmallExp < 0 ? 1.f / (float)(1 << -kSmallExp) : (float)(1 << kSmallExp));
    }
  }
  // mma.sync: one m16n8 tile's three products (a, bw: the big parts; as, bs: the small ones); at the first k-step the
  // big product's C is the bias, the small ones' zero.
  template <class Elem, bool kFirst>
  __device__ static void mma_sync_tile(float (&acc)[4], float (&small)[4], const uint32_t (&a)[4],
                                       const uint32_t (&as)[4], const uint32_t (&bw)[2], const uint32_t (&bs)[2],
                                       float4 bias) {
    if constexpr (kFirst) {
      mma_sync(small, a, bs[0], bs[1], float4{0.f, 0.f, 0.f, 0.f}, Operand<Elem>{});
    } else {
      mma_sync(small, a, bs[0], bs[1], Operand<Elem>{});
    }
    mma_sync(small, as, bw[0], bw[1], Operand<Elem>{});
    OneProduct::mma_sync_tile<Elem, kFirst>(acc, small, a, as, bw, bs, bias);  // big(w) * big(x)
  }
  // mma.sync: a raw fp32 A fragment into its big and small TF32 parts.
  __device__ static void split_fragment(uint32_t (&a)[4], uint32_t (&as)[4]) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      float big, small;
      split_tf32(__uint_as_float(a[r]), big, small);
      a[r] = __float_as_uint(big);
      as[r] = __float_as_uint(small);
    }
  }
  // mma.sync: the small products join the accumulators once the step's MMAs are issued.
  template <int kM, int kN>
  __device__ static void mma_sync_end(float (&acc)[kM][kN][4], float (&small)[kM][kN][4]) {
#pragma unroll
    for (int mt = 0; mt < kM; ++mt)
#pragma unroll
      for (int nt = 0; nt < kN; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][nt][i] += unscaled_small(small[mt][nt][i]);
  }
  template <int kN>
  using WgmmaSmall = float[kN][4];
};
using ThreeProducts = ThreeProductsScaled<0>;  // 3xTF32: TF32 parts

}  // namespace kb25
