#!/usr/bin/env bash
# What the `kernels:` switches buy: a Llama (configs/smollm2-135m.yaml, bf16-mixed, sequence
# 2048, micro-batch 8, global 32) with `kernels.fused_rms_norm` off and on, tokens/s and peak
# allocated. Needs a CUDA device (scripts/gpu_checks.sh part `kernels`); `--device cpu` runs
# configs/bench-llama-10m.yaml, where ATen has no fused RMSNorm and both rows run the same code.
# Usage: scripts/bench_kernels.sh [--device cuda|cpu]   (env STEPS=30)
set -euo pipefail
DEVICE=cuda
if [ "${1:-}" = "--device" ]; then DEVICE=${2:?--device needs a value}; fi
if [ "$DEVICE" = cpu ]; then
  shape="--config configs/bench-llama-10m.yaml --set train.micro_batch_size=8 --set train.global_batch_size=16"
else
  shape="--config configs/smollm2-135m.yaml --set train.micro_batch_size=8 --set train.global_batch_size=32"
fi
exec bash "$(dirname "$0")/bench_switches.sh" "$DEVICE" "$shape" \
  "RMSNorm step by step|kernels.fused_rms_norm=false" \
  "RMSNorm fused|kernels.fused_rms_norm=true"
