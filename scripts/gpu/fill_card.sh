#!/usr/bin/env bash
# Issue 16 on a GPU: does `plan --gpu auto --profile --apply` fill the card? Copies
# configs/gpt2-124m.yaml (bf16-mixed, global batch 480: no power of two divides it into the size
# that fits), lets the planner measure and apply the largest micro-batch that fits, trains STEPS
# (default 200) steps with it and prints peak reserved ÷ the card, the OOMs and the allocator
# retries; then NOEXP_STEPS (default 30; 0 skips it) steps with expandable segments off for
# reserved ÷ allocated before/after.
#   scripts/gpu/fill_card.sh            output in $OUT (default runs/fill-card): plan.json, the runs' metrics
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
dest=${OUT:-runs/fill-card}; mkdir -p "$dest"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || { echo "fill_card.sh needs a CUDA device" >&2; exit 2; }
work=$(mktemp -d)  # run directories hold gigabytes of checkpoints: not under $dest
trap 'rm -rf "$work"' EXIT
cfg=$dest/fill.yaml
{ echo "precision: bf16-mixed"; grep -v '^precision:' configs/gpt2-124m.yaml | sed 's/^\(  global_batch_size:\) *[0-9]*/\1 480/'; } >"$cfg"
"$BIN" plan --config "$cfg" --gpu auto --profile --apply --json >"$dest/plan.json"
steps=${STEPS:-200}
run() {  # run NAME STEPS [--set …]: trains the applied config, keeps its metrics
  local name=$1 n=$2; shift 2
  "$BIN" train --config "$cfg" --set device=cuda --set out_dir="$work/$name" --set train.max_steps="$n" \
    --set train.warmup_steps=$((n / 10)) --set train.eval_interval=0 --set checkpoint.interval=0 "$@" >"$dest/$name.log" 2>&1
  cp "$work/$name/metrics.jsonl" "$dest/$name-metrics.jsonl"; cp "$work/$name/events.jsonl" "$dest/$name-events.jsonl"
}
run applied "$steps"
noexp=${NOEXP_STEPS:-30}  # 0: skip the comparison run
[ "$noexp" -eq 0 ] || run no-expandable "$noexp" --set memory.allocator.expandable_segments=false
"$PY" - "$dest" <<'EOF'
import json, os, sys, torch
dest = sys.argv[1]
plan = json.load(open(f"{dest}/plan.json"))
total = torch.cuda.get_device_properties(0).total_memory
def read(name):
    m = [json.loads(l) for l in open(f"{dest}/{name}-metrics.jsonl")]
    ev = [json.loads(l) for l in open(f"{dest}/{name}-events.jsonl")]
    return m, ev
print(f"card: {torch.cuda.get_device_name(0)}, {total / 2**30:.1f} GiB")
print(f"plan --profile --apply: micro-batch {plan['applied']['micro_batch']} × accumulation {plan['applied']['accumulation']} (global {plan['applied']['global_batch']})")
for name in ("applied", "no-expandable"):
    if not os.path.exists(f"{dest}/{name}-metrics.jsonl"):
        continue
    m, ev = read(name)
    reserved = max(x["peak_reserved_bytes"] or 0 for x in m)
    allocated = max(x["peak_allocated_bytes"] or 0 for x in m)
    retries = sum(x["alloc_retries"] or 0 for x in m)  # per step in metrics.jsonl
    ooms = sum(e["event"] == "oom_recovered" for e in ev)
    conf = next(e for e in ev if e["event"] == "run_started").get("allocator", {}).get("conf")
    speeds = sorted(x["tokens_per_s"] for x in m if x["step"] > 5) or [0]  # retries cost speed
    tps = speeds[len(speeds) // 2]
    print(f"{name:14s} steps {len(m)}: peak reserved {reserved / 2**30:.2f} GiB = {reserved / total:.1%} of the card, "
          f"peak allocated {allocated / 2**30:.2f} GiB, reserved/allocated {reserved / max(allocated, 1):.3f}, "
          f"OOMs {ooms}, allocator retries {retries} (all steps), {tps:,.0f} tokens/s (median from step 5), allocator `{conf}`")
EOF
