#!/usr/bin/env bash
# Training time lost per checkpoint, synchronous against background (`checkpoint.async`), for
# GPT-2-124M's state (weights and AdamW moments: 1.5 GB) on this machine's CPU and disk.
# Three runs of the same steps, in turn, ROUNDS times: no checkpoint, `checkpoint.async: false`,
# `checkpoint.async: true`, checkpointing every EVERY steps (the last checkpoint is an
# interval's too, so the background run's end waits for it, and that wait counts). A short
# sequence (64 tokens, micro-batch 1) keeps a step short beside a checkpoint; one training
# thread, so the writer has a core of its own as on a machine with cores to spare.
# Time lost per checkpoint, from each run's metrics: its wall time from the first step to the
# end (`session_elapsed_s`) less the time inside its optimizer steps (`step_time_s` summed), less
# the same for the run without checkpoints, over the checkpoints: what training waited for (a
# synchronous write; the copy and any wait for the writer). The writer's competition for
# memory bandwidth shows as slower steps: the mean step time of each run is printed beside it.
# On a shared machine step times vary by more than a checkpoint costs, so whole-run wall times
# would not measure it; the time outside the steps does. Medians over the rounds; the last line
# prints the ratio background / synchronous.
# Checkpoints go under target/ (on the disk, not a tmpfs: fsync must reach the device).
# Usage: scripts/bench/bench_async_checkpoint.sh   (env ROUNDS=1 THREADS=1 STEPS=7 EVERY=2)
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
ROUNDS=${ROUNDS:-1}; THREADS=${THREADS:-1}; STEPS=${STEPS:-7}; EVERY=${EVERY:-2}
out=$PWD/target/bench-async-checkpoint; rm -rf "$out"; mkdir -p "$out"; trap 'rm -rf "$out"' EXIT
run=(--config configs/gpt2-124m.yaml --set model.seq_len=64 --set train.micro_batch_size=1
     --set train.global_batch_size=1 --set train.max_steps="$STEPS" --set train.warmup_steps=1
     --set train.eval_interval=0 --set checkpoint.at_end=false --set checkpoint.keep_last=1
     --set data.synthetic_tokens=1048576 --set train.threads="$THREADS" --set device=cpu)
n_ckpt=$((STEPS / EVERY))
[ $((STEPS % EVERY)) -ne 0 ] || { echo "STEPS must not be a multiple of EVERY (the last step's checkpoint is written at once)" >&2; exit 2; }

# name | --set overrides
variants=(
  "none|checkpoint.interval=0"
  "sync|checkpoint.interval=$EVERY checkpoint.async=false"
  "async|checkpoint.interval=$EVERY checkpoint.async=true"
)
: >"$out/times"
for round in $(seq "$ROUNDS"); do
  for v in "${variants[@]}"; do
    IFS='|' read -r name sets <<<"$v"
    args=(); for s in $sets; do args+=(--set "$s"); done
    rm -rf "${out:?}/run"
    "$BIN" train "${run[@]}" "${args[@]}" --set out_dir="$out/run" 2>"$out/run.err" \
      || { echo "trainguard failed on '$name':" >&2; tail -n 5 "$out/run.err" >&2; exit 1; }
    "$PY" - "$out/run" "$name" "$round" >>"$out/times" <<'PYEOF'
import json, sys
d, name, rnd = sys.argv[1:]
ev = [json.loads(l) for l in open(d + "/events.jsonl")]
steps = [json.loads(l) for l in open(d + "/metrics.jsonl")]
end = [e for e in ev if e["event"] == "run_finished"][-1]
saved = [e for e in ev if e["event"] == "checkpoint_saved"]
waits = sum(e["seconds"] for e in ev if e["event"] == "checkpoint_waited")
write = sum(e["seconds"] for e in saved) / max(len(saved), 1)
outside = end["session_elapsed_s"] - sum(m["step_time_s"] for m in steps)
step = sum(m["step_time_s"] for m in steps[1:]) / (len(steps) - 1)
print(name, rnd, outside, len(saved), write, waits, step)
PYEOF
  done
done
"$PY" - "$out/times" "$n_ckpt" <<'PYEOF'
import statistics as st, sys
rows = [l.split() for l in open(sys.argv[1])]
n = int(sys.argv[2])
by = lambda name, col: [float(r[col]) for r in rows if r[0] == name]
base = st.median(by("none", 2))
print("| run | checkpoints | write (s) | outside the steps (s) | waited for the writer (s) | mean step (s) | lost per checkpoint (s) |")
print("|---|---|---|---|---|---|---|")
lost = {}
for name in ["none", "sync", "async"]:
    count = int(by(name, 3)[0])
    lost[name] = (st.median(by(name, 2)) - base) / n
    write = f"{st.median(by(name, 4)):.2f}" if count else "-"
    print(f"| {name} | {count} | {write} | {st.median(by(name, 2)):.2f} | {st.median(by(name, 5)):.2f} | "
          f"{st.median(by(name, 6)):.2f} | {lost[name]:.2f} |")
print(f"time lost per checkpoint, background / synchronous: {lost['async'] / lost['sync']:.3f} "
      f"({lost['async']:.2f} s / {lost['sync']:.2f} s, {len(by('none', 2))} round(s))")
PYEOF
