// The chooser (choose_fused_kernel) asked for every arch, precision, input element type and backend: standard input
// is the number of precisions and of element types, then one `sm smem_optin` pair a line; each output line is `sm
// wgmma_built precision input mma_sync_only kernel smem_bytes guard guard_smem_bytes`, the kernel it picks (-1: none),
// that kernel's shared memory, and its guard (choose_guard_kernel; -1: none) with the guard's. Run as `chooser`
// (main.cpp);
// test_chooser_picks_only_kernels_each_arch_can_launch checks it.
#include <cstdio>

namespace host_chooser {
int run(int, char**) {
  int precisions = 0, inputs = 0;
  if (std::scanf("%d %d", &precisions, &inputs) != 2) return 2;
  int sm, smem;
  while (std::scanf("%d %d", &sm, &smem) == 2)
    for (int wgmma = 0; wgmma < 2; ++wgmma)
      for (int p = 0; p < precisions; ++p)
        for (int input = 0; input < inputs; ++input)
          for (int mma_sync_only = 0; mma_sync_only < 2; ++mma_sync_only) {
            const kb25::DeviceProfile device{sm, smem, wgmma == 1};
            const int k = choose_fused_kernel(p, input, device, mma_sync_only == 1);
            const int guard = choose_guard_kernel(k, device);
            std::printf("%d %d %d %d %d %d %d %d %d\n", sm, wgmma, p, input, mma_sync_only, k, fused_kernel_smem_bytes(k),
                        guard, fused_kernel_smem_bytes(guard));
          }
  return 0;
}
}  // namespace host_chooser
