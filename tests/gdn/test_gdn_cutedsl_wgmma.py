"""Warpgroup tensor-core products (``dsfuse.gdn.cutedsl.wgmma``), the building block of the per-head
forward's second step: the check kernel compiled for sm_90a on the CPU (one ``wgmma`` of the expected
shape per 16-wide block of K, nothing in local memory), refused for sm_100a by name, and on a GPU the
three operand forms against float64 products of the same bf16 / fp16 values."""

import re

import pytest
import torch
from conftest import cutedsl_or_skip
from helpers import assert_product_matches_float64, cute_spec_ptx


@pytest.fixture(scope="module")
def wgmma():
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl import wgmma

    return wgmma


def test_compiles_to_one_wgmma_per_k_block(wgmma, tmp_path):
    for spec in wgmma.AOT_SPECS:
        assert spec.archs == ("sm_90a",)
        m, n, k, _, _ = wgmma.FORMS[spec.name.removeprefix("gdn_wgmma_check_")]
        ptx = cute_spec_ptx(spec, "sm_90a", tmp_path)
        over_m = m // 64  # warpgroups over M; the rest split N
        shape = f"m64n{n // (wgmma.WARPGROUPS // over_m)}k16"
        found = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.bf16\.bf16", ptx)
        assert found == [shape] * (k // 16), (spec.name, found)


def test_refuses_blackwell(wgmma):
    with pytest.raises(ValueError, match="sm_90a"):
        wgmma.compile_check(torch.bfloat16, "qkT", "sm_100a")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["qkT", "kS", "kTv", "kS64"])
def test_products_match_float64(wgmma, form, dtype):
    """``A B^T`` with the operands stored as the per-head forward stores them (transposed where the
    form says): relative RMS <= 1e-5 against float64 products of the same values (fp32
    accumulation), and bitwise run to run."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on sm_90 only")
    assert_product_matches_float64(wgmma, form, dtype)
