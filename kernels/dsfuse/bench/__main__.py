"""``python -m dsfuse.bench``: run experiments and render their tables and plots.

    python -m dsfuse.bench run text_rope                 # GPU config on a GPU, smoke config otherwise
    python -m dsfuse.bench run text_rope --config experiments/text_rope/configs/h200.yaml
    python -m dsfuse.bench report text_rope              # results/ and experiments/<op>/plots/ from raw data

A smoke run (no GPU) runs the Triton kernels in the interpreter on tiny shapes
and writes under ``build/smoke/`` so it never mixes with measured raw data.

Every folder is the repository's (:func:`dsfuse.bench.paths.repo_root`), from any
working directory; ``--config`` is taken relative to the working directory when
the file exists there, else relative to the repository root.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from dsfuse.bench import EXPERIMENTS, host_time
from dsfuse.bench.paths import cli_path, repo_root, smoke_root


def _op_paths(op: str, smoke: bool) -> dict[str, Path]:
    """Absolute paths of an op's raw data, plots, result tables and default config."""
    repo = repo_root()
    out = smoke_root() if smoke else repo
    return dict(
        raw=out / "experiments" / op / "raw",
        plots=out / "experiments" / op / "plots",
        results=out / "results",
        config=repo / "experiments" / op / "configs" / ("smoke.yaml" if smoke else "h200.yaml"),
    )


def run(op: str, config_path: str | None, smoke: bool | None) -> Path:
    import torch

    if smoke is None:
        smoke = not torch.cuda.is_available()
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("--gpu: no CUDA GPU is available (torch.cuda.is_available() is False); use --smoke")
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first kernel launch
    from dsfuse.bench.harness import load_config, run_experiment

    paths = _op_paths(op, smoke)
    config = load_config(cli_path(config_path) if config_path else paths["config"])
    experiment = importlib.import_module(EXPERIMENTS[op])
    device = torch.device("cpu" if smoke else "cuda")
    run_dir = run_experiment(experiment, config, paths["raw"], device)
    if hasattr(experiment, "after_run"):  # op-specific whole-model checks that belong to the run
        experiment.after_run(config, run_dir, device)
    print(f"{'SMOKE RUN (CPU, interpreter; not a measurement): ' if smoke else ''}raw data in {run_dir}")
    return run_dir


def report(op: str, smoke: bool) -> list[Path]:
    from dsfuse.bench.report import latest_run, render

    paths = _op_paths(op, smoke)
    try:
        latest_run(paths["raw"])
    except FileNotFoundError:
        print(f"{op}: no raw run under {paths['raw']} yet; nothing to render (run the experiment first)")
        return []
    written = render(op, paths["raw"], paths["results"], paths["plots"], smoke=smoke)
    if not smoke:
        written += host_time.write_report(op)
    for path in written:
        print(f"wrote {path}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsfuse.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="check and time an op's providers; write raw data")
    p_run.add_argument("ops", nargs="*", default=sorted(EXPERIMENTS), help="ops (default: all)")
    p_run.add_argument("--config", help="config YAML (default: the op's h200.yaml, or smoke.yaml without GPU)")
    mode = p_run.add_mutually_exclusive_group()
    mode.add_argument("--smoke", dest="smoke", action="store_true", default=None, help="force a CPU smoke run")
    mode.add_argument("--gpu", dest="smoke", action="store_false", help="require the GPU run")
    p_rep = sub.add_parser("report", help="render results/ tables and plots from raw data")
    p_rep.add_argument("ops", nargs="*", default=sorted(EXPERIMENTS))
    p_rep.add_argument("--smoke", action="store_true", help="render the smoke run under build/smoke/")
    args = parser.parse_args(argv)
    unknown = [op for op in args.ops if op not in EXPERIMENTS]
    if unknown:
        parser.error(f"unknown ops {unknown}; expected some of {sorted(EXPERIMENTS)}")
    for op in args.ops:
        if args.command == "run":
            run(op, args.config, args.smoke)
        else:
            report(op, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
