"""Gated DeltaNet backward stage through the WY representation (``wy_backward`` of each fused
backend's backward stage table: the ``backward_stages`` fixture, from the registry; Triton's
``launch_wy_backward``) against the chunked reference in fp64.

The stage is fed the reference's own intermediates: the forward stages of
``chunk_gdn_stages`` (fp64) give ``A`` and ``g_cum``; the backward stages of
``dsfuse.gdn.reference_backward`` before this one (``chunk_dv_local``,
``chunk_state_backward``, ``chunk_dqkwg``, from a random ``do``) give the real ``dw``, ``du``
(``= dv_new``) and ``dg_in`` (the gate gradient from the output and the state update). Each is
cast to what the kernel reads (``A``, ``g_cum``, ``dg_in`` fp32; ``k``, ``v``, ``beta``,
``dw``, ``du`` in the test dtype), and ``wy_backward`` followed by
``chunk_local_cumsum_backward`` runs in fp64 on the same cast values. The padded layout's
``G`` comes from ``chunk_local_cumsum(to_chunks(g))`` (flat past a chunk's end), as
``chunk_gdn_backward_reference`` makes it; ``dg_in``'s entry at a short chunk's padded
last position (the gradient of ``G_last``) moves to the chunk's last token, where the packed
layout keeps it (the reverse cumulative sum is the same). ``dk`` is in/out: it starts from a
random fp32 tensor (of ``dk_wy``'s size) and must end as that start plus ``dk_wy``.

Tolerances (relative RMS over every token; outputs are NaN-poisoned by the conftest, so an
unwritten element fails):

* fp32 inputs (full fp32 products): ``max(1e-5, 2^-22 max|G|)`` for every output. The kernel
  reads ``G`` in fp32, each value off by up to ``2^-24 |G|`` from the reference's fp64 sum, and
  exponentiates ``G`` and its differences, several decays to a term (``|G|`` up to about 3500
  with the strong gates here: a bound of 8e-4). Observed on the CPU: <= 2.7e-7 (model gates),
  <= 8.0e-5 (strong gates, ``dk``; ``dg`` 2.8e-5).
* bf16 inputs: one bf16 pass per product; the fp32 values that enter a product (``A``, ``dA``,
  ``A^T dA``, ``diag(beta) Q`` and its scalings, see the module) are rounded once to bf16
  (relative error <= 2^-9 each), the data tiles enter unrounded. Bounds (relative RMS, plus
  ``2^-22 max|G|`` for the fp32 ``G``), from the errors observed on the CPU with margin:
  ``dk`` (fp32 output) 4e-3, observed 2.6e-3 to 2.9e-3 with model gates (this file's cases,
  K = V = 128 included, and six more seeds each of two cases), 3.3e-4 and 1.8e-3 with strong
  gates; ``dg`` (fp32) 2.5e-3, observed 2.3e-4 to 1.3e-3; ``dv`` and ``dbeta`` (rounded once to
  bf16) 3e-3, observed <= 1.8e-3 and <= 2.1e-3, of which rounding the exact values to bf16 alone
  makes 1.55e-3 to 1.72e-3.

On the CPU, Triton's interpreter would multiply bf16 dot operands as integer bit patterns and
truncates fp32 -> bf16 conversions; the kernel widens bf16 dot operands to fp32 (exact) and
rounds on the bits there (``common.dot``, ``common.round_to`` in ``dsfuse.gdn.triton.common``), so the CPU tests check the GPU's
numerics. The same tests run on the GPU (``device`` "cuda") with the same bounds.

Exact (bf16, one value head, packed documents, strong gates): ``dg`` written over ``dg_in``
(the same tensor) equals ``dg`` written elsewhere, and two launches give the same bits.

Shapes: K = 32, V = 64 (K != V) and K = V = 128 once (two key and value blocks); one sequence of
T = 150 (not a multiple of 64) and packed documents of 1, 45, 0 and 130 tokens (T = 176);
(H, HV) in (2, 2), (2, 6), (1, 3); L2 norm in the kernel on and off; model and strongly
decaying gates (``tests/helpers.model_like_gates``); "packed" cases read k and v as head views
of one row (token stride 2HK + HV V) and every other tensor with padded or head-major strides.
"""

from __future__ import annotations

import pytest
import torch
from dsfuse.gdn import chunk_gdn_stages, chunk_local_cumsum, from_chunks, to_chunks
from dsfuse.gdn.reference_backward import (
    chunk_dqkwg,
    chunk_dv_local,
    chunk_local_cumsum_backward,
    chunk_state_backward,
    wy_backward,
)
from gdn_stage_inputs import DK, DTYPES, DV, F64
from gdn_stage_inputs import make_inputs as stage_inputs
from helpers import assert_bitwise, assert_rel_rms

FP32_RMS = 1e-5
# bf16 inputs, one bf16 pass per product: observed 2.9e-3 (dk), 1.3e-3 (dg), 1.8e-3 (dv), 2.1e-3 (dbeta)
BF16_RMS = {"dk": 4e-3, "dg": 2.5e-3, "dv": 3e-3, "dbeta": 3e-3}

# (layout, (H, HV), l2 norm, gates, packed strides)
CASES = [
    ("one_seq_T150", (2, 6), False, "model", False),
    ("one_seq_T150", (1, 3), True, "strong", True),
    ("docs_1_45_0_130", (2, 2), True, "model", True),
    ("docs_1_45_0_130", (1, 3), False, "strong", False),
]


def case_id(case):
    layout, (h, hv), l2, gates, packed = case
    return f"{layout.split('_')[0]}-H{h}_HV{hv}-{'l2' if l2 else 'raw'}-{gates}{'-packed' if packed else ''}"


# ----------------------------------------------------------------------------- inputs


def make_inputs(layout, heads, *, l2, gates, dtype, seed=0, dk=DK, dv=DV):
    """Forward inputs and ``do`` ``[T, HV, V]`` in fp64: see ``gdn_stage_inputs.make_inputs``."""
    forward, draws = stage_inputs(layout, heads, l2=l2, gates=gates, dtype=dtype, seed=seed, dk=dk, dv=dv,
                                  extra=("do64",))
    return forward, draws["do64"]


def fold_padding(xc: torch.Tensor, chunk_indices: torch.Tensor) -> torch.Tensor:
    """``[NC, HV, C]``: each chunk's entries past its end added to its last token's (a reverse
    cumulative sum over the chunk's tokens is unchanged), then zeroed."""
    out = xc.clone()
    for c, (_, start, end) in enumerate(chunk_indices.tolist()):
        n = end - start
        out[c, :, n - 1] += out[c, :, n:].sum(-1)
        out[c, :, n:] = 0
    return out


def strided(x: torch.Tensor, packed: bool) -> torch.Tensor:
    """``x`` with other strides (same values): ``[T, HV]`` head-major, ``[T, HV, D]`` inside a
    wider ``[T, HV, D + 16]`` buffer; or ``x`` contiguous."""
    if not packed:
        return x.contiguous()
    if x.dim() == 2:
        return x.t().contiguous().t()
    buf = torch.zeros(*x.shape[:2], x.shape[2] + 16, dtype=x.dtype, device=x.device)
    buf[..., : x.shape[2]] = x
    return buf[..., : x.shape[2]]


def packed_views(k, v, device, dtype):
    """k ``[T, H, K]`` and v ``[T, HV, V]`` as head views of one row ``[T, 2HK + HV V]`` (q, k, v)."""
    tokens, heads, dk = k.shape
    value_heads, dv = v.shape[1:]
    row = torch.zeros(tokens, 2 * heads * dk + value_heads * dv, dtype=dtype, device=device)
    row[:, heads * dk : 2 * heads * dk] = k.reshape(tokens, -1).to(dtype)
    row[:, 2 * heads * dk :] = v.reshape(tokens, -1).to(dtype)
    return (row[:, heads * dk : 2 * heads * dk].view(tokens, heads, dk),
            row[:, 2 * heads * dk :].view(tokens, value_heads, dv))


class Prepared:
    """The fp64 reference of one case and the kernel's inputs on ``device`` in ``dtype``."""

    def __init__(self, inputs, do, l2, device, dtype, packed=False, seed=0):
        self.l2, self.device, self.dtype = l2, device, dtype
        cu = inputs["cu_seqlens"]
        st = chunk_gdn_stages(**inputs, use_qk_l2norm_in_kernel=l2, compute_dtype=F64)
        ci = st.chunk_indices
        self.chunk_indices = ci.to(torch.int32).to(device)
        tokens = st.q.shape[0]
        scale = inputs["q"].shape[-1] ** -0.5
        # the padded layout's G: flat past each chunk's end (G_last at position C - 1)
        gcum = chunk_local_cumsum(to_chunks(inputs["g"][0].double(), ci))
        qc, kc, doc, w, v_new = (to_chunks(x, ci) for x in (st.q, st.k, do, st.w, st.v_new))
        dv_local = chunk_dv_local(qc, kc, doc, gcum, scale)
        dh, dv_new, _ = chunk_state_backward(qc, kc, w, doc, dv_local, gcum, ci, len(cu) - 1, scale)
        _, _, dw, dg_in = chunk_dqkwg(qc, kc, v_new, st.h, dh, doc, dv_new, gcum, scale)

        # what the kernel reads, cast; the reference runs on the same cast values
        f32 = torch.float32
        self.A = strided(st.A.to(f32).to(device), packed)
        self.g_cum = strided(st.g_cum.to(f32).to(device), packed)
        self.dg_in = strided(from_chunks(fold_padding(dg_in, ci), ci, tokens).to(f32).to(device), packed)
        self.beta = strided(inputs["beta"][0].to(dtype).to(device), packed)
        self.dw = strided(from_chunks(dw, ci, tokens).to(dtype).to(device), packed)
        self.du = strided(from_chunks(dv_new, ci, tokens).to(dtype).to(device), packed)
        k, v = inputs["k"][0], inputs["v"][0]
        if packed:
            self.k, self.v = packed_views(k, v, device, dtype)
        else:
            self.k, self.v = k.to(dtype).to(device).contiguous(), v.to(dtype).to(device).contiguous()

        up = [to_chunks(x.cpu().double(), ci) for x in (self.A, self.beta, self.dw, self.du, self.dg_in)]
        A_c, beta_c, dw_c, du_c, dg_in_c = up
        v_c = to_chunks(inputs["v"][0].double(), ci)
        dk_wy, dv, dbeta, dg_wy = wy_backward(A_c, kc, v_c, beta_c, gcum, dw_c, du_c)
        dg = chunk_local_cumsum_backward(dg_in_c + dg_wy)
        self.want = {name: from_chunks(x, ci, tokens)
                     for name, x in (("dk", dk_wy), ("dv", dv), ("dbeta", dbeta), ("dg", dg))}
        gen = torch.Generator().manual_seed(seed + 1000)
        rms = self.want["dk"].pow(2).mean().sqrt().item()
        self.dk_start = strided((rms * torch.randn(self.want["dk"].shape, generator=gen)).to(device), packed)
        self.packed = packed
        self.max_g = st.g_cum.abs().max().item()

    def outputs(self, dg_alias=False):
        dk = self.dk_start.clone() if not self.packed else strided(self.dk_start.clone(), True)
        dv = strided(torch.empty(self.du.shape, dtype=self.dtype, device=self.device), self.packed)
        dbeta = strided(torch.empty(self.beta.shape, dtype=self.dtype, device=self.device), self.packed)
        if dg_alias:
            dg_in = self.dg_in.clone()
            return dk, dv, dbeta, dg_in, dg_in
        dg = strided(torch.empty(self.g_cum.shape, device=self.device), self.packed)
        return dk, dv, dbeta, self.dg_in, dg

    def run(self, stages, dg_alias=False):
        dk, dv, dbeta, dg_in, dg = self.outputs(dg_alias)
        out = stages.wy_backward(self.k, self.v, self.beta, self.A, self.g_cum, self.dw, self.du, dg_in,
                                 self.chunk_indices, dk, dv, dbeta, dg, use_qk_l2norm=self.l2)
        assert out[0] is dk and out[1] is dv and out[2] is dbeta and out[3] is dg
        return dk, dv, dbeta, dg

    def gate_slack(self):
        """Relative error allowed for ``G`` read in fp32 (``2^-24 |G|`` each, in exponents)."""
        return 2.0**-22 * self.max_g

    def check(self, dk, dv, dbeta, dg):
        slack = self.gate_slack()
        if self.dtype == torch.float32:
            tol = dict.fromkeys(BF16_RMS, max(FP32_RMS, slack))
        else:
            tol = {name: bound + slack for name, bound in BF16_RMS.items()}
        assert dk.dtype == torch.float32 and dg.dtype == torch.float32
        assert dv.dtype == self.dtype and dbeta.dtype == self.dtype
        errs = {
            "dk": assert_rel_rms(dk.double().cpu() - self.dk_start.double().cpu(), self.want["dk"], tol["dk"], "dk"),
            "dv": assert_rel_rms(dv, self.want["dv"], tol["dv"], "dv"),
            "dbeta": assert_rel_rms(dbeta, self.want["dbeta"], tol["dbeta"], "dbeta"),
            "dg": assert_rel_rms(dg, self.want["dg"], tol["dg"], "dg"),
        }
        # dk in/out: start + dk_wy (not only the difference)
        assert_rel_rms(dk, self.dk_start.double().cpu() + self.want["dk"], tol["dk"], "dk (start + dk_wy)")
        return errs


# ----------------------------------------------------------------------------- comparisons






# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_wy_backward(case, dtype, device, backward_stages):
    layout, heads, l2, gates, packed = case
    seed = CASES.index(case)
    inputs, do = make_inputs(layout, heads, l2=l2, gates=gates, dtype=DTYPES[dtype], seed=seed)
    p = Prepared(inputs, do, l2, device, DTYPES[dtype], packed=packed, seed=seed)
    p.check(*p.run(backward_stages))


def test_head_dims_128(device, backward_stages):
    """The model's K = V = 128: two key and two value blocks per program."""
    inputs, do = make_inputs("one_seq_T150", (1, 3), l2=True, gates="model", dtype=torch.bfloat16, seed=11,
                             dk=128, dv=128)
    p = Prepared(inputs, do, True, device, torch.bfloat16, packed=True, seed=11)
    p.check(*p.run(backward_stages))


def test_dg_over_dg_in_and_determinism(device, backward_stages):
    """``dg`` written over ``dg_in`` equals ``dg`` written elsewhere; two launches, the same bits (bf16)."""
    inputs, do = make_inputs("docs_1_45_0_130", (1, 1), l2=True, gates="strong", dtype=torch.bfloat16, seed=5)
    p = Prepared(inputs, do, True, device, torch.bfloat16, packed=False, seed=5)
    first = p.run(backward_stages)
    second = p.run(backward_stages)
    for name, a, b in zip(("dk", "dv", "dbeta", "dg"), first, second, strict=True):
        assert_bitwise(a, b, f"{name}: second launch")
    aliased = p.run(backward_stages, dg_alias=True)
    for name, a, b in zip(("dk", "dv", "dbeta", "dg"), first, aliased, strict=True):
        assert_bitwise(a, b, f"{name}: dg over dg_in")
    p.check(*aliased)


def test_no_chunks(device, backward_stages):
    """No chunk at all (every document empty): nothing is launched, nothing written."""
    tokens, h, hv = 0, 1, 3
    k = torch.zeros(tokens, h, DK, device=device)
    v = torch.zeros(tokens, hv, DV, device=device)
    vec = torch.zeros(tokens, hv, device=device)
    A = torch.zeros(tokens, hv, 64, device=device)
    dk, dv = torch.zeros(tokens, hv, DK, device=device), torch.zeros_like(v)
    chunk_indices = torch.zeros(0, 3, dtype=torch.int32, device=device)
    out = backward_stages.wy_backward(k, v, vec, A, vec, dk, dv, vec, chunk_indices, dk, dv, vec.clone(),
                                      vec.clone())
    assert [t.shape[0] for t in out] == [0, 0, 0, 0]
