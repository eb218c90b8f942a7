"""The tuning scripts' sweep helper (``dsfuse.bench.harness.sweep``) on the CPU."""

import pandas as pd
import pytest
import torch

from dsfuse.bench.harness import Timer, checked_graph_samples, sweep


def test_product_of_named_options_gives_one_row_per_sample_in_order(tmp_path):
    out = tmp_path / "sweep.csv"
    seen = []

    def build(setting):
        seen.append(dict(setting))
        return setting["elements"] * setting["warps"]

    rows = sweep({"elements": [256, 512], "warps": [1, 2, 4]}, build, lambda built, s: [built, built + 0.5], out)
    assert seen == [{"elements": e, "warps": w} for e in (256, 512) for w in (1, 2, 4)]
    df = pd.read_csv(out)
    assert list(df.columns) == ["elements", "warps", "sample", "us"]
    assert len(df) == len(rows) == 12
    assert df["sample"].tolist() == [0, 1] * 6
    assert df["us"].tolist() == [float(e * w + d) for e in (256, 512) for w in (1, 2, 4) for d in (0, 0.5)]


def test_failing_settings_are_recorded_not_dropped(tmp_path):
    out = tmp_path / "sweep.csv"
    settings = [dict(mode="ok", warps=1), dict(mode="build-fails", warps=2), dict(mode="check-fails", warps=4),
                dict(mode="ok", warps=8)]

    def build(setting):
        if setting["mode"] == "build-fails":
            raise ValueError("no such launch")
        return setting["warps"]

    def measure(built, setting):
        if setting["mode"] == "check-fails":
            raise AssertionError("output 0: relative RMS error 1.0e+00")
        return [10.0 * built] * 3

    sweep(settings, build, measure, out)
    df = pd.read_csv(out, keep_default_na=False)
    assert list(df.columns) == ["mode", "warps", "sample", "us", "error"]
    assert df["warps"].tolist() == [1, 1, 1, 2, 4, 8, 8, 8]  # every setting present, in order
    failed = df[df["error"] != ""]
    assert failed["mode"].tolist() == ["build-fails", "check-fails"]
    assert failed["error"].tolist() == ["ValueError: no such launch",
                                        "AssertionError: output 0: relative RMS error 1.0e+00"]
    assert (failed["sample"] == "").all() and (failed["us"] == "").all()
    assert pd.to_numeric(df.loc[df["error"] == "", "us"]).tolist() == [10.0] * 3 + [80.0] * 3


def test_a_setting_without_samples_is_a_failure(tmp_path):
    rows = sweep([{"mode": "empty"}], lambda s: None, lambda built, s: [], tmp_path / "sweep.csv")
    assert len(rows) == 1 and "no samples" in rows[0]["error"]


def test_rounds_extra_columns_and_value_name(tmp_path):
    out = tmp_path / "sweep.csv"
    order = []

    def measure(built, setting):
        order.append(setting["part"])
        return [1.0, 2.0], {"regs": len(setting["part"])}

    sweep([{"part": "a"}, {"part": "bb"}], lambda s: None, measure, out, value="host_us", rounds=2)
    assert order == ["a", "bb", "a", "bb"]  # rounds outermost: every setting once per round
    df = pd.read_csv(out)
    assert list(df.columns) == ["part", "regs", "round", "sample", "host_us"]
    assert df["round"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert df["regs"].tolist() == [1, 1, 2, 2] * 2


def test_the_csv_holds_the_finished_settings_while_the_sweep_runs(tmp_path):
    out = tmp_path / "sweep.csv"

    def measure(built, setting):
        if setting["warps"] == 4:  # the file already has the first two settings
            assert pd.read_csv(out)["warps"].tolist() == [1, 2]
        return [1.0]

    rows = sweep({"warps": [1, 2, 4]}, lambda s: None, measure, out)
    assert not any("error" in r for r in rows)  # the check inside measure passed
    assert pd.read_csv(out)["warps"].tolist() == [1, 2, 4]


def test_with_the_harness_check_a_wrong_setting_is_recorded(tmp_path):
    """The tuning scripts' shape: build sets a constant and returns (fn, outputs, expected);
    measure is ``checked_graph_samples`` (CPU: plain calls), whose failed check becomes a row."""
    out = tmp_path / "sweep.csv"
    timer = Timer(torch.device("cpu"), 0)
    x = torch.linspace(-1, 1, 64)
    y = torch.zeros(64)
    want = (x * 2,)

    def build(setting):
        scale = 2.0 if setting["variant"] == "right" else 2.5
        return lambda: torch.mul(x, scale, out=y), (y,), want

    def measure(built, setting):
        fn, outputs, expected = built
        return checked_graph_samples(fn, outputs, expected, timer, str(setting), n=4)

    rows = sweep({"variant": ["right", "wrong"]}, build, measure, out)
    assert [r["variant"] for r in rows] == ["right"] * 4 + ["wrong"]
    assert all(r["us"] > 0 for r in rows[:4])
    assert rows[-1]["error"].startswith("AssertionError: {'variant': 'wrong'}: output 0: relative RMS error")


def test_settings_must_be_dicts_or_a_mapping(tmp_path):
    with pytest.raises((TypeError, ValueError)):
        sweep([("elements", 256)], lambda s: None, lambda b, s: [1.0], tmp_path / "sweep.csv")
