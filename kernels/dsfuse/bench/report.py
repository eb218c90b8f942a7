"""Result tables and plots generated from raw run data (never typed by hand).

``render(op, raw_root, results_dir, plots_dir)`` reads the newest run under
``raw_root`` and writes ``results/<op>.md`` (included by the docs) and
``<plots_dir>/<op>_<mode>.png``. Definitions:

* latency: median of all samples of a (case, provider, clock, regime);
* achieved bandwidth: the case's byte floor over the median, and its fraction
  of the fastest median device-to-device copy bandwidth of the same run;
* ratio: per block, median of the fastest valid control over the median of the
  candidate (> 1: dsfuse is faster); the table quotes the median over blocks and
  the range. The fastest valid control is the same-contract provider with the
  lowest overall median that passed every check before and after timing;
  anchors (other contracts) are shown but never used as the baseline.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402
from tabulate import tabulate  # noqa: E402

CLOCK_REGIMES = [("graph", "hot"), ("graph", "evicted"), ("eager", "hot"), ("eager", "evicted"), ("wall", "hot")]


def latest_run(raw_root: Path) -> Path:
    runs = sorted(p for p in Path(raw_root).iterdir() if (p / "samples.csv").exists()) if Path(raw_root).exists() else []
    if not runs:
        raise FileNotFoundError(f"no run with samples.csv under {raw_root}")
    return runs[-1]


def load_run(run_dir: Path) -> dict:
    return dict(
        run_id=run_dir.name,
        samples=pd.read_csv(run_dir / "samples.csv"),
        validation=pd.read_csv(run_dir / "validation.csv", keep_default_na=False),
        cases=pd.read_csv(run_dir / "cases.csv", keep_default_na=False),
        env=json.loads((run_dir / "env.json").read_text()),
        config=yaml.safe_load((run_dir / "config.yaml").read_text()) or {},
    )


def valid_providers(validation: pd.DataFrame) -> dict[str, set[str]]:
    """Per case: providers whose every check (before and after timing) passed."""
    checks = validation[validation["stage"].str.startswith(("before", "after"))]
    ok: dict[str, set[str]] = {}
    for (case, provider), rows in checks.groupby(["case", "provider"]):
        if (rows["status"] == "pass").all():
            ok.setdefault(case, set()).add(provider)
    return ok


def summarize(run: dict) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """Median latency table and the candidate-vs-control ratio table."""
    samples, cases, validation = run["samples"], run["cases"], run["validation"]
    copy = samples[samples["case"] == "copy"].groupby("clock")["us"].median()
    copy_bytes = int(cases.loc[cases["case"] == "copy", "bytes"].iloc[0])
    copy_bw = {clock: copy_bytes / us / 1e6 for clock, us in copy.items()}  # TB/s per clock
    # The ceiling is the fastest copy of the run: a memcpy captured in a CUDA Graph may
    # run on a copy engine, slower than the kernel copy that eager calls get.
    ceiling = max(copy_bw.values())
    params = {row.case: json.loads(row.params) for row in cases.itertuples()}
    floor_bytes = {row.case: int(row.bytes) for row in cases.itertuples()}
    roles = dict(zip(validation["provider"], validation["role"]))
    forms = dict(zip(validation["provider"], validation["form"]))
    valid = valid_providers(validation)

    timed = samples[samples["case"] != "copy"]
    med = timed.groupby(["case", "mode", "provider", "clock", "regime"])["us"].median().reset_index()

    def nbytes(case: str, provider: str) -> int:
        return int(params[case].get("bytes_by_provider", {}).get(provider, floor_bytes[case]))

    med["tbps"] = [nbytes(c, p) / us / 1e6 for c, p, us in zip(med["case"], med["provider"], med["us"])]
    med["of_copy"] = med["tbps"] / ceiling

    ratio_rows = []
    block_med = timed.groupby(["case", "provider", "clock", "regime", "block"])["us"].median()
    for (case, mode, clock, regime), grp in med.groupby(["case", "mode", "clock", "regime"]):
        for cand in grp[[roles.get(p) == "candidate" for p in grp["provider"]]].itertuples():
            controls = grp[[roles.get(p) == "control" and forms.get(p) == forms.get(cand.provider)
                            and p in valid.get(case, set()) for p in grp["provider"]]]
            if controls.empty:
                continue
            best = controls.loc[controls["us"].idxmin()]
            per_block = (block_med[(case, best.provider, clock, regime)] / block_med[(case, cand.provider, clock, regime)]).dropna()
            ratio_rows.append(dict(
                case=case, mode=mode, clock=clock, regime=regime, candidate=cand.provider,
                candidate_us=cand.us, control=best.provider, control_us=best.us,
                ratio=per_block.median(), ratio_min=per_block.min(), ratio_max=per_block.max(),
                candidate_valid=cand.provider in valid.get(case, set()),
                tbps=cand.tbps, of_copy=cand.of_copy,
                floor_us=nbytes(case, cand.provider) / (ceiling * 1e6),
            ))
    return med, pd.DataFrame(ratio_rows), copy_bw


def _fmt(x: float, digits: int = 1) -> str:
    return "n/a" if pd.isna(x) else f"{x:.{digits}f}"


def render(op: str, raw_root: Path, results_dir: Path, plots_dir: Path, smoke: bool = False) -> list[Path]:
    run_dir = latest_run(raw_root)
    run = load_run(run_dir)
    med, ratios, copy_bw = summarize(run)
    env = run["env"]
    ceiling = max(copy_bw.values())
    params = {row.case: json.loads(row.params) for row in run["cases"].itertuples()}
    floors = {
        (case, provider): int(params[case].get("bytes_by_provider", {}).get(provider, nbytes)) / (ceiling * 1e6)
        for case, nbytes in zip(run["cases"]["case"], run["cases"]["bytes"])
        for provider in set(med["provider"])
    }
    results_dir, plots_dir = Path(results_dir), Path(plots_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    plots_dir.mkdir(parents=True, exist_ok=True)

    lines = [f"<!-- generated by `python -m dsfuse.bench report {op}` from {run_dir.as_posix()}; do not edit -->", ""]
    if smoke:
        lines += ["**SMOKE RUN on CPU (Triton interpreter, tiny shapes): these numbers measure nothing.**", ""]
    pk = env.get("packages", {})
    lines += [
        f"Run `{run['run_id']}`: {env.get('gpu_name') or 'CPU'}"
        + (f" ({env.get('sm_count')} SMs, driver {env.get('driver')})" if env.get("gpu_name") else "")
        + f", torch {pk.get('torch')}, triton {pk.get('triton')}, commit `{(env.get('git_commit') or '?')[:10]}`"
        + (" (dirty tree)" if env.get("git_dirty") else "") + f", {env.get('date_utc')}.",
        "Same-run device-to-device copy bandwidth (bytes read + written): "
        + ", ".join(f"{clock} {bw:.2f} TB/s" for clock, bw in sorted(copy_bw.items()))
        + f"; the fastest, {max(copy_bw.values()):.2f} TB/s, is the ceiling for 'of copy' and 'floor us'.",
        "",
    ]

    if not ratios.empty:
        lines += ["### dsfuse against the fastest valid control", ""]
        table = [
            [r.case, r.candidate, f"{r.clock}/{r.regime}", _fmt(r.candidate_us), f"{r.control} {_fmt(r.control_us)}",
             f"{_fmt(r.ratio, 2)} [{_fmt(r.ratio_min, 2)}, {_fmt(r.ratio_max, 2)}]", _fmt(r.tbps, 2),
             f"{_fmt(100 * r.of_copy, 0)}%", _fmt(r.floor_us), "yes" if r.candidate_valid else "NO"]
            for r in ratios.sort_values(["mode", "case", "candidate", "clock", "regime"]).itertuples()
        ]
        lines.append(tabulate(table, headers=["case", "dsfuse", "clock/cache", "median us", "fastest control (us)",
                                              "ratio [min, max]", "TB/s", "of copy", "floor us", "checks pass"],
                              tablefmt="github"))
        lines.append("")

    targets = run["config"].get("targets", [])
    if targets:
        lines += ["### Targets", "",
                  "Each target as set for this op, the measured median (graph clock unless stated), the bytes "
                  "floor at the run's copy bandwidth, and whether it was met.", ""]
        table = []
        for t in targets:
            sel = med[(med["case"] == t["case"]) & (med["provider"] == t["provider"])
                      & (med["clock"] == t.get("clock", "graph")) & (med["regime"] == t.get("regime", "evicted"))]
            us = float(sel["us"].iloc[0]) if not sel.empty else float("nan")
            frac = float(sel["of_copy"].iloc[0]) if not sel.empty else float("nan")
            floor = floors.get((t["case"], t["provider"]), float("nan"))
            goal, verdict = [], []
            if "max_us" in t:
                goal.append(f"<= {t['max_us']} us")
                verdict.append("latency " + ("met" if us <= t["max_us"] else "MISSED"))
            if "min_of_copy" in t:
                goal.append(f">= {100 * t['min_of_copy']:.0f}% of copy")
                verdict.append("bandwidth " + ("met" if frac >= t["min_of_copy"] else "MISSED"))
            for other, factor in t.get("min_speedup", {}).items():
                ref = med[(med["case"] == t["case"]) & (med["provider"] == other)
                          & (med["clock"] == t.get("clock", "graph")) & (med["regime"] == t.get("regime", "evicted"))]
                speedup = float(ref["us"].iloc[0]) / us if not ref.empty else float("nan")
                goal.append(f">= {factor}x {other}")
                verdict.append(f"{_fmt(speedup, 2)}x {other} " + ("met" if speedup >= factor else "MISSED"))
            if "max_of_fastest" in t:  # latency at most this fraction of the fastest valid control's
                sel_r = ratios[(ratios["case"] == t["case"]) & (ratios["candidate"] == t["provider"])
                               & (ratios["clock"] == t.get("clock", "graph"))
                               & (ratios["regime"] == t.get("regime", "evicted"))] if not ratios.empty else ratios
                frac_c = float(us / sel_r["control_us"].iloc[0]) if not sel_r.empty else float("nan")
                goal.append(f"<= {t['max_of_fastest']:.2f}x the fastest valid control")
                verdict.append(f"{_fmt(frac_c, 2)}x {sel_r['control'].iloc[0] if not sel_r.empty else 'n/a'} "
                               + ("met" if frac_c <= t["max_of_fastest"] else "MISSED"))
            table.append([t["case"], t["provider"], f"{t.get('clock', 'graph')}/{t.get('regime', 'evicted')}",
                          " and ".join(goal), _fmt(us), f"{_fmt(100 * frac, 0)}%", _fmt(floor),
                          ", ".join(verdict) if not sel.empty else "not measured"])
        lines.append(tabulate(table, headers=["case", "provider", "clock/cache", "target", "median us", "of copy",
                                              "floor us", "verdict"], tablefmt="github"))
        lines.append("")

    lines += ["### Median latency of every provider (us)", ""]
    present = [cr for cr in CLOCK_REGIMES if ((med["clock"] == cr[0]) & (med["regime"] == cr[1])).any()]
    wide = med.pivot_table(index=["case", "provider"], columns=["clock", "regime"], values="us")
    table = [[case, provider] + [_fmt(wide.loc[(case, provider)].get(cr, float("nan"))) for cr in present]
             for case, provider in wide.index]
    lines.append(tabulate(table, headers=["case", "provider"] + [f"{c}/{r}" for c, r in present], tablefmt="github"))
    lines.append("")

    for junit in sorted(run_dir.glob("junit-gpu*.xml"), key=_junit_stamp):
        lines += _junit_summary(junit, op) + [""]

    import importlib

    from dsfuse.bench import EXPERIMENTS

    extra = getattr(importlib.import_module(EXPERIMENTS[op]), "report_extra", None) if op in EXPERIMENTS else None
    if extra is not None:
        lines += extra(run_dir)

    lines += ["### Correctness checks of the benchmark providers (before and after timing)", ""]
    val = run["validation"]
    table = []
    for (case, provider), rows in val.groupby(["case", "provider"], sort=False):
        failed = rows[rows["status"] == "fail"]
        skipped = rows[~rows["status"].isin(["pass", "fail", "n/a"])]
        if (rows["status"] == "n/a").all():
            continue
        status = "fail" if not failed.empty else ("pass" if (rows["status"] == "pass").any() else "not run")
        notes = {str(e).splitlines()[0] for e in pd.concat([failed, skipped])["error"] if e}
        notes |= {f"{r.mismatches} elements differ (max abs diff {float(r.max_abs_diff):.3g})"
                  for r in failed.itertuples() if not r.error and str(r.mismatches)}
        note = "; ".join(sorted(notes))
        table.append([case, provider, rows["check"].iloc[0], status,
                      ", ".join(sorted(set(rows.loc[rows["status"] == "pass", "stage"]))), note[:160]])
    lines.append(tabulate(table, headers=["case", "provider", "check", "status", "stages passed", "note"],
                          tablefmt="github"))
    lines.append("")
    table_path = results_dir / f"{op}.md"
    table_path.write_text("\n".join(lines))

    written = [table_path]
    tuning = write_tuning(op, raw_root, results_dir)
    if tuning:
        written.append(tuning)
    clock, regime = ("graph", "evicted") if "graph" in set(med["clock"]) else ("wall", "hot")
    colors = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(sorted(set(med["provider"])))}
    for mode, grp in med[(med["clock"] == clock) & (med["regime"] == regime)].groupby("mode"):
        floor = {case: floors[(case, "dsfuse")] for case in set(grp["case"]) if (case, "dsfuse") in floors}
        written.append(_plot(op, mode, grp, clock, regime, plots_dir, smoke, floor, colors))
    return written


def _junit_stamp(path: Path) -> str:
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return suite.get("timestamp", "") if suite is not None else ""


def _junit_summary(path: Path, op: str) -> list[str]:
    """One line per GPU test session stored with this raw data (from its JUnit XML)."""
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    stamp = _junit_stamp(path) or "?"
    cases = [c for c in root.iter("testcase") if op in c.get("classname", "")]
    failed = sum(1 for c in cases if c.find("failure") is not None or c.find("error") is not None)
    skipped = sum(1 for c in cases if c.find("skipped") is not None)
    files = sorted({c.get("classname").rsplit(".", 1)[-1] for c in cases})
    return [f"GPU tests of this op, session of {stamp} (`{path.name}` in the run folder): "
            f"{len(cases) - failed - skipped} passed, {failed} failed, {skipped} skipped ({', '.join(files)})."]


def write_tuning(op: str, raw_root: Path, results_dir: Path) -> Path | None:
    """Medians of every launch-constant sweep under ``raw/tuning/`` (one table per file)."""
    files = sorted((Path(raw_root) / "tuning").glob("blocks-*.csv"))
    host_files = sorted((Path(raw_root) / "tuning").glob("host-overhead-*.csv"))
    probe_files = sorted(set((Path(raw_root) / "tuning").glob("*.csv")) - set(files) - set(host_files))
    if not files and not host_files and not probe_files:
        return None
    lines = [f"<!-- generated by `python -m dsfuse.bench report {op}` from {Path(raw_root).as_posix()}/tuning; "
             "do not edit -->", ""]
    for path in files:
        df = pd.read_csv(path)
        df = df[df["regime"] == "evicted"]
        wide = df.groupby(["mode", "elements", "warps"])["us"].median().unstack("warps")
        lines += [f"**{path.stem}** (median us, CUDA Graph replay, L2 evicted; rows: mode and elements per "
                  "program, columns: warps)", ""]
        table = [[mode, elements] + [_fmt(v) for v in row] for (mode, elements), row in wide.iterrows()]
        lines += [tabulate(table, headers=["mode", "elements"] + [str(w) for w in wide.columns], tablefmt="github"), ""]
    for path in host_files:  # host time per call: part -> median over repetitions
        df = pd.read_csv(path)
        med = df.groupby("part", sort=False)["host_us"].median()
        lines += [f"**{path.stem}** (median host us per call, no synchronisation, small input)", ""]
        lines += [tabulate([[part, _fmt(us)] for part, us in med.items()], headers=["part", "host us"],
                           tablefmt="github"), ""]
    for path in probe_files:  # other probes: the median of ``us`` per combination of the other columns
        df = pd.read_csv(path)
        keys = [c for c in df.columns if c not in ("sample", "round", "block", "us")]  # rounds, blocks: repeats
        med = df.groupby(keys, sort=False)["us"].median().reset_index()
        repeats = [f"every {c}" for c in ("round", "block") if c in df]
        lines += [f"**{path.stem}** (median us over the samples{' of ' + ' and '.join(repeats) if repeats else ''}, "
                  "CUDA Graph replay, L2 evicted)", ""]
        lines += [tabulate(med.values.tolist(), headers=keys + ["us"], tablefmt="github", floatfmt=".1f"), ""]
    out = Path(results_dir) / f"{op}_tuning.md"
    out.write_text("\n".join(lines))
    return out


def _plot(op: str, mode: str, grp: pd.DataFrame, clock: str, regime: str, plots_dir: Path, smoke: bool,
          floor: dict[str, float], colors: dict) -> Path:
    cases = list(dict.fromkeys(grp["case"]))
    providers = sorted(set(grp["provider"]))
    fig, ax = plt.subplots(figsize=(8.5, 3.2), dpi=100)
    width = 0.8 / max(len(providers), 1)
    for i, provider in enumerate(providers):
        rows = grp[grp["provider"] == provider].set_index("case").reindex(cases)
        ax.bar([c + i * width for c in range(len(cases))], rows["us"], width, label=provider, color=colors[provider])
    for c, case in enumerate(cases):  # the out-of-place bytes floor at the run's copy bandwidth
        if case in floor:
            ax.hlines(floor[case], c - width / 2, c + 0.8 - width / 2, colors="black", linestyles="dashed",
                      label="bytes floor" if c == 0 else None)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))])
    ax.set_xticklabels([c.rsplit("_", 1)[0] for c in cases], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("median us (log)")
    title = f"{op} {mode}: {clock} clock, {regime} cache"
    ax.set_title(("SMOKE (CPU interpreter): " if smoke else "") + title, fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    path = plots_dir / f"{op}_{mode.replace('+', '_')}.png"
    fig.savefig(path)
    plt.close(fig)
    return path
