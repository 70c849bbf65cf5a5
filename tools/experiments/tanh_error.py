"""The error of the tanh the fused kernels use, over every finite float input: the SFU's tanh.approx.f32 once and
twice (tanh2 where the precision tag's kTanhApprox is set: bf16, fp16) and tanhf twice (TF32, 3xTF32), against
float64 tanh on the GPU. Prints the largest absolute and relative errors and an input that reaches each.

    python3 tools/experiments/tanh_error.py

The PTX ISA bounds tanh.approx.f32 by 2^-10.98 relative; this measures what the GPU at hand does, which is what the
tests' bounds (test_16bit_tanh2_of_every_value, test_fp32_tanh2_error) stand on.
"""
import math
import struct

import torch
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <cstdint>
#include <cuda_runtime.h>

__device__ __forceinline__ float approx(float v) {
  asm("tanh.approx.f32 %0, %0;\n" : "+f"(v));
  return v;
}

// Per form (0: tanh.approx once, 1: twice, 2: tanhf twice): max absolute and max relative error, each packed as
// (error bits << 32 | input bits) so that one atomicMax keeps the error and an input that reaches it.
__global__ void tanh_error_kernel(unsigned long long* worst) {
  unsigned long long mine[6] = {0, 0, 0, 0, 0, 0};
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32); i += stride) {
    const uint32_t bits = (uint32_t)i;
    const float x = __uint_as_float(bits);
    if (!isfinite(x)) continue;
    const double t1 = tanh((double)x), t2 = tanh(t1);
    const float got[3] = {approx(x), approx(approx(x)), tanhf(tanhf(x))};
    const double want[3] = {t1, t2, t2};
#pragma unroll
    for (int f = 0; f < 3; ++f) {
      const double abs_err = fabs((double)got[f] - want[f]);
      const double rel_err = fabs(want[f]) >= 1.1754943508222875e-38 ? abs_err / fabs(want[f]) : 0.0;
      const unsigned long long a = (unsigned long long)__float_as_uint((float)abs_err) << 32 | bits;
      const unsigned long long r = (unsigned long long)__float_as_uint((float)rel_err) << 32 | bits;
      mine[2 * f] = a > mine[2 * f] ? a : mine[2 * f];
      mine[2 * f + 1] = r > mine[2 * f + 1] ? r : mine[2 * f + 1];
    }
  }
  for (int k = 0; k < 6; ++k) atomicMax(worst + k, mine[k]);
}

extern "C" int launch_tanh_error(unsigned long long* worst, int sms) {
  tanh_error_kernel<<<sms * 8, 256>>>(worst);
  return (int)cudaGetLastError();
}
"""

CPP = r"""
#include <torch/extension.h>
extern "C" int launch_tanh_error(unsigned long long* worst, int sms);
void tanh_error(at::Tensor worst, int64_t sms) {
  TORCH_CHECK(worst.is_cuda() && worst.dtype() == at::kLong && worst.numel() == 6, "expected 6 int64 on the GPU");
  TORCH_CHECK(launch_tanh_error(reinterpret_cast<unsigned long long*>(worst.data_ptr()), (int)sms) == 0,
              "the launch failed");
}
"""

FORMS = ("tanh.approx.f32", "tanh.approx.f32 twice", "tanhf twice")


def main():
    ext = load_inline("kb25_tanh_error", cpp_sources=CPP, cuda_sources=CUDA, functions=["tanh_error"],
                      extra_cuda_cflags=["-O3"])
    worst = torch.zeros(6, dtype=torch.int64, device="cuda")
    ext.tanh_error(worst, torch.cuda.get_device_properties(0).multi_processor_count)
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}: every finite float x, against float64 tanh on the GPU")
    print(f"{'form':<24}{'max abs error':>16}{'at x':>16}{'max rel error':>16}{'at x':>16}")
    for f, name in enumerate(FORMS):
        cells = []
        for packed in worst[2 * f: 2 * f + 2].tolist():
            err, x = (struct.unpack("<f", struct.pack("<I", word))[0] for word in (packed >> 32, packed & 0xFFFFFFFF))
            cells.append(f"{err:>10.3e} 2^{math.log2(err) if err else float('-inf'):>5.1f}{x:>16.8g}")
        print(f"{name:<24}{cells[0]}{cells[1]}")


if __name__ == "__main__":
    main()
