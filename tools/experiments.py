"""Time variants of the fused kernel that leave one stage out, to place where its time goes.

The variants are textual edits of model_new.cuda_source(), built with plain nvcc into shared libraries and called
through the extern "C" launcher, so no torch extension build is involved. Only "base" computes the right answer;
the others are timing probes (they read stale or racing shared memory on purpose).

    python3 tools/experiments.py                 # time every variant, both MMA kinds
    python3 tools/experiments.py --only base --trials 3   # e.g. under ncu
"""
import argparse
import concurrent.futures
import ctypes
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import harness  # noqa: E402
import model_new  # noqa: E402

PREFETCH_WAIT = """    if (has_next) {
      if (has_next2) {
        cp_async_wait<1>();  // row oy+3 has landed; oy+4 may still be in flight
      } else {
        cp_async_wait<0>();
      }
      round_row_grouped<T>(slot(oy + 3));
    }
    __syncthreads();
  }
#endif"""


def variants():
    src = model_new.cuda_source()
    assert PREFETCH_WAIT in src
    # The probes edit the wgmma kernel only (the mma.sync kernel has its own, older pipeline).
    no_loads = src.replace("const bool has_next = (s + 1 < s_end) && (oy + 1 < OH);", "const bool has_next = false;")
    no_loads = no_loads.replace("const bool has_next2 = (s + 2 < s_end) && (oy + 2 < OH);",
                                "const bool has_next2 = false;")
    no_loads = no_loads.replace("if (s == s_begin || oy == 0) {\n      for (int r = 0; r < T::kKsize; ++r) "
                                "load_row_grouped", "if (s == s_begin) {\n      for (int r = 0; r < T::kKsize; ++r) "
                                "load_row_grouped")
    return {
        "base": src,
        # the next rows' copies are issued but never waited for: shows whether a step waits on memory
        "no_prefetch_wait": src.replace(PREFETCH_WAIT, "    __syncthreads();\n  }\n#endif"),
        # no copy at all after the first window: compute, epilogue and barriers only
        "no_row_loads": no_loads,
    }


def build(name, src, workdir):
    cu = os.path.join(workdir, f"{name}.cu")
    lib = os.path.join(workdir, f"{name}.so")
    with open(cu, "w") as f:
        f.write(src)
    cmd = ["nvcc", "-shared", "-Xcompiler", "-fPIC", "-O3", "-std=c++17",
           "-gencode=arch=compute_90a,code=sm_90a", "-o", lib, cu]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return lib


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", default=None)
    p.add_argument("--trials", type=int, default=20)
    args = p.parse_args()
    chosen = {k: v for k, v in variants().items() if args.only in (None, k)}
    workdir = tempfile.mkdtemp()
    with concurrent.futures.ThreadPoolExecutor(len(chosen)) as pool:
        libs = dict(zip(chosen, pool.map(lambda kv: build(kv[0], kv[1], workdir), chosen.items())))

    ref, _ = harness.make_models(0, device="cuda")
    w, b = ref.conv.weight.detach().contiguous(), ref.conv.bias.detach().contiguous()
    shape = (128, 16, 256, 256)
    x = harness.make_input(shape, seed=1, device="cuda")
    out = torch.empty(shape[0], 1, shape[2] - 2, shape[3] - 2, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with torch.no_grad():
        want = model_new.reference_math(x, w, b)
    print(f"{'variant':18s} {'mma':9s} {'median ms':>9s} {'min':>7s}  correct", flush=True)
    for name, lib in libs.items():
        fn = ctypes.CDLL(lib).launch_conv3x3_min_tanh2_tf32
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_bool,
                                               ctypes.c_int, ctypes.c_void_p]
        for use_wgmma in (True, False):
            def run():
                err = fn(x.data_ptr(), w.data_ptr(), b.data_ptr(), out.data_ptr(), shape[0], shape[2], shape[3],
                         use_wgmma, sms, None)
                assert err == 0, err

            run()
            torch.cuda.synchronize()
            ok = harness.compare(out, want)[0]
            t = harness.summarize(harness.time_cuda(run, trials=args.trials, warmup=2))
            kind = "wgmma" if use_wgmma else "mma_sync"
            print(f"{name:18s} {kind:9s} {t['median']:9.3f} {t['min']:7.3f}  {ok}", flush=True)


if __name__ == "__main__":
    main()
