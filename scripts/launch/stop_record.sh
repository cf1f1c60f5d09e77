# Sourced by scripts/launch/torchrun.sh and scripts/launch/slurm.sbatch: how a trainguard run ended, read from
# the stop record it leaves in its run directory (README "Planned stops under torchrun and SLURM").
#   OUT_DIR/stop.json  {"status":"stopped",…,"resumable":true}  → stopped, resume with --resume auto
#                      {"status":"finished",…}                   → finished
#   no file                                                     → crashed (trainguard removes the
#                                                                  record when a run starts; a
#                                                                  record not written anew by this
#                                                                  launch is an older one: record_stamp)

# out_dir_of TRAINGUARD CONFIG [--set K=V ...]: the run directory the config resolves to.
out_dir_of() {
  local bin=$1 config=$2; shift 2
  "$bin" config show --config "$config" "$@" | sed -n 's/^out_dir: *//p'
}

# sets_of ARGS...: only the `--set K=V` pairs of a trainguard command line (they may move out_dir).
sets_of() {
  while [ $# -gt 0 ]; do
    case $1 in
      --set) [ $# -ge 2 ] && printf '%s\0%s\0' "$1" "$2"; shift 2 || shift ;;
      --set=*) printf '%s\0' "$1"; shift ;;
      *) shift ;;
    esac
  done
}

# stop_status OUT_DIR: prints stopped | finished | crashed.
stop_status() {
  local rec="$1/stop.json" status=""
  [ -f "$rec" ] && status=$(sed -n 's/.*"status":"\([a-z_]*\)".*/\1/p' "$rec")
  case $status in
    stopped|finished) echo "$status" ;;
    *) echo crashed ;;
  esac
}

# stop_field OUT_DIR KEY: a number or word the stop record gives KEY (`step`, `reason`); empty
# without one.
stop_field() {
  [ -f "$1/stop.json" ] && sed -n "s/.*\"$2\":\"\{0,1\}\([a-z_0-9]*\).*/\1/p" "$1/stop.json"
}

# newest_step OUT_DIR: the newest checkpoint's step, 0 without one: where a run resumes.
newest_step() {
  local d n=0
  for d in "$1"/checkpoints/step-*; do
    [ -d "$d" ] && n=$((10#${d##*step-}))
  done
  echo "$n"
}

# failure_code [FILE]: the exit code of a failure no torchrun restart mends, as a worker recorded
# it in $TRAINGUARD_FAILURE_FILE (crates/trainguard/src/job/attempts.rs: one JSON line; a message's quotes are
# escaped); empty without one. Without FILE: the first such record on standard input.
failure_code() {
  if [ $# -gt 0 ]; then
    [ -s "$1" ] || return 0
    failure_code < "$1"; return
  fi
  sed -n 's/.*"code":\([0-9]*\).*/\1/p' | head -n 1
}

# record_stamp OUT_DIR: which stop record is there (inode, modification time), empty without
# one: a record the run rewrote is another file (trainguard writes it by rename).
record_stamp() {
  [ -f "$1/stop.json" ] && stat -c '%i %.9Y' "$1/stop.json"
}

# notify_killed OUT_DIR CODE: a run that ended without a word (killed: the OOM killer, kill -9, a
# node lost) is told as `crashed` to the webhook in TRAINGUARD_NOTIFY_WEBHOOK, when it is set
# (docs/notifications.md; trainguard tells every end it lives to see itself). The JSON body has
# trainguard's shape; curl tries 3 times, 10 s each at most. The URL is a secret: a failure
# names its scheme and host only.
notify_killed() {
  local url=${TRAINGUARD_NOTIFY_WEBHOOK:-} dir=$1 code=$2 host text json
  [ -n "$url" ] || return 0
  command -v curl >/dev/null || { echo "warning: notify: no curl to send the crash notice" >&2; return 0; }
  host=$(hostname 2>/dev/null || echo "unknown host")
  dir=${dir//\\/\\\\}; dir=${dir//\"/\\\"}
  text="$dir on $host: crashed, exit $code (killed: no error from trainguard, no stop record)"
  json=$(printf '{"text":"%s","content":"%s","title":"trainguard %s: crashed","event":"crashed","run":"%s","host":"%s","step":null,"exit_code":%d,"details":{"message":"the job script saw the run end without a stop record or a failure record"}}' \
    "$text" "$text" "$dir" "$dir" "$host" "$code")
  curl -fsS -o /dev/null -m 10 --retry 2 -H 'Content-Type: application/json' -d "$json" "$url" 2>/dev/null \
    || echo "warning: notify: cannot send the crash notice to $(printf '%s' "$url" | sed -E 's#^([a-zA-Z]+://)([^@/?#]*@)?([^/?#]*).*#\1\3/…#')" >&2
}
