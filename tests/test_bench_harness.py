"""The shared bench harness: checks, exclusion of failing providers, raw data, report."""

import json
import types

import pandas as pd
import pytest
import torch
import yaml

from dsfuse.bench import harness, report
from dsfuse.bench.harness import Case, Provider, bits, compare


def test_bits_distinguish_signed_zero_and_nan_payloads():
    a = torch.tensor([0.0, float("nan")])
    b = torch.tensor([-0.0, float("nan")])
    assert not torch.equal(bits(a), bits(b))
    assert torch.equal(bits(a)[1:], bits(b)[1:])


def test_compare_bitwise_and_allclose():
    case = Case("c", "fwd", {}, bytes=0)
    want = (torch.tensor([1.0, 2.0, 0.0]),)
    exact = Provider("p", build=None)
    assert compare((want[0].clone(),), want, exact, case).ok
    one_ulp = want[0].clone()
    one_ulp[1] = torch.nextafter(one_ulp[1], torch.tensor(3.0))
    result = compare((one_ulp,), want, exact, case)
    assert not result.ok and result.mismatches == 1 and result.max_abs_diff > 0
    assert not compare((torch.tensor([1.0, 2.0, -0.0]),), want, exact, case).ok
    loose = Provider("p", build=None, check="allclose", rtol=1e-6, atol=0)
    assert compare((one_ulp,), want, loose, case).ok
    assert not compare((want[0][:2],), want, exact, case).ok  # shape


def test_compare_relrms_one_bound_per_output():
    """``rtol`` as a tuple bounds each output by its own entry (a float keeps bounding every output);
    a longer tuple applies its first bounds, a shorter one or a non-relrms check fails clearly."""
    case = Case("c", "fwd", {}, bytes=0)
    want = (torch.ones(100), torch.ones(100))
    got = (torch.ones(100) * 1.004, torch.ones(100) * 1.015)  # relative RMS errors 0.004 and 0.015
    assert compare(got, want, Provider("p", build=None, check="relrms", rtol=(0.005, 0.02)), case).ok
    assert not compare(got, want, Provider("p", build=None, check="relrms", rtol=0.005), case).ok  # one float
    assert compare(got, want, Provider("p", build=None, check="relrms", rtol=0.02), case).ok
    swapped = compare(got, want, Provider("p", build=None, check="relrms", rtol=(0.02, 0.005)), case)
    assert not swapped.ok and "output 1" in swapped.detail and "bound 0.005" in swapped.detail
    assert abs(swapped.max_abs_diff - 0.015) < 1e-6
    # a prefix: the forward's (o,) with the bounds of (o, grad)
    assert compare(got[:1], want[:1], Provider("p", build=None, check="relrms", rtol=(0.005, 0.001)), case).ok
    short = compare(got, want, Provider("p", build=None, check="relrms", rtol=(0.02,)), case)
    assert not short.ok and "1 bounds for 2 outputs" in short.detail
    wrong_check = compare(got, want, Provider("p", build=None, check="allclose", rtol=(0.02, 0.02)), case)
    assert not wrong_check.ok and "relrms" in wrong_check.detail
    # a non-finite output fails whatever its bound
    assert not compare((torch.full((100,), float("nan")), got[1]), want,
                       Provider("p", build=None, check="relrms", rtol=(1.0, 1.0)), case).ok


def _fake_experiment():
    """Two providers: a correct one and one that is off by one ulp (must be excluded)."""

    def cases(config):
        return [Case("tiny_fwd", "fwd", {"n": 64}, bytes=2 * 64 * 4)]

    def make_inputs(case, device, seed):
        return {"x": torch.randn(case.params["n"], generator=torch.Generator().manual_seed(seed))}

    def reference(case, inputs):
        return (inputs["x"] * 2,)

    def providers(config):
        good = Provider("good", lambda case, inp: (lambda: (inp["x"] * 2,)), role="candidate")
        ctrl = Provider("control", lambda case, inp: (lambda: (inp["x"] + inp["x"],)))
        bad = Provider("bad", lambda case, inp: (lambda: (torch.nextafter(inp["x"] * 2, torch.tensor(1e9)),)))
        broken = Provider("broken", lambda case, inp: (lambda: 1 / 0))
        return [good, ctrl, bad, broken]

    return types.SimpleNamespace(OP="fake", cases=cases, make_inputs=make_inputs, reference=reference,
                                 providers=providers)


def test_run_records_failures_and_never_baselines_them(tmp_path):
    config = {"timing": {"blocks": 2, "samples": 2}}
    run_dir = harness.run_experiment(_fake_experiment(), config, tmp_path, torch.device("cpu"), run_id="r1")
    samples = pd.read_csv(run_dir / "samples.csv")
    validation = pd.read_csv(run_dir / "validation.csv", keep_default_na=False)
    # "bad" ran (timed, flagged); "broken" raised (not timed)
    assert set(samples.loc[samples["case"] == "tiny_fwd", "provider"]) == {"good", "control", "bad"}
    by_provider = validation.groupby("provider")["status"].agg(set)
    assert by_provider["bad"] == {"fail"} and by_provider["broken"] == {"fail"}
    assert "ZeroDivisionError" in validation.loc[validation["provider"] == "broken", "error"].iloc[0]
    assert by_provider["good"] == {"pass"}
    assert set(validation.loc[validation["provider"] == "good", "stage"]) == {"before", "after-eager"}
    env = json.loads((run_dir / "env.json").read_text())
    assert env["packages"]["torch"] and env["device"] == "cpu"
    assert (run_dir / "config.yaml").read_text().strip()
    assert len(samples[samples["case"] == "copy"]) == 4  # 2 blocks x 2 samples, wall clock

    written = report.render("fake", tmp_path, tmp_path / "results", tmp_path / "plots", smoke=True)
    table = (tmp_path / "results" / "cpu" / "fake.md").read_text()  # a CPU run: the results of GPU "cpu"
    assert "SMOKE RUN" in table and "| bad" in table and "fail" in table
    summary = report.summarize(report.load_run(run_dir))[1]
    assert set(summary["control"]) == {"control"}  # the faster-looking "bad" is never the baseline
    assert any(p.suffix == ".png" for p in written)


def test_a_run_stopped_midway_keeps_its_finished_cases_and_says_so(tmp_path):
    """A run cut by a time limit (here: an exception in its second case) leaves the first case's
    samples, checks and case row, and an UNFINISHED marker that the report turns into a line; a run
    that ends removes the marker."""
    fake = _fake_experiment()
    two = [Case("tiny_fwd", "fwd", {"n": 64}, bytes=512), Case("stops_fwd", "fwd", {"n": -1}, bytes=512)]
    stopping = types.SimpleNamespace(**(vars(fake) | {"cases": lambda config: two}))
    config = {"timing": {"blocks": 2, "samples": 2}}
    with pytest.raises(RuntimeError):  # a negative size: torch.randn refuses it, as a killed run stops
        harness.run_experiment(stopping, config, tmp_path, torch.device("cpu"), run_id="cut")
    run_dir = tmp_path / "cut"
    assert (run_dir / harness.UNFINISHED).read_text().startswith("2 cases")
    assert set(pd.read_csv(run_dir / "samples.csv")["case"]) == {"copy", "tiny_fwd"}
    assert list(pd.read_csv(run_dir / "cases.csv")["case"]) == ["copy", "tiny_fwd"]
    report.render("fake", tmp_path, tmp_path / "results", tmp_path / "plots", smoke=True)
    assert "stopped before its end" in (tmp_path / "results" / "cpu" / "fake.md").read_text()
    assert not list(run_dir.glob(".*.partial"))  # each file renamed into place whole
    done = harness.run_experiment(fake, config, tmp_path, torch.device("cpu"), run_id="done")
    assert not (done / harness.UNFINISHED).exists()


def test_a_configs_cases_key_runs_only_the_cases_it_names(tmp_path):
    """``cases`` keeps the named cases in the experiment's order; an unknown or empty selection is
    refused before anything runs."""
    fake = _fake_experiment()
    three = [Case(f"c{i}_fwd", "fwd", {"n": 8}, bytes=64) for i in range(3)]
    picky = types.SimpleNamespace(**(vars(fake) | {"cases": lambda config: three}))
    config = {"timing": {"blocks": 1, "samples": 1}, "cases": ["c2_fwd", "c0_fwd"]}
    assert [c.name for c in harness.selected_cases(picky, config)] == ["c0_fwd", "c2_fwd"]
    run_dir = harness.run_experiment(picky, config, tmp_path, torch.device("cpu"), run_id="part")
    assert list(pd.read_csv(run_dir / "cases.csv")["case"]) == ["copy", "c0_fwd", "c2_fwd"]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["cases"] == ["c2_fwd", "c0_fwd"]  # the part, recorded
    assert "2 cases (fwd) (a part of its config: c0_fwd, c2_fwd);" in report.measured(run_dir)  # the runs list
    assert [c.name for c in harness.selected_cases(picky, {})] == ["c0_fwd", "c1_fwd", "c2_fwd"]
    for bad in (["c9_fwd"], [], "c0_fwd", None, ["c0_fwd", "c0_fwd"]):  # None: a YAML `cases:` left empty
        with pytest.raises(ValueError, match="cases"):
            harness.selected_cases(picky, {"cases": bad})
    with pytest.raises(ValueError, match="c9_fwd"):  # refused before the run's folder is made
        harness.run_experiment(picky, config | {"cases": ["c9_fwd"]}, tmp_path, torch.device("cpu"), run_id="no")
    assert not (tmp_path / "no").exists()


def test_ratio_uses_fastest_valid_control_per_block():
    samples = pd.DataFrame(
        [dict(case="c", mode="fwd", provider=p, regime="hot", clock="graph", block=b, sample=0, us=us)
         for b, times in enumerate([{"cand": 10, "ctrl": 20, "slow": 40, "wrong": 1},
                                    {"cand": 10, "ctrl": 30, "slow": 40, "wrong": 1}])
         for p, us in times.items()]
        + [dict(case="copy", mode="copy", provider="copy", regime="evicted", clock="eager", block=0, sample=0, us=1.0)]
    )
    validation = pd.DataFrame(
        [dict(case="c", provider=p, role=r, form="", stage="before", status=s)
         for p, r, s in [("cand", "candidate", "pass"), ("ctrl", "control", "pass"), ("slow", "control", "pass"),
                         ("wrong", "control", "fail")]]
    )
    cases = pd.DataFrame([dict(case="copy", mode="copy", bytes=1_000_000, params="{}"),
                          dict(case="c", mode="fwd", bytes=500_000, params="{}")])
    med, ratios, copy_bw = report.summarize(dict(samples=samples, validation=validation, cases=cases, env={}))
    row = ratios.iloc[0]
    assert row["control"] == "ctrl"  # "wrong" is faster but failed its check
    assert row["ratio"] == 2.5 and row["ratio_min"] == 2.0 and row["ratio_max"] == 3.0
    assert abs(copy_bw["eager"] - 1.0) < 1e-9  # 1e6 bytes in 1 us = 1 TB/s
    assert abs(row["of_copy"] - 0.05) < 1e-9  # 5e5 bytes in 10 us = 0.05 TB/s


def test_host_us_samples_counts_calls():
    from dsfuse.bench.harness import host_us_samples

    calls = []
    samples = host_us_samples(lambda: calls.append(1), torch.device("cpu"), reps=3, calls=7, warmup=2)
    assert len(samples) == 3 and all(us > 0 for us in samples)
    assert len(calls) == 2 + 3 * 7


def test_tuning_tables_from_every_raw_csv(tmp_path):
    """Each CSV under raw/tuning becomes a table of medians: sweeps, host time, and other probes."""
    tuning = tmp_path / "raw" / "tuning"
    tuning.mkdir(parents=True)
    pd.DataFrame(dict(elements=[256] * 3 + [512] * 3, warps=4, mode="bwd", regime="evicted", sample=[0, 1, 2] * 2,
                      us=[1.0, 2.0, 30.0, 5.0, 6.0, 7.0])).to_csv(tuning / "blocks-v1.csv", index=False)
    pd.DataFrame(dict(part="plan", rep=[0, 1, 2], host_us=[3.0, 4.0, 50.0])).to_csv(tuning / "host-overhead-v1.csv",
                                                                                    index=False)
    pd.DataFrame(dict(variant=["a", "a", "a", "b", "b", "b"], regs=[96] * 3 + [168] * 3, sample=[0, 1, 2] * 2,
                      us=[10.0, 12.0, 50.0, 7.0, 8.0, 9.0])).to_csv(tuning / "probe-x.csv", index=False)
    # rounds and blocks repeat a setting: one median over all of them
    pd.DataFrame(dict(setting="s", round=[0, 0, 1, 1, 2], block=[0, 1, 0, 1, 0], sample=0,
                      us=[1.0, 2.0, 3.0, 40.0, 50.0])).to_csv(tuning / "repeats.csv", index=False)
    out = report.write_tuning("fake", tmp_path / "raw", tmp_path)
    text = out.read_text()
    for stem in ("blocks-v1", "host-overhead-v1", "probe-x"):
        assert f"**{stem}**" in text
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]
    assert ["bwd", "256", "2"] in rows and ["bwd", "512", "6"] in rows  # medians, not means
    assert ["plan", "4"] in rows
    assert ["a", "96", "12.0"] in rows and ["b", "168", "8.0"] in rows
    assert ["s", "3.0"] in rows


def test_checked_graph_samples_checks_before_timing():
    """A sweep setting whose outputs are off (or left unwritten) raises; a right one is timed."""
    timer = harness.Timer(torch.device("cpu"), 0)
    want = torch.arange(1.0, 9.0)
    out = torch.empty(8)
    samples = harness.checked_graph_samples(lambda: out.copy_(want * (1 + 2**-10)), [out], [want], timer, "ok", n=3)
    assert len(samples) == 3 and all(s > 0 for s in samples)
    for fn, what in ((lambda: out.copy_(want * 1.01), "off by 1%"), (lambda: None, "unwritten")):
        try:
            harness.checked_graph_samples(fn, [out], [want], timer, what, n=3)
        except AssertionError as e:
            assert what in str(e)
        else:
            raise AssertionError(f"{what}: not caught")


def test_engram_consumer_estimates_from_the_run(tmp_path):
    from dsfuse.bench.engram_gate import report_extra

    times = {("gate_N4_fwd+bwd", "ctrl"): 200.0, ("gate_N4_fwd+bwd", "cand"): 100.0,
             ("consumer_N4_fwd+bwd", "ctrl"): 1000.0, ("consumer_N4_fwd+bwd", "cand"): 950.0}
    rows = [dict(case=c, mode="fwd+bwd", provider=p, regime="evicted", clock="graph", block=b, sample=0, us=us)
            for (c, p), us in times.items() for b in range(2)]
    rows.append(dict(case="copy", mode="copy", provider="copy", regime="evicted", clock="graph", block=0, sample=0,
                     us=1.0))
    pd.DataFrame(rows).to_csv(tmp_path / "samples.csv", index=False)
    pd.DataFrame([dict(case=c, provider=p, role="candidate" if p == "cand" else "control", form="", stage="before",
                       status="pass") for c, p in times]).to_csv(tmp_path / "validation.csv", index=False)
    pd.DataFrame([dict(case="copy", mode="copy", bytes=1_000_000, params="{}"),  # 1 TB/s
                  dict(case="gate_N4_fwd+bwd", mode="fwd+bwd", bytes=50_000_000, params="{}"),  # floor 50 us
                  dict(case="consumer_N4_fwd+bwd", mode="fwd+bwd", bytes=1, params="{}")]).to_csv(
        tmp_path / "cases.csv", index=False)
    (tmp_path / "env.json").write_text("{}")
    (tmp_path / "config.yaml").write_text("{}")
    row = next(line for line in "\n".join(report_extra(tmp_path)).splitlines() if line.startswith("| consumer_N4"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # measured 1000 / 950; expected 1000 / (800 + 100); at the gate floor 1000 / (800 + 50)
    assert cells[-3:] == ["1.05x", "1.11x", "1.18x"]
    assert cells[3:6] == ["200", "100", "50"]


_APART_EXPERIMENT = '''
import torch
from dsfuse.bench.harness import Case, Provider

OP = "fake"


def cases(config):
    return [Case("tiny_fwd", "fwd", {"n": 64}, bytes=512), Case("small_fwd", "fwd", {"n": 96}, bytes=768)]


def make_inputs(case, device, seed):
    return {"x": torch.randn(case.params["n"], generator=torch.Generator().manual_seed(seed))}


def reference(case, inputs):
    return (inputs["x"] * 2,)


def _elsewhere(case, inputs):
    import only_in_the_worker  # on the worker's path alone: this provider fails in the run's process

    return lambda: (inputs["x"] * only_in_the_worker.TWO,)


def providers(config):
    table = {"good": Provider("good", lambda case, inp: (lambda: (inp["x"] * 2,)), role="candidate"),
             "control": Provider("control", _elsewhere)}
    return [table[name] for name in config["providers"]]
'''


def test_own_process_providers_are_checked_and_timed_in_the_same_blocks(tmp_path, monkeypatch):
    """A config's ``own_process`` provider runs in a worker with the Python path of
    ``DSFUSE_OWN_PROCESS_PYTHONPATH`` (it imports a module found only there), is checked on the
    same seeds and timed in every block and (clock, regime) beside the others; env.json records the
    worker's path and packages."""
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir(), there.mkdir()
    (here / "fake_apart_experiment.py").write_text(_APART_EXPERIMENT)
    (there / "only_in_the_worker.py").write_text("TWO = 2\n")
    monkeypatch.syspath_prepend(str(here))
    monkeypatch.setenv("DSFUSE_OWN_PROCESS_PYTHONPATH", f"{here}:{there}")
    import fake_apart_experiment

    config = {"providers": ["good", "control"], "own_process": ["control"], "timing": {"blocks": 3, "samples": 2}}
    run_dir = harness.run_experiment(fake_apart_experiment, config, tmp_path / "raw", torch.device("cpu"), run_id="r")
    samples = pd.read_csv(run_dir / "samples.csv")
    validation = pd.read_csv(run_dir / "validation.csv", keep_default_na=False)
    control = validation[validation["provider"] == "control"]
    assert set(control["status"]) == {"pass"} and set(control["stage"]) == {"before", "after-eager"}
    assert len(control) == 4  # two cases, before and after
    timed = samples[samples["case"] != "copy"].groupby(["case", "provider"])["block"].agg(sorted)
    for case in ("tiny_fwd", "small_fwd"):
        assert timed[(case, "control")] == timed[(case, "good")] == [0, 0, 1, 1, 2, 2]
    env = json.loads((run_dir / "env.json").read_text())
    assert env["own_process"]["providers"] == ["control"] and str(there) in env["own_process"]["pythonpath"]
    assert env["own_process"]["packages"]["torch"] == env["packages"]["torch"]

    # in the run's own process the same provider cannot run: the worker is what made it pass
    monkeypatch.setenv("DSFUSE_OWN_PROCESS_PYTHONPATH", str(here))
    failed = harness.run_experiment(fake_apart_experiment, config, tmp_path / "raw", torch.device("cpu"),
                                    run_id="no-path")
    errors = pd.read_csv(failed / "validation.csv", keep_default_na=False)
    assert "ModuleNotFoundError" in errors.loc[errors["provider"] == "control", "error"].iloc[0]


def test_own_process_names_listed_providers_and_raises_the_workers_errors(tmp_path, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    there = tmp_path / "there"
    there.mkdir()
    (there / "only_in_the_worker.py").write_text("TWO = 2\n")
    worker_lacks_a_case = _APART_EXPERIMENT.replace(
        "def cases(config):\n", "def cases(config):\n    import importlib.util\n"
        "    if importlib.util.find_spec('only_in_the_worker'):\n        return []\n")
    (here / "fake_apart_experiment2.py").write_text(worker_lacks_a_case)
    monkeypatch.syspath_prepend(str(here))
    monkeypatch.setenv("DSFUSE_OWN_PROCESS_PYTHONPATH", f"{here}:{there}")
    import fake_apart_experiment2

    with pytest.raises(ValueError, match="own_process: expected a list of the config's providers"):
        harness.run_experiment(fake_apart_experiment2, {"providers": ["good"], "own_process": ["control"]},
                               tmp_path / "raw", torch.device("cpu"), run_id="bad")
    config = {"providers": ["good", "control"], "own_process": ["control"], "timing": {"blocks": 1, "samples": 1}}
    with pytest.raises(RuntimeError, match=r"(?s)own process of \['control'\], 'check_before'.*KeyError: 'tiny_fwd'"):
        harness.run_experiment(fake_apart_experiment2, config, tmp_path / "raw", torch.device("cpu"), run_id="cut")
    assert (tmp_path / "raw" / "cut" / harness.UNFINISHED).exists()


def test_graph_part_rows_time_each_part_from_its_own_graph(monkeypatch, tmp_path, capsys):
    """A probe's parts: each captured once, its replays timed in the evicted regime, one row per sample
    with the caller's columns; `write_part_medians` writes them and prints the medians by case and part."""
    from dsfuse.bench import harness

    captured, timed = [], []

    class Graph:
        def __init__(self, fn):
            self.replay = fn

    def capture(fn, device):
        captured.append(fn())
        return Graph(fn), None

    class FakeTimer:
        def samples(self, fn, regime, n, reps):
            timed.append((fn(), regime, n, reps))
            return [float(10 * len(timed) + i) for i in range(n)]

    monkeypatch.setattr(harness, "capture_graph", capture)
    parts = [("a", lambda: "ran a"), ("b", lambda: "ran b")]
    rows = harness.graph_part_rows(parts, FakeTimer(), 3, None, case="c1", l2norm=True)
    assert captured == [("ran a",), ("ran b",)]
    assert timed == [(("ran a",), "evicted", 3, 1), (("ran b",), "evicted", 3, 1)]
    assert rows[0] == {"case": "c1", "l2norm": True, "part": "a", "sample": 0, "us": 10.0}
    assert [(r["part"], r["us"]) for r in rows] == [("a", 10.0), ("a", 11.0), ("a", 12.0),
                                                    ("b", 20.0), ("b", 21.0), ("b", 22.0)]
    harness.write_part_medians(tmp_path, rows, 3)
    assert (tmp_path / "samples.csv").read_text().splitlines()[0] == "case,l2norm,part,sample,us"
    out = capsys.readouterr().out
    assert "11.0" in out and "21.0" in out


def test_variant_rows_check_the_bits_then_time_graph_and_eager(monkeypatch):
    """A probe's variant: its outputs cloned and required bitwise equal to the first variant's (a
    differing one is refused before any timing), then its graph replays and eager calls timed in the
    evicted regime, one row per sample with the caller's columns."""
    from dsfuse.bench import harness

    timed = []

    class Graph:
        def __init__(self, fn):
            self.replay = lambda: ("replayed", fn())

    class FakeTimer:
        def samples(self, fn, regime, n, reps):
            timed.append((fn(), regime, n, reps))
            return [float(10 * len(timed) + i) for i in range(n)]

    monkeypatch.setattr(harness, "capture_graph", lambda fn, device: (Graph(fn), None))
    out = torch.tensor([1.0, -0.0])
    got, rows = harness.variant_rows(lambda: (out,), None, "v0", FakeTimer(), 2, None, case="c", variant="v0")
    assert torch.equal(got[0], out) and got[0] is not out
    assert timed == [(("replayed", (out,)), "evicted", 2, 1), ((out,), "evicted", 2, 1)]
    assert rows == [{"case": "c", "variant": "v0", "clock": clock, "sample": i, "us": us}
                    for clock, i, us in (("graph", 0, 10.0), ("graph", 1, 11.0), ("eager", 0, 20.0), ("eager", 1, 21.0))]
    same, _ = harness.variant_rows(lambda: (out.clone(),), got, "v1", FakeTimer(), 1, None)
    assert torch.equal(same[0], out)
    timed.clear()
    with pytest.raises(AssertionError, match="v2 changed the bits"):
        harness.variant_rows(lambda: (torch.tensor([1.0, 0.0]),), got, "v2", FakeTimer(), 1, None)  # +0 against -0
    assert timed == []


class _FakeAllocator:
    """Stand-ins for the ``torch.cuda`` memory counters: ``live`` bytes held by `_Block`s (freed when the
    last reference goes), ``peak`` since the last reset; each call is logged with the bytes live then."""

    def __init__(self):
        self.live = self.peak = 0
        self.log: list[tuple[str, int]] = []

    def block(self, nbytes: int) -> "_Block":
        return _Block(self, nbytes)

    def install(self, monkeypatch):
        def logged(name, value=lambda: None):
            def call(*args, **kwargs):
                self.log.append((name, self.live))
                return value()
            return call

        monkeypatch.setattr(torch.cuda, "synchronize", logged("synchronize"))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", logged("reset", self._reset))
        monkeypatch.setattr(torch.cuda, "memory_allocated", logged("allocated", lambda: self.live))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", logged("max", lambda: self.peak))

    def _reset(self):
        self.peak = self.live


class _Block:
    def __init__(self, allocator: _FakeAllocator, nbytes: int):
        self.allocator, self.nbytes = allocator, nbytes
        allocator.live += nbytes
        allocator.peak = max(allocator.peak, allocator.live)

    def __del__(self):
        self.allocator.live -= self.nbytes


def test_peak_memory_row_counts_one_call_above_what_was_allocated_before(monkeypatch):
    """Peak: the call's temporaries and outputs above the bytes held before it (inputs, a reset's copy
    excluded), read while the outputs are alive; retained: what the call keeps once they are dropped.
    No row on the CPU or for a call that raises."""
    mib = 2**20
    alloc = _FakeAllocator()
    alloc.install(monkeypatch)
    inputs = alloc.block(100 * mib)  # allocated before the call: never counted
    kept = []
    resets = []

    def runner():
        temporary = alloc.block(3 * mib)  # freed inside the call: in the peak only
        out = alloc.block(5 * mib)
        kept.append(alloc.block(2 * mib))  # a workspace the runner keeps: in the peak and retained
        del temporary
        return (out,)

    def reset():
        resets.append(alloc.live)
        scratch = alloc.block(50 * mib)  # a reset's scratch: before the counters are reset, never counted
        del scratch

    runner.reset = reset
    case, provider = Case("c_fwd", "fwd", {}, bytes=0), Provider("p", build=None)
    row = harness.peak_memory_row(case, provider, runner, torch.device("cuda"))
    assert row == dict(case="c_fwd", mode="fwd", provider="p", peak_mib=10.0, retained_mib=2.0)
    assert resets == [100 * mib]
    names = [name for name, _ in alloc.log]
    assert names.index("reset") < names.index("allocated") < names.index("max") < len(names) - 1
    assert dict(alloc.log)["max"] == 107 * mib  # the counters read while the outputs were alive
    assert alloc.log[-1] == ("allocated", 102 * mib)  # retained: read after the outputs were dropped
    del inputs

    alloc.log.clear()
    assert harness.peak_memory_row(case, provider, runner, torch.device("cpu")) is None
    assert alloc.log == []  # the CPU has no counters: none read
    assert harness.peak_memory_row(case, provider, lambda: 1 / 0, torch.device("cuda")) is None


def test_memory_rows_of_both_processes_reach_memory_csv(tmp_path, monkeypatch):
    """`CaseRun.build` measures each runnable provider (`peak_memory_row`; faked here, the CPU has no
    counters) and the own process its own; both reach ``memory.csv`` and `report.load_run`. A run
    without rows (the CPU) writes no ``memory.csv`` and loads an empty table."""
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir(), there.mkdir()
    # in the worker alone (only there is `only_in_the_worker` importable): 2 MiB, with the worker's pid
    worker_fake = ("\ntry:\n    import only_in_the_worker  # noqa: F401\nexcept ImportError:\n    pass\nelse:\n"
                   "    import os\n    from dsfuse.bench import harness\n"
                   "    harness.peak_memory_row = lambda case, provider, runner, device: dict(\n"
                   "        case=case.name, mode=case.mode, provider=provider.name, peak_mib=2.0, retained_mib=0.0,\n"
                   "        pid=os.getpid())\n")
    (here / "fake_memory_experiment.py").write_text(_APART_EXPERIMENT + worker_fake)
    (there / "only_in_the_worker.py").write_text("TWO = 2\n")
    monkeypatch.syspath_prepend(str(here))
    monkeypatch.setenv("DSFUSE_OWN_PROCESS_PYTHONPATH", f"{here}:{there}")
    import os

    import fake_memory_experiment

    plain = harness.run_experiment(_fake_experiment(), {"timing": {"blocks": 1, "samples": 1}}, tmp_path / "raw",
                                   torch.device("cpu"), run_id="plain")
    assert not (plain / "memory.csv").exists()
    assert report.load_run(plain)["memory"].empty
    assert list(report.load_run(plain)["memory"].columns) == report.MEMORY_COLUMNS

    config = {"providers": ["good", "control"], "own_process": ["control"], "timing": {"blocks": 1, "samples": 1}}
    monkeypatch.setattr(harness, "peak_memory_row", lambda case, provider, runner, device: dict(
        case=case.name, mode=case.mode, provider=provider.name, peak_mib=1.0, retained_mib=0.0, pid=os.getpid()))
    run_dir = harness.run_experiment(fake_memory_experiment, config, tmp_path / "raw", torch.device("cpu"),
                                     run_id="r")
    memory = report.load_run(run_dir)["memory"]
    assert sorted(zip(memory["case"], memory["provider"], memory["peak_mib"])) == [
        ("small_fwd", "control", 2.0), ("small_fwd", "good", 1.0), ("tiny_fwd", "control", 2.0),
        ("tiny_fwd", "good", 1.0)]
    pids = memory.groupby("provider")["pid"].agg(set)
    assert pids["good"] == {os.getpid()} and len(pids["control"]) == 1 and pids["control"] != {os.getpid()}
    assert not list(run_dir.glob(".*.partial"))


def test_start_run_writes_env_and_reads_the_config(tmp_path, monkeypatch):
    """A GPU script's start (`harness.start_run`): the output folder created with env.json naming the
    commit it was given and the op's source hash, and the config read from the path as given."""
    from dsfuse.bench.harness import load_config, start_run

    monkeypatch.setenv("DSFUSE_GIT_COMMIT", "abc1234")
    out = tmp_path / "run" / "nested"
    config = start_run(out, "experiments/gdn/configs/smoke.yaml", torch.device("cpu"), "gdn")
    env = json.loads((out / "env.json").read_text())
    assert env["git_commit"] == "abc1234" and env["device"] == "cpu", env
    assert env["kernel_sources"], sorted(env)
    assert config["op"] == "gdn" and config == load_config("experiments/gdn/configs/smoke.yaml")


def test_each_process_releases_its_cache_before_the_other_makes_its_reference(monkeypatch):
    """`_run_case` gives its allocator's cache back before the own process's checks, its timing
    reference and its build (each process makes a float64 reference, too large for two caches at
    131,072 tokens), and both processes make their timing references before either builds its
    runners and graphs (at 131,072 tokens and (16, 32) the run's process held 67 GiB, its inputs,
    float64 results, runners and graphs, while the other process's reference needed more than the
    rest: `experiments/gdn/raw/long/20261205-023630-h200`); and the run's process lets go of its runners
    and graphs before the other's checks after timing (at 131,072 tokens and (16, 48) they ran out of
    memory beside its 88 GiB: `experiments/gdn/raw/long/20261205-053331-h200`)."""
    events = []
    monkeypatch.setattr(harness, "release_cached_memory", lambda device: events.append("release"))
    for step in ("check_before", "prepare", "build"):
        real = getattr(harness.CaseRun, step)
        monkeypatch.setattr(harness.CaseRun, step,
                            lambda self, _real=real, _step=step: events.append(f"here.{_step}") or _real(self))

    class Apart:
        names = ["control"]

        def check_before(self, case_name):
            events.append("apart.check_before")
            return []

        def prepare(self):
            events.append("apart.prepare")

        def build(self):
            events.append("apart.build")
            return [], []

        def memory(self):
            return []

        def check_after(self):
            events.append("apart.check_after")
            return []

    experiment = _fake_experiment()
    case = experiment.cases({})[0]
    providers = experiment.providers({})[:2]
    settings = harness.RunSettings(blocks=1, samples=1, clocks=["wall"], regimes=["hot"])
    timer = harness.Timer(torch.device("cpu"), settings.flush_bytes)
    harness._run_case(experiment, case, providers, settings, timer, torch.device("cpu"), [], [], apart=Apart())
    assert events == ["here.check_before", "release", "apart.check_before", "here.prepare", "release",
                      "apart.prepare", "here.build", "release", "apart.build", "release", "apart.check_after"]


def test_a_case_is_built_on_its_prepared_inputs_only():
    """`CaseRun.build` runs on the inputs and reference `prepare` made (it refuses to run before), and
    the checks after timing let go of both."""
    experiment = _fake_experiment()
    case = experiment.cases({})[0]
    settings = harness.RunSettings(blocks=1, samples=1, clocks=["wall"], regimes=["hot"])
    timer = harness.Timer(torch.device("cpu"), settings.flush_bytes)
    run = harness.CaseRun(experiment, case, experiment.providers({})[:1], settings, timer, torch.device("cpu"))
    run.check_before()
    with pytest.raises(RuntimeError, match="call prepare first"):
        run.build()
    run.prepare()
    assert run.inputs is not None and run.expected is not None
    failed, timed = run.build()
    assert not failed and timed == [experiment.providers({})[0].name]
    assert all(row["status"] == "pass" for row in run.check_after())
    assert run.inputs is None and run.expected is None
    idle = harness.CaseRun(experiment, case, [], settings, timer, torch.device("cpu"))
    assert idle.check_before() == []
    idle.prepare()  # no provider to time: no inputs, no reference
    assert idle.inputs is None and idle.expected is None and idle.build() == ([], [])


def test_a_probe_without_a_gpu_says_so(tmp_path, capsys, monkeypatch):
    """`harness.start_probe` parses a probe's command line, and without a CUDA GPU exits (2) saying
    what it needs, before it writes anything."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        harness.start_probe("A probe.\n\nMore.", "cfg.yaml", 3, "gdn", [str(tmp_path / "out"), "--samples", "2"])
    assert stop.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
