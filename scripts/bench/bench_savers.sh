#!/usr/bin/env bash
# Memory savers, each measured: a GPT-2-124M-shaped model (12 × 768, vocab 50257) on this
# machine's CPU, sequence 256 and micro-batch 4 (1024 tokens a step) so a CPU finishes in
# minutes. For each switch: the process's peak resident memory above start-up (the CPU
# analogue of peak allocated, with glibc set as under memory.limit), tokens/s, both relative
# to the fp32 baseline, and `trainguard plan`'s estimate of peak allocated for the same switch
# with its error.
# On a GPU (`--device cuda`) the memory column is the caching allocator's peak allocated over
# the measured steps (the figure the planner estimates), not an analogue.
# Usage: scripts/bench/bench_savers.sh [--device cpu|cuda]   (env STEPS=3 THREADS=$(nproc); ONLY=<regex>
# keeps the switches whose name matches, beside the fp32 baseline the ratios need)
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
DEVICE=cpu
if [ "${1:-}" = "--device" ]; then DEVICE=${2:?--device needs a value}; fi
STEPS=${STEPS:-3}; THREADS=${THREADS:-$(nproc)}
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
shape=(--config configs/gpt2-124m.yaml --set model.seq_len=256 --set train.micro_batch_size=4 --set train.global_batch_size=4)
run=(--set train.max_steps=$((STEPS + 1)) --set train.warmup_steps=1 --set train.eval_interval=0 --set checkpoint.interval=0 --set checkpoint.at_end=false
     --set data.synthetic_tokens=1048576 --set train.threads="$THREADS" --set device="$DEVICE")
# On CPU a cap far above need puts glibc in the mode `memory.limit` and `plan --profile` use:
# freed large blocks go back to the system at once, so the peak is live memory, not what the
# heap happens to retain between steps.
[ "$DEVICE" != cpu ] || run+=(--set memory.limit=1TiB)

# name | trainguard --set overrides (the planner reads the same switches from the config)
variants=(
  "fp32 baseline|"
  "activation checkpointing|memory.activation_checkpointing=blocks"
  "checkpointing, first 6 of 12 blocks|memory.activation_checkpointing=first_n:6"
  "chunked loss (256 tokens)|memory.loss_chunk_tokens=256"
  "checkpointing + chunked loss|memory.activation_checkpointing=blocks memory.loss_chunk_tokens=256"
  "checkpointing + offload|memory.activation_checkpointing=blocks memory.offload_activations=true"
  "sgd_momentum|optimizer.name=sgd_momentum"
  "adafactor|optimizer.name=adafactor"
  "8-bit AdamW|optimizer.name=adamw8bit"
)
if [ "$DEVICE" = cpu ]; then mem_col="peak resident above start (MiB)"; else mem_col="peak allocated (MiB)"; fi
printf "| switch | $mem_col | vs fp32 | tokens/s | vs fp32 | planner peak allocated (MiB) | planner error |\n|---|---|---|---|---|---|---|\n"
base_mem=""; base_tps=""
for v in "${variants[@]}"; do
  IFS='|' read -r name sets <<<"$v"
  if [ -n "${ONLY:-}" ] && [ -n "$base_mem" ] && ! [[ $name =~ $ONLY ]]; then continue; fi
  args=(); for s in $sets; do args+=(--set "$s"); done
  rm -rf "${out:?}/run"  # a fresh run each time (trainguard refuses to start over another run's checkpoints)
  "$BIN" train "${shape[@]}" "${run[@]}" "${args[@]}" --set out_dir="$out/run" 2>"$out/run.err" \
    || { echo "trainguard failed on '$name':" >&2; tail -n 5 "$out/run.err" >&2; exit 1; }
  read -r mem tps < <("$PY" - "$out/run" "$DEVICE" <<'PYEOF'
import json, sys
d, device = sys.argv[1], sys.argv[2]
ev = [json.loads(l) for l in open(d + "/events.jsonl")]
m = [json.loads(l) for l in open(d + "/metrics.jsonl")][1:]
# CUDA: each metrics line holds the allocator's peak since the line before.
mem = ev[-1]["peak_resident_above_start_bytes"] if device == "cpu" else max(x["peak_allocated_bytes"] for x in m)
print(mem, sum(x["tokens"] for x in m) / sum(x["step_time_s"] for x in m))
PYEOF
)
  [ -n "$base_mem" ] || { base_mem=$mem; base_tps=$tps; }
  # The planner does not model offloading (the saved inputs leave the GPU, not the process).
  est=$("$BIN" plan "${shape[@]}" "${args[@]}" --gpu-memory 80GiB --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["estimate"]["peak_allocated"])')
  err=$("$PY" -c "print(f'{100*($est-$mem)/$mem:+.1f}%')"); est=$("$PY" -c "print(f'{$est/2**20:.0f}')")
  case "$sets" in *offload*) est="$est (offload not modelled)" ;; esac
  "$PY" -c "print(f'| $name | {$mem/2**20:.0f} | {$mem/$base_mem:.2f}x | {$tps:.0f} | {$tps/$base_tps:.2f}x | $est | $err |')"
done
