"""Gated DeltaNet backward, the q/k finalize stage (value-head sum, L2-norm backward) of each fused
backend's backward stage table (the ``backward_stages`` fixture, from the registry).

``finalize`` against ``dsfuse.gdn.reference_backward._sum_value_heads`` and
``_l2norm_backward`` in fp64 on the same inputs (q, k in the test dtype; ``dq_hv``, ``dk_hv``
fp32), and against the same formulas evaluated by torch in fp32.

What is checked (outputs are head views of a wider NaN-poisoned buffer, so an unwritten element
fails; the buffer's other columns hold random values that must come back bit for bit):

* Sum only (no L2 norm): the kernel adds the value heads of a group left to right in fp32, as
  ``_sum_value_heads`` does, so the fp32 output is bitwise torch's fp32 ``_sum_value_heads`` and
  the bf16 output bitwise its round-to-nearest-even conversion. Against fp64: every element within
  ``(G - 1) 2^-24 sum_j |dx_j|`` (the bound of G - 1 fp32 additions; a unit in the last place of
  the result is no measure here, the sum of random heads cancels), plus half a bf16 unit for bf16.
* With the L2 norm, fp32: every element within ``(K + G + 8) 2^-24 m`` of the exact value, with
  ``m = r (sum_j |dx_j| + |y| sum |dy y|)`` (``r``, ``y``, ``dy``: the formula's terms; the
  K-term fp32 reductions in any order, ``rsqrt`` and the few products of the formula); relative
  RMS at most 1e-6. Observed on the CPU: every element within 4 x 2^-24 m, relative RMS
  <= 9e-8; about 3 in 4 elements bitwise equal to torch's fp32 evaluation of the formula.
* With the L2 norm, bf16: within half a bf16 unit in the last place plus the fp32 bound above of
  the exact value (one rounding to nearest of the fp32 result) and relative RMS <= 2^-8.
  Observed on the CPU: bitwise the rounding of torch's fp32 result in every element; relative
  RMS <= 1.9e-3 (the sum alone: <= 1.7e-3).

Shapes: T = 150 (not a multiple of the 32-token block), (H, HV) = (2, 2), (1, 3), (2, 8), (2, 6)
(G = 1, 3, 4, 3); K = 32, one case K = 128; q, k and the outputs as head views of packed rows
[T, (2H + HV) K], or with head-major layouts (token stride K, head stride T K); rows of q of zero
and tiny norm (the eps of the norm). The model's specialisation (AOT_SPECS: bf16, K = 128,
H = 16, HV = 48, token stride 10240) once. Determinism: two launches give the same bits.
"""

from __future__ import annotations

import pytest
import torch
from dsfuse.gdn.reference import L2NORM_EPS
from dsfuse.gdn.reference_backward import _l2norm_backward, _sum_value_heads
from helpers import assert_bitwise, spacing

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
U32 = 2.0**-24  # fp32 unit roundoff
# (T, H, HV, K, layout): layout "packed" (q, k, dq, dk head views of packed rows) or "headmajor"
CASES = [
    (150, 2, 2, 32, "packed"),
    (150, 1, 3, 32, "packed"),
    (150, 2, 8, 32, "headmajor"),
    (150, 2, 6, 32, "packed"),
    (37, 1, 4, 128, "packed"),
]


def case_id(case):
    tokens, h, hv, dk, layout = case
    return f"T{tokens}-H{h}_HV{hv}-K{dk}-{layout}"


class Prepared:
    """Inputs of one case on ``device``: q, k ``[T, H, K]`` (dtype), dq_hv, dk_hv fp32 ``[T, HV, K]``,
    and output views dq, dk into a wider buffer whose other columns hold random sentinel values."""

    def __init__(self, tokens, heads, value_heads, dk, layout, dtype, device, seed=0, pad=8):
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.dtype = heads, dtype
        width = (2 * heads + value_heads) * dk
        x = torch.randn(tokens, 2, heads, dk, generator=gen)
        x = x * torch.exp(2 * torch.randn(tokens, 2, heads, 1, generator=gen))  # norms from ~1e-2 to ~1e2
        x[0] = 0.0  # zero rows: r = eps^-1/2
        x[1] = x[1] * 1e-4  # |x|^2 below eps
        x = x.to(dtype)
        if layout == "packed":
            row = torch.zeros(tokens, width, dtype=dtype)
            row[:, : 2 * heads * dk] = x.reshape(tokens, -1)
            row = row.to(device)
            self.q = row[:, : heads * dk].view(tokens, heads, dk)
            self.k = row[:, heads * dk : 2 * heads * dk].view(tokens, heads, dk)
        else:  # head-major: token stride K, head stride T K
            hm = x.permute(1, 2, 0, 3).contiguous().to(device)  # [2, H, T, K]
            self.q, self.k = hm[0].transpose(0, 1), hm[1].transpose(0, 1)
        self.dq_hv = torch.randn(tokens, value_heads, dk, generator=gen).to(device)
        self.dk_hv = torch.randn(tokens, value_heads, dk, generator=gen).to(device)

        # outputs: head views of a gradient buffer [T, width + pad] (the packed layout plus extra columns)
        self.buf = torch.empty(tokens, width + pad, dtype=dtype, device=device)  # NaN (conftest)
        self.rest = torch.zeros(self.buf.shape, dtype=torch.bool, device=device)
        if layout == "packed":
            self.dq = self.buf[:, : heads * dk].view(tokens, heads, dk)
            self.dk = self.buf[:, heads * dk : 2 * heads * dk].view(tokens, heads, dk)
            self.rest[:, 2 * heads * dk :] = True
        else:  # head-major views of the buffer's first 2 H T K elements, reversed head order for dk
            flat = self.buf.view(-1)
            self.dq = flat[: heads * tokens * dk].view(heads, tokens, dk).transpose(0, 1)
            dkv = flat[heads * tokens * dk : 2 * heads * tokens * dk].view(heads, tokens, dk).flip(0)
            self.dk = dkv.transpose(0, 1)  # negative head stride: any head stride
            self.rest.view(-1)[2 * heads * tokens * dk :] = True
        with torch.no_grad():
            self.buf[self.rest] = torch.randn(int(self.rest.sum()), generator=gen).to(dtype).to(device)
        self.sentinel = self.buf[self.rest].clone()

    def run(self, stages, l2):
        stages.finalize(self.q, self.k, self.dq_hv, self.dk_hv, self.dq, self.dk, use_qk_l2norm=l2)
        assert_bitwise(self.buf[self.rest].cpu(), self.sentinel.cpu(), "buffer outside dq and dk")
        return self.dq, self.dk


def reference(x, dx_hv, heads, l2):
    """``(exact, magnitude, emulated)``: fp64 result, fp64 error scale (``sum_j |dx_j|``, and with
    the L2 norm ``r (sum_j |dx_j| + |y| sum |dy y|)``), and torch's fp32 evaluation."""
    dy64 = _sum_value_heads(dx_hv.double(), heads)
    mag = _sum_value_heads(dx_hv.double().abs(), heads)
    emu = _sum_value_heads(dx_hv, heads)
    if not l2:
        return dy64, mag, emu
    x64 = x.double()
    exact = _l2norm_backward(x64, dy64, L2NORM_EPS)
    r = torch.rsqrt((x64 * x64).sum(-1, keepdim=True) + L2NORM_EPS)
    y = x64 * r
    mag = r * (mag + y.abs() * (mag * y.abs()).sum(-1, keepdim=True))
    emu = _l2norm_backward(x.float(), emu, L2NORM_EPS)
    return exact, mag, emu


def check(got, x, dx_hv, heads, l2, what, report):
    """The bounds of the module docstring; returns the observed relative RMS error."""
    dtype = got.dtype
    group, dk = dx_hv.shape[1] // heads, dx_hv.shape[-1]
    got = got.cpu()
    exact, mag, emu = (t.cpu() for t in reference(x.cpu(), dx_hv.cpu(), heads, l2))
    assert torch.isfinite(got).all(), f"{what}: non-finite values (an element left unwritten?)"
    err = (got.double() - exact).abs()
    bound = ((dk + group + 8) if l2 else max(group - 1, 0)) * U32 * mag
    if dtype == torch.float32:
        if not l2:
            assert_bitwise(got, emu, f"{what} (fp32 sum in head order)")
    else:
        if not l2:
            assert_bitwise(got, emu.to(dtype), f"{what} (fp32 sum in head order, rounded to nearest)")
        # one rounding of a value within `bound` of the exact one
        bound = bound + 0.5 * spacing(exact.to(dtype))
    worst = (err / bound.clamp_min(1e-300)).max().item()
    assert (err <= bound).all(), f"{what}: error {worst:.3f} x the bound"
    rel = ((got.double() - exact).norm() / exact.norm()).item()
    assert rel <= (1e-6 if dtype == torch.float32 else 2.0**-8), f"{what}: relative RMS {rel:.2e}"
    report[what] = {"rel_rms": rel, "worst_over_bound": worst,
                    "err_over_u_mag": (err / (U32 * mag).clamp_min(1e-300)).max().item(),
                    "equal_to_torch": (got == emu.to(dtype)).double().mean().item()}
    return rel


@pytest.mark.parametrize("l2", [False, True], ids=["sum", "l2"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_finalize_against_reference(case, dtype, l2, device, backward_stages):
    tokens, heads, value_heads, dk, layout = case
    p = Prepared(tokens, heads, value_heads, dk, layout, DTYPES[dtype], device, seed=CASES.index(case))
    dq, dk_ = p.run(backward_stages, l2)
    assert dq.dtype == dk_.dtype == DTYPES[dtype]
    report = {}
    check(dq, p.q, p.dq_hv, heads, l2, "dq", report)
    check(dk_, p.k, p.dk_hv, heads, l2, "dk", report)


def test_model_specialisation(device, backward_stages):
    """AOT_SPECS' geometry: bf16, K = 128, H = 16, HV = 48, q, k, dq, dk with token stride 10240."""
    p = Prepared(40, 16, 48, 128, "packed", torch.bfloat16, device, pad=0)
    assert p.q.stride() == p.dq.stride() == (10240, 128, 1)
    for l2 in (False, True):
        dq, dk = p.run(backward_stages, l2)
        report = {}
        check(dq, p.q, p.dq_hv, 16, l2, "dq", report)
        check(dk, p.k, p.dk_hv, 16, l2, "dk", report)


def test_deterministic(device, backward_stages):
    p = Prepared(150, 2, 6, 32, "packed", torch.bfloat16, device)
    first = [t.clone() for t in p.run(backward_stages, True)]
    p.buf[~p.rest] = float("nan")
    second = p.run(backward_stages, True)
    for a, b, name in zip(first, second, ("dq", "dk"), strict=True):
        assert_bitwise(b.cpu(), a.cpu(), f"{name}: second launch")


def test_no_tokens_is_a_no_op(device, backward_stages):
    q = torch.zeros(0, 2, 32, device=device)
    hv = torch.zeros(0, 6, 32, device=device)
    dq, dk = backward_stages.finalize(q, q, hv, hv, torch.zeros_like(q), torch.zeros_like(q), use_qk_l2norm=True)
    assert dq.shape == dk.shape == (0, 2, 32)
