#!/usr/bin/env bash
# What the `kernels:` switches buy: a Llama (configs/smollm2-135m.yaml, bf16-mixed, sequence
# 2048, micro-batch 8, global 32) with `kernels.fused_rms_norm` off and on, tokens/s and peak
# allocated. Needs a CUDA device (scripts/gpu_checks.sh part `kernels`); `--device cpu` runs
# configs/bench-llama-10m.yaml, where ATen has no fused RMSNorm and both rows run the same code.
# Usage: scripts/bench_kernels.sh [--device cuda|cpu]   (env STEPS=30)
exec bash "$(dirname "$0")/bench_switches.sh" "$@" \
  "--config configs/smollm2-135m.yaml --set train.micro_batch_size=8 --set train.global_batch_size=32" \
  "--config configs/bench-llama-10m.yaml --set train.micro_batch_size=8 --set train.global_batch_size=16" \
  "RMSNorm step by step|kernels.fused_rms_norm=false" \
  "RMSNorm fused|kernels.fused_rms_norm=true"
