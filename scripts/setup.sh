#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install dsfuse with its dev tools.
#   bash scripts/setup.sh            -> .venv (reuses a system torch/triton, e.g. on a GPU machine)
# DSFUSE_VENV picks another folder; DSFUSE_ISOLATED=1 makes a venv that sees no system packages.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${DSFUSE_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  if [ "${DSFUSE_ISOLATED:-0}" = 1 ]; then python3 -m venv "$venv"; else python3 -m venv --system-site-packages "$venv"; fi
fi
py="$venv/bin/python"
pip_install() { "$py" -m pip install -q --disable-pip-version-check "$@"; }
has_gpu() { command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L > /dev/null 2>&1; }
if ! "$py" -c "import torch" 2> /dev/null; then
  # Without a GPU the CPU build is enough (the tests run Triton in its interpreter).
  if has_gpu; then pip_install torch; else pip_install "${DSFUSE_CPU_TORCH:-torch==2.13.0}"; fi
fi
if ! "$py" -c "import triton" 2> /dev/null; then
  pip_install "${DSFUSE_TRITON:-triton==3.6.0}"  # the version of the H200 test machine
fi
# The CuTe DSL backends compile on the CPU too (CI checks them for sm_90a and sm_100a);
# DSFUSE_NO_CUTEDSL=1 skips the extra (its tests then skip).
if [ "${DSFUSE_NO_CUTEDSL:-0}" = 1 ]; then pip_install -e ".[dev]"; else pip_install -e ".[dev,cutedsl]"; fi
"$py" -c "import dsfuse, torch, triton; print(f'dsfuse ready: torch {torch.__version__}, triton {triton.__version__}, CUDA available: {torch.cuda.is_available()}')"
