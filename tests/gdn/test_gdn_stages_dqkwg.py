"""Gated DeltaNet backward stage ``dqkwg`` of each fused backend's backward stage table (the
``backward_stages`` fixture, from the registry): dq, dk, dw and the gate gradient from o and the
state update.

The stage (Triton's ``launch_dqkwg``) is fed the fp64 reference's own intermediates: the forward
stages (``chunk_gdn_stages``: ``h``, ``v_new``, ``w``), then ``chunk_dv_local`` and
``chunk_state_backward`` for ``dh`` and ``dv_new`` from a random ``do`` (and a random
``dht`` in some cases), each cast to the test dtype. The oracle is ``chunk_dqkwg`` in fp64
on those same dtype-rounded values (``h``, ``dh``, ``v_new``, ``dv_new``, ``do``; q and k are
dtype values normalised in fp64), so the error measured is the stage's own. Its padded gate
is ``chunk_local_cumsum(to_chunks(g))`` (flat past a chunk's end, as
``chunk_gdn_backward_reference`` makes it); the kernel reads the packed fp32 ``g_cum``. The
reference puts ``G_last``'s gradient at position ``C - 1`` of a padded chunk; the kernel at the
chunk's last token: the test folds the padding positions (which hold only that term) into the
last valid one before ``from_chunks``.

Tolerances (relative RMS over the whole tensor, which must be finite: outputs are allocated
NaN-poisoned by the conftest, so an unwritten element fails):

* fp32 inputs (full fp32 dots, ``input_precision="ieee"``): ``<= max(1e-5, 2^-24 * max|G|)``
  for every output, as the forward stages: the kernel reads ``G`` rounded to fp32 (each value
  off by up to ``2^-24 |G|``) and exponentiates differences of it. Observed on the CPU:
  ``dq``, ``dk``, ``dw`` <= 4.8e-7; ``dg`` <= 3.0e-7 with the model's gates and up to 2.1e-5
  with the strong ones (``max|G|`` ~ 700 .. 3800, bounds 4.3e-5 .. 2.3e-4).
* bf16 inputs (single-pass bf16 dots, fp32 accumulation): ``dq``, ``dk``, ``dw`` ``<= 3e-3``,
  the observed error with a margin of about 1.7x. ``dw`` is an fp32 product of bf16 values
  rounded once to bf16 (at most 2^-9 relative per element); ``dq`` and ``dk`` lose the
  rounding of the masked ``dA_o`` (and its transpose, times the L2 norms) to bf16 where it
  enters a dot. Observed on the CPU: ``dq`` <= 1.8e-3, ``dk`` <= 1.7e-3, ``dw`` <= 1.8e-3
  (K = V = 128: 1.6e-3, 9e-5, 1.7e-3). ``dg`` keeps the fp32 bound: every term is reduced in
  fp32 from fp32 values (products of bf16 inputs are exact in fp32; ``ds`` uses the unrounded
  ``dA_o``), so the bf16 inputs cost it nothing beyond fp32 arithmetic. Observed: <= 3.1e-7
  with the model's gates, 2.1e-5 with the strong.

On the CPU, Triton's interpreter would multiply bf16 dot operands as integer bit patterns and
truncate fp32 -> bf16 conversions; the launcher then widens bf16 dot operands to fp32 (exact)
and rounds to nearest even on the bits (``common.dot``, ``common.round_to`` in ``dsfuse.gdn.triton.common``), so the CPU tests
check the GPU's numerics. The same tests run on the GPU (``device`` "cuda") with the same bounds.

Also: two launches give the same bits; a launch with no chunk writes nothing; every tensor
with its own token stride gives the same results and writes only its own heads.

Sizes: K = 32, V = 64 (K != V: one key and one value block per program) in the main tests;
K = V = 128 (the model's: two key and two value blocks of 64 per program) once, in bf16 (and
in fp32 on the CPU only, see ``HEAD_DIMS_128``).
Layouts: one sequence of T = 150 (not a multiple of 64) and packed documents of 1, 45, 0 and
130 tokens (T = 176: every token in a document, as the public API requires), (H, HV) = (2, 2),
(2, 6), (1, 3); q and k as head views of a wider packed buffer, ``v_new``, ``do``, ``dv_new`` as
head views of wider buffers (token stride != HV * V). Gates as the model makes them
(``gdn_gates``), mild and strongly decaying.
"""

from __future__ import annotations

import pytest
import torch
from dsfuse.gdn import chunk_gdn_stages, chunk_local_cumsum, from_chunks, to_chunks
from dsfuse.gdn.reference_backward import (
    chunk_dqkwg,
    chunk_dv_local,
    chunk_state_backward,
)
from gdn_stage_inputs import DK, DTYPES, DV, F64, head_view, qk_views
from gdn_stage_inputs import make_inputs as stage_inputs
from helpers import assert_bitwise, assert_rel_rms

FP32_RMS = 1e-5
BF16_RMS = 3e-3  # observed <= 1.8e-3 (module docstring)

# (layout, (H, HV), l2 norm, dht, gates): every flag on and off, every head group in both layouts
CASES = [
    ("one_seq_T150", (2, 2), False, False, "model"),
    ("one_seq_T150", (2, 6), True, True, "strong"),
    ("one_seq_T150", (1, 3), True, False, "model"),
    ("docs_1_45_0_130", (2, 2), True, True, "strong"),
    ("docs_1_45_0_130", (2, 6), False, True, "model"),
    ("docs_1_45_0_130", (1, 3), True, False, "strong"),
]


def case_id(case):
    layout, (h, hv), l2, dht, gates = case
    return f"{layout.split('_')[0]}-H{h}_HV{hv}-{'l2' if l2 else 'raw'}-{'dht' if dht else 'nodht'}-{gates}"


# ----------------------------------------------------------------------------- inputs


def make_inputs(layout, heads, *, l2, with_dht, gates, dtype, seed=0, dk=DK, dv=DV):
    """Forward inputs, ``do`` ``[T, HV, V]`` and ``dht`` ``[N, HV, K, V]`` (or None): see
    ``gdn_stage_inputs.make_inputs``."""
    forward, draws = stage_inputs(layout, heads, l2=l2, gates=gates, dtype=dtype, seed=seed, dk=dk, dv=dv,
                                  extra=("do", "dht") if with_dht else ("do",))
    return forward, draws["do"], draws.get("dht")


def fold_padding(dg_c, chunk_indices):
    """Padded ``dG`` ``[NC, HV, C]``: each chunk's padding positions added to its last valid one."""
    dg_c = dg_c.clone()
    for c, (_, start, end) in enumerate(chunk_indices.tolist()):
        n = end - start
        dg_c[c, :, n - 1] += dg_c[c, :, n:].sum(-1)
        dg_c[c, :, n:] = 0
    return dg_c


class Prepared:
    """The fp64 reference of one case and the kernel's inputs on ``device`` in ``dtype``."""

    def __init__(self, inputs, do, dht, l2, device, dtype, scale=None):
        self.device, self.dtype, self.l2 = device, dtype, l2
        cu = inputs["cu_seqlens"]
        st = chunk_gdn_stages(**inputs, scale=scale, use_qk_l2norm_in_kernel=l2, compute_dtype=F64)
        self.scale = inputs["q"].shape[-1] ** -0.5 if scale is None else scale
        ci = st.chunk_indices
        tokens = st.q.shape[0]
        # the fp64 backward up to this stage: dh and dv_new from do (and dht)
        gcum = chunk_local_cumsum(to_chunks(inputs["g"][0].to(F64), ci))  # flat past each chunk's end
        qc, kc, wc = (to_chunks(x, ci) for x in (st.q, st.k, st.w))
        do_c = to_chunks(do.to(F64), ci)
        dv_local = chunk_dv_local(qc, kc, do_c, gcum, self.scale)
        dh, dv_new, _ = chunk_state_backward(qc, kc, wc, do_c, dv_local, gcum, ci, len(cu) - 1, self.scale,
                                             None if dht is None else dht.to(F64))
        dv_new = from_chunks(dv_new, ci, tokens)

        # the kernel's inputs, in the test dtype
        self.chunk_indices = ci.to(torch.int32).to(device)
        self.q, self.k = qk_views(inputs["q"][0], inputs["k"][0], device, dtype)
        self.v_new, self.do, self.dv_new = (head_view(x, device, dtype) for x in (st.v_new, do, dv_new))
        self.h, self.dh = (x.to(dtype).to(device).contiguous() for x in (st.h, dh))
        self.g_cum = st.g_cum.float().to(device)
        self.max_g = gcum.abs().max().item() if gcum.numel() else 0.0

        # the oracle on the same rounded values
        v_new_c, dv_new_c = (to_chunks(x.cpu().to(F64), ci) for x in (self.v_new, self.dv_new))
        h64, dh64 = (x.cpu().to(F64) for x in (self.h, self.dh))
        do_c = to_chunks(self.do.cpu().to(F64), ci)
        dq, dk, dw, dg = chunk_dqkwg(qc, kc, v_new_c, h64, dh64, do_c, dv_new_c, gcum, self.scale)
        self.want = {"dq": from_chunks(dq, ci, tokens), "dk": from_chunks(dk, ci, tokens),
                     "dw": from_chunks(dw, ci, tokens), "dg": from_chunks(fold_padding(dg, ci), ci, tokens)}

    def tol(self, name):
        """``dg``'s bound is fp32 arithmetic's for every input dtype (its sums are fp32 throughout)."""
        if self.dtype == torch.bfloat16 and name != "dg":
            return BF16_RMS
        return max(FP32_RMS, 2.0**-24 * self.max_g)

    def run(self, stages):
        tokens, hv, dk = self.v_new.shape[0], self.v_new.shape[1], self.q.shape[-1]
        dq = torch.empty(tokens, hv, dk, dtype=torch.float32, device=self.device)
        dk_ = torch.empty(tokens, hv, dk, dtype=torch.float32, device=self.device)
        dw = torch.empty(tokens, hv, dk, dtype=self.dtype, device=self.device)
        dg = torch.empty(tokens, hv, dtype=torch.float32, device=self.device)
        out = stages.dqkwg(self.q, self.k, self.v_new, self.h, self.dh, self.do, self.dv_new, self.g_cum,
                           self.chunk_indices, self.scale, dq, dk_, dw, dg, use_qk_l2norm=self.l2)
        return dict(zip(("dq", "dk", "dw", "dg"), out, strict=True))


# ----------------------------------------------------------------------------- comparisons






def check(stages, p: Prepared) -> dict:
    got = p.run(stages)
    assert got["dq"].dtype == got["dk"].dtype == got["dg"].dtype == torch.float32
    assert got["dw"].dtype == p.dtype
    return {name: assert_rel_rms(got[name], p.want[name], p.tol(name), name) for name in ("dq", "dk", "dw", "dg")}


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_dqkwg(case, dtype, device, backward_stages):
    layout, heads, l2, with_dht, gates = case
    inputs, do, dht = make_inputs(layout, heads, l2=l2, with_dht=with_dht, gates=gates, dtype=DTYPES[dtype],
                                  seed=CASES.index(case))
    check(backward_stages, Prepared(inputs, do, dht, l2, device, DTYPES[dtype], scale=0.3 if l2 else None))


# bf16 everywhere; fp32 only in the interpreter: on a GPU its full-fp32 (FMA) dots at K = V = 128
# take Triton minutes to compile (4.4 min on this CPU), and the fp32 path is the same code as at
# K = 32, V = 64 (test_dqkwg), the blocking the same as bf16's
HEAD_DIMS_128 = [("bf16", "cpu"), pytest.param("bf16", "cuda", marks=pytest.mark.gpu), ("fp32", "cpu")]


@pytest.mark.parametrize("dtype,device", HEAD_DIMS_128)
def test_head_dims_128(dtype, device, backward_stages):
    """The model's K = V = 128: two key blocks and two value blocks per program."""
    inputs, do, dht = make_inputs("docs_1_45_0_130", (1, 3), l2=True, with_dht=True, gates="model",
                                  dtype=DTYPES[dtype], seed=11, dk=128, dv=128)
    check(backward_stages, Prepared(inputs, do, dht, True, device, DTYPES[dtype]))


def test_distinct_token_strides(device, backward_stages):
    """Every tensor with its own token stride: ``do`` dense, ``dv_new`` a view of a wider buffer
    than ``v_new``'s, ``g_cum`` a column view, ``dq`` / ``dk`` / ``dw`` / ``dg`` views of wider
    outputs."""
    inputs, do, dht = make_inputs("docs_1_45_0_130", (2, 6), l2=True, with_dht=True, gates="strong",
                                  dtype=torch.float32, seed=3)
    p = Prepared(inputs, do, dht, True, device, torch.float32)
    p.do = p.do.contiguous()
    tokens, hv, dv = p.dv_new.shape
    buf = torch.zeros(tokens, hv + 3, dv, device=device)
    buf[:, 1:hv + 1] = p.dv_new
    p.dv_new = buf[:, 1:hv + 1]
    g_buf = torch.zeros(tokens, hv + 2, device=device)
    g_buf[:, 2:] = p.g_cum
    p.g_cum = g_buf[:, 2:]
    dk_ = p.q.shape[-1]
    bufs = [torch.empty(tokens, hv + n, dk_, device=device) for n in (1, 2, 3)]
    bufs.append(torch.empty(tokens, hv + 1, device=device))
    outs = [bufs[0][:, :hv], bufs[1][:, :hv], bufs[2][:, 3:], bufs[3][:, 1:]]
    assert len({x.stride(0) for x in (p.q, p.v_new, p.do, p.dv_new, p.g_cum, *outs[1:])}) == 8
    got = backward_stages.dqkwg(p.q, p.k, p.v_new, p.h, p.dh, p.do, p.dv_new, p.g_cum, p.chunk_indices, p.scale,
                                *outs, use_qk_l2norm=True)
    for name, x in zip(("dq", "dk", "dw", "dg"), got, strict=True):
        assert_rel_rms(x, p.want[name], p.tol(name), name)
    # the other heads of the output buffers are left as allocated (NaN-poisoned by the conftest)
    for rest in (bufs[0][:, hv:], bufs[1][:, hv:], bufs[2][:, :3], bufs[3][:, :1]):
        assert torch.isnan(rest).all()


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_deterministic(dtype, device, backward_stages):
    """Two launches give the same bits."""
    inputs, do, dht = make_inputs("docs_1_45_0_130", (1, 3), l2=True, with_dht=True, gates="strong",
                                  dtype=DTYPES[dtype], seed=5)
    p = Prepared(inputs, do, dht, True, device, DTYPES[dtype])
    first, second = p.run(backward_stages), p.run(backward_stages)
    for name in ("dq", "dk", "dw", "dg"):
        assert_bitwise(first[name], second[name], f"{name}: second launch")


def test_no_chunks(device, backward_stages):
    """No chunk at all (every document empty): the launch writes nothing."""
    tokens, h, hv = 5, 1, 3
    q = k = torch.zeros(tokens, h, DK, device=device)
    v = torch.zeros(tokens, hv, DV, device=device)
    states = torch.zeros(0, hv, DK, DV, device=device)
    g_cum = torch.zeros(tokens, hv, device=device)
    chunk_indices = torch.zeros(0, 3, dtype=torch.int32, device=device)
    outs = [torch.full((tokens, hv, DK), 7.0, device=device) for _ in range(3)] + [torch.full_like(g_cum, 7.0)]
    got = backward_stages.dqkwg(q, k, v, states, states, v, v, g_cum, chunk_indices, 0.5, *outs)
    for x in got:
        assert (x == 7.0).all()
