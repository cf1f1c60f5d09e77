#!/usr/bin/env bash
# One shape trained under several sets of `--set` switches: tokens/s (the median of the steps
# from step 5 on) and the peak allocated, each against the first set. The table behind
# scripts/bench/bench_determinism.sh and scripts/bench/bench_kernels.sh.
# Usage: scripts/bench/bench_switches.sh [--device cuda|cpu] "CUDA SHAPE" "CPU SHAPE" "NAME|key=value key=value" ...
#   (env STEPS=30). A SHAPE: the config and the switches every variant shares on that device,
#   split at blanks. The device defaults to cuda.
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
DEVICE=cuda
if [ "${1:-}" = "--device" ]; then DEVICE=${2:?--device needs a value}; shift 2; fi
if [ "$DEVICE" = cpu ]; then shape_text=${2:?cpu shape}; else shape_text=${1:?cuda shape}; fi
read -r -a shape <<<"$shape_text"; shift 2
STEPS=${STEPS:-30}
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT; trap 'exit 143' TERM; trap 'exit 130' INT
run=(--set train.max_steps="$STEPS" --set train.warmup_steps=1 --set train.eval_interval=0 --set checkpoint.interval=0 --set checkpoint.at_end=false --set device="$DEVICE")

printf "| %s | tokens/s (median from step 5) | vs first | peak allocated (GiB) |\n|---|---|---|---|\n" "$DEVICE"
base=""; failed=0
for v in "$@"; do
  IFS='|' read -r name sets <<<"$v"
  args=(); for s in $sets; do args+=(--set "$s"); done
  dir="$out/$(echo "$name" | tr -c 'a-zA-Z0-9' _)"
  "$BIN" train "${shape[@]}" "${run[@]}" "${args[@]}" --set out_dir="$dir" >"$dir.log" 2>&1 \
    || { echo "| $name | failed: $(tail -n 3 "$dir.log" | tr '\n' ' ') | | |"; failed=1; continue; }
  read -r tps peak < <("$PY" -c 'import json, statistics, sys
m = [json.loads(l) for l in open(sys.argv[1])]
peak = max((x.get("peak_allocated_bytes") or 0) for x in m)
warm = [x["tokens_per_s"] for x in m if x["step"] > 5] or [x["tokens_per_s"] for x in m[1:]] or [x["tokens_per_s"] for x in m]
print(round(statistics.median(warm)), f"{peak / 2**30:.2f}" if peak else "-")' "$dir/metrics.jsonl")
  [ -n "$base" ] || base=$tps
  printf "| %s | %s | %.3f× | %s |\n" "$name" "$tps" "$("$PY" -c "print($tps / $base)")" "$peak"
done
exit $failed
