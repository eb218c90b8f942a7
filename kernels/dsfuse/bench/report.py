"""Result tables, plots and figures generated from raw run data (never typed by hand), per GPU.

``render(op, raw_root, results_root, plots_root)`` files every run under ``raw_root`` by the GPU
it ran on (`dsfuse.bench.env.gpu_key` of its env.json ``gpu_name``: ``NVIDIA H200`` ->
``h200``) and writes, per GPU:

* ``results/<gpu>/<op>.md``: the tables of that GPU's newest run, under the run's anchor
  (``<a id="run-<run-id>">``) with its date, commit, versions, a link to its raw folder and, where
  the op's kernel source changed since the run, a mark saying so; where that run ran a part of its
  config (``cases``), the tables join the newest part of each case (`config_parts`);
* ``results/<gpu>/<op>_runs.md``: every run of the op on that GPU (anchor, date, commit, what it
  measured, whether its kernels are still the current source), so any run can be cited;
* ``results/<gpu>/<op>.json``: the figures of every run, by name, for the pages' prose
  (``docs/macros.py``);
* ``results/<gpu>/<op>_host_time.md`` and ``results/<gpu>/<op>_tuning.md`` where the GPU has
  host-time runs or tuning sweeps; ``<plots_root>/<gpu>/<op>_<mode>.png``;

and, for every GPU that has results, the indexes the op's page includes once:
``results/<op>_all_gpus.md`` (each GPU's tables, host time and runs) and
``results/<op>_tuning_all_gpus.md``. A new GPU's results appear on the page without editing it.
Runs of a config kept apart (its ``raw_subdir``: ``raw/<sub>/``, e.g. GDN's long documents) get
the same files under the stem ``<op>_<sub>`` (``results/<gpu>/<op>_<sub>.md``, ``_runs.md``,
``.json``, plots in ``<plots_root>/<gpu>/<sub>/``) and their own ``results/<op>_<sub>_all_gpus.md``.
Files whose content did not change are not rewritten.

Definitions (stated once in docs/method.md):

* latency: median of all samples of a (case, provider, clock, regime);
* achieved bandwidth: the case's byte floor over the median, and its fraction of the fastest
  median device-to-device copy bandwidth of the same run;
* ratio: the fastest valid control's median latency over dsfuse's median latency (ratio of
  medians, > 1: dsfuse is faster), with the range of the same ratio taken per paired block.
  The fastest valid control is the same-contract provider with the lowest overall median that
  passed every check before and after timing; anchors (other contracts) are shown but never
  used as the baseline.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import textwrap
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402

from dsfuse.bench.env import _git, gpu_key, source_state  # noqa: E402
from dsfuse.bench.paths import junit_files, junit_root, raw_file, raw_url, relative, repo_root, repo_url  # noqa: E402
from dsfuse.bench.tables import (  # noqa: E402
    CLOCK_REGIMES,  # noqa: F401  (part of this module's interface)
    REPEATS,
    blocks_table,
    check_table,
    host_table,
    host_time_table,
    latency_table,
    markdown,
    probe_keys,
    probe_table,
    ratio_table,
    target_table,
)
from dsfuse.bench.tables import fmt as _fmt  # noqa: E402, F401  (used by the ops' report_extra)

SMOKE_BANNER = "**SMOKE RUN on CPU (Triton interpreter, tiny shapes): these numbers measure nothing.**"
TARGETS_INTRO = ("Each target as set for this op, the measured median (graph clock unless stated), the bytes "
                 "floor at the copy bandwidth of the case's run, and whether it was met.")
RATIO_INTRO = ("ratio = the fastest valid control's median latency / dsfuse's median latency (> 1: dsfuse is "
               "faster); [min, max]: the same ratio per paired block.")


def anchor(run_id: str, kind: str = "run") -> str:
    """The stable HTML id of a run on its op's page: ``run-<run-id>`` (``host-time-<run-id>`` for host time)."""
    return f"{kind}-{run_id}"


# -- runs and their GPUs ---------------------------------------------------------------------


def _env(run_dir: Path) -> dict:
    path = Path(run_dir) / "env.json"
    return json.loads(path.read_text()) if path.exists() else {}


def run_gpu(run_dir: Path) -> str:
    """The GPU folder name of a run (``cpu`` for a smoke run)."""
    return gpu_key(_env(run_dir).get("gpu_name"))


def runs_of(raw_root: Path, marker: str = "samples.csv") -> list[Path]:
    """Run folders under ``raw_root`` holding ``marker``, oldest first (run ids start with their UTC stamp)."""
    raw_root = Path(raw_root)
    return sorted(p for p in raw_root.iterdir() if raw_file(p, marker).exists()) if raw_root.exists() else []


def runs_by_gpu(raw_root: Path, marker: str = "samples.csv") -> dict[str, list[Path]]:
    """``{gpu: [run folders, oldest first]}``."""
    groups: dict[str, list[Path]] = {}
    for run_dir in runs_of(raw_root, marker):
        groups.setdefault(run_gpu(run_dir), []).append(run_dir)
    return groups


def latest_run(raw_root: Path, gpu: str | None = None) -> Path:
    """The newest run under ``raw_root`` (of ``gpu`` when given)."""
    runs = runs_by_gpu(raw_root).get(gpu, []) if gpu else runs_of(raw_root)
    if not runs:
        raise FileNotFoundError(f"no run with samples.csv under {raw_root}" + (f" on GPU {gpu}" if gpu else ""))
    return runs[-1]


def tuning_by_gpu(tuning_dir: Path) -> dict[str, list[Path]]:
    """Sweep CSVs under ``raw/tuning/`` by GPU: from ``<stem>.env.json`` beside a file (written by
    `dsfuse.bench.harness.sweep`), else from the folder's ``env.json`` (the environment of the
    files measured before sweeps recorded theirs), else ``unknown-gpu``."""
    tuning_dir = Path(tuning_dir)
    folder = _env(tuning_dir).get("gpu_name") if (tuning_dir / "env.json").exists() else None
    groups: dict[str, list[Path]] = {}
    for path in sorted(tuning_dir.glob("*.csv")):
        side = tuning_dir / f"{path.stem}.env.json"
        name = json.loads(side.read_text()).get("gpu_name") if side.exists() else folder
        groups.setdefault(gpu_key(name) if name else "unknown-gpu", []).append(path)
    return groups


MEMORY_COLUMNS = ["case", "mode", "provider", "peak_mib", "retained_mib"]  # memory.csv (harness.peak_memory_row)


def load_run(run_dir: Path, cases: list[str] | None = None) -> dict:
    """A run folder's CSVs as DataFrames, its env.json and config.yaml; ``memory`` empty where the run has no
    ``memory.csv`` (a CPU run, or one made before the harness measured memory). ``cases``: only those
    cases' rows (and the copy's), where a newer run of the same config gives the others."""
    memory = raw_file(run_dir, "memory.csv")
    run = dict(
        run_id=run_dir.name,
        samples=pd.read_csv(raw_file(run_dir, "samples.csv")),
        validation=pd.read_csv(raw_file(run_dir, "validation.csv"), keep_default_na=False),
        cases=pd.read_csv(raw_file(run_dir, "cases.csv"), keep_default_na=False),
        memory=pd.read_csv(memory) if memory.exists() else pd.DataFrame(columns=MEMORY_COLUMNS),
        env=json.loads((run_dir / "env.json").read_text()),
        config=yaml.safe_load((run_dir / "config.yaml").read_text()) or {},
    )
    if cases is not None:
        for name in ("samples", "validation", "cases", "memory"):
            frame = run[name]
            run[name] = frame[frame["case"].isin([*cases, "copy"])].reset_index(drop=True)
    return run


# -- medians, bandwidth, ratios --------------------------------------------------------------


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


def ratio_of_medians(control_us: float, dsfuse_us: float) -> float:
    """The one ratio of the project: control latency / dsfuse latency (> 1: dsfuse is faster)."""
    return control_us / dsfuse_us if dsfuse_us > 0 else float("nan")


def candidate_ratios(med: pd.DataFrame, timed: pd.DataFrame, validation: pd.DataFrame, nbytes, ceiling: float
                     ) -> pd.DataFrame:
    """Per candidate, case, clock and regime: the fastest valid same-form control, the ratio of the two
    medians, and the range of the same ratio per paired block."""
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
                ratio=ratio_of_medians(best.us, cand.us), ratio_min=per_block.min(), ratio_max=per_block.max(),
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


# -- rendering -------------------------------------------------------------------------------


def _write(path: Path, text: str) -> Path:
    """Write ``text`` unless the file already holds it (a rerun on another GPU leaves this one's files alone)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def render(op: str, raw_root: Path, results_dir: Path, plots_dir: Path, smoke: bool = False,
           gpus: list[str] | set[str] | None = None) -> list[Path]:
    """Render every GPU's results of ``op`` (only those in ``gpus`` when given) and the all-GPU
    indexes; return the paths written (per GPU: tables, plots, runs, figures, host time, tuning)."""
    raw_root, results_dir, plots_dir = Path(raw_root), Path(results_dir), Path(plots_dir)
    runs = runs_by_gpu(raw_root)
    host = runs_by_gpu(raw_root / "host-time", marker=HOST_TIME_MARKER)
    tuning = tuning_by_gpu(raw_root / "tuning")
    written: list[Path] = []
    for gpu in sorted(set(runs) | set(host) | set(tuning)):
        if gpus is not None and gpu not in gpus:
            continue
        written += render_gpu(op, gpu, runs.get(gpu, []), results_dir / gpu, plots_dir / gpu, smoke,
                              host_runs=host.get(gpu, []), tuning_files=tuning.get(gpu, []))
    written += write_indexes(op, results_dir)
    for sub in apart_folders(raw_root):
        stem = f"{op}_{sub}"
        for gpu, gpu_runs in sorted(runs_by_gpu(raw_root / sub).items()):
            if gpus is None or gpu in gpus:
                written += render_gpu(op, gpu, gpu_runs, results_dir / gpu, plots_dir / gpu / sub, smoke, stem=stem)
        written += write_indexes(op, results_dir, stem=stem)
    return written


def shown_files(op: str, run_dir: Path, written: list[Path]) -> tuple[Path, list[Path]]:
    """Of the files `render` wrote (``written``), the tables and the plots of the run ``run_dir``: the
    op's own (``<op>.md``) for a run of the op's raw folder, ``<op>_<sub>.md`` and the plots under
    ``<sub>/`` for a run of a config kept apart (``raw_subdir``: ``experiments/<op>/raw/<sub>/<run>``)."""
    sub = None if Path(run_dir).parent.name == "raw" else Path(run_dir).parent.name
    gpu = run_gpu(Path(run_dir))
    table = next(p for p in written if p.name == (f"{op}_{sub}.md" if sub else f"{op}.md") and p.parent.name == gpu)
    plots = [p for p in written if p.suffix == ".png" and p.parent.name == (sub or gpu)
             and (p.parent.parent.name == gpu if sub else True)]
    return table, plots


def apart_folders(raw_root: Path) -> list[str]:
    """The subfolders of ``raw_root`` holding runs of a config kept apart (their ``config.yaml`` names
    the folder as its ``raw_subdir``), by name."""
    raw_root = Path(raw_root)
    if not raw_root.exists():
        return []
    return sorted(p.name for p in raw_root.iterdir() if p.is_dir() and any(
        (yaml.safe_load(raw_file(r, "config.yaml").read_text()) or {}).get("raw_subdir") == p.name
        for r in runs_of(p) if raw_file(r, "config.yaml").exists()))


def render_gpu(op: str, gpu: str, runs: list[Path], results_dir: Path, plots_dir: Path, smoke: bool = False,
               host_runs: list[Path] = (), tuning_files: list[Path] = (), stem: str | None = None) -> list[Path]:
    """One GPU's files (see the module docstring) from its runs (oldest first), named ``stem`` (the op's
    name unless the runs are a config's kept apart)."""
    stem = stem or op
    written: list[Path] = []
    figures: dict = dict(op=op, gpu=gpu, runs={}, host_time={}, tuning={})
    if runs:
        newest = runs[-1]
        run = load_run(newest)
        parts = config_parts(runs)
        joined = join_parts(parts, newest)
        med, ratios, floors = joined["med"], joined["ratios"], joined["floors"]
        plots = plot_modes(op, med, floors, plots_dir, smoke, gpu=gpu_title(run["env"]),
                           validation=joined["validation"], cases=joined["cases"])
        state = source_state(op, run["env"])
        if joined["runs"] == [newest]:
            lines = header_lines(op, newest, run, joined["copy_bw"][newest.name], smoke, state)
        else:
            lines = parts_header_lines(op, parts, joined, smoke, state)
        lines += ratio_section(ratios)
        lines += targets_section(run["config"].get("targets", []), med, ratios, floors)
        lines += latency_section(med)
        lines += plots_section(op, plots)
        for part in joined["runs"]:
            lines += junit_section(part, op)
        if joined["runs"] == [newest]:
            lines += [demote(line) for line in extra_section(op, newest)]
        else:
            lines += parts_extra_lines(op, parts, joined["runs"])
        lines += checks_section(joined["validation"])
        index = runs_index(op, runs, shown=joined["runs"]).split("\n")
        if stem != op:  # included inside a section of the op's page: every heading one level down
            lines, index = ([("#" + line if line.startswith("#") else line) for line in text] for text in (lines, index))
        written.append(_write(results_dir / f"{stem}.md", "\n".join(lines)))
        written += plots
        written.append(_write(results_dir / f"{stem}_runs.md", "\n".join(index)))
        figures.update(gpu_name=run["env"].get("gpu_name"), newest=newest.name)
        if joined["runs"] != [newest]:  # the joined parts' tables: which run each case is from, the targets judged there
            verdicts = target_table(run["config"].get("targets", []), med, ratios, floors).to_dict("records")
            figures["joined"] = dict(cases={case: run_dir.name for case, run_dir in parts.items()},
                                     targets=[dict(row, goals=goal) for row, goal in
                                              zip(verdicts, run["config"].get("targets", []))])
        for run_dir in runs:
            figures["runs"][run_dir.name] = run_figures(op, run_dir)
    if host_runs:
        written.append(_write(results_dir / f"{op}_host_time.md", render_host_time(op, host_runs[-1])))
        figures["host_time"] = {r.name: host_time_figures(r) for r in host_runs}
        figures.setdefault("gpu_name", _env(host_runs[-1]).get("gpu_name"))
    if tuning_files:
        written.append(write_tuning(op, tuning_files[0].parent, results_dir, files=tuning_files))
        figures["tuning"] = {path.stem: tuning_figures(path) for path in tuning_files}
    if not smoke or runs:
        written.append(_write(results_dir / f"{stem}.json", dump_figures(figures) + "\n"))
    return written


# -- a config run in parts: the tables of its newest runs, joined --------------------------


def run_cases(run_dir: Path) -> list[str]:
    """The cases a run timed (its cases.csv but the copy, those with samples), in its order."""
    cases = pd.read_csv(raw_file(run_dir, "cases.csv"), keep_default_na=False)
    timed = set(pd.read_csv(raw_file(run_dir, "samples.csv"), usecols=["case"])["case"])
    return [case for case in cases["case"] if case != "copy" and case in timed]


def part_key(run_dir: Path) -> tuple[str, str | None]:
    """What the runs of one config's parts share: the config but its ``cases`` and the environment
    that decides what ran (GPU, packages, driver, CUDA, the recorded variables), as one string; and
    the kernel source they measured (env.json's ``kernel_sources`` hash, else the commit of a tree
    recorded clean; None where neither tells)."""
    config = dict(yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {})
    config.pop("cases", None)
    e = _env(run_dir)
    setting = {k: e.get(k) for k in ("gpu_name", "packages", "driver", "torch_cuda", "variables")}
    kernels = (e.get("kernel_sources") or {}).get("sha256")
    if kernels is None and e.get("git_commit") and e.get("git_dirty") is False:
        kernels = "commit " + e["git_commit"]
    return json.dumps(dict(config=config, env=setting), sort_keys=True, default=str), kernels


def config_parts(runs: list[Path]) -> dict[str, Path]:
    """Which run each case of the tables comes from. Where the newest of ``runs`` (oldest first) ran a
    part of its config (config.yaml's ``cases``: `dsfuse.bench.harness.selected_cases`), every case
    that a run of the same config, environment and kernel source (`part_key`) timed, each from the
    newest such run that timed it; otherwise the newest run's cases. In the order the runs timed them."""
    newest = runs[-1]
    key = part_key(newest)
    config = yaml.safe_load((newest / "config.yaml").read_text()) or {}
    if not config.get("cases") or key[1] is None:
        return {case: newest for case in run_cases(newest)}
    timed = {run_dir: run_cases(run_dir) for run_dir in reversed(runs) if part_key(run_dir) == key}  # newest first
    found: dict[str, Path] = {}
    for run_dir, cases in timed.items():
        for case in cases:
            found.setdefault(case, run_dir)
    return dict(sorted(found.items(), key=lambda item: (item[1].name, timed[item[1]].index(item[0]))))


def join_parts(parts: dict[str, Path], newest: Path) -> dict:
    """The runs of ``parts`` (oldest first; ``newest`` alone, all of it, where ``parts`` is empty),
    each summarized on its own and kept to the cases it gives: ``med`` and ``ratios`` (with a ``run``
    column: a ratio is always within one run), ``floors`` (at each run's own copy ceiling),
    ``validation``, ``cases``, and ``copy_bw`` by run."""
    if not parts:  # a run that timed no case: its tables as they are (the copy alone)
        run = load_run(newest)
        med, ratios, copy_bw = summarize(run)
        return dict(runs=[newest], med=med.assign(run=newest.name), ratios=ratios, validation=run["validation"],
                    cases=run["cases"], floors=bytes_floors(run["cases"], set(med["provider"]), max(copy_bw.values())),
                    copy_bw={newest.name: copy_bw})
    runs = sorted(set(parts.values()), key=lambda r: r.name)
    meds, ratio_frames, validations, case_frames = [], [], [], []
    floors: dict[tuple[str, str], float] = {}
    copy_bw: dict[str, dict[str, float]] = {}
    for run_dir in runs:
        run = load_run(run_dir, [case for case, source in parts.items() if source == run_dir])
        med, ratios, copy_bw[run_dir.name] = summarize(run)
        meds.append(med.assign(run=run_dir.name))
        if not ratios.empty:
            ratio_frames.append(ratios.assign(run=run_dir.name))
        validations.append(run["validation"])
        case_frames.append(run["cases"][run["cases"]["case"] != "copy"])
        floors |= bytes_floors(case_frames[-1], set(med["provider"]), max(copy_bw[run_dir.name].values()))
    return dict(runs=runs, med=pd.concat(meds, ignore_index=True),
                ratios=pd.concat(ratio_frames, ignore_index=True) if ratio_frames else pd.DataFrame(),
                validation=pd.concat(validations, ignore_index=True), cases=pd.concat(case_frames, ignore_index=True),
                floors=floors, copy_bw=copy_bw)


PARTS_INTRO = ("**These tables read {n}** of one config (its config.yaml the same but for `cases`, the "
               "part a run timed) in the same environment, that measured the same kernel source: each case's "
               "figures come from the newest of them that timed it (the table below says which). A ratio "
               "against a control is always within one run (its paired blocks); a target that compares two "
               "cases may compare two runs, and its verdict then says 'across runs'.")


def parts_header_lines(op: str, parts: dict[str, Path], joined: dict, smoke: bool, state: dict) -> list[str]:
    """`header_lines` of joined parts: every part's anchor, which run each case comes from, a row of the
    run table and a copy bandwidth per run."""
    runs = joined["runs"]
    lines = [f"<!-- generated by `python -m dsfuse.bench report {op}` from "
             f"{', '.join(relative(r) for r in runs)}; do not edit -->", ""]
    lines += [f'<a id="{anchor(r.name)}"></a>' for r in runs]
    lines += ["", f"### {gpu_title(_env(runs[-1]))}", ""]
    if smoke:
        lines += [SMOKE_BANNER, ""]
    lines += [PARTS_INTRO.format(n=f"{len(runs)} runs" if len(runs) > 1 else "1 run"), ""]
    for r in runs:
        if (r / "UNFINISHED").exists():
            mine = ", ".join(case for case, source in parts.items() if source == r)
            lines += [f"**Run `{r.name}` stopped before its end** (a time limit or an error): of its part, only "
                      f"{mine} finished.", ""]
    lines += [line.replace("since this run", "since these runs") for line in state_lines(state)]
    for r in runs:
        lines += [line.replace("of this run", f"of run `{r.name}`").replace("in this run", f"in run `{r.name}`")
                  for line in backend_lines(load_run(r), op)]
    where = pd.DataFrame([[case, f"`{run_dir.name}`"] for case, run_dir in parts.items()], columns=["case", "run"])
    table = pd.concat([run_table(r.name, _env(r), r) for r in runs], ignore_index=True)
    rates = "; ".join(f"`{r.name}`: " + ", ".join(f"{clock} {bw:.2f} TB/s" for clock, bw in
                                                    sorted(joined["copy_bw"][r.name].items())) for r in runs)
    return lines + [markdown(where, disable_numparse=True), "", markdown(table, disable_numparse=True), "",
                    f"Same-run device-to-device copy bandwidth (bytes read + written), per run: {rates}; each run's "
                    "fastest is the ceiling for its own cases' 'of copy' and 'floor us'.", ""]


def parts_extra_lines(op: str, parts: dict[str, Path], runs: list[Path]) -> list[str]:
    """The op's own sections (`extra_section`) of each run the tables join, each kept to the cases it
    gives, under a heading per run."""
    lines = []
    for run_dir in runs:
        extra = extra_section(op, run_dir, [case for case, source in parts.items() if source == run_dir])
        if extra:
            lines += [f"#### The op's own tables of `{run_dir.name}`", ""]
            lines += [("##" + line if line.startswith("### ") else line) for line in extra]
    return lines


def demote(line: str) -> str:
    """A level-3 heading of an op's own section one level down, under the GPU's heading."""
    return "#" + line if line.startswith("### ") else line


def section(title: str, *blocks: str) -> list[str]:
    """A level-4 heading (under the GPU's level-3 one), then each block followed by a blank line."""
    lines = [f"#### {title}", ""]
    for block in blocks:
        lines += [block, ""]
    return lines


def gpu_title(env: dict) -> str:
    return env.get("gpu_name") or "CPU (smoke run)"


def header_lines(op: str, run_dir: Path, run: dict, copy_bw: dict[str, float], smoke: bool,
                 state: dict | None = None) -> list[str]:
    """The generated-file comment, the run's anchor and GPU heading, the smoke banner, the source
    state, the run table (id, date, commit, versions, raw folder) and the copy bandwidth."""
    lines = [f"<!-- generated by `python -m dsfuse.bench report {op}` from {relative(run_dir)}; do not edit -->", "",
             f'<a id="{anchor(run["run_id"])}"></a>', "", f"### {gpu_title(run['env'])}", ""]
    if smoke:
        lines += [SMOKE_BANNER, ""]
    if (run_dir / "UNFINISHED").exists():  # dsfuse.bench.harness.UNFINISHED: "<n> cases to run; .."
        total = ((run_dir / "UNFINISHED").read_text().split() or ["?"])[0]
        lines += [f"**This run stopped before its end** (a time limit or an error): only the cases below "
                  f"finished, of {total} it was to run.", ""]
    if state is not None:
        lines += state_lines(state)
    lines += backend_lines(run, op)
    return lines + [markdown(run_table(run["run_id"], run["env"], run_dir), disable_numparse=True), "",
                    copy_line(copy_bw), ""]


def has_cutedsl_backend(op: str) -> bool:
    """Whether ``op`` has a CuTe DSL backend (a ``dsfuse/<op>/cutedsl/`` package)."""
    return importlib.util.find_spec(f"dsfuse.{op}.cutedsl") is not None


def backend_lines(run: dict, op: str) -> list[str]:
    """A warning where a GPU run of an op with a CuTe DSL backend let ``auto`` choose on a machine
    without it (env.json's ``packages`` records ``nvidia-cutlass-dsl`` as not installed): its dsfuse
    providers ran the Triton kernels, whatever their names say."""
    packages = run["env"].get("packages", {})
    if (not run["env"].get("gpu_name") or run["config"].get("backend", "auto") != "auto"
            or "nvidia-cutlass-dsl" not in packages or packages["nvidia-cutlass-dsl"]
            or not has_cutedsl_backend(op)):
        return []
    return ['!!! warning "The CuTe DSL backend was not installed in this run"',
            "    The config let `auto` choose the backend, and the run's environment had no `nvidia-cutlass-dsl`: "
            "every dsfuse provider of this run ran the Triton kernels.", ""]


def short(commit: str | None) -> str:
    return (commit or "?")[:10]


def state_lines(state: dict) -> list[str]:
    """The staleness mark: a warning where the kernel source changed since the run, a note where
    that cannot be told, one line where it did not."""
    files = ", ".join(f"`{f}`" for f in state["files"])
    if state.get("scope") == "host":
        return _host_state_lines(state, files)
    if state["state"] == "changed":
        since = ""
        if state.get("since"):
            since = f" (commits since: {', '.join(state['since'])}" + ("; uncommitted changes too" if
                                                                        state.get("uncommitted") else "") + ")"
        elif state.get("uncommitted"):
            since = " (uncommitted changes)"
        how = "its recorded hash differs from the current files" if state["how"] == "hash" else \
            f"their code differs from commit {short(state['commit'])}{since}"
        return [f'!!! warning "Measured at commit {short(state["commit"])}; the kernel source has changed since"',
                f"    The kernels these tables measured differ from the current source ({files}: {how}). "
                "They describe the kernels of that commit; a rerun measures the current ones.", ""]
    if state["state"] == "unknown":
        why = ("the run's tree had uncommitted changes" if state.get("how") == "git"
               else "the run recorded no kernel hash and git cannot compare its commit here")
        return [f'!!! note "Kernel source since this run: unknown"',
                f"    Whether the kernel source ({files}) changed since commit {short(state['commit'])} cannot be "
                f"told: {why}.", ""]
    how = "same hash" if state["how"] == "hash" else \
        f"code unchanged since commit {short(state['commit'])}, docstrings and comments aside"
    return [f"Kernel source unchanged since this run ({files}: {how}).", ""]


def _host_state_lines(state: dict, files: str) -> list[str]:
    """`state_lines` of a host-time run: its scope is the eager call's whole path (kernels, launchers,
    the public function, its checks and the backend choice)."""
    commit = short(state["commit"])
    if state["state"] == "changed":
        since = f" (commits since: {', '.join(state['since'])})" if state.get("since") else ""
        differ = ", ".join(f"`{f}`" for f in state.get("differ") or state["files"])
        return [f'!!! warning "Measured at commit {commit}; the code of the call path has changed since"',
                f"    The code these host times measured differs from the current source in {differ}{since}. "
                "A rerun measures the current code.", ""]
    if state["state"] == "unknown":
        return [f'!!! note "Code of the call path since this run: unknown"',
                f"    Whether the call path ({files}) changed since commit {commit} cannot be told.", ""]
    how = "same hash" if state["how"] == "hash" else f"code unchanged since commit {commit}"
    return [f"Code of the call path unchanged since this run ({how}; files: {files}).", ""]


def run_table(run_id: str, env: dict, run_dir: Path) -> pd.DataFrame:
    """One row: run (its id is its UTC stamp), commit, GPU, torch, triton, CUDA, driver, raw folder (a link)."""
    pk = env.get("packages", {})
    device = gpu_title(env)
    if env.get("gpu_name"):
        device += f" ({env.get('sm_count')} SMs, sm_{str(env.get('compute_capability', '?')).replace('.', '')})"
    commit = f"`{short(env.get('git_commit'))}`" + (" (dirty tree)" if env.get("git_dirty") else "")
    raw = raw_link(run_dir, "raw data")
    return pd.DataFrame([[f"`{run_id}`", commit, device, pk.get("torch"), pk.get("triton"),
                          env.get("torch_cuda") or "n/a", env.get("driver") or "n/a", raw]],
                        columns=["run (UTC stamp)", "commit", "device", "torch", "triton", "CUDA", "driver",
                                 "raw data"]).astype(str)


def raw_link(run_dir: Path, label: str) -> str:
    """A link to the run's folder on the repository (``repo_url``), pinned to the commit that added it
    (``main`` until it is committed: render again after committing the raw data), or its path where it
    is not one of the repository's committed folders (smoke runs under build/, folders outside it)."""
    where = relative(run_dir)
    return f"`{where}`" if where.startswith(("build/", "/")) else f"[{label}]({pinned_url(run_dir)})"


def pinned_url(folder: Path) -> str:
    """``raw_url`` of a committed folder at the commit that added it (``main`` before it is committed)."""
    added = _git("log", "-1", "--diff-filter=A", "--format=%h", "--", relative(folder))
    return raw_url(folder, branch=added or "main")


def commit_link(commit: str | None) -> str:
    """The run's commit as a link to the repository's tree at that commit (the code it measured)."""
    return f"[`{short(commit)}`]({repo_url()}/tree/{commit})" if commit else "`?`"


def run_line(run_id: str, env: dict) -> str:
    """The run in one line: device, torch and triton versions, commit, date."""
    pk = env.get("packages", {})
    device = env.get("gpu_name") or "CPU"
    if env.get("gpu_name"):
        device += f" ({env.get('sm_count')} SMs, driver {env.get('driver')})"
    commit = f"`{short(env.get('git_commit'))}`" + (" (dirty tree)" if env.get("git_dirty") else "")
    return (f"Run `{run_id}`: {device}, torch {pk.get('torch')}, triton {pk.get('triton')}, commit {commit}, "
            f"{env.get('date_utc')}.")


def copy_line(copy_bw: dict[str, float]) -> str:
    rates = ", ".join(f"{clock} {bw:.2f} TB/s" for clock, bw in sorted(copy_bw.items()))
    return (f"Same-run device-to-device copy bandwidth (bytes read + written): {rates}; the fastest, "
            f"{max(copy_bw.values()):.2f} TB/s, is the ceiling for 'of copy' and 'floor us'.")


HEADLINE_REGIME = "graph/evicted"  # the regime the targets are judged in: the table a page shows first


def ratio_section(ratios: pd.DataFrame) -> list[str]:
    """The headline regime's rows (CUDA Graph clock, L2 evicted) as the table, every other clock and
    cache regime in a collapsed block below it (so a cited table is one regime, not all of them)."""
    if ratios.empty:
        return []
    table = ratio_table(ratios)
    regime = table["clock/cache"]
    headline = HEADLINE_REGIME if (regime == HEADLINE_REGIME).any() else regime.iloc[0]
    blocks = [f"Headline regime: {headline}.", markdown(table[regime == headline])]
    rest = table[regime != headline]
    if not rest.empty:
        blocks.append(collapsed(f'The other clocks and cache regimes ({", ".join(dict.fromkeys(rest["clock/cache"]))})',
                                markdown(rest)))
    return section("dsfuse against the fastest valid control", RATIO_INTRO, *blocks)


def targets_section(targets: list[dict], med: pd.DataFrame, ratios: pd.DataFrame,
                    floors: dict[tuple[str, str], float]) -> list[str]:
    if not targets:
        return []
    return section("Targets", TARGETS_INTRO, markdown(target_table(targets, med, ratios, floors)))


def collapsed(title: str, block: str) -> str:
    """``block`` in a collapsed block titled ``title`` (``pymdownx.details``): a long table below the headline ones."""
    indented = "\n".join(("    " + line).rstrip() for line in block.splitlines())
    return f'??? note "{title}"\n\n{indented}'


def latency_section(med: pd.DataFrame) -> list[str]:
    table = latency_table(med)
    regimes = ", ".join(table.columns[2:])
    return section("Median latency of every provider (us)",
                   collapsed(f"Every case and provider ({len(table)} rows; {regimes})", markdown(table)))


def plots_section(op: str, plots: list[Path]) -> list[str]:
    """The plots, linked from the op's page (``docs/ops/<op>.md``: one folder below the site root)."""
    if not plots:
        return []
    return section("Plots", *[f"![{p.stem}](../{relative(p)})" for p in plots])


def junit_section(run_dir: Path, op: str) -> list[str]:
    """One paragraph per GPU test session stored with the run, oldest first."""
    return [line for junit in sorted(junit_files(run_dir), key=_junit_stamp)
            for line in _junit_summary(junit, op) + [""]]


def op_function(op: str, name: str, required: bool = True) -> Callable | None:
    """``dsfuse.bench.<op>.<name>``: the op's own piece of a tool that loops over every op with an
    experiment (``dsfuse.bench.experiments()``), e.g. ``host_time_calls``, ``fingerprint_cases``,
    ``ncu_calls``. Where the op has no experiment module or the module has no such function: None
    when not ``required``, else ``LookupError`` naming the op and the function (a tool never skips
    an op silently)."""
    from dsfuse.bench import experiments

    module = experiments().get(op)
    found = getattr(importlib.import_module(module), name, None) if module else None
    if found is None and required:
        where = f"its experiment module {module} has no function {name}()" if module else \
            f"it has no experiment module dsfuse.bench.{op} (ops with one: {sorted(experiments())})"
        raise LookupError(f"op {op!r}: {where}; each op with an experiment defines {name}() in "
                          f"kernels/dsfuse/bench/{op}.py (docs/conventions.md)")
    return found


def extra_section(op: str, run_dir: Path, cases: list[str] | None = None) -> list[str]:
    """The op's own sections: ``report_extra(run_dir, cases)`` of its bench module, where it has one
    (``cases``: only those cases' rows, as `load_run`)."""
    extra = op_function(op, "report_extra", required=False)
    return extra(run_dir, cases) if extra is not None else []


def checks_section(validation: pd.DataFrame) -> list[str]:
    table = check_table(validation)
    return section("Correctness checks of the benchmark providers (before and after timing)",
                   checks_summary(table), collapsed(f"Every case and provider ({len(table)} rows)", markdown(table)))


def checks_summary(table: pd.DataFrame) -> str:
    """One line over the checks table: how many (case, provider) pairs passed, and which providers did not."""
    passed = int((table["status"] == "pass").sum())
    line = f"{passed} of {len(table)} (case, provider) pairs passed every check they ran."
    others = table[table["status"] != "pass"]
    if not others.empty:
        counts = others.groupby(["provider", "status"], sort=False).size()
        line += " Not passed (never the baseline where it did not pass): " + "; ".join(
            f"{provider} {status} in {n} case{'s' if n > 1 else ''}" for (provider, status), n in counts.items()) + "."
    return line


# -- host time (runs of python -m dsfuse.bench.host_time) -----------------------------------

HOST_TIME_MARKER = "host_time.csv"


def host_time_root(op: str) -> Path:
    """Where the host-time runs of ``op`` are: ``experiments/<op>/raw/host-time/``."""
    return repo_root() / "experiments" / op / "raw" / "host-time"


def host_targets(op: str) -> dict[str, float]:
    """``op``'s host-time targets: call -> at most that many ``torch.add`` (``HOST_TARGETS`` of its bench module)."""
    from dsfuse.bench import experiments

    return getattr(importlib.import_module(experiments()[op]), "HOST_TARGETS", {})


def render_host_time(op: str, run_dir: Path) -> str:
    """The host-time table of one run, under its anchor (``host-time-<run-id>``), with the run's
    commit, versions, raw folder and whether the op's kernel source changed since."""
    samples = pd.read_csv(run_dir / HOST_TIME_MARKER)
    env = json.loads((run_dir / "env.json").read_text())
    return "\n".join([
        f"<!-- generated by python -m dsfuse.bench report {op} from {relative(run_dir)}; do not edit -->", "",
        f'<a id="{anchor(run_dir.name, "host-time")}"></a>', "",
        f"#### Host time per eager call ({env['gpu_name']})", "",
        *state_lines(source_state(op, env, scope="host")),
        f"Median of {samples['sample'].nunique()} samples of a loop without synchronisation on tiny tensors; run "
        f"`{run_dir.name}` ({env.get('date_utc')}), torch {env['packages']['torch']}, triton "
        f"{env['packages']['triton']}, commit `{str(env['git_commit'])[:10]}`, raw data "
        f"[{relative(run_dir)}]({pinned_url(run_dir)}).",
        "",
        markdown(host_time_table(samples, host_targets(op))),
        "",
    ])


def host_time_figures(run_dir: Path) -> dict:
    """``{call: {provider: median host us}}`` of one host-time run (for the pages' prose)."""
    samples = pd.read_csv(run_dir / HOST_TIME_MARKER)
    med = samples.groupby(["call", "provider"], sort=False)["host_us"].median()
    out: dict = {}
    for (call, provider), us in med.items():
        out.setdefault(call, {})[provider] = round(float(us), 4)
    return out


def latest_host_time(op: str, gpu: str | None = None) -> Path:
    """The newest host-time run of ``op`` (on ``gpu``, a folder name such as ``h200``, when given)."""
    root = host_time_root(op)
    runs = runs_by_gpu(root, marker=HOST_TIME_MARKER).get(gpu, []) if gpu else runs_of(root, marker=HOST_TIME_MARKER)
    if not runs:
        raise FileNotFoundError(f"no host-time run for {op} under experiments/{op}/raw/host-time/")
    return runs[-1]


def write_host_time(op: str, gpus: set[str] | None = None) -> list[Path]:
    """``results/<gpu>/<op>_host_time.md`` from each GPU's newest host-time run (only ``gpus`` when
    given), and the op's all-GPU indexes."""
    results = repo_root() / "results"
    written = [_write(results / gpu / f"{op}_host_time.md", render_host_time(op, runs[-1]))
               for gpu, runs in runs_by_gpu(host_time_root(op), marker=HOST_TIME_MARKER).items()
               if gpus is None or gpu in gpus]
    return written + write_indexes(op, results) if written else []


# -- every run of a GPU, and the indexes the page includes ----------------------------------


def measured(run_dir: Path) -> str:
    """What a run measured, from its cases.csv and config.yaml."""
    cases = pd.read_csv(run_dir / "cases.csv", keep_default_na=False)
    cases = cases[cases["case"] != "copy"]
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    timing = config.get("timing", {})
    providers = ", ".join(config.get("providers", [])) or "?"
    modes = ", ".join(dict.fromkeys(cases["mode"]))
    part = f" (a part of its config: {', '.join(cases['case'])})" if config.get("cases") else ""
    return (f"{len(cases)} case{'' if len(cases) == 1 else 's'} ({modes}){part}; providers {providers}; "
            f"{timing.get('blocks', '?')} blocks x {timing.get('samples', '?')} samples")


def _junit_counts(run_dir: Path, op: str) -> str:
    sessions = sorted(junit_files(run_dir), key=_junit_stamp)
    if not sessions:
        return "none stored"
    failed = 0
    for path in sessions:
        cases = [c for c in junit_root(path).iter("testcase") if op in c.get("classname", "")]
        failed += sum(1 for c in cases if c.find("failure") is not None or c.find("error") is not None)
    return f"{len(sessions)} session{'s' if len(sessions) > 1 else ''}, " + (
        "all passed" if not failed else f"{failed} failed")


def gpu_tests_cell(run_dir: Path, op: str) -> str:
    """The GPU test sessions stored with the run, else a link to the op's GPU test log folder
    (``raw/gpu-tests/``, whose README says which commit each session tested)."""
    stored = _junit_counts(run_dir, op)
    logs = run_dir.parent / "gpu-tests"
    if stored == "none stored" and logs.is_dir() and any(logs.iterdir()):
        return f"[logs by commit]({raw_url(logs)})"
    return stored


def runs_index(op: str, runs: list[Path], shown: list[Path] | None = None) -> str:
    """Every run of ``op`` on one GPU, newest first, each under its anchor (those the tables render,
    ``shown``, by default the newest, link to them)."""
    env = _env(runs[-1])
    shown = set(shown or runs[-1:])
    rows = []
    for run_dir in reversed(runs):
        e = _env(run_dir)
        state = source_state(op, e)["state"]
        name = (f"[`{run_dir.name}`](#{anchor(run_dir.name)}) (tables above)" if run_dir in shown
                else f'<a id="{anchor(run_dir.name)}"></a>`{run_dir.name}`')
        rows.append([name, commit_link(e.get("git_commit")),
                     {"current": "current", "changed": "changed since", "unknown": "unknown"}[state],
                     measured(run_dir), gpu_tests_cell(run_dir, op), raw_link(run_dir, "raw")])
    table = pd.DataFrame(rows, columns=["run (UTC stamp)", "commit", "kernel source", "measured",
                                        "GPU test sessions", "raw data"])
    return "\n".join([
        f"<!-- generated by `python -m dsfuse.bench report {op}` from {relative(runs[-1].parent)}; do not edit -->",
        "", f"#### Every {gpu_title(env)} run of this op", "",
        "Each raw run, newest first, under its anchor on this page (cite a run by it, with the raw folder and "
        "the commit); the tables above render the newest (or, where it ran a part of its config, the newest part of each "
        "case: those marked). 'kernel source': whether the op's kernel files are "
        "still those the run measured.", "",
        markdown(table), ""])


GPU_FILES = ("{op}.md", "{op}_host_time.md", "{op}_runs.md")


def write_indexes(op: str, results_dir: Path, stem: str | None = None) -> list[Path]:
    """``<op>_all_gpus.md`` and ``<op>_tuning_all_gpus.md``: a snippet include of every GPU folder's files;
    for the runs of a config kept apart (``stem``), ``<stem>_all_gpus.md`` of their tables and runs."""
    results_dir = Path(results_dir)
    gpus = sorted(p for p in results_dir.iterdir() if p.is_dir()) if results_dir.exists() else []
    head = (f"<!-- generated by `python -m dsfuse.bench report {op}`: every GPU with results of this op "
            f"(results/<gpu>/); do not edit -->")

    def include(files: list[Path], none: str) -> str:
        lines = [head, ""]
        lines += [f'--8<-- "{relative(p)}"\n' for p in files] or [none, ""]
        return "\n".join(lines)

    if stem is not None:
        files = [g / f"{stem}{suffix}.md" for g in gpus for suffix in ("", "_runs") if (g / f"{stem}{suffix}.md").exists()]
        return [_write(results_dir / f"{stem}_all_gpus.md", include(files, "No measured run of this config yet."))]
    main = [g / name.format(op=op) for g in gpus for name in GPU_FILES if (g / name.format(op=op)).exists()]
    tuning = [g / f"{op}_tuning.md" for g in gpus if (g / f"{op}_tuning.md").exists()]
    return [_write(results_dir / f"{op}_all_gpus.md", include(main, "No measured run of this op yet.")),
            _write(results_dir / f"{op}_tuning_all_gpus.md", include(tuning, "No tuning sweep of this op yet."))]


# -- figures for the pages' prose (results/<gpu>/<op>.json) ---------------------------------


def dump_figures(obj, depth: int = 0, open_levels: int = 4) -> str:
    """JSON with keys sorted, one key per line down to ``open_levels`` levels, deeper values on one line
    (small diffs when a rerun changes some figures, a compact file)."""
    if not isinstance(obj, dict) or not obj or depth >= open_levels:
        return json.dumps(obj, sort_keys=True)
    pad = " " * (depth + 1)
    items = [f"{pad}{json.dumps(str(k))}: {dump_figures(obj[k], depth + 1, open_levels)}" for k in sorted(obj)]
    return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"


def _num(x) -> float | None:
    x = float(x)
    return None if math.isnan(x) else round(x, 4)


def run_figures(op: str, run_dir: Path) -> dict:
    """Every figure of one run, by name: medians, bandwidth fractions, floors, ratios, target verdicts."""
    run = load_run(run_dir)
    med, ratios, copy_bw = summarize(run)
    floors = bytes_floors(run["cases"], set(med["provider"]), max(copy_bw.values()))
    state = source_state(op, run["env"])
    out: dict = dict(run_id=run_dir.name, date_utc=run["env"].get("date_utc"), commit=run["env"].get("git_commit"),
                     kernel_source=state["state"], copy_tbps={k: _num(v) for k, v in copy_bw.items()},
                     us={}, of_copy={}, floor_us={}, ratio={}, targets=[], extra={})
    for r in med.itertuples():
        at = f"{r.clock}/{r.regime}"
        out["us"].setdefault(r.case, {}).setdefault(r.provider, {})[at] = _num(r.us)
        out["of_copy"].setdefault(r.case, {}).setdefault(r.provider, {})[at] = _num(r.of_copy)
    for (case, provider), us in floors.items():
        if case != "copy":
            out["floor_us"].setdefault(case, {})[provider] = _num(us)
    for r in ratios.itertuples():
        out["ratio"].setdefault(r.case, {}).setdefault(r.candidate, {})[f"{r.clock}/{r.regime}"] = dict(
            control=r.control, control_us=_num(r.control_us), us=_num(r.candidate_us), ratio=_num(r.ratio),
            min=_num(r.ratio_min), max=_num(r.ratio_max), valid=bool(r.candidate_valid))
    targets = run["config"].get("targets", [])
    if targets:
        rows = target_table(targets, med, ratios, floors).to_dict("records")
        out["targets"] = [dict(row, goals=goal) for row, goal in zip(rows, targets)]  # goals: as the config sets them
    if raw_file(run_dir, "tower_samples.csv").exists():
        out["extra"]["tower"] = tower_figures(pd.read_csv(raw_file(run_dir, "tower_samples.csv")))
    return out


def tower_figures(samples: pd.DataFrame) -> dict:
    """Whole-tower timing (vision RoPE): per geometry, eager over dsfuse as a ratio of medians, with
    the per-block range, on the GPU clock and the wall clock."""
    out = {}
    for geometry, grp in samples.groupby("geometry", sort=False):
        med = grp.groupby("provider")[["gpu_ms", "wall_ms"]].median()
        blocks = grp.groupby(["block", "provider"])["gpu_ms"].median().unstack("provider")
        per_block = blocks["eager"] / blocks["dsfuse"]
        out[geometry] = dict(tokens=int(grp["tokens"].iloc[0]), eager_ms=_num(med.loc["eager", "gpu_ms"]),
                             dsfuse_ms=_num(med.loc["dsfuse", "gpu_ms"]),
                             ratio=_num(ratio_of_medians(med.loc["eager", "gpu_ms"], med.loc["dsfuse", "gpu_ms"])),
                             min=_num(per_block.min()), max=_num(per_block.max()),
                             wall_ratio=_num(ratio_of_medians(med.loc["eager", "wall_ms"],
                                                              med.loc["dsfuse", "wall_ms"])))
    return out


def tuning_figures(path: Path) -> list[dict]:
    """The medians of a sweep, one dict per setting (its columns and ``us`` or ``host_us``)."""
    df = pd.read_csv(path)
    value = "host_us" if "host_us" in df else "us"
    keys = [c for c in df.columns if c not in ("sample", "rep", *REPEATS, value, "error")] if value == "host_us" \
        else [c for c in probe_keys(df) if c != "error"]
    if value not in df or not keys:
        return []
    table = df.groupby(keys, sort=False, dropna=False)[value].median().reset_index()
    return [{k: (None if pd.isna(v) else (v.item() if hasattr(v, "item") else v)) for k, v in row.items()}
            for row in table.to_dict("records")]


# -- plots -----------------------------------------------------------------------------------


CLOCK_WORDS = {"graph": "CUDA Graph replay", "eager": "eager launches", "wall": "wall clock, CPU interpreter"}
CACHE_WORDS = {"evicted": "L2 evicted", "hot": "hot L2"}
MODE_WORDS = {"fwd": "forward", "bwd": "backward", "fwd+bwd": "forward + backward", "ckpt": "checkpointed step",
              "layer": "layer step"}
ROLE_STYLE = {  # bar colour per provider role (candidate: dsfuse; control: the baselines; anchor: another contract)
    "candidate": dict(color="#1f6fb4", label="dsfuse"),
    "control": dict(color="#a3a3a3", label="control"),
    "anchor": dict(color="#e0e0e0", label="anchor (another contract)"),
}
FAILED_HATCH = "////"
PLOT_WIDTH_IN, PLOT_DPI = 6.9, 150  # the site's content column at 1400 px (688 px), drawn at 1.5x
PANEL_TITLE_CHAR_IN = 0.068  # a panel title's mean character width at 9 pt (titles wrap to their panel and half its gaps)


def op_title(op: str) -> str:
    """The op's name as the site's nav gives it (``Text RoPE``), else its id."""
    from dsfuse.bench.status import title

    try:
        return title(repo_root(), op)
    except (LookupError, OSError, KeyError, TypeError):
        return op


def regime_words(clock: str, regime: str) -> str:
    """``CUDA Graph replay, L2 evicted``: the clock and cache regime of a plot."""
    if clock == "wall":
        return CLOCK_WORDS["wall"]
    return f"{CLOCK_WORDS.get(clock, clock + ' clock')}, {CACHE_WORDS.get(regime, regime + ' cache')}"


def _dtype(name) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}.get(str(name), str(name))


def shape_parts(case: str, params: dict) -> list[tuple[str, str]]:
    """A case's shape as named parts, from its params in cases.csv (the parts every case of a plot
    shares go to its title, the others to the case's panel); the case's name where the params name no shape."""
    p = params
    if "shape" in p:  # a tensor of the op (text RoPE)
        parts = [("tensor", f"{p.get('tensor', 'x')} [{', '.join(str(d) for d in p['shape'])}]")]
    elif {"n_h", "n_w"} <= set(p):  # a patch grid (vision RoPE)
        parts = [("grid", f"T = {p.get('tokens', p['n_h'] * p['n_w'])} ({p['n_h']} x {p['n_w']})")]
        parts += [("heads", f"{p['heads']} heads x {p['dim']}")] if {"heads", "dim"} <= set(p) else []
    elif {"kind", "n"} <= set(p):  # tokens of a model width (Engram gate)
        kind = {"gate": "gate alone", "consumer": "training consumer"}.get(p["kind"], str(p["kind"]))
        parts = [("kind", kind), ("n", f"N = {p['n']}")]
        if {"streams", "dim"} <= set(p):
            parts += [("width", f"S = {p['streams']}, D = {p['dim']}" + (f", emb {p['emb']}" if "emb" in p else ""))]
    elif {"tokens", "value_heads"} <= set(p):  # a packed row of documents (GDN)
        parts = [("tokens", f"T = {p['tokens']}" + (f" in {p['documents']} document{'' if p['documents'] == 1 else 's'}" if "documents" in p else "")),
                 ("heads", f"H = {p.get('heads')}, HV = {p['value_heads']}, K = V = {p.get('head_dim')}")]
        if "l2norm" in p:
            parts.append(("l2norm", "L2 norm " + ("on" if p["l2norm"] else "off")))
    else:
        return [("case", case)]
    return parts + ([("dtype", _dtype(p["dtype"]))] if "dtype" in p else [])


def plot_modes(op: str, med: pd.DataFrame, floors: dict[tuple[str, str], float], plots_dir: Path,
               smoke: bool, gpu: str = "", validation: pd.DataFrame | None = None,
               cases: pd.DataFrame | None = None) -> list[Path]:
    """One figure per mode: CUDA Graph replay with L2 evicted where the run has it (the headline
    regime), else the wall clock; one panel per case, each on its own linear axis from zero. Where
    ``med`` joins several runs (its ``run`` column, `join_parts`), a figure whose cases come from more
    than one says so."""
    clock, regime = ("graph", "evicted") if "graph" in set(med["clock"]) else ("wall", "hot")
    validation = validation if validation is not None else pd.DataFrame(
        columns=["case", "provider", "role", "stage", "status"])
    roles = dict(zip(validation["provider"], validation["role"]))
    valid = valid_providers(validation) if not validation.empty else {}
    params = ({row.case: json.loads(row.params) for row in cases.itertuples()}
              if cases is not None and "params" in cases else {})
    Path(plots_dir).mkdir(parents=True, exist_ok=True)
    written = []
    for mode, grp in med[(med["clock"] == clock) & (med["regime"] == regime)].groupby("mode", sort=False):
        failed = {(case, p) for case, p in zip(grp["case"], grp["provider"])
                  if not validation.empty and p not in valid.get(case, set())}
        runs = grp["run"].nunique() if "run" in grp else 1
        written.append(_plot(op, mode, grp, clock, regime, Path(plots_dir), smoke, floors, roles, failed,
                             params, gpu, runs))
    return written


def provider_order(providers, roles: dict) -> list[str]:
    """Candidates first, then controls, then anchors; by name within each."""
    rank = {"candidate": 0, "control": 1, "anchor": 2}
    return sorted(providers, key=lambda p: (rank.get(roles.get(p), 1), p))


def _grid(n: int) -> int:
    """Columns of panels: all in one row up to three, else three where they fill whole rows, else two."""
    return n if n <= 3 else (3 if n % 3 == 0 else 2)


def _fmt_us(us: float) -> str:
    return f"{us:,.0f}" if us >= 1000 else f"{us:.1f}"


def _plot(op: str, mode: str, grp: pd.DataFrame, clock: str, regime: str, plots_dir: Path, smoke: bool,
          floors: dict[tuple[str, str], float], roles: dict, failed: set, params: dict, gpu: str,
          runs: int = 1) -> Path:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    order = {case: i for i, case in enumerate(params)}  # the run's order of cases (cases.csv)
    cases = sorted(dict.fromkeys(grp["case"]), key=lambda c: (order.get(c, len(order)), c))
    providers = provider_order(set(grp["provider"]), roles)
    shapes = {case: shape_parts(case, params.get(case, {})) for case in cases}
    common = [part for part in shapes[cases[0]] if all(part in shapes[c] for c in cases)] if len(cases) > 1 else []
    ncols = _grid(len(cases))
    nrows = -(-len(cases) // ncols)
    head = f"{op_title(op)}: median latency on the {gpu or 'CPU'}"
    if MODE_WORDS.get(mode, mode) not in head:  # "Vision RoPE backward" names its one mode
        head = head.replace(":", f", {MODE_WORDS.get(mode, mode)}:", 1)
    shared = ", ".join(text for _, text in common)  # what every panel shares; each panel's title: the rest
    regime_line = "; ".join(x for x in (regime_words(clock, regime), shared, "bars: median us, linear from 0") if x)
    title_lines = [head] + ([regime_line] if len(regime_line) <= 95 else
                            [regime_words(clock, regime) + "; bars: median us, linear from 0", shared])
    if runs > 1:
        title_lines.append(f"the cases from {runs} runs of one config, each timed against the controls in its own run")
    if smoke:
        title_lines.insert(0, "SMOKE RUN (CPU interpreter, tiny shapes): these numbers measure nothing")
    label_in = 0.08 * max(len(p) for p in providers) + 0.3
    panel_in = 1.2 * (0.97 * PLOT_WIDTH_IN - min(label_in, 0.4 * PLOT_WIDTH_IN)) / (ncols + 0.25 * (ncols - 1))
    own_titles = {}
    for case in cases:  # each panel's own parts, wrapped to its width (never inside "HV = 48")
        own = [text for part in shapes[case] if part not in common for _, text in [part]] or \
            [text for _, text in shapes[case]]
        own_titles[case] = textwrap.fill(", ".join(own).replace(" = ", "\u00a0=\u00a0"), break_long_words=False,
                                         width=int(panel_in / PANEL_TITLE_CHAR_IN)).replace("\u00a0", " ")
    extra_in = 0.16 * (max(t.count("\n") for t in own_titles.values()))  # panel titles wrapped to fit their column
    axes_in, gap_in = 0.24 * len(providers) + 0.1, 0.55 + extra_in  # a panel's plot area; between rows: ticks, title
    legend_rows = 2
    top_in, bottom_in = 0.22 * len(title_lines) + 0.36 + extra_in, 0.3 + 0.18 * legend_rows
    height = nrows * axes_in + (nrows - 1) * gap_in + top_in + bottom_in
    fig, axes = plt.subplots(nrows, ncols, sharey=True, squeeze=False, dpi=PLOT_DPI, figsize=(PLOT_WIDTH_IN, height))
    us = grp.set_index(["case", "provider"])["us"]
    for ax, case in zip(axes.flat, cases):
        top = 0.0
        for y, provider in enumerate(providers):
            value = us.get((case, provider))
            if value is None or pd.isna(value):
                ax.text(0, y, " not run", va="center", ha="left", fontsize=8, color="#555555")
                continue
            style = ROLE_STYLE.get(roles.get(provider), ROLE_STYLE["control"])
            bad = (case, provider) in failed
            ax.barh(y, value, height=0.7, color=style["color"], edgecolor="#333333" if bad else style["color"],
                    hatch=FAILED_HATCH if bad else None, linewidth=0.6)
            ax.text(value, y, " " + _fmt_us(value), va="center", ha="left", fontsize=8)
            top = max(top, value)
            floor = floors.get((case, provider))
            if floor is not None and not pd.isna(floor):
                ax.vlines(floor, y - 0.42, y + 0.42, colors="black", linewidth=1.4)
                top = max(top, floor)
        ax.set_xlim(0, top * 1.42 if top > 0 else 1)  # room for the value labels
        ax.xaxis.set_major_locator(MaxNLocator(4))
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="x", color="#e6e6e6", linewidth=0.6)
        ax.set_axisbelow(True)
        ax.set_title(own_titles[case], fontsize=9)
    for ax in axes.flat[len(cases):]:
        ax.set_visible(False)
    for row in axes:
        row[0].set_yticks(range(len(providers)))
        row[0].set_yticklabels(providers, fontsize=8.5)
        row[0].set_ylim(len(providers) - 0.5, -0.5)  # the first provider on top
    fig.suptitle("\n".join(title_lines), fontsize=9.5, linespacing=1.4)
    roles_here = [r for r in ("candidate", "control", "anchor") if any(roles.get(p, "control") == r for p in providers)]
    handles = [Patch(facecolor=ROLE_STYLE[r]["color"], label=ROLE_STYLE[r]["label"]) for r in roles_here]
    if failed:
        handles.append(Patch(facecolor="white", edgecolor="#333333", hatch=FAILED_HATCH,
                             label="failed a check (not a baseline)"))
    if any(f is not None and not pd.isna(f) for (c, _), f in floors.items() if c in cases):
        handles.append(Line2D([], [], color="black", linewidth=1.4, label="bytes floor at the run's copy bandwidth" if runs == 1 else
                              "bytes floor at its run's copy bandwidth"))
    fig.legend(handles=handles, loc="lower center", ncol=-(-len(handles) // legend_rows), fontsize=8,
               frameon=False, bbox_to_anchor=(0.5, 0.0))
    fig.subplots_adjust(left=min(label_in / PLOT_WIDTH_IN, 0.4), right=0.97, wspace=0.25, hspace=gap_in / axes_in,
                        top=1 - top_in / height, bottom=bottom_in / height)
    path = plots_dir / f"{op}_{mode.replace('+', '_')}.png"
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    _palette_png(path)
    return path


def _palette_png(path: Path, colors: int = 64) -> None:
    """Rewrite a plot as a palette PNG: a few flat colours and anti-aliased text need no more, and
    the file is several times smaller (the tree travels to the GPU machine in one call)."""
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    small.save(path, optimize=True)


def _junit_stamp(path: Path) -> str:
    root = junit_root(path)
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return suite.get("timestamp", "") if suite is not None else ""


def _junit_summary(path: Path, op: str) -> list[str]:
    """One line per GPU test session stored with this raw data (from its JUnit XML)."""
    root = junit_root(path)
    stamp = _junit_stamp(path) or "?"
    cases = [c for c in root.iter("testcase") if op in c.get("classname", "")]
    failed = sum(1 for c in cases if c.find("failure") is not None or c.find("error") is not None)
    skipped = sum(1 for c in cases if c.find("skipped") is not None)
    files = sorted({c.get("classname").rsplit(".", 1)[-1] for c in cases})
    return [f"GPU tests of this op, session of {stamp} (`{path.name}` in the run folder): "
            f"{len(cases) - failed - skipped} passed, {failed} failed, {skipped} skipped ({', '.join(files)})."]


# -- tuning sweeps ---------------------------------------------------------------------------


def write_tuning(op: str, raw_root: Path, results_dir: Path, files: list[Path] | None = None) -> Path | None:
    """Medians of the launch-constant sweeps (``files``, default every CSV under ``<raw_root>/tuning``,
    or under ``raw_root`` itself when it is the tuning folder), one table per file, into
    ``<results_dir>/<op>_tuning.md``."""
    raw_root = Path(raw_root)
    tuning = raw_root if raw_root.name == "tuning" else raw_root / "tuning"
    files = sorted(files) if files is not None else sorted(tuning.glob("*.csv"))
    blocks = [p for p in files if p.name.startswith("blocks-")]
    host_files = [p for p in files if p.name.startswith("host-overhead-")]
    probe_files = [p for p in files if p not in blocks and p not in host_files]
    if not files:
        return None
    gpu_names = {json.loads(s.read_text()).get("gpu_name") for p in files
                 for s in [p.with_name(f"{p.stem}.env.json")] if s.exists()}
    if (tuning / "env.json").exists() and len(gpu_names) < len(files):
        gpu_names.add(_env(tuning).get("gpu_name"))
    lines = [f"<!-- generated by `python -m dsfuse.bench report {op}` from {relative(tuning)}; do not edit -->", ""]
    if gpu_names - {None}:
        lines += [f"**{', '.join(sorted(gpu_names - {None}))}**: sweeps under `{relative(tuning)}/`.", ""]
    lines += [line for path in blocks for line in blocks_block(path)]
    lines += [line for path in host_files for line in host_block(path)]
    lines += [line for path in probe_files for line in probe_block(path)]
    return _write(Path(results_dir) / f"{op}_tuning.md", "\n".join(lines))


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
