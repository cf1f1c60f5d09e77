#!/usr/bin/env bash
# The libraries' tests (trainguard-sys's and trainguard's) with the shim built under AddressSanitizer (TG_SANITIZE=address, build.rs).
# Those tests run our CUDA kernels' own source on the host emulation (crates/trainguard-sys/cpp/cuda_emulation.cpp)
# over CPU tensors, so a kernel that reads or writes past a tensor, which on a GPU is an illegal
# address (the process's CUDA context lost) or silent garbage, fails here on a machine without one.
#
#   bash scripts/test/asan_kernels.sh [test name filter…]
#
# Builds in CARGO_TARGET_DIR (default target/asan, so the normal build stays as it is: the first
# run builds the dependencies there, ~5 minutes on 2 cores; CI points it at target to reuse them,
# after its test run). Exit status: the tests' (0 all passed); 2 where libasan is missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
asan=$(${CXX:-c++} -print-file-name=libasan.so)
if [ ! -e "$asan" ]; then
  echo "asan_kernels: libasan.so not found beside ${CXX:-c++} (Debian: it comes with g++)" >&2
  exit 2
fi
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/asan}
exes=$(TG_SANITIZE=address cargo test --release --lib --no-run --message-format=json-render-diagnostics |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["executable"])')
[ "$(echo "$exes" | grep -c .)" -ge 2 ] || { echo "asan_kernels: cargo built no test binary for one of the two libraries: $exes" >&2; exit 1; }
# libtorch keeps its singletons to the end (no leak report); one test asks for an allocation no
# machine has and expects libtorch's out-of-memory error, which needs a null from the allocator.
# The load-waits test runs Python and NVIDIA's disassembler on machine code (no kernel of ours
# runs): skipped, so that they do not run with the sanitizer preloaded.
for exe in $exes; do
  echo "asan_kernels: $exe under $asan"
  ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:halt_on_error=1 LD_PRELOAD="$asan" "$exe" \
    --skip the_streaming_kernels_have_a_batch_of_loads_in_flight "$@"
done
