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

from dsfuse._common.aot import ARCHS, all_specs


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
