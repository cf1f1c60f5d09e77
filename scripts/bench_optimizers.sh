#!/usr/bin/env bash
# One optimizer update of each optimizer against fused AdamW, timed in the same process on a
# model's real parameters (examples/bench_optimizers.rs; default configs/gpt2-124m.yaml).
#   scripts/bench_optimizers.sh [--device cpu|cuda] [config.yaml ...]   (env STEPS, default 10)
set -euo pipefail
source "$(dirname "$0")/tools.sh"
exe=target/release/examples/bench_optimizers
if command -v cargo >/dev/null 2>&1; then cargo build --release --quiet --example bench_optimizers; fi
[ -x "$exe" ] || { echo "no $exe: build it where cargo is (scripts/gpu_bundle.sh) and carry it" >&2; exit 2; }
device=(); configs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=(--device "${2:?--device needs a value}"); shift 2 ;;
    *) configs+=("$1"); shift ;;
  esac
done
[ ${#configs[@]} -gt 0 ] || configs=(configs/gpt2-124m.yaml)
for c in "${configs[@]}"; do "$exe" "${device[@]}" "$c"; echo; done
