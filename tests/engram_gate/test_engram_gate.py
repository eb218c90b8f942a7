"""Engram gate against the float64 reference: forward, saved state, all five gradients.

Tolerances (derived, not tuned):

* forward: bf16 ``out`` within a relative RMS error of 2^-8 (bf16's epsilon; rounding
  alone gives about 2^-10) and no element off by more than 2% of the tensor's largest
  magnitude; the fp32 saved state within 1e-5 of its largest magnitude (fp32 sums over D).
* backward from the same saved state (``engram_gate_backward_from_saved`` in float64):
  isolates the backward's arithmetic. Every bf16 element within 2^-7 of its own
  magnitude (one rounding; the CPU interpreter truncates) plus 2^-16 of the largest;
  dweight within 1e-5 of its largest magnitude.
* end to end against the float64 model: dx and both parts of dkv as the forward's
  out; dweight within 1e-3 of its largest magnitude. dweight sums over tokens terms
  scaled by 1/sqrt|dot|, which amplifies the fp32 rounding of small scores: the
  model's own fp32 computation is off by 1.7e-4 to 2.8e-4 at N = 4096, D = 5120.

Masked tokens are exact: their output is x and their dx is dout, bit for bit.

Sizes: N = 1, 3, 65 (odd, tails of every block), D = 96 and 160 (not powers of
two: masked channel tails), and the DeepSeek-V4.1 D = 5120 on the GPU.

Every contract test takes the ``backend`` fixture (``tests/conftest.py``): it runs on each fused
backend the op registers, on the CPU (Triton's interpreter) and on CUDA; what only one backend
has (its launch constants, its code generation) is tested per backend.
"""

import functools

import pytest
import torch
from conftest import DEVICES
from helpers import assert_bitwise

from dsfuse.engram_gate import (
    EngramGatePlan,
    engram_gate,
    engram_gate_backward,
    engram_gate_backward_from_saved,
    engram_gate_backward_reference,
    engram_gate_forward,
    engram_gate_reference,
)


def make(n, dim, device, seed=0, streams=4, weight_scale=None, mask=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, streams, dim, generator=gen).bfloat16().to(device)
    kv = torch.randn(n, (streams + 1) * dim, generator=gen).bfloat16().to(device)
    weight = torch.randn(streams, dim, generator=gen)
    if weight_scale is not None:
        weight = weight * torch.tensor(weight_scale)[:, None]
    if mask is None:
        mask = torch.rand(n, generator=gen) > 0.3
    dout = torch.randn(n, streams, dim, generator=gen).bfloat16().to(device)
    return x, kv, weight.to(device), mask.to(device), dout


def assert_close_bf16(got, want, what):
    got, want = got.double(), want.double()
    rms = (got - want).norm() / want.norm().clamp_min(1e-30)
    assert rms <= 2**-8, f"{what}: relative RMS error {rms:.2e} > 2^-8"
    worst = (got - want).abs().max() / want.abs().max().clamp_min(1e-30)
    assert worst <= 0.02, f"{what}: an element is off by {worst:.2e} of the largest magnitude"


def assert_close_fp32(got, want, what, rel=1e-5):
    err = (got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)
    assert err <= rel, f"{what}: max error {err:.2e} of the largest magnitude > {rel}"


def assert_rounded_from(got, want, what):
    """Each element is ``want`` (float64) after one rounding to ``got``'s dtype, up to fp32 noise."""
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-6}[got.dtype]
    err = (got.double() - want).abs()
    bound = ulp * want.abs() + 2**-16 * want.abs().max()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (f"{what}: element {worst.item()} is {got.flatten()[worst].item()}, "
                                  f"want {want.flatten()[worst].item()}")


def check_all(x, kv, weight, mask, dout, eps, backend, clamp=1e-6):
    out, saved = engram_gate_forward(x, kv, weight, mask, eps=eps, clamp=clamp, backend=backend)
    ref_out, ref_saved = engram_gate_reference(x, kv, weight, mask, eps=eps, clamp=clamp, compute_dtype=torch.float64)
    assert_close_bf16(out, ref_out, "out")
    for i, name in enumerate(("gate", "dot", "rx", "rk")):
        assert_close_fp32(saved[..., i], ref_saved[..., i], f"saved {name}")
    assert_bitwise(out[~mask], x[~mask], "masked tokens keep x")
    assert (saved[~mask][..., 0] == 0).all(), "masked gate is 0"
    dx, dkv, dweight = engram_gate_backward(dout, x, kv, weight, mask, saved, eps=eps, clamp=clamp, backend=backend)
    assert_bitwise(dx[~mask], dout[~mask], "masked tokens: dx is dout")
    fx, fkv, fw = engram_gate_backward_from_saved(dout, x, kv, weight, saved, clamp=clamp)
    assert_rounded_from(dx, fx, "dx (same saved state)")
    assert_rounded_from(dkv, fkv, "dkv (same saved state)")
    assert_close_fp32(dweight, fw, "dweight (same saved state)")
    gx, gkv, gw = engram_gate_backward_reference(dout, x, kv, weight, mask, eps=eps, clamp=clamp)
    streams, dim = x.shape[1:]
    assert_close_bf16(dx, gx, "dx")
    assert_close_bf16(dkv[:, : streams * dim], gkv[:, : streams * dim], "dkey")
    assert_close_bf16(dkv[:, streams * dim :], gkv[:, streams * dim :], "dvalue")
    assert_close_fp32(dweight, gw, "dweight", rel=1e-3)
    return out, saved, (dx, dkv, dweight)


@pytest.mark.parametrize("n", [1, 3, 65])
@pytest.mark.parametrize("dim", [96, 160])
def test_against_fp64_reference(n, dim, device, backend):
    check_all(*make(n, dim, device, seed=n + dim), eps=1e-20, backend=backend)


@pytest.mark.parametrize("eps", [1e-20, 1e-6, 0.03])
def test_eps(eps, device, backend):
    check_all(*make(9, 96, device, seed=1), eps=eps, backend=backend)


def test_scores_around_the_clamp(device, backend):
    """Zero scores (weight 0), scores below the clamp of both signs (weights ~1e-9) and above it."""
    x, kv, weight, _, dout = make(17, 96, device, seed=2, weight_scale=[0.0, 1e-9, -1e-9, 1.0])
    mask = torch.ones(17, dtype=torch.bool, device=device)
    _, saved, _ = check_all(x, kv, weight, mask, dout, eps=1e-20, backend=backend)
    dot, gate = saved[..., 1], saved[..., 0]
    assert (dot[:, 0] == 0).all()
    root = torch.tensor(1e-6).sqrt()
    assert torch.allclose(gate[:, 0], torch.sigmoid(root).to(device)), "copysign(+0) gives sigmoid(+sqrt(clamp))"
    below = dot[:, 1:3]
    assert (below.abs() < 1e-6).all() and (below > 0).any() and (below < 0).any()
    clamped = torch.sigmoid(torch.where(below > 0, root, -root))
    assert torch.allclose(gate[:, 1:3], clamped), "below the clamp the gate is sigmoid(+-sqrt(clamp))"
    above = dot[:, 3].abs() > 1e-6
    assert above.all() and (dot[:, 3] > 0).any() and (dot[:, 3] < 0).any()


def all_masked_and_deterministic(n_masked, n, dim, device, backend):
    """No token gated: out is x and dx is dout bit for bit, zero key/value/weight gradients; then
    mixed masks, three forward + backward runs bitwise equal (saved state and dweight included)."""
    x, kv, weight, _, dout = make(n_masked, dim, device, seed=3)
    none = torch.zeros(n_masked, dtype=torch.bool, device=device)
    out, saved = engram_gate_forward(x, kv, weight, none, eps=1e-20, backend=backend)
    assert_bitwise(out, x, "no token gated")
    dx, dkv, dweight = engram_gate_backward(dout, x, kv, weight, none, saved, eps=1e-20, backend=backend)
    assert_bitwise(dx, dout, "dx")
    assert (dkv == 0).all() and (dweight == 0).all()
    x, kv, weight, mask, dout = make(n, dim, device, seed=4)
    runs = []
    for _ in range(3):
        out, saved = engram_gate_forward(x, kv, weight, mask, eps=1e-20, backend=backend)
        runs.append((out, saved, *engram_gate_backward(dout, x, kv, weight, mask, saved, eps=1e-20, backend=backend)))
    for again in runs[1:]:
        for a, b, name in zip(again, runs[0], ("out", "saved", "dx", "dkv", "dweight")):
            assert_bitwise(a, b, f"repeat {name}")


def test_all_masked_and_deterministic(device, backend):
    all_masked_and_deterministic(11, 40, 96, device, backend)


def test_caller_owned_outputs_plan_and_autograd(device, backend, launchers):
    """Caller-owned outputs and workspace (one too small refused), the plan (a fresh saved state:
    rebinding) and autograd: all bitwise equal to the functional calls."""
    x, kv, weight, mask, dout = make(7, 96, device, seed=5)
    out, saved = torch.empty_like(x), torch.empty(7, 4, 4, device=device)
    dx, dkv, dweight = torch.empty_like(x), torch.empty_like(kv), torch.empty(4, 96, device=device)
    elements = launchers["workspace_elements"](7, 4, 96)
    workspace = torch.empty(elements, device=device)
    got = engram_gate_forward(x, kv, weight, mask, eps=1e-20, out=out, saved=saved, backend=backend)
    assert got[0] is out and got[1] is saved
    grads = engram_gate_backward(dout, x, kv, weight, mask, saved, eps=1e-20, dx=dx, dkv=dkv, dweight=dweight,
                                 workspace=workspace, backend=backend)
    assert grads[0] is dx and grads[1] is dkv and grads[2] is dweight
    with pytest.raises(ValueError, match="workspace: expected"):
        engram_gate_backward(dout, x, kv, weight, mask, saved, eps=1e-20, backend=backend,
                             workspace=torch.empty(elements - 1, device=device))
    plan = EngramGatePlan(streams=4, dim=96, max_tokens=16, device=device, eps=1e-20, backend=backend)
    out2, saved2 = torch.empty_like(x), torch.empty(7, 4, 4, device=device)  # rebinding: fresh saved state
    plan.forward(x, kv, weight, mask, out2, saved2)
    assert_bitwise(out2, out, "plan forward")
    assert_bitwise(saved2, saved, "plan saved")
    dx2, dkv2, dw2 = torch.empty_like(x), torch.empty_like(kv), torch.empty(4, 96, device=device)
    plan.backward(dout, x, kv, weight, mask, saved2, dx2, dkv2, dw2)
    for a, b, name in zip((dx2, dkv2, dw2), (dx, dkv, dweight), ("dx", "dkv", "dweight")):
        assert_bitwise(a, b, f"plan {name}")
    leaves = [t.clone().requires_grad_() for t in (x, kv, weight)]
    y = engram_gate(*leaves, mask, eps=1e-20, backend=backend)
    assert_bitwise(y, out, "autograd out")
    autograd_grads = torch.autograd.grad(y, leaves, dout)
    for a, b, name in zip(autograd_grads, (dx, dkv, dweight), ("dx", "dkv", "dweight")):
        assert_bitwise(a, b, f"autograd {name}")


def test_plan_checks_a_call_once_per_set_of_tensors(backend, monkeypatch):
    """A plan call with the previous call's tensors (addresses, sizes, strides, dtypes, devices) skips
    the checks; any other tensor is checked again, so a bad call after a good one still raises."""
    x, kv, weight, mask, dout = make(5, 32, "cpu", seed=8)
    plan = EngramGatePlan(dim=32, max_tokens=8, device="cpu", eps=1e-20, backend=backend)
    out, saved = torch.empty_like(x), torch.empty(5, 4, 4)
    dx, dkv, dweight = torch.empty_like(x), torch.empty_like(kv), torch.empty(4, 32)
    plan.forward(x, kv, weight, mask, out, saved)
    plan.backward(dout, x, kv, weight, mask, saved, dx, dkv, dweight)
    checks = []
    monkeypatch.setattr(plan, "_check", lambda *a, **k: checks.append(1) or EngramGatePlan._check(plan, *a, **k))
    plan.forward(x, kv, weight, mask, out, saved)
    plan.backward(dout, x, kv, weight, mask, saved, dx, dkv, dweight)
    assert checks == []
    other = torch.empty_like(x)
    plan.forward(x, kv, weight, mask, other, saved)  # another out: checked
    assert checks == [1]
    with pytest.raises(ValueError, match="out: must not overlap x"):
        plan.forward(x, kv, weight, mask, x, saved)
    with pytest.raises(ValueError, match="dkv: must not overlap kv"):
        plan.backward(dout, x, kv, weight, mask, saved, dx, kv, dweight)
    with pytest.raises(ValueError, match="saved: expected"):
        plan.forward(x, kv, weight, mask, other, saved[:, :, :3])  # same address, other sizes
    with pytest.raises(TypeError, match="out: expected a torch.Tensor"):
        plan.forward(x, kv, weight, mask, None, saved)


def test_validation_errors(device, backend):
    """Every bad argument refused by name, each fused backend named (validation comes first)."""
    x, kv, weight, mask, dout = make(5, 32, device, seed=6)
    saved = torch.empty(5, 4, 4, device=device)
    fwd = functools.partial(engram_gate_forward, backend=backend)
    bwd = functools.partial(engram_gate_backward, backend=backend)
    plan = functools.partial(EngramGatePlan, dim=32, device=device, eps=1e-20, backend=backend)
    cases = [
        (lambda: fwd(x[0], kv, weight, mask, eps=1e-20), ValueError, r"x: expected \[N, S, D\]"),
        (lambda: fwd(x, kv[:, :-1], weight, mask, eps=1e-20), ValueError, "kv: expected shape"),
        (lambda: fwd(x, kv.half(), weight, mask, eps=1e-20), TypeError, "kv: expected dtype"),
        (lambda: fwd(x, kv, weight.double(), mask, eps=1e-20), TypeError, "weight: expected dtype"),
        (lambda: fwd(x, kv, weight.t().contiguous().t(), mask, eps=1e-20), ValueError,
         "weight: expected a contiguous"),
        (lambda: fwd(x, kv, weight, mask.int(), eps=1e-20), TypeError, "token_mask: expected dtype"),
        (lambda: fwd(x, kv, weight, mask[:4], eps=1e-20), ValueError, "token_mask: expected shape"),
        (lambda: fwd(x.transpose(1, 2).contiguous().transpose(1, 2), kv, weight, mask, eps=1e-20),
         ValueError, "x: expected contiguous"),
        (lambda: fwd(x, kv, weight, mask, eps=-1.0), ValueError, "eps: expected a float >= 0"),
        (lambda: fwd(x, kv, weight, mask, eps=1e-20, clamp=0.0), ValueError, "clamp: expected"),
        (lambda: fwd(x, kv, weight, mask, eps=1e-20, saved=torch.empty(5, 4, 3, device=device)), ValueError,
         "saved: expected"),
        (lambda: fwd(x, kv, weight, mask, eps=1e-20, out=x), ValueError, "out: must not overlap x"),
        (lambda: bwd(dout, x, kv, weight, mask, saved, eps=1e-20, dkv=kv), ValueError, "dkv: must not overlap kv"),
        (lambda: bwd(dout, x, kv, weight, mask, saved, eps=1e-20, workspace=torch.empty(3, device=device)),
         ValueError, "workspace: expected"),
        (lambda: bwd(dout.float(), x, kv, weight, mask, saved, eps=1e-20), ValueError, "dout: expected"),
        (lambda: plan(max_tokens=0), ValueError, "max_tokens"),
        (lambda: plan(max_tokens=4).forward(x, kv, weight, mask, torch.empty_like(x), saved), ValueError,
         "N <= max_tokens = 4"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()


def test_reference_backend_is_the_model():
    x, kv, weight, mask, dout = make(6, 32, "cpu", seed=7)
    out, saved = engram_gate_forward(x, kv, weight, mask, eps=1e-20, backend="reference")
    ref_out, ref_saved = engram_gate_reference(x, kv, weight, mask, eps=1e-20)
    assert_bitwise(out, ref_out, "reference out")
    assert_bitwise(saved, ref_saved, "reference saved")
    grads = engram_gate_backward(dout, x, kv, weight, mask, saved, eps=1e-20, backend="reference")
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.bfloat16, torch.float32]


def test_torch_compile_fullgraph(device, backend):
    x, kv, weight, mask, dout = make(5, 64, device, seed=8)
    compiler = "inductor" if device == "cuda" else "aot_eager"
    f = torch.compile(lambda *a: engram_gate(*a, mask, eps=1e-20, backend=backend), fullgraph=True, backend=compiler)
    leaves = [t.clone().requires_grad_() for t in (x, kv, weight)]
    out = f(*leaves)
    ref_leaves = [t.clone().requires_grad_() for t in (x, kv, weight)]
    ref = engram_gate(*ref_leaves, mask, eps=1e-20, backend=backend)
    assert_bitwise(out, ref, "compiled out")
    for a, b in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(ref, ref_leaves, dout)):
        assert_bitwise(a, b, "compiled gradients")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_other_dtypes(dtype, device, backend):
    """fp16 and fp32 rows (masked tokens keep x), the backward from the same saved state.

    fp16: dx and dkv one rounding from the float64 formula. fp32: the small gate terms are not hidden
    under bf16 rounding of the residual, so they are checked alone: dx - dout and every key/value/
    weight gradient within 1e-5 of the largest magnitude of the float64 formula (a dropped or wrong
    term is off by percents); end to end, out - x within 1e-4 of the float64 model's.
    """
    x, kv, weight, mask, dout = make(33, 160, device, seed=9)
    x, kv, dout = x.to(dtype), kv.to(dtype), dout.to(dtype)
    out, saved = engram_gate_forward(x, kv, weight, mask, eps=1e-20, backend=backend)
    assert_bitwise(out[~mask], x[~mask], "masked tokens keep x")
    if dtype == torch.float32:
        ref_out, _ = engram_gate_reference(x, kv, weight, mask, eps=1e-20, compute_dtype=torch.float64)
        assert_close_fp32(out - x, ref_out - x.double(), "out - x", rel=1e-4)
    dx, dkv, dweight = engram_gate_backward(dout, x, kv, weight, mask, saved, eps=1e-20, backend=backend)
    fx, fkv, fw = engram_gate_backward_from_saved(dout, x, kv, weight, saved)
    if dtype == torch.float32:
        assert_close_fp32(dx - dout, fx - dout.double(), "dx - dout")
        assert_close_fp32(dkv[:, : 4 * 160], fkv[:, : 4 * 160], "dkey")
        assert_close_fp32(dkv[:, 4 * 160 :], fkv[:, 4 * 160 :], "dvalue")
    else:
        assert_rounded_from(dx, fx, "dx")
        assert_rounded_from(dkv, fkv, "dkv")
    assert_close_fp32(dweight, fw, "dweight")


@pytest.mark.parametrize("device", DEVICES)
def test_backward_from_saved_formula_is_autograd(device):
    """The explicit float64 formula equals float64 autograd of the model (given the fp64 saved state)."""
    x, kv, weight, mask, dout = make(21, 96, device, seed=5, weight_scale=[0.0, 1e-9, -1.0, 1.0])
    _, saved64 = engram_gate_reference(x, kv, weight, mask, eps=1e-6, compute_dtype=torch.float64)
    got = engram_gate_backward_from_saved(dout, x, kv, weight, saved64)
    want = engram_gate_backward_reference(dout, x, kv, weight, mask, eps=1e-6)
    for g, w, name in zip(got, want, ("dx", "dkv", "dweight")):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12 * w.abs().max().item(), msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("groups, tile, coef, reverse", [(2, 64, 64, True), (3, 128, 32, False), (64, 32, 2048, True)])
def test_launch_constants(groups, tile, coef, reverse, device, monkeypatch):
    """The Triton kernels' launch constants: token groups (more and fewer than N), channel blocks (with
    channel tails) and both token orders of the backward."""
    from dsfuse.engram_gate.triton import kernels as eg

    for name, value in (("GROUPS", groups), ("TILE_BLOCK_D", tile), ("COEF_BLOCK_D", coef), ("TILE_REVERSE", reverse)):
        monkeypatch.setattr(eg, name, value)
    check_all(*make(7, 160, device, seed=4), eps=1e-20, backend="triton")
