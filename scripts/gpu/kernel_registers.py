#!/usr/bin/env python3
"""Registers and spills per kernel of our CUDA source, as the torch wheel's NVRTC compiles it
for a GPU generation (no GPU needed): the figures BENCHMARKS.md quotes as "ptxas for sm_90".

    .venv/bin/python scripts/gpu/kernel_registers.py [name filter] [--arch sm_90] [--no-spills]

The source is what crates/trainguard-sys/src/kernels.rs hands NVRTC (optim, loss, norm, llama, linear kernels, in
that order) with cuda_jit.cpp's options, plus --ptxas-options=-v. Exit status 1 with the
compiler's log where it does not compile. --no-spills: exit 1 where a kernel the filter names
spills registers to memory, or none matches.
"""
import ctypes
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = ["optim_kernels.cu", "loss_kernels.cu", "norm_kernels.cu", "llama_kernels.cu", "linear_kernels.cu"]


def nvrtc():
    import torch  # the wheel's nvidia/cu13/lib sits beside site-packages/torch

    lib = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia", "cu13", "lib")
    for builtins in glob.glob(os.path.join(lib, "libnvrtc-builtins.so.13.*")):
        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(os.path.join(lib, "libnvrtc.so.13"))


def compile_kernels(arch, extra=()):
    """NVRTC's program for our kernels (cuda_jit.cpp's options plus `extra`) and its log; exits
    with the log where they do not compile."""
    src = "".join(open(os.path.join(ROOT, "crates", "trainguard-sys", "cuda", f)).read() for f in FILES)
    n = nvrtc()
    prog = ctypes.c_void_p()
    if n.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"optim_kernels.cu", 0, None, None) != 0:
        sys.exit("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), b"--fmad=false", b"--std=c++17", *extra]
    rc = n.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    n.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    n.nvrtcGetProgramLog(prog, log)
    text = log.value.decode()
    if rc != 0:
        print(text)
        sys.exit(1)
    return n, prog, text


def main():
    args = sys.argv[1:]
    arch = "sm_90"
    if "--arch" in args:
        i = args.index("--arch")
        arch = args[i + 1]
        del args[i : i + 2]
    no_spills = "--no-spills" in args
    if no_spills:
        args.remove("--no-spills")
    pattern = args[0] if args else ""
    _, _, text = compile_kernels(arch, [b"--ptxas-options=-v"])
    kernel = None
    matched, spilling = set(), set()
    for line in text.splitlines():
        entry = re.search(r"Compiling entry function '(\w+)'", line)
        if entry:
            kernel = entry.group(1)
        elif kernel and pattern in kernel and ("registers" in line or "spill" in line):
            figures = re.sub(r"^ptxas\s*(info\s*:|\.)?\s*", "", line.strip())
            print(f"{kernel:40s} {figures}")
            matched.add(kernel)
            if re.search(r"[1-9]\d* bytes spill (stores|loads)", figures):
                spilling.add(kernel)
    if no_spills and (spilling or not matched):
        sys.exit(f"spilling: {sorted(spilling)}" if spilling else f"no kernel matches {pattern!r}")


if __name__ == "__main__":
    main()
