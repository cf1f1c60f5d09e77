#!/usr/bin/env bash
# The planner's accuracy: `trainguard plan --profile` on three configs (debug, gpt2-124m,
# gpt2-350m) at three micro-batches and two sequence lengths each; prints a Markdown table of
# estimated vs measured peak and the error, plus each run's fixed + per-sample fit.
#
#   scripts/plan_accuracy.sh                 # CPU: the analogue (peak resident set; see README)
#   scripts/plan_accuracy.sh --device cuda   # GPU: the caching allocator's allocated_peak
#
# CPU defaults keep it to a few minutes on 2 cores: short sequences, one step per size.
# Env: THREADS (default: all cores), STEPS (optimizer steps per size; default 1 on CPU, 2 on CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=cpu
if [ "${1:-}" = "--device" ]; then DEVICE=${2:?--device needs a value}; fi
[ -x .venv/bin/python ] || bash scripts/setup.sh
cargo build --release --quiet
BIN=target/release/trainguard; PY=.venv/bin/python
THREADS=${THREADS:-$(nproc)}
if [ "$DEVICE" = cpu ]; then
  STEPS=${STEPS:-1}
  # config | sequence lengths | micro-batches
  # Sizes on both sides of where activations overtake the gradients (end of backward) as the peak.
  RUNS=("debug.yaml|64 128|8,16,32" "gpt2-124m.yaml|128 256|1,4,8" "gpt2-350m.yaml|64 256|1,2,4")
else
  STEPS=${STEPS:-2}
  RUNS=("debug.yaml|64 256|8,16,32" "gpt2-124m.yaml|512 1024|1,2,4" "gpt2-350m.yaml|512 1024|1,2,4")
fi
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
echo "device $DEVICE, $STEPS step(s) of 2 micro-steps per size, $THREADS threads; $(date -u +%Y-%m-%d)" >&2
for run in "${RUNS[@]}"; do
  IFS='|' read -r cfg seqs micros <<<"$run"
  for seq in $seqs; do
    echo "  $cfg seq $seq: micro-batches $micros" >&2
    "$BIN" plan --config "configs/$cfg" --profile --json --device "$DEVICE" --micro-batches "$micros" \
      --profile-steps "$STEPS" --set model.seq_len="$seq" --set data.synthetic_tokens=1048576 \
      --set train.threads="$THREADS" >"$out/${cfg%.yaml}-$seq.json"
  done
done
"$PY" - "$out" <<'PYEOF'
import glob, json, os, sys
MiB = 2**20
def size(b):
    return f"{b / 2**30:.3f} GiB" if b >= 2**30 else f"{b / MiB:.1f} MiB"
rows, worst = [], 0.0
order = {"debug": 0, "gpt2-124m": 1, "gpt2-350m": 2}
files = sorted(glob.glob(os.path.join(sys.argv[1], "*.json")),
               key=lambda f: (order.get(os.path.basename(f).rsplit("-", 1)[0], 9), int(f.rsplit("-", 1)[1][:-5])))
print("| config | params | seq | micro-batch | estimate | measured | error | peak at |")
print("|---|---|---|---|---|---|---|---|")
fits = []
for f in files:
    j = json.load(open(f)); p = j["profile"]
    name = os.path.basename(f).rsplit("-", 1)[0]
    for pt in p["points"]:
        if pt["measured_bytes"] is None:
            print(f"| {name} | {j['params']/1e6:.1f}M | {j['model']['seq_len']} | {pt['micro_batch']} | {size(pt['estimate_bytes'])} | out of memory | — | |")
            continue
        worst = max(worst, abs(pt["error_pct"]))
        print(f"| {name} | {j['params']/1e6:.1f}M | {j['model']['seq_len']} | {pt['micro_batch']} | "
              f"{size(pt['estimate_bytes'])} | {size(pt['measured_bytes'])} | {pt['error_pct']:+.1f}% | {pt['peak_phase']} |")
    if p["fit"]:
        f_, e_ = p["fit"], p["estimate_fit"]
        fits.append(f"| {name} | {j['model']['seq_len']} | {size(f_['fixed_bytes'])} + {size(f_['per_sample_bytes'])}/sample | "
                    f"{size(e_['fixed_bytes'])} + {size(e_['per_sample_bytes'])}/sample |")
print(f"\nlargest |error|: {worst:.1f}%\n")
print("| config | seq | least-squares line through the measured peaks | through the estimates |")
print("|---|---|---|---|")
print("\n".join(fits))
PYEOF
