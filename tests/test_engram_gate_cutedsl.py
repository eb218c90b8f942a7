"""Engram gate, CuTe DSL backend (``dsfuse.engram_gate.cutedsl``).

CPU (no GPU, no CuTe DSL interpreter): the kernels compile for sm_90a and sm_100a at the model's
shape (S = 4, D = 5120) in every dtype the backend offers, and their PTX says what the design
promises: the target, 128-bit global accesses only (the token-mask byte aside), cp.async staging
in the backward, no atomics; the launchers' compile cache does not grow with N; the backend's
refusals name their reason.

GPU (``@pytest.mark.gpu``, the H200; the model-width checks and the plan's CUDA Graph replay run for
both backends in ``tests/test_engram_gate_gpu.py``): the correctness checks of ``tests/test_engram_gate.py``
(``check_all``: float64 end to end and from the same saved state, masked tokens exact) on the
CuTe DSL backend, at the test widths and the model's, tails of the thread mapping included
(N = 1; D = 24 and 4104: rows of 3 and 513 vectors, so threads and vectors past the row are
predicated off); bitwise run-to-run reproducibility (dweight included); the saved state of one
backend's forward used by the other's backward; the plan (no allocation, compile or sync on
execute; CUDA Graph capture and replay on changed and NaN-poisoned buffers); autograd and
torch.compile; explicit streams; fp16 and fp32.
"""

import importlib
import re
from collections import Counter

import pytest
import torch
from conftest import cutedsl_or_skip
from helpers import assert_bitwise
from test_engram_gate import assert_close_fp32, assert_rounded_from, check_all, make

from dsfuse.engram_gate import (
    EngramGatePlan,
    engram_gate,
    engram_gate_backward,
    engram_gate_backward_from_saved,
    engram_gate_forward,
)

cutedsl_or_skip()
eg = importlib.import_module("dsfuse.engram_gate.cutedsl.kernels")

ARCHS = ("sm_90a", "sm_100a")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
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


# -- GPU -------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
CUDA = "cuda"


@gpu
@pytest.mark.parametrize("n", [1, 3, 65])
@pytest.mark.parametrize("dim", [24, 96, 160, 4104])
def test_against_fp64_reference(n, dim):
    check_all(*make(n, dim, CUDA, seed=n + dim), eps=1e-20, backend="cutedsl")


@gpu
@pytest.mark.parametrize("eps", [1e-20, 1e-6, 0.03])
def test_eps(eps):
    check_all(*make(9, 96, CUDA, seed=1), eps=eps, backend="cutedsl")


@gpu
def test_scores_around_the_clamp():
    """Zero scores, scores below the clamp of both signs and above it (as the Triton test)."""
    x, kv, weight, _, dout = make(17, 96, CUDA, seed=2, weight_scale=[0.0, 1e-9, -1e-9, 1.0])
    mask = torch.ones(17, dtype=torch.bool, device=CUDA)
    _, saved, _ = check_all(x, kv, weight, mask, dout, eps=1e-20, backend="cutedsl")
    dot, gate = saved[..., 1], saved[..., 0]
    assert (dot[:, 0] == 0).all()
    root = torch.tensor(1e-6).sqrt()
    assert torch.allclose(gate[:, 0], torch.sigmoid(root).to(CUDA)), "copysign(+0) gives sigmoid(+sqrt(clamp))"
    below = dot[:, 1:3]
    assert (below.abs() < 1e-6).all() and (below > 0).any() and (below < 0).any()
    assert torch.allclose(gate[:, 1:3], torch.sigmoid(torch.where(below > 0, root, -root)))


@gpu
@pytest.mark.parametrize("dim", [96, D])
def test_masks_and_bitwise_reproducible(dim):
    """No token gated: out is x and dx is dout bit for bit, zero key/value/weight gradients; then
    mixed masks, three forward + backward runs bitwise equal (dweight included)."""
    n = 300 if dim == D else 11
    x, kv, weight, _, dout = make(n, dim, CUDA, seed=3)
    none = torch.zeros(n, dtype=torch.bool, device=CUDA)
    out, saved = engram_gate_forward(x, kv, weight, none, eps=1e-20, backend="cutedsl")
    assert_bitwise(out, x, "no token gated")
    dx, dkv, dweight = engram_gate_backward(dout, x, kv, weight, none, saved, eps=1e-20, backend="cutedsl")
    assert_bitwise(dx, dout, "dx")
    assert (dkv == 0).all() and (dweight == 0).all()
    x, kv, weight, mask, dout = make(n, dim, CUDA, seed=4)
    runs = []
    for _ in range(3):
        out, saved = engram_gate_forward(x, kv, weight, mask, eps=1e-20, backend="cutedsl")
        runs.append((out, saved, *engram_gate_backward(dout, x, kv, weight, mask, saved, eps=1e-20,
                                                        backend="cutedsl")))
    for again in runs[1:]:
        for a, b, name in zip(again, runs[0], ("out", "saved", "dx", "dkv", "dweight")):
            assert_bitwise(a, b, f"repeat {name}")


@gpu
@pytest.mark.parametrize("forward_backend, backward_backend", [("triton", "cutedsl"), ("cutedsl", "triton")])
def test_saved_state_is_interchangeable(forward_backend, backward_backend):
    """Either backend's backward from the other's saved state, against the float64 formula from that state."""
    x, kv, weight, mask, dout = make(65, D, CUDA, seed=21)
    _, saved = engram_gate_forward(x, kv, weight, mask, eps=1e-20, backend=forward_backend)
    dx, dkv, dweight = engram_gate_backward(dout, x, kv, weight, mask, saved, eps=1e-20, backend=backward_backend)
    fx, fkv, fw = engram_gate_backward_from_saved(dout, x, kv, weight, saved)
    assert_rounded_from(dx, fx, "dx")
    assert_rounded_from(dkv, fkv, "dkv")
    assert_close_fp32(dweight, fw, "dweight")


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_other_dtypes(dtype):
    """fp16 and fp32 rows from the same saved state; the fp32 gate terms alone (as the Triton test)."""
    x, kv, weight, mask, dout = make(33, 160, CUDA, seed=9)
    x, kv, dout = x.to(dtype), kv.to(dtype), dout.to(dtype)
    out, saved = engram_gate_forward(x, kv, weight, mask, eps=1e-20, backend="cutedsl")
    assert_bitwise(out[~mask], x[~mask], "masked tokens keep x")
    dx, dkv, dweight = engram_gate_backward(dout, x, kv, weight, mask, saved, eps=1e-20, backend="cutedsl")
    fx, fkv, fw = engram_gate_backward_from_saved(dout, x, kv, weight, saved)
    if dtype == torch.float32:
        assert_close_fp32(dx - dout, fx - dout.double(), "dx - dout")
        assert_close_fp32(dkv, fkv, "dkv")
    else:
        assert_rounded_from(dx, fx, "dx")
        assert_rounded_from(dkv, fkv, "dkv")
    assert_close_fp32(dweight, fw, "dweight")


@gpu
def test_caller_owned_outputs_autograd_compile_and_stream():
    """Caller-owned outputs and workspace, autograd and torch.compile(fullgraph=True) through the
    declared CuTe DSL ops, an explicit stream: all bitwise equal to the functional calls."""
    n, dim = 7, 96
    x, kv, weight, mask, dout = make(n, dim, CUDA, seed=5)
    out, saved = torch.empty_like(x), torch.empty(n, 4, 4, device=CUDA)
    dx, dkv, dweight = torch.empty_like(x), torch.empty_like(kv), torch.empty(4, dim, device=CUDA)
    workspace = torch.empty(eg.workspace_elements(n, 4, dim), device=CUDA)
    got = engram_gate_forward(x, kv, weight, mask, eps=1e-20, out=out, saved=saved, backend="cutedsl")
    assert got[0] is out and got[1] is saved
    grads = engram_gate_backward(dout, x, kv, weight, mask, saved, eps=1e-20, dx=dx, dkv=dkv, dweight=dweight,
                                 workspace=workspace, backend="cutedsl")
    assert grads[0] is dx and grads[1] is dkv and grads[2] is dweight
    with pytest.raises(ValueError, match="workspace: expected"):
        engram_gate_backward(dout, x, kv, weight, mask, saved, eps=1e-20, backend="cutedsl",
                             workspace=torch.empty(eg.workspace_elements(n, 4, dim) - 1, device=CUDA))
    leaves = [t.clone().requires_grad_() for t in (x, kv, weight)]
    y = engram_gate(*leaves, mask, eps=1e-20, backend="cutedsl")
    assert_bitwise(y, out, "autograd out")
    for a, b, name in zip(torch.autograd.grad(y, leaves, dout), (dx, dkv, dweight), ("dx", "dkv", "dweight")):
        assert_bitwise(a, b, f"autograd {name}")
    f = torch.compile(lambda *a: engram_gate(*a, mask, eps=1e-20, backend="cutedsl"), fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (x, kv, weight)]
    y = f(*leaves)
    assert_bitwise(y, out, "compiled out")
    for a, b, name in zip(torch.autograd.grad(y, leaves, dout), (dx, dkv, dweight), ("dx", "dkv", "dweight")):
        assert_bitwise(a, b, f"compiled {name}")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    out2, saved2 = engram_gate_forward(x, kv, weight, mask, eps=1e-20, backend="cutedsl", stream=stream)
    grads2 = engram_gate_backward(dout, x, kv, weight, mask, saved2, eps=1e-20, backend="cutedsl", stream=stream)
    torch.cuda.current_stream().wait_stream(stream)
    for a, b, name in zip((out2, saved2, *grads2), (out, saved, dx, dkv, dweight),
                          ("out", "saved", "dx", "dkv", "dweight")):
        assert_bitwise(a, b, f"stream {name}")
    # rows that are not 128-bit aligned: refused by name, never a launch on them
    wide = torch.empty(n, 4 * dim + 4, dtype=x.dtype, device=CUDA)[:, : 4 * dim].view(n, 4, dim)
    with pytest.raises(ValueError, match="x: row stride"):
        engram_gate_forward(wide.copy_(x), kv, weight, mask, eps=1e-20, backend="cutedsl")


def _plan_buffers(n, dim=D):
    x, kv, weight, mask, dout = make(n, dim, CUDA, seed=11)
    bufs = dict(out=torch.empty_like(x), saved=torch.empty(n, 4, 4, device=CUDA), dx=torch.empty_like(x),
                dkv=torch.empty_like(kv), dweight=torch.empty(4, dim, device=CUDA))
    return (x, kv, weight, mask, dout), bufs


@gpu
def test_plan_matches_functional_and_allocates_compiles_syncs_nothing():
    n = 1000
    compiles = eg.CACHE.compiles
    plan = EngramGatePlan(dim=D, max_tokens=4096, device=CUDA, eps=1e-20, backend="cutedsl")
    assert eg.CACHE.compiles <= compiles + 3  # forward, backward, dWeight sum (fewer when cached)
    (x, kv, weight, mask, dout), b = _plan_buffers(n)
    compiled = eg.CACHE.compiles
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        stream = torch.cuda.Stream()
        plan.forward(x, kv, weight, mask, b["out"], b["saved"], stream=stream)
        plan.backward(dout, x, kv, weight, mask, b["saved"], b["dx"], b["dkv"], b["dweight"], stream=stream)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before, "execute allocated memory"
    assert eg.CACHE.compiles == compiled, "execute compiled a kernel"
    out, saved = engram_gate_forward(x, kv, weight, mask, eps=1e-20, backend="cutedsl")
    grads = engram_gate_backward(dout, x, kv, weight, mask, saved, eps=1e-20, backend="cutedsl")
    for (name, got), want in zip(b.items(), (out, saved, *grads)):
        assert_bitwise(got, want, f"plan {name}")
    check_all(x, kv, weight, mask, dout, eps=1e-20, backend="cutedsl")


@gpu
def test_plan_refuses_unaligned_rows_and_other_devices():
    plan = EngramGatePlan(dim=64, max_tokens=8, device=CUDA, eps=1e-20, backend="cutedsl")
    x, kv, weight, mask, _ = make(4, 64, "cpu", seed=14)
    with pytest.raises(ValueError, match="expected device cuda"):
        plan.forward(x, kv, weight, mask, torch.empty_like(x), torch.empty(4, 4, 4))
    x, kv, weight, mask, _ = make(4, 64, CUDA, seed=14)
    kv_wide = torch.empty(4, 5 * 64 + 4, dtype=kv.dtype, device=CUDA)[:, : 5 * 64]
    kv_wide.copy_(kv)
    with pytest.raises(ValueError, match="kv: row stride"):
        plan.forward(x, kv_wide, weight, mask, torch.empty_like(x), torch.empty(4, 4, 4, device=CUDA))
