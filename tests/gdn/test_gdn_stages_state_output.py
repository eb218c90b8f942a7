"""Gated DeltaNet forward stages ``state`` (the state pass) and ``output`` of each fused backend's
forward stage table (the ``forward_stages`` fixture, from the registry), against the chunked
reference.

Each stage is fed the reference's own intermediates (``chunk_gdn_stages`` in fp64, the
inputs the stage reads cast to the test dtype) and compared with the matching reference stage
(``chunk_state_pass``: ``h``, ``v_new``, ``final_state``; ``chunk_output``: ``o``). An
end-to-end test chains the reference's cumulative gate and WY outputs through both kernels and
compares ``o`` and the final state with the fp64 token-by-token recurrence.

Tolerances (relative RMS over the whole tensor, which must be finite: outputs are allocated
NaN-poisoned by the conftest, so an unwritten element fails):

* bf16 inputs (q, k, v, beta hold bf16 values; the reference starts from the same values):
  ``<= 5e-3`` for every output (``h``, ``v_new``, ``final_state``, ``o``). Rounding the stored
  intermediates the stages read (``w``, ``u``; ``h``, ``v_new``) and write costs about 1.7e-3
  each; the bf16 dot operands (L2-normalised q and k, the masked ``q k^T * Gamma``, the decayed
  ``v_new``) add the rest. Observed on the CPU: ``o`` <= 3.9e-3 (stage and end to end),
  ``h`` <= 3.4e-3, ``v_new`` and the final state <= 2.5e-3.
* fp32 inputs (the kernels multiply in full fp32, ``input_precision="ieee"``, no TF32):
  ``<= max(1e-5, 2^-24 * max|G|)`` with ``G`` the within-chunk cumulative gate. The stages read
  ``G`` in fp32, each value off by up to ``2^-24 |G|`` absolutely, and exponentiate its
  differences: with model gates the bound is 1e-5, with strongly decaying gates
  (``|G| ~ 10^3 .. 10^4``) it grows as the reference's own fp32 error does
  (tests/gdn/test_gdn_reference.py). Observed on the CPU: <= 4.8e-7 per stage, 1.0e-6 end to end.

On the CPU, Triton's interpreter would multiply bf16 dot operands as integer bit patterns and
truncates fp32 -> bf16 conversions; the launchers then widen bf16 dot operands to fp32 (exact)
and round to nearest even on the bits (``common.dot``, ``common.round_to`` in ``dsfuse.gdn.triton.common``), so the CPU tests check
the GPU's numerics. The same tests run on the GPU (``device`` "cuda") with the same bounds.

Exact: tokens past ``cu_seqlens[-1]`` get ``v_new = o = 0``; an empty document's final state
is its initial state bit for bit; two runs give the same bits.

Sizes: K = 32, V = 64 (K != V, so a transposed state cannot pass; the state pass then runs two
value blocks, the output one) in the main tests; K = V = 128 (the model's), K = 16 / V = 32 and
K = 64 / V = 16 in one test each. Layouts and head groups as tests/gdn/test_gdn_reference.py: one
sequence of T = 150 (not a multiple of 64) and packed documents of 1, 45, 0 and 130 tokens
followed by 4 tokens in no document, (H, HV) = (2, 2), (2, 6), (1, 3); q and k as head views
of a wider packed buffer in the packed layout (token stride != H * K). Gates as the model makes
them (``gdn_gates``), mild and strongly decaying.
"""

from __future__ import annotations


import pytest
import torch
from dsfuse.gdn import (
    chunk_gdn_stages,
    naive_recurrent_gdn,
    prepare_chunk_offsets,
)
from gdn_stage_inputs import DK, DTYPES, DV, F64, qk_views
from gdn_stage_inputs import make_inputs as stage_inputs
from helpers import assert_bitwise, assert_rel_rms, rel_rms

BF16_RMS = 5e-3
FP32_RMS = 1e-5

# (layout, (H, HV), l2 norm, initial state, final state, gates): every flag on and off,
# every head group in both layouts
CASES = [
    ("one_seq_T150", (2, 2), False, False, True, "model"),
    ("one_seq_T150", (2, 6), True, True, True, "strong"),
    ("one_seq_T150", (1, 3), True, False, False, "model"),
    ("docs_1_45_0_130_tail4", (2, 2), True, True, False, "strong"),
    ("docs_1_45_0_130_tail4", (2, 6), False, True, True, "model"),
    ("docs_1_45_0_130_tail4", (1, 3), True, True, True, "model"),
    ("docs_1_45_0_130_tail4", (2, 6), True, False, True, "strong"),
]


def case_id(case):
    layout, (h, hv), l2, h0, ht, gates = case
    return (f"{layout.split('_')[0]}-H{h}_HV{hv}-{'l2' if l2 else 'raw'}-{'h0' if h0 else 'zero'}"
            f"-{'ht' if ht else 'noht'}-{gates}")


# ----------------------------------------------------------------------------- inputs


def make_inputs(layout, heads, *, l2, with_h0, gates, dtype, seed=0, dk=DK, dv=DV):
    """Forward inputs with an fp32 initial state (or None): see ``gdn_stage_inputs.make_inputs``."""
    forward, draws = stage_inputs(layout, heads, l2=l2, gates=gates, dtype=dtype, seed=seed, dk=dk, dv=dv,
                                  extra=("h0",) if with_h0 else ())
    return forward | {"initial_state": draws.get("h0")}


class Prepared:
    """The fp64 reference stages of one case and the kernels' inputs on ``device`` in ``dtype``."""

    def __init__(self, inputs, l2, device, dtype, scale=None):
        self.inputs, self.l2, self.device, self.dtype = inputs, l2, device, dtype
        cu = inputs["cu_seqlens"]
        self.ref = chunk_gdn_stages(**inputs, scale=scale, use_qk_l2norm_in_kernel=l2, compute_dtype=F64)
        self.scale = inputs["q"].shape[-1] ** -0.5 if scale is None else scale
        self.chunk_indices = self.ref.chunk_indices.to(torch.int32).to(device)
        self.chunk_offsets = prepare_chunk_offsets(cu).to(torch.int32).to(device)
        self.q, self.k = qk_views(inputs["q"][0], inputs["k"][0], device, dtype)
        self.g_cum = self.ref.g_cum.float().to(device)
        self.w, self.u = (x.to(dtype).to(device) for x in (self.ref.w, self.ref.u))
        h0 = inputs["initial_state"]
        self.h0 = None if h0 is None else h0.float().to(device)
        self.num_seqs = len(cu) - 1
        self.tail = cu[-1]
        self.max_g = self.ref.g_cum.abs().max().item() if self.ref.g_cum.numel() else 0.0

    def tol(self):
        if self.dtype == torch.bfloat16:
            return BF16_RMS
        return max(FP32_RMS, 2.0**-24 * self.max_g)

    def state_outputs(self, final):
        tokens, hv, dk, dv = self.u.shape[0], self.u.shape[1], self.w.shape[-1], self.u.shape[-1]
        nc = self.chunk_indices.shape[0]
        h = torch.empty(nc, hv, dk, dv, dtype=self.dtype, device=self.device)
        v_new = torch.empty(tokens, hv, dv, dtype=self.dtype, device=self.device)
        ht = torch.empty(self.num_seqs, hv, dk, dv, dtype=torch.float32, device=self.device) if final else None
        return h, v_new, ht

    def run_state(self, stages, final=True):
        h, v_new, ht = self.state_outputs(final)
        stages.state(self.k, self.w, self.u, self.g_cum, self.chunk_indices, self.chunk_offsets, self.h0,
                          h, v_new, ht, use_qk_l2norm=self.l2)
        return h, v_new, ht

    def run_output(self, stages, h, v_new):
        o = torch.empty(v_new.shape, dtype=self.dtype, device=self.device)
        return stages.output(self.q, self.k, v_new, h, self.g_cum, self.chunk_indices, self.scale, o,
                             use_qk_l2norm=self.l2)


# ----------------------------------------------------------------------------- comparisons






def assert_tail_zero(x, tail, what):
    rest = x[tail:]
    assert_bitwise(rest.cpu(), torch.zeros_like(rest).cpu(), f"{what} past cu_seqlens[-1]")


# ----------------------------------------------------------------------------- state pass


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_state_pass(case, dtype, device, forward_stages):
    layout, heads, l2, with_h0, final, gates = case
    inputs = make_inputs(layout, heads, l2=l2, with_h0=with_h0, gates=gates, dtype=DTYPES[dtype],
                         seed=CASES.index(case))
    p = Prepared(inputs, l2, device, DTYPES[dtype])
    h, v_new, ht = p.run_state(forward_stages, final)
    tol = p.tol()
    assert h.dtype == p.dtype and v_new.dtype == p.dtype
    assert_rel_rms(h, p.ref.h, tol, "h")
    assert_rel_rms(v_new, p.ref.v_new, tol, "v_new")
    assert_tail_zero(v_new, p.tail, "v_new")
    if final:
        assert ht.dtype == torch.float32
        assert_rel_rms(ht, p.ref.final_state, tol, "final state")
        if layout.startswith("docs"):  # document 2 is empty
            want = p.h0[2] if p.h0 is not None else torch.zeros_like(ht[2])
            assert_bitwise(ht[2], want, "an empty document's final state")


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_state_pass_without_h_and_v_new_gives_the_same_final_state(dtype, device, forward_stages):
    """The pass the long-document split runs for its segments' final states and maps: ``h`` and
    ``v_new`` None (not written), the final state bitwise that of the full pass (documents with an
    empty one, a tail past cu_seqlens[-1], an initial state, the L2 norm)."""
    case = next(c for c in CASES if c[0].startswith("docs") and c[2] and c[3] and c[4])
    layout, heads, l2, with_h0, _, gates = case
    inputs = make_inputs(layout, heads, l2=l2, with_h0=with_h0, gates=gates, dtype=DTYPES[dtype], seed=5)
    p = Prepared(inputs, l2, device, DTYPES[dtype])
    _, _, want = p.run_state(forward_stages)
    got = torch.full_like(want, float("nan"))
    forward_stages.state(p.k, p.w, p.u, p.g_cum, p.chunk_indices, p.chunk_offsets, p.h0, None, None, got,
                         use_qk_l2norm=l2)
    assert_bitwise(got, want, "final state with h and v_new not written")


# ----------------------------------------------------------------------------- output


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_output(case, dtype, device, forward_stages):
    layout, heads, l2, with_h0, _, gates = case
    inputs = make_inputs(layout, heads, l2=l2, with_h0=with_h0, gates=gates, dtype=DTYPES[dtype],
                         seed=CASES.index(case))
    p = Prepared(inputs, l2, device, DTYPES[dtype], scale=0.3 if l2 else None)
    h, v_new = (x.to(p.dtype).to(device) for x in (p.ref.h, p.ref.v_new))
    o = p.run_output(forward_stages, h, v_new)
    assert o.dtype == p.dtype
    assert_rel_rms(o, p.ref.o, p.tol(), "o")
    assert_tail_zero(o, p.tail, "o")


# ----------------------------------------------------------------------------- end to end


def check_end_to_end(stages, inputs, l2, device, dtype):
    """Reference cumsum / WY outputs -> state pass -> output, against the fp64 recurrence; twice, bitwise."""
    p = Prepared(inputs, l2, device, dtype)
    h, v_new, ht = p.run_state(stages)
    o = p.run_output(stages, h, v_new)
    want_o, want_ht = naive_recurrent_gdn(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=l2,
                                          compute_dtype=F64)
    tol = p.tol()
    assert_rel_rms(o, want_o[0], tol, "o")
    assert_rel_rms(ht, want_ht, tol, "final state")
    assert_tail_zero(o, p.tail, "o")
    h2, v_new2, ht2 = p.run_state(stages)
    o2 = p.run_output(stages, h2, v_new2)
    for name, a, b in (("h", h, h2), ("v_new", v_new, v_new2), ("final state", ht, ht2), ("o", o, o2)):
        assert_bitwise(a, b, f"{name}: second run")
    return {"o": rel_rms(o, want_o[0]), "final_state": rel_rms(ht, want_ht)}


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("heads,gates", [((2, 6), "model"), ((1, 3), "strong")], ids=["H2_HV6-model", "H1_HV3-strong"])
def test_end_to_end(heads, gates, dtype, device, forward_stages):
    inputs = make_inputs("docs_1_45_0_130_tail4", heads, l2=True, with_h0=True, gates=gates, dtype=DTYPES[dtype],
                         seed=7)
    check_end_to_end(forward_stages, inputs, True, device, DTYPES[dtype])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("dims", [(128, 128), (16, 32), (64, 16)], ids=lambda d: f"K{d[0]}_V{d[1]}")
def test_head_dims(dims, dtype, device, forward_stages):
    """The model's K = V = 128 (four state value blocks, two output ones) and the small head dims."""
    dk, dv = dims
    inputs = make_inputs("docs_1_45_0_130_tail4", (1, 3), l2=True, with_h0=True, gates="model",
                         dtype=DTYPES[dtype], seed=11, dk=dk, dv=dv)
    check_end_to_end(forward_stages, inputs, True, device, DTYPES[dtype])


def test_no_chunks(device, forward_stages):
    """Every document empty (no chunk at all): v_new and o are zero everywhere, final state = initial state."""
    gen = torch.Generator().manual_seed(3)
    tokens, h, hv = 7, 1, 3
    q, k = (torch.randn(tokens, h, DK, generator=gen).to(device) for _ in range(2))
    w = torch.randn(tokens, hv, DK, generator=gen).to(device)
    u = torch.randn(tokens, hv, DV, generator=gen).to(device)
    g_cum = -torch.rand(tokens, hv, generator=gen).to(device)
    h0 = torch.randn(2, hv, DK, DV, generator=gen).to(device)
    chunk_indices = torch.zeros(0, 3, dtype=torch.int32, device=device)
    chunk_offsets = torch.zeros(3, dtype=torch.int32, device=device)
    h = torch.empty(0, hv, DK, DV, device=device)
    v_new = torch.empty(tokens, hv, DV, device=device)
    ht = torch.empty(2, hv, DK, DV, device=device)
    forward_stages.state(k, w, u, g_cum, chunk_indices, chunk_offsets, h0, h, v_new, ht)
    assert_bitwise(v_new, torch.zeros_like(v_new), "v_new")
    assert_bitwise(ht, h0, "final state")
    o = torch.empty(tokens, hv, DV, device=device)
    forward_stages.output(q, k, v_new, h, g_cum, chunk_indices, 0.5, o)
    assert_bitwise(o, torch.zeros_like(o), "o")
