// Each FUSED_TABLE row's shared memory per CTA (fused_kernel_smem_bytes), one number a line, for the `kernels` rows
// given as the argument. Appended to model_new.cuda_source() with the other host programs (main.cpp runs it as
// `smem KERNELS`); test_correctness.py's fused_smem_bytes fixture reads it.
#include <cstdio>
#include <cstdlib>

namespace host_smem {
int run(int argc, char** argv) {
  if (argc != 3) return 2;
  const int kernels = std::atoi(argv[2]);
  for (int k = 0; k < kernels; ++k) std::printf("%d\n", fused_kernel_smem_bytes(k));
  return 0;
}
}  // namespace host_smem
