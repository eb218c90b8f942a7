"""Gated DeltaNet backward: the gradients of q, k, w and the cumulative gate from o and the state update.

One program per (chunk, value head), chunks of ``C = BT = 64`` tokens from the chunk table (the
last chunk of a document may be short; :func:`dsfuse.gdn.reference_backward.chunk_dqkwg` is the
math). With ``h`` the state at the chunk's start ``[K, V]``, ``dh`` the gradient of the state
after it, ``do`` the gradient of o, ``dv_new`` the total gradient of ``v_new`` and
``Gamma_ij = exp(G_i - G_j)`` for ``j <= i`` (0 above the diagonal)::

    dA_o     = scale (do v_new^T) * Gamma                          # [BT, BT]
    dq_inter = scale exp(G) (do h^T)                               # [BT, K]
    dk_state = exp(G_last - G) (v_new dh^T)
    dq = dq_inter + dA_o k
    dk = dA_o^T q + dk_state                                       # the WY part is added by a later stage
    dw = -dv_new h^T
    ds = dA_o * (q k^T)
    dG_i = sum(q_i dq_inter_i) + rowsum(ds)_i - colsum(ds)_i - sum(k_i dk_state_i)
    dG_last += exp(G_last) sum(dh * h) + sum_i sum(k_i dk_state_i)   # at the chunk's last token

``dG`` is the gradient of the chunk-local cumulative gate (before the reverse cumulative sum
that makes ``dg``); ``dq``, ``dk`` are per VALUE head (a later stage sums the value heads of
each qk head and applies the L2-norm backward).

Five phases per program, each a loop over blocks of ``BK`` key or ``BV`` value channels:
(1) ``q k^T`` (k loaded transposed) and the rows' squared norms; (2) ``do v_new^T`` (v_new
loaded transposed), masked and decayed into ``dA_o``, then ``ds`` and its row and column sums;
(3) per key block, ``do h^T`` and ``dv_new h^T`` over value blocks (``h`` loaded as transposed
``[BV, BK]`` tiles, swapped strides), then ``dq`` and ``dw`` of the block are stored; (4)
``dA_o^T`` as its own dot ``v_new do^T`` (do loaded transposed) with the transposed mask and
decay; (5) per key block, ``v_new dh^T`` and ``sum(dh * h)`` over value blocks, then ``dk``.
No dot result is ever transposed (Triton 3.6 on Hopper miscompiles ``tl.trans`` of a wgmma
accumulator). The causal mask is applied to the exponent before ``exp`` and to the product
after it, so only ``G_i - G_j <= 0``, ``G_last - G_i <= 0`` and ``G_i <= 0`` are exponentiated.
``dA_o^T`` is built after ``dq`` so that only one rounded ``[BT, BT]`` tile is live at a time.
Tiles read by two phases carry a different eviction hint at each read (``evict_last`` when
read again later, ``evict_first`` at the last read): besides the L2 hint, this keeps the
compiler from merging the two reads into one value held in registers between the phases.

``USE_QK_L2NORM``: ``q`` and ``k`` are normalised on load in fp32 (``x r``,
``r = rsqrt(sum x^2 + 1e-6)``, the forward stages' eps). The norms are folded where they
are exact: ``q k^T`` is the dot of the loaded rows scaled by ``r_q[i] r_k[j]``; ``dA_o k_hat``
is ``(dA_o * r_k[None, :]) k`` and ``dA_o^T q_hat`` is ``(dA_o^T * r_q[None, :]) q``; the gate
sums use the fp32 normalised rows. So the only rounding to the dot dtype besides the inputs
is that of the masked ``dA_o`` / ``dA_o^T`` where they enter a dot.

Precision: bf16/fp16 inputs multiply bf16/fp16 operands with fp32 accumulation; fp32 inputs
multiply in full fp32 (``input_precision="ieee"``, not TF32). ``dq``, ``dk``, ``dG`` are fp32;
every term of ``dG`` is reduced in fp32 from fp32 values (``ds`` from the unrounded ``dA_o``
and the fp32 ``q k^T``; ``q``, ``k`` normalised in fp32), as it is a difference of large terms
when the decay is strong. ``dw`` is rounded once to the input dtype.

Layouts (packed tokens): ``q``, ``k`` ``[T, H, K]``; ``v_new``, ``do``, ``dv_new`` ``[T, HV, V]``
in the input dtype (any token and head strides, unit channel stride); ``h``, ``dh``
``[NC, HV, K, V]`` contiguous in the input dtype; ``g_cum`` fp32 ``[T, HV]``; outputs ``dq``,
``dk`` fp32 ``[T, HV, K]``, ``dw`` ``[T, HV, K]`` in the input dtype (unit channel stride), ``dg``
fp32 ``[T, HV]``. Value head ``i_hv`` reads qk head ``i_hv // (HV // H)``. A chunk's first token
offset is int64 before it multiplies a stride (scalar base pointers); offsets within a chunk
(at most 63 times a token stride) are int32. Tokens in no chunk
(past ``cu_seqlens[-1]``, which the public API refuses) are not written. No atomics: every
output element is written by one program, reductions run in a fixed order, the launch
constants are fixed; two launches give the same bits. Grid ``(NC, HV)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsfuse._common.aot import AotSpec
from dsfuse.gdn.triton.state import (
    CHUNK,
    L2NORM_EPS,
    _dot,
    _round,
    dot_precision,
    emulate_bf16,
)

# Launch constants (no autotuner): key blocks of 32 channels, value blocks of 64, 4 warps. Chosen
# for registers, not timed on a GPU yet: AOT_SPECS (K = V = 128, bf16) compile at 253-255 registers
# on sm_90 and 237-238 on sm_100 without spills; 64-channel key blocks spilled 8-88 bytes on sm_90.
BLOCK_K = 32
BLOCK_V = 64
NUM_WARPS = 4
NUM_STAGES = 2


@triton.jit
def _dqkwg_kernel(
    q_ptr,  # [T, H, K], unit channel stride
    k_ptr,  # [T, H, K]
    vn_ptr,  # v_new [T, HV, V]
    h_ptr,  # [NC, HV, K, V] contiguous: state at each chunk's start
    dh_ptr,  # [NC, HV, K, V] contiguous: gradient of the state after each chunk
    do_ptr,  # [T, HV, V]
    dv_ptr,  # dv_new [T, HV, V]
    g_ptr,  # g_cum fp32 [T, HV]
    ci_ptr,  # chunk_indices int32 [NC, 3] (sequence, start, end), contiguous
    dq_ptr,  # fp32 [T, HV, K] (out)
    dk_ptr,  # fp32 [T, HV, K] (out)
    dw_ptr,  # [T, HV, K] input dtype (out)
    dg_ptr,  # fp32 [T, HV] (out)
    scale,  # fp32
    s_qt, s_qh,
    s_kt, s_kh,
    s_vt, s_vh,
    s_ot, s_oh,
    s_dvt, s_dvh,
    s_gt, s_gh,
    s_dqt, s_dqh,
    s_dkt, s_dkh,
    s_dwt, s_dwh,
    s_dgt, s_dgh,
    HV: tl.constexpr,
    GROUP: tl.constexpr,  # HV // H
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32); ignored for bf16/fp16
    EMULATE_BF16: tl.constexpr,  # CPU interpreter with bf16 data only (see state._dot, state._round)
):
    i_c = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    i_h = i_hv // GROUP
    start = tl.load(ci_ptr + i_c * 3 + 1)
    n_t = tl.load(ci_ptr + i_c * 3 + 2) - start  # tokens in the chunk, 1 .. BT
    bos = start.to(tl.int64)  # int64 before it multiplies a stride
    o_i = tl.arange(0, BT)
    m_t = o_i < n_t
    dtype = do_ptr.dtype.element_ty

    # the chunk's rows of every tensor: scalar base pointers (int64 offsets), tile offsets from them
    q_ptr += bos * s_qt + i_h * s_qh
    k_ptr += bos * s_kt + i_h * s_kh
    vn_ptr += bos * s_vt + i_hv * s_vh
    do_ptr += bos * s_ot + i_hv * s_oh
    dv_ptr += bos * s_dvt + i_hv * s_dvh
    g_ptr += bos * s_gt + i_hv * s_gh
    dq_ptr += bos * s_dqt + i_hv * s_dqh
    dk_ptr += bos * s_dkt + i_hv * s_dkh
    dw_ptr += bos * s_dwt + i_hv * s_dwh
    dg_ptr += bos * s_dgt + i_hv * s_dgh
    h_ptr += (i_c * HV + i_hv) * (K * V)
    dh_ptr += (i_c * HV + i_hv) * (K * V)

    b_g = tl.load(g_ptr + o_i * s_gt, mask=m_t, other=0.0)  # [BT], <= 0 in the chunk
    b_g_last = tl.load(g_ptr + (n_t - 1) * s_gt)

    # ---- (1) q k^T [BT, BT] over key blocks (k loaded transposed), with the rows' squared norms
    b_qk = tl.zeros([BT, BT], dtype=tl.float32)
    b_ssq = tl.zeros([BT], dtype=tl.float32)
    b_ssk = tl.zeros([BT], dtype=tl.float32)
    for i_k in tl.static_range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_q = tl.load(q_ptr + o_i[:, None] * s_qt + o_k[None, :], mask=m_t[:, None], other=0.0,
                      eviction_policy="evict_last")  # [BT, BK]
        b_kt = tl.load(k_ptr + o_i[None, :] * s_kt + o_k[:, None], mask=m_t[None, :], other=0.0)  # [BK, BT]
        b_qk = _dot(b_q, b_kt, b_qk, DOT_PRECISION, EMULATE_BF16)
        if USE_QK_L2NORM:
            b_qf = b_q.to(tl.float32)
            b_kf = b_kt.to(tl.float32)
            b_ssq += tl.sum(b_qf * b_qf, axis=1)
            b_ssk += tl.sum(b_kf * b_kf, axis=0)
    if USE_QK_L2NORM:
        b_rq = tl.rsqrt(b_ssq + L2NORM_EPS)  # [BT]
        b_rk = tl.rsqrt(b_ssk + L2NORM_EPS)
        b_qk = b_qk * b_rq[:, None] * b_rk[None, :]

    # ---- (2) dA_o = scale (do v_new^T) * Gamma over value blocks (v_new loaded transposed)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)  # [i, j] = do_i . v_j
    for i_v in tl.static_range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        b_do = tl.load(do_ptr + o_i[:, None] * s_ot + o_v[None, :], mask=m_t[:, None], other=0.0,
                       eviction_policy="evict_last")  # [BT, BV]
        b_vt = tl.load(vn_ptr + o_i[None, :] * s_vt + o_v[:, None], mask=m_t[None, :], other=0.0)  # [BV, BT]
        b_dA = _dot(b_do, b_vt, b_dA, DOT_PRECISION, EMULATE_BF16)
    m_valid = m_t[:, None] & m_t[None, :]
    m_A = (o_i[:, None] >= o_i[None, :]) & m_valid
    b_dA = tl.where(m_A, b_dA * tl.exp(tl.where(m_A, b_g[:, None] - b_g[None, :], 0.0)), 0.0) * scale
    # the intra-chunk term of dG: ds = dA_o * (q k^T), both fp32
    b_ds = b_dA * b_qk
    b_dg = tl.sum(b_ds, axis=1) - tl.sum(b_ds, axis=0)  # [BT]
    # the dot operand: k's norms folded into dA_o's columns, one rounding
    if USE_QK_L2NORM:
        b_dA = b_dA * b_rk[None, :]
    b_dA = _round(b_dA, dtype, EMULATE_BF16)

    # ---- (3) per key block: do h^T and dv_new h^T over value blocks (h^T loaded), then dq, dw
    b_eg = tl.exp(b_g) * scale  # [BT]; padding rows: their accumulators are 0
    for i_k in tl.static_range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_dw = tl.zeros([BT, BK], dtype=tl.float32)
        for i_v in tl.static_range(V // BV):
            o_v = i_v * BV + tl.arange(0, BV)
            b_ht = tl.load(h_ptr + o_k[None, :] * V + o_v[:, None])  # [BV, BK]: h^T, swapped strides
            b_do = tl.load(do_ptr + o_i[:, None] * s_ot + o_v[None, :], mask=m_t[:, None], other=0.0,
                           eviction_policy="evict_first")  # [BT, BV]
            b_dv = tl.load(dv_ptr + o_i[:, None] * s_dvt + o_v[None, :], mask=m_t[:, None], other=0.0)
            b_dq = _dot(b_do, b_ht, b_dq, DOT_PRECISION, EMULATE_BF16)  # [BT, BV] @ [BV, BK]
            b_dw = _dot(b_dv, b_ht, b_dw, DOT_PRECISION, EMULATE_BF16)
        b_q = tl.load(q_ptr + o_i[:, None] * s_qt + o_k[None, :], mask=m_t[:, None], other=0.0)  # [BT, BK]
        b_k = tl.load(k_ptr + o_i[:, None] * s_kt + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_qf = b_q.to(tl.float32)
        if USE_QK_L2NORM:
            b_qf = b_qf * b_rq[:, None]
        # dq = scale exp(G) (do h^T) + dA_o k
        b_dq = b_dq * b_eg[:, None]
        b_dg += tl.sum(b_qf * b_dq, axis=1)
        b_dq = _dot(b_dA, b_k, b_dq, DOT_PRECISION, EMULATE_BF16)  # [BT, BT] @ [BT, BK]
        tl.store(dq_ptr + o_i[:, None] * s_dqt + o_k[None, :], b_dq, mask=m_t[:, None])
        tl.store(dw_ptr + o_i[:, None] * s_dwt + o_k[None, :], _round(-b_dw, dw_ptr.dtype.element_ty, EMULATE_BF16),
                 mask=m_t[:, None])

    # ---- (4) dA_o^T = scale (v_new do^T) * Gamma^T as its own dot (do loaded transposed)
    b_dAt = tl.zeros([BT, BT], dtype=tl.float32)  # [j, i] = v_j . do_i
    for i_v in tl.static_range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        b_v = tl.load(vn_ptr + o_i[:, None] * s_vt + o_v[None, :], mask=m_t[:, None], other=0.0,
                      eviction_policy="evict_last")  # [BT, BV]
        b_dot = tl.load(do_ptr + o_i[None, :] * s_ot + o_v[:, None], mask=m_t[None, :], other=0.0)  # [BV, BT]
        b_dAt = _dot(b_v, b_dot, b_dAt, DOT_PRECISION, EMULATE_BF16)
    m_At = (o_i[:, None] <= o_i[None, :]) & m_valid
    b_dAt = tl.where(m_At, b_dAt * tl.exp(tl.where(m_At, b_g[None, :] - b_g[:, None], 0.0)), 0.0) * scale
    if USE_QK_L2NORM:
        b_dAt = b_dAt * b_rq[None, :]  # q's norms folded into the columns
    b_dAt = _round(b_dAt, dtype, EMULATE_BF16)

    # ---- (5) per key block: v_new dh^T over value blocks (dh^T loaded) and sum(dh * h), then dk
    b_dl = tl.where(m_t, tl.exp(tl.where(m_t, b_g_last - b_g, 0.0)), 0.0)  # [BT] exp(G_last - G)
    b_hdh = tl.zeros([BV], dtype=tl.float32)  # sum(dh * h) per row of an h^T tile; summed at the end
    b_kst = tl.zeros([BT], dtype=tl.float32)  # sum(k_i dk_state_i) per token
    for i_k in tl.static_range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_dk = tl.zeros([BT, BK], dtype=tl.float32)
        for i_v in tl.static_range(V // BV):
            o_v = i_v * BV + tl.arange(0, BV)
            o_hkv = o_k[None, :] * V + o_v[:, None]  # [BV, BK]: h^T, dh^T
            b_ht = tl.load(h_ptr + o_hkv, eviction_policy="evict_first")
            b_dht = tl.load(dh_ptr + o_hkv)
            b_v = tl.load(vn_ptr + o_i[:, None] * s_vt + o_v[None, :], mask=m_t[:, None], other=0.0,
                          eviction_policy="evict_first")  # [BT, BV]
            b_dk = _dot(b_v, b_dht, b_dk, DOT_PRECISION, EMULATE_BF16)  # [BT, BV] @ [BV, BK]
            b_hdh += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), axis=1)
        b_q = tl.load(q_ptr + o_i[:, None] * s_qt + o_k[None, :], mask=m_t[:, None], other=0.0,
                      eviction_policy="evict_first")  # [BT, BK]
        b_kf = tl.load(k_ptr + o_i[:, None] * s_kt + o_k[None, :], mask=m_t[:, None], other=0.0,
                       eviction_policy="evict_first").to(tl.float32)
        if USE_QK_L2NORM:
            b_kf = b_kf * b_rk[:, None]
        # dk = exp(G_last - G) (v_new dh^T) + dA_o^T q
        b_dk = b_dk * b_dl[:, None]
        b_ks = tl.sum(b_kf * b_dk, axis=1)  # [BT]
        b_dg -= b_ks
        b_kst += b_ks
        b_dk = _dot(b_dAt, b_q, b_dk, DOT_PRECISION, EMULATE_BF16)  # [BT, BT] @ [BT, BK]
        tl.store(dk_ptr + o_i[:, None] * s_dkt + o_k[None, :], b_dk, mask=m_t[:, None])

    # G_last's gradient at the chunk's last token
    # (sum_i k_state_i as a [1, BT] -> [1] sum: a rank-1 sum to a scalar of a value computed from a
    # tensor-memory accumulator crashes Triton 3.6's sm_100 TMEM layout pass)
    b_dg_last = tl.exp(b_g_last) * tl.sum(b_hdh, axis=0) + tl.sum(tl.reshape(b_kst, [1, BT]), axis=1)  # [1]
    b_dg = tl.where(o_i == n_t - 1, b_dg + b_dg_last, b_dg)
    tl.store(dg_ptr + o_i * s_dgt, b_dg, mask=m_t)


def blocks(K: int, V: int) -> tuple[int, int]:
    """``(BK, BV)``: channels of a key / value block."""
    return min(K, BLOCK_K), min(V, BLOCK_V)


def launch_dqkwg(
    q: torch.Tensor,
    k: torch.Tensor,
    v_new: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    do: torch.Tensor,
    dv_new: torch.Tensor,
    g_cum: torch.Tensor,
    chunk_indices: torch.Tensor,
    scale: float,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dw: torch.Tensor,
    dg: torch.Tensor,
    *,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write ``dq``, ``dk`` (fp32 ``[T, HV, K]``), ``dw`` (``[T, HV, K]``, input dtype) and ``dg`` (fp32
    ``[T, HV]``, the gradient of ``g_cum``) of every chunk; returns them.

    ``q``, ``k`` ``[T, H, K]``; ``v_new``, ``do``, ``dv_new`` ``[T, HV, V]`` (any token and head
    strides, unit channel stride); ``h`` (state at each chunk's start), ``dh`` (gradient of the
    state after it) ``[NC, HV, K, V]`` contiguous; ``g_cum`` fp32 ``[T, HV]``; ``chunk_indices``
    int32 ``[NC, 3]`` contiguous. ``dq``, ``dk`` are per value head and w.r.t. the normalised q, k
    when ``use_qk_l2norm`` (q and k normalised in the kernel). ``dk`` holds the output and
    state-update terms only (the WY part is added later). Arguments are validated by the public API.
    """
    H, K = q.shape[1], q.shape[2]
    HV, V = v_new.shape[1], v_new.shape[2]
    NC = chunk_indices.shape[0]
    if NC == 0 or HV == 0:
        return dq, dk, dw, dg
    BK, BV = blocks(K, V)
    _dqkwg_kernel[(NC, HV)](
        q, k, v_new, h, dh, do, dv_new, g_cum, chunk_indices, dq, dk, dw, dg,
        float(scale),
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        v_new.stride(0), v_new.stride(1),
        do.stride(0), do.stride(1),
        dv_new.stride(0), dv_new.stride(1),
        g_cum.stride(0), g_cum.stride(1),
        dq.stride(0), dq.stride(1),
        dk.stride(0), dk.stride(1),
        dw.stride(0), dw.stride(1),
        dg.stride(0), dg.stride(1),
        HV=HV, GROUP=HV // H, K=K, V=V, BT=CHUNK, BK=BK, BV=BV,
        USE_QK_L2NORM=use_qk_l2norm,
        DOT_PRECISION=dot_precision(q.dtype),
        EMULATE_BF16=emulate_bf16(q.dtype),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return dq, dk, dw, dg


def _aot_specs() -> list[AotSpec]:
    """The model's specialisations: K = V = 128, H = 16, HV = 48, bf16, BT = 64; packed q/k row.

    q, k are head views of the packed row ``[T, (2H + HV) * 128]`` (token stride 10240, head
    stride 128); v_new, do, dv_new, dw ``[T, 48, 128]`` and dq, dk fp32 ``[T, 48, 128]`` dense;
    g_cum, dg fp32 ``[T, 48]`` dense (head stride 1). With and without the in-kernel L2 norm.
    """
    K = V = 128
    H, HV = 16, 48
    BK, BV = blocks(K, V)
    signature = {
        "q_ptr": "*bf16", "k_ptr": "*bf16", "vn_ptr": "*bf16", "h_ptr": "*bf16", "dh_ptr": "*bf16",
        "do_ptr": "*bf16", "dv_ptr": "*bf16", "g_ptr": "*fp32", "ci_ptr": "*i32",
        "dq_ptr": "*fp32", "dk_ptr": "*fp32", "dw_ptr": "*bf16", "dg_ptr": "*fp32", "scale": "fp32",
        "s_qt": "i32", "s_qh": "i32", "s_kt": "i32", "s_kh": "i32", "s_vt": "i32", "s_vh": "i32",
        "s_ot": "i32", "s_oh": "i32", "s_dvt": "i32", "s_dvh": "i32", "s_gt": "i32",
        "s_dqt": "i32", "s_dqh": "i32", "s_dkt": "i32", "s_dkh": "i32", "s_dwt": "i32", "s_dwh": "i32",
        "s_dgt": "i32",
    }
    return [
        AotSpec(
            name=f"gdn_dqkwg{'_l2' if l2 else ''}_bf16",
            kernel=_dqkwg_kernel,
            signature=signature,
            constexprs={
                "s_gh": 1, "s_dgh": 1, "HV": HV, "GROUP": HV // H, "K": K, "V": V, "BT": CHUNK, "BK": BK, "BV": BV,
                "USE_QK_L2NORM": l2, "DOT_PRECISION": dot_precision(torch.bfloat16), "EMULATE_BF16": False,
            },
            options={"num_warps": NUM_WARPS, "num_stages": NUM_STAGES},
            divisible_by_16=tuple(n for n in signature if n.endswith("_ptr") or n.startswith("s_")),
        )
        for l2 in (True, False)
    ]


AOT_SPECS = _aot_specs()
