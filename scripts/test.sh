#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the test suite.
#   bash scripts/test.sh          CPU tests: Triton kernels in the interpreter, validation, properties, AOT compile
#   bash scripts/test.sh --gpu    the GPU-marked tests on a CUDA machine (a missing GPU is an error)
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
py="${DSFUSE_VENV:-.venv}/bin/python"
if [ "${1:-}" = "--gpu" ]; then
  shift
  DSFUSE_REQUIRE_GPU=1 exec "$py" -m pytest tests -m gpu "$@"
fi
exec "$py" -m pytest tests -m "not gpu" "$@"
