"""Benchmark harness shared by every experiment.

* :mod:`dsfuse.bench.harness`: cases, providers, correctness checks, paired-block
  timing (CUDA Graph replay and eager clocks; hot and evicted cache), the copy
  bandwidth of the same run, raw data under ``experiments/<op>/raw/<run-id>/``.
* :mod:`dsfuse.bench.report`: result tables (``results/``) and plots
  (``experiments/<op>/plots/``) generated from raw data.
* one module per op (``dsfuse.bench.text_rope``, ...) defining its cases,
  inputs, reference and providers; ``python -m dsfuse.bench`` runs them.
"""

EXPERIMENTS = {
    "text_rope": "dsfuse.bench.text_rope",
    "vision_rope": "dsfuse.bench.vision_rope",
    "engram_gate": "dsfuse.bench.engram_gate",
}
