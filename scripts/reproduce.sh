#!/usr/bin/env bash
# Set up (scripts/setup.sh), then reproduce every op experiment and render its tables and plots.
# On a CUDA GPU: the full experiments with the GPU's config (configs/<gpu>.yaml, chosen by the
#   device name: h200.yaml, b200.yaml; another GPU: pass --config FILE), raw data under
#   experiments/<op>/raw/, this GPU's tables in results/<gpu>/ and plots in experiments/<op>/plots/<gpu>/
#   (no other GPU's files are rewritten).
# Without one: a SMOKE run (Triton interpreter, tiny shapes) that validates every provider and
#   renders under build/smoke/; its numbers measure nothing.
# Either way it ends with the summary of every provider's checks and exits 1 when a dsfuse
# provider failed one (controls that fail are flagged in the summary, not fatal).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
py="${DSFUSE_VENV:-.venv}/bin/python"
if "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  exec "$py" -m dsfuse.bench run --gpu --report "$@"
fi
echo "No CUDA GPU found: running the SMOKE experiment on CPU (validation + rendering only)."
exec "$py" -m dsfuse.bench run --smoke --report "$@"
