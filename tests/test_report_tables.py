"""The report's table builders (dsfuse.bench.tables) and how render composes their sections."""

import json

import pandas as pd
import yaml

from dsfuse.bench import report, tables
from dsfuse.bench.harness import sweep


def _rows(markdown: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in markdown.splitlines()[2:]]


def _ratio(**kw) -> dict:
    row = dict(case="c_fwd", mode="fwd", clock="graph", regime="evicted", candidate="dsfuse", candidate_us=10.0,
               control="eager", control_us=25.0, ratio=2.5, ratio_min=2.0, ratio_max=3.0, candidate_valid=True,
               tbps=1.234, of_copy=0.456, floor_us=4.0)
    return {**row, **kw}


def test_ratio_table_markdown():
    ratios = pd.DataFrame([_ratio(case="c_fwd+bwd", mode="fwd+bwd", candidate_valid=False, ratio_max=float("nan")),
                           _ratio(regime="hot", candidate_us=9.96)])
    assert tables.markdown(tables.ratio_table(ratios)).splitlines() == [
        "| case      | dsfuse   | clock/cache   |   median us | fastest control (us)   | ratio [min, max]   "
        "|   TB/s | of copy   |   floor us | checks pass   |",
        "|-----------|----------|---------------|-------------|------------------------|--------------------"
        "|--------|-----------|------------|---------------|",
        "| c_fwd     | dsfuse   | graph/hot     |          10 | eager 25.0             | 2.50 [2.00, 3.00]  "
        "|   1.23 | 46%       |          4 | yes           |",
        "| c_fwd+bwd | dsfuse   | graph/evicted |          10 | eager 25.0             | 2.50 [2.00, n/a]   "
        "|   1.23 | 46%       |          4 | NO            |",
    ]


def _med(rows) -> pd.DataFrame:
    return pd.DataFrame([dict(case=c, provider=p, clock=cl, regime=r, us=us, of_copy=f)
                         for c, p, cl, r, us, f in rows])


def test_target_rows_state_each_goal_and_verdict():
    med = _med([("c", "dsfuse", "graph", "evicted", 10.0, 0.9), ("c", "eager", "graph", "evicted", 30.0, 0.3),
                ("c", "dsfuse", "eager", "evicted", 20.0, 0.45)])
    ratios = pd.DataFrame([_ratio(case="c", control="eager", control_us=30.0)])
    floors = {("c", "dsfuse"): 8.0}
    targets = [dict(case="c", provider="dsfuse", max_us=12, min_of_copy=0.95, min_speedup={"eager": 2},
                    max_of_fastest=0.25),
               dict(case="c", provider="dsfuse", clock="eager", max_us=12),
               dict(case="c", provider="dsfuse", clock="wall", regime="hot", max_us=12)]
    rows = _rows(tables.markdown(tables.target_table(targets, med, ratios, floors)))
    assert rows[0] == ["c", "dsfuse", "graph/evicted",
                       "<= 12 us and >= 95% of copy and >= 2x eager and >= 4.00x the fastest valid control "
                       "(latency <= 0.25x)",
                       "10.0", "90%", "8", "latency met, bandwidth MISSED, 3.00x eager met, 3.00x eager MISSED"]
    assert rows[1][2:] == ["eager/evicted", "<= 12 us", "20.0", "45%", "8", "latency MISSED"]
    assert rows[2][2:] == ["wall/hot", "<= 12 us", "n/a", "n/a", "8", "not measured"]


def test_case_goal_judges_a_provider_against_itself_at_another_case():
    med = _med([("one", "dsfuse", "graph", "evicted", 14.5, 0), ("five", "dsfuse", "graph", "evicted", 10.0, 0),
                ("five", "dsfuse", "eager", "evicted", 12.0, 0), ("one", "dsfuse", "eager", "evicted", 14.5, 0),
                ("five", "other", "graph", "evicted", 1.0, 0)])
    goal = dict(case="five", factor=1.25)
    targets = [dict(case="one", provider="dsfuse", max_of_case=goal),
               dict(case="one", provider="dsfuse", clock="eager", max_of_case=goal),
               dict(case="one", provider="dsfuse", max_of_case=dict(case="ten", factor=1.25)),
               dict(case="one", provider="dsfuse", min_speedup=dict(absent=1.1))]
    rows = _rows(tables.markdown(tables.target_table(targets, med, pd.DataFrame(), {})))
    assert [r[3] for r in rows] == ["<= 1.25x five", "<= 1.25x five", "<= 1.25x ten", ">= 1.1x absent"]
    assert [r[-1] for r in rows] == ["1.45x five MISSED", "1.21x five met", "ten not measured", "absent not measured"]


def test_a_case_goal_names_the_other_case_by_what_differs():
    assert tables.case_label("T32768_n5_l2_fwd", "T32768_n1_l2_fwd") == "its n5 case"
    assert tables.case_label("T131072_n5_hv32_l2_fwd+bwd", "T131072_n1_hv32_l2_fwd+bwd") == "its n5 case"
    assert tables.case_label("T8_n5_l2_bwd", "T4_n1_l2_bwd") == "its T8_n5 case"
    assert tables.case_label("five", "one") == "five"  # nothing in common: the name whole
    assert tables.case_label("T8_n5", "T8_n5_l2") == "T8_n5"  # not the same parts
    med = _med([("T8_n1_fwd", "dsfuse", "graph", "evicted", 12.0, 0),
                ("T8_n5_fwd", "dsfuse", "graph", "evicted", 10.0, 0)])
    row = tables.target_row(dict(case="T8_n1_fwd", provider="dsfuse", max_of_case=dict(case="T8_n5_fwd", factor=1.25)),
                            med, pd.DataFrame(), {})
    assert row[3] == "<= 1.25x its n5 case" and row[-1] == "1.20x its n5 case met"
    target = dict(case="T8_n1_fwd", provider="dsfuse", max_of_case=dict(case="T8_n5_fwd", factor=1.25))
    same, other = med.assign(run="a"), med.assign(run=["a", "b"])  # the joined parts of a config
    assert tables.target_row(target, same, pd.DataFrame(), {})[-1] == "1.20x its n5 case met"
    assert tables.target_row(target, other, pd.DataFrame(), {})[-1] == "1.20x its n5 case across runs met"


def test_fastest_goal_without_a_ratio():
    goal, verdict = tables.fastest_goal(dict(case="c", provider="dsfuse", max_of_fastest=1.0), 5.0, pd.DataFrame())
    assert goal == ">= 1.00x the fastest valid control (latency <= 1.00x)"
    assert verdict == "fastest valid control not measured"
    assert tables.verdict_state(verdict) == "not measured"
    assert [tables.verdict_state(v) for v in ("1.2x a met", "0.9x a MISSED, b not measured", "latency met")] == [
        "met", "missed", "met"]


def test_latency_table_has_a_column_per_present_regime_in_fixed_order():
    med = _med([("c", "a", "eager", "hot", 2.0, 0), ("c", "a", "graph", "evicted", 1.0, 0),
                ("c", "b", "graph", "evicted", 3.25, 0)])
    table = tables.latency_table(med)
    assert list(table.columns) == ["case", "provider", "graph/evicted", "eager/hot"]
    assert table.values.tolist() == [["c", "a", "1.0", "2.0"], ["c", "b", "3.2", "n/a"]]


def test_check_table_statuses_and_notes():
    def check(provider, stage, status, error="", mismatches=0, max_abs_diff=0.0):
        return dict(case="c", provider=provider, check="bitwise", stage=stage, status=status, error=error,
                    mismatches=mismatches, max_abs_diff=max_abs_diff)

    validation = pd.DataFrame([
        check("ok", "before", "pass"), check("ok", "after-eager", "pass"),
        check("na", "applies", "n/a", "does not apply"),
        check("skip", "before", "skipped", "needs a GPU\ntraceback"),
        check("off", "before", "pass"), check("off", "after-graph", "fail", mismatches=3, max_abs_diff=0.00123456),
        check("long", "before", "fail", "E" * 200),
    ])
    rows = tables.check_table(validation).values.tolist()
    assert [r[1] for r in rows] == ["ok", "skip", "off", "long"]  # run order; all-n/a dropped
    assert rows[0][3:] == ["pass", "after-eager, before", ""]
    assert rows[1][3:] == ["not run", "", "needs a GPU"]
    assert rows[2][3:] == ["fail", "before", "3 elements differ (max abs diff 0.00123)"]
    assert rows[3][5] == "E" * tables.NOTE_CHARS


def test_tuning_tables():
    sweep = pd.DataFrame(dict(mode="bwd", elements=[256, 256, 256, 512], warps=[4, 4, 8, 4],
                              regime=["evicted"] * 3 + ["hot"], us=[1.0, 2.0, 6.0, 9.0]))
    assert _rows(tables.markdown(tables.blocks_table(sweep))) == [["bwd", "256", "1.5", "6"]]
    host = pd.DataFrame(dict(part=["b", "a", "b"], host_us=[1.0, 5.0, 2.0]))
    assert tables.host_table(host).values.tolist() == [["b", "1.5"], ["a", "5.0"]]
    probe = pd.DataFrame(dict(variant=["x", "x", "x"], round=[0, 1, 1], block=[0, 0, 1], sample=0,
                              us=[1.0, 2.0, 30.0]))
    assert tables.probe_keys(probe) == ["variant"]
    assert _rows(tables.markdown(tables.probe_table(probe), floatfmt=".1f")) == [["x", "2.0"]]



def test_tuning_tables_keep_every_setting_of_a_sweep_with_a_failed_one(tmp_path):
    """A failed setting adds an ``error`` column (empty in the good rows): no row may vanish."""
    def measure(setting, _):
        if setting["variant"] == "b":
            raise ValueError("out of resources")
        return [2.0, 4.0]

    path = tmp_path / "sweep.csv"
    sweep([dict(variant="a", warps=4), dict(variant="b", warps=8), dict(variant="c", warps=4)], lambda s: s, measure,
          path)
    df = pd.read_csv(path)
    assert list(df.columns) == ["variant", "warps", "sample", "us", "error"]
    assert _rows(tables.markdown(tables.probe_table(df), floatfmt=".1f")) == [
        ["a", "4", "", "3.0"], ["b", "8", "ValueError: out of resources", ""], ["c", "4", "", "3.0"]]
    extra = df.assign(registers=[40, 40, None, 64, 64])  # a column the failed setting could not measure
    assert _rows(tables.markdown(tables.probe_table(extra), floatfmt=".1f"))[:2] == [
        ["a", "4", "", "40", "3.0"], ["b", "8", "ValueError: out of resources", "", ""]]
    blocks = df.rename(columns={"variant": "mode"}).assign(elements=256, regime="evicted")
    assert _rows(tables.markdown(tables.blocks_table(blocks))) == [["a", "256", "3.0", "n/a"], ["b", "256", "n/a", "n/a"],
                                                                  ["c", "256", "3.0", "n/a"]]

def _write_run(run_dir, targets):
    run_dir.mkdir(parents=True)
    samples = [dict(case="copy", mode="copy", provider="copy", regime="evicted", clock="graph", block=0, sample=0,
                    us=2.0)]
    samples += [dict(case="c_fwd", mode="fwd", provider=p, regime="evicted", clock="graph", block=b, sample=0, us=us)
                for b in (0, 1) for p, us in (("dsfuse", 4.0), ("eager", 8.0))]
    pd.DataFrame(samples).to_csv(run_dir / "samples.csv", index=False)
    pd.DataFrame([dict(case="copy", mode="copy", bytes=4_000_000, params="{}"),
                  dict(case="c_fwd", mode="fwd", bytes=2_000_000, params="{}")]).to_csv(run_dir / "cases.csv",
                                                                                          index=False)
    pd.DataFrame([dict(case="c_fwd", mode="fwd", provider=p, role=r, form="", check="bitwise", stage="before",
                       status="pass", mismatches=0, max_abs_diff=0.0, error="")
                  for p, r in (("dsfuse", "candidate"), ("eager", "control"))]).to_csv(run_dir / "validation.csv",
                                                                                        index=False)
    (run_dir / "env.json").write_text(json.dumps(dict(gpu_name="GPU X", sm_count=7, driver="1.2",
                                                      packages=dict(torch="2.x", triton="3.x"),
                                                      git_commit="0123456789abcdef", date_utc="today")))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(dict(targets=targets)))


def test_render_composes_the_sections_in_order(tmp_path):
    _write_run(tmp_path / "raw" / "r1", [dict(case="c_fwd", provider="dsfuse", max_us=5)])
    written = report.render("fake", tmp_path / "raw", tmp_path / "results", tmp_path / "plots", smoke=True)
    gpu = tmp_path / "results" / "gpu-x"  # the GPU folder: from env.json's gpu_name "GPU X"
    assert written[:4] == [gpu / "fake.md", tmp_path / "plots" / "gpu-x" / "fake_fwd.png", gpu / "fake_runs.md",
                           gpu / "fake.json"]
    lines = written[0].read_text().splitlines()
    assert lines[2] == '<a id="run-r1"></a>' and lines[4] == "### GPU X" and lines[6].startswith("**SMOKE RUN")
    assert any(line.startswith("| `r1`") and "`0123456789`" in line and "2.x" in line for line in lines)
    assert any(line.startswith("Same-run device-to-device copy bandwidth (bytes read + written): graph 2.00 TB/s;")
               for line in lines)
    assert [line for line in lines if line.startswith("#### ")] == [
        "#### dsfuse against the fastest valid control", "#### Targets", "#### Median latency of every provider (us)",
        "#### Plots", "#### Correctness checks of the benchmark providers (before and after timing)"]
    assert "| c_fwd  | dsfuse     | graph/evicted | <= 5 us  |           4 | 25%       |          1 | latency met |" \
        in lines
    assert (tmp_path / "results" / "fake_all_gpus.md").read_text().count('--8<-- "') == 2  # tables and runs


def test_report_keeps_its_public_names():
    for name in ("render", "latest_run", "load_run", "summarize", "valid_providers", "write_tuning", "_fmt",
                 "CLOCK_REGIMES"):
        assert hasattr(report, name), name
    assert report._fmt(float("nan")) == "n/a" and report._fmt(1.234, 2) == "1.23"


def test_plots_are_linear_from_zero_one_panel_per_case_titled_with_gpu_regime_and_shape(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(report.plt, "close", figures.append)  # keep each figure to look at it
    shapes = {"q_1x8x4x16_fwd": dict(tensor="q", shape=[1, 8, 4, 16]),
              "kv_1x8x16_fwd": dict(tensor="kv", shape=[1, 8, 16])}
    med = pd.DataFrame([dict(case=case, mode="fwd", provider=p, clock=clock, regime="evicted", us=us)
                        for case in shapes for p, us in (("dsfuse", 4.0), ("eager", 40.0))
                        for clock in ("graph", "eager")])
    cases = pd.DataFrame([dict(case=case, params=json.dumps(dict(p, dtype="bfloat16"))) for case, p in shapes.items()])
    validation = pd.DataFrame([dict(case=case, provider=p, role=r, stage="before", status=status)
                               for case in shapes for p, r, status in (("dsfuse", "candidate", "pass"),
                                                                       ("eager", "control", "fail"))])
    floors = {(case, p): 1.0 for case in shapes for p in ("dsfuse", "eager")}
    written = report.plot_modes("fake", med, floors, tmp_path, False, gpu="GPU X", validation=validation, cases=cases)
    assert written == [tmp_path / "fake_fwd.png"] and written[0].exists() and len(figures) == 1
    fig = figures[0]
    title = fig._suptitle.get_text()
    assert "fake, forward: median latency on the GPU X" in title
    assert "CUDA Graph replay, L2 evicted" in title and "bf16" in title and "linear from 0" in title
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["q [1, 8, 4, 16]", "kv [1, 8, 16]"]  # the run's order of cases
    assert all(ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0 for ax in panels)
    assert [t.get_text() for t in panels[0].get_yticklabels()] == ["dsfuse", "eager"]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "failed a check (not a baseline)" in legend and "bytes floor at the run's copy bandwidth" in legend


def test_checks_summary_names_the_providers_that_did_not_pass():
    table = pd.DataFrame([["a", "dsfuse", "bitwise", "pass", "before", ""], ["a", "eager", "bitwise", "fail", "", "x"],
                          ["b", "eager", "bitwise", "fail", "", "x"]], columns=tables.CHECK_COLUMNS)
    assert report.checks_summary(table) == ("1 of 3 (case, provider) pairs passed every check they ran. Not passed "
                                            "(never the baseline where it did not pass): eager fail in 2 cases.")


def test_load_run_reads_memory_csv_where_the_run_has_one(tmp_path):
    """Runs made before the harness measured memory (and CPU runs) have no memory.csv: an empty table
    with its columns; a run with one (plain or compacted) loads its rows."""
    _write_run(tmp_path / "old", [])
    memory = report.load_run(tmp_path / "old")["memory"]
    assert memory.empty and list(memory.columns) == report.MEMORY_COLUMNS
    assert report.summarize(report.load_run(tmp_path / "old"))[0]["us"].tolist() == [4.0, 8.0]

    _write_run(tmp_path / "new", [])
    rows = pd.DataFrame([dict(case="c_fwd", mode="fwd", provider="dsfuse", peak_mib=12.5, retained_mib=0.0)])
    rows.to_csv(tmp_path / "new" / "memory.csv.gz", index=False)
    assert report.load_run(tmp_path / "new")["memory"].to_dict("records") == rows.to_dict("records")


def test_a_gpu_run_of_auto_without_the_cutedsl_backend_is_flagged():
    """`auto` on a GPU machine lacking nvidia-cutlass-dsl measured the Triton kernels under the
    candidates' names: the report's header says so; with the package, a named backend, a run that
    recorded no package list, a CPU run, or an op without a CuTe DSL backend, it says nothing."""
    def run(packages, backend="auto", gpu="NVIDIA H200"):
        return dict(env=dict(gpu_name=gpu, packages=packages), config=dict(backend=backend))

    flagged = report.backend_lines(run({"nvidia-cutlass-dsl": None}), "gdn")
    assert flagged and "Triton" in " ".join(flagged)
    assert report.backend_lines(run({"nvidia-cutlass-dsl": None}), "text_rope") == []  # Triton only
    assert report.backend_lines(run({"nvidia-cutlass-dsl": None}, backend="triton"), "gdn") == []
    assert report.backend_lines(run({"nvidia-cutlass-dsl": "4.8.1"}), "gdn") == []
    assert report.backend_lines(run({}), "gdn") == []
    assert report.backend_lines(run({"nvidia-cutlass-dsl": None}, gpu=None), "gdn") == []


def test_shown_files_are_the_runs_own_table_and_plots(tmp_path):
    import json
    from pathlib import Path

    from dsfuse.bench.report import shown_files

    raw = tmp_path / "experiments" / "gdn" / "raw"
    main, apart = raw / "20260101-000000-h200", raw / "long" / "20260101-000001-h200"
    for run in (main, apart):
        run.mkdir(parents=True)
        (run / "env.json").write_text(json.dumps({"gpu_name": "NVIDIA H200"}))
    res, plots = tmp_path / "results", tmp_path / "experiments" / "gdn" / "plots"
    written = [res / "h200" / "gdn.md", res / "h200" / "gdn_long.md", res / "h200" / "gdn_runs.md",
               res / "b200" / "gdn_long.md", plots / "h200" / "gdn_fwd.png", plots / "h200" / "long" / "gdn_fwd.png",
               plots / "b200" / "long" / "gdn_fwd.png", res / "gdn_all_gpus.md"]
    assert shown_files("gdn", main, written) == (res / "h200" / "gdn.md", [plots / "h200" / "gdn_fwd.png"])
    assert shown_files("gdn", apart, written) == (res / "h200" / "gdn_long.md", [plots / "h200" / "long" / "gdn_fwd.png"])
    assert isinstance(shown_files("gdn", main, written)[0], Path)
