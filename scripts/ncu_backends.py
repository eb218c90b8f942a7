"""Where the time of each backend's kernels goes: Nsight Compute counters at the model's shapes (GPU).

    python scripts/ncu_backends.py profile OUT_DIR [--ops OP ...]   # runs ncu on `run`: OUT_DIR/ncu.csv, calls.txt
    python scripts/ncu_backends.py render OUT_DIR OUT.md [OP]      # the table an op page includes (OP's calls)

The calls are every op's with an experiment (``dsfuse.bench.experiments()``, from the registry), on
each backend the registry lists for it (``OpBackends.kernels``): ``ncu_calls(device, backends)``
in ``kernels/dsfuse/bench/<op>.py`` gives them by name (an op without it is an error, not
skipped), and ``calls.txt`` names each ``<op> <call>``; e.g. the vision RoPE backward at T = 8649
(the model's 93 x 93 grid) and a copy of the same bytes, the Engram gate forward and backward at
N = 4096, the text RoPE forward at the model's q, the Gated DeltaNet forward and backward at the
seed's T = 32,768. ``run`` warms every call up (compiles, loads modules), then calls each once
between ``cudaProfilerStart`` and ``cudaProfilerStop``, each after a one-CTA marker kernel whose
grid size is the call's number in ``calls.txt``, so ncu profiles exactly those launches and the
rendering knows which call launched which kernel. ncu replays each kernel with the caches flushed
before each pass (its default cache control): the evicted-cache regime of the benchmarks. The
counters name what bounds a kernel (DRAM throughput against its peak, achieved occupancy, bytes
moved against the floor's bytes); ncu's replay serialises kernels, so its durations are not the
benchmark's latencies.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pandas as pd

METRICS = [  # one name per column of the rendered table
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "sm__maximum_warps_per_active_cycle_pct",
    "launch__registers_per_thread",
    "launch__grid_size",
    "launch__block_size",
]
COLUMNS = {"gpu__time_duration.sum": "ncu us", "dram__bytes_read.sum": "read MB", "dram__bytes_write.sum": "written MB",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM % of peak",
           "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM % of peak",
           "sm__warps_active.avg.pct_of_peak_sustained_active": "warps resident %",
           "sm__maximum_warps_per_active_cycle_pct": "max resident %",
           "launch__registers_per_thread": "registers", "launch__grid_size": "CTAs", "launch__block_size": "threads"}
SHOWN = [c for c in COLUMNS.values() if c != "max resident %"]  # the page's columns (ncu.csv keeps all)


def calls(device=None, names: list[str] | None = None) -> dict[str, object]:
    """The launches to profile, by name (the order of ``calls.txt``): each op's ``ncu_calls`` on every
    backend the registry lists for it, named ``<op> <call>`` (``LookupError`` naming an op without it)."""
    import torch

    from dsfuse._common.backends import load_all_ops
    from dsfuse.bench import experiments
    from dsfuse.bench.report import op_function

    dev = torch.device(device or "cuda")
    registry = load_all_ops()
    found = {}
    for op in names if names is not None else list(experiments()):
        pieces = op_function(op, "ncu_calls")
        for name, fn in pieces(dev, list(registry[op].kernels)).items():
            found[f"{op} {name}"] = fn
    return found


def run(out_dir: Path, names: list[str] | None = None) -> None:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def ncu_marker(x_ptr):
        tl.store(x_ptr + tl.program_id(0), 0.0)

    todo = calls(names=names)
    (out_dir / "calls.txt").write_text("\n".join(todo) + "\n")
    flag = torch.zeros(len(todo) + 1, device="cuda")
    for fn in todo.values():  # compile and load everything before profiling
        fn()
    ncu_marker[(1,)](flag)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for index, fn in enumerate(todo.values(), start=1):
        ncu_marker[(index,)](flag)
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def profile(out_dir: Path, names: list[str] | None = None) -> None:
    """ncu over ``run``: clocks left alone (``--clock-control none``), the listed counters."""
    import subprocess

    out_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["ncu", "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
                    "--metrics", ",".join(METRICS), "--log-file", str(out_dir / "ncu.csv"),
                    sys.executable, __file__, "run", str(out_dir), *(["--ops", *names] if names else [])], check=True)


def render(out_dir: Path, out_md: Path, op: str | None = None) -> None:
    """One row per profiled kernel: the call that launched it, its name and the counters (``op``: of
    that op's calls only)."""
    from dsfuse.bench.paths import raw_file
    from dsfuse.bench.tables import markdown

    names = (out_dir / "calls.txt").read_text().splitlines()
    raw = pd.read_csv(raw_file(out_dir, "ncu.csv"), comment="=", dtype=str)  # numbers may carry thousands separators
    raw = raw[raw["ID"].fillna("").str.isdigit()]  # the units row follows the header
    rows, call = [], None
    for _, r in raw.iterrows():
        grid = int(float(r["launch__grid_size"].replace(",", "")))
        if r["Kernel Name"].startswith("ncu_marker"):
            call = names[grid - 1]
            continue
        row = {"call": call, "kernel": kernel_name(r["Kernel Name"])}
        for metric, column in COLUMNS.items():
            value = float(r[metric].replace(",", ""))
            row[column] = value / 1e3 if metric == "gpu__time_duration.sum" else (
                value / 1e6 if metric.startswith("dram__bytes") else value)
        rows.append(row)
    table = pd.DataFrame(rows).round(1)[["call", "kernel", *SHOWN]]
    if op is not None:  # the op's calls, named without the op
        table = table[table["call"].str.startswith(op + " ")].assign(call=lambda t: t["call"].str.removeprefix(op + " "))
    command = " ".join(["python scripts/ncu_backends.py render", relative_to_root(out_dir), str(out_md), *([op] if op else [])])
    out_md.write_text(f"<!-- generated by {command}; do not edit -->\n\n" + markdown(table) + "\n")


def kernel_name(name: str) -> str:
    """A Triton kernel's function name; a CuTe DSL kernel's class (its mangled name carries the module,
    the class and the argument layouts)."""
    if found := re.search(r"cutedsl_(\w+?)_object_at", name):
        return f"{found.group(1)} (CuTe DSL)"
    return name.split("(")[0].strip("_").removesuffix("_kernel")  # a Triton function: _engram_fwd_kernel


def relative_to_root(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        return str(path)


def main(argv=None) -> int:
    from dsfuse.bench import experiments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for command, what in (("profile", "run ncu over `run`"), ("run", "the profiled process (started by profile)")):
        sub = commands.add_parser(command, help=what)
        sub.add_argument("out_dir", type=Path)
        sub.add_argument("--ops", nargs="+", choices=list(experiments()), metavar="OP",
                         help="only these ops (default: every op with an experiment)")
    sub = commands.add_parser("render", help="the table an op page includes")
    sub.add_argument("out_dir", type=Path)
    sub.add_argument("out_md", type=Path)
    sub.add_argument("op", nargs="?", help="only this op's calls, named without the op")
    args = parser.parse_args(argv)
    if args.command == "render":
        render(args.out_dir, args.out_md, args.op)
        return 0
    (run if args.command == "run" else profile)(args.out_dir, args.ops)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
