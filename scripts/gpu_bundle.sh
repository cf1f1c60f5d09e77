#!/usr/bin/env bash
# Builds what scripts/gpu_checks.sh needs on a GPU machine that has no Rust toolchain: the
# release binary and two test binaries copied to fixed names: tests/gpu.rs (gpu-tests) and
# tests/optimizers.rs, whose ignored test is the optimizer benchmark (optimizer-bench). All load
# libtorch from that machine's torch (scripts/tools.sh sets LD_LIBRARY_PATH there).
#   scripts/gpu_bundle.sh   then carry target/release/trainguard, target/release/gpu-tests and
#                           target/release/optimizer-bench
set -euo pipefail
source "$(dirname "$0")/tools.sh"
test_binary() {  # test_binary NAME: the path of tests/NAME.rs's release test binary
  cargo test --release --test "$1" --no-run --message-format=json \
    | "$PY" -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$1"
}
for t in gpu:gpu-tests optimizers:optimizer-bench; do
  p=$(test_binary "${t%%:*}")
  [ -n "$p" ] || { echo "no test binary for tests/${t%%:*}.rs (its build failed: above)" >&2; exit 1; }
  cp "$p" "target/release/${t#*:}"
done
ls -l target/release/trainguard target/release/gpu-tests target/release/optimizer-bench
