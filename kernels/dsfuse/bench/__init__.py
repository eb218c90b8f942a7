"""Benchmark harness shared by every experiment.

* `dsfuse.bench.harness`: cases, providers, correctness checks, paired-block
  timing (CUDA Graph replay and eager clocks; hot and evicted cache), the copy
  bandwidth of the same run, raw data under ``experiments/<op>/raw/<run-id>/``.
* `dsfuse.bench.report`: result tables (``results/``) and plots
  (``experiments/<op>/plots/``) generated from raw data.
* one module per op (``dsfuse.bench.text_rope``, ...) defining its cases,
  inputs, reference and providers; ``python -m dsfuse.bench`` runs them.
"""

import functools
import importlib.util


@functools.cache
def experiments() -> dict[str, str]:
    """Every registered op that has an experiment module ``dsfuse.bench.<op>`` (no list to keep).

    Looked up on first use, not when ``dsfuse.bench`` is imported: listing the ops imports their
    kernels, and with them Triton, which fixes its mode (compiled or interpreted) at import, so
    ``python -m dsfuse.bench`` must be able to choose ``TRITON_INTERPRET`` first."""
    from dsfuse._common.backends import load_all_ops

    return {op: f"dsfuse.bench.{op}" for op in load_all_ops() if importlib.util.find_spec(f"dsfuse.bench.{op}")}
