// The host programs of test_correctness.py's CPU tests, in one executable: model_new.cuda_source(), then smem.cpp,
// chooser.cpp, argmin.cpp, split.cpp and this file, built once by nvcc (_host_program). The first argument names the
// program; each is host code of the CUDA source run on the CPU, no GPU needed.
#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  const char* program = argc > 1 ? argv[1] : "";
  if (!std::strcmp(program, "smem")) return host_smem::run(argc, argv);
  if (!std::strcmp(program, "chooser")) return host_chooser::run(argc, argv);
  if (!std::strcmp(program, "argmin")) return host_argmin::run(argc, argv);
  if (!std::strcmp(program, "split")) return host_split::run(argc, argv);
  std::fprintf(stderr, "usage: %s smem KERNELS | chooser | argmin | split PART PARTS\n", argv[0]);
  return 2;
}
