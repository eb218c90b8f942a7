#!/usr/bin/env bash
# A short GPU verification in priority order, each step bounded, its output under OUT as it goes
# (a call cut short by its time limit still returns what finished):
#   1. the bound-launch GPU tests, 2. the output fingerprints of every op (bitwise against
#   tests/golden), 3. the host-time runs of every op (raw data packed in host-time.tar.gz),
#   4. the remaining GPU tests named in TESTS (default: none).
#   bash scripts/gpu_quick.sh OUT_DIR
set -uo pipefail
out="${1:?OUT_DIR}"
mkdir -p "$out"
export PYTHONPATH="$PWD/kernels:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 DSFUSE_REQUIRE_GPU=1
status=0
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
timeout -k 10 "${T_BOUND:-60}" python3 -m pytest tests/test_bound_launch.py -m gpu -q -p no:cacheprovider \
  --junitxml "$out/junit-bound-launch.xml" > "$out/pytest-bound-launch.log" 2>&1 || status=1
timeout -k 10 "${T_FINGERPRINTS:-120}" python3 scripts/output_hashes.py --check tests/golden/h200_output_fingerprints.json \
  > "$out/fingerprints.txt" 2>&1 || status=1
stamp=$(mktemp); sleep 1
timeout -k 10 "${T_HOST:-120}" python3 -m dsfuse.bench.host_time run > "$out/host-time.log" 2>&1 || status=1
new=$(find experiments -path '*/raw/host-time/*' -name host_time.csv -newer "$stamp" -printf '%h\n')
[ -n "$new" ] && tar czf "$out/host-time.tar.gz" $new
if [ -n "${TESTS:-}" ]; then
  timeout -k 10 "${T_TESTS:-120}" python3 -m pytest $TESTS -m gpu -q -p no:cacheprovider -x \
    --junitxml "$out/junit-gpu.xml" > "$out/pytest-gpu.log" 2>&1 || status=1
fi
exit $status
