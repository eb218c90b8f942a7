"""Where a kernel's time goes, from Nsight Compute's per-instruction (SASS) counters.

Input: the CSV of ``ncu --import <report> --page source --print-source sass --csv`` (gzip or plain),
from a report with the SourceCounters section. Output (markdown): the warp-stall samples and executed
instructions summed per stretch of code between two CTA barriers (``BAR.SYNC``; the barrier's own
waiting counted with the stretch that ends at it), and per instruction kind, with the main stall
reasons of each. A stretch is a step of the kernel between two ``sync_threads``; the kernel's
docstring names them in order.

    python experiments/gdn/ncu_sass_summary.py experiments/gdn/raw/fused-forward/<run>/ncu-head-sass.csv.gz
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re
from pathlib import Path

import pandas as pd

SAMPLES, EXECUTED, SOURCE = "Warp Stall Sampling (All Samples)", "Instructions Executed", "Source"


def read(path: Path) -> pd.DataFrame:
    """The instruction rows: source text, opcode, samples, executed instructions and stall columns."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    header = next(i for i, r in enumerate(rows) if SOURCE in r)  # a line naming the kernel comes first
    df = pd.DataFrame(rows[header + 1:], columns=rows[header])
    stalls = [c for c in df.columns if c.startswith("stall_") and "Not Issued" not in c]
    for col in [SAMPLES, EXECUTED, *stalls]:
        df[col] = pd.to_numeric(df[col], errors="coerce").fillna(0).astype(int)
    df["opcode"] = df[SOURCE].str.strip().map(lambda s: re.sub(r"^@!?U?P\w+\s+", "", s).split(" ")[0].split(".")[0])
    df["stretch"] = df[SOURCE].str.contains("BAR.SYNC").shift(fill_value=False).cumsum()
    return df


def _top_stalls(group: pd.DataFrame, n: int = 3) -> str:
    sums = group[[c for c in group.columns if c.startswith("stall_") and "Not Issued" not in c]].sum()
    total = max(sums.sum(), 1)
    return ", ".join(f"{name[6:]} {value / total:.0%}" for name, value in sums.nlargest(n).items() if value)


def summary(df: pd.DataFrame, top: int = 15) -> str:
    samples, executed = df[SAMPLES].sum(), df[EXECUTED].sum()
    out = [f"{len(df)} instructions, {executed:,} executed (warp level), {samples:,} stall samples.", "",
           "| stretch (ends at a barrier) | lines | samples | executed | main opcodes | main stalls |",
           "| --- | ---: | ---: | ---: | --- | --- |"]
    for stretch, g in df.groupby("stretch"):
        ops = collections.Counter(g["opcode"]).most_common(4)
        out.append(f"| {stretch + 1} | {g.index[0]}-{g.index[-1]} | {g[SAMPLES].sum() / samples:.1%} | "
                   f"{g[EXECUTED].sum() / executed:.1%} | {', '.join(f'{o} {n}' for o, n in ops)} | {_top_stalls(g)} |")
    out += ["", "| opcode | samples | executed | main stalls |", "| --- | ---: | ---: | --- |"]
    by_op = df.groupby("opcode")
    for op in by_op[SAMPLES].sum().nlargest(top).index:
        g = by_op.get_group(op)
        shares = f"{g[SAMPLES].sum() / samples:.1%} | {g[EXECUTED].sum() / executed:.1%}"
        out.append(f"| {op} | {shares} | {_top_stalls(g)} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path, help="the SASS page of an ncu report, as CSV (.csv or .csv.gz)")
    parser.add_argument("--top", type=int, default=15, help="opcodes listed (default 15)")
    args = parser.parse_args()
    print(summary(read(args.csv), args.top))


if __name__ == "__main__":
    main()
