// The arithmetic that decides the output's bits: NaN-propagating min, TF32 rounding and
// splits, tanh(tanh(v)), and torch.min's order for the argmin.
#pragma once

#include "device.cuh"

namespace kb25 {

// torch.min semantics: NaN wins (fminf would drop it). min.NaN needs sm_80; the select does the same before it.
__device__ __forceinline__ float nan_min(float a, float b) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  float r;
  asm("min.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a < b || a != a) ? a : b;
#endif
}

// Every NaN made the canonical one, every other value left as it is: min.NaN returns the canonical NaN for a NaN
// operand. TF32 keeps the 19 top bits, so a NaN whose payload sits only in the 13 low bits would read as infinity to a
// tensor core that ignores them, and cvt.rna (as ptxas builds it) keeps such a NaN's top bits too. The fused kernels
// need sm_80, where min.NaN exists (before it, nan_min's select returns the NaN as it came).
__device__ __forceinline__ float canonical_nan(float v) { return nan_min(v, __int_as_float(0x7F800000)); }

// Round to nearest, ties away: what cuDNN's TF32 conv does to its operands (truncation would be 8e-4 off).
__device__ __forceinline__ float round_to_tf32(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(v));
  return __uint_as_float(r);
}

// The same rounding for kN raw fp32 words on their way to a tensor core that ignores the 13 low bits (all of them
// do): half a TF32 unit added to the magnitude (CUTLASS's round_half_ulp_truncate), the low bits then cleared as
// cvt.rna clears them (kClear) or left as the add leaves them. The carry rounds up into the exponent where it must;
// the largest floats round to infinity, as cvt.rna's do, and an infinity keeps its top bits. Right for every value
// but a NaN (payload only in the low bits: an infinity; every bit set: carried out to a zero): the producer checks
// its items for NaNs (either_nan) and makes those it finds 0x7FC00000, which stays a NaN.
template <bool kClear, int kN>
__device__ __forceinline__ void round_to_tf32_words(const uint32_t (&v)[kN], uint32_t (&out)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) out[i] = kClear ? (v[i] + 0x1000u) & 0xFFFFE000u : v[i] + 0x1000u;
}
// Whether a or b is a NaN: one compare for two words.
__device__ __forceinline__ bool either_nan(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("{\n .reg .pred p;\n setp.nan.f32 p, %1, %2;\n selp.u32 %0, 1, 0, p;\n}\n" : "=r"(r) : "r"(a), "r"(b));
  return r != 0;
}

// v = big + small for 3xTF32. big: v truncated to TF32 (never overflows), or the canonical NaN where v is NaN (a NaN
// whose payload sits only in the 13 low bits would read as infinity to a tensor core that ignores them); v - big is
// then exact and has v's sign. small: that remainder rounded to nearest, which keeps the sign; 0 where v is not
// finite.
__device__ __forceinline__ void split_tf32(float v, float& big, float& small) {
  big = (v == v) ? __uint_as_float(__float_as_uint(v) & 0xFFFFE000u) : __uint_as_float(0x7FFFFFFFu);
  small = isfinite(v) ? round_to_tf32(v - big) : 0.f;
}
// A weight, split so that none of the three products is 0 * inf where the fp32 product w * x is not NaN (done once
// per CTA, when the weights are staged, so the inputs' split in the hot loop stays plain):
// - w that TF32 holds exactly (small 0): small becomes the least normal float of w's sign, so small(w) * big(x)
//   carries an infinite x with the right sign, and adds nothing measurable to finite products;
// - infinite w: big becomes the largest TF32 value of w's sign and small = w, so small(x) * big(w) is finite for
//   every finite x (0 where x is TF32-exact), and small(w) * big(x) carries the infinity (NaN where x is 0, as w * x).
__device__ __forceinline__ void split_tf32_weight(float v, float& big, float& small) {
  split_tf32(v, big, small);
  if (isinf(v)) {
    big = copysignf(__uint_as_float(0x7F7FE000u), v);
    small = v;
  } else if (small == 0.f && big != 0.f) {
    small = copysignf(1.17549435e-38f, big);
  }
}

// The fp32 bias as three TF32 values whose sum is exactly v, for the tensor cores to add (each times one): the top 11
// significant bits (truncated, so never rounded up to infinity), the next 11 of the exact remainder, and what is left
// (at most 2 bits). A NaN or an infinity is the first part alone (a NaN the canonical one, as split_tf32 makes it).
// Below |v| = 2^-113 a part can be subnormal with bits TF32 does not keep: the bias added is then off by less than
// 2^-136. Host code too: a CPU test checks it on every float (test_split_tf32_bias_on_every_float).
// Device code reinterprets by the intrinsics, not memcpy: a host compiler that defines _FORTIFY_SOURCE by default
// (Ubuntu's gcc) turns memcpy into its checked form in the device code too, and the TF32 carrier's machine code then
// depended on which host compiler built it.
__host__ __device__ __forceinline__ void split_tf32_bias(float v, float (&part)[3]) {
#ifdef __CUDA_ARCH__
  const auto bits = [](float f) { return __float_as_uint(f); };
  const auto of = [](uint32_t u) { return __uint_as_float(u); };
#else
  const auto bits = [](float f) { uint32_t u; memcpy(&u, &f, sizeof(u)); return u; };
  const auto of = [](uint32_t u) { float f; memcpy(&f, &u, sizeof(f)); return f; };
#endif
  part[0] = (v == v) ? of(bits(v) & 0xFFFFE000u) : of(0x7FFFFFFFu);
  const float rest = isfinite(v) ? v - part[0] : 0.f;
  part[1] = of(bits(rest) & 0xFFFFE000u);
  part[2] = rest - part[1];
}

// tanh(tanh(v)) for a fused kernel's output. kApprox (the precision tag's kTanhApprox: bf16 and fp16): the SFU's
// tanh.approx.f32 twice, one instruction each instead of about 14, then the one rounding to the element type. The PTX
// ISA bounds its error by 2^-10.98 relative; over every float input it is 8.0e-6 absolute at most on the H200
// (tools/experiments/tanh_error.py; docs/perf-notes.md, "Rounding, NaN and tanh"), and test_16bit_tanh2_of_every_value
// holds what reaches the output: every 16-bit value within an ulp of the float64 tanh(tanh(m)) and no further than the
// reference's two roundings. fp32 outputs (TF32, 3xTF32): tanhf twice, within 2 fp32 ulps each (test_fp32_tanh2_error:
// 2^-20). The saving and inference variants share it, so their outputs stay equal.
template <bool kApprox>
__device__ __forceinline__ float tanh2(float v) {
  if constexpr (kHasFused && kApprox) {
    asm("tanh.approx.f32 %0, %0;\n tanh.approx.f32 %0, %0;\n" : "+f"(v));
    return v;
  } else {
    return tanhf(tanhf(v));
  }
}

// torch.min's order on (value, channel), which picks the argmin its backward scatters to: a NaN before any number
// (the lower channel among NaNs), else the smaller value, else the lower channel.
__host__ __device__ __forceinline__ bool precedes(float a, int ia, float b, int ib) {
  const bool a_nan = a != a, b_nan = b != b;
  if (a_nan || b_nan) return a_nan && (!b_nan || ia < ib);
  return a < b || (a == b && ia < ib);
}
// One step of a scan in ascending channel order (the pixel-row and row-streaming saving epilogues): (best, channel)
// becomes (v, c) where v strictly precedes best, smaller or a NaN where best is a number (not (best <= v), best no
// NaN); a later channel of an equal value never does. Selects, no branch.
__host__ __device__ __forceinline__ void scan_min(float& best, int& channel, float v, int c) {
  const bool took = !(best <= v) && best == best;
  best = took ? v : best;
  channel = took ? c : channel;
}
// scan_min where neither best nor v is a NaN (a guarded kernel's kept images: the tags' inexact() lists the rest):
// the smaller value, a later channel of an equal value never. One compare where scan_min needs two.
__host__ __device__ __forceinline__ void scan_min_finite(float& best, int& channel, float v, int c) {
  const bool took = v < best;
  best = took ? v : best;
  channel = took ? c : channel;
}
// (v, i) becomes (w, j) where (w, j) precedes it.
__host__ __device__ __forceinline__ void keep_min(float& v, int& i, float w, int j) {
  if (precedes(w, j, v, i)) {
    v = w;
    i = j;
  }
}

}  // namespace kb25
