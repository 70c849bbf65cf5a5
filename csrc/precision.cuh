// Precision tags: how the conv's operands become tensor-core products (CUTLASS's multiply-add tags).
#pragma once

#include "multiply.cuh"
#include "numerics.cuh"

namespace kb25 {

// How the conv's operands become tensor-core products, one tag each (CUTLASS's multiply-add tags: 3xTF32 is another
// tag on the same kernel). A tag owns its conversions and picks its multiply (multiply.cuh): to_tensor_core(v) is what
// the multipliers get for any weight or input value; to_slot(v, out) and to_registers(v, out) the faster ones for kN
// input words in a slot that wgmma reads or that mma.sync loads into registers (where kFastNeedsNoNaN, right for
// every word but a NaN: the producer makes NaNs quiet first). Tf32x3's multiply (ThreeProducts) splits each operand
// into big + small (split, split_weight) and keeps the two small products in an accumulator of their own. Where the
// inputs are split is the mainloop's choice: on the way into shared memory when the MMA reads its operands there
// (wgmma: two operand copies per slot), or in registers after the fragment load (mma.sync: one raw copy, as TF32 has).
struct Tf32RoundNearest {  // the reference's TF32 conv: both operands rounded to nearest (ties away), one product
  using Elem = float;
  static constexpr int kMmaK = 8;
  using Multiply = OneProduct;
  // tanh2 by tanhf: the SFU's tanh slowed the wgmma kernel (docs/perf-notes.md, "Epilogue and the handed write").
  static constexpr bool kTanhApprox = false;
  __device__ static float to_tensor_core(float v) { return round_to_tf32(canonical_nan(v)); }
  // Inputs, kN words at a time, into a slot that wgmma reads (low bits cleared) or that mma.sync loads into registers:
  // a NaN comes out right only as 0x7FC00000 (kFastNeedsNoNaN).
  static constexpr bool kFastNeedsNoNaN = true;
  template <int kN>
  __device__ static void to_slot(const uint32_t (&v)[kN], uint32_t (&out)[kN]) { round_to_tf32_words<true>(v, out); }
  template <int kN>
  __device__ static void to_registers(const uint32_t (&v)[kN], uint32_t (&out)[kN]) {
    round_to_tf32_words<false>(v, out);
  }
};
struct Tf32x3 {  // strict fp32: v = big + small, both TF32; big*big + big*small + small*big (small*small dropped)
  using Elem = float;
  static constexpr int kMmaK = 8;
  using Multiply = ThreeProducts;
  static constexpr bool kTanhApprox = false;  // tanh2: 1e-5 against the strict reference
  __device__ static float to_tensor_core(float v) { return v; }  // raw: split later
  static constexpr bool kFastNeedsNoNaN = false;
  template <int kN>
  __device__ static void to_registers(const uint32_t (&v)[kN], uint32_t (&out)[kN]) {
#pragma unroll
    for (int i = 0; i < kN; ++i) out[i] = v[i];
  }
  __device__ static void split(float v, float& big, float& small) { split_tf32(v, big, small); }
  __device__ static void split_weight(float v, float& big, float& small) { split_tf32_weight(v, big, small); }
};
// bf16 and fp16: operands as they come, fp32 accumulation. The 16-bit tags also own a packed min: pack2 rounds two
// fp32 values to the element type into one word (lo in the low half), min2 takes the NaN-propagating min of each
// half. Rounding is monotonic, so the min of rounded values is the rounded min, which the output's one rounding then
// leaves as it is (the reference rounds its conv output to the element type before its min, too).
template <class Elem_>
struct Native16 {
  static_assert(std::is_same_v<Elem_, __nv_bfloat16> || std::is_same_v<Elem_, __half>, "bf16 or fp16");
  using Elem = Elem_;
  static constexpr bool kBf16 = std::is_same_v<Elem, __nv_bfloat16>;
  static constexpr int kMmaK = 16;
  using Multiply = OneProduct;
  static constexpr bool kTanhApprox = true;  // tanh2
  __device__ static Elem to_tensor_core(Elem v) { return v; }
  __device__ static uint32_t pack2(float lo, float hi) {
    uint32_t r = 0;
    if constexpr (kHasFused && kBf16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    if constexpr (kHasFused && !kBf16) asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  __device__ static uint32_t min2(uint32_t a, uint32_t b) {
    uint32_t r = 0;
    if constexpr (kHasFused && kBf16) asm("min.NaN.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    if constexpr (kHasFused && !kBf16) asm("min.NaN.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
  }
};

}  // namespace kb25
