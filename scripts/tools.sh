# Sourced by the scripts in scripts/: finds (or builds) the trainguard binary and a Python with
# torch, so each script works in two places:
#   - a development checkout: runs scripts/setup.sh if needed, `cargo build --release`, and uses
#     the project venv (.venv/bin/python, .venv/bin/torchrun);
#   - a GPU machine with no Rust toolchain (see scripts/gpu/gpu_checks.sh): uses a prebuilt
#     target/release/trainguard (or $TRAINGUARD_BIN) and the python3 that holds torch, and points
#     the dynamic loader at that torch's libraries.
# Sets BIN, PY and TORCHRUN (an array: the torchrun command); exports TRAINGUARD_BIN and
# TRAINGUARD_PYTHON for the tests the scripts run.
# shellcheck shell=bash
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if command -v cargo >/dev/null 2>&1 && [ -z "${TRAINGUARD_BIN:-}" ]; then
  [ -x .venv/bin/python ] || bash scripts/setup.sh
  cargo build --release --quiet
  BIN=$PWD/target/release/trainguard
  PY=$PWD/.venv/bin/python
  TORCHRUN=("$PWD/.venv/bin/torchrun")
else
  BIN=${TRAINGUARD_BIN:-$PWD/target/release/trainguard}
  [ -x "$BIN" ] || { echo "no cargo here and no prebuilt binary at $BIN (build it elsewhere: scripts/gpu/gpu_bundle.sh)" >&2; exit 2; }
  if [ -x .venv/bin/python ]; then PY=$PWD/.venv/bin/python; else PY=$(command -v python3); fi
  # Found, not imported: importing torch takes ~3 s, and a GPU check sources this many times.
  torch_lib=$("$PY" -c 'import importlib.util as u, os; s = u.find_spec("torch"); print(os.path.join(os.path.dirname(s.origin), "lib"))' 2>/dev/null) \
    || { echo "$PY cannot import torch: trainguard needs its libraries" >&2; exit 2; }
  export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  TORCHRUN=("$PY" -m torch.distributed.run)
fi
export TRAINGUARD_BIN=$BIN TRAINGUARD_PYTHON=$PY
