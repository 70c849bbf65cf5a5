// The chooser (choose_fused_kernel) asked for every arch, precision, input element type and backend: standard input
// is the number of precisions and of element types, then one `sm smem_optin` pair a line; each output line is `sm
// wgmma_built precision input mma_sync_only kernel smem_bytes guard guard_smem_bytes`, the kernel it picks (-1: none),
// that kernel's shared memory, and its guard (choose_guard_kernel; -1: none) with the guard's. Run as `chooser`
// (main.cpp); test_chooser_picks_only_kernels_each_arch_can_launch checks it.
// `chooser dw`: the dW kernel (choose_grad_weight_kernel) for each `sm smem_optin` line of standard input, with and
// without tensor cores: each output line is `smem_optin tensor_cores kernel smem_bytes` (the fed kernels' shared
// memory a CTA; 0 for the walkers); test_grad_weight_chooser_picks_built_b_where_two_ctas_fit checks it.
#include <cstdio>
#include <cstring>

namespace host_chooser {
int run_grad_weight() {
  int sm, smem;
  while (std::scanf("%d %d", &sm, &smem) == 2)
    for (int tensor_cores = 0; tensor_cores < 2; ++tensor_cores) {
      const int k = choose_grad_weight_kernel(tensor_cores == 1, smem);
      const int bytes =
          k == 2 ? kb25::GradWeightFed<true>::kSmemBytes : k == 1 ? kb25::GradWeightFed<false>::kSmemBytes : 0;
      std::printf("%d %d %d %d\n", smem, tensor_cores, k, bytes);
    }
  return 0;
}

int run(int argc, char** argv) {
  if (argc > 2 && !std::strcmp(argv[2], "dw")) return run_grad_weight();
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
