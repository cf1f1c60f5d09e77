#!/usr/bin/env bash
# Single-node data-parallel training under torchrun, one process per GPU (or N CPU processes).
#   scripts/torchrun.sh NPROC CONFIG [trainguard train args...]
# e.g. scripts/torchrun.sh 8 configs/gpt2-124m.yaml --resume auto
# Restarts the whole group up to MAX_RESTARTS times (default 3) after a worker failure; a
# restarted group resumes from the newest complete checkpoint by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 NPROC CONFIG [train args...]" >&2; exit 2; }
nproc=$1; config=$2; shift 2
[ -x .venv/bin/torchrun ] || bash scripts/setup.sh
[ -x target/release/trainguard ] || cargo build --release
exec .venv/bin/torchrun --standalone --nproc_per_node="$nproc" --max-restarts="${MAX_RESTARTS:-3}" \
  --no-python target/release/trainguard train --config "$config" "$@"
