#!/usr/bin/env bash
# memory.offload_optimizer on one device (issue 60's GPU figures): the median step time and the
# peak memory with the optimizer state on the device and in host memory, then a memory.limit
# between the two peaks, under which the run without offload should stop with exit 3 at the
# micro-batch floor, the run with offload train, and the run that starts without it train through
# the guard's escalation (oom.escalate: [offload_optimizer]). Every run is at micro-batch 1, the
# floor, so the run without offload cannot halve its way under the cap.
# The peaks: CUDA's peak reserved (what memory.limit's memory fraction caps) and peak allocated;
# on the CPU the address space mapped above start-up (what memory.limit caps there). On the CPU
# the host is the device's memory and offload adds its host copies: the script says so and tries
# no cap unless --cap names one, in MiB (a dry run of the script's mechanics).
#   scripts/bench/bench_offload.sh [--device cuda] [--config FILE] [--steps N] [--cap MIB] [--set K=V ...]
# Defaults: --device cuda runs configs/llama3.2-1b.yaml (bf16-mixed, activation checkpointing) at
# global batch 8; --device cpu a 13M-parameter GPT-2 of configs/debug.yaml.
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
device=cuda; config=""; steps=6; cap=""; extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=${2:?}; shift 2 ;;
    --config) config=${2:?}; shift 2 ;;
    --steps) steps=${2:?}; shift 2 ;;
    --cap) cap=${2:?}; shift 2 ;;
    --set) extra+=(--set "${2:?}"); shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$device" in
  cuda*) config=${config:-configs/llama3.2-1b.yaml}; model=() ;;
  cpu) config=${config:-configs/debug.yaml}
       model=(--set model.n_embd=512 --set model.n_head=8 --set model.n_layer=4 --set train.threads=2) ;;
  *) echo "--device: cpu or cuda[:N], got $device" >&2; exit 2 ;;
esac
work=$(mktemp -d); trap '[ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
common=(--config "$config" "${model[@]}" --set "device=$device" --set train.global_batch_size=8
  --set train.micro_batch_size=1 --set oom.min_micro_batch=1 --set "train.max_steps=$steps"
  --set train.warmup_steps=1 --set train.eval_interval=0 --set train.log_interval=1
  --set checkpoint.interval=0 --set checkpoint.at_end=false "${extra[@]}")

# run NAME [--set K=V ...]: trains into $work/NAME, prints its exit status.
run() {
  local name=$1; shift
  local rc=0
  "$BIN" train "${common[@]}" --set "out_dir=$work/$name" "$@" >"$work/$name.log" 2>&1 || rc=$?
  echo "$rc"
}
# figures NAME: "median_step_s peak_reserved peak_allocated escalations" from the run's files
# (CPU: the mapped peak in both peak columns); "-" where the run wrote none.
figures() {
  "$PY" - "$work/$1" <<'PYEOF'
import json, os, statistics, sys
out = sys.argv[1]
def lines(name):
    p = os.path.join(out, name)
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
metrics, events = lines("metrics.jsonl"), lines("events.jsonl")
times = [m["step_time_s"] for m in metrics[1:]]
done = next((e for e in events if e["event"] == "run_finished"), {})
peak = lambda k: max((m[k] for m in metrics if m.get(k) is not None), default=None)
reserved, allocated = peak("peak_reserved_bytes"), peak("peak_allocated_bytes")
if reserved is None and done.get("peak_mapped_above_start_bytes") is not None:
    reserved = allocated = done["peak_mapped_above_start_bytes"]
fmt = lambda v: "-" if v is None else str(v)
print(f"{statistics.median(times) if times else '-'} {fmt(reserved)} {fmt(allocated)} {done.get('oom_escalations', '-')}")
PYEOF
}
mib() { [ "$1" = - ] && echo - || "$PY" -c "print(f'{$1 / 2**20:.0f}')"; }

printf '%-26s %6s %10s %14s %15s\n' run exit "step s" "peak res. MiB" "peak alloc. MiB"
# row LABEL NAME RC: prints the run's row; leaves its figures in t, res, alloc and esc.
row() {
  read -r t res alloc esc <<<"$(figures "$2")"
  local shown=$t; [ "$t" != - ] && shown=$(printf %.3f "$t")
  printf '%-26s %6s %10s %14s %15s\n' "$1" "$3" "$shown" "$(mib "$res")" "$(mib "$alloc")"
  # The error's first line, and its first listed problem when it lists them.
  [ "$3" = 0 ] || grep -m1 -A1 "^error:" "$work/$2.log" | grep -v "^[^e ]" | grep -E "^error:|^  - " | cut -c1-220 | sed 's/^/      /' || true
}
rc=$(run state-on-device --set memory.offload_optimizer=false); row "optimizer on the device" state-on-device "$rc"
t_dev=$t; res_dev=$res
rc=$(run state-on-host --set memory.offload_optimizer=true); row "offload_optimizer" state-on-host "$rc"
t_host=$t; res_host=$res
if [ "$t_dev" != - ] && [ "$t_host" != - ]; then
  "$PY" -c "print(f'step time with offload / without: {$t_host / $t_dev:.2f}x')"
fi

if [ -z "$cap" ]; then
  if [ "$res_dev" = - ] || [ "$res_host" = - ] || [ "$res_host" -ge "$res_dev" ]; then
    echo "offload does not lower this device's peak ($(mib "$res_host") MiB against $(mib "$res_dev") MiB): no cap to try (--cap MIB tries one)"
    exit 0
  fi
  cap=$(( (res_dev + res_host) / 2 / 1048576 ))
fi
echo "memory.limit=${cap}MiB, between the two peaks:"
rc=$(run capped-on-device --set "memory.limit=${cap}MiB" --set memory.offload_optimizer=false --set 'oom.escalate=[]')
row "  on the device" capped-on-device "$rc"
rc=$(run capped-on-host --set "memory.limit=${cap}MiB" --set memory.offload_optimizer=true)
row "  offload_optimizer" capped-on-host "$rc"
rc=$(run capped-escalating --set "memory.limit=${cap}MiB" --set memory.offload_optimizer=false --set 'oom.escalate=[offload_optimizer]')
row "  escalate to offload" capped-escalating "$rc"
echo "  escalations in the escalating run: $esc"
