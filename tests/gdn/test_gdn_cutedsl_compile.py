"""Every kernel module of the Gated DeltaNet's CuTe DSL table (``dsfuse.gdn.cutedsl.KERNELS``, the
registry's list) compiles its AOT specs (the model's specialisations) on the CPU for each architecture
a spec names (sm_90a and sm_100a, or sm_90a alone for Hopper's wgmma), with a fixed order of every sum
(no atomics or reductions) and nothing in local memory."""

import importlib

import pytest
from conftest import cutedsl_or_skip
from dsfuse.gdn.cutedsl import KERNELS
from helpers import cute_spec_ptx


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name", KERNELS)
def test_aot_specs_compile_in_a_fixed_order(name, arch, tmp_path):
    cutedsl_or_skip()
    specs = importlib.import_module(name).AOT_SPECS
    assert specs, f"{name} lists no AOT spec"
    assert all(set(spec.archs) <= {"sm_90a", "sm_100a"} and spec.archs for spec in specs), name
    built = [cute_spec_ptx(spec, arch, tmp_path) for spec in specs if arch in spec.archs]
    if not built:  # an instruction of one architecture (wgmma) compiles for it alone
        pytest.skip(f"{name} has no spec for {arch}")
