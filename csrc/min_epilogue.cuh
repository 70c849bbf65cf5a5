// The cudnn_epilogue backend's kernel: min over dim 1, tanh, tanh after a library conv.
#pragma once

#include "numerics.cuh"

namespace kb25 {

// What the reference does after its conv: torch.min over dim 1 (the channels of a batched conv output, the rows
// of an unbatched one), tanh, tanh. y is viewed as [outer][reduce][inner] (contiguous), out as [outer][inner].
// Each thread reduces kVec adjacent inner elements, one 16-byte load per reduce step where the rows are aligned;
// a warp reads consecutive vectors of one row per load, so every load is coalesced. The min is taken on values
// widened to the math type (exact); each tanh result is rounded to the element type, as torch rounds it.
template <class Elem>
struct MathOf {
  using type = float;  // float, half and bfloat16: torch computes their tanh in float
};
template <>
struct MathOf<double> {
  using type = double;
};

__device__ __forceinline__ double nan_min(double a, double b) { return (a < b || a != a) ? a : b; }
__device__ __forceinline__ float tanh_of(float v) { return tanhf(v); }
__device__ __forceinline__ double tanh_of(double v) { return tanh(v); }

template <class Elem, int kVec>
struct alignas(sizeof(Elem) * kVec) ElemVec {
  Elem v[kVec];
};

template <class Elem, int kVec>
__global__ void __launch_bounds__(256) min_dim1_tanh2_kernel(const Elem* __restrict__ y, Elem* __restrict__ out,
                                                             int64_t outer, int64_t reduce, int64_t inner) {
  using Math = typename MathOf<Elem>::type;
  using V = ElemVec<Elem, kVec>;
  const int64_t groups = inner / kVec;
  const int64_t total = outer * groups;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t o = i / groups;
    const int64_t p = (i - o * groups) * kVec;
    const V* src = reinterpret_cast<const V*>(y + o * reduce * inner + p);
    const V first = src[0];
    Math m[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) m[e] = convert<Math>(first.v[e]);
    // Double's tanh needs more registers: unrolled 4 deep, sm_120's ptxas spills it.
#pragma unroll(sizeof(Math) == 8 ? 2 : 4)
    for (int64_t r = 1; r < reduce; ++r) {
      const V u = src[r * groups];
#pragma unroll
      for (int e = 0; e < kVec; ++e) m[e] = nan_min(m[e], convert<Math>(u.v[e]));
    }
    V res;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const Elem t1 = convert<Elem>(tanh_of(m[e]));
      res.v[e] = convert<Elem>(tanh_of(convert<Math>(t1)));
    }
    *reinterpret_cast<V*>(out + o * inner + p) = res;
  }
}

}  // namespace kb25
