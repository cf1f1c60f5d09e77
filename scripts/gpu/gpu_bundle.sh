#!/usr/bin/env bash
# Builds what scripts/gpu/gpu_checks.sh needs on a GPU machine that has no Rust toolchain: the
# release binary, the integration test binary (tests/it/, copied to gpu-tests; gpu_checks.sh runs
# its gpu:: module) and the optimizer benchmark example (optimizer-bench). All load libtorch from
# that machine's torch (scripts/tools.sh sets LD_LIBRARY_PATH there).
#   scripts/gpu/gpu_bundle.sh   then carry target/release/trainguard, target/release/gpu-tests and
#                           target/release/optimizer-bench
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
tests=$(cargo test --release --test it --no-run --message-format=json \
  | "$PY" -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "it":
        print(m["executable"])')
[ -n "$tests" ] || { echo "no test binary for tests/it/ (its build failed: above)" >&2; exit 1; }
cp "$tests" target/release/gpu-tests
cargo build --release --quiet -p trainguard --example optimizer_bench
cp target/release/examples/optimizer_bench target/release/optimizer-bench
ls -l target/release/trainguard target/release/gpu-tests target/release/optimizer-bench
