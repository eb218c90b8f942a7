"""experiments/gdn/tree_maps_accuracy.py on two chunks: a row per gate kind, key kind and value head;
the fp32 tree's E within the contract's fp32 tolerance of the float64 walk, and the emulated
products' errors in the order of their precisions; its tf32 rounding to nearest, ties to even."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def module():
    spec = importlib.util.spec_from_file_location("tree_maps_accuracy", ROOT / "experiments/gdn/tree_maps_accuracy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_accuracy_script_writes_its_table(module, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["tree_maps_accuracy.py", str(tmp_path), "--chunks", "2", "--heads", "2"])
    assert module.main() == 0
    rows = pd.read_csv(tmp_path / "accuracy.csv")
    assert sorted(set(zip(rows["gates"], rows["keys"], rows["head"]))) == sorted(
        (g, k, h) for g in ("model", "strong", "weak") for k in ("full", "rank16") for h in (0, 1))
    assert (rows["e_norm"] > 0).all() and (rows["e_tree_fp32"] < 1e-5).all()
    for what in ("e", "s"):  # each emulated product rounds less than the next
        errors = [rows[f"{what}_tree_{p}"] for p in ("fp32", "bf16x3", "tf32", "bf16")]
        for finer, coarser in zip(errors, errors[1:]):
            assert (finer < coarser).all(), (what, finer.tolist(), coarser.tolist())


def test_tf32_rounds_to_nearest_ties_to_even(module):
    ulp = 2.0**-10  # tf32 keeps 10 mantissa bits
    x = torch.tensor([1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 2 + 2.0**-20, -(1 + 3 * ulp / 2), 1 + ulp], dtype=torch.float32)
    want = torch.tensor([1.0, 1 + 2 * ulp, 1 + ulp, -(1 + 2 * ulp), 1 + ulp], dtype=torch.float32)
    assert torch.equal(module.tf32(x), want)


def test_the_scripts_walk_is_the_reference_state_pass(module):
    """The script's walk (which takes an emulated product) is `chunk_state_pass`'s final state."""
    from dsfuse.gdn.reference import chunk_state_pass, prepare_chunk_indices

    gen = torch.Generator().manual_seed(0)
    nc, hv, c, k_dim = 3, 2, 8, 4
    k, w = (torch.randn(nc, hv, c, k_dim, generator=gen, dtype=torch.float64) for _ in range(2))
    u = torch.randn(nc, hv, c, k_dim, generator=gen, dtype=torch.float64)
    g_cum = -torch.rand(nc, hv, c, generator=gen, dtype=torch.float64).cumsum(-1)
    h0 = torch.randn(1, hv, k_dim, k_dim, generator=gen, dtype=torch.float64)
    ci = prepare_chunk_indices([0, nc * c], c)
    want = chunk_state_pass(k, w, u, g_cum, ci, 1, h0)[2][0]
    got = module.walk(k, w, u, g_cum, h0[0], module.PRODUCTS["fp32"])
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
