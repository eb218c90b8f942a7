"""Gated DeltaNet forward stages (chunk-local cumulative gate, UT transform, WY representation)
of each fused backend's forward stage table (the ``forward_stages`` fixture, from the registry)
against the matching stages of the chunked reference in float64.

The reference is ``dsfuse.gdn.reference.chunk_gdn_stages`` on the same inputs (the
kernels' input dtype, upcast). ``A``, ``w`` and ``u`` are compared with the reference stages
(``ut_transform``, ``wy_representation``) fed the ``g_cum`` the kernel was given (the cumsum
kernel's fp32 output), so each stage's error is its own; the whole chain is also compared
with ``chunk_gdn_stages``' own ``A``, ``w``, ``u``.

Tolerances (derived, not tuned):

* ``g_cum``: every element within ``63 * 2^-24 * sum |g|`` (over the chunk's tokens so far)
  of the exact sum: the bound of any summation order of at most 64 fp32 terms.
* ``A`` (fp32): relative RMS error of its strictly lower part <= 1e-5 against float64 (fp32
  arithmetic, 2^-24 = 6e-8 per operation, through a 64-token triangular solve); diagonal
  exactly 1, upper triangle and columns past the chunk's end exactly 0.
* ``w``, ``u``: computed in fp32 and rounded once. fp32 outputs: relative RMS <= 1e-5.
  bf16 / fp16 outputs: every element within half a unit in the last place of the exact value
  on the GPU (round to nearest; 1% slack for the fp32 error) and within one unit in the CPU
  interpreter (its float-to-bf16 conversion truncates), or within 1e-5 of the largest
  magnitude; relative RMS at most the unit roundoff (2^-8 bf16, 2^-11 fp16), the bound of one
  rounding to nearest (twice that in the interpreter: truncation). On the GPU the products
  ``A x`` of 16-bit data run in one tf32 pass: each element's bound also has
  ``2.1 * 2^-10 * sum_j |A_ij| |x_j|`` (both factors truncated to tf32), and the relative RMS
  bound that term's norm.
* Through the chain (``g_cum`` rounded to fp32 once, error ``dG``, then exponentiated as
  differences, so each decay's relative error is ``|dG_i - dG_j| <= 2 max |dG|``, about
  ``2^-24 |G|`` with ``|G|`` up to about 2500 with the strong gates): relative RMS only, the
  bounds above plus ``2 max |dG|``. Single elements of ``u`` built by cancellation may then be
  off by a few units, and the strong gates' ``A`` by a relative RMS of about 3e-5.

Every element of a chunk's rows is checked (outputs start as NaN, see ``conftest``); rows
of tokens in no chunk (past ``cu_seqlens[-1]``) are not written by these stages and not
checked. Gates are the model's (``gdn_gates`` from ``A_log`` and a softplus of the
projection), mild and strongly decaying (per-token log decay down to about -1000).

Shapes: one sequence with T not a multiple of 64; documents of length 1, shorter than a
chunk, empty, and spanning chunks; (H, HV) in (2, 2), (2, 6), (1, 3); L2 norm in the kernel
on and off (off: keys normalised before the call, as the model does); q, k, v as head views
of one packed row or contiguous; K = V = 128 once; on the GPU also the model's geometry
(H, HV) = (16, 48), K = V = 128, 4096 tokens in five documents, bitwise repeatable.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import pytest
import torch
from helpers import spacing
from helpers import assert_rel_rms

from dsfuse.gdn.reference import (
    chunk_gdn_stages,
    chunk_local_cumsum,
    from_chunks,
    gdn_gates,
    l2norm,
    to_chunks,
    ut_transform,
    wy_representation,
)

CHUNK = 64
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


class Case(NamedTuple):
    docs: tuple[int, ...]  # document lengths (cu_seqlens from them)
    heads: int  # H
    value_heads: int  # HV
    dim_k: int
    dim_v: int
    dtype: torch.dtype
    l2norm: bool
    gates: str  # "model" or "strong"
    packed: bool  # q, k, v as head views of one packed row (and g with a strided layout)
    trailing: int = 0  # tokens past cu_seqlens[-1]

    def __str__(self):
        docs = "-".join(map(str, self.docs)) + (f"+{self.trailing}" if self.trailing else "")
        dt = str(self.dtype).removeprefix("torch.")
        return (f"docs{docs}_h{self.heads}x{self.value_heads}_k{self.dim_k}v{self.dim_v}_{dt}"
                f"_{'l2' if self.l2norm else 'nol2'}_{self.gates}{'_packed' if self.packed else ''}")


VARLEN = (1, 37, 0, 130, 64)  # length 1, shorter than a chunk, empty, spanning three chunks, one full chunk
CASES = [
    Case((150,), 2, 2, 16, 32, torch.float32, True, "model", False),
    Case((150,), 2, 6, 32, 16, torch.float32, False, "strong", True),
    Case((150,), 1, 3, 32, 16, torch.bfloat16, False, "strong", True),
    Case(VARLEN, 2, 2, 16, 32, torch.bfloat16, False, "model", False, trailing=5),
    Case(VARLEN, 2, 2, 16, 16, torch.float16, True, "strong", True),
    Case(VARLEN, 2, 6, 16, 32, torch.bfloat16, True, "model", True, trailing=3),
    Case(VARLEN, 1, 3, 32, 16, torch.float32, True, "model", False),
    Case((70, 1, 30), 1, 3, 128, 128, torch.bfloat16, True, "strong", True),
]
MODEL = Case((1000, 64, 1, 2500, 531), 16, 48, 128, 128, torch.bfloat16, True, "strong", True)


# ----------------------------------------------------------------------------- inputs


def make_inputs(case: Case, device: str, seed: int = 0) -> dict:
    """Inputs in the packed token layout: q, k ``[T, H, K]``, v ``[T, HV, V]``, g fp32 and beta ``[T, HV]``."""
    gen = torch.Generator().manual_seed(seed)
    heads, value_heads, dim_k, dim_v = case.heads, case.value_heads, case.dim_k, case.dim_v
    tokens = sum(case.docs) + case.trailing
    cu_seqlens = list(itertools.accumulate(case.docs, initial=0))
    width = 2 * heads * dim_k + value_heads * dim_v
    row = torch.randn(tokens, width, generator=gen)  # [T, q heads | k heads | v heads]
    if not case.l2norm:  # the model normalises q and k before the call when the kernel does not
        qk = row[:, : 2 * heads * dim_k].reshape(tokens, 2 * heads, dim_k)
        row[:, : 2 * heads * dim_k] = l2norm(qk).reshape(tokens, -1)
    row = row.to(device=device, dtype=case.dtype)
    # head views of the packed row (token stride 2HK + HV V), or contiguous copies
    q = row[:, : heads * dim_k].view(tokens, heads, dim_k)
    k = row[:, heads * dim_k : 2 * heads * dim_k].view(tokens, heads, dim_k)
    v = row[:, 2 * heads * dim_k :].view(tokens, value_heads, dim_v)
    if not case.packed:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()

    # gates as the model makes them: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
    dt = torch.empty(value_heads).uniform_(1e-3, 0.1, generator=gen)
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus, as the model initialises it
    b = torch.randn(tokens, value_heads, generator=gen).to(case.dtype)
    if case.gates == "model":
        A_log = torch.empty(value_heads).uniform_(1.0, 16.0, generator=gen).log()
        a = torch.randn(tokens, value_heads, generator=gen)
    else:  # strongly decaying: resets (log decay of about -1000) between spans of mild decay
        A_log = torch.empty(value_heads).uniform_(1.0, 64.0, generator=gen).log()
        a = 4.0 * torch.randn(tokens, value_heads, generator=gen) + 2.0
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    if case.packed:  # any strides: g stored head-major
        g = g.t().contiguous().t()
    return {"q": q, "k": k, "v": v, "g": g.to(device), "beta": beta.to(device), "cu_seqlens": cu_seqlens}


def reference_stages(inputs: dict, case: Case):
    x = inputs
    return chunk_gdn_stages(x["q"][None], x["k"][None], x["v"][None], x["g"][None], x["beta"][None],
                            cu_seqlens=x["cu_seqlens"], use_qk_l2norm_in_kernel=case.l2norm,
                            compute_dtype=torch.float64)


def reference_wy(ref, v: torch.Tensor, beta: torch.Tensor, g_cum: torch.Tensor, magnitude: bool = False):
    """``(A, w, u)`` of the reference stages in float64 from the given ``g_cum`` (the kernel's input);
    ``magnitude``: ``w``, ``u`` from ``|A|``, ``|k|``, ``|v|``, ``|beta|`` (``sum_j |A_ij| |x_j|``)."""
    ci, tokens = ref.chunk_indices, v.shape[0]
    kc, vc, bc, gc = (to_chunks(t, ci) for t in (ref.k, v.double(), beta.double(), g_cum.double()))
    A = ut_transform(kc, bc, gc)
    if magnitude:
        A, kc, vc, bc = A.abs(), kc.abs(), vc.abs(), bc.abs()
    w, u = wy_representation(A, kc, vc, bc, gc)
    return tuple(from_chunks(t, ci, tokens) for t in (A, w, u))


def positions(ref, tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(covered, pos)``: tokens in a chunk, and each token's position in its chunk (-1 if none)."""
    pos = torch.full((tokens,), -1, dtype=torch.int64)
    for _, start, end in ref.chunk_indices.tolist():
        pos[start:end] = torch.arange(end - start)
    return (pos >= 0).to(device), pos.to(device)


# ----------------------------------------------------------------------------- comparisons




def assert_finite(t: torch.Tensor, what: str):
    bad = ~torch.isfinite(t)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {t.numel()} elements not finite (unwritten or overflow)"




# tf32 keeps 10 fraction bits of each fp32 factor, and the tensor cores truncate (no rounding): up to
# 2^-10 relative per factor, 2 * 2^-10 per product (the H200 showed 1.24x the round-to-nearest bound)
TF32_PRODUCT = 2.1 * 2.0**-10


def assert_one_rounding(got: torch.Tensor, want: torch.Tensor, what: str, slack: float | None = None,
                        dot_mag: torch.Tensor | None = None):
    """``got`` (input dtype) is ``want`` (float64) rounded once: every element within half a unit in
    the last place (round to nearest on the GPU; one unit in the CPU interpreter, which truncates)
    or 1e-5 of the largest magnitude, relative RMS at most the unit roundoff (fp32: <= 1e-5).
    With ``slack`` (an error of the inputs): relative RMS only, the bound plus ``slack``. With
    ``dot_mag`` (``sum_j |A_ij| |x_j|`` of a product computed in one tf32 pass on the GPU): each
    element's bound grows by ``TF32_PRODUCT * dot_mag`` and the relative RMS bound by its norm."""
    if got.dtype == torch.float32:
        return assert_rel_rms(got, want, 1e-5 + (slack or 0.0), what)
    extra = 0.0
    if slack is None:
        ulps = 1.0 if got.device.type == "cpu" else 0.5 * 1.01
        ulp = spacing(want.to(got.dtype))
        floor = 1e-5 * want.abs().max().item()
        err = (got.double() - want).abs()
        allowed = torch.clamp_min(ulps * ulp, floor)
        if dot_mag is not None:
            allowed = allowed + TF32_PRODUCT * dot_mag
            extra = TF32_PRODUCT * (dot_mag.norm() / want.norm().clamp_min(1e-300)).item()
        bad = err > allowed
        assert not bad.any(), (f"{what}: {int(bad.sum())} elements over the bound; "
                               f"worst {(err / allowed)[bad].max().item():.3f} x the bound")
    # truncation's relative error reaches twice the unit roundoff
    bound = UNIT_ROUNDOFF[got.dtype] * (2.0 if got.device.type == "cpu" else 1.0)
    return assert_rel_rms(got, want, bound + extra + (slack or 0.0), what)


# ----------------------------------------------------------------------------- tests


def run_stages(stages, inputs: dict, case: Case, chunk_indices: torch.Tensor):
    """The ``cumsum`` and ``wy`` stages of the backend's forward stage table."""
    x = inputs
    tokens, value_heads = x["v"].shape[:2]
    device = x["v"].device
    g_cum = stages.cumsum(x["g"], chunk_indices, torch.empty(tokens, value_heads, device=device))
    A = torch.empty(tokens, value_heads, CHUNK, device=device)
    w = torch.empty(tokens, value_heads, case.dim_k, dtype=case.dtype, device=device)
    u = torch.empty(tokens, value_heads, case.dim_v, dtype=case.dtype, device=device)
    stages.wy(x["k"], x["v"], x["beta"], g_cum, chunk_indices, A, w, u, use_qk_l2norm=case.l2norm)
    return g_cum, A, w, u


def check_stages(stages, case: Case, device: str, report: dict | None = None):
    inputs = make_inputs(case, device)
    ref = reference_stages(inputs, case)
    chunk_indices = ref.chunk_indices.to(device=device, dtype=torch.int32)
    tokens = inputs["v"].shape[0]
    covered, pos = positions(ref, tokens, device)
    g_cum, A, w, u = run_stages(stages, inputs, case, chunk_indices)
    report = {} if report is None else report

    # cumulative gate: bound of any summation order
    assert_finite(g_cum[covered], "g_cum")
    abs_cum = from_chunks(chunk_local_cumsum(to_chunks(inputs["g"].double().abs(), ref.chunk_indices)),
                          ref.chunk_indices, tokens)
    bound = 63 * 2.0**-24 * abs_cum[covered]
    err = (g_cum[covered].double() - ref.g_cum[covered]).abs()
    assert (err <= bound).all(), f"g_cum: error {(err / bound.clamp_min(1e-300)).max().item():.2f} x the bound"
    report["g_cum_err_over_bound"] = (err / bound.clamp_min(1e-300)).max().item()

    # A: written in full on every chunk row; exact diagonal and upper triangle
    A_c = A[covered]  # [Tc, HV, BT]
    assert_finite(A_c, "A")
    cols = torch.arange(CHUNK, device=device)
    p = pos[covered][:, None, None]
    assert (A_c[(cols > p).expand_as(A_c)] == 0).all(), "A: upper triangle / columns past the chunk not exactly 0"
    assert (A_c[(cols == p).expand_as(A_c)] == 1).all(), "A: diagonal not exactly 1"

    # stage by stage: the reference stages from the kernel's g_cum; A compared on its strictly
    # lower part (the exact unit diagonal would dilute the relative error)
    lower = (cols < p).expand_as(A_c)
    A_ref, w_ref, u_ref = reference_wy(ref, inputs["v"], inputs["beta"], g_cum)
    report["A"] = assert_rel_rms(A_c[lower], A_ref[covered][lower], 1e-5, "A")
    assert_finite(w[covered], "w")
    assert_finite(u[covered], "u")
    # 16-bit data on the GPU: w = A x, u = A y in one tf32 pass (wy.wy_precision), so each element
    # may also be off by the tf32 rounding of its products, bounded with |A| |x| and |A| |y|
    w_mag = u_mag = None
    if device != "cpu" and case.dtype != torch.float32:
        w_mag, u_mag = (t[covered] for t in reference_wy(ref, inputs["v"], inputs["beta"], g_cum, magnitude=True)[1:])
    report["w"] = assert_one_rounding(w[covered], w_ref[covered], "w", dot_mag=w_mag)
    report["u"] = assert_one_rounding(u[covered], u_ref[covered], "u", dot_mag=u_mag)

    # through the chain: chunk_gdn_stages' own A, w, u (float64 g_cum); g_cum's fp32 rounding
    # dG changes each decay exp(G_i - G_j) by a relative |dG_i - dG_j| <= 2 max |dG|
    slack = 2 * err.max().item()
    report["g_cum_max_abs_err"] = err.max().item()
    report["A_chain"] = assert_rel_rms(A_c[lower], ref.A[covered][lower], 1e-5 + slack, "A (chain)")
    report["w_chain"] = assert_one_rounding(w[covered], ref.w[covered], "w (chain)", slack=slack)
    report["u_chain"] = assert_one_rounding(u[covered], ref.u[covered], "u (chain)", slack=slack)

    if device != "cpu":  # bitwise repeatable (the interpreter is trivially so)
        again = run_stages(stages, inputs, case, chunk_indices)
        for name, first, second in zip(("g_cum", "A", "w", "u"), (g_cum, A, w, u), again, strict=True):
            assert torch.equal(first[covered], second[covered]), f"{name}: a second run differs"
    return report


@pytest.mark.parametrize("case", CASES, ids=str)
def test_stages_against_reference(case, device, forward_stages):
    check_stages(forward_stages, case, device)


@pytest.mark.gpu
def test_model_geometry(forward_stages):
    """(H, HV) = (16, 48), K = V = 128, bf16, L2 norm, strong gates, 4096 tokens in five documents."""
    check_stages(forward_stages, MODEL, "cuda")


def test_no_chunks_is_a_no_op(device, forward_stages):
    g = torch.zeros(0, 3, device=device)
    chunk_indices = torch.zeros(0, 3, dtype=torch.int32, device=device)
    assert forward_stages.cumsum(g, chunk_indices, torch.zeros(0, 3, device=device)).shape == (0, 3)
    k = torch.zeros(0, 1, 16, device=device)
    v = torch.zeros(0, 3, 16, device=device)
    out = forward_stages.wy(k, v, g, g, chunk_indices, torch.zeros(0, 3, CHUNK, device=device), torch.zeros_like(v),
                            torch.zeros_like(v))
    assert [t.shape[0] for t in out] == [0, 0, 0]
