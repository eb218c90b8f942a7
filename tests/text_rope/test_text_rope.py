"""Text RoPE: fused kernels against the eager model, forward and backward.

On CUDA every comparison is bitwise. On CPU the kernels run in the Triton
interpreter, which evaluates ``tl.fma`` as a rounded product plus a sum and
truncates bf16/fp16 stores; the copied channels are still compared bitwise and
the rotated ones within one output ulp plus the FMA gap (4 fp32 eps of the
pair's magnitude, which covers cancellation between the two products).

Sizes: 5 x 7 rows and 12 channels exercise row and channel tails of every block;
C = 11 makes the rotary region start at an odd channel; P = C/2 rotates everything.

Every contract test takes the ``backend`` fixture (``tests/conftest.py``): it runs on each fused
backend the op registers, on the CPU (Triton's interpreter) and on CUDA.
"""

import pytest
import torch
from conftest import DEVICES
from helpers import assert_bitwise, spacing

from dsfuse.text_rope import apply_rope, rope_reference, rope_reference_fp64, rope_reference_inplace

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [  # (values shape, rotary pairs)
    ((2, 5, 3, 12), 3),
    ((1, 7, 11), 4),
    ((3, 9, 2, 8), 4),
    ((2, 33, 64), 32),
]


def make(shape, pairs, dtype, device, seed=0, batch_angles=None):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen).to(dtype).to(device)
    b = shape[0] if batch_angles is None else batch_angles
    angles = (torch.rand(b, shape[1], pairs, generator=gen) * 200 - 100).to(device)
    return values, angles


def assert_rope_equal(got, want, values, pairs, what=""):
    """Bitwise on CUDA; on CPU bitwise copied channels and a bounded gap on rotated ones."""
    if got.is_cuda:
        assert_bitwise(got, want, what)
        return
    rd = 2 * pairs
    assert_bitwise(got[..., :-rd], want[..., :-rd], what + " (copied channels)")
    g, w = got[..., -rd:].double(), want[..., -rd:].double()
    assert torch.equal(torch.isnan(g), torch.isnan(w)), what + ": NaN positions differ"
    x = values[..., -rd:].double().abs()
    pair_mag = (x[..., 0::2] + x[..., 1::2]).repeat_interleave(2, -1)
    out_ulp = spacing(want[..., -rd:]) if want.dtype != torch.float32 else 0
    bound = out_ulp + 4 * 2.0**-24 * pair_mag
    err = (g - w).abs()
    ok = (err <= bound) | (g == w) | torch.isnan(w)
    assert ok.all(), f"{what}: {int((~ok).sum())} rotated elements beyond tolerance, max err {err[~ok].max()}"


@pytest.mark.parametrize("inverse", [False, True], ids=["rope", "inverse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,pairs", SHAPES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_forward_matches_eager(shape, pairs, dtype, inverse, device, backend):
    values, angles = make(shape, pairs, dtype, device)
    got = apply_rope(values, angles, inverse, backend=backend)
    assert got.is_contiguous()
    assert_rope_equal(got, rope_reference(values, angles, inverse), values, pairs, "forward")


@pytest.mark.parametrize("inverse", [False, True], ids=["rope", "inverse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,pairs", SHAPES[:3], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_backward_matches_eager_autograd(shape, pairs, dtype, inverse, device, backend):
    values, angles = make(shape, pairs, dtype, device, seed=1)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    leaf = values.clone().requires_grad_()
    (got,) = torch.autograd.grad(apply_rope(leaf, angles, inverse, backend=backend), leaf, grad)
    ref_leaf = values.clone().requires_grad_()
    (want,) = torch.autograd.grad(rope_reference(ref_leaf, angles, inverse), ref_leaf, grad)
    assert_rope_equal(got, want, grad, pairs, "backward")


@pytest.mark.parametrize("device", DEVICES)
def test_reference_agrees_with_fp64(device):
    values, angles = make((2, 9, 4, 16), 5, torch.float32, device)
    for inverse in (False, True):
        got = rope_reference(values, angles, inverse).double()
        want = rope_reference_fp64(values, angles, inverse)
        assert (got - want).abs().max() < 1e-5, inverse  # angles up to 100 rad: libm sin/cos error


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_is_conjugate_rotation_fp64(device):
    """The eager backward is the conjugate rotation: check it against float64 autograd."""
    values, angles = make((1, 6, 2, 8), 3, torch.float64, device)
    values.requires_grad_()
    grad = torch.randn_like(values)
    (g64,) = torch.autograd.grad(rope_reference_fp64(values, angles), values, grad)
    assert torch.allclose(g64, rope_reference_fp64(grad, angles, inverse=True), atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_views_without_copies(dtype, device, backend):
    """A channel slice of a wider row, a head-major permutation, a batch-broadcast angle
    and a non-contiguous caller-owned output all run without .contiguous() copies."""
    wide = torch.randn(2, 7, 3, 40).to(dtype).to(device)
    values = wide[..., 5:29]  # channel slice: row stride 40, width 24
    angles = (torch.rand(1, 7, 6) * 50).to(device)  # broadcast over batch
    out_storage = torch.empty(2, 3, 7, 30, dtype=dtype, device=device).transpose(1, 2)
    out = out_storage[..., 2:26]
    apply_rope(values, angles, out=out, backend=backend)
    assert_rope_equal(out, rope_reference(values, angles), values, 6, "slice -> strided out")
    assert torch.isnan(out_storage[..., :2]).all() and torch.isnan(out_storage[..., 26:]).all(), "wrote outside out"

    permuted = torch.randn(2, 3, 7, 24).to(dtype).to(device).transpose(1, 2)  # [B,S,H,C] with H outer
    assert_rope_equal(apply_rope(permuted, angles, backend=backend), rope_reference(permuted, angles), permuted, 6,
                      "permuted")
    channel_strided = torch.randn(2, 7, 48).to(dtype).to(device)[..., ::2]  # channel stride 2
    a3 = (torch.rand(2, 7, 4) * 50).to(device)
    assert_rope_equal(apply_rope(channel_strided, a3, backend=backend), rope_reference(channel_strided, a3),
                      channel_strided, 4, "channel stride 2")


def _special_values(dtype, device):
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0, 3.0e38])
    values = torch.randn(3, 8, 2, 10)
    flat = values.view(-1)
    idx = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(3))[:200]
    flat[idx] = specials.repeat(25)
    values = values.to(dtype).to(device)
    angles = torch.rand(3, 8, 3) * 10
    angles[0, 0] = 0.0  # cos = 1, sin = 0: exact products, signed zeros reach the output
    angles[0, 1] = torch.pi / 2
    return values, angles.to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_forward_and_backward(dtype, device, backend):
    """Signed zeros, infinities and NaN propagate exactly as in eager (bitwise on CUDA)."""
    values, angles = _special_values(dtype, device)
    assert_rope_equal(apply_rope(values, angles, backend=backend), rope_reference(values, angles), values, 3, "fwd")
    grad = values.flip(0).clone()  # the same specials, elsewhere
    leaf = torch.randn_like(values).requires_grad_()
    (got,) = torch.autograd.grad(apply_rope(leaf, angles, backend=backend), leaf, grad)
    (want,) = torch.autograd.grad(rope_reference(leaf, angles), leaf, grad)
    assert_rope_equal(got, want, grad, 3, "bwd")
    # eager sums the copied- and rotated-channel gradient paths, so -0.0 comes back as +0.0
    neg_zero = (torch.signbit(grad) & (grad == 0))[..., :4]  # copied channels
    assert neg_zero.any()
    assert not (torch.signbit(got) & (got == 0))[..., :4][neg_zero].any()


@pytest.mark.parametrize("inverse", [False, True], ids=["rope", "inverse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inplace_touches_only_rotary_channels(dtype, inverse, device, backend):
    values, angles = make((2, 5, 3, 12), 3, dtype, device, seed=4)
    work = values.clone()
    result = apply_rope(work, angles, inverse, inplace=True, backend=backend)
    assert result is work
    want = rope_reference_inplace(values.clone(), angles, inverse)
    assert_rope_equal(work, want, values, 3, "in place")
    assert_bitwise(work[..., :-6], values[..., :-6], "leading channels untouched")


def test_inplace_autograd(device, backend):
    values, angles = make((2, 5, 3, 12), 3, torch.float32, device, seed=5)
    leaf = values.clone().requires_grad_()
    with pytest.raises(ValueError, match="leaf tensor that requires grad"):
        apply_rope(leaf, angles, inplace=True, backend=backend)
    grad = torch.randn_like(values)
    hidden = leaf * 1.0
    apply_rope(hidden, angles, inplace=True, backend=backend)
    (got,) = torch.autograd.grad(hidden, leaf, grad)
    ref_leaf = values.clone().requires_grad_()
    (want,) = torch.autograd.grad(rope_reference(ref_leaf, angles), ref_leaf, grad)
    assert_rope_equal(got, want, grad, 3, "in-place backward")


def test_backends_and_fallbacks(device, backend):
    values, angles = make((2, 5, 3, 12), 3, torch.float32, device, seed=6)
    ref = rope_reference(values, angles)
    assert_bitwise(apply_rope(values, angles, backend="reference"), ref, "reference backend")
    # float64 is not fused: auto falls back to the (exact) reference, a fused backend refuses
    v64 = values.double()
    assert_bitwise(apply_rope(v64, angles), rope_reference(v64, angles), "fp64 fallback")
    with pytest.raises(ValueError, match="dtype float64 is not one of bfloat16, float16, float32"):
        apply_rope(v64, angles, backend=backend)
    # angles that require grad: auto takes eager (and angles get their gradient); a fused backend refuses
    angles_rg = angles.clone().requires_grad_()
    out = apply_rope(values, angles_rg)
    out.sum().backward()
    assert angles_rg.grad is not None and torch.isfinite(angles_rg.grad).all()
    with pytest.raises(ValueError, match="angles requires grad"):
        apply_rope(values, angles_rg, backend=backend)
    with pytest.raises(ValueError, match="backend"):
        apply_rope(values, angles, backend="cuda")


def test_triton_needs_cuda_without_the_interpreter(monkeypatch):
    """CPU tensors without ``TRITON_INTERPRET``: Triton refuses by name, ``auto`` takes the reference."""
    values, angles = make((2, 5, 3, 12), 3, torch.float32, "cpu", seed=6)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="Triton needs CUDA"):
        apply_rope(values, angles, backend="triton")
    assert_bitwise(apply_rope(values, angles), rope_reference(values, angles), "auto on CPU is the reference")


def test_torch_compile_fullgraph(device, backend):
    """The custom ops trace without graph breaks; compiled results equal the eager API."""
    values, angles = make((2, 5, 3, 12), 3, torch.float32, device, seed=7)

    def f(v, a):
        return apply_rope(v, a, backend=backend) * 2.0

    compiler = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(f, fullgraph=True, backend=compiler)
    leaf = values.clone().requires_grad_()
    out = compiled(leaf, angles)
    assert_bitwise(out, f(values, angles), "compiled forward")
    grad = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, leaf, grad)
    ref_leaf = values.clone().requires_grad_()
    (want,) = torch.autograd.grad(f(ref_leaf, angles), ref_leaf, grad)
    assert_bitwise(got, want, "compiled backward")

    def g(v, a, out):  # out= and in-place forms through their mutating custom ops
        apply_rope(v, a, True, out=out, backend=backend)
        apply_rope(v, a, inplace=True, backend=backend)
        return v, out

    out_c, out_e = torch.empty_like(values), torch.empty_like(values)
    v_c, v_e = values.clone(), values.clone()
    torch.compile(g, fullgraph=True, backend=compiler)(v_c, angles, out_c)
    g(v_e, angles, out_e)
    assert_bitwise(out_c, out_e, "compiled out=")
    assert_bitwise(v_c, v_e, "compiled in place")


def test_reference_compiles_fullgraph():
    """The benchmark's torch.compile controls compile the reference itself: it must trace whole."""
    values, angles = make((1, 6, 4, 16), 4, torch.bfloat16, "cpu", seed=8)
    leaf = values.clone().requires_grad_()
    compiled = torch.compile(rope_reference, fullgraph=True, dynamic=False, backend="aot_eager")
    out = compiled(leaf, angles, True)
    assert_bitwise(out, rope_reference(values, angles, True), "compiled reference")
    torch.autograd.grad(out, leaf, torch.ones_like(out))


def test_compiled_inplace_under_autograd_takes_the_reference(device, backend):
    """A mutating custom op carries no gradient formula under torch.compile: auto takes the reference
    there (right gradient), a fused backend named refuses rather than return a gradient that skips the
    rotation."""
    values, angles = make((2, 5, 3, 12), 3, torch.float32, device, seed=11)
    grad = torch.randn_like(values)

    def f(v, a, which):
        y = v * 1.0
        return apply_rope(y, a, inplace=True, backend=which)

    leaf = values.clone().requires_grad_()
    torch.compile(f, fullgraph=True, backend="aot_eager")(leaf, angles, "auto").backward(grad)
    want_leaf = values.clone().requires_grad_()
    rope_reference(want_leaf * 1.0, angles).backward(grad)
    assert_bitwise(leaf.grad, want_leaf.grad, "compiled in-place gradient")
    with pytest.raises(Exception, match="in-place rotation under autograd while torch.compile traces"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(values.clone().requires_grad_(), angles, backend)
