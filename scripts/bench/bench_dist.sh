#!/usr/bin/env bash
# Data-parallel overhead on CPU: tokens/s of the same global batch with 1 process and with 2
# ranks under torchrun (Gloo), one thread per process, on this machine. Prints both and the
# scaling efficiency (2-rank tokens/s ÷ (2 × 1-rank tokens/s)), and the 2-rank cost relative to
# the 1-rank run with 2 threads (the same cores used another way).
# Usage: scripts/bench/bench_dist.sh [config] (default configs/bench-10m.yaml; env STEPS=8)
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
cfg=${1:-configs/bench-10m.yaml}; STEPS=${STEPS:-8}
out=$(mktemp -d)
common=(--config "$cfg" --set train.max_steps=$((STEPS + 2)) --set train.warmup_steps=1 --set train.eval_interval=0 --set checkpoint.interval=0 --set checkpoint.at_end=false)
tps() {  # mean tokens/s over steps 2.. of metrics.jsonl
  "$PY" -c "
import json; m=[json.loads(l) for l in open('$1/metrics.jsonl')][2:]
print(sum(x['tokens'] for x in m)/sum(x['step_time_s'] for x in m))"
}
"$BIN" train "${common[@]}" --set out_dir="$out/one1" --set train.threads=1 2>/dev/null
"$BIN" train "${common[@]}" --set out_dir="$out/one2" --set train.threads=2 2>/dev/null
"${TORCHRUN[@]}" --standalone --nproc_per_node=2 --no-python "$BIN" train "${common[@]}" \
  --set out_dir="$out/two" --set train.threads=1 >/dev/null 2>&1
one1=$(tps "$out/one1"); one2=$(tps "$out/one2"); two=$(tps "$out/two")
"$PY" -c "
print(f'config {\"$cfg\"}, {$STEPS} measured steps')
print(f'1 process, 1 thread : {$one1:10.0f} tok/s')
print(f'1 process, 2 threads: {$one2:10.0f} tok/s')
print(f'2 ranks, 1 thread   : {$two:10.0f} tok/s  (scaling efficiency {$two/(2*$one1)*100:.0f}% of 2x one rank; {$two/$one2:.2f}x the 2-thread process)')"
rm -rf "$out"
