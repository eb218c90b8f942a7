"""``python -m dsfuse.bench``: run experiments and render their tables and plots, per GPU.

    python -m dsfuse.bench run text_rope                 # the config of the GPU found; smoke config without one
    python -m dsfuse.bench run --report                  # every op, then its tables; the checks' summary last
    python -m dsfuse.bench run text_rope --config experiments/text_rope/configs/h200.yaml
    python -m dsfuse.bench report text_rope              # results/<gpu>/ and plots/<gpu>/ of every GPU's runs
    python -m dsfuse.bench report --gpu h200             # only that GPU's files (and the all-GPU indexes)
    python -m dsfuse.bench report --this-gpu             # only the GPU of this machine

The config of a GPU run is chosen by the device's name: ``experiments/<op>/configs/<gpu>.yaml``,
``<gpu>`` being `dsfuse.bench.env.gpu_key` of the name (``NVIDIA H200`` -> ``h200.yaml``,
``NVIDIA B200`` -> ``b200.yaml``; a variant such as ``NVIDIA H200 NVL`` falls back to its family's
``h200.yaml``). A GPU without a config stops the run with an error naming ``--config``.

A smoke run (no GPU) runs the Triton kernels in the interpreter on tiny shapes
and writes under ``build/smoke/`` so it never mixes with measured raw data.

``run`` ends with the summary of every provider's checks (`dsfuse.bench.checks`) and exits
with status 1 when a dsfuse provider failed one (a failing control is flagged, not fatal).

Every folder is the repository's (`dsfuse.bench.paths.repo_root`), from any
working directory; ``--config`` is taken relative to the working directory when
the file exists there, else relative to the repository root.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from dsfuse.bench import checks, experiments
from dsfuse.bench.env import gpu_key
from dsfuse._common.backends import interpreting, triton_mode_mismatch
from dsfuse.bench.paths import cli_path, relative, repo_root, smoke_root

FLUSH_OVER_L2 = 2  # the evicted regime's overwritten buffer must hold at least this many L2s


def _op_paths(op: str, smoke: bool) -> dict[str, Path]:
    """Absolute paths of an op's raw data, plots root and results root (``<gpu>/`` folders below both)."""
    out = smoke_root() if smoke else repo_root()
    return dict(
        raw=out / "experiments" / op / "raw",
        plots=out / "experiments" / op / "plots",
        results=out / "results",
    )


def config_for(op: str, gpu_name: str | None) -> Path:
    """The op's config for a GPU named ``gpu_name`` (``None``: the CPU smoke config).

    ``configs/<gpu_key>.yaml``, else the family's (the key's first part: ``h200-nvl`` -> ``h200``);
    a GPU with neither raises `SystemExit` naming ``--config`` and the configs there are.
    """
    configs = repo_root() / "experiments" / op / "configs"
    if gpu_name is None:
        return configs / "smoke.yaml"
    key = gpu_key(gpu_name)
    for name in dict.fromkeys([key, key.split("-")[0]]):
        if (configs / f"{name}.yaml").is_file():
            return configs / f"{name}.yaml"
    have = sorted(p.stem for p in configs.glob("*.yaml") if p.stem != "smoke")
    raise SystemExit(f"{op}: no config for this GPU ({gpu_name}): {relative(configs)}/{key}.yaml does not exist "
                     f"(configs there: {', '.join(have)}). Pass one with --config FILE (in a notebook: CONFIG), "
                     f"e.g. a copy of the closest GPU's with this GPU's L2 size in timing.flush_bytes.")


def check_flush(config: dict, l2_bytes: int, gpu_name: str) -> None:
    """The evicted regime overwrites ``timing.flush_bytes`` before each timed call: it must exceed the
    GPU's L2 (by `FLUSH_OVER_L2` times), or "evicted" would time a warm cache."""
    flush = int(config.get("timing", {}).get("flush_bytes", 256 << 20))
    if l2_bytes and flush < FLUSH_OVER_L2 * l2_bytes:
        raise SystemExit(f"timing.flush_bytes = {flush} is less than {FLUSH_OVER_L2} x the L2 of this {gpu_name} "
                         f"({l2_bytes} bytes): the evicted regime would not evict; use a config for this GPU")


def select_mode(smoke: bool | None) -> bool:
    """Decide between a smoke run (``None``: when no CUDA GPU is found) and a GPU run, and set
    ``TRITON_INTERPRET`` for it; return ``smoke``.

    Triton fixes its mode at import (`dsfuse._common.backends.triton_mode_mismatch`), so this
    runs before anything imports a kernel module: the CLI calls it first, ``dsfuse.bench`` imports
    no op, and a process that imported Triton in the other mode is stopped here with the reason."""
    import torch

    if smoke is None:
        smoke = not torch.cuda.is_available()
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("--gpu: no CUDA GPU is available (torch.cuda.is_available() is False); use --smoke")
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # "1" even where the caller exported "0"
    elif interpreting():
        raise SystemExit("TRITON_INTERPRET is set: a GPU run would check and time Triton's interpreter; "
                         "unset it (or pass --smoke)")
    mismatch = triton_mode_mismatch()
    if mismatch:
        raise SystemExit(f"cannot start a {'smoke' if smoke else 'GPU'} run in this process: {mismatch} "
                         "(in a notebook: restart the kernel)")
    return smoke


RESERVED_SUBDIRS = {"runs", "host_time", "tuning", "stages", "cp", "ncu", "all_gpus", "tuning_all_gpus"}


def raw_root(raw: Path, config: dict) -> Path:
    """Where a run of ``config`` writes: the op's raw folder, or its ``raw_subdir`` (a config apart
    from the op's tables, e.g. the long-document one: the report reads only the folder's own runs)."""
    sub = config.get("raw_subdir")
    if sub is None:
        return raw
    if not isinstance(sub, str) or not sub.isidentifier():
        raise ValueError(f"raw_subdir: expected a folder name (letters, digits, _), got {sub!r}")
    if sub in RESERVED_SUBDIRS:  # its tables, <op>_<sub>.md, would overwrite the op's own files of that name
        raise ValueError(f"raw_subdir: {sub!r} names one of the op's own result files; choose another name")
    return raw / sub


def run(op: str, config_path: str | None, smoke: bool | None, cases: list[str] | None = None) -> Path:
    import torch

    smoke = select_mode(smoke)
    from dsfuse.bench.harness import load_config, run_experiment

    paths = _op_paths(op, smoke)
    gpu_name = None if smoke else torch.cuda.get_device_name()
    chosen = cli_path(config_path) if config_path else config_for(op, gpu_name)
    config = load_config(chosen)
    if cases is not None:  # a part of the config: the run's config.yaml records which (`harness.selected_cases`)
        config["cases"] = cases
    if not smoke:
        props = torch.cuda.get_device_properties(0)
        check_flush(config, int(getattr(props, "L2_cache_size", 0)), gpu_name)
        check_backends(config, op)
    print(f"{op}: config {relative(chosen)}" + ("" if smoke else f" for the {gpu_name}"))
    experiment = importlib.import_module(experiments()[op])
    device = torch.device("cpu" if smoke else "cuda")
    run_dir = run_experiment(experiment, config, raw_root(paths["raw"], config), device)
    if hasattr(experiment, "after_run"):  # op-specific whole-model checks that belong to the run
        experiment.after_run(config, run_dir, device)
    print(f"{'SMOKE RUN (CPU, interpreter; not a measurement): ' if smoke else ''}raw data in {run_dir}")
    return run_dir


def check_backends(config: dict, op: str) -> None:
    """A GPU run whose config lets ``auto`` choose, for an op with a CuTe DSL backend, on a machine
    without it, measures the Triton kernels under the candidates' names: refused under
    ``DSFUSE_REQUIRE_CUTEDSL=1`` (a job meant to measure that backend), said loudly otherwise (the report
    says it too, from env.json)."""
    from dsfuse._common.backends import AUTO, BACKENDS
    from dsfuse.bench.report import has_cutedsl_backend

    if config.get("backend", AUTO) != AUTO or BACKENDS["cutedsl"].installed or not has_cutedsl_backend(op):
        return
    what = ("backend: auto, but the CuTe DSL backend is not installed (nvidia-cutlass-dsl, apache-tvm-ffi): "
            "the dsfuse providers would run the Triton kernels")
    if os.environ.get("DSFUSE_REQUIRE_CUTEDSL") == "1":
        raise SystemExit(f"DSFUSE_REQUIRE_CUTEDSL=1 and {what}; install the cutedsl extra or unset it")
    print(f"WARNING: {what}", file=sys.stderr)


def this_gpu() -> str:
    """The folder name of this machine's GPU (``cpu`` without one)."""
    import torch

    return gpu_key(torch.cuda.get_device_name() if torch.cuda.is_available() else None)


def report(op: str, smoke: bool, gpus: set[str] | None = None) -> list[Path]:
    """Render ``op``'s results per GPU (only ``gpus`` when given) from its raw runs; return the paths written."""
    from dsfuse.bench.report import render, runs_by_gpu

    paths = _op_paths(op, smoke)
    if not runs_by_gpu(paths["raw"]) and not runs_by_gpu(paths["raw"] / "host-time", marker="host_time.csv"):
        print(f"{op}: no raw run under {paths['raw']} yet; nothing to render (run the experiment first)")
        return []
    written = render(op, paths["raw"], paths["results"], paths["plots"], smoke=smoke, gpus=gpus)
    for path in written:
        print(f"wrote {path}")
    return written


def write_status(smoke: bool) -> None:
    """The status of every op (``results/status.md`` and the README's block), from the results of every
    GPU; not for a smoke run, whose results measure nothing."""
    if smoke:
        return
    from dsfuse.bench import status

    for path in status.write(repo_root(), sorted(experiments())):
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsfuse.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="check and time an op's providers; write raw data")
    p_run.add_argument("ops", nargs="*", help="ops (default: all)")
    p_run.add_argument("--report", action="store_true",
                       help="render each op's tables and plots after its run (that GPU's files only)")
    p_run.add_argument("--config", help="config YAML (default: the op's configs/<gpu>.yaml for the GPU found, "
                                        "or smoke.yaml without GPU)")
    p_run.add_argument("--cases", type=lambda s: [c.strip() for c in s.split(",") if c.strip()],
                       metavar="NAME,NAME", help="run only these cases of one op's config, in the config's "
                                                 "order (the run is a part of the config)")
    mode = p_run.add_mutually_exclusive_group()
    mode.add_argument("--smoke", dest="smoke", action="store_true", default=None, help="force a CPU smoke run")
    mode.add_argument("--gpu", dest="smoke", action="store_false", help="require the GPU run")
    p_rep = sub.add_parser("report", help="render results/<gpu>/ tables and plots from raw data")
    p_rep.add_argument("ops", nargs="*", help="ops (default: all)")
    p_rep.add_argument("--smoke", action="store_true", help="render the smoke run under build/smoke/")
    which = p_rep.add_mutually_exclusive_group()
    which.add_argument("--gpu", dest="gpus", action="append", metavar="GPU",
                       help="only this GPU's results (a folder name under results/, e.g. h200; repeatable)")
    which.add_argument("--this-gpu", action="store_true", help="only the results of this machine's GPU")
    args = parser.parse_args(argv)
    smoke = select_mode(args.smoke) if args.command == "run" else args.smoke  # before the ops are imported
    known = sorted(experiments())
    unknown = [op for op in args.ops if op not in known]
    if unknown:
        parser.error(f"unknown ops {unknown}; expected some of {known}")
    ops = args.ops or known
    if args.command == "run" and args.cases is not None and len(ops) != 1:
        parser.error("--cases names the cases of one op's config: name exactly one op")
    if args.command == "report":
        gpus = {this_gpu()} if args.this_gpu else (set(args.gpus) if args.gpus else None)
        for op in ops:
            report(op, smoke, gpus)
        write_status(smoke)
        return 0
    summary = []
    for op in ops:
        run_dir = run(op, args.config, smoke, args.cases)
        if args.report:
            from dsfuse.bench.report import run_gpu

            report(op, smoke, {run_gpu(run_dir)})
        summary += checks.summarize(op, run_dir)
    if args.report:
        write_status(smoke)
    print("\nChecks of this run (dsfuse providers must pass; controls that fail are flagged and not used):")
    print(checks.render(summary))
    return 1 if checks.failures(summary) else 0


if __name__ == "__main__":
    sys.exit(main())
