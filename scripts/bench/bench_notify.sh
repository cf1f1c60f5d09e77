#!/usr/bin/env bash
# What a dead webhook costs training: the same CPU run (configs/debug.yaml, a checkpoint and a
# notification every CKPT steps, and one at the end) without a webhook, with one on a loopback
# port nothing listens on (refused at once), and with one on a loopback server that accepts and
# never answers (each try waits notify.timeout_s). Alternated ROUNDS times; the best training
# time of each side (run_finished's session_elapsed_s) is compared, and the process' wall time
# beside it (which includes the bounded wait for the queue at exit, notify.timeout_s at most).
# Usage: scripts/bench/bench_notify.sh   (env: ROUNDS=3 STEPS=300 CKPT=10 THREADS=$(nproc))
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-300}; CKPT=${CKPT:-10}; THREADS=${THREADS:-$(nproc)}
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

run() {  # prints "training_s wall_s" of a fresh run named $1 with --set args $2...
  local name=$1; shift
  rm -rf "${out:?}/$name"
  local t0; t0=$("$PY" -c 'import time; print(time.monotonic())')
  "$BIN" train "${common[@]}" --set out_dir="$out/$name" "$@" 2>"$out/$name.err" >/dev/null
  local t1; t1=$("$PY" -c 'import time; print(time.monotonic())')
  "$PY" -c "
import json; s=[json.loads(l) for l in open('$out/$name/events.jsonl')][-1]
print(s['session_elapsed_s'], $t1 - $t0)"
}

echo "== configs/debug.yaml, $STEPS steps, a notification every $CKPT steps, $THREADS threads, best of $ROUNDS"
declare -A train wall
for k in none refused silent; do train[$k]=1e9; wall[$k]=1e9; done
for _ in $(seq "$ROUNDS"); do
  for k in none refused silent; do
    case $k in
      none) r=$(run none) ;;
      refused) r=$(run refused --set notify.webhook="http://127.0.0.1:$refused_port/hook") ;;
      silent) r=$(run silent --set notify.webhook="http://127.0.0.1:$silent_port/hook") ;;
    esac
    read -r t w <<<"$r"
    train[$k]=$("$PY" -c "print(min(${train[$k]}, $t))"); wall[$k]=$("$PY" -c "print(min(${wall[$k]}, $w))")
  done
done
warned=$(grep -c "notify: cannot send" "$out/silent.err" "$out/refused.err" | tr '\n' ' ')
"$PY" -c "
t={'none':${train[none]},'refused':${train[refused]},'silent':${train[silent]}}
w={'none':${wall[none]},'refused':${wall[refused]},'silent':${wall[silent]}}
for k in t: print(f'{k:8s} training {t[k]:7.2f} s  process {w[k]:7.2f} s')
for k in ('refused','silent'): print(f'{k}/none: training {t[k]/t[\"none\"]:.4f}  process {w[k]/w[\"none\"]:.4f} (the exit waits notify.timeout_s at most)')
"
echo "warnings (one per run expected): $warned"
