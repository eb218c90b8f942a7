"""Gated DeltaNet chunked backward stages (explicit formulas) against autograd of the forward stages (fp64, CPU).

Each stage of :mod:`dsfuse.gdn.reference_backward` is checked against ``torch.autograd.grad``
of the forward stage functions it inverts, and the assembled backward against autograd of
:func:`chunk_gdn_reference` (q, k, v, g, beta, initial state; through ``o`` and the final
state). Tolerance: every element within ``1e-10`` of the tensor's largest magnitude.

Cases: sequences of 100 tokens (not a multiple of 64), B = 2; packed documents of 1, 45, 0
and 100 tokens plus 3 tokens in no document; (H, HV) in (1, 1), (2, 6); L2 norm off and on;
with an initial state and a final-state gradient (and, in some cases, without either). Gates as the model
makes them. Head dims K = 16, V = 24.
"""

from __future__ import annotations

import pytest
import torch
from dsfuse.gdn import (
    chunk_gdn_reference,
    chunk_local_cumsum,
    chunk_output,
    chunk_state_pass,
    gdn_gates,
    prepare_chunk_indices,
    to_chunks,
    ut_transform,
    wy_representation,
)
from dsfuse.gdn.reference import _prepare, decay_matrix
from dsfuse.gdn.reference_backward import (
    chunk_dqkwg,
    chunk_dv_local,
    chunk_gdn_backward_reference,
    chunk_local_cumsum_backward,
    chunk_state_backward,
    wy_backward,
)

DK, DV = 16, 24
F64 = torch.float64


def assert_close(actual, expected, tol=1e-10, name=""):
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    scale = max(expected.abs().max().item() if expected.numel() else 0.0, 1e-300)
    err = (actual - expected).abs().max().item() if expected.numel() else 0.0
    assert err <= tol * scale, f"{name}: max error {err:.3e} vs largest magnitude {scale:.3e}"


CASES = {
    "single": {"batch": 2, "tokens": 100, "cu": None},
    "varlen": {"batch": 1, "tokens": 149, "cu": [0, 1, 46, 46, 146]},
}


def make_inputs(case, heads, value_heads, with_state, seed=0):
    gen = torch.Generator().manual_seed(seed)
    spec = CASES[case]
    b, t = spec["batch"], spec["tokens"]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    q, k = rnd(b, t, heads, DK), rnd(b, t, heads, DK) / DK**0.5  # |k| ~ 1: a stable recurrence without the L2 norm
    v = rnd(b, t, value_heads, DV)
    a, bb = rnd(b, t, value_heads), rnd(b, t, value_heads)
    g, beta = gdn_gates(a, bb, torch.linspace(-1.0, 1.0, value_heads, dtype=F64), torch.full((value_heads,), 0.5, dtype=F64))
    g, beta = g.to(F64), beta.to(F64)
    cu = spec["cu"]
    n = b if cu is None else len(cu) - 1
    h0 = rnd(n, value_heads, DK, DV) if with_state else None
    do = rnd(b, t, value_heads, DV)
    if cu is not None:
        do[:, cu[-1]:] = 0  # outputs there are 0 by contract; gradients must be 0 too
    dht = rnd(n, value_heads, DK, DV) if with_state else None
    return q, k, v, g, beta, h0, cu, do, dht


def chunk_leaves(case, heads, value_heads, l2norm, with_state):
    """Chunk-layout fp64 inputs of the stage functions, as the forward makes them."""
    q, k, v, g, beta, h0, cu, do, dht = make_inputs(case, heads, value_heads, with_state)
    qq, kk, vv, gg, bb, scale, h0, bounds = _prepare(q, k, v, g, beta, None, h0, cu, l2norm, F64)
    ci = prepare_chunk_indices(bounds)
    qc, kc, vc, gc, bc, doc = (to_chunks(x, ci) for x in (qq, kk, vv, gg, bb, do.flatten(0, 1)))
    return {"qc": qc, "kc": kc, "vc": vc, "gc": gc, "bc": bc, "doc": doc, "h0": h0, "dht": dht, "ci": ci,
            "n": len(bounds) - 1, "scale": scale}


# the stages see q and k after the L2 norm: one L2 setting per state setting is enough here
PARAMS = [
    (case, hv, l2, st)
    for case in ("single", "varlen")
    for hv in ((1, 1), (2, 6))
    for l2, st in ((True, True), (False, False))
]


def _ids(p):
    case, (h, hv), l2, st = p
    return f"{case}-H{h}HV{hv}-{'l2' if l2 else 'nol2'}-{'state' if st else 'nostate'}"


@pytest.fixture(params=PARAMS, ids=[_ids(p) for p in PARAMS])
def leaves(request):
    case, (h, hv), l2, st = request.param
    return chunk_leaves(case, h, hv, l2, st)


def test_local_cumsum_backward(leaves):
    gc = leaves["gc"].clone().requires_grad_()
    dG = torch.randn_like(gc)
    (expected,) = torch.autograd.grad(chunk_local_cumsum(gc), gc, dG)
    assert_close(chunk_local_cumsum_backward(dG), expected, name="dg")


def test_dv_local_against_chunk_output(leaves):
    L = leaves
    G = chunk_local_cumsum(L["gc"])
    A = ut_transform(L["kc"], L["bc"], G)
    w, u = wy_representation(A, L["kc"], L["vc"], L["bc"], G)
    h, v_new, _ = chunk_state_pass(L["kc"], w, u, G, L["ci"], L["n"], L["h0"])
    v_new = v_new.clone().requires_grad_()
    o = chunk_output(L["qc"], L["kc"], v_new, h, G, L["scale"])
    (expected,) = torch.autograd.grad(o, v_new, L["doc"])
    assert_close(chunk_dv_local(L["qc"], L["kc"], L["doc"], G, L["scale"]), expected, name="dv_local")


def _state_and_output(L, qc, kc, w, u, G, h0):
    h, v_new, final = chunk_state_pass(kc, w, u, G, L["ci"], L["n"], h0)
    o = chunk_output(qc, kc, v_new, h, G, L["scale"])
    return h, v_new, final, o


def _loss(L, o, final):
    loss = (o * L["doc"]).sum()
    if L["dht"] is not None:
        loss = loss + (final * L["dht"]).sum()
    return loss


def test_state_backward_and_dqkwg(leaves):
    """Stages 1-3 against autograd of chunk_state_pass + chunk_output with w, u, G as leaves."""
    L = leaves
    G0 = chunk_local_cumsum(L["gc"])
    A = ut_transform(L["kc"], L["bc"], G0)
    w0, u0 = wy_representation(A, L["kc"], L["vc"], L["bc"], G0)
    qc, kc, w, u, G = (x.clone().requires_grad_() for x in (L["qc"], L["kc"], w0, u0, G0))
    value_heads = L["kc"].shape[1]
    # without an initial state, dh0 is the gradient of the zero state the pass starts from
    h0 = (torch.zeros(L["n"], value_heads, DK, DV, dtype=F64) if L["h0"] is None else L["h0"]).clone()
    h0.requires_grad_()
    h, v_new, final, o = _state_and_output(L, qc, kc, w, u, G, h0)
    leaves_ = [qc, kc, w, u, G, h0]
    grads = torch.autograd.grad(_loss(L, o, final), leaves_)
    h, v_new = h.detach(), v_new.detach()

    dv_local = chunk_dv_local(L["qc"], L["kc"], L["doc"], G0, L["scale"])
    dh, dv_new, dh0 = chunk_state_backward(L["qc"], L["kc"], w0, L["doc"], dv_local, G0, L["ci"], L["n"],
                                           L["scale"], L["dht"])
    assert_close(dv_new, grads[3], name="dv_new (= du)")
    assert_close(dh0, grads[5], name="dh0")
    dq, dk, dw, dg = chunk_dqkwg(L["qc"], L["kc"], v_new, h, dh, L["doc"], dv_new, G0, L["scale"])
    assert_close(dq, grads[0], name="dq")
    assert_close(dk, grads[1], name="dk (output + state)")
    assert_close(dw, grads[2], name="dw")
    assert_close(dg, grads[4], name="dg_cum (output + state)")


def test_state_backward_dh_per_chunk(leaves):
    """dh[c] = gradient of the state after chunk c: autograd through a zero perturbation added there."""
    L = leaves
    G = chunk_local_cumsum(L["gc"])
    A = ut_transform(L["kc"], L["bc"], G)
    w, u = wy_representation(A, L["kc"], L["vc"], L["bc"], G)
    ci, nc = L["ci"], L["kc"].shape[0]
    value_heads = L["kc"].shape[1]
    delta = torch.zeros(nc, value_heads, DK, DV, dtype=F64, requires_grad=True)
    states = list(L["h0"].unbind(0)) if L["h0"] is not None else [torch.zeros(value_heads, DK, DV, dtype=F64)
                                                                   for _ in range(L["n"])]
    g_last = G[..., -1]
    hs, vns = [], []
    for c, n in enumerate(ci[:, 0].tolist()):
        hc = states[n]
        vn = u[c] - w[c] @ hc
        k_dec = L["kc"][c] * (g_last[c][:, None] - G[c]).exp()[..., None]
        states[n] = g_last[c].exp()[:, None, None] * hc + k_dec.transpose(-1, -2) @ vn + delta[c]
        hs.append(hc)
        vns.append(vn)
    h_ref, v_ref, final_ref = chunk_state_pass(L["kc"], w, u, G, ci, L["n"], L["h0"])
    if nc:
        o = chunk_output(L["qc"], L["kc"], torch.stack(vns), torch.stack(hs), G, L["scale"])
        assert_close(torch.stack(hs), h_ref, tol=0, name="replayed h")
        assert_close(torch.stack(vns), v_ref, tol=0, name="replayed v_new")
    else:
        o = torch.zeros_like(L["doc"])
    final = torch.stack(states)
    assert_close(final, final_ref, tol=0, name="replayed final state")
    (expected,) = torch.autograd.grad(_loss(L, o, final), delta)
    dv_local = chunk_dv_local(L["qc"], L["kc"], L["doc"], G, L["scale"])
    dh, _, _ = chunk_state_backward(L["qc"], L["kc"], w, L["doc"], dv_local, G, ci, L["n"], L["scale"], L["dht"])
    assert_close(dh, expected, name="dh per chunk")


def test_wy_backward(leaves):
    L = leaves
    kc, vc, bc = (x.clone().requires_grad_() for x in (L["kc"], L["vc"], L["bc"]))
    G = chunk_local_cumsum(L["gc"]).clone().requires_grad_()
    A = ut_transform(kc, bc, G)
    w, u = wy_representation(A, kc, vc, bc, G)
    gen = torch.Generator().manual_seed(1)
    dw = torch.randn(w.shape, generator=gen, dtype=F64)
    du = torch.randn(u.shape, generator=gen, dtype=F64)
    expected = torch.autograd.grad((w, u), (kc, vc, bc, G), (dw, du))
    got = wy_backward(A.detach(), L["kc"], L["vc"], L["bc"], G.detach(), dw, du)
    for name, a, e in zip(("dk", "dv", "dbeta", "dg_cum"), got, expected, strict=True):
        assert_close(a, e, name=name)


# each of: one sequence / varlen, (H, HV) = (1, 1) / (2, 6), L2 norm off / on, state on / off
FULL = [
    ("single", (1, 1), False, True),
    ("single", (2, 6), True, True),
    ("varlen", (1, 1), True, True),
    ("varlen", (2, 6), False, True),
    ("varlen", (2, 6), True, False),
    ("single", (1, 1), True, False),
]


@pytest.mark.parametrize("case,heads,l2,with_state", FULL,
                         ids=[f"{c}-H{h[0]}HV{h[1]}-{'l2' if l else 'nol2'}-{'state' if s else 'nostate'}"
                              for c, h, l, s in FULL])
def test_full_backward_against_autograd(case, heads, l2, with_state):
    h, hv = heads
    q, k, v, g, beta, h0, cu, do, dht = make_inputs(case, h, hv, with_state, seed=2)
    ins = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    h0_leaf = None if h0 is None else h0.clone().requires_grad_()
    o, final = chunk_gdn_reference(*ins, initial_state=h0_leaf, output_final_state=True, cu_seqlens=cu,
                                   use_qk_l2norm_in_kernel=l2)
    loss = (o * do).sum() + ((final * dht).sum() if dht is not None else 0)
    wrt = ins + ([h0_leaf] if h0_leaf is not None else [])
    expected = torch.autograd.grad(loss, wrt)
    got = chunk_gdn_backward_reference(q, k, v, g, beta, None, h0, cu, l2, do, dht)
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    for i, e in enumerate(expected):
        assert_close(got[i], e, name=names[i])
    if h0 is None:
        assert got[5] is None
    if cu is not None:
        for x in got[:5]:
            assert (x[:, cu[-1]:] == 0).all()


def test_strong_gates_finite():
    """Strongly decaying gates (|G| ~ 1e3 within a chunk): no overflow, matches autograd."""
    q, k, v, g, beta, h0, cu, do, dht = make_inputs("varlen", 2, 6, True, seed=3)
    g = g * 60.0
    ins = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    h0_leaf = h0.clone().requires_grad_()
    o, final = chunk_gdn_reference(*ins, initial_state=h0_leaf, output_final_state=True, cu_seqlens=cu,
                                   use_qk_l2norm_in_kernel=True)
    expected = torch.autograd.grad((o * do).sum() + (final * dht).sum(), ins + [h0_leaf])
    got = chunk_gdn_backward_reference(q, k, v, g, beta, None, h0, cu, True, do, dht)
    for i, e in enumerate(expected):
        assert torch.isfinite(got[i]).all()
        assert_close(got[i], e, name=str(i))


def test_decay_matrix_used_is_masked():
    # the formulas exponentiate only masked differences: decay_matrix's contract
    G = torch.tensor([[[0.0, -800.0, -1600.0]]], dtype=F64)
    assert torch.isfinite(decay_matrix(G, True)).all()
