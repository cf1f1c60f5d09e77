#!/usr/bin/env bash
# Throughput of trainguard against the same model, batch split and AdamW in PyTorch
# (scripts/reference/reference_gpt.py; scripts/reference/reference_llama_bench.py for configs with
# `model.arch: llama`), back to back on the same device and thread count, at the same shapes
# (the vocabulary padded alike: the config's `model.pad_vocab_to`, default 64, or --pad-vocab-to).
# PyTorch runs in eager mode with torch.optim.AdamW's default implementation and with fused=True
# (the kernel trainguard uses by default), and under torch.compile (default mode, fused AdamW):
# on by default on CUDA, opt-in on CPU (--compile: it needs a C++ compiler and compiles for
# minutes). Prints tokens/s, trainguard's MFU and its ratios to each. Usage:
#   scripts/bench/bench_vs_pytorch.sh [--device cpu|cuda] [--threads N] [--dtype fp32|bf16]
#       [--compile|--no-compile] [--pad-vocab-to N] [--global-batch N] [--peak-tflops F] [--trace DIR]
#       [--tg-set KEY=VALUE ...] [config.yaml ...]
# --global-batch N: sequences per optimizer step on both sides instead of the config's (a short
# measurement of a config made for a long run; the micro-batch stays the config's).
# --tg-set KEY=VALUE: a switch for trainguard's side only (repeatable), e.g. kernels.cuda_graphs=true.
# --dtype bf16: bf16-mixed (trainguard `precision: bf16-mixed`, PyTorch bf16 autocast).
# --trace DIR: after the timed steps each side profiles two more (trainguard's `metrics.trace`,
# the reference's torch.profiler) into DIR/<config>-<side>.json, and the tables of `trainguard
# trace` follow the figures: the sides' time by kind of work side by side (`--compare`), then
# each one's kernel by kernel.
# MFU = tokens/s × (6 × parameters + 12 × layers × width × sequence) ÷ peak; the peak defaults to
# an H100's dense bf16, 989 TFLOP/s (give your device's: an MFU on a CPU against it is tiny).
# Defaults: cpu, all cores, fp32, configs/debug.yaml, configs/bench-10m.yaml (GPT-2),
# configs/llama-debug.yaml and configs/bench-llama-10m.yaml (Llama). STEPS (30) and ROUNDS (2)
# from the environment.
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
device=cpu; threads=$(nproc); dtype=fp32; compile=""; pad=""; global=""; peak=989; trace=""; configs=(); tg_sets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --dtype) dtype=$2; shift 2 ;;
    --compile) compile=1; shift ;;
    --no-compile) compile=0; shift ;;
    --pad-vocab-to) pad=$2; shift 2 ;;
    --global-batch) global=$2; shift 2 ;;
    --peak-tflops) peak=$2; shift 2 ;;
    --trace) trace=$2; shift 2 ;;
    --tg-set) tg_sets+=(--set "$2"); shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "unknown option $1 (--help lists them)" >&2; exit 2 ;;
    *) configs+=("$1"); shift ;;
  esac
done
case "$dtype" in fp32) precision=fp32 ;; bf16) precision=bf16-mixed ;; *) echo "--dtype must be fp32 or bf16, got $dtype" >&2; exit 2 ;; esac
[ -n "$compile" ] || { [ "${device%%:*}" = cuda ] && compile=1 || compile=0; }
[ ${#configs[@]} -gt 0 ] || configs=(configs/debug.yaml configs/bench-10m.yaml configs/llama-debug.yaml configs/bench-llama-10m.yaml)
STEPS=${STEPS:-30}; WARMUP=3
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT; trap 'exit 143' TERM; trap 'exit 130' INT
tg_extra=(); ref_extra=()
[ -z "$pad" ] || { tg_extra=(--set "model.pad_vocab_to=$pad"); ref_extra=(--pad-vocab-to "$pad"); }
[ -z "$global" ] || { tg_extra+=(--set "train.global_batch_size=$global"); ref_extra+=(--global-batch "$global"); }
tg_extra+=(${tg_sets[@]+"${tg_sets[@]}"})

[ -z "$trace" ] || mkdir -p "$trace"
traced() { [ -n "$trace" ] && echo "$trace/$(basename "$1" .yaml)-$2.json"; }  # CONFIG SIDE: its trace file

trainguard_tps() {  # mean tokens/s over the steps after warm-up, from metrics.jsonl
  # A fresh run directory each time: trainguard refuses to start a fresh run over an old one, and
  # the old metrics must never be read back as this run's.
  rm -rf "$out/tg"
  local extra=0 tr=()
  [ -z "$trace" ] || { extra=2; tr=(--set "metrics.trace.from_step=$((STEPS + WARMUP + 1))"); }
  "$BIN" train --config "$1" --set out_dir="$out/tg" --set device="$device" --set train.threads="$threads" \
    --set precision="$precision" ${tg_extra[@]+"${tg_extra[@]}"} ${tr[@]+"${tr[@]}"} \
    --set train.max_steps=$((STEPS + WARMUP + extra)) --set train.warmup_steps=1 --set train.eval_interval=0 --set checkpoint.interval=0 --set checkpoint.at_end=false 2>"$out/tg.err" \
    || { echo "trainguard failed on $1:" >&2; cat "$out/tg.err" >&2; exit 1; }
  [ -z "$trace" ] || cp "$out"/tg/trace/*.json "$(traced "$1" trainguard)"
  "$PY" - "$out/tg/metrics.jsonl" "$WARMUP" "$STEPS" <<'PYEOF'
import json, sys
w, n = int(sys.argv[2]), int(sys.argv[3])
m = [json.loads(l) for l in open(sys.argv[1])][w:w + n]
print(sum(x["tokens"] for x in m) / sum(x["step_time_s"] for x in m))
PYEOF
}

pytorch_run() {  # CONFIG [reference options]: the reference's JSON line
  local c=$1 ref=scripts/reference/reference_gpt.py
  shift
  [ "$("$PY" -c 'import sys, yaml; print((yaml.safe_load(open(sys.argv[1])).get("model") or {}).get("arch", "gpt2"))' "$c")" = llama ] \
    && ref=scripts/reference/reference_llama_bench.py
  "$PY" "$ref" --config "$c" --steps "$STEPS" --warmup "$WARMUP" --threads "$threads" --device "$device" --dtype "$dtype" \
    ${ref_extra[@]+"${ref_extra[@]}"} "$@" 2>"$out/pt.err" | tail -n 1 \
    || { echo "the PyTorch reference failed on $c:" >&2; cat "$out/pt.err" >&2; exit 1; }
}
measured() { printf 'measured: %s %s %s %s %.0f tokens/s\n' "$1" "$device" "$dtype" "$2" "$3" >&2; }  # CONFIG SIDE TOKENS/S
field() { "$PY" -c 'import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"; }
best() { "$PY" -c "print(max($1, $2))"; }
ratio() { [ "$2" = 0 ] && echo - || "$PY" -c "print(f'{$1 / $2:.2f}x')"; }

printf '%-28s %6s %5s %11s %11s %11s %11s %7s %8s %8s %8s\n' \
  config device dtype trainguard pt-eager pt-fused pt-compile "tg-MFU" "tg/eager" "tg/fused" "tg/comp"
for cfg in "${configs[@]}"; do
  # Alternate them ROUNDS times and keep each one's best, so a noisy moment hurts none.
  tg=0; pt=0; pf=0; pc=0; flops=0
  for _ in $(seq "${ROUNDS:-2}"); do
    # Each measurement assigned on its own, so a failed run stops the script (set -e).
    # Each figure also on stderr as it comes: a run cut short (a device call's time limit)
    # keeps the ones measured before it.
    x=$(trainguard_tps "$cfg"); tg=$(best "$tg" "$x"); measured "$cfg" trainguard "$x"
    j=$(pytorch_run "$cfg"); pt=$(best "$pt" "$(field "$j" tokens_per_s)"); flops=$(field "$j" flops_per_token); measured "$cfg" pt-eager "$(field "$j" tokens_per_s)"
    j=$(pytorch_run "$cfg" --fused ${trace:+--trace "$(traced "$cfg" eager-fused)"}); pf=$(best "$pf" "$(field "$j" tokens_per_s)"); measured "$cfg" pt-fused "$(field "$j" tokens_per_s)"
    if [ "$compile" = 1 ]; then
      echo "measuring $cfg pt-compile (compiling first: minutes)" >&2
      j=$(pytorch_run "$cfg" --fused --compile ${trace:+--trace "$(traced "$cfg" compile)"}); pc=$(best "$pc" "$(field "$j" tokens_per_s)"); measured "$cfg" pt-compile "$(field "$j" tokens_per_s)"
    fi
  done
  mfu=$("$PY" -c "print(f'{100 * $tg * $flops / ($peak * 1e12):.3g}%')")
  printf '%-28s %6s %5s %11.0f %11.0f %11.0f %11s %7s %8s %8s %8s\n' "$cfg" "$device" "$dtype" "$tg" "$pt" "$pf" \
    "$([ "$pc" = 0 ] && echo - || printf '%.0f' "$pc")" "$mfu" "$(ratio "$tg" "$pt")" "$(ratio "$tg" "$pf")" "$(ratio "$tg" "$pc")"
done
echo "MFU: tokens/s × FLOPs per token (6N + 12·L·C·T, N without the padded rows) ÷ $peak TFLOP/s"
if [ -n "$trace" ]; then
  for cfg in "${configs[@]}"; do  # trainguard beside the others, then each one's own tables
    sides=()
    for side in trainguard eager-fused compile; do f=$(traced "$cfg" "$side"); [ ! -f "$f" ] || sides+=("$f"); done
    echo; "$BIN" trace --compare "${sides[@]}"
    for f in "${sides[@]}"; do echo; "$BIN" trace "$f"; done
  done
fi
rm -rf "$out"
