"""Gated DeltaNet (grouped value heads, variable-length documents): the math contract in plain PyTorch.

Two oracles of the same function, and the stages of the chunked algorithm one by one.

Layouts (the API's): ``q``, ``k`` ``[B, T, H, K]``; ``v`` ``[B, T, HV, V]``; ``g`` ``[B, T, HV]``
(log decay, ``g <= 0``, fp32); ``beta`` ``[B, T, HV]``; ``o`` ``[B, T, HV, V]``; states
``[N, HV, K, V]`` fp32, one per sequence (``N = B`` without ``cu_seqlens``; with them
``B = 1`` and ``N = len(cu_seqlens) - 1``: documents packed FlashAttention style). Value head
``j`` reads qk head ``j // (HV // H)`` (grouped value heads). Per sequence and value head::

    q, k = l2norm(q), l2norm(k)                    # optional: x * rsqrt(sum(x^2) + 1e-6)
    S_0 = initial_state or 0                       # [K, V]
    for t:  S   = exp(g_t) * S_{t-1}
            u_t = beta_t * (v_t - S^T k_t)         # [V]: the delta rule's correction
            S_t = S + k_t u_t^T
            o_t = scale * S_t^T q_t                # scale defaults to K ** -0.5

`naive_recurrent_gdn` runs this token by token. `chunk_gdn_reference` runs the
chunked algorithm the kernels implement (chunks of ``C = 64`` tokens, each document chunked
from its own start). Within a chunk with state ``h`` at its start, ``G = cumsum(g)`` (chunk
local) and ``Gamma_ij = exp(G_i - G_j)`` for ``j <= i`` (0 above the diagonal), the
recurrence unrolls to::

    (I + L) u = beta * v - beta * exp(G) * (k h),  L = strictly_lower(diag(beta) k k^T * Gamma)
    A = (I + L)^-1                                 # UT transform
    w = A (beta * exp(G) * k),  u = A (beta * v)   # WY representation: the chunk's u_t = u - w h
    v_new = u - w h                                # [C, V]: the true u_t of every token
    o = scale * [(q * exp(G)) h + tril(q k^T * Gamma) v_new]
    h_next = exp(G_last) h + (k * exp(G_last - G))^T v_new

(derivation: unrolling, ``exp(g_t) S_{t-1} = exp(G_t) h + sum_{s<t} exp(G_t - G_s) k_s u_s^T``,
so ``u_t + beta_t sum_{s<t} Gamma_ts (k_t . k_s) u_s = beta_t (v_t - exp(G_t) h^T k_t)``, the
lower-triangular system above; ``o_t`` and ``h_next = S_last`` follow from the same sum.)
Only differences ``G_i - G_j`` with ``j <= i`` (``<= 0`` for ``g <= 0``) are exponentiated,
and the mask is applied to the exponent before ``exp``, so strongly decaying gates neither
overflow nor produce ``0 * inf`` in the forward or in autograd's backward.

The stage functions work on the padded chunk layout ``[NC, HV, C, ...]`` (chunk, value head,
position in chunk, channel); padding positions hold zeros (``g = 0`` there keeps the cumulative
gate flat, ``k = q = beta = 0`` make their rows and columns vanish). `to_chunks` and
`from_chunks` convert from and to the packed token layout ``[T, HV, ...]`` (the batch
dim dropped, ``B * T`` tokens without ``cu_seqlens``) in which kernels store their
intermediates; `chunk_gdn_stages` returns every intermediate in that layout.

Everything here is eager, differentiable by autograd (``torch.autograd.grad`` of either
oracle in fp64 gives the gradient oracle: dq, dk, dv, dg, dbeta, dh0) and runs on the CPU.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # flash-linear-attention's l2norm default
CHUNK_SIZE = 64


# ----------------------------------------------------------------------------- helpers


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim (flash-linear-attention's ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """The gates as the model makes them (Qwen3-Next / Qwen3.5 linear attention): ``(g, beta)``.

    ``a``, ``b`` ``[..., HV]`` (projections of the hidden state); ``A_log``, ``dt_bias`` ``[HV]``::

        g = -exp(A_log) * softplus(a + dt_bias)     # fp32 log decay, <= 0
        beta = sigmoid(b)
    """
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid()


def _seqlens_list(cu_seqlens) -> list[int]:
    return [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]


def _check_cu_seqlens(bounds: list[int], num_tokens: int) -> None:
    decreasing = any(b < a for a, b in itertools.pairwise(bounds))
    if len(bounds) < 2 or bounds[0] != 0 or decreasing or bounds[-1] > num_tokens:
        raise ValueError(
            f"cu_seqlens must start at 0, never decrease and end at most at T = {num_tokens}; got {bounds}"
        )


def packed_cu_seqlens(cu_seqlens, batch: int, tokens: int) -> list[int]:
    """Document bounds ``[N + 1]`` (python ints) in the packed token layout of ``B * T`` tokens.

    Without ``cu_seqlens`` each of the ``B`` rows is one sequence: ``[0, T, 2T, ..., B*T]``.
    With them ``B`` must be 1 (``ValueError`` otherwise).
    """
    if cu_seqlens is None:
        return [i * tokens for i in range(batch + 1)]
    if batch != 1:
        raise ValueError(
            f"with cu_seqlens the inputs must hold one packed row of documents (batch size 1), "
            f"got q with batch size {batch}"
        )
    bounds = _seqlens_list(cu_seqlens)
    _check_cu_seqlens(bounds, tokens)
    return bounds


def split_by_documents(x: torch.Tensor, cu_seqlens, dim: int = 0) -> list[torch.Tensor]:
    """Views of ``x`` along ``dim``, one per document ``[cu[n], cu[n+1])`` (empty documents included)."""
    bounds = _seqlens_list(cu_seqlens)
    return [x.narrow(dim, bos, eos - bos) for bos, eos in itertools.pairwise(bounds)]


def prepare_chunk_indices(cu_seqlens, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Chunks of every document, in token order: int64 ``[NC, 3]`` = (sequence, start, end).

    ``start``/``end`` are token offsets in the packed layout; each document is chunked from its
    own start, its last chunk may be shorter than ``chunk_size``, and an empty document has
    no chunk. On ``cu_seqlens``' device (the CPU for a list).
    """
    bounds = _seqlens_list(cu_seqlens)
    rows = [
        (n, start, min(start + chunk_size, eos))
        for n, (bos, eos) in enumerate(itertools.pairwise(bounds))
        for start in range(bos, eos, chunk_size)
    ]
    device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else None
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 3)


def prepare_chunk_offsets(cu_seqlens, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """int64 ``[N + 1]``: index of each sequence's first chunk in `prepare_chunk_indices` (and ``NC``)."""
    bounds = _seqlens_list(cu_seqlens)
    counts = [-(-(eos - bos) // chunk_size) for bos, eos in itertools.pairwise(bounds)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else None
    return torch.tensor(offsets, dtype=torch.int64, device=device)


def _chunk_positions(chunk_indices: torch.Tensor, chunk_size: int):
    pos = chunk_indices[:, 1:2] + torch.arange(chunk_size, device=chunk_indices.device)  # [NC, C]
    return pos, pos < chunk_indices[:, 2:3]


def to_chunks(x: torch.Tensor, chunk_indices: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Packed ``[T, HV, *D]`` -> padded chunk layout ``[NC, HV, C, *D]``, zeros past each chunk's end."""
    pos, valid = _chunk_positions(chunk_indices.to(x.device), chunk_size)
    xc = x[pos.clamp_max(max(x.shape[0] - 1, 0))]  # [NC, C, HV, *D]
    xc = torch.where(valid.view(*valid.shape, *([1] * (x.dim() - 1))), xc, 0)
    return xc.movedim(1, 2)


def from_chunks(xc: torch.Tensor, chunk_indices: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Padded chunk layout ``[NC, HV, C, *D]`` -> packed ``[T, HV, *D]``; tokens in no chunk are 0."""
    pos, valid = _chunk_positions(chunk_indices.to(xc.device), xc.shape[2])
    x = xc.movedim(2, 1)  # [NC, C, HV, *D]
    out = x.new_zeros((num_tokens, *x.shape[2:]))
    return out.index_put((pos[valid],), x[valid])


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, compute_dtype):
    """Packed ``[B*T, HV, ...]`` inputs in ``compute_dtype``, q and k expanded to the value heads."""
    batch, tokens, heads = q.shape[:3]
    value_heads = v.shape[2]
    if value_heads % heads:
        raise ValueError(f"the value heads HV = {value_heads} must be a multiple of the qk heads H = {heads}")
    bounds = packed_cu_seqlens(cu_seqlens, batch, tokens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    q, k, v, g, beta = (x.flatten(0, 1).to(compute_dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    group = value_heads // heads
    q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)  # [B*T, HV, K]
    h0 = None if initial_state is None else initial_state.to(compute_dtype)
    return q, k, v, g, beta, scale, h0, bounds


def _finish(o, final_state, v, output_final_state, compute_dtype):
    batch, tokens = v.shape[:2]
    o = o.unflatten(0, (batch, tokens))
    if compute_dtype != torch.float64:
        o = o.to(v.dtype)
    return o, (final_state if output_final_state else None)


# ----------------------------------------------------------------------------- naive recurrence


def naive_recurrent_gdn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        cu_seqlens=None, use_qk_l2norm_in_kernel=False, compute_dtype=torch.float64):
    """The recurrence token by token (the oracle): ``(o, final_state)``.

    ``q``, ``k`` ``[B, T, H, K]``; ``v`` ``[B, T, HV, V]``; ``g`` ``[B, T, HV]`` log decay;
    ``beta`` ``[B, T, HV]``; ``initial_state`` ``[N, HV, K, V]`` or None (zeros);
    ``cu_seqlens`` ``[N + 1]`` (tensor or list) with ``B = 1``, or None (``N = B``).
    ``use_qk_l2norm_in_kernel`` normalises q and k over the head dim first.

    Returns ``o`` ``[B, T, HV, V]`` in ``v``'s dtype (in ``compute_dtype`` when that is fp64)
    and, if ``output_final_state``, ``final_state`` ``[N, HV, K, V]`` in ``compute_dtype``
    (else None). Tokens past ``cu_seqlens[-1]`` get ``o = 0``; an empty document's final state
    is its initial state.
    """
    q, k, vv, g, beta, scale, h0, bounds = _prepare(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, compute_dtype)
    num_tokens, value_heads, dk = k.shape
    dv = vv.shape[-1]
    outs, finals = [], []
    for n, (bos, eos) in enumerate(itertools.pairwise(bounds)):
        state = h0[n] if h0 is not None else vv.new_zeros(value_heads, dk, dv)  # [HV, K, V]
        for t in range(bos, eos):
            state = state * g[t].exp()[:, None, None]
            u = beta[t][:, None] * (vv[t] - torch.bmm(k[t][:, None, :], state)[:, 0])  # [HV, V]
            state = state + k[t][:, :, None] * u[:, None, :]
            outs.append(scale * torch.bmm(q[t][:, None, :], state)[:, 0])
        finals.append(state)
    o = torch.stack(outs) if outs else vv.new_zeros(0, value_heads, dv)
    o = torch.cat([o, vv.new_zeros(num_tokens - o.shape[0], value_heads, dv)])
    final_state = torch.stack(finals) if output_final_state else None
    return _finish(o, final_state, v, output_final_state, compute_dtype)


# ----------------------------------------------------------------------------- chunk stages


def chunk_local_cumsum(g_chunks: torch.Tensor) -> torch.Tensor:
    """Cumulative gate within each chunk: ``[NC, HV, C]`` -> ``G`` ``[NC, HV, C]``, ``G_i = sum_{j<=i} g_j``."""
    return g_chunks.cumsum(-1)


def decay_matrix(g_cum: torch.Tensor, include_diagonal: bool) -> torch.Tensor:
    """``Gamma`` ``[NC, HV, C, C]``: ``exp(G_i - G_j)`` for ``j <= i`` (``j < i`` without the diagonal), else 0.

    The exponent is masked before ``exp``: the upper triangle (``G_i - G_j >= 0``, large for
    strong decay) never reaches ``exp``, so neither the value nor autograd's ``0 * exp(.)``
    can overflow.
    """
    size = g_cum.shape[-1]
    causal = torch.ones(size, size, dtype=torch.bool, device=g_cum.device).tril(0 if include_diagonal else -1)
    diff = g_cum[..., :, None] - g_cum[..., None, :]  # [NC, HV, C, C]
    return diff.masked_fill(~causal, 0).exp().masked_fill(~causal, 0)


def ut_transform(k: torch.Tensor, beta: torch.Tensor, g_cum: torch.Tensor) -> torch.Tensor:
    """``A = (I + L)^-1``, ``L = strictly_lower(diag(beta) k k^T * Gamma)``: ``[NC, HV, C, C]``, unit lower triangular.

    ``k`` ``[NC, HV, C, K]`` (normalised, expanded to the value heads); ``beta``, ``g_cum``
    ``[NC, HV, C]``. ``L_ij = beta_i (k_i . k_j) exp(G_i - G_j)`` for ``j < i``.
    """
    lower = beta[..., None] * (k @ k.transpose(-1, -2)) * decay_matrix(g_cum, include_diagonal=False)
    eye = torch.eye(lower.shape[-1], dtype=lower.dtype, device=lower.device).expand_as(lower)
    return torch.linalg.solve_triangular(eye + lower, eye, upper=False)


def wy_representation(A: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g_cum: torch.Tensor):
    """``(w, u)``: ``w = A (beta * exp(G) * k)`` ``[NC, HV, C, K]``, ``u = A (beta * v)`` ``[NC, HV, C, V]``.

    With the state ``h`` at the chunk's start, ``u - w h`` is every token's delta-rule
    correction ``u_t``.
    """
    w = A @ (k * (beta * g_cum.exp())[..., None])
    u = A @ (v * beta[..., None])
    return w, u


def chunk_state_pass(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g_cum: torch.Tensor,
                     chunk_indices: torch.Tensor, num_seqs: int, initial_state: torch.Tensor | None = None):
    """Sequential over chunks: ``(h, v_new, final_state)``.

    ``k``, ``w`` ``[NC, HV, C, K]``; ``u`` ``[NC, HV, C, V]``; ``g_cum`` ``[NC, HV, C]``;
    ``chunk_indices`` ``[NC, 3]`` from `prepare_chunk_indices`; ``initial_state``
    ``[N, HV, K, V]`` or None (zeros). A sequence's first chunk starts from its initial state::

        h_c     = state before chunk c                           # [HV, K, V]
        v_new_c = u_c - w_c h_c                                  # [HV, C, V]
        h_next  = exp(G_last) h_c + (k_c * exp(G_last - G_c))^T v_new_c

    Returns ``h`` ``[NC, HV, K, V]`` (each chunk's starting state), ``v_new`` ``[NC, HV, C, V]``
    and ``final_state`` ``[N, HV, K, V]`` (an empty document keeps its initial state).
    """
    value_heads, dk, dv = k.shape[1], k.shape[-1], u.shape[-1]
    if initial_state is None:
        states = [u.new_zeros(value_heads, dk, dv) for _ in range(num_seqs)]
    else:
        states = list(initial_state.unbind(0))
    g_last = g_cum[..., -1]  # [NC, HV]; padding (g = 0) keeps the last real token's value
    k_decayed = k * (g_last[..., None] - g_cum).exp()[..., None]  # [NC, HV, C, K]
    hs, v_news = [], []
    for c, n in enumerate(chunk_indices[:, 0].tolist()):
        h = states[n]
        v_new = u[c] - w[c] @ h  # [HV, C, K] @ [HV, K, V] -> [HV, C, V]
        states[n] = g_last[c].exp()[:, None, None] * h + k_decayed[c].transpose(-1, -2) @ v_new
        hs.append(h)
        v_news.append(v_new)
    h = torch.stack(hs) if hs else u.new_zeros(0, value_heads, dk, dv)
    v_new = torch.stack(v_news) if v_news else torch.zeros_like(u)
    final_state = torch.stack(states) if states else u.new_zeros(0, value_heads, dk, dv)
    return h, v_new, final_state


def chunk_output(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, h: torch.Tensor, g_cum: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """``o = scale * [(q * exp(G)) h + tril(q k^T * Gamma) v_new]``: ``[NC, HV, C, V]``.

    ``q``, ``k`` ``[NC, HV, C, K]``; ``v_new`` ``[NC, HV, C, V]``; ``h`` ``[NC, HV, K, V]``;
    ``g_cum`` ``[NC, HV, C]``; the triangle includes the diagonal.
    """
    inter = (q * g_cum.exp()[..., None]) @ h  # [NC, HV, C, K] @ [NC, HV, K, V]
    intra = ((q @ k.transpose(-1, -2)) * decay_matrix(g_cum, include_diagonal=True)) @ v_new
    return scale * (inter + intra)


# ----------------------------------------------------------------------------- chunked reference


class ChunkStages(NamedTuple):
    """Every intermediate of the chunked forward, in the packed token layout kernels store.

    ``T`` is the packed token count (``B * T`` without ``cu_seqlens``), ``NC`` the number of
    chunks (`prepare_chunk_indices` order), ``C`` the chunk size. All in the compute dtype.
    """

    chunk_indices: torch.Tensor  # [NC, 3] int64 (sequence, start, end)
    q: torch.Tensor  # [T, HV, K] normalised (if asked) and expanded to the value heads
    k: torch.Tensor  # [T, HV, K]
    g_cum: torch.Tensor  # [T, HV] chunk-local cumulative gate
    A: torch.Tensor  # [T, HV, C] row t of its chunk's (I + L)^-1, columns = position in chunk
    w: torch.Tensor  # [T, HV, K]
    u: torch.Tensor  # [T, HV, V]
    h: torch.Tensor  # [NC, HV, K, V] state at each chunk's start
    v_new: torch.Tensor  # [T, HV, V]
    o: torch.Tensor  # [T, HV, V]
    final_state: torch.Tensor  # [N, HV, K, V]


def _chunk_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, compute_dtype,
                   chunk_size):
    q, k, v, g, beta, scale, h0, bounds = _prepare(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, compute_dtype)
    chunk_indices = prepare_chunk_indices(bounds, chunk_size)
    qc, kc, vc, gc, bc = (to_chunks(x, chunk_indices, chunk_size) for x in (q, k, v, g, beta))
    g_cum = chunk_local_cumsum(gc)
    A = ut_transform(kc, bc, g_cum)
    w, u = wy_representation(A, kc, vc, bc, g_cum)
    h, v_new, final_state = chunk_state_pass(kc, w, u, g_cum, chunk_indices, len(bounds) - 1, h0)
    o = chunk_output(qc, kc, v_new, h, g_cum, scale)
    chunks = {"chunk_indices": chunk_indices, "q": q, "k": k, "g_cum": g_cum, "A": A, "w": w, "u": u, "h": h,
              "v_new": v_new, "o": o, "final_state": final_state}
    return chunks, q.shape[0]


def chunk_gdn_stages(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None,
                     use_qk_l2norm_in_kernel=False, compute_dtype=torch.float64,
                     chunk_size=CHUNK_SIZE) -> ChunkStages:
    """The chunked forward's intermediates (`ChunkStages`), for testing kernel stages one by one.

    Arguments as `chunk_gdn_reference`; everything returned is in ``compute_dtype``.
    """
    chunks, num_tokens = _chunk_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                        use_qk_l2norm_in_kernel, compute_dtype, chunk_size)
    ci = chunks["chunk_indices"]
    flat = {name: from_chunks(chunks[name], ci, num_tokens) for name in ("g_cum", "A", "w", "u", "v_new", "o")}
    return ChunkStages(chunk_indices=ci, q=chunks["q"], k=chunks["k"], h=chunks["h"],
                       final_state=chunks["final_state"], **flat)


def chunk_gdn_reference(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        cu_seqlens=None, use_qk_l2norm_in_kernel=False, compute_dtype=torch.float64,
                        chunk_size=CHUNK_SIZE):
    """The chunked algorithm the kernels implement, stage by stage: ``(o, final_state)``.

    Arguments and results as `naive_recurrent_gdn` (same layouts, dtypes and
    conventions), plus ``chunk_size`` (``C``, 64 in the kernels). Each document is chunked
    from its own start. Runs in fp32 (the kernels' arithmetic, without their bf16 operand
    rounding) or fp64; differentiable by autograd.
    """
    chunks, num_tokens = _chunk_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                        use_qk_l2norm_in_kernel, compute_dtype, chunk_size)
    o = from_chunks(chunks["o"], chunks["chunk_indices"], num_tokens)
    return _finish(o, chunks["final_state"], v, output_final_state, compute_dtype)
