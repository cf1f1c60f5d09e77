#!/usr/bin/env bash
# Muon against AdamW, each at its best learning rate of a small sweep: optimizer steps and wall
# time until the validation loss first reaches a target (evaluated every 10 steps), on the same
# config, corpus and seed. Prints one line per run, then each optimizer's best and the ratios.
#   scripts/bench/bench_muon.sh [--config FILE] [--target LOSS] [--steps N] [--device cpu|cuda]
#   env ADAMW_LRS (train.lr, default "1e-3 3e-3 1e-2"), MUON_LRS (optimizer.muon_lr, default
#   "0.01 0.02 0.05"), MUON_TRAIN_LR (train.lr of Muon's AdamW-updated embeddings, head, norms
#   and biases; default the config's),
#   THREADS (CPU intra-op threads, default 2)
set -euo pipefail
source "$(dirname "$0")/../tools.sh"
config=configs/debug.yaml; target=1.45; steps=300; device=cpu
while [ $# -gt 0 ]; do
  case "$1" in
    --config) config=${2:?}; shift 2 ;;
    --target) target=${2:?}; shift 2 ;;
    --steps) steps=${2:?}; shift 2 ;;
    --device) device=${2:?}; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
results=$work/results.jsonl
run() { # name, label, --set ...
  local name=$1 label=$2; shift 2
  local out=$work/$name-$label
  "$BIN" train --config "$config" --set "out_dir=$out" --set "device=$device" \
    --set "train.max_steps=$steps" --set train.eval_interval=10 --set train.eval_batches=4 \
    --set checkpoint.at_end=false --set checkpoint.interval=0 --set "train.threads=${THREADS:-2}" \
    "$@" >/dev/null 2>"$out.log" || { cat "$out.log" >&2; exit 1; }
  "$PY" - "$out/metrics.jsonl" "$name" "$label" "$target" >>"$results" <<'PYEOF'
import json, sys
path, name, label, target = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
rows = [json.loads(l) for l in open(path)]
hit = next((r for r in rows if r.get("val_loss") is not None and r["val_loss"] <= target), None)
best = min(r["val_loss"] for r in rows if r.get("val_loss") is not None)
print(json.dumps({"optimizer": name, "lr": label, "steps": hit and hit["step"],
                  "seconds": hit and round(hit["elapsed_s"], 2), "best_val": round(best, 4)}))
PYEOF
}
for lr in ${ADAMW_LRS:-1e-3 3e-3 1e-2}; do run adamw "$lr" --set optimizer.name=adamw --set "train.lr=$lr" --set "train.min_lr=$(awk "BEGIN{print $lr/10}")"; done
muon_rest=()
[ -z "${MUON_TRAIN_LR:-}" ] || muon_rest=(--set "train.lr=$MUON_TRAIN_LR" --set "train.min_lr=$(awk "BEGIN{print $MUON_TRAIN_LR/10}")")
for lr in ${MUON_LRS:-0.01 0.02 0.05}; do run muon "$lr" --set optimizer.name=muon --set "optimizer.muon_lr=$lr" "${muon_rest[@]}"; done
"$PY" - "$results" "$target" "$config" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
target, config = sys.argv[2], sys.argv[3]
print(f"{config}: steps and wall time until validation loss <= {target} (evaluated every 10 steps)")
for r in rows:
    print(f"  {r['optimizer']:6} lr {r['lr']:>6}: " + (f"step {r['steps']:4}, {r['seconds']:7.2f} s" if r["steps"] else "not reached") + f"; best val {r['best_val']}")
best = {}
for r in rows:
    if r["steps"] and (r["optimizer"] not in best or r["steps"] < best[r["optimizer"]]["steps"]):
        best[r["optimizer"]] = r
for name, r in best.items():
    print(f"best {name}: lr {r['lr']}, step {r['steps']}, {r['seconds']} s")
if len(best) == 2:
    a, m = best["adamw"], best["muon"]
    print(f"muon / adamw: steps {m['steps'] / a['steps']:.2f}x, wall time {m['seconds'] / a['seconds']:.2f}x")
PYEOF
