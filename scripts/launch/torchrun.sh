#!/usr/bin/env bash
# Single-node data-parallel training under torchrun, one process per GPU (or N CPU processes).
#   scripts/launch/torchrun.sh NPROC CONFIG [trainguard train args...]
# e.g. scripts/launch/torchrun.sh 8 configs/gpt2-124m.yaml --resume auto --max-duration 7h30m
# Restarts the whole group up to MAX_RESTARTS times (default 3) after a worker *failure*; a
# restarted group resumes from the newest complete checkpoint by itself, with what is left of
# --max-duration. A planned stop (SIGINT/SIGTERM to this script, or the time limit) is not a
# failure: trainguard exits 0 under torchrun and leaves OUT_DIR/stop.json, so there is no restart.
# A failure a restart would meet again (exit 2, 3, 5, 6: a refused config or out_dir, out of
# memory at the floor, non-finite losses, a non-deterministic op) is not retried: the restarts
# exit with its code at once, and so does this script. A restart resumes only the run this job
# started: a fresh start refused in another run's out_dir is not turned into a resume of it.
# Exit code: 0 finished, 4 stopped and resumable (`--resume auto` continues), 2 a bad config or
# an out_dir another run is using, 3 / 5 / 6 as trainguard's, else crashed (torchrun's code, 1
# if it had none).
# TORCHRUN and TRAINGUARD override the launcher and binary paths (by default the repo's). CONFIG
# and relative paths in the arguments (out_dir, data) are the caller's, from where it runs.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
. "$repo/scripts/launch/stop_record.sh"
[ $# -ge 2 ] || { echo "usage: $0 NPROC CONFIG [train args...]" >&2; exit 2; }
nproc=$1; config=$2; shift 2
torchrun=${TORCHRUN:-$repo/.venv/bin/torchrun}
bin=${TRAINGUARD:-$repo/target/release/trainguard}
[ -x "$torchrun" ] || bash "$repo/scripts/setup.sh" || exit 1
[ -x "$bin" ] || (cd "$repo" && cargo build --release) || exit 1
mapfile -d '' sets < <(sets_of "$@")
out_dir=$(out_dir_of "$bin" "$config" "${sets[@]}") || exit 2   # a bad config: its error is printed
# A run still going in out_dir (its rank 0 holds out_dir/.lock): refused here, once, exit 2, as
# trainguard would refuse it; under torchrun each refusal would be a failed attempt, restarted
# MAX_RESTARTS times, and its stop record is not ours to remove.
# Only a lock held (flock's -E code): a filesystem without locks, or a .lock that cannot be
# opened, is trainguard's to report.
if [ -d "$out_dir" ] && command -v flock >/dev/null; then
  flock -n -E 75 "$out_dir/.lock" true 2>/dev/null; held=$?
  if [ "$held" -eq 75 ]; then
    holder=$(cat "$out_dir/.lock" 2>/dev/null); [ -n "$holder" ] || holder="its pid unknown"
    echo "error: $out_dir is in use by another trainguard run ($holder): wait for it to end, or choose another out_dir" >&2
    exit 2
  fi
fi
# A record an earlier run left must not decide this one, and is not ours to remove: a start
# refused in that run's out_dir leaves it as it was. It counts only if the run wrote it anew.
stale=$(record_stamp "$out_dir")
TRAINGUARD_FAILURE_FILE=$(mktemp -u "${TMPDIR:-/tmp}/trainguard-failure.XXXXXXXX")
export TRAINGUARD_FAILURE_FILE
"$torchrun" --standalone --nproc_per_node="$nproc" --max-restarts="${MAX_RESTARTS:-3}" \
  --no-python "$bin" train --config "$config" "$@" &
pid=$!
# torchrun forwards SIGINT/SIGTERM to its workers, which stop at the next step with a checkpoint.
trap 'kill -TERM $pid 2>/dev/null' TERM
trap 'kill -INT $pid 2>/dev/null' INT
code=0
wait $pid || code=$?
while kill -0 $pid 2>/dev/null; do code=0; wait $pid || code=$?; done   # a trapped signal interrupts wait
status=$(stop_status "$out_dir")
[ -n "$stale" ] && [ "$(record_stamp "$out_dir")" = "$stale" ] && status=crashed
case $status in
  finished) echo "trainguard: finished ($out_dir)"; exit 0 ;;
  stopped) echo "trainguard: stopped, resumable: rerun with --resume auto ($out_dir/stop.json)"; exit 4 ;;
  *) failed=$(failure_code "$TRAINGUARD_FAILURE_FILE"); rm -f "$TRAINGUARD_FAILURE_FILE"
     if [ -n "$failed" ]; then
       echo "trainguard: failed with exit $failed, which a restart would meet again (the error is above); not restarted" >&2
       exit "$failed"
     fi
     echo "trainguard: crashed: torchrun exited $code and left no stop record in $out_dir" >&2
     notify_killed "$out_dir" "$code"
     [ "$code" -ne 0 ] && exit "$code"; exit 1 ;;
esac
