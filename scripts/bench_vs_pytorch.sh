#!/usr/bin/env bash
# Throughput of trainguard against the same model, batch split and AdamW in plain PyTorch
# (scripts/reference_gpt.py, eager mode), back to back on the same device and thread count.
# Prints tokens/s of both and the ratio per config. Usage:
#   scripts/bench_vs_pytorch.sh [--device cpu|cuda] [--threads N] [config.yaml ...]
# Defaults: cpu, all cores, configs/debug.yaml and configs/bench-10m.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
device=cpu; threads=$(nproc); configs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    *) configs+=("$1"); shift ;;
  esac
done
[ ${#configs[@]} -gt 0 ] || configs=(configs/debug.yaml configs/bench-10m.yaml)
[ -x .venv/bin/python ] || bash scripts/setup.sh
cargo build --release --quiet
BIN=target/release/trainguard
PY=.venv/bin/python
STEPS=${STEPS:-30}; WARMUP=3
out=$(mktemp -d)

trainguard_tps() {  # mean tokens/s over the steps after warm-up, from metrics.jsonl
  "$BIN" train --config "$1" --set out_dir="$out/tg" --set device="$device" --set train.threads="$threads" \
    --set train.max_steps=$((STEPS + WARMUP)) --set train.warmup_steps=1 --set train.eval_interval=0 2>/dev/null
  "$PY" - "$out/tg/metrics.jsonl" "$WARMUP" <<'PYEOF'
import json, sys
m = [json.loads(l) for l in open(sys.argv[1])][int(sys.argv[2]):]
print(sum(x["tokens"] for x in m) / sum(x["step_time_s"] for x in m))
PYEOF
}

printf '%-26s %8s %14s %14s %7s\n' config device trainguard pytorch ratio
for cfg in "${configs[@]}"; do
  # Alternate the two twice and keep each side's best, so a noisy moment hurts neither.
  best_tg=0; best_pt=0
  for _ in 1 2; do
    tg=$(trainguard_tps "$cfg")
    pt=$("$PY" scripts/reference_gpt.py --config "$cfg" --steps "$STEPS" --warmup "$WARMUP" --threads "$threads" --device "$device" \
         | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_s"])')
    best_tg=$("$PY" -c "print(max($best_tg, $tg))"); best_pt=$("$PY" -c "print(max($best_pt, $pt))")
  done
  printf '%-26s %8s %14.0f %14.0f %6.2fx\n' "$cfg" "$device" "$best_tg" "$best_pt" "$("$PY" -c "print($best_tg / $best_pt)")"
done
rm -rf "$out"
