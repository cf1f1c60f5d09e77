#!/usr/bin/env bash
# The planner's accuracy: `trainguard plan --profile` on four models (debug, gpt2-124m,
# gpt2-350m, llama-125m) at three micro-batches and two sequence lengths each; prints a Markdown
# table of estimated vs measured peak and the error, plus each run's fixed + per-sample fit.
#
#   scripts/bench/plan_accuracy.sh                 # CPU: the analogue (peak resident set; see README)
#   scripts/bench/plan_accuracy.sh --device cuda   # GPU: the caching allocator's allocated_peak
#   scripts/bench/plan_accuracy.sh --savers [--device cuda]
#       gpt2-124m with each memory saver (activation checkpointing by block and in segments of
#       three, chunked loss, both, the lighter optimizers) instead of the four models
#   scripts/bench/plan_accuracy.sh --only llama-125m   # one model's rows (its label)
#
# llama-125m: configs/llama-debug.yaml resized to 12 layers, hidden 768, 12 query heads sharing
# 4 key/value heads, SwiGLU 2048, vocabulary 32000, untied head (124.7M parameters).

# CPU defaults keep it to a few minutes on 2 cores: short sequences, one step per size.
# Env: THREADS (default: all cores), STEPS (optimizer steps per size; default 1 on CPU, 2 on CUDA).
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
DEVICE=cpu; SAVERS=no; ONLY=
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=${2:?--device needs a value}; shift 2 ;;
    --savers) SAVERS=yes; shift ;;
    --only) ONLY=${2:?--only needs a label}; shift 2 ;;
    *) echo "usage: $0 [--device cpu|cuda] [--savers] [--only LABEL]" >&2; exit 2 ;;
  esac
done
THREADS=${THREADS:-$(nproc)}
if [ "$DEVICE" = cpu ]; then STEPS=${STEPS:-1}; else STEPS=${STEPS:-2}; fi
# label | config | sequence lengths | micro-batches | --set overrides
llama="model.n_layer=12 model.n_embd=768 model.n_head=12 model.n_kv_head=4 model.ffn_hidden=2048 model.vocab_size=32000 model.tie_embeddings=false"
if [ "$SAVERS" = yes ]; then
  if [ "$DEVICE" = cpu ]; then seq=256; else seq=1024; fi
  g=gpt2-124m.yaml; b="1,4,8"
  RUNS=("plain|$g|$seq|$b|"
        "chunked loss 256|$g|$seq|$b|memory.loss_chunk_tokens=256"
        "checkpointing (blocks)|$g|$seq|$b|memory.activation_checkpointing=blocks"
        "checkpointing (every_n:3)|$g|$seq|$b|memory.activation_checkpointing=every_n:3"
        "blocks + chunked 256|$g|$seq|$b|memory.activation_checkpointing=blocks memory.loss_chunk_tokens=256"
        "every_n:3 + chunked 256|$g|$seq|$b|memory.activation_checkpointing=every_n:3 memory.loss_chunk_tokens=256"
        "sgd|$g|$seq|$b|optimizer.name=sgd"
        "sgd_momentum|$g|$seq|$b|optimizer.name=sgd_momentum"
        "adafactor|$g|$seq|$b|optimizer.name=adafactor"
        "8-bit AdamW|$g|$seq|$b|optimizer.name=adamw8bit")
elif [ "$DEVICE" = cpu ]; then
  # Sizes on both sides of where activations overtake the gradients (end of backward) as the peak.
  RUNS=("debug|debug.yaml|64 128|8,16,32|" "gpt2-124m|gpt2-124m.yaml|128 256|1,4,8|" "gpt2-350m|gpt2-350m.yaml|64 256|1,2,4|"
        "llama-125m|llama-debug.yaml|128 256|1,4,8|$llama")
else
  RUNS=("debug|debug.yaml|64 256|8,16,32|" "gpt2-124m|gpt2-124m.yaml|512 1024|1,2,4|" "gpt2-350m|gpt2-350m.yaml|512 1024|1,2,4|"
        "llama-125m|llama-debug.yaml|512 1024|1,2,4|$llama")
fi
if [ -n "$ONLY" ]; then
  keep=(); for run in "${RUNS[@]}"; do [ "${run%%|*}" = "$ONLY" ] && keep+=("$run"); done
  [ ${#keep[@]} -gt 0 ] || { echo "--only: no run labelled \`$ONLY\`" >&2; exit 2; }
  RUNS=("${keep[@]}")
fi
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
echo "device $DEVICE, $STEPS step(s) of 2 micro-steps per size, $THREADS threads; $(date -u +%Y-%m-%d)" >&2
n=0
for run in "${RUNS[@]}"; do
  IFS='|' read -r label cfg seqs micros sets <<<"$run"
  extra=(); for s in $sets; do extra+=(--set "$s"); done
  for seq in $seqs; do
    echo "  $label seq $seq: micro-batches $micros" >&2
    n=$((n + 1))
    "$BIN" plan --config "configs/$cfg" --profile --json --device "$DEVICE" --micro-batches "$micros" \
      --profile-steps "$STEPS" --set model.seq_len="$seq" --set data.synthetic_tokens=1048576 \
      --set train.threads="$THREADS" "${extra[@]}" >"$out/$(printf %03d $n).json"
    echo "$label" >"$out/$(printf %03d $n).label"
  done
done
"$PY" - "$out" <<'PYEOF'
import glob, json, os, sys
MiB = 2**20
def size(b):
    return f"{b / 2**30:.3f} GiB" if b >= 2**30 else f"{b / MiB:.1f} MiB"
rows, worst = [], 0.0
files = sorted(glob.glob(os.path.join(sys.argv[1], "*.json")))
print("| config | params | seq | micro-batch | estimate | measured | error | peak at |")
print("|---|---|---|---|---|---|---|---|")
fits = []
for f in files:
    j = json.load(open(f)); p = j["profile"]
    name = open(f[:-5] + ".label").read().strip()
    for pt in p["points"]:
        if pt["measured_bytes"] is None:
            print(f"| {name} | {j['params']/1e6:.1f}M | {j['model']['seq_len']} | {pt['micro_batch']} | {size(pt['estimate_bytes'])} | out of memory | — | |")
            continue
        worst = max(worst, abs(pt["error_pct"]))
        print(f"| {name} | {j['params']/1e6:.1f}M | {j['model']['seq_len']} | {pt['micro_batch']} | "
              f"{size(pt['estimate_bytes'])} | {size(pt['measured_bytes'])} | {pt['error_pct']:+.1f}% | {pt['peak_phase']} |")
    if p["fit"]:
        f_, e_ = p["fit"], p["estimate_fit"]
        fits.append(f"| {name} | {j['model']['seq_len']} | {size(f_['fixed_bytes'])} + {size(f_['per_sample_bytes'])}/sample | "
                    f"{size(e_['fixed_bytes'])} + {size(e_['per_sample_bytes'])}/sample |")
print(f"\nlargest |error|: {worst:.1f}%\n")
print("| config | seq | least-squares line through the measured peaks | through the estimates |")
print("|---|---|---|---|")
print("\n".join(fits))
PYEOF
