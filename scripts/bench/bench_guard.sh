#!/usr/bin/env bash
# The OOM guard's cost, measured on this machine's CPU:
#  1. steady-state overhead with no OOM: tokens/s with `oom.policy: adapt` (guard on) against
#     `oom.policy: off` (the step called directly), same config and length, alternated ROUNDS
#     times; the best of each side is compared.
#  2. recovery latency: a run at micro-batch 64 under a memory cap that fits only 16 (calibrated
#     here from measured peaks) — time from each failed allocation to the first micro-step that
#     succeeds after it, from events.jsonl.
# Usage: scripts/bench/bench_guard.sh   (env: ROUNDS=3 STEPS=300 THREADS=$(nproc))
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-300}; THREADS=${THREADS:-$(nproc)}
out=$(mktemp -d)
common=(--config configs/debug.yaml --set train.threads="$THREADS" --set train.eval_interval=0 --set train.log_interval=1000)

tps() {  # mean tokens/s over steps 10.. of a run with policy $1
  rm -rf "${out:?}/$1"  # a fresh run each round (trainguard refuses to start over another run's checkpoints)
  "$BIN" train "${common[@]}" --set out_dir="$out/$1" --set train.max_steps="$STEPS" --set oom.policy="$1" 2>/dev/null
  "$PY" -c "
import json; m=[json.loads(l) for l in open('$out/$1/metrics.jsonl')][10:]
print(sum(x['tokens'] for x in m)/sum(x['step_time_s'] for x in m))"
}

echo "== steady-state overhead (configs/debug.yaml, $STEPS steps, $THREADS threads, best of $ROUNDS)"
on=0; off=0
for _ in $(seq "$ROUNDS"); do
  on=$("$PY" -c "print(max($on, $(tps adapt)))"); off=$("$PY" -c "print(max($off, $(tps off)))")
done
"$PY" -c "print(f'guard on  {$on:10.0f} tok/s\nguard off {$off:10.0f} tok/s\nA/B difference {100*(1-$on/$off):+.2f}% (negative = the guarded run was faster: run-to-run noise)')"
"$PY" -c "
import json; s=[json.loads(l) for l in open('$out/adapt/events.jsonl')][-1]
print(f\"guard's own time (outside the step, measured inside the guard): {s['guard_overhead_s']*1e6/s['steps']:.1f} us/step = {100*s['guard_overhead_s']/s['elapsed_s']:.4f}% of the run\")"

echo "== recovery latency (micro-batch 64 under a cap that fits 16)"
peak() {
  "$BIN" train "${common[@]}" --set out_dir="$out/p$1" --set train.max_steps=2 --set train.warmup_steps=0 \
    --set train.global_batch_size=64 --set train.micro_batch_size="$1" --set memory.limit=1TiB 2>/dev/null
  "$PY" -c "import json; print([json.loads(l) for l in open('$out/p$1/events.jsonl')][-1]['peak_mapped_above_start_bytes'])"
}
p16=$(peak 16); p32=$(peak 32); cap=$(( (p16 + p32) / 2 ))
"$BIN" train "${common[@]}" --set out_dir="$out/cap" --set train.max_steps=10 --set train.warmup_steps=0 \
  --set train.global_batch_size=64 --set train.micro_batch_size=64 --set memory.limit="$cap" 2>/dev/null
"$PY" - "$out/cap/events.jsonl" "$cap" <<'PYEOF'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
print(f"cap {int(sys.argv[2]) / 2**20:.1f} MiB above start-up")
for e in ev:
    if e["event"] == "oom_recovered":
        ms = e["recover_ms"]
        print(f"step {e['step']}: micro {e['old_micro_batch']} -> {e['new_micro_batch']}, "
              f"accumulation {e['old_accumulation']} -> {e['new_accumulation']}, "
              f"recovered in {'n/a (next size failed too)' if ms is None else f'{ms:.1f} ms'}")
s = ev[-1]
print(f"summary: {s['oom_recoveries']} recoveries, final micro-batch {s['final_micro_batch']}, time lost {s['time_lost_s']*1e3:.1f} ms of {s['elapsed_s']:.2f} s")
PYEOF
rm -rf "$out"
