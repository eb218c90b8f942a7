"""Where the time of each backend's kernels goes: Nsight Compute counters at the model's shapes (GPU).

    python scripts/ncu_backends.py profile OUT_DIR         # runs ncu on `run`: OUT_DIR/ncu.csv, calls.txt
    python scripts/ncu_backends.py render OUT_DIR OUT.md [OP]  # the table an op page includes (OP's calls)

``run`` warms every call up (compiles, loads modules), then calls each once between
``cudaProfilerStart`` and ``cudaProfilerStop``, each after a one-CTA marker kernel whose grid size
is the call's number in ``calls.txt``, so ncu profiles exactly those launches and the rendering
knows which call launched which kernel: the vision RoPE backward at T = 8649 (the model's 93 x 93 grid; 16 heads x
64, bf16, dK in its [H, D, T] storage) on the Triton and the CuTe DSL backends and a copy of the
same bytes, and the Engram gate forward and backward at N = 4096 (4 streams x 5120, bf16) on both
backends. ncu replays each kernel with the caches flushed before each pass (its default cache
control): the evicted-cache regime of the benchmarks. The counters name what bounds a kernel
(DRAM throughput against its peak, achieved occupancy, bytes moved against the floor's bytes);
ncu's replay serialises kernels, so its durations are not the benchmark's latencies.
"""

from __future__ import annotations

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


def calls() -> dict[str, object]:
    """The launches to profile, by name (the order of ``calls.txt``)."""
    import torch

    from dsfuse.bench.engram_gate import gate_inputs
    from dsfuse.engram_gate import engram_gate_backward, engram_gate_forward
    from dsfuse.vision_rope import vision_rope_backward

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    heads, tokens, dim = 16, 8649, 64
    dq, dv = (torch.randn(heads, tokens, dim, device=dev, generator=gen).bfloat16() for _ in range(2))
    dk_hdt = torch.randn(heads, dim, tokens, device=dev, generator=gen).bfloat16()
    angles = torch.rand(tokens, dim // 2, device=dev, generator=gen) * 6.3
    cos, sin = angles.cos(), angles.sin()
    dqkv = torch.empty(tokens, 3 * heads * dim, device=dev, dtype=torch.bfloat16)
    src = torch.empty(dqkv.numel() + cos.numel() * 2 * 2, dtype=torch.bfloat16, device=dev)  # same bytes read
    dst = torch.empty_like(src)
    x, kv, weight, mask, dout, eps = gate_inputs(4096, dev)
    out, saved = engram_gate_forward(x, kv, weight, mask, eps=eps)
    grads = [torch.empty_like(x), torch.empty_like(kv), torch.empty_like(weight)]
    found = {"vision_rope bwd T8649: copy of the bytes it reads": lambda: torch.add(src, 0, out=dst)}  # a kernel
    for backend in ("triton", "cutedsl"):
        found[f"vision_rope bwd T8649: {backend}"] = (
            lambda b=backend: vision_rope_backward(dq, dk_hdt, dv, cos, sin, out=dqkv, backend=b))
        found[f"engram_gate fwd N4096: {backend}"] = (
            lambda b=backend: engram_gate_forward(x, kv, weight, mask, eps=eps, out=out, saved=saved, backend=b))
        found[f"engram_gate bwd N4096: {backend}"] = (
            lambda b=backend: engram_gate_backward(dout, x, kv, weight, mask, saved, eps=eps, dx=grads[0],
                                                   dkv=grads[1], dweight=grads[2], backend=b))
    return found


def run(out_dir: Path) -> None:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def ncu_marker(x_ptr):
        tl.store(x_ptr + tl.program_id(0), 0.0)

    todo = calls()
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


def profile(out_dir: Path) -> None:
    """ncu over ``run``: clocks left alone (``--clock-control none``), the listed counters."""
    import subprocess

    out_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["ncu", "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
                    "--metrics", ",".join(METRICS), "--log-file", str(out_dir / "ncu.csv"),
                    sys.executable, __file__, "run", str(out_dir)], check=True)


def render(out_dir: Path, out_md: Path, op: str | None = None) -> None:
    """One row per profiled kernel: the call that launched it, its name and the counters (``op``: of
    that op's calls only)."""
    from dsfuse.bench.tables import markdown

    names = (out_dir / "calls.txt").read_text().splitlines()
    raw = pd.read_csv(out_dir / "ncu.csv", comment="=", dtype=str)  # numbers may carry thousands separators
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


if __name__ == "__main__":
    command, *paths = sys.argv[1:] or [""]
    if command in ("run", "profile") and len(paths) == 1:
        (run if command == "run" else profile)(Path(paths[0]))
    elif command == "render" and len(paths) in (2, 3):
        render(Path(paths[0]), Path(paths[1]), *paths[2:])
    else:
        sys.exit(__doc__)
