#!/usr/bin/env bash
# Prepares a fresh Debian machine (with Rust and Python 3) to build and run trainguard.
# Idempotent: every step checks before it acts, so rerunning it is cheap and safe.
#   - Debian packages the build needs (a C++ compiler for torch-sys and the shim, Gloo headers)
#   - the project venv `.venv` with torch==2.11.0 from PyPI (the libtorch that tch 0.24 binds),
#     and tensorboard (tests read the event files back with it), tokenizers and transformers,
#     nvdisasm (a test reads our CUDA kernels' machine code with it)
#   - chromium, optional: the report page's rendering test (skipped without it)
# Afterwards plain `cargo build`, `cargo test` and `cargo run` work: `.cargo/config.toml` points
# torch-sys at `.venv`'s torch.
set -euo pipefail

cd "$(dirname "$0")/.."
TORCH_VERSION=2.11.0
VENV=.venv

say() { printf '[setup] %s\n' "$*"; }

# --- Debian packages ----------------------------------------------------------------------------
need_pkgs=()
command -v g++ >/dev/null 2>&1 || need_pkgs+=(g++)
command -v make >/dev/null 2>&1 || need_pkgs+=(make)
command -v pkg-config >/dev/null 2>&1 || need_pkgs+=(pkg-config)
# Gloo's headers for the c10d shim (crates/trainguard-sys/cpp/dist.cpp); the torch wheel ships c10d's, not gloo's.
[ -f /usr/include/gloo/allreduce.h ] || need_pkgs+=(libgloo-dev)
# Debian's python3 needs python3-venv for `python3 -m venv` (pyenv/conda Pythons have it built in).
${PYTHON:-python3} -c 'import ensurepip, venv' >/dev/null 2>&1 || need_pkgs+=(python3-venv)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  say "installing Debian packages: ${need_pkgs[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}"
else
  say "Debian packages present"
fi

# A headless browser for the test that renders `trainguard report`'s page (tests/it/report.rs).
# Optional: where apt cannot install it, setup goes on and that test prints "skipped: ...".
if ! command -v chromium >/dev/null 2>&1; then
  say "installing chromium (headless, for the report page's rendering test)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium; }; then
    say "chromium could not be installed; the report's browser test will be skipped"
  fi
fi

# --- Python venv with torch ---------------------------------------------------------------------
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PY" -m venv "$VENV"
fi
have=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [ "${have%%+*}" != "$TORCH_VERSION" ]; then
  say "installing torch==$TORCH_VERSION into $VENV (about 4.6 GB with its CUDA wheels; a few minutes)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" safetensors numpy pyyaml
else
  say "torch $have present in $VENV"
fi
"$VENV/bin/python" -c 'import safetensors, numpy, yaml' 2>/dev/null \
  || "$VENV/bin/python" -m pip install -q --disable-pip-version-check safetensors numpy pyyaml
# TensorBoard's reader for tests/it/report.rs (checks the `metrics.tensorboard` event files).
TENSORBOARD_VERSION=2.20.0
[ "$("$VENV/bin/python" -c 'import tensorboard; print(tensorboard.__version__)' 2>/dev/null)" = "$TENSORBOARD_VERSION" ] \
  || "$VENV/bin/python" -m pip install -q --disable-pip-version-check "tensorboard==$TENSORBOARD_VERSION"
# Tokenizers and transformers for the tests of `prepare` (ids against Python's tokenizers), the
# benchmark and the Hugging Face export/import checks; pinned so CI compares against fixed code.
TOKENIZERS_VERSION=0.23.3
TRANSFORMERS_VERSION=5.23.0
"$VENV/bin/python" -c "import tokenizers, transformers, sys; sys.exit(tokenizers.__version__ != '$TOKENIZERS_VERSION' or transformers.__version__ != '$TRANSFORMERS_VERSION')" 2>/dev/null \
  || "$VENV/bin/python" -m pip install -q --disable-pip-version-check "tokenizers==$TOKENIZERS_VERSION" "transformers==$TRANSFORMERS_VERSION"
# CUDA headers the c10d shim needs to build ProcessGroupNCCL (a few MB; torch's wheel has NCCL's).
SITE=$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')
[ -f "$SITE/nvidia/cu13/include/crt/host_defines.h" ] && [ -f "$SITE/nvidia/cu13/include/nv/target" ] \
  || "$VENV/bin/python" -m pip install -q --disable-pip-version-check "nvidia-cuda-crt==13.0.*" "nvidia-cuda-cccl==13.0.*"
# NVIDIA's disassembler (5 MB) for scripts/gpu/load_waits.py and its test: which loads of our CUDA
# kernels the wheel's NVRTC puts in flight together. It reads what NVRTC 13.0 writes.
NVDISASM_VERSION=13.5.37
[ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("nvidia-cuda-nvdisasm"))' 2>/dev/null)" = "$NVDISASM_VERSION" ] \
  || "$VENV/bin/python" -m pip install -q --disable-pip-version-check "nvidia-cuda-nvdisasm==$NVDISASM_VERSION"

# --- sanity check -------------------------------------------------------------------------------
TORCH_DIR=$("$VENV/bin/python" -c 'import torch, os; print(os.path.dirname(torch.__file__))')
[ -f "$TORCH_DIR/lib/libtorch_cpu.so" ] || { echo "setup: $TORCH_DIR/lib/libtorch_cpu.so missing" >&2; exit 1; }
# A path that does not depend on the venv's Python version, for .cargo/config.toml's LIBTORCH.
ln -sfn "$TORCH_DIR" "$VENV/libtorch"
say "libtorch: $TORCH_DIR"
say "ready: cargo build / cargo test / cargo run work from $(pwd)"
