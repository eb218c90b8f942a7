"""experiments/gdn/tree_maps_accuracy.py on two chunks: it writes a row per gate kind, and the fp32
tree's E is within the contract's fp32 tolerance of the float64 walk."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_accuracy_script_writes_its_table(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("tree_maps_accuracy", ROOT / "experiments/gdn/tree_maps_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["tree_maps_accuracy.py", str(tmp_path), "--chunks", "2"])
    assert module.main() == 0
    rows = list(csv.DictReader((tmp_path / "accuracy.csv").open()))
    assert [r["gates"] for r in rows] == ["model", "strong"]
    for row in rows:  # M may underflow (its norm depends on the drawn head's decay), E does not
        assert float(row["e_tree_fp32"]) < 1e-5 and float(row["e_norm"]) > 0, row
