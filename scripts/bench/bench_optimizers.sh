#!/usr/bin/env bash
# One update of each optimizer against fused AdamW, timed in the same process on a model's real
# parameters (crates/trainguard/examples/optimizer_bench.rs; default configs/gpt2-124m.yaml). On a
# machine without Rust it runs the example binary scripts/gpu/gpu_bundle.sh built
# (target/release/optimizer-bench).
#   scripts/bench/bench_optimizers.sh [--device cpu|cuda] [config.yaml ...]   (env STEPS, default 10)
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
device=cpu; configs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=${2:?--device needs a value}; shift 2 ;;
    *) configs+=("$1"); shift ;;
  esac
done
[ ${#configs[@]} -gt 0 ] || configs=(configs/gpt2-124m.yaml)
if command -v cargo >/dev/null 2>&1; then
  cargo build --release --quiet -p trainguard --example optimizer_bench
  bench=target/release/examples/optimizer_bench
else
  bench=target/release/optimizer-bench
  [ -x "$bench" ] || { echo "no $bench: build it where cargo is (scripts/gpu/gpu_bundle.sh) and carry it" >&2; exit 2; }
fi
for c in "${configs[@]}"; do
  TG_BENCH_DEVICE=$device TG_BENCH_CONFIG=$c TRAINGUARD_REPO=$PWD "$bench" update
  echo
done
