#!/usr/bin/env bash
# What `deterministic: true` and `memory.snapshot_on_oom` cost: GPT-2 124M (configs/gpt2-124m.yaml,
# bf16-mixed, sequence 1024, micro-batch 16, global 64), tokens/s as the median of the steps
# after warm-up, for the four combinations, each relative to both off. Needs a CUDA device
# (scripts/gpu_checks.sh part `detcost`); `--device cpu` runs the same table on a small model.
# Usage: scripts/bench_determinism.sh [--device cuda|cpu]   (env STEPS=30)
set -euo pipefail
source "$(dirname "$0")/tools.sh"
DEVICE=cuda
if [ "${1:-}" = "--device" ]; then DEVICE=${2:?--device needs a value}; fi
STEPS=${STEPS:-30}
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
if [ "$DEVICE" = cpu ]; then
  shape=(--config configs/debug.yaml --set model.seq_len=128 --set train.micro_batch_size=8 --set train.global_batch_size=16)
else
  shape=(--config configs/gpt2-124m.yaml --set precision=bf16-mixed --set train.micro_batch_size=16 --set train.global_batch_size=64)
fi
run=(--set train.max_steps="$STEPS" --set train.warmup_steps=1 --set train.eval_interval=0 --set checkpoint.interval=0 --set device="$DEVICE")

# name | --set overrides
variants=(
  "both off|deterministic=false memory.snapshot_on_oom=false"
  "memory.snapshot_on_oom|deterministic=false memory.snapshot_on_oom=true"
  "deterministic|deterministic=true memory.snapshot_on_oom=false"
  "both on|deterministic=true memory.snapshot_on_oom=true"
)
printf "| %s | tokens/s (median after step 5) | vs both off |\n|---|---|---|\n" "$DEVICE"
base=""
for v in "${variants[@]}"; do
  IFS='|' read -r name sets <<<"$v"
  args=(); for s in $sets; do args+=(--set "$s"); done
  dir="$out/$(echo "$name" | tr -c 'a-z0-9' _)"
  "$BIN" train "${shape[@]}" "${run[@]}" "${args[@]}" --set out_dir="$dir" >"$dir.log" 2>&1 \
    || { echo "| $name | failed: $(tail -n 3 "$dir.log" | tr '\n' ' ') | |"; continue; }
  tps=$("$PY" -c 'import json, statistics, sys
m = [json.loads(l) for l in open(sys.argv[1])]
print(round(statistics.median(x["tokens_per_s"] for x in m if x["step"] >= 5)))' "$dir/metrics.jsonl")
  [ -n "$base" ] || base=$tps
  printf "| %s | %s | %.3f× |\n" "$name" "$tps" "$("$PY" -c "print($tps / $base)")"
done
