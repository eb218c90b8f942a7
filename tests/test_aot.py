"""Every Triton kernel compiles ahead of time for Hopper (sm_90) and Blackwell (sm_100).

No GPU is needed: ``triton.compile`` with a ``GPUTarget`` runs the whole pipeline
to a cubin with Triton's bundled ptxas. The specialisations are the ones the
DeepSeek-V4.1 shapes launch (each op's ``AOT_SPECS``). The compiler runs in a
subprocess because the CPU tests run Triton in its interpreter.
"""

import json
import os
import subprocess
import sys

import pytest

from dsfuse._common.aot import ARCHS, all_specs, record_specs


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "dsfuse._common.aot"], capture_output=True, text=True, env=env,
                          timeout=900)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, f"no output from the AOT compiler run:\n{proc.stderr[-3000:]}"
    return {(row["spec"], row["arch"]): row for row in rows}


def _spec_names():
    return sorted(spec.name for spec in all_specs())


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("name", _spec_names())
def test_compiles_for(compiled, name, arch):
    row = compiled[(name, arch)]
    assert row["ok"], row.get("error")
    assert row["cubin_bytes"] > 0
    assert row["target"] in (f"sm_{ARCHS[arch]}", f"sm_{ARCHS[arch]}a")


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("name", ["text_rope_fwd_bf16", "text_rope_bwd_bf16", "text_rope_inplace_bf16"])
def test_text_rope_accesses_are_vectorised(compiled, name, arch):
    """Copied channels move in 16-byte accesses, rotated pairs at least 4 bytes at a time
    (a thread holds whole pairs), and nothing is staged through shared memory."""
    row = compiled[(name, arch)]
    ops = row["memory_ops"]
    if name != "text_rope_inplace_bf16":
        assert ops.get("ld.global.v4.b32") and ops.get("st.global.v4.b32"), ops
    assert not any(op.endswith((".b16", ".u16")) for op in ops), ops
    assert row["shared"] == 0


def test_unknown_arch_is_rejected():
    from dsfuse._common.aot import compile_for
    from dsfuse.text_rope.triton import AOT_SPECS

    with pytest.raises(ValueError, match="arch: expected one of"):
        compile_for(AOT_SPECS[0], "sm_80")


def test_recorded_spec_is_the_runtime_specialisation():
    """A spec recorded from a launcher call (meta tensors, nothing runs) holds what Triton's runtime
    would specialise: a contiguous [T, 48] gate's head stride 1 as a constant, the 48 heads and the
    token stride 48 as multiples of 16, the launcher's constexprs and options."""
    from dsfuse.gdn.triton.common import model_tensors
    from dsfuse.gdn.triton.cumsum import launch_chunk_cumsum

    x = model_tensors()
    (spec,) = record_specs("cumsum", launch_chunk_cumsum, x.g, x.chunk_indices, x.g_cum)
    assert spec.signature == {"g_ptr": "*fp32", "gc_ptr": "*fp32", "ci_ptr": "*i32", "n_heads": "i32",
                              "s_gt": "i32", "s_ct": "i32"}
    assert spec.constexprs == {"s_gh": 1, "s_ch": 1, "BT": 64, "BH": 64}
    assert spec.options == {"num_warps": 4}
    assert spec.divisible_by_16 == ("g_ptr", "gc_ptr", "ci_ptr", "n_heads", "s_gt", "s_ct")


def test_recorded_spec_keeps_do_not_specialize_and_none():
    """``do_not_specialize`` arguments stay runtime i32 (N = 1 is not made a constant, T = 32768 not
    marked divisible), None pointers become constexprs, and the GPU path is recorded even under the
    CPU interpreter (``PIPELINED``, no bf16 emulation)."""
    from dsfuse.gdn.triton.common import BLACKWELL, assume_family, model_tensors
    from dsfuse.gdn.triton.state import launch_state_pass

    x = model_tensors()
    args = (x.k, x.w, x.u, x.g_cum, x.chunk_indices, x.chunk_offsets, None, x.h, x.v_new, None)
    (spec,) = record_specs("state", launch_state_pass, *args)
    assert spec.signature["T"] == spec.signature["N"] == "i32"
    assert "T" not in spec.divisible_by_16 and "N" not in spec.divisible_by_16
    assert spec.constexprs["h0_ptr"] is None and spec.constexprs["ht_ptr"] is None
    assert spec.constexprs["PIPELINED"] is True and spec.constexprs["S"].EMULATE_BF16.value is False
    assert [f.value for f in spec.constexprs["S"]] == [48, 3, 128, 128, 64, False, "tf32", False]  # common.Stage
    assert spec.options == {"num_warps": 4, "num_stages": 2} and spec.constexprs["BV"] == 64
    with assume_family(BLACKWELL):
        (spec,) = record_specs("state", launch_state_pass, *args)
    assert spec.options == {"num_warps": 2, "num_stages": 2} and spec.constexprs["BV"] == 32


def test_record_specs_wants_one_name_per_launch():
    from dsfuse.gdn.triton.common import model_tensors
    from dsfuse.gdn.triton.wy import launch_wy

    x = model_tensors()
    args = (x.k, x.v, x.beta, x.g_cum, x.chunk_indices, x.A, x.w, x.u)
    assert [s.name for s in record_specs(["ut", "wy"], launch_wy, *args)] == ["ut", "wy"]
    with pytest.raises(ValueError, match="names: 1 given"):
        record_specs("ut", launch_wy, *args)
