#!/usr/bin/env python3
"""Compiles kernels/decoder.cu + int4.cu + sampling.cu (one module, as the
library embeds them) with NVRTC for several GPU architectures and
both activation dtypes, the way the library does at run time, so a kernel
that does not compile fails here, on a machine without a GPU.

NVRTC comes from the `nvidia-cuda-nvrtc` wheel (PyPI), unpacked once into
~/.cache/nanoinfer/nvrtc (no pip install, no CUDA toolkit needed).

    python3 scripts/check_kernels.py [--arch 80,90] [--nvrtc PATH/libnvrtc.so]
"""
import argparse
import ctypes
import glob
import os
import re
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "nanoinfer", "nvrtc")


def find_nvrtc():
    hits = glob.glob(os.path.join(CACHE, "nvidia", "*", "lib", "libnvrtc.so*"))
    hits = [h for h in hits if "builtins" not in h]
    if hits:
        return hits[0]
    os.makedirs(CACHE, exist_ok=True)
    wheels = os.path.join(CACHE, "wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", wheels, "nvidia-cuda-nvrtc"],
        check=True,
    )
    for whl in glob.glob(os.path.join(wheels, "*.whl")):
        zipfile.ZipFile(whl).extractall(CACHE)
    hits = [h for h in glob.glob(os.path.join(CACHE, "nvidia", "*", "lib", "libnvrtc.so*")) if "builtins" not in h]
    if not hits:
        sys.exit("check_kernels: the nvidia-cuda-nvrtc wheel holds no libnvrtc.so")
    return hits[0]


def module_files():
    """The .cu files of the module, in the order src/backend/cuda/kernels.rs embeds them."""
    rs = open(os.path.join(ROOT, "src", "backend", "cuda", "kernels.rs")).read()
    files = re.findall(r'include_str!\("\.\./\.\./\.\./kernels/([^"]+)"\)', rs)
    if not files:
        sys.exit("check_kernels: no include_str! of kernels/ found in src/backend/cuda/kernels.rs")
    return files


def compile_once(lib, source, arch, f16):
    prog = ctypes.c_void_p()
    check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"decoder.cu", 0, None, None), "create")
    opts = [f"--gpu-architecture=compute_{arch}".encode(), f"-DNI_F16={f16}".encode()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    status = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    ptx_size = ctypes.c_size_t()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx_size))
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return status, log.value.decode(errors="replace").strip(), ptx_size.value


def check(lib, status, what):
    if status != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        sys.exit(f"check_kernels: nvrtc {what} failed: {lib.nvrtcGetErrorString(status).decode()}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="80,90", help="compute capabilities, e.g. 80,89,90")
    ap.add_argument("--nvrtc", help="path of libnvrtc.so (default: the cached wheel)")
    args = ap.parse_args()
    lib = ctypes.CDLL(args.nvrtc or find_nvrtc())
    source = b"".join(open(os.path.join(ROOT, "kernels", f), "rb").read() for f in module_files())
    failed = False
    for arch in args.arch.split(","):
        for f16 in (0, 1):
            status, log, ptx = compile_once(lib, source, arch.strip(), f16)
            dtype = "f16" if f16 else "bf16"
            if status != 0:
                failed = True
                print(f"sm_{arch} {dtype}: FAILED\n{log}")
            else:
                print(f"sm_{arch} {dtype}: ok ({ptx} bytes of PTX)" + (f"\n{log}" if log else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
