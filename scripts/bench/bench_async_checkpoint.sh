#!/usr/bin/env bash
# Training time lost per checkpoint, synchronous against background (`checkpoint.async`), for
# GPT-2-124M's state (weights and AdamW moments: 1.5 GB) on this machine's CPU and disk.
# Three runs of the same steps, in turn, ROUNDS times: no checkpoint, `checkpoint.async: false`,
# `checkpoint.async: true`, each checkpointing every 3 steps (4 checkpoints in 13 steps; the
# last one is an interval's too, so the background run's end waits for it and that wait counts).
# A short sequence (64 tokens, micro-batch 1) keeps a step short beside a checkpoint. Time lost
# per checkpoint = (the run's wall time from its first step to its end, `session_elapsed_s`,
# less the run without checkpoints') / 4: a background write's copy, the writer's competition
# for the CPU and the disk, and any wait for it, all count. Medians over the rounds; the last
# line prints the ratio background / synchronous.
# Checkpoints go under target/ (on the disk, not a tmpfs: fsync must reach the device).
# Usage: scripts/bench/bench_async_checkpoint.sh   (env ROUNDS=2 THREADS=$(nproc) STEPS=13 EVERY=3)
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
ROUNDS=${ROUNDS:-2}; THREADS=${THREADS:-$(nproc)}; STEPS=${STEPS:-13}; EVERY=${EVERY:-3}
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
end = [e for e in ev if e["event"] == "run_finished"][-1]
saved = [e for e in ev if e["event"] == "checkpoint_saved"]
waits = sum(e["seconds"] for e in ev if e["event"] == "checkpoint_waited")
write = sum(e["seconds"] for e in saved) / max(len(saved), 1)
print(name, rnd, end["session_elapsed_s"], len(saved), write, waits)
PYEOF
  done
done
"$PY" - "$out/times" "$n_ckpt" <<'PYEOF'
import statistics as st, sys
rows = [l.split() for l in open(sys.argv[1])]
n = int(sys.argv[2])
by = lambda name, col: [float(r[col]) for r in rows if r[0] == name]
base = st.median(by("none", 2))
print(f"| run | wall time (s, median) | checkpoints | write (s, median) | waited for the writer (s) | lost per checkpoint (s) |")
print("|---|---|---|---|---|---|")
lost = {}
for name in ["none", "sync", "async"]:
    wall = st.median(by(name, 2))
    count = int(by(name, 3)[0])
    lost[name] = (wall - base) / n
    write = f"{st.median(by(name, 4)):.2f}" if count else "-"
    print(f"| {name} | {wall:.2f} | {count} | {write} | {st.median(by(name, 5)):.2f} | {lost[name]:.2f} |")
print(f"time lost per checkpoint, background / synchronous: {lost['async'] / lost['sync']:.3f} "
      f"({lost['async']:.2f} s / {lost['sync']:.2f} s, {len(by('none', 2))} rounds)")
PYEOF
