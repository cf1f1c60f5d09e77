#!/usr/bin/env bash
# Memory savers, each measured: a GPT-2-124M-shaped model (12 × 768, vocab 50257) on this
# machine's CPU, sequence 256 and micro-batch 4 (1024 tokens a step) so a CPU finishes in
# minutes. For each switch: the process's peak resident memory above start-up (the CPU
# analogue of peak allocated), tokens/s, both relative to the fp32 baseline, and
# `trainguard plan`'s estimate of peak allocated for the same switch with its error.
# Usage: scripts/bench_savers.sh   (env STEPS=3 THREADS=$(nproc))
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
cargo build --release --quiet
BIN=target/release/trainguard; PY=.venv/bin/python
STEPS=${STEPS:-3}; THREADS=${THREADS:-$(nproc)}
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
shape=(--config configs/gpt2-124m.yaml --set model.seq_len=256 --set train.micro_batch_size=4 --set train.global_batch_size=4)
run=(--set train.max_steps=$((STEPS + 1)) --set train.warmup_steps=1 --set train.eval_interval=0 --set checkpoint.interval=0
     --set data.synthetic_tokens=1048576 --set train.threads="$THREADS")

# name | trainguard --set overrides | planner flags ("-" = the planner has no knob for it)
variants=(
  "fp32 baseline||"
  "activation checkpointing|memory.activation_checkpointing=blocks|--activation-checkpointing"
  "chunked loss (256 tokens)|memory.loss_chunk_tokens=256|-"
  "checkpointing + chunked loss|memory.activation_checkpointing=blocks memory.loss_chunk_tokens=256|-"
  "checkpointing + offload|memory.activation_checkpointing=blocks memory.offload_activations=true|--activation-checkpointing"
  "sgd_momentum|optimizer.name=sgd_momentum|--optimizer sgd_momentum"
  "adafactor|optimizer.name=adafactor|--optimizer adafactor"
  "8-bit AdamW|optimizer.name=adamw8bit|--optimizer adamw8bit"
)
printf '| switch | peak resident above start (MiB) | vs fp32 | tokens/s | vs fp32 | planner peak allocated (MiB) | planner error |\n|---|---|---|---|---|---|---|\n'
base_mem=""; base_tps=""
for v in "${variants[@]}"; do
  IFS='|' read -r name sets plan_flags <<<"$v"
  args=(); for s in $sets; do args+=(--set "$s"); done
  rm -rf "$out/run"
  "$BIN" train "${shape[@]}" "${run[@]}" "${args[@]}" --set out_dir="$out/run" 2>/dev/null
  read -r mem tps < <("$PY" - "$out/run" <<'PYEOF'
import json, sys
d = sys.argv[1]
ev = [json.loads(l) for l in open(d + "/events.jsonl")]
m = [json.loads(l) for l in open(d + "/metrics.jsonl")][1:]
print(ev[-1]["peak_resident_above_start_bytes"], sum(x["tokens"] for x in m) / sum(x["step_time_s"] for x in m))
PYEOF
)
  [ -n "$base_mem" ] || { base_mem=$mem; base_tps=$tps; }
  if [ "$plan_flags" = "-" ]; then est="not modelled"; err="—"; else
    est=$("$BIN" plan "${shape[@]}" --gpu-memory 80GiB --json $plan_flags | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["estimate"]["peak_allocated"])')
    err=$("$PY" -c "print(f'{100*($est-$mem)/$mem:+.1f}%')"); est=$("$PY" -c "print(f'{$est/2**20:.0f}')"); fi
  "$PY" -c "print(f'| $name | {$mem/2**20:.0f} | {$mem/$base_mem:.2f}x | {$tps:.0f} | {$tps/$base_tps:.2f}x | $est | $err |')"
done
