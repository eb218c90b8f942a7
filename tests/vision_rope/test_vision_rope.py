"""Vision RoPE: fused backward (native layouts -> packed dQKV) and fused forward against the model.

On CUDA every comparison is bitwise. On CPU (Triton interpreter) fp32 is bitwise
too (the contract has no FMA: every product and sum rounds separately), while bf16
stores truncate instead of rounding, so bf16 results are within one bf16 ulp.

Sizes: T = 1, 7, 77 and 130 cover single-token, sub-block and multi-block tails
of the 64-token program; (H, D) = (16, 64) is the model, (3, 8) and (5, 32) other
head counts and widths.

Every contract test takes the ``backend`` fixture (``tests/conftest.py``): each fused backend the
op registers that serves the call (the CuTe DSL backend has the backward alone), on the CPU
(Triton's interpreter) and on CUDA. What only one backend has (its launch constants, the head dims
its kernels refuse, its code generation) is tested per backend.
"""

import pytest
import torch
from conftest import DEVICES
from helpers import assert_bitwise, assert_within_ulp

from dsfuse.models.vision_geometry import largest_grid, llm_tokens, patch_grid
from dsfuse.vision_rope import (
    attention,
    attention_front,
    vision_cos_sin,
    vision_rope_attention_front,
    vision_rope_backward,
    vision_rope_backward_autograd,
    vision_rope_backward_reference,
    vision_rope_forward,
)
from dsfuse._common.backends import BACKENDS as BACKEND_KINDS
from dsfuse.vision_rope import api as vr_api

SHAPES = [(16, 1, 64), (16, 7, 64), (16, 77, 64), (3, 130, 8), (5, 33, 32)]  # (H, T, D)


def grads(heads, tokens, dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen).to(dtype).to(device)

    n_w = 10 if tokens % 10 == 0 else 1  # a 2D grid where T allows, so row and column angles both vary
    cos, sin = vision_cos_sin(tokens // n_w, n_w, dim // 2, device=device)
    return randn(heads, tokens, dim), randn(heads, dim, tokens), randn(heads, tokens, dim), cos, sin


def assert_equal_contract(got, want, what):
    if got.is_cuda or got.dtype == torch.float32:
        assert_bitwise(got, want, what)
    else:
        assert_within_ulp(got, want, 1, what)


def check_backward(args, what, backend):
    """``vision_rope_backward`` on ``backend``, allocating (NaN-poisoned by the conftest) and into a
    NaN-filled caller buffer (with ``[T, 1, D/2]`` tables), both equal to eager autograd (bitwise on
    CUDA); returns eager autograd's result."""
    want = vision_rope_backward_autograd(*args)
    got = vision_rope_backward(*args, backend=backend)
    assert got.shape == want.shape and got.is_contiguous()
    assert_equal_contract(got, want, f"{what} allocating")
    out = torch.full_like(want, float("nan"))
    dq, dk_hdt, dv, cos, sin = args
    assert vision_rope_backward(dq, dk_hdt, dv, cos[:, None], sin[:, None], out=out, backend=backend) is out
    assert_equal_contract(out, want, f"{what} out=")
    return want


@pytest.mark.serves("backward")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}_T{}_D{}".format(*s))
def test_backward_matches_eager_autograd(shape, dtype, device, backend):
    args = grads(*shape, dtype, device)
    want = check_backward(args, f"{shape} {dtype}", backend)
    assert want.shape == (shape[1], 3 * shape[0] * shape[2])
    assert_bitwise(vision_rope_backward_reference(*args), want, "formula == autograd")


@pytest.mark.serves("backward")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_without_dv_the_v_columns_are_zero(dtype, device, backend):
    """dv=None (the differentiable forward's gradient of q and k alone): +0.0 in the v columns (the
    model's heads on CUDA, fewer in the interpreter)."""
    heads, tokens, dim = (16, 77, 64) if device == "cuda" else (4, 77, 16)
    dq, dk_hdt, dv, cos, sin = grads(heads, tokens, dim, dtype, device, seed=5)
    got = vr_api.backward_ops[backend](dq, dk_hdt.transpose(1, 2), None, cos, sin)
    want = vision_rope_backward_autograd(dq, dk_hdt, torch.zeros_like(dv), cos, sin)
    assert_equal_contract(got, want, "no dV")
    assert (got[:, 2 * heads * dim:].view(torch.int16 if dtype != torch.float32 else torch.int32) == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_t", [16, 32, 128])
@pytest.mark.parametrize("shape", [(16, 77, 64), (3, 130, 8), (6, 33, 32)], ids=lambda s: "H{}_T{}_D{}".format(*s))
def test_launch_constants(shape, block_t, device, monkeypatch):
    """The Triton kernels' tokens-per-program: every setting gives the same bits, backward and forward."""
    from dsfuse.vision_rope.triton import kernels as vr_triton

    monkeypatch.setattr(vr_triton, "TOKENS_PER_PROGRAM", block_t)
    dq, dk_hdt, dv, cos, sin = grads(*shape, torch.float32, device, seed=3)
    got = vision_rope_backward(dq, dk_hdt, dv, cos, sin, backend="triton")
    assert_bitwise(got, vision_rope_backward_autograd(dq, dk_hdt, dv, cos, sin), f"block_t={block_t}")
    qkv = torch.cat([g.transpose(0, 1).flatten(1) for g in (dq, dk_hdt.transpose(1, 2), dv)], 1)
    heads = shape[0]
    want = attention_front(qkv, cos, sin, heads)
    got = vision_rope_forward(qkv, cos, sin, heads, backend="triton")
    for g, w, name in zip(got, want, ("q", "k", "v")):
        assert_bitwise(g, w, f"forward {name}, block_t={block_t}")


@pytest.mark.serves("forward")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}_T{}_D{}".format(*s))
def test_forward_and_autograd_front(shape, dtype, device, backend):
    heads, tokens, dim = shape
    _, _, _, cos, sin = grads(*shape, dtype, device)
    qkv = torch.randn(tokens, 3 * heads * dim, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    fused = vision_rope_forward(qkv, cos, sin, heads, backend=backend)
    model = attention_front(qkv, cos, sin, heads)
    for got, want, name in zip(fused, model, "qkv"):
        assert got.stride() == want.stride(), (name, got.stride(), want.stride())  # what SDPA sees
        assert_equal_contract(got, want, f"forward {name}")
    assert fused[2].data_ptr() == model[2].data_ptr()  # v stays a view of qkv
    leaf = qkv.clone().requires_grad_()
    outs = vision_rope_attention_front(leaf, cos, sin, heads, backend=backend)
    g = (torch.randn_like(model[0]), torch.randn(heads, dim, tokens, dtype=dtype, device=device).transpose(1, 2),
         torch.randn_like(model[2]))
    (got,) = torch.autograd.grad(outs, leaf, g)
    ref_leaf = qkv.clone().requires_grad_()
    (want,) = torch.autograd.grad(attention_front(ref_leaf, cos, sin, heads), ref_leaf, g)
    assert_equal_contract(got, want, "autograd through the fused front end")


@pytest.mark.serves("forward")
def test_attention_gradients_through_sdpa(device, backend):
    """The whole attention core (front end + 3D math SDPA): the fused front end changes no bit (fp32)."""
    heads, tokens, dim = 4, 45, 16
    cos, sin = vision_cos_sin(5, 9, dim // 2, device=device)
    qkv = torch.randn(tokens, 3 * heads * dim, device=device)
    grad_o = torch.randn(heads, tokens, dim, device=device)
    a = qkv.clone().requires_grad_()
    q, k, v = vision_rope_attention_front(a, cos, sin, heads, backend=backend)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    (got,) = torch.autograd.grad(o, a, grad_o)
    b = qkv.clone().requires_grad_()
    (want,) = torch.autograd.grad(attention(b, cos, sin, heads), b, grad_o)
    assert_bitwise(got, want, "dqkv through SDPA")


def test_geometries_from_the_image_processor():
    """The six geometries of the model's image processor, and the budget limits."""
    sizes = {(300, 300): (39, 39), (490, 644): (35, 46), (770, 1036): (55, 74), (1036, 1036): (74, 74),
             (966, 1708): (69, 122), (1302, 1302): (93, 93), (4000, 4000): (93, 93)}
    for image, grid in sizes.items():
        assert patch_grid(*image) == grid, image
        assert llm_tokens(*grid) <= 1024
    assert llm_tokens(94, 94) > 1024  # 93 x 93 is the largest square
    n_h, n_w = largest_grid()
    assert llm_tokens(n_h, n_w) <= 1024 and n_h * n_w == 9189
    with pytest.raises(ValueError, match="image: expected positive sides"):
        patch_grid(0, 10)


def _bad_calls(device="cpu"):
    h, t, d = 4, 9, 8

    def randn(*shape):
        return torch.randn(*shape, device=device).bfloat16()

    def base():
        return [randn(h, t, d), randn(h, d, t), randn(h, t, d), *vision_cos_sin(t, 1, d // 2, device=device)]

    def call(mutate, **kw):
        def run(backend):
            args = base()
            mutate(args)
            return vision_rope_backward(*args, **({"backend": backend} | kw))
        return run

    def set_(i, value):
        return lambda a: a.__setitem__(i, value(a) if callable(value) else value)

    def overlapping_out(backend):
        storage = randn(3 * h * t * d)
        return vision_rope_backward(storage[: h * t * d].view(h, t, d), randn(h, d, t), randn(h, t, d),
                                    *vision_cos_sin(t, 1, d // 2, device=device), out=storage.view(t, 3 * h * d),
                                    backend=backend)

    return {
        "dq not a tensor": (call(set_(0, 1.0)), TypeError, "dq_htd: expected a torch.Tensor"),
        "dq 2D": (call(set_(0, lambda a: a[0][0])), ValueError, "dq_htd: expected 3 dims"),
        "odd head dim": (call(set_(0, lambda a: randn(h, t, d - 1))), ValueError, "even head dim"),
        "dk in HTD shape": (call(set_(1, lambda a: a[1].transpose(1, 2))), ValueError,
                            r"dk_hdt: expected shape \[H, D, T\]"),
        "dk transposed view": (call(set_(1, lambda a: randn(h, t, d).transpose(1, 2))), ValueError,
                               r"dk_hdt: expected contiguous \[H, D, T\] storage"),
        "dq non-contiguous": (call(set_(0, lambda a: randn(t, h, d).transpose(0, 1))), ValueError,
                              r"dq_htd: expected contiguous \[H, T, D\] storage"),
        "dv wrong shape": (call(set_(2, lambda a: randn(h, t + 1, d))), ValueError,
                           r"dv_htd: expected shape \[H, T, D\]"),
        "dtype mismatch": (call(set_(2, lambda a: a[2].float())), TypeError, "dv_htd: expected dtype bfloat16 \\(that of dq_htd\\)"),
        "cos fp64": (call(set_(3, lambda a: a[3].double())), TypeError, r"cos: expected dtype in \(float32\)"),
        "cos wrong tokens": (call(set_(3, lambda a: a[3][:-1])), ValueError, r"cos: expected shape \[9, 4\]"),
        "misaligned dq": (call(set_(0, lambda a: randn(h * t * d + 1)[1:].view(h, t, d))), ValueError,
                          "dq_htd: expected a 16-byte aligned data pointer"),
        "out wrong shape": (call(lambda a: None, out=torch.empty(t, 3 * h * d - 1, device=device).bfloat16()),
                            ValueError, r"out: expected a bfloat16 tensor of shape \[9, 96\]"),
        "out overlaps dq": (overlapping_out, ValueError, "out: must not overlap dq_htd"),
        "bad backend": (call(lambda a: None, backend="cuda"), ValueError, "backend: expected one of"),
    }


@pytest.mark.refusals
@pytest.mark.parametrize("name", sorted(_bad_calls()))
def test_bad_arguments_raise(name, device, backend):
    """Every bad argument of the backward, refused alike by auto, each fused backend and the reference."""
    call, exc, match = _bad_calls(device)[name]
    with pytest.raises(exc, match=match):
        call(backend)


@pytest.mark.serves("forward")
def test_front_end_errors(backend):
    cos, sin = vision_cos_sin(3, 3, 4)
    with pytest.raises(ValueError, match="qkv: expected \\[T, 3 \\* heads \\* D\\]"):
        vision_rope_attention_front(torch.randn(9, 50), cos, sin, 2)
    with pytest.raises(TypeError, match="heads: expected a positive int"):
        vision_rope_attention_front(torch.randn(9, 48), cos, sin, 0)
    with pytest.raises(ValueError, match="qkv: expected unit channel stride"):
        vision_rope_attention_front(torch.randn(48, 9).t(), cos, sin, 2)
    with pytest.raises(ValueError, match="cos/sin require grad"):
        vision_rope_attention_front(torch.randn(9, 48), cos.requires_grad_(), sin, 2, backend=backend)


def test_head_dims_the_triton_kernels_refuse(monkeypatch):
    """D / 2 not a power of two (D = 12): ``backend="triton"`` says so; ``auto`` on a GPU takes the
    reference instead (the contract's formula), never a kernel that cannot compile."""
    cos, sin = vision_cos_sin(3, 3, 6)
    dq, dv = torch.randn(2, 9, 12), torch.randn(2, 9, 12)
    dk_hdt = torch.randn(2, 12, 9)
    with pytest.raises(ValueError, match=r"backend='triton' cannot serve .*D / 2 = 6 is not a power of two"):
        vision_rope_backward(dq, dk_hdt, dv, cos, sin, backend="triton")
    with pytest.raises(ValueError, match=r"backend='triton' cannot serve .*D / 2 = 6 is not a power of two"):
        vision_rope_attention_front(torch.randn(9, 72), cos, sin, 2, backend="triton")
    asked = []  # the call and arguments each public function hands to the registry
    entry = vr_api.BACKENDS
    choose = type(entry).choose  # a frozen dataclass: the method is patched on the class
    monkeypatch.setattr(type(entry), "choose", lambda self, *a, **k: asked.append(k) or choose(self, *a, **k))
    vision_rope_backward(dq, dk_hdt, dv, cos, sin)
    vision_rope_attention_front(torch.randn(9, 72), cos, sin, 2)
    assert [k["call"] for k in asked] == ["backward", "forward"]
    for k in asked:  # every backend with a kernel for the call refuses D = 12 by its own reasons
        assert all(entry.own_reasons(name, k["call"], k["args"], auto=True) for name in entry.serving(k["call"]))
    dq16, dk16, dv16 = torch.randn(2, 9, 16), torch.randn(2, 16, 9), torch.randn(2, 9, 16)
    c16, s16 = vision_cos_sin(3, 3, 8)
    vision_rope_backward(dq16, dk16, dv16, c16, s16)
    assert entry.own_reasons("triton", "backward", asked[-1]["args"]) == []
    monkeypatch.undo()
    monkeypatch.setattr("dsfuse._common.backends._FAMILIES", {0: "sm_90"})
    cuda = torch.device("cuda", 0)
    args12 = (dq, dk_hdt.transpose(1, 2), dv, cos, sin)
    assert entry.choose("auto", cuda, torch.float32, call="backward", args=args12) == "reference"
    args16 = (dq16, dk16.transpose(1, 2), dv16, c16, s16)
    served = [name for name in entry.auto_order(cuda) if BACKEND_KINDS[name].installed]  # the extra may be left out
    assert entry.choose("auto", cuda, torch.float32, call="backward", args=args16) == served[0]
    assert entry.choose("auto", cuda, torch.float32, call="forward", args=(torch.randn(9, 96), c16, s16, 2)) == "triton"


@pytest.mark.serves("forward")
def test_torch_compile_fullgraph_front(device, backend):
    heads, tokens, dim = 2, 15, 8
    cos, sin = vision_cos_sin(3, 5, dim // 2, device=device)
    qkv = torch.randn(tokens, 3 * heads * dim, device=device)
    compiler = "inductor" if device == "cuda" else "aot_eager"

    def f(x):  # the front end alone: Inductor compiles SDPA differently from eager, not our op
        q, k, v = vision_rope_attention_front(x, cos, sin, heads, backend=backend)
        return q * 1.0, k * 1.0, v * 1.0

    a, b = qkv.clone().requires_grad_(), qkv.clone().requires_grad_()
    outs = torch.compile(f, fullgraph=True, backend=compiler)(a)
    refs = f(b)
    for got, want, name in zip(outs, refs, "qkv"):
        assert_bitwise(got, want, f"compiled forward {name}")
    g = tuple(torch.randn_like(r) for r in refs)
    assert_bitwise(torch.autograd.grad(outs, a, g)[0], torch.autograd.grad(refs, b, g)[0], "compiled backward")


@pytest.mark.serves("backward")
def test_torch_compile_fullgraph_backward(device, backend):
    """The backward op traces as its backend's own custom op; compiled and eager give the same bits,
    allocating and into the caller's ``out=``."""
    compiler = "inductor" if device == "cuda" else "aot_eager"
    heads, tokens, dim = 2, 15, 8
    cases = {"fp32 H2_T15_D8": (torch.randn(heads, tokens, dim, device=device),
                                torch.randn(heads, dim, tokens, device=device),
                                torch.randn(heads, tokens, dim, device=device),
                                *vision_cos_sin(3, 5, dim // 2, device=device))}
    if device == "cuda":  # and the model's heads and layouts in bf16
        from test_vision_rope_gpu import model_grads

        cases["bf16 model 7x11"] = model_grads(7, 11, 8)
    for what, args in cases.items():
        eager = vision_rope_backward(*args, backend=backend)
        fn = torch.compile(lambda *x: vision_rope_backward(*x, backend=backend), fullgraph=True, backend=compiler)
        assert_bitwise(fn(*args), eager, f"{what}: compiled")
        out = torch.empty_like(eager)
        into = torch.compile(lambda *x, out=out: vision_rope_backward(*x, out=out, backend=backend), fullgraph=True,
                             backend=compiler)
        into(*args)
        assert_bitwise(out, eager, f"{what}: compiled, out=")


@pytest.mark.parametrize("device", DEVICES)
def test_small_tower_rope_swap(device):
    """A 2-block tower of small width: swapping in the fused front end changes no output or gradient."""
    from dsfuse.models.vision_tower import TowerConfig, VisionTower, synthetic_weights

    cfg = TowerConfig(layers=2, hidden=64, heads=4, mlp=96, llm_hidden=80)
    weights = {k: v.float().to(device) for k, v in synthetic_weights(cfg).items()}  # fp32: exact on CPU too
    model = VisionTower(weights, cfg)
    patches = torch.randn(5 * 7, 588, device=device)
    results = {}
    for rope in ("eager", "dsfuse"):
        x = patches.clone().requires_grad_()
        out, hidden = model(x, 5, 7, rope=rope)
        grads = torch.autograd.grad(out, [x, *model.params], torch.ones_like(out))
        results[rope] = [out, *hidden, *grads]
    assert len(results["eager"]) == 1 + 2 + 1 + len(list(model.params))
    for i, (a, b) in enumerate(zip(results["eager"], results["dsfuse"])):
        assert_bitwise(b, a, f"tensor {i}")
