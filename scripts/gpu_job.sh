#!/usr/bin/env bash
# The GPU job: on a CUDA machine, run the GPU-marked tests and the op experiments in one go.
#   bash scripts/gpu_job.sh [OUT_DIR] [OPS...]
# Writes to OUT_DIR (default $OUT, else build/gpu-job): pytest log + junit XML, the bench log,
# and raw.tar.gz with the new experiments/*/raw/<run-id>/ folders (unpack at the repo root; then
# `python -m dsfuse.bench report --gpu <gpu>` renders results/<gpu>/; `python scripts/compact_raw.py` compresses
# the large raw CSVs before they are committed). Each op runs with the config of
# the GPU found (configs/<gpu>.yaml); its env.json records the hash of the op's kernel sources.
# Wheels under .carry/wheels-anchors (flash-linear-attention, Liger: the anchors) are installed if present.
# A tree copied to another machine (no .git, or a stale one) records DSFUSE_GIT_COMMIT, when set, as its commit (env.json).
# Also the output fingerprints (scripts/output_hashes.py --check) and the host-time experiment.
# TESTS=<paths> narrows the GPU tests, PYTEST_ARGS adds pytest arguments (e.g. "-n 8" with pytest-xdist);
# SKIP_TESTS, SKIP_BENCH, SKIP_HOST, SKIP_FINGERPRINTS skip those parts; HOST_OPS="<ops>" measures the host
# time of those ops instead of OPS, and HOST_PROFILE=1 adds their cProfile (host-profile.txt). A Gated DeltaNet run also
# gets its stage times and peak memory (experiments/gdn/stage_times.py) in its raw folder's stages/.
# DSFUSE_REQUIRE_CUTEDSL=1 (passed on to pytest) makes a missing cutedsl extra an error, not a skip.
# GDN_CUTEDSL=1 adds the CuTe DSL Gated DeltaNet forward's probe (experiments/gdn/fused_forward_probe.py, into
# experiments/gdn/raw/fused-forward/<stamp>-<gpu>/) and its compute-sanitizer runs (memcheck, racecheck, synccheck;
# each form of GDN_CUTEDSL_FORMS, default all) into the same folder's sanitizer.log; it needs the cutedsl extra (scripts/gpu_install_carry.sh a, b).
# STEP_TIMEOUT=<seconds> bounds each step, so a step that overruns still leaves the others' raw data
# packed in raw.tar.gz (the remote tree is replaced at the next call: only OUT_DIR comes back).
set -uo pipefail
out="${1:-${OUT:-build/gpu-job}}"; shift || true
ops=("$@")
mkdir -p "$out"
export PYTHONPATH="$PWD/kernels:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
if compgen -G ".carry/wheels-anchors/*.whl" > /dev/null; then  # whichever anchors travelled (FLA, Liger, pytest-xdist)
  python3 -m pip install -q --no-index --no-deps --target /tmp/dsfuse-site .carry/wheels-anchors/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/dsfuse-site"
fi
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
stamp=$(mktemp); sleep 1
status=0
step() { if [ -n "${STEP_TIMEOUT:-}" ]; then timeout -k 30 "$STEP_TIMEOUT" "$@"; else "$@"; fi; }
rm -f "$out/bench.log" "$out/junit-gpu.xml" "$out/raw.tar.gz" "$out/host-profile.txt"  # nothing stale from an earlier job in OUT_DIR
if [ -z "${SKIP_TESTS:-}" ]; then
  DSFUSE_REQUIRE_GPU=1 step python3 -m pytest ${TESTS:-tests} -m gpu -q -p no:cacheprovider -W ignore::UserWarning ${PYTEST_ARGS:-} \
    --junitxml "$out/junit-gpu.xml" 2>&1 | tee "$out/pytest-gpu.log" || status=1
fi
if [ -z "${SKIP_FINGERPRINTS:-}" ]; then
  step python3 scripts/output_hashes.py --check tests/golden/h200_output_fingerprints.json 2>&1 \
    | tee "$out/fingerprints.txt" || status=1
fi
if [ -z "${SKIP_HOST:-}" ]; then
  host_ops=("${ops[@]}"); [ -n "${HOST_OPS:-}" ] && read -ra host_ops <<< "$HOST_OPS"
  step python3 -m dsfuse.bench.host_time run "${host_ops[@]}" 2>&1 | tee "$out/host-time.log" || status=1
  if [ -n "${HOST_PROFILE:-}" ]; then
    step python3 -m dsfuse.bench.host_time profile "${host_ops[@]}" > "$out/host-profile.txt" 2>&1 || status=1
  fi
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  targets=("${ops[@]}")
  [ ${#targets[@]} -eq 0 ] && read -ra targets <<< "$(python3 -c 'from dsfuse.bench import experiments; print(*sorted(experiments()))')"
  for op in "${targets[@]}"; do  # one step per op: an op that overruns leaves the others' data
    step python3 -m dsfuse.bench run "$op" --gpu 2>&1 | tee -a "$out/bench.log" || status=1
  done
fi
if [ -n "${GDN_CUTEDSL:-}" ]; then
  probe="experiments/gdn/raw/fused-forward/$(date -u +%Y%m%d-%H%M%S)-$(python3 -c 'from dsfuse.bench.env import gpu_key; import torch; print(gpu_key(torch.cuda.get_device_name()))')"
  mkdir -p "$probe"
  for form in ${GDN_CUTEDSL_FORMS:-cuda_core tensor_core head}; do
    for tool in memcheck racecheck synccheck; do
      echo "== $tool $form" >> "$probe/sanitizer.log"
      step compute-sanitizer --tool "$tool" --error-exitcode 1 --report-api-errors no python3 experiments/gdn/sanitize_fused_forward.py --form "$form" \
        >> "$probe/sanitizer.log" 2>&1 || status=1
    done
  done
  step python3 experiments/gdn/fused_forward_probe.py "$probe" 2>&1 | tee "$probe/probe.log" || status=1
fi
new=$(find experiments -path '*/raw/*' \( -name samples.csv -o -name host_time.csv \) -newer "$stamp" -printf '%h\n')
for run in $new; do
  case "$run" in experiments/gdn/raw/2*)  # a bench run, not host-time/
    step python3 experiments/gdn/stage_times.py "$run/stages" --samples "${STAGE_SAMPLES:-10}" 2>&1 \
      | tee "$out/stage-times.log" || status=1 ;;
  esac
done
for run in $new; do  # the GPU test evidence travels with the raw data it belongs to
  [ -f "$out/junit-gpu.xml" ] && cp "$out/junit-gpu.xml" "$run/"
done
[ -n "$new" ] && tar czf "$out/raw.tar.gz" $new
exit $status
