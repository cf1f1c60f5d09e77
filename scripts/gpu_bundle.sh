#!/usr/bin/env bash
# Builds what scripts/gpu_checks.sh needs on a GPU machine that has no Rust toolchain: the
# release binary, the GPU test binary (tests/gpu.rs), copied to a fixed name, and the optimizer
# benchmark (examples/bench_optimizers.rs). All load libtorch from that machine's torch
# (scripts/tools.sh sets LD_LIBRARY_PATH there).
#   scripts/gpu_bundle.sh   then carry target/release/trainguard, target/release/gpu-tests and
#                           target/release/examples/bench_optimizers
set -euo pipefail
source "$(dirname "$0")/tools.sh"
exe=$(cargo test --release --test gpu --no-run --message-format=json 2>/dev/null \
  | "$PY" -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')
cp "$exe" target/release/gpu-tests
cargo build --release --quiet --example bench_optimizers
ls -l target/release/trainguard target/release/gpu-tests target/release/examples/bench_optimizers
