"""Gated DeltaNet backward stages ``dv_local`` and ``state_backward`` (the reverse state pass) of each
fused backend's backward stage table (the ``backward_stages`` fixture, from the registry), against
the chunked reference; Triton's Blackwell launch setting on its own.

Each stage is fed the fp64 reference's own intermediates (``chunk_gdn_stages``: the
normalised q and k are re-derived by the kernels from the raw inputs, ``w`` and ``g_cum`` are
the reference's; a random ``do`` and, in some cases, a random ``dht``), cast to the test dtype,
and compared with the matching reference stage in fp64 (``chunk_dv_local``: ``dv_local``;
``chunk_state_backward``: ``dh``, ``dv_new``, ``dh0``), converted to the packed layout with
``from_chunks``. The reference reads ``g_cum`` in its padded layout as the backward assembly makes
it, ``chunk_local_cumsum(to_chunks(g))`` (flat past a chunk's end), not ``to_chunks`` of the packed
``g_cum``. A chained test runs both kernels one after the other (the state pass reads the
kernel's ``dv_local``), twice, bitwise equal.

Tolerances (relative RMS over the whole tensor, which must be finite: outputs are allocated
NaN-poisoned by the conftest, so an unwritten element fails):

* bf16 inputs (q, k, do hold bf16 values; the reference starts from the same values):
  ``<= 1e-2`` for every output. The stored intermediates the stages read (``w``, ``dv_local``,
  ``dht`` where it dominates ``dh``) and write (``dv_local``, ``dh``, ``dv_new``) are rounded
  once each (about 1.7e-3 relative RMS), and the bf16 dot operands (the masked ``A^T``, the
  rounded ``dH``, ``scale exp(G) r_q do``) add the rest. Observed on the CPU (stage and chained,
  K = 32 and K = 128): ``dv_local`` <= 2.5e-3, ``dh`` <= 2.6e-3, ``dv_new`` <= 2.5e-3,
  ``dh0`` <= 2.1e-3.
* fp32 inputs (the kernels multiply in full fp32, ``input_precision="ieee"``, no TF32):
  ``<= max(1e-5, 2^-24 * max|G|)`` with ``G`` the within-chunk cumulative gate (the stages read
  ``G`` in fp32 and exponentiate its differences; see tests/gdn/test_gdn_stages_state_output.py).
  Observed on the CPU: <= 9.1e-7.

On the CPU, Triton's interpreter would multiply bf16 dot operands as integer bit patterns and
truncates fp32 -> bf16 conversions; the launchers then widen bf16 dot operands to fp32 (exact)
and round to nearest even on the bits (``common.dot``, ``common.round_to`` in ``dsfuse.gdn.triton.common``), so the CPU tests check
the GPU's numerics. The same tests run on the GPU (``device`` "cuda") with the same bounds.

Exact: an empty document's ``dh0`` is its ``dht`` (or zero) bit for bit; two runs give the same bits.

Sizes: K = 32, V = 64 (K != V, so a transposed state gradient cannot pass) in the main tests;
K = V = 128 (the model's: the state pass then carries the state gradient as two blocks of 64 rows
and runs two value blocks) in one.
One sequence of T = 150 (not a multiple of 64) and packed documents of 1, 45, 0 and 130 tokens
(every token in a document, as the public API requires); (H, HV) = (2, 2), (2, 6), (1, 3); q and
k as head views of a wider packed buffer, ``do`` a head view of a wider buffer too. Gates as the
model makes them (``gdn_gates``), mild and strongly decaying.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES
from dsfuse.gdn import chunk_gdn_stages, prepare_chunk_offsets
from dsfuse.gdn.reference import chunk_local_cumsum, from_chunks, to_chunks
from dsfuse.gdn.reference_backward import chunk_dv_local, chunk_state_backward
from dsfuse.gdn.triton import state_bwd
from dsfuse.gdn.triton.common import BLACKWELL, assume_family
from gdn_stage_inputs import DK, DTYPES, DV, F64, head_view, qk_views
from gdn_stage_inputs import make_inputs as stage_inputs
from helpers import assert_bitwise, assert_rel_rms

BF16_RMS = 1e-2
FP32_RMS = 1e-5
EMPTY_DOC = 2  # document 2 of "docs_1_45_0_130" has no tokens

# (layout, (H, HV), l2 norm, dht given, dh0 requested, gates): every flag on and off,
# every head group in both layouts
CASES = [
    ("one_seq_T150", (2, 2), False, False, False, "model"),
    ("one_seq_T150", (2, 6), True, True, True, "strong"),
    ("one_seq_T150", (1, 3), True, True, False, "model"),
    ("docs_1_45_0_130", (2, 2), True, True, False, "strong"),
    ("docs_1_45_0_130", (2, 6), False, True, True, "model"),
    ("docs_1_45_0_130", (1, 3), True, True, True, "model"),
    ("docs_1_45_0_130", (2, 6), True, False, True, "strong"),
]


def case_id(case):
    layout, (h, hv), l2, dht, dh0, gates = case
    return (f"{layout.split('_')[0]}-H{h}_HV{hv}-{'l2' if l2 else 'raw'}-{'dht' if dht else 'nodht'}"
            f"-{'dh0' if dh0 else 'nodh0'}-{gates}")


# ----------------------------------------------------------------------------- inputs


def make_inputs(layout, heads, *, l2, with_dht, gates, dtype, seed=0, dk=DK, dv=DV):
    """Forward inputs (no initial state), ``do`` ``[T, HV, V]`` and an fp32 ``dht`` (or None): see
    ``gdn_stage_inputs.make_inputs``."""
    forward, draws = stage_inputs(layout, heads, l2=l2, gates=gates, dtype=dtype, seed=seed, dk=dk, dv=dv,
                                  extra=("do", "dht") if with_dht else ("do",))
    return forward | {"initial_state": None}, draws["do"], draws.get("dht")


class Prepared:
    """The fp64 reference stages of one case and the kernels' inputs on ``device`` in ``dtype``."""

    def __init__(self, forward, do, dht, l2, device, dtype, scale=None):
        self.l2, self.device, self.dtype = l2, device, dtype
        cu = forward["cu_seqlens"]
        ref = chunk_gdn_stages(**forward, scale=scale, use_qk_l2norm_in_kernel=l2, compute_dtype=F64)
        self.scale = forward["q"].shape[-1] ** -0.5 if scale is None else scale
        self.num_seqs = len(cu) - 1
        tokens = ref.q.shape[0]
        ci = ref.chunk_indices

        # the reference backward stages in fp64, padded layout; G flat past each chunk's end
        qc, kc, wc = (to_chunks(x, ci) for x in (ref.q, ref.k, ref.w))
        doc = to_chunks(do.double(), ci)
        gc = chunk_local_cumsum(to_chunks(forward["g"][0].double(), ci))
        dv_local = chunk_dv_local(qc, kc, doc, gc, self.scale)
        dh, dv_new, dh0 = chunk_state_backward(qc, kc, wc, doc, dv_local, gc, ci, self.num_seqs, self.scale,
                                               None if dht is None else dht.double())
        self.want = {"dv_local": from_chunks(dv_local, ci, tokens), "dh": dh,
                     "dv_new": from_chunks(dv_new, ci, tokens), "dh0": dh0}

        # the kernels' inputs
        self.chunk_indices = ci.to(torch.int32).to(device)
        self.chunk_offsets = prepare_chunk_offsets(cu).to(torch.int32).to(device)
        self.q, self.k = qk_views(forward["q"][0], forward["k"][0], device, dtype)
        self.g_cum = ref.g_cum.float().to(device)
        self.w = ref.w.to(dtype).to(device)
        self.do = head_view(do, device, dtype, first=False)
        self.dv_local = self.want["dv_local"].to(dtype).to(device)
        self.dht = None if dht is None else dht.float().to(device)
        self.max_g = ref.g_cum.abs().max().item() if ref.g_cum.numel() else 0.0

    def tol(self):
        if self.dtype == torch.bfloat16:
            return BF16_RMS
        return max(FP32_RMS, 2.0**-24 * self.max_g)

    def run_dv_local(self, stages):
        dv_local = torch.empty(self.do.shape, dtype=self.dtype, device=self.device)
        return stages.dv_local(self.q, self.k, self.do, self.g_cum, self.chunk_indices, self.scale, dv_local,
                               use_qk_l2norm=self.l2)

    def run_state(self, stages, dv_local=None, want_dh0=True):
        tokens, hv, dv = self.do.shape
        dk = self.w.shape[-1]
        nc = self.chunk_indices.shape[0]
        dh = torch.empty(nc, hv, dk, dv, dtype=self.dtype, device=self.device)
        dv_new = torch.empty(tokens, hv, dv, dtype=self.dtype, device=self.device)
        dh0 = torch.empty(self.num_seqs, hv, dk, dv, dtype=torch.float32, device=self.device) if want_dh0 else None
        return stages.state_backward(self.q, self.k, self.w, self.do,
                                     self.dv_local if dv_local is None else dv_local, self.g_cum,
                                     self.chunk_indices, self.chunk_offsets, self.dht, dh, dv_new, dh0, self.scale,
                                     use_qk_l2norm=self.l2)


# ----------------------------------------------------------------------------- comparisons






def check_state(p, dh, dv_new, dh0, layout):
    tol = p.tol()
    assert dh.dtype == p.dtype and dv_new.dtype == p.dtype
    errs = {"dh": assert_rel_rms(dh, p.want["dh"], tol, "dh"),
            "dv_new": assert_rel_rms(dv_new, p.want["dv_new"], tol, "dv_new")}
    if dh0 is not None:
        assert dh0.dtype == torch.float32
        errs["dh0"] = assert_rel_rms(dh0, p.want["dh0"], tol, "dh0")
        if layout.startswith("docs"):
            want = p.dht[EMPTY_DOC] if p.dht is not None else torch.zeros_like(dh0[EMPTY_DOC])
            assert_bitwise(dh0[EMPTY_DOC], want, "an empty document's dh0")
    return errs


# ----------------------------------------------------------------------------- dv_local


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_dv_local(case, dtype, device, backward_stages):
    layout, heads, l2, with_dht, _, gates = case
    forward, do, dht = make_inputs(layout, heads, l2=l2, with_dht=with_dht, gates=gates, dtype=DTYPES[dtype],
                                   seed=CASES.index(case))
    p = Prepared(forward, do, dht, l2, device, DTYPES[dtype], scale=0.3 if l2 else None)
    dv_local = p.run_dv_local(backward_stages)
    assert dv_local.dtype == p.dtype
    assert_rel_rms(dv_local, p.want["dv_local"], p.tol(), "dv_local")


# ----------------------------------------------------------------------------- reverse state pass


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_state_backward(case, dtype, device, backward_stages):
    layout, heads, l2, with_dht, want_dh0, gates = case
    forward, do, dht = make_inputs(layout, heads, l2=l2, with_dht=with_dht, gates=gates, dtype=DTYPES[dtype],
                                   seed=CASES.index(case))
    p = Prepared(forward, do, dht, l2, device, DTYPES[dtype], scale=0.3 if l2 else None)
    dh, dv_new, dh0 = p.run_state(backward_stages, want_dh0=want_dh0)
    assert (dh0 is None) == (not want_dh0)
    check_state(p, dh, dv_new, dh0, layout)


# ----------------------------------------------------------------------------- chained, twice


def check_chained(stages, layout, heads, gates, device, dtype, seed, dk=DK, dv=DV):
    """dv_local stage -> state backward stage against the fp64 reference; a second run bitwise equal."""
    forward, do, dht = make_inputs(layout, heads, l2=True, with_dht=True, gates=gates, dtype=dtype, seed=seed,
                                   dk=dk, dv=dv)
    p = Prepared(forward, do, dht, True, device, dtype)
    dv_local = p.run_dv_local(stages)
    errs = {"dv_local": assert_rel_rms(dv_local, p.want["dv_local"], p.tol(), "dv_local")}
    dh, dv_new, dh0 = p.run_state(stages, dv_local)
    errs.update(check_state(p, dh, dv_new, dh0, layout))
    dv_local2 = p.run_dv_local(stages)
    dh2, dv_new2, dh02 = p.run_state(stages, dv_local2)
    for name, a, b in (("dv_local", dv_local, dv_local2), ("dh", dh, dh2), ("dv_new", dv_new, dv_new2),
                       ("dh0", dh0, dh02)):
        assert_bitwise(a, b, f"{name}: second run")
    return errs


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("heads,gates", [((2, 6), "model"), ((1, 3), "strong")], ids=["H2_HV6-model", "H1_HV3-strong"])
def test_chained(heads, gates, dtype, device, backward_stages):
    check_chained(backward_stages, "docs_1_45_0_130", heads, gates, device, DTYPES[dtype], seed=7)


@pytest.mark.parametrize("device", DEVICES)
def test_blackwell_setting(device):
    """Triton's state pass in Blackwell's launch setting (16 value channels, 2 warps): four value blocks
    for V = 64."""
    from dsfuse.gdn.triton import BACKWARD

    with assume_family(BLACKWELL):
        assert state_bwd.launch_config(torch.device(device), DV)[0] < DV
        check_chained(BACKWARD, "docs_1_45_0_130", (1, 3), "model", device, torch.bfloat16, seed=5)


@pytest.mark.slow
def test_head_dims_128(device, backward_stages):
    """The model's K = V = 128 in bf16: two blocks of 64 state-gradient rows, two value blocks
    in Hopper's setting, one dv_local block."""
    check_chained(backward_stages, "docs_1_45_0_130", (1, 3), "model", device, torch.bfloat16, seed=11, dk=128,
                  dv=128)


def test_no_chunks(device, backward_stages):
    """Every document empty (no chunk at all): nothing to write but dh0, which is dht (or zero) bit for bit."""
    gen = torch.Generator().manual_seed(3)
    tokens, h, hv = 7, 1, 3
    q, k = (torch.randn(tokens, h, DK, generator=gen).to(device) for _ in range(2))
    w = torch.randn(tokens, hv, DK, generator=gen).to(device)
    do = torch.randn(tokens, hv, DV, generator=gen).to(device)
    g_cum = -torch.rand(tokens, hv, generator=gen).to(device)
    dht = torch.randn(2, hv, DK, DV, generator=gen).to(device)
    dht[0, 0, 0, :2] = -0.0  # kept bit for bit too
    chunk_indices = torch.zeros(0, 3, dtype=torch.int32, device=device)
    chunk_offsets = torch.zeros(3, dtype=torch.int32, device=device)
    dv_local = torch.zeros(tokens, hv, DV, device=device)
    backward_stages.dv_local(q, k, do, g_cum, chunk_indices, 0.5, dv_local)
    assert_bitwise(dv_local, torch.zeros_like(dv_local), "dv_local")
    dh = torch.empty(0, hv, DK, DV, device=device)
    for given in (dht, None):
        dv_new = torch.zeros(tokens, hv, DV, device=device)
        dh0 = torch.empty(2, hv, DK, DV, device=device)
        backward_stages.state_backward(q, k, w, do, dv_local, g_cum, chunk_indices, chunk_offsets, given, dh, dv_new,
                                       dh0, 0.5)
        assert_bitwise(dh0, dht if given is not None else torch.zeros_like(dht), "dh0")
        assert_bitwise(dv_new, torch.zeros_like(dv_new), "dv_new")
