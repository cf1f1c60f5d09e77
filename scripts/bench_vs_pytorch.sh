#!/usr/bin/env bash
# Throughput of trainguard against the same model, batch split and AdamW in plain PyTorch
# (scripts/reference_gpt.py, eager mode; scripts/reference_llama_bench.py for configs with
# `model.arch: llama`), back to back on the same device and thread count.
# PyTorch runs twice: with torch.optim.AdamW's default implementation and with fused=True (the
# kernel trainguard uses by default). Prints tokens/s and trainguard's ratio to each. Usage:
#   scripts/bench_vs_pytorch.sh [--device cpu|cuda] [--threads N] [config.yaml ...]
# Defaults: cpu, all cores, configs/debug.yaml, configs/bench-10m.yaml (GPT-2),
# configs/llama-debug.yaml and configs/bench-llama-10m.yaml (Llama).
set -euo pipefail
source "$(dirname "$0")/tools.sh"
device=cpu; threads=$(nproc); configs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    *) configs+=("$1"); shift ;;
  esac
done
[ ${#configs[@]} -gt 0 ] || configs=(configs/debug.yaml configs/bench-10m.yaml configs/llama-debug.yaml configs/bench-llama-10m.yaml)
STEPS=${STEPS:-30}; WARMUP=3
out=$(mktemp -d)

trainguard_tps() {  # mean tokens/s over the steps after warm-up, from metrics.jsonl
  # A fresh run directory each time: trainguard refuses to start a fresh run over an old one, and
  # the old metrics must never be read back as this run's.
  rm -rf "$out/tg"
  "$BIN" train --config "$1" --set out_dir="$out/tg" --set device="$device" --set train.threads="$threads" \
    --set train.max_steps=$((STEPS + WARMUP)) --set train.warmup_steps=1 --set train.eval_interval=0 2>"$out/tg.err" \
    || { echo "trainguard failed on $1:" >&2; cat "$out/tg.err" >&2; exit 1; }
  "$PY" - "$out/tg/metrics.jsonl" "$WARMUP" <<'PYEOF'
import json, sys
m = [json.loads(l) for l in open(sys.argv[1])][int(sys.argv[2]):]
print(sum(x["tokens"] for x in m) / sum(x["step_time_s"] for x in m))
PYEOF
}

pytorch_tps() {
  local ref=scripts/reference_gpt.py
  [ "$("$PY" -c 'import sys, yaml; print((yaml.safe_load(open(sys.argv[1])).get("model") or {}).get("arch", "gpt2"))' "$1")" = llama ] \
    && ref=scripts/reference_llama_bench.py
  "$PY" "$ref" --config "$1" --steps "$STEPS" --warmup "$WARMUP" --threads "$threads" --device "$device" ${2:-} \
    | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_s"])'
}

printf '%-24s %6s %11s %11s %11s %9s %9s\n' config device trainguard pytorch pt-fused "tg/pt" "tg/fused"
for cfg in "${configs[@]}"; do
  # Alternate the three ROUNDS times and keep each one's best, so a noisy moment hurts none.
  tg=0; pt=0; pf=0
  for _ in $(seq "${ROUNDS:-2}"); do
    # Each measurement assigned on its own, so a failed run stops the script (set -e).
    x=$(trainguard_tps "$cfg"); tg=$("$PY" -c "print(max($tg, $x))")
    x=$(pytorch_tps "$cfg"); pt=$("$PY" -c "print(max($pt, $x))")
    x=$(pytorch_tps "$cfg" --fused); pf=$("$PY" -c "print(max($pf, $x))")
  done
  printf '%-24s %6s %11.0f %11.0f %11.0f %8.2fx %8.2fx\n' "$cfg" "$device" "$tg" "$pt" "$pf" \
    "$("$PY" -c "print($tg / $pt)")" "$("$PY" -c "print($tg / $pf)")"
done
rm -rf "$out"
