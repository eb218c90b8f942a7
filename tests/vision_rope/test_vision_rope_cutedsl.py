"""Vision RoPE backward, CuTe DSL backend (``dsfuse.vision_rope.cutedsl``).

CPU (no GPU, no CuTe DSL interpreter): the kernel compiles for sm_90a and sm_100a in every dtype
the backend offers, with and without dV, at the model's 16 heads x 64, and its PTX says what the
design promises: the target; the rotation as ``mul.rn``/``add.rn``/``sub.rn`` (explicit rounding,
so nothing can be contracted into an FMA: the bitwise contract) and one ``cvt.rn`` to the output
dtype; every global read a 16-byte ``cp.async`` (dK included: the transpose happens in shared
memory), every global write a 128-bit store; the compile cache does not grow with T; the backend's
refusals name their reason.

GPU (``@pytest.mark.gpu``, the H200): what only this backend has: every tile and heads-per-CTA
setting gives the same bits; T = 1 compiles nothing; its refusals on CUDA; ``auto`` takes it on
Hopper where it serves. Every contract check runs on this backend through the ``backend`` fixture
(``tests/conftest.py``): ``test_vision_rope.py`` (bitwise equality with eager autograd for every
dtype on its shapes, NaN-poisoned outputs, the caller's ``out=``, ``dv=None``,
``torch.compile(fullgraph=True)``) and ``test_vision_rope_gpu.py`` (the model geometries, CUDA Graph
replay with changed inputs, no compile for a new T, explicit streams, determinism).
"""

import re
from collections import Counter

import pytest
import torch
from conftest import cutedsl_kernels
from helpers import assert_bitwise
from test_vision_rope import check_backward, grads
from test_vision_rope_gpu import model_grads

from dsfuse._common.backends import BACKENDS as BACKEND_KINDS
from dsfuse._common.backends import gpu_family
from dsfuse.vision_rope import (
    vision_cos_sin,
    vision_rope_backward,
    vision_rope_backward_autograd,
    vision_rope_forward,
)
from dsfuse.vision_rope import api as vr_api

vc, ARCHS, DTYPES = cutedsl_kernels("vision_rope")  # ARCHS: sm_90a, sm_100a; DTYPES: bf16, fp16, fp32
H, D = 16, 64  # DeepSeek-V4.1 vision tower


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- CPU: compile for both targets and read the PTX -------------------------------------------


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    """PTX per (dtype, has dV, arch) at the model's shape."""
    dump = str(tmp_path_factory.mktemp("ptx"))
    return {(dtype, has_v, arch): vc.compile_backward(dtype, H, D, has_v, arch, keep_ptx=True, dump_dir=dump).__ptx__
            for arch in ARCHS for dtype in DTYPES for has_v in (True, False)}


def _ops(text: str) -> Counter:
    return Counter(re.findall(r"\b((?:ld|st|cp|atom|red|fma|mul|add|sub|cvt|bar)\.[\w.]+)", text))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("has_v", [True, False], ids=["dv", "no_dv"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_ptx_rounding_is_the_contract(ptx, dtype, has_v, arch):
    """No FMA anywhere; every fp32 product and sum carries an explicit .rn (PTX never contracts those),
    two products per sum; one round-to-nearest-even conversion to a 16-bit output dtype."""
    text = ptx[dtype, has_v, arch]
    assert re.search(r"\.target (\w+)", text).group(1) == arch
    ops = _ops(text)
    assert not [op for op in ops if op.startswith("fma")], ops
    plain = [op for op in ops if re.fullmatch(r"(mul|add|sub)(\.ftz)?\.f32", op)]
    assert not plain, f"uncontracted-but-contractible fp32 arithmetic: {plain}"
    assert ops["add.rn.f32"] == ops["sub.rn.f32"] > 0, ops
    assert ops["mul.rn.f32"] == 2 * (ops["add.rn.f32"] + ops["sub.rn.f32"]), ops
    narrow = {torch.bfloat16: "cvt.rn.bf16x2.f32", torch.float16: "cvt.rn.f16x2.f32"}.get(dtype)
    conversions = {op for op in ops if op.startswith("cvt.") and ".f32" in op and op.split(".")[-2] != "f32"}
    assert conversions == ({narrow} if narrow else set()), conversions


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("has_v", [True, False], ids=["dv", "no_dv"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_ptx_moves_16_bytes_per_access(ptx, dtype, has_v, arch):
    """Reads: only 16-byte cp.async copies (L2-only, .cg) into shared memory, one commit/wait and a
    barrier; writes: only 128-bit stores; no atomics. dK is gathered from shared memory."""
    text = ptx[dtype, has_v, arch]
    ops = _ops(text)
    assert not [op for op in ops if op.startswith("ld.global")], ops
    stores = {op: n for op, n in ops.items() if op.startswith("st.global")}
    assert stores and all(re.search(r"\.v4\.b32|\.v2\.b64", op) for op in stores), stores
    copies = re.findall(r"cp\.async\.(\w+)\.shared\.global(?:\.\w+)* \[[^\]]+\], \[[^\]]+\], (\d+)", text)
    assert copies and set(copies) == {("cg", "16")}, Counter(copies)
    assert ops["cp.async.commit_group"] and ops["cp.async.wait_group"] and ops["bar.sync"], ops
    assert not [op for op in ops if op.startswith(("atom.", "red."))], ops
    geo = vc.geometry(dtype, H, D)
    items = geo.tile_t * geo.chunks // 32  # tokens x vectors per lane in the rotation
    # two vectors per rotated item (q and k share the tail of the code, or not) and the v copy's
    stored = ops["st.global.v4.b32"] + ops["st.global.v2.b64"]
    assert stored in (2 * items + 2 * items, 2 * 2 * items + 2 * items), stores
    # dK: one shared load per element (the transpose), 2 * VEC per rotated pair of vectors
    gathered = ops["ld.shared.b16"] + ops["ld.shared.b32"]
    assert gathered == 2 * geo.vec * items, ops


def test_model_geometry():
    """16 x 64 bf16: 8-channel vectors, 4 lanes per half row, 32-token tiles (64 bytes of a dK row),
    2 heads (6 warps) per CTA staging 36 KB: tables 2 x 32 rows x 36 floats, per head dQ 32 x 72,
    dK 64 x 40, dV 32 x 64 elements (six CTAs per multiprocessor); fp32 the same with 16-token tiles."""
    geo = vc.geometry(torch.bfloat16, H, D)
    assert geo == vc.Geometry(vec=8, chunks=4, tile_t=32, group=2, dim=64)
    assert geo.smem_bytes(2, True) == 2 * 32 * 36 * 4 + 2 * (32 * 72 + 64 * 40 + 32 * 64) * 2 == 36864
    assert 6 * (geo.smem_bytes(2, True) + 1024) <= 228 * 1024
    assert vc.geometry(torch.float32, H, D) == vc.Geometry(vec=4, chunks=8, tile_t=16, group=2, dim=64)
    assert vc.geometry(torch.bfloat16, 3, 8) == vc.Geometry(vec=4, chunks=1, tile_t=32, group=1, dim=8)
    assert vc.geometry(torch.bfloat16, 16, 64, heads_per_cta=4, tile_tokens=32).group == 4
    assert vc.shape_reasons(torch.bfloat16, H, D) == []


@pytest.mark.parametrize("dtype", vc.FUSED_DTYPES, ids=_name)
def test_default_geometry_for_every_accepted_shape(dtype):
    """Every head dim the kernel accepts gets a default tile of whole warps (a tile of ``TILE_BYTES``
    holds 16 fp32 tokens, fewer than one warp's 32 / NC rows when D / 2 is one vector)."""
    accepted = [dim for dim in range(8, 520, 8) if not vc.shape_reasons(dtype, 6, dim)]
    assert 8 in accepted and 64 in accepted
    for dim in accepted:
        geo = vc.geometry(dtype, 6, dim)
        assert geo.tile_t % geo.vec == 0 and geo.tile_t * geo.chunks % 32 == 0, (dim, geo)
        assert geo.tile_t >= vc.TILE_BYTES // dtype.itemsize


def test_registration_and_auto(monkeypatch):
    """Registered with its kernel module and dtypes; ``auto`` takes it first on Hopper (measured there),
    Triton on Blackwell (not measured), and Triton where the kernel does not compile for the call."""
    entry = vr_api.BACKENDS
    assert entry.kernels["cutedsl"] == ("dsfuse.vision_rope.cutedsl.kernels",)
    assert tuple(entry.dtypes["cutedsl"]) == vc.FUSED_DTYPES
    assert entry.preference == {"sm_90": ("cutedsl", "triton"), "sm_100": ("triton",)}
    monkeypatch.setattr("dsfuse._common.backends._FAMILIES", {0: "sm_90"})
    cuda = torch.device("cuda", 0)
    dq, dk_hdt, dv, cos, sin = grads(16, 33, 64, torch.bfloat16, "cpu", seed=1)
    args = (dq, dk_hdt.transpose(1, 2), dv, cos, sin)
    assert entry.choose("auto", cuda, torch.bfloat16, call="backward", args=args) == "cutedsl"
    dq6, dk6, dv6, cos6, sin6 = grads(2, 33, 12, torch.bfloat16, "cpu", seed=1)  # D = 12: not a multiple of 8
    args = (dq6, dk6.transpose(1, 2), dv6, cos6, sin6)
    assert entry.choose("auto", cuda, torch.bfloat16, call="backward", args=args) == "reference"  # D / 2 = 6 too
    assert [spec.name for spec in vc.AOT_SPECS] == ["vision_rope_bwd_bf16", "vision_rope_bwd_bf16_no_v"]


def _cpu_args(heads, tokens, dim, dtype=torch.bfloat16, seed=0):
    dq, dk_hdt, dv, cos, sin = grads(heads, tokens, dim, dtype, "cpu", seed=seed)
    return dq, dk_hdt.transpose(1, 2), dv, cos, sin, torch.empty(tokens, 3 * heads * dim, dtype=dtype)


def test_a_new_token_count_compiles_nothing(monkeypatch):
    """The cache key holds no T: the launcher on T = 3, 65 and 130 compiles once (and once more
    without dV). CPU tensors: the compiled functions are real, their calls recorded instead of
    launched (no GPU to launch on)."""
    calls = []
    build = vc.compile_backward

    def recording(*args, **kwargs):
        fn = build(*args, **kwargs)
        return lambda *call_args: calls.append((fn, call_args))

    cache = type(vc.CACHE)()
    monkeypatch.setattr(vc, "CACHE", cache)
    monkeypatch.setattr(vc, "_LAUNCH", {})
    monkeypatch.setattr(vc, "_arch", lambda device: "sm_90a")
    monkeypatch.setattr(vc, "compile_backward", recording)
    for tokens in (3, 65, 130):
        dq, dk, dv, cos, sin, out = _cpu_args(H, tokens, D, seed=tokens)
        assert vc.launch_backward(dq, dk, dv, cos, sin, out) is out
        assert cache.compiles == 1, f"T = {tokens} compiled again"
    vc.launch_backward(dq, dk, None, cos, sin, out)
    assert cache.compiles == 2 and len(calls) == 4
    assert len({id(fn) for fn, _ in calls[:3]}) == 1
    args = calls[2][1]
    assert args[1].shape == (H, D, 130) and args[1].is_contiguous(), "dK goes as its [H, D, T] buffer"
    assert args[0].shape == (H, 130, D) and args[5].shape == (130, 3 * H * D)
    assert calls[3][1][2] is None
    dq, dk, dv, cos, sin, out = _cpu_args(H, 0, D)
    assert vc.launch_backward(dq, dk, dv, cos, sin, out) is out and len(calls) == 4  # T = 0: nothing to launch


def test_refusals_name_their_reason():
    dq, dk_hdt, dv, cos, sin = grads(4, 9, 8, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match=r"backend='cutedsl' cannot serve this vision_rope call: tensors are on cpu "
                                         r"\(CuTe DSL needs CUDA\)"):
        vision_rope_backward(dq, dk_hdt, dv, cos, sin, backend="cutedsl")
    kind = BACKEND_KINDS["cutedsl"]  # a frozen dataclass: as if the extra were not installed
    object.__setattr__(kind, "installed", False)
    try:
        with pytest.raises(ValueError, match=r"needs the packages cutlass and tvm_ffi \(pip install 'dsfuse\[cutedsl\]'\)"):
            vision_rope_backward(dq, dk_hdt, dv, cos, sin, backend="cutedsl")
    finally:
        object.__setattr__(kind, "installed", True)
    qkv = torch.randn(9, 3 * 4 * 8)
    with pytest.raises(ValueError, match="the CuTe DSL backend has no forward kernel for vision_rope"):
        vision_rope_forward(qkv, cos, sin, 4, backend="cutedsl")

    assert "not a multiple of 8" in vc.shape_reasons(torch.bfloat16, 2, 12)[0]
    assert "3 vectors per half head row is not a power of two" in vc.shape_reasons(torch.bfloat16, 2, 48)[0]
    assert vc.shape_reasons(torch.float32, 5, 32) == [] and vc.shape_reasons(torch.float32, 3, 8) == []
    assert "not one of" in vc.shape_reasons(torch.float64, 2, 64)[0]
    with pytest.raises(ValueError, match="cannot compile this: head dim D = 12"):
        vc.compile_backward(torch.bfloat16, 2, 12, True, "sm_90a")
    with pytest.raises(ValueError, match="tile_tokens: expected a multiple of 8"):
        vc.geometry(torch.bfloat16, 2, 64, tile_tokens=20)

    dq, dk, dv, cos, sin, out = _cpu_args(4, 9, 64)
    assert vc.layout_reasons(dq, dk.transpose(1, 2), dv, cos, sin, out) == []
    wide = torch.empty(9, 33)
    wide[:, :32] = cos
    reasons = vc.layout_reasons(dq, dk.transpose(1, 2), dv, wide[:, :32], sin, out)
    assert reasons == ["cos rows are not 16-byte aligned fp32 rows (strides (33, 1))"]
    shifted = torch.empty(dq.numel() + 1, dtype=dq.dtype)[1:].view(dq.shape)
    assert "dq_htd data pointer" in vc.layout_reasons(shifted, dk.transpose(1, 2), dv, cos, sin, out)[0]
    assert "dq_htd is not contiguous" in vc.layout_reasons(dq.transpose(0, 1).contiguous().transpose(0, 1),
                                                           dk.transpose(1, 2), dv, cos, sin, out)[0]
    with pytest.raises(ValueError, match="cannot serve this call: cos rows are not 16-byte aligned"):
        vc.launch_backward(dq, dk, dv, wide[:, :32], sin, out)


# -- GPU: what only this backend has ------------------------------------------------------------
# (every contract check runs on this backend from test_vision_rope.py and test_vision_rope_gpu.py)

gpu = pytest.mark.gpu
CUDA = "cuda"


def _check(args, what):
    check_backward(args, what, "cutedsl")


@gpu
def test_one_token_compiles_nothing():
    """T = 1 after other token counts: the token count is symbolic in the compiled kernel (Triton,
    which specialises an argument equal to 1, compiles again there)."""
    _check(model_grads(39, 39, 1), "warm-up")
    compiled = vc.CACHE.compiles
    _check(model_grads(1, 1, 2), "T = 1")
    assert vc.CACHE.compiles == compiled, "T = 1 compiled the kernel again"


@gpu
@pytest.mark.parametrize("heads_per_cta", [1, 2, 4])
@pytest.mark.parametrize("tile_bytes", [64, 128])
@pytest.mark.parametrize("case", [(16, 77, 64, torch.bfloat16), (6, 131, 32, torch.float32),
                                  (3, 130, 8, torch.float16)],
                         ids=lambda c: "H{}_T{}_D{}_{}".format(*c[:3], _name(c[3])))
def test_launch_constants(case, tile_bytes, heads_per_cta, monkeypatch):
    """Every tile width and heads-per-CTA setting gives the same bits (what a sweep may pick)."""
    monkeypatch.setattr(vc, "TILE_BYTES", tile_bytes)
    monkeypatch.setattr(vc, "HEADS_PER_CTA", heads_per_cta)
    heads, tokens, dim, dtype = case
    _check(grads(heads, tokens, dim, dtype, CUDA, seed=3), f"tile {tile_bytes} B, {heads_per_cta} heads")


@gpu
def test_refusals_on_cuda():
    dq, dk_hdt, dv, cos, sin = model_grads(3, 3, 9)
    wide = torch.zeros(9, 33, device=CUDA)
    wide[:, :32] = cos
    with pytest.raises(ValueError, match=r"backend='cutedsl' cannot serve .*cos rows are not 16-byte aligned"):
        vision_rope_backward(dq, dk_hdt, dv, wide[:, :32], sin, backend="cutedsl")
    assert_bitwise(vision_rope_backward(dq, dk_hdt, dv, wide[:, :32], sin, backend="triton"),
                   vision_rope_backward_autograd(dq, dk_hdt, dv, cos, sin), "Triton takes those tables")
    c12, s12 = vision_cos_sin(3, 3, 6, device=CUDA)
    g = [torch.randn(2, 9, 12, device=CUDA).bfloat16(), torch.randn(2, 12, 9, device=CUDA).bfloat16(),
         torch.randn(2, 9, 12, device=CUDA).bfloat16()]
    with pytest.raises(ValueError, match=r"backend='cutedsl' cannot serve .*head dim D = 12"):
        vision_rope_backward(*g, c12, s12, backend="cutedsl")


@gpu
def test_auto_takes_cutedsl_on_hopper_where_it_serves(monkeypatch):
    """``auto`` on the H200 (the extra installed): the CuTe DSL backward for the functional call and for
    the fused front end's backward through 3D math SDPA (the model's layouts), Triton for gradients in
    another storage or a head dim it does not compile for; every path bitwise equal to eager autograd."""
    if gpu_family(torch.device(CUDA)) != "sm_90":
        pytest.skip("the measured order is Hopper's")
    ran = Counter()
    for backend, name in (("triton", "backward_op"), ("cutedsl", "backward_op_cutedsl")):
        op = vr_api.backward_ops[backend]
        monkeypatch.setitem(vr_api.backward_ops, backend, lambda *a, _op=op, _name=name: ran.update([_name]) or _op(*a))
    args = model_grads(39, 39, 11)
    assert_bitwise(vision_rope_backward(*args), vision_rope_backward_autograd(*args), "auto, functional")
    assert ran == {"backward_op_cutedsl": 1}
    heads, tokens, dim = 16, 39 * 39, 64
    cos, sin = args[3], args[4]
    qkv = torch.randn(tokens, 3 * heads * dim, device=CUDA).bfloat16()
    grad_o = torch.randn(heads, tokens, dim, device=CUDA).bfloat16()
    dqkv = {}
    for backend in ("triton", "auto"):
        leaf = qkv.clone().requires_grad_()
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            o = torch.nn.functional.scaled_dot_product_attention(*vr_api.vision_rope_attention_front(
                leaf, cos, sin, heads, backend=backend))
        (dqkv[backend],) = torch.autograd.grad(o, leaf, grad_o)
    assert_bitwise(dqkv["auto"], dqkv["triton"], "auto front through SDPA")
    assert ran == {"backward_op_cutedsl": 2, "backward_op": 1}  # explicit Triton front: Triton's backward
    leaf = qkv.clone().requires_grad_()
    outs = vr_api.vision_rope_attention_front(leaf, cos, sin, heads)
    dk_htd_storage = torch.randn(heads, tokens, dim, device=CUDA).bfloat16()  # dK not in [H, D, T] storage
    g = (torch.randn_like(dk_htd_storage), dk_htd_storage, torch.randn_like(dk_htd_storage))
    (got,) = torch.autograd.grad(outs, leaf, g)
    ref = qkv.clone().requires_grad_()
    (want,) = torch.autograd.grad(vr_api.attention_front(ref, cos, sin, heads), ref, g)
    assert_bitwise(got, want, "auto front, dK in [H, T, D] storage")
    assert ran == {"backward_op_cutedsl": 2, "backward_op": 2}
    c12, s12 = vision_cos_sin(3, 3, 6, device=CUDA)
    g12 = [torch.randn(2, 9, 12, device=CUDA).bfloat16(), torch.randn(2, 12, 9, device=CUDA).bfloat16(),
           torch.randn(2, 9, 12, device=CUDA).bfloat16()]
    assert_bitwise(vision_rope_backward(*g12, c12, s12), vision_rope_backward_autograd(*g12, c12, s12), "D = 12")
    assert ran == {"backward_op_cutedsl": 2, "backward_op": 2}  # neither kernel takes D = 12: the reference
