"""The fused backward's algebra (`experiments/gdn/notes/fused-backward-design.md`) in float64 on the CPU,
before any kernel: its reverse chain (``dS`` carried through the chunks without ``w``) and its
per-chunk gradients (``A Gamma`` split into the ungated inverse and the decays, as the fused
forward keeps them), written out with torch, against `chunk_gdn_backward_reference` (which the
Triton stages are tested against). Every element within ``1e-10`` of the tensor's largest magnitude.
Inputs and cases as ``test_gdn_reference_backward.py``'s (varlen with a one-token and an empty
document, B = 2 without ``cu_seqlens``, grouped value heads, the L2 norm on and off, gates as the
model makes them)."""

from __future__ import annotations

import pytest
import torch
from dsfuse.gdn import chunk_gdn_stages, to_chunks, ut_transform
from dsfuse.gdn.reference import (
    L2NORM_EPS,
    _prepare,
    chunk_local_cumsum,
    decay_matrix,
    from_chunks,
)
from dsfuse.gdn.reference_backward import (
    _l2norm_backward,
    _sum_value_heads,
    _t,
    chunk_gdn_backward_reference,
    chunk_local_cumsum_backward,
)
from test_gdn_reference_backward import assert_close, make_inputs


def _chunk_terms(q, k, v, g, beta, scale, h0, cu, l2, do):
    """The forward's chunk-layout terms in float64 that the backward's two passes read."""
    st = chunk_gdn_stages(q, k, v, g, beta, scale, h0, cu, l2, torch.float64)
    _, _, vv, gg, bb, scale, _, bounds = _prepare(q, k, v, g, beta, scale, h0, cu, False, torch.float64)
    ci = st.chunk_indices
    n_tok = st.q.shape[0]
    qc, kc, vc, bc, doc = (to_chunks(x, ci) for x in (st.q, st.k, vv, bb, do.reshape(n_tok, *do.shape[-2:])))
    G = chunk_local_cumsum(to_chunks(gg, ci))  # flat past a chunk's end, as the kernels pad
    gamma = decay_matrix(G, include_diagonal=True)
    a0 = ut_transform(kc, bc, torch.zeros_like(G))  # the ungated inverse
    return {"ci": ci, "n_tok": n_tok, "n_seq": len(bounds) - 1, "scale": scale, "S": st.h, "qc": qc, "kc": kc,
            "vc": vc, "bc": bc, "doc": doc, "G": G, "gamma": gamma, "a0": a0, "ag": a0 * gamma}


def _reverse_chain(t, dht):
    """The design's kernel 2: ``(dS', dv_new, dX, dh0)`` of every chunk (``dS'`` the gradient of the
    state after the chunk, ``[NC, HV, K, V]``), the chunks of each document last to first."""
    ci, scale, qc, kc, bc, doc, G, ag = (t[name] for name in ("ci", "scale", "qc", "kc", "bc", "doc", "G", "ag"))
    eg, g_last = G.exp()[..., None], G[..., -1:]
    dec = (g_last - G).exp()[..., None]  # exp(G_last - G)
    p = (qc @ _t(kc)) * t["gamma"]
    shape = t["S"].shape[1:]
    carry = list(dht.unbind(0)) if dht is not None else [t["S"].new_zeros(shape) for _ in range(t["n_seq"])]
    ds_after, dv_new, dx = [None] * len(ci), [None] * len(ci), [None] * len(ci)
    for c in reversed(range(len(ci))):
        n = int(ci[c, 0])
        dsp = carry[n]
        dvn = scale * (_t(p[c]) @ doc[c]) + dec[c] * (kc[c] @ dsp)
        dxc = _t(ag[c]) @ dvn
        carry[n] = (g_last[c].exp()[..., None] * dsp + scale * (_t(eg[c] * qc[c]) @ doc[c])
                    - _t(bc[c][..., None] * eg[c] * kc[c]) @ dxc)
        ds_after[c], dv_new[c], dx[c] = dsp, dvn, dxc
    dsp, dvn, dxc = (torch.stack(x) for x in (ds_after, dv_new, dx))
    return dsp, dvn, dxc, torch.stack(carry)


def state_backward_in_float64(q, k, g, beta, scale, cu, l2, do, dht):
    """The reverse state chain alone (kernel 2's oracle): ``(dS' [NC, HV, K, V], dh0 [N, HV, K, V])``."""
    v = torch.zeros(*q.shape[:2], do.shape[-2], do.shape[-1], dtype=torch.float64)  # the chain reads no v
    dsp, _, _, dh0 = _reverse_chain(_chunk_terms(q, k, v, g, beta, scale, None, cu, l2, do), dht)
    return dsp, dh0


def fused_backward_in_float64(q, k, v, g, beta, scale, h0, cu, l2, do, dht):
    """``(dq, dk, dv, dg, dbeta, dh0)`` by the design's two passes: the reverse chain, then each chunk's
    gradients from its state ``S`` (the forward's), the state gradient after it ``dS'`` (the chain's),
    and the chunk's own rows."""
    batch, tokens, heads = q.shape[:3]
    t = _chunk_terms(q, k, v, g, beta, scale, h0, cu, l2, do)
    ci, n_tok, scale, S, qc, kc, vc, bc, doc, G, gamma, a0, ag = (
        t[name] for name in ("ci", "n_tok", "scale", "S", "qc", "kc", "vc", "bc", "doc", "G", "gamma", "a0", "ag"))
    eg, g_last = G.exp()[..., None], G[..., -1:]
    dec = (g_last - G).exp()[..., None]  # exp(G_last - G)
    x = bc[..., None] * (vc - eg * (kc @ S))
    v_new = ag @ x
    p = (qc @ _t(kc)) * gamma

    # 1. the reverse chain: dS' of every chunk, dv_new and dX on the way
    dsp, dvn, dxc, dh0 = _reverse_chain(t, dht)

    # 2. each chunk's gradients, independent of the others
    dp = scale * (doc @ _t(v_new)) * (gamma != 0)  # o's intra-chunk term, lower triangle with its diagonal
    dq = scale * eg * (doc @ _t(S)) + (dp * gamma) @ kc
    dk = _t(dp * gamma) @ qc + (dec * v_new) @ _t(dsp) - bc[..., None] * eg * (dxc @ _t(S))
    dv = bc[..., None] * dxc
    dag = (dvn @ _t(x)) * (gamma != 0)
    dm = -(_t(a0) @ (dag * gamma) @ _t(a0)).tril(-1)  # through A0 = (I + M)^-1, M strictly lower
    kk = kc @ _t(kc)
    dbeta = (dxc * (vc - eg * (kc @ S))).sum(-1) + (dm * kk).sum(-1)
    dk = dk + (bc[..., None] * dm) @ kc + _t(bc[..., None] * dm) @ kc
    e = dp * p + dag * ag  # the decays' gradient times the decays, by (i, j)
    dG = e.sum(-1) - e.sum(-2)
    dG = dG + scale * (eg * (qc @ S) * doc).sum(-1) - (bc[..., None] * eg * (kc @ S) * dxc).sum(-1)
    t_row = ((kc @ dsp) * dec * v_new).sum(-1)  # through the state update's exp(G_last - G)
    last = (g_last.exp()[..., None] * S * dsp).sum((-1, -2)) + t_row.sum(-1)
    dG = dG - t_row
    dG[..., -1] += last
    dg = chunk_local_cumsum_backward(dG)

    dq, dk, dv, dg, dbeta = (from_chunks(t, ci, n_tok) for t in (dq, dk, dv, dg, dbeta))
    dq, dk = _sum_value_heads(dq, heads), _sum_value_heads(dk, heads)
    if l2:
        dq = _l2norm_backward(q.flatten(0, 1), dq, L2NORM_EPS)
        dk = _l2norm_backward(k.flatten(0, 1), dk, L2NORM_EPS)
    dq, dk, dv, dg, dbeta = (t.unflatten(0, (batch, tokens)) for t in (dq, dk, dv, dg, dbeta))
    return dq, dk, dv, dg, dbeta, (dh0 if h0 is not None else None)


@pytest.mark.parametrize("case", ["single", "varlen"])
@pytest.mark.parametrize("heads", [(1, 1), (2, 6)])
@pytest.mark.parametrize("l2", [False, True])
def test_the_design_s_two_passes_give_the_reference_gradients(case, heads, l2):
    q, k, v, g, beta, h0, cu, do, dht = make_inputs(case, *heads, with_state=True)
    cu_t = None if cu is None else torch.tensor(cu)
    got = fused_backward_in_float64(q, k, v, g, beta, None, h0, cu_t, l2, do, dht)
    want = chunk_gdn_backward_reference(q, k, v, g, beta, None, h0, cu_t, l2, do=do, dht=dht)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        assert_close(a, b, name=name)


@pytest.mark.parametrize("l2", [False, True])
def test_the_inverse_backward_through_the_gated_A(l2):
    """The per-chunk kernel's form of the inverse's backward, on the gated ``A = A0 Gamma`` the forward
    keeps: ``-tril(A0^T (dA Gamma) A0^T, -1) = -tril((A^T dA A^T) Gamma, -1)`` for every chunk (float64,
    within 1e-12 of the largest magnitude), so the kernel needs no ungated inverse."""
    q, k, v, g, beta, h0, cu, do, dht = make_inputs("varlen", 2, 6, with_state=True)
    t = _chunk_terms(q, k, v, g, beta, None, h0, torch.tensor(cu), l2, do)
    a0, ag, gamma = t["a0"], t["ag"], t["gamma"]
    da = torch.randn(ag.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).tril()
    ungated = -(_t(a0) @ (da * gamma) @ _t(a0)).tril(-1)
    gated = -((_t(ag) @ da @ _t(ag)) * gamma).tril(-1)
    assert (gated - ungated).abs().max() <= 1e-12 * ungated.abs().max()
    assert ungated.abs().max() > 0
