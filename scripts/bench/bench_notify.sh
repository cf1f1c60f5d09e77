#!/usr/bin/env bash
# What a dead webhook costs training: the same CPU run (configs/debug.yaml, a checkpoint and a
# notification every CKPT steps, and one at the end) without a webhook, with one on a loopback
# port nothing listens on (refused at once), and with one on a loopback server that accepts and
# never answers (each try waits notify.timeout_s). The three run at once, ROUNDS times; the best
# of each side is compared: training time (run_finished's session_elapsed_s), the median step
# time, and the process' wall time (which includes the bounded wait at exit, notify.timeout_s).
# Usage: scripts/bench/bench_notify.sh   (env: ROUNDS=3 STEPS=100 CKPT=5 THREADS=1)
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-100}; CKPT=${CKPT:-5}; THREADS=${THREADS:-1}
out=$(mktemp -d)
# A server that accepts every connection and never answers (held open until it ends).
"$PY" -c '
import socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(512)
open(sys.argv[1], "w").write(str(s.getsockname()[1]))
held = []
while True:
    held.append(s.accept()[0])
' "$out/silent.port" &
silent_pid=$!
while [ ! -s "$out/silent.port" ]; do sleep 0.1; done
silent_port=$(cat "$out/silent.port")
refused_port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
trap 'kill "$silent_pid" 2>/dev/null; rm -rf "$out"' EXIT
common=(--config configs/debug.yaml --set train.threads="$THREADS" --set train.eval_interval=0
  --set train.log_interval=1000 --set train.max_steps="$STEPS" --set checkpoint.interval="$CKPT"
  --set checkpoint.keep_last=1 --set 'notify.on=[checkpoint_saved, finished]')

run() {  # a fresh run named $1 with --set args $2...; its figures in $out/$1.fig
  local name=$1; shift
  rm -rf "${out:?}/$name"
  local t0; t0=$("$PY" -c 'import time; print(time.monotonic())')
  "$BIN" train "${common[@]}" --set out_dir="$out/$name" "$@" 2>"$out/$name.err" >/dev/null
  local t1; t1=$("$PY" -c 'import time; print(time.monotonic())')
  "$PY" -c "
import json, statistics
s=[json.loads(l) for l in open('$out/$name/events.jsonl')][-1]
m=[json.loads(l)['step_time_s'] for l in open('$out/$name/metrics.jsonl')][5:]
print(s['session_elapsed_s'], statistics.median(m), $t1 - $t0)" > "$out/$name.fig"
}

# The three side by side in each round: on a shared machine they meet the same load, which runs
# one after another do not (the ratio would measure the load's drift).
echo "== configs/debug.yaml, $STEPS steps, a notification every $CKPT steps, $THREADS threads each, the three at once, $ROUNDS rounds"
for r in $(seq "$ROUNDS"); do
  run "none$r" & a=$!
  run "refused$r" --set notify.webhook="http://127.0.0.1:$refused_port/hook" & b=$!
  run "silent$r" --set notify.webhook="http://127.0.0.1:$silent_port/hook" & c=$!
  wait $a $b $c
done
"$PY" -c "
import statistics
rounds=range(1, $ROUNDS + 1)
fig={k: [list(map(float, open(f'$out/{k}{r}.fig').read().split())) for r in rounds] for k in ('none','refused','silent')}
best=lambda k, i: min(f[i] for f in fig[k])
for k in fig: print(f'{k:8s} training {best(k,0):7.2f} s  median step {1e3*best(k,1):7.2f} ms  process {best(k,2):7.2f} s')
for k in ('refused','silent'):
    print(f'{k}/none: training {best(k,0)/best(\"none\",0):.4f}  median step {best(k,1)/best(\"none\",1):.4f}  process {best(k,2)/best(\"none\",2):.4f} (the exit waits notify.timeout_s at most)')
"
warned=$(grep -c "notify: cannot send" "$out"/silent*.err "$out"/refused*.err | sed "s#$out/##" | tr '\n' ' ')
echo "warnings (one per run expected): $warned"
