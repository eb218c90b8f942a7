"""The tensor-core product of shared-memory tiles (``dsfuse.gdn.cutedsl.mma``), the building block of
the fused forward's tensor-core form: its compilation for sm_90a and sm_100a (CPU: one ``mma.sync``
per 16x8x16 step, nothing in local memory) and, on a GPU, the three operand forms the fused forward
needs against float64 products of the same bf16 / fp16 values."""

import re

import pytest
import torch
from conftest import cutedsl_or_skip
from helpers import assert_product_matches_float64, cute_spec_ptx


@pytest.fixture(scope="module")
def mma():
    cutedsl_or_skip()
    from dsfuse.gdn.cutedsl import mma

    return mma


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_compiles_to_one_mma_per_step(mma, arch, tmp_path):
    for spec in mma.AOT_SPECS:
        form = spec.name.removeprefix("gdn_mma_check_")
        m, n, k, _, _ = mma.FORMS[form]
        ptx = cute_spec_ptx(spec, arch, tmp_path)
        assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16", ptx)) == m * n * k // (16 * 8 * 16) // 4, spec.name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["qkT", "kS", "kTv"])
def test_products_match_float64(mma, form, dtype):
    """``A B^T`` with the operands stored as the fused forward stores them (transposed where the form
    says): relative RMS <= 1e-5 against float64 products of the same values (fp32 accumulation)."""
    assert_product_matches_float64(mma, form, dtype)


def test_swizzled_tiles_refuse_partial_atoms():
    """Staged tiles rely on whole swizzle atoms (a stage's offset then leaves the swizzled bits
    alone): both tile helpers refuse a shape that is not whole atoms, before any layout or allocation
    (the whole shapes are built by the kernels' compile tests)."""
    cutedsl_or_skip()
    import cutlass

    from dsfuse.gdn.cutedsl import mma, wgmma

    for rows, cols in ((64, 48), (12, 64)):
        with pytest.raises(ValueError, match="whole 8 x"):
            mma.swizzled_layout(rows, cols, 2)
    for rows, cols in ((64, 96), (12, 128)):
        with pytest.raises(ValueError, match="whole 8 x 64 atoms"):
            wgmma.tile(None, cutlass.BFloat16, rows, cols, 2)
