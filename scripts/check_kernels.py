#!/usr/bin/env python3
"""Compiles each kernel source of kernels/ (each its own module, as the
library embeds them, its #include "*.cuh" from kernels/) with NVRTC for
several GPU architectures and both activation dtypes, the way the library
does at run time, so a kernel that does not compile fails here, on a
machine without a GPU.

NVRTC comes from the `nvidia-cuda-nvrtc` wheel (PyPI), unpacked once into
~/.cache/nanoinfer/nvrtc (no pip install, no CUDA toolkit needed).

With --ptxas the PTX also goes through ptxas (from the `nvidia-cuda-nvcc`
wheel, 47 MB, unpacked once the same way), as the driver does when it loads
the module: that catches what NVRTC lets through (too much shared memory per
block, instructions the architecture lacks). --resources REGEX prints
ptxas's registers / shared memory / spills for the kernels it matches.

    python3 scripts/check_kernels.py [--arch 80,90a] [--nvrtc PATH/libnvrtc.so]
                                     [--ptxas [--resources 'w4a?_mm']] [-D NAME=VALUE ...]
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "nanoinfer", "nvrtc")


def from_wheel(package, wheel_dir, pattern, wanted=lambda name: True):
    """The file `pattern` matches under CACHE/nvidia/*/, unpacking the members
    `wanted` selects from `package`'s PyPI wheel into CACHE first if needed."""

    def cached():
        return [h for h in glob.glob(os.path.join(CACHE, "nvidia", "*", pattern)) if "builtins" not in h]

    if not cached():
        wheels = os.path.join(CACHE, wheel_dir)
        os.makedirs(wheels, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", wheels, package],
            check=True,
        )
        for whl in glob.glob(os.path.join(wheels, "*.whl")):
            with zipfile.ZipFile(whl) as z:
                for name in filter(wanted, z.namelist()):
                    z.extract(name, CACHE)
    hits = cached()
    if not hits:
        sys.exit(f"check_kernels: the {package} wheel holds no {pattern}")
    return hits[0]


def find_nvrtc():
    return from_wheel("nvidia-cuda-nvrtc", "wheel", os.path.join("lib", "libnvrtc.so*"))


def find_ptxas():
    ptxas = from_wheel(
        "nvidia-cuda-nvcc", "wheel-nvcc", os.path.join("bin", "ptxas"), lambda name: name.endswith("/bin/ptxas")
    )
    os.chmod(ptxas, 0o755)
    return ptxas


def run_ptxas(ptxas, ptx, arch, resources):
    """(ok, report): ptxas's errors, or the resource lines of the kernels `resources` matches."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "module.ptx")
        with open(src, "wb") as f:
            f.write(ptx)
        cmd = [ptxas, f"-arch=sm_{arch}", "-o", os.path.join(tmp, "module.cubin"), src]
        if resources:
            cmd.insert(1, "-v")
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return False, proc.stderr.strip()
    if not resources:
        return True, ""
    lines, current = [], None
    for line in proc.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m.group(1)
        elif current and re.search(resources, current) and ("Used" in line or "spill" in line):
            lines.append(f"  {current}: {line.split(':', 1)[-1].strip()}")
    return True, "\n".join(lines)


def module_files():
    """The .cu files src/backend/cuda/kernels.rs embeds, one module each."""
    rs = open(os.path.join(ROOT, "src", "backend", "cuda", "kernels.rs")).read()
    files = re.findall(r'include_str!\("\.\./\.\./\.\./kernels/([^"]+\.cu)"\)', rs)
    if not files:
        sys.exit("check_kernels: no include_str! of kernels/*.cu found in src/backend/cuda/kernels.rs")
    return files


def compile_once(lib, source, name, arch, f16, defines=()):
    prog = ctypes.c_void_p()
    check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source, name.encode(), 0, None, None), "create")
    opts = [f"--gpu-architecture=compute_{arch}".encode(), f"-DNI_F16={f16}".encode()]
    opts += [f"--include-path={os.path.join(ROOT, 'kernels')}".encode()]
    opts += [f"-D{d}".encode() for d in defines]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    status = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    ptx_size = ctypes.c_size_t()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size))
    ptx = ctypes.create_string_buffer(ptx_size.value)
    if status == 0:
        lib.nvrtcGetPTX(prog, ptx)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return status, log.value.decode(errors="replace").strip(), ptx.raw.rstrip(b"\0")


def check(lib, status, what):
    if status != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        sys.exit(f"check_kernels: nvrtc {what} failed: {lib.nvrtcGetErrorString(status).decode()}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="80,90a", help="compute capabilities, e.g. 80,89,90a (90a: sm_90, as the library compiles it)")
    ap.add_argument("--nvrtc", help="path of libnvrtc.so (default: the cached wheel)")
    ap.add_argument("--ptxas", action="store_true", help="also assemble the PTX with ptxas")
    ap.add_argument("--resources", help="with --ptxas: print resources of kernels matching this regex")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="NAME=VALUE, as NANOINFER_CUDA_DEFINES")
    args = ap.parse_args()
    lib = ctypes.CDLL(args.nvrtc or find_nvrtc())
    ptxas = find_ptxas() if args.ptxas else None
    failed = False
    entries = {}  # kernel name -> modules whose PTX defines it (first arch, bf16)
    for name in module_files():
        source = open(os.path.join(ROOT, "kernels", name), "rb").read()
        for arch in args.arch.split(","):
            for f16 in (0, 1):
                status, log, ptx = compile_once(lib, source, name, arch.strip(), f16, args.defines)
                what = f"{name} sm_{arch} {'f16' if f16 else 'bf16'}"
                if status != 0:
                    failed = True
                    print(f"{what}: FAILED\n{log}")
                    continue
                print(f"{what}: ok ({len(ptx)} bytes of PTX)" + (f"\n{log}" if log else ""))
                if not f16 and arch == args.arch.split(",")[0]:
                    for entry in re.findall(rb"\.entry\s+(\w+)", ptx):
                        entries.setdefault(entry.decode(), []).append(name)
                if ptxas:
                    ok, report = run_ptxas(ptxas, ptx, arch.strip(), args.resources)
                    failed |= not ok
                    print(f"{what} ptxas: {'ok' if ok else 'FAILED'}" + (f"\n{report}" if report else ""))
    # Every kernel the host loads (kernel_set! in kernels.rs) in exactly one module.
    rs = open(os.path.join(ROOT, "src", "backend", "cuda", "kernels.rs")).read()
    listed = re.search(r"kernel_set!\(([^)]*)\);", rs)
    for kernel in re.findall(r"\w+", listed.group(1)) if listed else []:
        where = entries.get(kernel, [])
        if len(where) != 1:
            failed = True
            print(f"kernel {kernel}: defined in {len(where)} modules {where}")
    if not listed:
        failed = True
        print("check_kernels: no kernel_set!(...) list in src/backend/cuda/kernels.rs")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
