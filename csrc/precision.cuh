// Precision tags: how the conv's operands become tensor-core products (CUTLASS's multiply-add tags).
#pragma once

#include "multiply.cuh"
#include "numerics.cuh"

namespace kb25 {

// What every tag has whose tensor-core operands are the elements' own values, rounded (all but Tf32OnF16 and
// Fp32OnF16x3): no weight scale, no range to guard.
struct UnscaledOperands {
  static constexpr bool kGuardsRange = false;
  static constexpr bool kRefits16 = false;  // 16-bit x converted on its way into the slots (the fed dW's bf16 x)
  static constexpr int kScratchBytes = 0;
  // A weight or the bias as the kernel reads it (x's type) to Elem: the same value (Native16FromF32 rounds it).
  template <class E>
  __device__ static E param(E v) { return v; }
  template <int kThreads, class E>
  __device__ static float find_scale(const E* __restrict__, int, const E* __restrict__, int, uint32_t*) { return 1.f; }
  __device__ static float scale_of(const uint32_t*, int = 1) { return 1.f; }
  template <class E>
  __device__ static E scale(E v, float) { return v; }
  template <class E>
  __device__ static bool inexact(E, float) { return false; }
  template <class E>
  __device__ static bool inexact_bias(E, float) { return false; }
  __device__ static float unscale(float m, float) { return m; }
  // The wgmma bias k-step (WgmmaMainloop, kBiasByMma): A's k column kk of an output channel (bias_part) against B's
  // k row kk (ones). TF32: the bias as three TF32 parts (split_tf32_bias) in columns 0..2; 16-bit: the bias in column
  // 0. B is all ones.
  template <class M, class E>
  __device__ static M bias_part(E bias, float, int kk) {
    if constexpr (sizeof(M) == 4) {
      float part[3];
      split_tf32_bias(bias, part);
      return kk == 0 ? part[0] : kk == 1 ? part[1] : kk == 2 ? part[2] : 0.f;  // no local memory
    } else {
      return kk == 0 ? bias : convert<M>(0.f);
    }
  }
  template <class M>
  __device__ static M ones(int) { return convert<M>(1.f); }
};

// How the conv's operands become tensor-core products, one tag each (CUTLASS's multiply-add tags: 3xTF32 is another
// tag on the same kernel). A tag owns its conversions and picks its multiply (multiply.cuh): to_tensor_core(v) is what
// the multipliers get for any weight or input value; to_slot(v, out) and to_registers(v, out) the faster ones for kN
// input words in a slot that wgmma reads or that mma.sync loads into registers (where kFastNeedsNoNaN, right for
// every word but a NaN: the producer makes NaNs quiet first). Tf32x3's multiply (ThreeProducts) splits each operand
// into big + small (split, split_weight) and keeps the two small products in an accumulator of their own. Where the
// inputs are split is the mainloop's choice: on the way into shared memory when the MMA reads its operands there
// (wgmma: two operand copies per slot) or when the slots narrow x (fp16 parts, either MMA), else in registers after
// the fragment load (mma.sync's 3xTF32: one raw copy, as TF32 has).
struct Tf32RoundNearest : UnscaledOperands {  // the reference's TF32 conv: both operands rounded to nearest (ties away), one product
  using Elem = float;     // the weights, the bias, the output
  using XElem = float;    // x
  using MmaElem = float;  // what the slots hold and the tensor cores multiply
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
struct Tf32x3 : UnscaledOperands {  // strict fp32: v = big + small, both TF32; big*big + big*small + small*big (small*small dropped)
  using Elem = float;
  using XElem = float;
  using MmaElem = float;
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
struct Native16 : UnscaledOperands {
  static_assert(std::is_same_v<Elem_, __nv_bfloat16> || std::is_same_v<Elem_, __half>, "bf16 or fp16");
  using Elem = Elem_;
  using XElem = Elem_;
  using MmaElem = Elem_;
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

// bf16 and fp16 from a float32 x, weights and bias (autocast's call, without its cast kernels): the producer rounds x
// to the element type to nearest, ties to even, as x.to(dtype) does (cvt.rn: an fp16 overflow becomes an infinity, a
// NaN stays a NaN), the CTA rounds the weights and the bias the same way as it stages them (param), and everything
// after is Native16's, so the output is the 16-bit kernel's on x.to(dtype) and the cast weights, bit for bit.
template <class Elem_>
struct Native16FromF32 : Native16<Elem_> {
  using XElem = float;
  static constexpr bool kFastNeedsNoNaN = false;
  __device__ static Elem_ param(float v) { return convert<Elem_>(v); }  // __float2bfloat16_rn, __float2half_rn
  // Two input words into one word of two 16-bit values (lo in the low half).
  __device__ static uint32_t narrow2(uint32_t lo, uint32_t hi) {
    uint32_t r = 0;
    if constexpr (kHasFused && Native16<Elem_>::kBf16) {
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(__uint_as_float(hi)), "f"(__uint_as_float(lo)));
    }
    if constexpr (kHasFused && !Native16<Elem_>::kBf16) {
      asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(__uint_as_float(hi)), "f"(__uint_as_float(lo)));
    }
    return r;
  }
  // Every input has its 16-bit value: nothing is out of range (RowProducer folds what it narrows, range_fold, with the
  // input words it came from, and asks at the row's end whether that lists the image, range_lists).
  __device__ static uint32_t range_fold(uint32_t range, uint32_t, uint32_t, uint32_t) { return range; }
  __device__ static bool range_lists(uint32_t) { return false; }
};

// The weights' scale of the tags on fp16 operands (Tf32OnF16, Fp32OnF16x3). All of the CTA's threads: the largest of
// the |as_multiplied(w)| over `count` weights and the |bias| over `biases` (bits) into scratch[0], scratch[1] cleared
// (the flag that inexact() weights and biases raise).
template <int kThreads, class AsMultiplied>
__device__ void find_largest(const float* __restrict__ w, int count, const float* __restrict__ b, int biases,
                             uint32_t* scratch, const AsMultiplied& as_multiplied) {
  if (threadIdx.x == 0) scratch[0] = scratch[1] = 0;
  __syncthreads();
  uint32_t m = 0;
  for (int i = threadIdx.x; i < count; i += kThreads) m = max(m, __float_as_uint(as_multiplied(w[i])) & 0x7FFFFFFFu);
  if (threadIdx.x < biases) m = max(m, __float_as_uint(b[threadIdx.x]) & 0x7FFFFFFFu);
  atomicMax(scratch, m);
  __syncthreads();
}
// 2^(sign * s), s = kTop - the exponent of that largest magnitude, kept within [-126, 126] (2^s and 2^-s normal
// floats): the scale (sign 1) or its inverse (-1). The largest then lies in [2^kTop, 2^(kTop + 1)).
template <int kTop>
__device__ float pow2_scale(const uint32_t* scratch, int sign) {
  int s = kTop - ((int)(scratch[0] >> 23) - 127);
  s = s < -126 ? -126 : s > 126 ? 126 : s;
  return __uint_as_float((uint32_t)(127 + sign * s) << 23);
}

// TF32 on the fp16 tensor cores (the default fp32 path): the TF32 products at the fp16 rate. A TF32 value has fp16's
// 10 mantissa bits; where its exponent lies in fp16's range it is an fp16 value. x is read as fp32, rounded as the
// reference rounds it (to nearest, ties away: by the fp16 conversion's own rounding, narrow2) and goes into the slots
// as fp16, exactly. The weights, rounded the same way, are scaled by 2^s first
// (s puts the largest of the CTA's |w| and |bias| in [2^15, 2^16)), so that they are fp16 values exactly too; every
// sum is then 2^s times the TF32 one, exactly. The bias times 2^s enters as three fp16 parts, by one more MMA
// (wgmma; bias_part, ones) or as the first MMA's C (mma.sync), and the epilogue multiplies each pixel's min by 2^-s
// (unscale): the order of the channels, and so the argmin, does not change.
// The guard: a row with an input that fp16 does not hold (|tf32(x)| >= 65504, +-inf, NaN; 65504 itself would fit, and
// goes the slow way too) lists its image, and weights or a bias that the scale does not carry exactly list every
// image (GuardList). The TF32 kernel (Tf32RoundNearest) runs after this one in the same stream and recomputes the
// listed images; with none listed it returns at once.
// Inputs below fp16's normal range (|x| < 2^-14) keep fp16's subnormal spacing: each is off by at most 2^-25 from x
// and less than 2^-24 from its TF32 value, so an output by less than 2^-24 times the largest sum of |w| over a
// channel's 144 weights.
struct Tf32OnF16 {
  using Elem = float;
  using XElem = float;
  using MmaElem = __half;
  static constexpr int kMmaK = 16;
  using Multiply = OneProduct;
  static constexpr bool kTanhApprox = false;  // tanh2 by tanhf, as the TF32 kernel
  // narrow2 keeps every NaN a NaN, which range_fold sees: the producer passes NaNs as they come.
  static constexpr bool kFastNeedsNoNaN = false;
  static constexpr bool kGuardsRange = true;
  // The weights' largest magnitude (bits) and whether anything did not carry exactly, in the mainloop's shared memory.
  static constexpr int kScratchBytes = 16;
  __device__ static float param(float v) { return v; }
  // A (scaled) weight as the tensor cores get it.
  __device__ static __half to_tensor_core(float v) { return __float2half_rn(round_to_tf32(v)); }
  // Two input words into one word of two fp16 (lo in the low half), rounded as TF32 rounds (to 11 significant bits,
  // ties away): fp16's round to nearest even of v | 1. Setting the lowest bit moves a tie (the 13 dropped bits exactly
  // 0x1000) above the half, so it rounds away from zero, and leaves every other value on its side of the half. Exact
  // in fp16's normal range; a finite value beyond it becomes 65504 or an infinity, and an infinity (v | 1 is a NaN
  // pattern) or a NaN of any payload becomes a NaN, which range_fold sees. Below it, v is rounded to fp16's subnormal
  // spacing (2^-24), to nearest.
  __device__ static uint32_t narrow2(uint32_t lo, uint32_t hi) {
    uint32_t r = 0;
    if constexpr (kHasFused) {
      asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(__uint_as_float(hi | 1u)), "f"(__uint_as_float(lo | 1u)));
    }
    return r;
  }
  // Bit 15 of each half set where its magnitude is 65504 or more (+-inf, NaN too), ORed over a thread's words; the
  // image is listed where either bit is set. No carry crosses the halves (0x7FFF + 0x0401 < 0x10000).
  __device__ static uint32_t range_fold(uint32_t range, uint32_t w, uint32_t, uint32_t) {
    return range | ((w & 0x7FFF7FFFu) + 0x04010401u);
  }
  __device__ static bool range_lists(uint32_t range) { return (range & 0x80008000u) != 0; }
  // The largest of the |tf32(w)| and the |bias| (find_largest), then 2^s.
  template <int kThreads>
  __device__ static float find_scale(const float* __restrict__ w, int count, const float* __restrict__ b, int biases,
                                     uint32_t* scratch) {
    find_largest<kThreads>(w, count, b, biases, scratch, [](float v) { return round_to_tf32(v); });
    return scale_of(scratch);
  }
  // 2^(sign * s), s = 15 - the exponent of the largest |tf32(w)| (pow2_scale).
  __device__ static float scale_of(const uint32_t* scratch, int sign = 1) { return pow2_scale<15>(scratch, sign); }
  __device__ static float scale(float v, float scale) { return v * scale; }
  // Whether a weight's TF32 value is not finite (an infinity, a NaN, or a finite weight of magnitude 0x7F7FF000 or
  // more, which rounds up to infinity) or does not come back from tf32(v) * 2^s (inverse: 2^-s, exact), or is not an
  // fp16 value once scaled. Any of them lists every image. fp16 carries an infinite weight, but its products are not
  // all the reference's: an input below fp16's subnormals at its tap makes a NaN where the reference has an
  // infinity, and the NaN that an input of 0 makes there is one that the guarded kernels' pixel-row scan
  // (scan_min_finite) would not order.
  __device__ static bool inexact(float v, float scale) {
    const float tf32 = round_to_tf32(v);
    const float scaled = tf32 * scale;
    return !(isfinite(tf32) && scaled * __frcp_rn(scale) == tf32 && __half2float(__float2half_rn(scaled)) == scaled);
  }
  // The bias must also be the sum of its three fp16 parts (bias_part) once scaled: true for every finite bias whose
  // scaled magnitude is 0 or within [2^-12, 65504].
  __device__ static bool inexact_bias(float v, float scale) {
    const float scaled = v * scale;
    const float sum = __half2float(bias_part<__half>(v, scale, 0)) +
                      (__half2float(bias_part<__half>(v, scale, 1)) * 0x1p-11f +
                       __half2float(bias_part<__half>(v, scale, 2)) * 0x1p-22f);
    return !(isfinite(v) && scaled * __frcp_rn(scale) == v && sum == scaled);
  }
  // The wgmma bias k-step: the scaled bias as three fp16 values p0 + p1 * 2^-11 + p2 * 2^-22, split_tf32_bias's parts
  // (11 significant bits each, the last at most 2) with the second and third scaled up so that they stay fp16 values;
  // B's k rows 0..2 hold 1, 2^-11, 2^-22 (2^-22: an fp16 subnormal, exact). Each product is exact.
  template <class M>
  __device__ static __half bias_part(float bias, float scale, int kk) {
    float part[3];
    split_tf32_bias(bias * scale, part);
    return __float2half_rn(kk == 0 ? part[0] : kk == 1 ? part[1] * 0x1p11f : kk == 2 ? part[2] * 0x1p22f : 0.f);
  }
  template <class M>
  __device__ static __half ones(int kk) { return __float2half_rn(kk == 1 ? 0x1p-11f : kk == 2 ? 0x1p-22f : 1.f); }
  // A pixel's min back to the TF32 sums' scale (inverse: 2^-s).
  __device__ static float unscale(float m, float inverse) { return m * inverse; }
};

// Strict fp32 on the fp16 tensor cores: each operand as two fp16 parts, v = hi + lo * 2^-11 (hi = v rounded to fp16,
// lo = the rest times 2^11, rounded to fp16: 22 significant bits), and three products, hi*hi into the accumulators,
// hi*lo + lo*hi into an accumulator of their own that joins them times 2^-11 (ThreeProductsScaled<-11>): 3xTF32's
// scheme at the fp16 rate. The weights are scaled by 2^s first (s puts the largest |w| or |bias| in [2^14, 2^15), so
// that no hi rounds up past fp16's range), the accumulators start from the bias times 2^s, and the epilogue
// multiplies each pixel's min by 2^-s, as Tf32OnF16 does. A part below fp16's normal range keeps its subnormal
// spacing: an input is carried to within 2^-22 of its magnitude plus 2^-36.
// The guard (GuardList): a producer thread's share of a row (its items: 4 columns x 8 channels each) that holds an
// input fp16 does not (|hi| >= 65504, +-inf, NaN), or that is nonzero but all below fp16's normal range (2^-14: there
// the 2^-36 would be most of what fp32 keeps), lists its image; a weight or a bias that is not finite, or a nonzero
// weight that the scale leaves below 2^-14 (one that the parts would carry to less than 22 bits), lists every image.
// The 3xTF32 kernel (Tf32x3) runs after this one in the same stream and recomputes the listed images.
struct Fp32OnF16x3 {
  using Elem = float;
  using XElem = float;
  using MmaElem = __half;
  static constexpr int kMmaK = 16;
  static constexpr int kSmallExp = -11;
  using Multiply = ThreeProductsScaled<kSmallExp>;
  static constexpr bool kTanhApprox = false;  // tanh2 by tanhf, as 3xTF32
  static constexpr bool kFastNeedsNoNaN = false;  // a NaN lists its image: what it converts to does not matter
  static constexpr bool kGuardsRange = true;
  static constexpr int kScratchBytes = 16;  // the largest magnitude (bits) and the flag, as Tf32OnF16's
  __device__ static float param(float v) { return v; }
  __device__ static void split(float v, __half& hi, __half& lo) {
    hi = __float2half_rn(v);
    lo = __float2half_rn((v - __half2float(hi)) * 2048.f);
  }
  __device__ static void split_weight(float v, __half& hi, __half& lo) { split(v, hi, lo); }
  // Two input words into one word of their two hi parts (lo in the low half): fp16 rounded to nearest, even.
  __device__ static uint32_t narrow2(uint32_t lo, uint32_t hi) {
    uint32_t r = 0;
    if constexpr (kHasFused) asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(__uint_as_float(hi)), "f"(__uint_as_float(lo)));
    return r;
  }
  // The same two words' lo parts, from their hi parts h (narrow2's word): (v - hi) * 2^11, exact in fp32, rounded to
  // fp16.
  __device__ static uint32_t rest2(uint32_t lo, uint32_t hi, uint32_t h) {
    const __half2 parts = *reinterpret_cast<const __half2*>(&h);
    const float r_lo = (__uint_as_float(lo) - __low2float(parts)) * 2048.f;
    const float r_hi = (__uint_as_float(hi) - __high2float(parts)) * 2048.f;
    uint32_t r = 0;
    if constexpr (kHasFused) asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(r_hi), "f"(r_lo));
    return r;
  }
  // Over a thread's hi and lo words: the largest magnitude of each half (bits; a NaN's is above every other). A lo is
  // never larger than its hi, but nonzero where hi rounded a value below 2^-25 to 0 (that value is then counted).
  __device__ static uint32_t range_fold(uint32_t range, uint32_t h, uint32_t, uint32_t) {
    return __vmaxu2(range, h & 0x7FFF7FFFu);
  }
  // Whether the folded magnitudes list the image: 65504 or more (+-inf, NaN), or nonzero and none above 2^-14 (a lo
  // under a subnormal hi reaches 2^-14 at most).
  __device__ static bool range_lists(uint32_t range) {
    const uint32_t m = max(range & 0xFFFFu, range >> 16);
    return m >= 0x7BFFu || (m != 0 && m <= 0x0400u);
  }
  // The largest of the |w| and the |bias| (find_largest), then 2^s.
  template <int kThreads>
  __device__ static float find_scale(const float* __restrict__ w, int count, const float* __restrict__ b, int biases,
                                     uint32_t* scratch) {
    find_largest<kThreads>(w, count, b, biases, scratch, [](float v) { return v; });
    return scale_of(scratch);
  }
  // 2^(sign * s), s = 14 - the exponent of the largest |w| or |bias| (pow2_scale).
  __device__ static float scale_of(const uint32_t* scratch, int sign = 1) { return pow2_scale<14>(scratch, sign); }
  __device__ static float scale(float v, float scale) { return v * scale; }
  // A weight or a bias that is not finite lists every image (3xTF32 carries infinities in its parts), and so does a
  // nonzero weight whose scaled magnitude is below 2^-14 (its hi would be an fp16 subnormal).
  __device__ static bool inexact(float v, float scale) { return !isfinite(v) || (v != 0.f && fabsf(v * scale) < 0x1p-14f); }
  // The bias starts the accumulators times 2^s: it must come back from that (where s < 0 a tiny bias would lose bits).
  __device__ static bool inexact_bias(float v, float scale) { return !isfinite(v) || (v * scale) * __frcp_rn(scale) != v; }
  __device__ static float unscale(float m, float inverse_scale) { return m * inverse_scale; }
};

}  // namespace kb25
