"""Result tables and plots generated from raw run data (never typed by hand).

``render(op, raw_root, results_dir, plots_dir)`` reads the newest run under
``raw_root`` and writes ``results/<op>.md`` (included by the docs) and
``<plots_dir>/<op>_<mode>.png``; each section and table is its own small function
(the tables' DataFrames in :mod:`dsfuse.bench.tables`). Definitions:

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

import importlib
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402

from dsfuse.bench.paths import relative  # noqa: E402
from dsfuse.bench.tables import (  # noqa: E402
    CLOCK_REGIMES,  # noqa: F401  (part of this module's interface)
    REPEATS,
    blocks_table,
    check_table,
    host_table,
    latency_table,
    markdown,
    probe_table,
    ratio_table,
    target_table,
)
from dsfuse.bench.tables import fmt as _fmt  # noqa: E402, F401  (used by the ops' report_extra)

SMOKE_BANNER = "**SMOKE RUN on CPU (Triton interpreter, tiny shapes): these numbers measure nothing.**"
TARGETS_INTRO = ("Each target as set for this op, the measured median (graph clock unless stated), the bytes "
                 "floor at the run's copy bandwidth, and whether it was met.")


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
    copy_bw = copy_bandwidth(samples, cases)
    # The ceiling is the fastest copy of the run: a memcpy captured in a CUDA Graph may
    # run on a copy engine, slower than the kernel copy that eager calls get.
    ceiling = max(copy_bw.values())
    nbytes = provider_bytes(cases)
    timed = samples[samples["case"] != "copy"]
    med = timed.groupby(["case", "mode", "provider", "clock", "regime"])["us"].median().reset_index()
    med["tbps"] = [nbytes(c, p) / us / 1e6 for c, p, us in zip(med["case"], med["provider"], med["us"])]
    med["of_copy"] = med["tbps"] / ceiling
    return med, candidate_ratios(med, timed, validation, nbytes, ceiling), copy_bw


def copy_bandwidth(samples: pd.DataFrame, cases: pd.DataFrame) -> dict[str, float]:
    """TB/s per clock of the run's device-to-device copy (median of its samples)."""
    copy = samples[samples["case"] == "copy"].groupby("clock")["us"].median()
    copy_bytes = int(cases.loc[cases["case"] == "copy", "bytes"].iloc[0])
    return {clock: copy_bytes / us / 1e6 for clock, us in copy.items()}


def provider_bytes(cases: pd.DataFrame):
    """``nbytes(case, provider)``: the case's byte floor, unless its params name the provider's own."""
    params = {row.case: json.loads(row.params) for row in cases.itertuples()}
    floor_bytes = {row.case: int(row.bytes) for row in cases.itertuples()}

    def nbytes(case: str, provider: str) -> int:
        return int(params[case].get("bytes_by_provider", {}).get(provider, floor_bytes[case]))

    return nbytes


def candidate_ratios(med: pd.DataFrame, timed: pd.DataFrame, validation: pd.DataFrame, nbytes, ceiling: float
                     ) -> pd.DataFrame:
    """Per candidate, case, clock and regime: the fastest valid same-form control and the per-block ratio."""
    roles = dict(zip(validation["provider"], validation["role"]))
    forms = dict(zip(validation["provider"], validation["form"]))
    valid = valid_providers(validation)
    block_med = timed.groupby(["case", "provider", "clock", "regime", "block"])["us"].median()
    ratio_rows = []
    for (case, mode, clock, regime), grp in med.groupby(["case", "mode", "clock", "regime"]):
        for cand in grp[[roles.get(p) == "candidate" for p in grp["provider"]]].itertuples():
            controls = grp[[roles.get(p) == "control" and forms.get(p) == forms.get(cand.provider)
                            and p in valid.get(case, set()) for p in grp["provider"]]]
            if controls.empty:
                continue
            best = controls.loc[controls["us"].idxmin()]
            per_block = (block_med[(case, best.provider, clock, regime)]
                         / block_med[(case, cand.provider, clock, regime)]).dropna()
            ratio_rows.append(dict(
                case=case, mode=mode, clock=clock, regime=regime, candidate=cand.provider,
                candidate_us=cand.us, control=best.provider, control_us=best.us,
                ratio=per_block.median(), ratio_min=per_block.min(), ratio_max=per_block.max(),
                candidate_valid=cand.provider in valid.get(case, set()),
                tbps=cand.tbps, of_copy=cand.of_copy,
                floor_us=nbytes(case, cand.provider) / (ceiling * 1e6),
            ))
    return pd.DataFrame(ratio_rows)


def bytes_floors(cases: pd.DataFrame, providers: set[str], ceiling: float) -> dict[tuple[str, str], float]:
    """us per (case, provider) to move the bytes the provider must move at the run's copy ceiling."""
    nbytes = provider_bytes(cases)
    return {(case, provider): nbytes(case, provider) / (ceiling * 1e6)
            for case in cases["case"] for provider in providers}


def render(op: str, raw_root: Path, results_dir: Path, plots_dir: Path, smoke: bool = False) -> list[Path]:
    """Write ``<results_dir>/<op>.md``, the tuning tables and the plots of the newest run; return their paths."""
    run_dir = latest_run(raw_root)
    run = load_run(run_dir)
    med, ratios, copy_bw = summarize(run)
    floors = bytes_floors(run["cases"], set(med["provider"]), max(copy_bw.values()))
    results_dir, plots_dir = Path(results_dir), Path(plots_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    plots_dir.mkdir(parents=True, exist_ok=True)

    lines = header_lines(op, run_dir, run, copy_bw, smoke)
    lines += ratio_section(ratios)
    lines += targets_section(run["config"].get("targets", []), med, ratios, floors)
    lines += latency_section(med)
    lines += junit_section(run_dir, op)
    lines += extra_section(op, run_dir)
    lines += checks_section(run["validation"])
    table_path = results_dir / f"{op}.md"
    table_path.write_text("\n".join(lines))

    written = [table_path]
    tuning = write_tuning(op, raw_root, results_dir)
    if tuning:
        written.append(tuning)
    return written + plot_modes(op, med, floors, plots_dir, smoke)


def section(title: str, *blocks: str) -> list[str]:
    """A level-3 heading, then each block (a paragraph or a table) followed by a blank line."""
    lines = [f"### {title}", ""]
    for block in blocks:
        lines += [block, ""]
    return lines


def header_lines(op: str, run_dir: Path, run: dict, copy_bw: dict[str, float], smoke: bool) -> list[str]:
    lines = [f"<!-- generated by `python -m dsfuse.bench report {op}` from {relative(run_dir)}; do not edit -->", ""]
    if smoke:
        lines += [SMOKE_BANNER, ""]
    return lines + [run_line(run["run_id"], run["env"]), copy_line(copy_bw), ""]


def run_line(run_id: str, env: dict) -> str:
    """The run: device, torch and triton versions, commit, date."""
    pk = env.get("packages", {})
    device = env.get("gpu_name") or "CPU"
    if env.get("gpu_name"):
        device += f" ({env.get('sm_count')} SMs, driver {env.get('driver')})"
    commit = f"`{(env.get('git_commit') or '?')[:10]}`" + (" (dirty tree)" if env.get("git_dirty") else "")
    return (f"Run `{run_id}`: {device}, torch {pk.get('torch')}, triton {pk.get('triton')}, commit {commit}, "
            f"{env.get('date_utc')}.")


def copy_line(copy_bw: dict[str, float]) -> str:
    rates = ", ".join(f"{clock} {bw:.2f} TB/s" for clock, bw in sorted(copy_bw.items()))
    return (f"Same-run device-to-device copy bandwidth (bytes read + written): {rates}; the fastest, "
            f"{max(copy_bw.values()):.2f} TB/s, is the ceiling for 'of copy' and 'floor us'.")


def ratio_section(ratios: pd.DataFrame) -> list[str]:
    return [] if ratios.empty else section("dsfuse against the fastest valid control", markdown(ratio_table(ratios)))


def targets_section(targets: list[dict], med: pd.DataFrame, ratios: pd.DataFrame,
                    floors: dict[tuple[str, str], float]) -> list[str]:
    if not targets:
        return []
    return section("Targets", TARGETS_INTRO, markdown(target_table(targets, med, ratios, floors)))


def latency_section(med: pd.DataFrame) -> list[str]:
    return section("Median latency of every provider (us)", markdown(latency_table(med)))


def junit_section(run_dir: Path, op: str) -> list[str]:
    """One paragraph per GPU test session stored with the run, oldest first."""
    return [line for junit in sorted(run_dir.glob("junit-gpu*.xml"), key=_junit_stamp)
            for line in _junit_summary(junit, op) + [""]]


def extra_section(op: str, run_dir: Path) -> list[str]:
    """The op's own sections: ``report_extra(run_dir)`` of its bench module, where it has one."""
    from dsfuse.bench import EXPERIMENTS

    extra = getattr(importlib.import_module(EXPERIMENTS[op]), "report_extra", None) if op in EXPERIMENTS else None
    return extra(run_dir) if extra is not None else []


def checks_section(validation: pd.DataFrame) -> list[str]:
    return section("Correctness checks of the benchmark providers (before and after timing)",
                   markdown(check_table(validation)))


def plot_modes(op: str, med: pd.DataFrame, floors: dict[tuple[str, str], float], plots_dir: Path,
               smoke: bool) -> list[Path]:
    """One bar chart per mode: CUDA Graph replay with L2 evicted where the run has it, else wall clock."""
    clock, regime = ("graph", "evicted") if "graph" in set(med["clock"]) else ("wall", "hot")
    colors = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(sorted(set(med["provider"])))}
    written = []
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
    tuning = Path(raw_root) / "tuning"
    files = sorted(tuning.glob("blocks-*.csv"))
    host_files = sorted(tuning.glob("host-overhead-*.csv"))
    probe_files = sorted(set(tuning.glob("*.csv")) - set(files) - set(host_files))
    if not files and not host_files and not probe_files:
        return None
    lines = [f"<!-- generated by `python -m dsfuse.bench report {op}` from {relative(raw_root)}/tuning; "
             "do not edit -->", ""]
    lines += [line for path in files for line in blocks_block(path)]
    lines += [line for path in host_files for line in host_block(path)]
    lines += [line for path in probe_files for line in probe_block(path)]
    out = Path(results_dir) / f"{op}_tuning.md"
    out.write_text("\n".join(lines))
    return out


def tuning_block(path: Path, caption: str, table: str) -> list[str]:
    return [f"**{path.stem}** ({caption})", "", table, ""]


def blocks_block(path: Path) -> list[str]:
    return tuning_block(path, "median us, CUDA Graph replay, L2 evicted; rows: mode and elements per program, "
                        "columns: warps", markdown(blocks_table(pd.read_csv(path))))


def host_block(path: Path) -> list[str]:
    return tuning_block(path, "median host us per call, no synchronisation, small input",
                        markdown(host_table(pd.read_csv(path))))


def probe_block(path: Path) -> list[str]:
    df = pd.read_csv(path)
    repeats = [f"every {c}" for c in REPEATS if c in df]
    over = " of " + " and ".join(repeats) if repeats else ""
    caption = f"median us over the samples{over}, CUDA Graph replay, L2 evicted"
    return tuning_block(path, caption, markdown(probe_table(df), floatfmt=".1f"))


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
