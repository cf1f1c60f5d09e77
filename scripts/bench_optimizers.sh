#!/usr/bin/env bash
# One update of each optimizer against fused AdamW, timed in the same process on a model's real
# parameters (tests/optimizers.rs::print_update_time_against_fused_adamw; default
# configs/gpt2-124m.yaml). On a machine without Rust it runs the test binary that
# scripts/gpu_bundle.sh built (target/release/optimizer-bench).
#   scripts/bench_optimizers.sh [--device cpu|cuda] [config.yaml ...]   (env STEPS, default 10)
set -euo pipefail
source "$(dirname "$0")/tools.sh"
device=cpu; configs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=${2:?--device needs a value}; shift 2 ;;
    *) configs+=("$1"); shift ;;
  esac
done
[ ${#configs[@]} -gt 0 ] || configs=(configs/gpt2-124m.yaml)
for c in "${configs[@]}"; do
  if command -v cargo >/dev/null 2>&1; then
    TG_BENCH_DEVICE=$device TG_BENCH_CONFIG=$c cargo test --release --quiet --test optimizers -- \
      --ignored --nocapture --exact print_update_time_against_fused_adamw | grep -v '^$\|^\.$\|^running\|^test \|^test result'
  else
    [ -x target/release/optimizer-bench ] || { echo "no target/release/optimizer-bench: build it where cargo is (scripts/gpu_bundle.sh) and carry it" >&2; exit 2; }
    TG_BENCH_DEVICE=$device TG_BENCH_CONFIG=$c TRAINGUARD_REPO=$PWD target/release/optimizer-bench \
      --ignored --nocapture --exact print_update_time_against_fused_adamw | grep -v '^$\|^\.$\|^running\|^test \|^test result'
  fi
  echo
done
