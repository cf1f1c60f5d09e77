#!/usr/bin/env bash
# Sharded data parallel on the CPU (Gloo ranks, one thread each): for each world size and each
# `dist.shard` level, rank 0's peak memory above its start, the median step time, and the time a
# checkpoint takes (rank 0 writing all the optimizer state alone at `none`; every rank writing its
# part in parallel at the shard levels), with `plan`'s per-rank estimate beside the peak when
# `plan` prints one. A 13M-parameter GPT-2 (AdamW: ~150 MB of optimizer state) so that the state
# is what differs. `none` and `parameters` run twice: with their collectives overlapping the
# compute (the default, dist.overlap: the all-reduce during backward; the gathers ahead) and with
# each waited for (`none/waited`, `parameters/waited`; `gradients/waited` on request). `--levels`
# picks rows. Every run has a `memory.limit` (1 TiB: glibc then returns large blocks at once, so
# the peak is what was mapped) unless `--no-cap`; but under a CPU cap no rank starts a collective
# inside backward (docs/sharding.md), so `--no-cap` is how the all-reduce and the `gradients`
# reduces during backward are timed against waited ones.
#   scripts/bench/bench_sharding.sh [--worlds "1 2 4"] [--levels "none none/waited"] [--steps N] [--no-cap]
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
worlds="1 2 4"; steps=8; cap=(--set memory.limit=1TiB)
levels="none none/waited optimizer gradients parameters parameters/waited"
while [ $# -gt 0 ]; do
  case "$1" in
    --worlds) worlds=${2:?}; shift 2 ;;
    --steps) steps=${2:?}; shift 2 ;;
    --levels) levels=${2:?}; shift 2 ;;
    --no-cap) cap=(); shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
model=(--set model.n_embd=512 --set model.n_head=8 --set model.n_layer=4)
common=(--config configs/debug.yaml "${model[@]}" --set train.global_batch_size=8 --set train.micro_batch_size=2
  --set "train.max_steps=$steps" --set train.warmup_steps=1 --set train.eval_interval=0
  --set checkpoint.interval=2 --set checkpoint.keep_last=1 --set train.threads=1 "${cap[@]}"
  --set dist.timeout_s=120)
port=29700
printf '%-6s %-17s %14s %14s %12s %14s\n' world level "peak MiB" "plan MiB" "step s" "checkpoint s"
for world in $worlds; do
  for row in $levels; do
    level=${row%/*}; overlap=true
    [ "$row" != "$level" ] && overlap=false
    [ "$world" = 1 ] && [ "$row" != none ] && continue
    out=$work/$world-${row/\//-}; port=$((port + 1))
    if [ "$world" = 1 ]; then
      "$BIN" train "${common[@]}" --set "out_dir=$out" >"$out.log" 2>&1 || { cat "$out.log" >&2; exit 1; }
    else
      "${TORCHRUN[@]}" --nproc_per_node="$world" --master_addr=127.0.0.1 --master_port=$port --no-python "$BIN" train \
        "${common[@]}" --set "out_dir=$out" --set "dist.shard=$level" --set "dist.overlap=$overlap" >"$out.log" 2>&1 || { cat "$out.log" >&2; exit 1; }
    fi
    # The plan's row for this level, for the CPU (the busiest rank: rank 0 owns the largest share).
    plan=$("$BIN" plan "${common[@]}" --set "dist.overlap=$overlap" --target cpu --world-size "$world" --shard "$level" --json 2>/dev/null \
      | "$PY" -c 'import json,sys; d=json.load(sys.stdin); r=[r for r in d["levels"]["rows"] if r["shard"]==sys.argv[1] and not r["offload_optimizer"]][0]; print(round(r["peak_allocated_bytes"]/2**20,1))' "$level" 2>/dev/null || echo -)
    "$PY" - "$out" "$world" "$row" "$plan" <<'PYEOF'
import json, sys, statistics
out, world, level, plan = sys.argv[1:]
events = [json.loads(l) for l in open(f"{out}/events.jsonl")]
metrics = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
done = next(e for e in events if e["event"] == "run_finished")
saves = [e["seconds"] for e in events if e["event"] == "checkpoint_saved"]
steps = [m["step_time_s"] for m in metrics[1:] if m.get("step_time_s") is not None]
print(f"{world:<6} {level:<17} {done['peak_mapped_above_start_bytes'] / 2**20:14.1f} {plan:>14} "
      f"{statistics.median(steps) if steps else float('nan'):12.3f} {statistics.median(saves):14.3f}")
PYEOF
  done
done
