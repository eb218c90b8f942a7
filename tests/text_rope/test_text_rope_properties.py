"""Property tests: random shapes, strides, dtypes and pair counts through the fused path.

Shapes stay small (the interpreter runs every program in Python); the draws
cover 3D and 4D inputs, every dtype, P from 1 to C/2 (odd C included), channel
slices of wider rows, permuted head/sequence storage, and inverse rotation. Each fused backend that
runs here (the ``backend`` fixture; the fixture holds no state across examples).
"""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_text_rope import assert_rope_equal

from dsfuse.text_rope import apply_rope, rope_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@st.composite
def rope_inputs(draw):
    four_d = draw(st.booleans())
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    heads = draw(st.integers(1, 4)) if four_d else None
    channels = draw(st.integers(2, 40))
    pairs = draw(st.integers(1, channels // 2))
    pad_lo, pad_hi = draw(st.integers(0, 5)), draw(st.integers(0, 5))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    permute = four_d and draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    dims = [batch, seq, heads, channels + pad_lo + pad_hi] if four_d else [batch, seq, channels + pad_lo + pad_hi]
    if permute:  # store heads outside the sequence: [B, H, S, C] viewed as [B, S, H, C]
        dims[1], dims[2] = dims[2], dims[1]
    wide = torch.randn(dims, generator=gen).to(dtype)
    if permute:
        wide = wide.transpose(1, 2)
    values = wide[..., pad_lo : pad_lo + channels].to(DEVICE)
    angle_batch = draw(st.sampled_from([1, batch]))
    angles = (torch.rand(angle_batch, seq, pairs, generator=gen) * 400 - 200).to(DEVICE)
    return values, angles, pairs, draw(st.booleans())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(rope_inputs())
def test_forward_any_layout(backend, case):
    values, angles, pairs, inverse = case
    got = apply_rope(values, angles, inverse, backend=backend)
    assert_rope_equal(got, rope_reference(values, angles, inverse), values, pairs, "forward")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(rope_inputs())
def test_backward_any_layout(backend, case):
    values, angles, pairs, inverse = case
    grad = torch.randn(values.shape, generator=torch.Generator().manual_seed(1)).to(values.dtype).to(DEVICE)
    leaf = values.detach().clone().requires_grad_()
    (got,) = torch.autograd.grad(apply_rope(leaf, angles, inverse, backend=backend), leaf, grad)
    (want,) = torch.autograd.grad(rope_reference(leaf, angles, inverse), leaf, grad)
    assert_rope_equal(got, want, grad, pairs, "backward")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(rope_inputs())
def test_inplace_any_layout(backend, case):
    values, angles, pairs, inverse = case
    work = values.clone()
    apply_rope(work, angles, inverse, inplace=True, backend=backend)
    assert_rope_equal(work, rope_reference(values, angles, inverse), values, pairs, "in place (dense)")
