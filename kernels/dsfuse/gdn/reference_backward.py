"""Gated DeltaNet chunked backward, stage by stage, as explicit formulas (no autograd).

The oracle the backward kernel stages are tested against. Same padded chunk layout as the
forward stages in `dsfuse.gdn.reference` (``[NC, HV, C, ...]``, zeros on padding).
Per chunk, with ``G`` the chunk-local cumulative gate, ``Gamma`` / ``Gamma'`` the decay matrix
with / without the diagonal, ``h`` the state at the chunk's start, the forward is::

    L = diag(beta) (k k^T * Gamma'),  A = (I + L)^-1
    w = A (beta exp(G) k),  u = A (beta v),  v_new = u - w h
    o = scale [(q exp(G)) h + (q k^T * Gamma) v_new]
    h_next = exp(G_last) h + (k exp(G_last - G))^T v_new

and the backward, given ``do`` and ``dH`` = the gradient of the state at the chunk's END
(``dht`` for a sequence's last chunk)::

    dv_local = scale (q k^T * Gamma)^T do                                   # chunk_dv_local
    dv_new   = dv_local + (k exp(G_last - G)) dH                            # chunk_state_backward
    dh_start = exp(G_last) dH + scale (q exp(G))^T do - w^T dv_new           #   (carried backwards)
    dA_o = scale (do v_new^T) * Gamma                                       # chunk_dqkwg
    dq = scale exp(G) (do h^T) + dA_o k
    dk = dA_o^T q + exp(G_last - G) (v_new dH^T)
    dw = -dv_new h^T
    dG_i += sum(q_i dq_i) (rows of dq: both terms) - sum_j (dA_o * q k^T)_ji - sum(k_i dk^state_i)
    dG_last += exp(G_last) sum(dH * h) + sum_i sum(k_i dk^state_i)
    du = dv_new;  X = beta exp(G) k,  Y = beta v                            # wy_backward
    dX = A^T dw,  dY = A^T du,  dA = dw X^T + du Y^T,  dL = strictly_lower(-A^T dA A^T)
    dk += beta exp(G) dX + (dL * Gamma' * beta_i) k + (dL * Gamma' * beta_i)^T k
    dv = beta dY;  dbeta = sum(exp(G) k dX) + sum(v dY) + sum_j dL_ij (k_i.k_j) Gamma'_ij
    dG += sum(X dX) + rowsum(dL * L) - colsum(dL * L)

``dG`` is the gradient of the chunk-local cumulative gate; ``dg`` is its reverse cumulative
sum within each chunk (`chunk_local_cumsum_backward`). The state gradient ``dh`` stored
per chunk is the gradient of the state AFTER the chunk (the ``dH`` each chunk reads; the
convention of flash-linear-attention's ``chunk_gated_delta_rule_bwd_dhu``).

Every stage reads ``g_cum`` in the padded chunk layout as `chunk_local_cumsum` makes it:
flat past a chunk's end, so position ``C - 1`` holds ``G_last``. A packed ``g_cum`` (as
`chunk_gdn_stages` returns it) put back with ``to_chunks`` has zeros there instead and
must not be passed as is.
"""

from __future__ import annotations

import torch

from .reference import (
    CHUNK_SIZE,
    L2NORM_EPS,
    _prepare,
    chunk_gdn_stages,
    chunk_local_cumsum,
    decay_matrix,
    from_chunks,
    to_chunks,
)


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def chunk_local_cumsum_backward(dg_cum: torch.Tensor) -> torch.Tensor:
    """``dG`` ``[NC, HV, C]`` -> ``dg``: reverse cumulative sum within each chunk (``dg_j = sum_{i>=j} dG_i``)."""
    return dg_cum.flip(-1).cumsum(-1).flip(-1)


def chunk_dv_local(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, g_cum: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """``dv_local = scale (q k^T * Gamma)^T do`` ``[NC, HV, C, V]``: v_new's gradient from the intra-chunk term of o."""
    attn = (q @ _t(k)) * decay_matrix(g_cum, include_diagonal=True)  # [NC, HV, C, C]
    return scale * (_t(attn) @ do)


def chunk_state_backward(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, do: torch.Tensor,
                         dv_local: torch.Tensor, g_cum: torch.Tensor, chunk_indices: torch.Tensor,
                         num_seqs: int, scale: float, dht: torch.Tensor | None = None):
    """The reverse pass over chunks: ``(dh, dv_new, dh0)``.

    ``q``, ``k``, ``w`` ``[NC, HV, C, K]``; ``do``, ``dv_local`` ``[NC, HV, C, V]``; ``g_cum``
    ``[NC, HV, C]``; ``dht`` ``[N, HV, K, V]`` or None (zeros). Each sequence's chunks are
    visited last to first, carrying ``dH`` (from ``dht``)::

        dh[c]     = dH                                           # gradient of the state after chunk c
        dv_new[c] = dv_local[c] + (k exp(G_last - G)) dH
        dH        = exp(G_last) dH + scale (q exp(G))^T do - w^T dv_new[c]

    ``dh`` ``[NC, HV, K, V]``; ``dv_new`` ``[NC, HV, C, V]`` (total gradient of v_new);
    ``dh0`` ``[N, HV, K, V]`` the gradient of each initial state (``dht`` for an empty document).
    """
    value_heads, dk, dv = k.shape[1], k.shape[-1], do.shape[-1]
    if dht is None:
        carry = [do.new_zeros(value_heads, dk, dv) for _ in range(num_seqs)]
    else:
        carry = list(dht.unbind(0))
    g_last = g_cum[..., -1]  # [NC, HV]
    k_decayed = k * (g_last[..., None] - g_cum).exp()[..., None]
    q_decayed = q * g_cum.exp()[..., None]
    num_chunks = k.shape[0]
    dhs: list[torch.Tensor | None] = [None] * num_chunks
    dv_news: list[torch.Tensor | None] = [None] * num_chunks
    for c in reversed(range(num_chunks)):
        n = int(chunk_indices[c, 0])
        dH = carry[n]
        dv_new = dv_local[c] + k_decayed[c] @ dH  # [HV, C, K] @ [HV, K, V]
        carry[n] = g_last[c].exp()[:, None, None] * dH + scale * (_t(q_decayed[c]) @ do[c]) - _t(w[c]) @ dv_new
        dhs[c] = dH
        dv_news[c] = dv_new
    dh = torch.stack(dhs) if num_chunks else do.new_zeros(0, value_heads, dk, dv)
    dv_new = torch.stack(dv_news) if num_chunks else torch.zeros_like(dv_local)
    dh0 = torch.stack(carry) if carry else do.new_zeros(0, value_heads, dk, dv)
    return dh, dv_new, dh0


def chunk_dqkwg(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, h: torch.Tensor, dh: torch.Tensor,
                do: torch.Tensor, dv_new: torch.Tensor, g_cum: torch.Tensor, scale: float):
    """``(dq, dk, dw, dg_cum)`` from the output and the state update (the WY path not included).

    ``h`` the state at each chunk's start, ``dh`` the gradient of the state after it (from
    `chunk_state_backward`), ``dv_new`` the total gradient of ``v_new``. ``dq`` is
    complete; ``dk`` holds the output and state-update terms; ``dw = -dv_new h^T`` (v_new =
    u - w h); ``dg_cum`` ``[NC, HV, C]`` the gradient of the cumulative gate ``G`` from
    ``o`` and ``h_next`` (the gradient of ``G_last`` lands on the chunk's last position, C - 1).
    """
    eg = g_cum.exp()
    g_last = g_cum[..., -1]
    decay_last = (g_last[..., None] - g_cum).exp()  # [NC, HV, C]
    gamma = decay_matrix(g_cum, include_diagonal=True)
    # output: o = scale (q e^G) h + (q k^T * Gamma) v_new * scale
    dq_inter = scale * eg[..., None] * (do @ _t(h))  # [NC, HV, C, K]
    dA_o = scale * (do @ _t(v_new)) * gamma  # [NC, HV, C, C]
    dq = dq_inter + dA_o @ k
    dk_out = _t(dA_o) @ q
    # state update: h_next = e^{G_last} h + (k e^{G_last - G})^T v_new
    dk_state = decay_last[..., None] * (v_new @ _t(dh))  # [NC, HV, C, K]
    dk = dk_out + dk_state
    dw = -(dv_new @ _t(h))
    # gate: o's terms, then h_next's
    ds = dA_o * (q @ _t(k))  # d/d(G_i - G_j) of the intra term
    dg = (q * dq_inter).sum(-1) + ds.sum(-1) - ds.sum(-2)
    k_state = (k * dk_state).sum(-1)  # [NC, HV, C]
    dg = dg - k_state
    dg_last = g_last.exp() * (dh * h).sum((-1, -2)) + k_state.sum(-1)  # [NC, HV]
    dg = torch.cat([dg[..., :-1], dg[..., -1:] + dg_last[..., None]], dim=-1)
    return dq, dk, dw, dg


def wy_backward(A: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g_cum: torch.Tensor,
                dw: torch.Tensor, du: torch.Tensor):
    """Through ``w = A (beta e^G k)``, ``u = A (beta v)``, ``A = (I + L)^-1``: ``(dk, dv, dbeta, dg_cum)``.

    ``A`` ``[NC, HV, C, C]``; ``k`` ``[NC, HV, C, K]``; ``v`` ``[NC, HV, C, V]``; ``beta``, ``g_cum``
    ``[NC, HV, C]``; ``dw`` ``[NC, HV, C, K]``; ``du`` ``[NC, HV, C, V]`` (= the total gradient of
    v_new, since v_new = u - w h). Returns the WY-path contributions to ``dk``, ``dv`` (all of
    it), ``dbeta`` (all of it) and the gradient of the cumulative gate ``G``.
    """
    eg = g_cum.exp()
    x = k * (beta * eg)[..., None]  # beta e^G k
    y = v * beta[..., None]
    dx = _t(A) @ dw
    dy = _t(A) @ du
    dA = dw @ _t(x) + du @ _t(y)
    gamma_strict = decay_matrix(g_cum, include_diagonal=False)
    size = A.shape[-1]
    strict = torch.ones(size, size, dtype=torch.bool, device=A.device).tril(-1)
    dL = (-(_t(A) @ dA @ _t(A))).masked_fill(~strict, 0)
    kk = k @ _t(k)
    lower = beta[..., None] * kk * gamma_strict
    dkk = dL * gamma_strict * beta[..., None]  # d(k k^T)
    dk = (beta * eg)[..., None] * dx + dkk @ k + _t(dkk) @ k
    dv = beta[..., None] * dy
    dbeta = (eg[..., None] * k * dx).sum(-1) + (v * dy).sum(-1) + (dL * kk * gamma_strict).sum(-1)
    dlow = dL * lower
    dg = (x * dx).sum(-1) + dlow.sum(-1) - dlow.sum(-2)
    return dk, dv, dbeta, dg


def _l2norm_backward(x: torch.Tensor, dy: torch.Tensor, eps: float) -> torch.Tensor:
    """``y = x r``, ``r = (sum x^2 + eps)^-1/2``: ``dx = r (dy - y (dy . y))``."""
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    y = x * r
    return r * (dy - y * (dy * y).sum(-1, keepdim=True))


def _sum_value_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[T, HV, K]`` -> ``[T, H, K]``: sum over the ``HV // H`` value heads of each qk head, in head order."""
    grouped = x.unflatten(1, (heads, x.shape[1] // heads))  # [T, H, G, K]
    out = grouped[:, :, 0]
    for j in range(1, grouped.shape[2]):
        out = out + grouped[:, :, j]
    return out


def chunk_gdn_backward_reference(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None,
                                 use_qk_l2norm_in_kernel=False, do=None, dht=None,
                                 compute_dtype=torch.float64, chunk_size=CHUNK_SIZE):
    """The chunked backward assembled from the stages: ``(dq, dk, dv, dg, dbeta, dh0)``.

    Inputs as `dsfuse.gdn.chunk_gdn_reference`; ``do`` ``[B, T, HV, V]`` (or the packed
    ``[B*T, HV, V]``); ``dht`` ``[N, HV, K, V]`` or None. Returns, in ``compute_dtype``, ``dq``,
    ``dk`` ``[B, T, H, K]``, ``dv`` ``[B, T, HV, V]``, ``dg``, ``dbeta`` ``[B, T, HV]`` and ``dh0``
    ``[N, HV, K, V]`` (None without ``initial_state``). Tokens in no document get zeros.
    """
    if do is None:
        raise ValueError("do (the gradient of o) is required")
    batch, tokens, heads = q.shape[:3]
    st = chunk_gdn_stages(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
                          compute_dtype, chunk_size)
    _, _, vv, gg, bb, scale, _, bounds = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, False,
                                                  compute_dtype)
    ci = st.chunk_indices
    num_tokens = st.q.shape[0]
    qc, kc, vc, bc, doc = (to_chunks(x, ci, chunk_size)
                           for x in (st.q, st.k, vv, bb, do.reshape(num_tokens, *do.shape[-2:]).to(compute_dtype)))
    A, w, v_new = (to_chunks(x, ci, chunk_size) for x in (st.A, st.w, st.v_new))
    # G from g, not from the packed st.g_cum: the padded layout needs G flat past a chunk's end
    # (G_last is read at position C - 1), while to_chunks would fill those positions with 0
    gcum = chunk_local_cumsum(to_chunks(gg, ci, chunk_size))
    dht_c = None if dht is None else dht.to(compute_dtype)

    dv_local = chunk_dv_local(qc, kc, doc, gcum, scale)
    dh, dv_new, dh0 = chunk_state_backward(qc, kc, w, doc, dv_local, gcum, ci, len(bounds) - 1, scale, dht_c)
    dq, dk, dw, dg1 = chunk_dqkwg(qc, kc, v_new, st.h, dh, doc, dv_new, gcum, scale)
    dk2, dv, dbeta, dg2 = wy_backward(A, kc, vc, bc, gcum, dw, dv_new)
    dg = chunk_local_cumsum_backward(dg1 + dg2)

    dq, dk, dv, dg, dbeta = (from_chunks(x, ci, num_tokens) for x in (dq, dk + dk2, dv, dg, dbeta))
    dq, dk = _sum_value_heads(dq, heads), _sum_value_heads(dk, heads)
    if use_qk_l2norm_in_kernel:
        dq = _l2norm_backward(q.flatten(0, 1).to(compute_dtype), dq, L2NORM_EPS)
        dk = _l2norm_backward(k.flatten(0, 1).to(compute_dtype), dk, L2NORM_EPS)
    dq, dk, dv, dg, dbeta = (x.unflatten(0, (batch, tokens)) for x in (dq, dk, dv, dg, dbeta))
    return (dq, dk, dv, dg, dbeta,
            dh0 if initial_state is not None else None)
