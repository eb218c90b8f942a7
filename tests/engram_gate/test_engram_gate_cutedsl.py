"""Engram gate, CuTe DSL backend (``dsfuse.engram_gate.cutedsl``).

CPU (no GPU, no CuTe DSL interpreter): the kernels compile for sm_90a and sm_100a at the model's
shape (S = 4, D = 5120) in every dtype the backend offers, and their PTX says what the design
promises: the target, 128-bit global accesses only (the token-mask byte aside), cp.async staging
in the backward, no atomics; the launchers' compile cache does not grow with N; the backend's
refusals name their reason.

GPU (``@pytest.mark.gpu``, the H200): what only this backend refuses (rows that are not 128-bit
aligned, by the functional call and by the plan) and builds (a plan compiles three kernels at
most). Every contract check runs on this backend through the ``backend`` fixture
(``tests/conftest.py``): ``test_engram_gate.py`` (the test widths, float64 end to end and from the
same saved state, fp16 and fp32, caller-owned outputs, the plan, autograd, torch.compile) and
``test_engram_gate_gpu.py`` (the model's width, tails of the thread mapping, bitwise
reproducibility, either backend's saved state in the other's backward, streams, the plan's CUDA
Graph replay, no allocation, compile or sync on execute).
"""

import re
from collections import Counter

import pytest
import torch
from conftest import cutedsl_kernels
from test_engram_gate import make

from dsfuse.engram_gate import EngramGatePlan, engram_gate, engram_gate_backward, engram_gate_forward

eg, ARCHS, DTYPES = cutedsl_kernels("engram_gate")  # ARCHS: sm_90a, sm_100a; DTYPES: bf16, fp16, fp32
S, D = 4, 5120  # DeepSeek-V4.1


# -- CPU: compile for both targets and read the PTX ------------------------------------------


def _ops(ptx: str) -> Counter:
    return Counter(re.findall(r"\b((?:ld|st|cp|atom|red|multimem)\.[\w.]+)", ptx))


@pytest.fixture(scope="module")
def compiled():
    """PTX of every kernel per (kernel, dtype, arch)."""
    out = {}
    for arch in ARCHS:
        for dtype in DTYPES:
            out["fwd", dtype, arch] = eg.compile_forward(dtype, S, D, arch, keep_ptx=True).__ptx__
            out["bwd", dtype, arch] = eg.compile_backward(dtype, S, D, arch, keep_ptx=True).__ptx__
        out["sum", torch.float32, arch] = eg.compile_dweight_sum(S * D, arch, keep_ptx=True).__ptx__
    return out


def _global_accesses(ops: Counter) -> dict:
    return {op: c for op, c in ops.items() if op.startswith(("ld.global", "st.global"))}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kernel", ["fwd", "bwd"])
def test_ptx_target_vectors_and_no_atomics(compiled, kernel, dtype, arch):
    """128-bit global loads and stores only (but the token-mask byte), no atomics or reductions
    to memory: bitwise reproducible by construction."""
    ptx = compiled[kernel, dtype, arch]
    assert re.search(r"\.target (\w+)", ptx).group(1) == arch
    ops = _ops(ptx)
    accesses = _global_accesses(ops)
    narrow = {op: c for op, c in accesses.items() if not re.search(r"\.v4\.b32|\.v2\.b64", op)}
    assert narrow == ({"ld.global.b8": 1} if kernel == "fwd" else {}), accesses
    assert any(op.startswith("ld.global") for op in accesses) and any(op.startswith("st.global") for op in accesses)
    assert not any(op.startswith(("atom.", "red.", "multimem.")) for op in ops), ops


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_backward_stages_rows_with_cp_async(compiled, dtype, arch):
    """The backward stages dout, the value (and x, the keys where they fit) with 16-byte cp.async
    copies, waits on commit groups, and reads the staged rows back 128 bits at a time."""
    ptx = compiled["bwd", dtype, arch]
    ops = _ops(ptx)
    copies = re.findall(r"cp\.async\.cg\.shared\.global(?:\.\w+)* \[[^\]]+\], \[[^\]]+\], (\d+)", ptx)
    assert copies and set(copies) == {"16"}, copies
    assert ops["cp.async.commit_group"] and ops["cp.async.wait_group"], ops
    assert ops["ld.shared.v4.b32"], ops
    _, stage_xk = eg._stages(dtype, S, D)
    rows = S + 1 + (2 * S if stage_xk else 0)  # rows of D channels staged per token
    vectors = D // eg.vector_elements(dtype)
    # one copy per vector a thread owns, per staged row (prologue and loop bodies; static unrolling)
    assert len(copies) >= rows * vectors // eg.geometry(dtype, D)[2], (len(copies), rows)


@pytest.mark.parametrize("arch", ARCHS)
def test_dweight_sum_is_vectorised_and_atomic_free(compiled, arch):
    ptx = compiled["sum", torch.float32, arch]
    ops = _ops(ptx)
    assert re.search(r"\.target (\w+)", ptx).group(1) == arch
    accesses = _global_accesses(ops)
    assert all(re.search(r"\.v4\.b32|\.v2\.b64", op) for op in accesses), ops  # 128 bits each
    assert any(op.startswith("ld.") for op in accesses) and any(op.startswith("st.") for op in accesses), ops
    assert not any(op.startswith(("atom.", "red.")) for op in ops)


def test_model_geometry():
    """D = 5120 bf16: 640 vectors of 8 per row, 320 threads with two each; the backward stages two
    dout + value stages and one x + key stage (184320 bytes) and keeps weight in registers."""
    assert eg.geometry(torch.bfloat16, D) == (8, 2, 320)
    assert eg._stages(torch.bfloat16, S, D) == (2, True)
    assert eg._weight_in_registers(torch.bfloat16, S, D)
    assert eg.shape_reasons(torch.bfloat16, S, D, backward=True) == []
    assert eg.workspace_elements(4096, S, D) == eg.GROUPS * S * D
    assert eg.workspace_elements(3, S, D) == 3 * S * D


def test_a_new_token_count_compiles_nothing(monkeypatch):
    """The launchers' cache key holds no N: forward and backward on N = 3 then N = 65 (CPU tensors;
    the compiled functions are real, their calls recorded instead of launched)."""
    calls = []

    def recording(build):
        def wrapped(*args, **kwargs):
            fn = build(*args, **kwargs)
            return lambda *call_args: calls.append((fn, call_args))
        return wrapped

    cache = type(eg.CACHE)()
    monkeypatch.setattr(eg, "CACHE", cache)
    monkeypatch.setattr(eg, "_arch", lambda device: "sm_90a")
    for name in ("compile_forward", "compile_backward", "compile_dweight_sum"):
        monkeypatch.setattr(eg, name, recording(getattr(eg, name)))
    dim = 96
    for n in (3, 65):
        x, kv, weight, mask, dout = make(n, dim, "cpu", seed=n)
        out, saved = torch.empty_like(x), torch.empty(n, S, 4)
        eg.launch_forward(x, kv, weight, mask, out, saved, eps=1e-20, clamp=1e-6)
        ws = torch.empty(eg.workspace_elements(n, S, dim))
        eg.launch_backward(dout, x, kv, weight, saved, torch.empty_like(x), torch.empty_like(kv),
                           torch.empty(S, dim), ws, clamp=1e-6)
        assert cache.compiles == 3, "a new N compiled again"
    assert len(calls) == 6
    fwd_args = calls[0][1]
    assert fwd_args[3].dtype == torch.uint8, "the token mask goes as its uint8 view"
    bwd_args, sum_args = calls[1][1], calls[2][1]
    assert bwd_args[7].shape == (3, S, dim) and sum_args[0].shape == (3, S * dim)  # G = min(N, GROUPS)
    assert calls[4][1][7].shape == (65, S, dim)


def test_cpu_tensors_and_bad_geometries_are_refused():
    x, kv, weight, mask, dout = make(5, 32, "cpu", seed=6)
    saved = torch.empty(5, 4, 4)
    with pytest.raises(ValueError, match=r"backend='cutedsl' cannot serve .*tensors are on cpu \(CuTe DSL needs CUDA"):
        engram_gate_forward(x, kv, weight, mask, eps=1e-20, backend="cutedsl")
    with pytest.raises(ValueError, match=r"backend='cutedsl' cannot serve .*tensors are on cpu"):
        engram_gate_backward(dout, x, kv, weight, mask, saved, eps=1e-20, backend="cutedsl")
    with pytest.raises(ValueError, match=r"backend='cutedsl' cannot serve .*tensors are on cpu"):
        engram_gate(x, kv, weight, mask, eps=1e-20, backend="cutedsl")
    with pytest.raises(ValueError, match=r"device: the plan runs the CuTe DSL kernels: .*tensors are on cpu"):
        EngramGatePlan(dim=32, max_tokens=4, device="cpu", eps=1e-20, backend="cutedsl")
    with pytest.raises(ValueError, match="backend: expected 'triton' or 'cutedsl' for a plan"):
        EngramGatePlan(dim=32, max_tokens=4, device="cpu", eps=1e-20, backend="reference")
    assert "not a multiple of 8 channels" in eg.shape_reasons(torch.bfloat16, 4, 100, backward=False)[0]
    assert eg.shape_reasons(torch.float32, 4, 100, backward=True) == []  # fp32: vectors of 4
    assert "above the CuTe DSL kernels' limit" in eg.shape_reasons(torch.bfloat16, 4, 16392, backward=False)[0]
    wide = eg.shape_reasons(torch.bfloat16, 4, 16384, backward=True)
    assert wide and "dWeight partial in registers" in wide[0]
    assert eg.shape_reasons(torch.bfloat16, 4, 16384, backward=False) == []
    rows = torch.empty(3, 4, 40, dtype=torch.bfloat16)[:, :, :36].contiguous()
    strided = torch.empty(3, 4 * 36 + 4, dtype=torch.bfloat16)[:, : 4 * 36].view(3, 4, 36)  # row stride 148
    assert eg.layout_reasons(x=rows) == []
    assert eg.layout_reasons(x=strided) == ["x: row stride 148 elements is not a multiple of 16 bytes"]
    assert "not 16-byte aligned" in eg.layout_reasons(kv=torch.empty(10, dtype=torch.bfloat16)[1:])[0]


def test_auto_never_picks_cutedsl():
    from dsfuse.engram_gate.api import BACKENDS

    assert "cutedsl" in BACKENDS.kernels
    for family in ("sm_90", "sm_100"):
        assert BACKENDS.preference[family] == ("triton",)


# -- GPU: what only this backend refuses or builds --------------------------------------------
# (every contract check runs on this backend from test_engram_gate.py and test_engram_gate_gpu.py)

gpu = pytest.mark.gpu
CUDA = "cuda"


@gpu
def test_rows_not_128_bit_aligned_are_refused_on_cuda():
    """Rows that are not 128-bit aligned: refused by name, by the functional call and by the plan,
    never a launch on them."""
    n, dim = 7, 96
    x, kv, weight, mask, _ = make(n, dim, CUDA, seed=5)
    wide = torch.empty(n, 4 * dim + 4, dtype=x.dtype, device=CUDA)[:, : 4 * dim].view(n, 4, dim)
    with pytest.raises(ValueError, match="x: row stride"):
        engram_gate_forward(wide.copy_(x), kv, weight, mask, eps=1e-20, backend="cutedsl")
    plan = EngramGatePlan(dim=64, max_tokens=8, device=CUDA, eps=1e-20, backend="cutedsl")
    x, kv, weight, mask, _ = make(4, 64, CUDA, seed=14)
    kv_wide = torch.empty(4, 5 * 64 + 4, dtype=kv.dtype, device=CUDA)[:, : 5 * 64]
    kv_wide.copy_(kv)
    with pytest.raises(ValueError, match="kv: row stride"):
        plan.forward(x, kv_wide, weight, mask, torch.empty_like(x), torch.empty(4, 4, 4, device=CUDA))


@gpu
def test_plan_compiles_its_three_kernels_at_most():
    """A plan compiles the forward, the backward and the dWeight sum when it is made (fewer when cached)."""
    compiles = eg.CACHE.compiles
    EngramGatePlan(dim=D, max_tokens=4096, device=CUDA, eps=1e-20, backend="cutedsl")
    assert eg.CACHE.compiles <= compiles + 3
