#!/usr/bin/env python3
"""How many global loads each of our CUDA kernels has in flight before it first waits for one,
as the torch wheel's NVRTC compiles them for a GPU generation (no GPU needed).

    .venv/bin/python scripts/gpu/load_waits.py [name filter] [--arch sm_90] [--check]

Walks each kernel's machine code (nvdisasm, from the pinned `nvidia-cuda-nvdisasm` wheel that
scripts/setup.sh installs) in address order and cuts it at every instruction that reads or
overwrites a register an in-flight LDG is loading into: the sizes of the groups between those
waits. A kernel that streams rows through memory should issue a row's (or a batch's) loads as one
group; the fourth H100 session found ptxas splitting them into groups of 2 to 19 where a value
was converted as it was loaded, and those kernels ran at half the memory's speed. The walk
crosses every code path of a kernel in turn, so read the largest group, not the count.

--check: exit 1 unless each kernel of EXPECTED has a group of at least its listed loads.
"""
import ctypes
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_registers  # noqa: E402  NVRTC and our kernels' source, as cuda_jit.cpp compiles it

# The loads each kernel's hot loop issues together, and what they are (lanes load 4 bytes each
# unless packed: a 16-byte pack is 8 values of a 16-bit dtype, 4 of fp32).
ROW_VALUES = 32  # norm_kernels.cu's TG_ROW_VALUES: a lane's values of a row
PACKED_BATCH = 8  # linear_kernels.cu's TG_PACKED_BATCH: rows a lane loads before it adds
EXPECTED = {}
for dtype, packs in [("f32", 2), ("bf16", 1), ("f16", 1)]:
    EXPECTED[f"tg_ln_backward_warp_{dtype}"] = 3 * ROW_VALUES  # a row's dy, s and ds
    EXPECTED[f"tg_ln_forward_warp_{dtype}"] = 2 * ROW_VALUES  # a row's x and δ
    # the batch's dy (fp32: ptxas issues 4 rows, then a row's adds and two rows' loads in turn,
    # 4 rows ahead: the walk counts a wait at each add)
    EXPECTED[f"tg_col_sum_bands_packed_{dtype}"] = PACKED_BATCH
    EXPECTED[f"tg_gelu_backward_bands_{dtype}"] = 2 * PACKED_BATCH * packs  # its da and h
    # 8 pairs' two halves of x, and the cos and sin values of both halves (fp32: two packs each)
    EXPECTED[f"tg_rope_{dtype}"] = 2 * packs + 4 * 2


def nvdisasm():
    import torch  # the wheel's nvidia/cu13 sits beside site-packages/torch

    path = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia", "cu13", "bin", "nvdisasm")
    if not os.access(path, os.X_OK):
        sys.exit(f"no {path}: install it with `{sys.executable} -m pip install nvidia-cuda-nvdisasm==13.5.37` (scripts/setup.sh does)")
    return path


def cubin(arch):
    n, prog, _ = kernel_registers.compile_kernels(arch)
    size = ctypes.c_size_t()
    n.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    n.nvrtcGetCUBIN(prog, buf)
    return buf.raw


def kernels(sass):
    """{kernel name: its instructions (without predicate), in address order}."""
    out, name = {}, None
    for line in sass.splitlines():
        start = re.match(r"^\.text\.(\w+):", line)
        if start:
            name = start.group(1)
            out[name] = []
            continue
        ins = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if name and ins:
            out[name].append(re.sub(r"^@!?U?P\w+\s+", "", ins.group(1)))
    return out


def load_groups(instructions):
    """Sizes of the runs of LDGs issued between waits on one of them."""
    groups, inflight, run = [], set(), 0
    for ins in instructions:
        op, _, rest = ins.partition(" ")
        regs = [int(r) for r in re.findall(r"\bR(\d+)\b", rest)]
        if re.match(r"LDG(\.|$)", op) and regs:  # a load into registers (not LDGSTS, LDGDEPBAR)
            width = 4 if ".128" in op else 2 if ".64" in op else 1
            writes, reads = set(range(regs[0], regs[0] + width)), set(regs[1:])
        else:
            writes_first = regs and not op.startswith(("ST", "BRA", "ISETP", "FSETP", "BAR", "EXIT", "RED", "ATOM"))
            writes, reads = ({regs[0]}, set(regs[1:])) if writes_first else (set(), set(regs))
            if (reads | writes) & inflight:
                groups.append(run)
                run, inflight = 0, set()
            continue
        if reads & inflight:  # an address loaded by a load in flight
            groups.append(run)
            run, inflight = 0, set()
        run += 1
        inflight |= writes
    if run:
        groups.append(run)
    return [g for g in groups if g]


def main():
    args = sys.argv[1:]
    arch, check = "sm_90", "--check" in args
    args = [a for a in args if a != "--check"]
    if "--arch" in args:
        i = args.index("--arch")
        arch = args[i + 1]
        del args[i : i + 2]
    pattern = args[0] if args else ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin(arch))
        f.flush()
        sass = subprocess.run([nvdisasm(), "-c", f.name], check=True, capture_output=True, text=True).stdout
    found = kernels(sass)
    failed = []
    for name in sorted(found):
        if pattern not in name:
            continue
        groups = load_groups(found[name])
        largest = max(groups, default=0)
        want = EXPECTED.get(name)
        mark = "" if want is None else f"  (want a group of {want})" + ("" if largest >= want else "  FAILS")
        print(f"{name:36s} {sum(groups):4d} loads, largest group {largest:3d}, groups {groups[:24]}{mark}")
        if want is not None and largest < want:
            failed.append(name)
    missing = [k for k in EXPECTED if pattern in k and k not in found]
    if check and (failed or missing):
        sys.exit(f"loads not in flight together: {failed}; kernels not found: {missing}")


if __name__ == "__main__":
    main()
