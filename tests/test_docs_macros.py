"""The docs' raw-data macros (docs/macros.py) on a small samples.csv: what a page quotes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


class _Env:
    def __init__(self, root: Path):
        self.conf = {"config_file_path": str(root / "mkdocs.yml")}
        self.macros = {}

    def macro(self, fn):
        self.macros[fn.__name__] = fn
        return fn


@pytest.fixture
def macros(tmp_path):
    spec = importlib.util.spec_from_file_location("docs_macros", ROOT / "docs" / "macros.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    env = _Env(tmp_path)
    module.define_env(env)
    run = tmp_path / "raw" / "run"
    run.mkdir(parents=True)
    rows = ["case,provider,us"] + [f"c,dsfuse,{us}" for us in (99, 100, 101)] + [f"c,control,{us}" for us in (120, 121)]
    (run / "samples.csv").write_text("\n".join(rows) + "\n")
    return env.macros


def test_time_to_lose_is_the_share_of_the_candidates_median_above_the_margin(macros):
    dsfuse, control = dict(run="raw/run", provider="dsfuse"), dict(run="raw/run", provider="control")
    # medians 100 and 120.5: 1.10x faster needs 120.5 / 1.1 = 109.5 us, so nothing to lose; 1.25x needs 96.4 us
    assert macros["raw_time_to_lose"](dsfuse, control) == "none"
    assert macros["raw_time_to_lose"](dsfuse, control, speedup=1.25) == "4 %"
    assert macros["raw_time_to_lose"](dsfuse, control, speedup=1.2096) == "under 1 %"  # needs 99.6 us
    assert macros["raw_median_ratio"](dsfuse, control) == "0.83x"


def test_a_judged_ratio_is_judged_unrounded(macros):
    dsfuse, control = dict(run="raw/run", provider="dsfuse"), dict(run="raw/run", provider="control")
    # 120.5 / 100 = 1.205: shown as 1.21x (rounded half to even by the format: 1.20x or 1.21x), judged exactly
    shown = macros["raw_median_ratio"](control, dsfuse)
    assert macros["raw_ratio_judged"](control, dsfuse, at_least=1.205) == f"{shown} (met)"
    assert macros["raw_ratio_judged"](control, dsfuse, at_least=1.2051) == f"{shown} (**missed**)"
    assert macros["raw_ratio_judged"](dsfuse, control, at_most=0.83) == "0.83x (met)"  # 100 / 120.5 = 0.82988
    assert macros["raw_ratio_judged"](dsfuse, control, at_most=0.8298) == "0.83x (**missed**)"
    with pytest.raises(ValueError, match="one of"):
        macros["raw_ratio_judged"](dsfuse, control)


def test_a_figure_the_data_lacks_raises(macros):
    with pytest.raises(ValueError, match="no row"):
        macros["raw_time_to_lose"](dict(run="raw/run", provider="nobody"), dict(run="raw/run", provider="control"))
