"""Digests of each kernel's machine code: the bytes of its .text section in the cubin that nvcc makes of
model_new.py's CUDA source, one SHA-256 (first 16 hex digits) per kernel. Results record them (bench.py writes them
into results/<gpu>.json), so that evidence is tied to the machine code rather than to the source's text: a change
that leaves every digest as it was (comments, names, layout of the source) needs no new GPU run.

    python tools/machine_code.py                       # sm_90a digests of the current model_new.py, as JSON
    python tools/machine_code.py --arch sm_80 --source other/model_new.py
    python tools/machine_code.py --compare results/h100.json   # exit 1 if any kernel's digest differs

The build uses the flags the extension's build gives nvcc (torch's common nvcc flags, -O3, the C++ standard of
model_new._cuda_std()), so the digests match the code that ran, where the nvcc version is the same.
"""
import argparse
import hashlib
import importlib.util
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_ARCH = "sm_90a"


def load_module(path, name="model_new_for_digest"):
    """model_new.py (or another copy of it) as a module, without building anything (no CUDA here, or not wanted)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    import torch

    available = torch.cuda.is_available
    torch.cuda.is_available = lambda: False  # the module builds its extension at import only where CUDA is
    try:
        spec.loader.exec_module(module)
    finally:
        torch.cuda.is_available = available
    return module


def nvcc_version(nvcc="nvcc"):
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"release (\d+\.\d+), V([\d.]+)", out)
    return found.group(2) if found else out.strip().splitlines()[-1]


def build_flags(module, arch):
    from torch.utils import cpp_extension

    number = arch[3:]
    gencode = f"-gencode=arch=compute_{number},code={arch}"
    return [*cpp_extension.COMMON_NVCC_FLAGS, *module._cuda_cflags([gencode])]


def text_sections(cubin):
    """{section name: bytes} of an ELF64 little-endian cubin's .text.* sections (one per kernel or device function)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("expected a 64-bit little-endian ELF cubin, got another file")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx]
    names = cubin[strtab[4]:strtab[4] + strtab[5]]

    def name_at(offset):
        return names[offset:names.index(b"\0", offset)].decode()

    sections = {}
    for name_off, kind, _flags, _addr, offset, size, *_ in headers:
        name = name_at(name_off)
        if name.startswith(".text.") and kind != 8:  # 8: SHT_NOBITS
            sections[name[len(".text."):]] = cubin[offset:offset + size]
    return sections


FUSED = re.compile(r"conv3x3_min_tanh2_kernelINS_11FusedTraitsILNS_7MmaKindE(\d)E(.+?)Li(\d+)ELi(\d+)ELi(\d+)ELi(\d+)E"
                   r".*Lb([01])EEEv")


def mangled_tag(tag):
    """A precision tag of the kb25 namespace as it appears in a mangled template argument list: "Tf32x3" or
    "Native16<__half>" (one class-type argument)."""
    name, arg = re.fullmatch(r"(\w+)(?:<(\w+)>)?", tag).groups()
    return f"NS_{len(name)}{name}" + (f"I{len(arg)}{arg}E" if arg else "") + "E"


def kernel_names(mangled, table):
    """{mangled: name}: a fused kernel as its FUSED_TABLE row's name ("fused/<row>", "/save" for the variant that
    saves the argmin), so that it keeps its name when its template arguments are spelled otherwise; the other
    kernels as they are mangled (no demangler needed)."""
    rows = {(row.mma == "wgmma", mangled_tag(tag), row.tile_cols, row.consumers, row.producer_warps, row.ring): row.name
            for row, tag in table}
    names = {}
    for m in mangled:
        found = FUSED.search(m)
        row = None
        if found:
            mma, tag, *ints, save = found.groups()
            row = rows.get((mma == "1", tag, *map(int, ints)))
        names[m] = f"fused/{row}" + ("/save" if save == "1" else "") if row else m
    return names


def digests_of_cubin(cubin, table=()):
    code = text_sections(cubin)
    names = kernel_names(sorted(code), table)
    return {names[m]: hashlib.sha256(code[m]).hexdigest()[:16] for m in sorted(code, key=names.get)}


def cubin_of(source_text, flags, nvcc="nvcc"):
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "kernels.cu"), os.path.join(tmp, "kernels.cubin")
        with open(src, "w") as f:
            f.write(source_text)
        run = subprocess.run([nvcc, "-cubin", *flags, src, "-o", out], capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"nvcc failed on the CUDA source:\n{run.stderr[-4000:]}")
        with open(out, "rb") as f:
            return f.read()


def tag_table(module):
    """[(FUSED_TABLE row, its precision tag)] of a model_new module (an older one keys PRECISION_TAGS by precision)."""
    return [(row, row.tag if hasattr(row, "tag") else module.PRECISION_TAGS[row.precision]) for row in module.FUSED_TABLE]


def digests(source_path=os.path.join(HERE, "model_new.py"), arch=DEFAULT_ARCH, nvcc="nvcc"):
    """{"arch", "nvcc", "kernels": {mangled name: digest}} of the model_new.py at source_path."""
    module = load_module(source_path)
    cubin = cubin_of(module.cuda_source(), build_flags(module, arch), nvcc)
    table = tag_table(module)
    return {"arch": arch, "nvcc": nvcc_version(nvcc), "kernels": digests_of_cubin(cubin, table)}


def device_arch():
    """The nvcc code name the extension's build gives the current GPU (sm_90 is built as sm_90a)."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


def of_extension(module, arch=DEFAULT_ARCH):
    """The digests of the extension `module` (an imported model_new) has built and loaded: its cubin for `arch`,
    taken out of the library by cuobjdump; where cuobjdump is missing, nvcc's build of the module's CUDA source."""
    table = tag_table(module)
    lib = os.path.abspath(module._ext.__file__)
    try:
        version = nvcc_version()
    except (OSError, subprocess.CalledProcessError):
        version = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run(["cuobjdump", "-xelf", "all", lib], cwd=tmp, capture_output=True, check=True)
        except (OSError, subprocess.CalledProcessError):
            cubin = cubin_of(module.cuda_source(), build_flags(module, arch))
            return {"arch": arch, "nvcc": version, "from": "nvcc", "kernels": digests_of_cubin(cubin, table)}
        found = sorted(f for f in os.listdir(tmp) if f.endswith(f".{arch}.cubin"))
        if len(found) != 1:
            raise RuntimeError(f"expected one {arch} cubin in {lib}, got {found}")
        with open(os.path.join(tmp, found[0]), "rb") as f:
            cubin = f.read()
    return {"arch": arch, "nvcc": version, "from": "extension", "kernels": digests_of_cubin(cubin, table)}


def differences(recorded, current):
    """Kernels whose digest differs, or that only one side has."""
    a, b = recorded["kernels"], current["kernels"]
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default=os.path.join(HERE, "model_new.py"))
    p.add_argument("--arch", default=DEFAULT_ARCH, help="an nvcc code name such as sm_90a or sm_80")
    p.add_argument("--nvcc", default="nvcc")
    p.add_argument("--compare", metavar="JSON", help="a results file whose machine_code entry to compare with")
    args = p.parse_args()
    if not re.fullmatch(r"sm_\d+a?", args.arch):
        p.error(f"--arch expects an nvcc code name such as sm_90a, got {args.arch!r}")
    current = digests(args.source, args.arch, args.nvcc)
    if not args.compare:
        json.dump(current, sys.stdout, indent=1)
        print()
        return 0
    with open(args.compare) as f:
        recorded = json.load(f).get("machine_code")
    if not recorded:
        print(f"{args.compare} records no machine_code digests")
        return 1
    changed = differences(recorded, current)
    for name in changed:
        print(f"{name}: recorded {recorded['kernels'].get(name)}, now {current['kernels'].get(name)}")
    print(f"{len(changed)} of {len(current['kernels'])} kernels differ from {args.compare}")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
