"""The device code of model_new's CUDA source built by a CUDA release other than the nvcc at hand: that release's
front end and NVVM (NVRTC) and its ptxas, from the wheels NVIDIA publishes on PyPI (nvidia-cuda-nvrtc-cuXX,
nvidia-cuda-runtime-cuXX for the headers, nvidia-cuda-nvcc-cuXX for ptxas). What a GPU user builds with depends on
the CUDA their torch was built with (torch's cu126 and cu128 wheels: CUDA 12), while CI's nvcc is 13.0.

Every kernel the launchers instantiate is compiled, for each arch given, with torch's nvcc defines and the C++
standard model_new would pass for a torch built with that release. Host code is not covered: NVRTC compiles device
code only (the launchers are plain C++ and CUDA runtime calls, the same for every arch).

    python3 tools/toolkit_build.py --cuda 12.8 --arch 86 100 120

The wheels are fetched once with pip into $XDG_CACHE_HOME/kb25-toolkits (~/.cache by default). Prints, per arch,
the kernels built and ptxas's resources; exits 1 on an error, a stack frame or a spill.
"""
import argparse
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from unittest import mock

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import model_new  # noqa: E402

# Where the device code ends: the heading of the launchers (host code, CUDA runtime calls), in the bundle's spelling
# of csrc/launch.cu or the older single-file one.
LAUNCHERS = re.compile(r"^// (?:Launchers: raw pointers|=+ launchers$)", re.M)
# The instantiations of the table (`using Sm90Tf32 = FusedTraits<...>;`), one per FUSED_TABLE row, in its order.
INSTANTIATION = re.compile(r"^using (\w+) = FusedTraits<", re.M)
CPP_TYPES = {torch.float32: "float", torch.float64: "double", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
RELEASE = r"1[12]\.\d+"  # the releases NVIDIA's PyPI wheels (cu11, cu12) cover
CLEAN = "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
# NVRTC has no C++ standard library: what the device code takes from it, as NVRTC headers given with the program
# (host-side headers that nvcc takes from the host compiler, the same for every arch). A name missing here fails the
# build with "identifier ... is undefined": add it.
STD_HEADERS = {
    "type_traits": """#pragma once
namespace std {
template <bool B, class T, class F> struct conditional { using type = T; };
template <class T, class F> struct conditional<false, T, F> { using type = F; };
template <bool B, class T, class F> using conditional_t = typename conditional<B, T, F>::type;
template <class A, class B> inline constexpr bool is_same_v = false;
template <class A> inline constexpr bool is_same_v<A, A> = true;
}  // namespace std
""",
    # offsetof as CCCL defines it for NVRTC (whose front end has no __builtin_offsetof)
    "cstddef": """#pragma once
#define offsetof(type, member) (unsigned long long)((char*)&(((type*)0)->member) - (char*)0)
""",
    # host-only: the launchers' (after the device code) once-per-device opt-ins
    "atomic": "#pragma once\n",
    "mutex": "#pragma once\n",
    "cstdint": """#pragma once
typedef signed char int8_t; typedef short int16_t; typedef int int32_t; typedef long long int64_t;
typedef unsigned char uint8_t; typedef unsigned short uint16_t; typedef unsigned int uint32_t;
typedef unsigned long long uint64_t; typedef unsigned long long uintptr_t;
""",
}


class FetchError(RuntimeError):
    pass


_failed_fetches = {}  # root -> the FetchError of this process's attempt: one try per process (an offline GPU machine)


def fetch(release, cache=None):
    """The unpacked wheels of CUDA `release` ("12.8": the newest 12.8.x of each package), fetched with pip on first
    use: the directory holding nvidia/cuda_nvrtc, nvidia/cuda_runtime and nvidia/cuda_nvcc."""
    if not re.fullmatch(RELEASE, release):
        raise ValueError(f"--cuda: expected a CUDA 11 or 12 release such as 12.8, got {release!r}")
    cache = cache or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kb25-toolkits")
    root = os.path.join(cache, release)
    if root in _failed_fetches:
        raise _failed_fetches[root]
    parts = [os.path.join(root, "nvidia", d) for d in ("cuda_nvrtc", "cuda_runtime", "cuda_nvcc")]
    if not all(os.path.isdir(d) for d in parts):
        suffix = "cu" + release.split(".")[0]
        wheels = os.path.join(root, "wheels")
        pkgs = [f"nvidia-cuda-{p}-{suffix}=={release}.*" for p in ("nvrtc", "runtime", "nvcc")]
        run = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                              "--retries", "1", "--timeout", "20", "--dest", wheels, *pkgs], capture_output=True,
                             text=True, timeout=900)
        if run.returncode != 0:
            _failed_fetches[root] = FetchError(f"pip download {' '.join(pkgs)} failed: {run.stderr.strip()[-300:]}")
            raise _failed_fetches[root]
        for wheel in glob.glob(os.path.join(wheels, "*.whl")):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(root)
        ptxas = os.path.join(root, "nvidia", "cuda_nvcc", "bin", "ptxas")
        os.chmod(ptxas, 0o755)  # zipfile does not keep a file's mode
    return root


def kernel_names():
    """A name expression for every kernel the launchers instantiate: each FUSED_TABLE row for inference and saving,
    the epilogue's vector and scalar kernel per supported dtype, the backward kernels per backward dtype (the fed dW
    with B built by its consumers or its producer), and strict fp32's minima kernel (not a template: it is in the PTX
    whatever is named)."""
    traits = INSTANTIATION.findall(model_new.cuda_source())
    assert len(traits) == len(model_new.FUSED_TABLE), traits
    names = [f"&kb25::conv3x3_min_tanh2_kernel<kb25::{t}, {s}>" for t in traits for s in ("false", "true")]
    for dtype in model_new.SUPPORTED_DTYPES:
        vec = 16 // dtype.itemsize  # launch_min_dim1_tanh2_typed's kVec
        names += [f"&kb25::min_dim1_tanh2_kernel<{CPP_TYPES[dtype]}, {v}>" for v in (vec, 1)]
    for dtype in model_new.ARGMIN_BACKWARD_DTYPES:
        names += [f"&kb25::conv3x3_min_tanh2_{part}<{CPP_TYPES[dtype]}>"
                  for part in ("grad_input_kernel", "grad_weight_kernel", "grad_weight_reduce_kernel")]
        names += [f"&kb25::conv3x3_min_tanh2_grad_weight_fed_kernel<{CPP_TYPES[dtype]}, {b}>"
                  for b in ("false", "true")]
    return names + ["&kb25::conv3x3_min_refine_kernel"]


def device_source():
    src = model_new.cuda_source()
    found = LAUNCHERS.findall(src)
    assert len(found) == 1, f"the launchers' heading marks where the device code ends: found {found}"
    return src[:LAUNCHERS.search(src).start()]


def cuda_std(release):
    """The C++ standard model_new builds with for a torch built with CUDA `release`."""
    with mock.patch.object(torch.version, "cuda", release):
        return model_new._cuda_std()


def nvrtc_ptx(root, release, arch, std=None):
    """(PTX, log) of the device code for compute_<arch>, by the release's NVRTC; PTX None where it failed. std: the
    C++ standard, cuda_std(release) if None (which patches torch.version for a moment: a caller with threads that
    read it passes std)."""
    lib = os.path.join(root, "nvidia", "cuda_nvrtc", "lib")
    ctypes.CDLL(glob.glob(os.path.join(lib, "libnvrtc-builtins.so.*"))[0], mode=ctypes.RTLD_GLOBAL)
    nvrtc = ctypes.CDLL(sorted(glob.glob(os.path.join(lib, "libnvrtc.so.*")))[0])
    std = std or cuda_std(release)
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    # -default-device: the shared declarations name host functions without __host__, which NVRTC refuses otherwise
    opts = [f"--gpu-architecture=compute_{arch}", f"-std={std}", "-default-device",
            f"-I{os.path.join(root, 'nvidia', 'cuda_runtime', 'include')}",
            *(f for f in COMMON_NVCC_FLAGS if f.startswith("-D"))]
    prog = ctypes.c_void_p()
    names, texts = list(STD_HEADERS), list(STD_HEADERS.values())
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), device_source().encode(), b"model_new.cu", len(names),
                                    (ctypes.c_char_p * len(texts))(*[t.encode() for t in texts]),
                                    (ctypes.c_char_p * len(names))(*[n.encode() for n in names])) == 0
    for name in kernel_names():
        assert nvrtc.nvrtcAddNameExpression(prog, name.encode()) == 0, name
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts]))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    ptx = None
    if rc == 0:
        nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetPTX(prog, buf)
        ptx = buf.value.decode()
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx, f"NVRTC {release} {' '.join(opts)}: {'ok' if rc == 0 else f'error {rc}'}\n{log.value.decode()}"


def build(root, release, arch, workdir, std=None):
    """The release's build of the device code for sm_<arch>: (problems, report). problems lists what fails: an
    NVRTC or ptxas error, a kernel missing, a stack frame or spill. std: as nvrtc_ptx takes it."""
    ptx, log = nvrtc_ptx(root, release, arch, std)
    if ptx is None:
        return [f"sm_{arch}: NVRTC {release} failed"], log
    entries = len(re.findall(r"^\.(?:visible|weak) \.entry ", ptx, re.M))  # template kernels are .weak
    expected = len(kernel_names())
    problems = [] if entries == expected else [f"sm_{arch}: {entries} kernels, expected {expected}"]
    path = os.path.join(workdir, f"model_new_{release}_sm{arch}.ptx")
    with open(path, "w") as f:
        f.write(ptx)
    ptxas = os.path.join(root, "nvidia", "cuda_nvcc", "bin", "ptxas")
    run = subprocess.run([ptxas, f"-arch=sm_{arch}", "-O3", "-v", path, "-o", os.devnull], capture_output=True,
                         text=True, timeout=900)
    report = log + run.stdout + run.stderr
    if run.returncode != 0:
        problems.append(f"sm_{arch}: ptxas {release} failed: {run.stderr.strip()[-500:]}")
    # ptxas -v: per kernel, "Compiling entry function '<name>'", then its stack frame and spills
    resources = re.findall(r"entry function '(\w+)'.*?(\d+ bytes stack frame, \d+ bytes spill stores, \d+ bytes "
                           r"spill loads)", run.stderr, re.S)
    if run.returncode == 0 and len(resources) != entries:
        problems.append(f"sm_{arch}: ptxas reported {len(resources)} kernels of {entries}")
    problems += [f"sm_{arch}: {kernel}: {r}" for kernel, r in resources if r != CLEAN]
    return problems, report


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cuda", required=True, help="a CUDA 11 or 12 release, e.g. 12.8")
    p.add_argument("--arch", nargs="+", required=True, help="compute capabilities as nvcc spells them, e.g. 86 100")
    p.add_argument("--workdir", default=None, help="where the PTX goes (default: a temporary directory)")
    args = p.parse_args()
    for arch in args.arch:
        if not re.fullmatch(r"\d{2,3}a?", arch):
            p.error(f"--arch: expected a compute capability such as 86 or 100, got {arch!r}")
    try:
        root = fetch(args.cuda)
    except (ValueError, FetchError) as e:  # ValueError: not a release fetch() knows
        p.error(str(e))
    workdir = args.workdir or tempfile.mkdtemp(prefix="toolkit_build_")
    os.makedirs(workdir, exist_ok=True)
    failed = False
    for arch in args.arch:
        problems, report = build(root, args.cuda, arch, workdir)
        print(report.rstrip())
        print(f"== CUDA {args.cuda} sm_{arch}: " + ("; ".join(problems) if problems else
                                                   f"{len(kernel_names())} kernels, no error, stack frame or spill"),
              flush=True)
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
