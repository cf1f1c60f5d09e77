#!/usr/bin/env bash
# Two replicated Gloo ranks (a 13M-parameter GPT-2 at its micro-batch floor) under a per-rank CPU
# cap swept from FROM to TO MB, escalating to each level asked for: per cap, each rank's exit code
# and what the run came to (steps trained, or rank 0's first error line). The ranks must always
# agree: both finish, or both stop with the same code; a failed collective means they did not.
# The settings are tests/it/sharding.rs's HEAVY ones. `--repeat N` runs each cap N times: the
# last line counts the ranks that ended by a signal, and the exit status is 1 if any did (a rank
# that crashes on its way out, after its work or its error, loses the code torchrun acts on).
# PORT_BASE (default 29800) moves the ports the pairs use, for two sweeps at once.
#   scripts/bench/escalation_caps.sh [--from MB] [--to MB] [--step MB] [--repeat N] [--escalate "shard_parameters shard_gradients"]
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
from=196; to=268; step=3; repeat=1; escalations="shard_parameters shard_gradients"
while [ $# -gt 0 ]; do
  case "$1" in
    --from) from=${2:?}; shift 2 ;;
    --to) to=${2:?}; shift 2 ;;
    --step) step=${2:?}; shift 2 ;;
    --repeat) repeat=${2:?}; shift 2 ;;
    --escalate) escalations=${2:?}; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
sets=(model.n_embd=512 model.n_head=8 model.n_layer=4 train.global_batch_size=4 train.micro_batch_size=2
  oom.min_micro_batch=2 memory.activation_checkpointing=blocks train.max_steps=4 train.warmup_steps=1
  train.eval_interval=0 checkpoint.interval=0 dist.timeout_s=60 dist.bucket_mb=2 train.threads=1)
port=${PORT_BASE:-29800}; ranks=0; signalled=0
printf '%-17s %8s %7s %7s  %s\n' escalation "cap MB" "rank 0" "rank 1" outcome
for escalation in $escalations; do
  for mb in $(seq "$from" "$step" "$to"); do
    for try in $(seq 1 "$repeat"); do
      out=$work/$escalation-$mb-$try; port=$((port + 1))
      args=(train --config configs/debug.yaml --set "out_dir=$out" --set "memory.limit=${mb}000000" --set "oom.escalate=[$escalation]")
      for s in "${sets[@]}"; do args+=(--set "$s"); done
      for r in 0 1; do
        RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
          "$BIN" "${args[@]}" >"$out.$r.log" 2>&1 &
        eval "pid$r=\$!"
      done
      code0=0; code1=0
      wait "$pid0" || code0=$?
      wait "$pid1" || code1=$?
      if [ -f "$out/metrics.jsonl" ] && [ "$code0" = 0 ]; then
        outcome="trained $(wc -l <"$out/metrics.jsonl") steps, $(grep -c '"oom_escalated"' "$out/events.jsonl" || true) escalation(s)"
      else
        outcome=$(grep -m1 -o 'error: .*' "$out.0.log" | cut -c1-120 || true)
      fi
      printf '%-17s %8s %7s %7s  %s\n' "$escalation" "$mb" "$code0" "$code1" "$outcome"
      for code in "$code0" "$code1"; do
        ranks=$((ranks + 1))
        if [ "$code" -gt 128 ]; then signalled=$((signalled + 1)); fi
      done
    done
  done
done
echo "ended by a signal: $signalled of $ranks rank runs"
[ "$signalled" = 0 ]
