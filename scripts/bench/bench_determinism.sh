#!/usr/bin/env bash
# What `deterministic: true` and `memory.snapshot_on_oom` cost: GPT-2 124M (configs/gpt2-124m.yaml,
# bf16-mixed, sequence 1024, micro-batch 16, global 64), tokens/s as the median of the steps
# after warm-up, for the four combinations, each relative to both off. Needs a CUDA device
# (scripts/gpu/gpu_checks.sh part `detcost`); `--device cpu` runs the same table on a small model.
# Usage: scripts/bench/bench_determinism.sh [--device cuda|cpu]   (env STEPS=30)
exec bash "$(dirname "$0")/bench_switches.sh" "$@" \
  "--config configs/gpt2-124m.yaml --set precision=bf16-mixed --set train.micro_batch_size=16 --set train.global_batch_size=64" \
  "--config configs/debug.yaml --set model.seq_len=128 --set train.micro_batch_size=8 --set train.global_batch_size=16" \
  "both off|deterministic=false memory.snapshot_on_oom=false" \
  "memory.snapshot_on_oom|deterministic=false memory.snapshot_on_oom=true" \
  "deterministic|deterministic=true memory.snapshot_on_oom=false" \
  "both on|deterministic=true memory.snapshot_on_oom=true"
