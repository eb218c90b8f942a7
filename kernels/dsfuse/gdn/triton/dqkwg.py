"""Gated DeltaNet backward: the gradients of q, k, w and the cumulative gate from o and the state update.

One program per (chunk, value head), chunks of ``C = BT = 64`` tokens from the chunk table (the
last chunk of a document may be short; ``dsfuse.gdn.reference_backward.chunk_dqkwg`` is the
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

Key and value channels in blocks of ``BK = BV = 64`` (K = V = 128: two of each), 4 warps. Five
phases per program, each a loop over channel blocks with one fp32 accumulator tile:
(1) ``q k^T`` over key blocks (k loaded transposed) and the rows' squared norms; (2)
``do v_new^T`` over value blocks (v_new loaded transposed), masked and decayed into ``dA_o``,
then ``ds`` and its row and column sums; ``dA_o`` is rounded once to the input dtype; (3) per
key block, ``dv_new h^T`` over value blocks, ``dw`` stored, then ``do h^T`` over value blocks,
``dq = dq_inter + dA_o k`` stored (``h`` loaded as transposed ``[BV, BK]`` tiles, swapped
strides); (4) ``dA_o^T`` as its own dot ``v_new do^T`` (do loaded transposed) with the
transposed mask and decay, rounded once; (5) per key block, ``v_new dh^T`` and ``sum(dh * h)``
over value blocks, then ``dk = dk_state + dA_o^T q`` stored. At K = V = 128 that is 22
``[64, 64] x [64, 64]`` dots per program, single-pass bf16 (fp32 accumulation) for 16-bit
inputs. No dot result is ever transposed (Triton 3.6 on Hopper miscompiles ``tl.trans`` of a
wgmma accumulator). The causal mask is applied to the exponent before ``exp`` and to the
product after it, so only ``G_i - G_j <= 0``, ``G_last - G_i <= 0`` and ``G_i <= 0`` are
exponentiated. ``dA_o^T`` is built after ``dq`` so that only one rounded ``[BT, BT]`` tile is
live at a time.

Registers: the tile loads of the channel loops are asynchronous copies to shared memory
(software-pipelined ``range`` loops), so tiles do not sit in registers. Phases (3)-(5) read
the chunk's start again from the chunk table in each loop body (``_zero``: a 0 the compiler
cannot fold) and build their token and state offsets from it; otherwise the compiler keeps
the 64-bit addresses and masks of every tile of the earlier phases, and those hoisted out of
the key loops, in registers across the whole program (it merges equal offsets across phases).
The row sums of phases (3) and (5) are carried through the key loops as ``[BT, 1]`` tiles: as
``[BT]`` vectors the compiler moved each ``[BT, BK]`` fp32 product through shared memory into
another layout to sum it. For 16-bit inputs the launch caps the registers at ``CONFIG.maxnreg``.
The ``AOT_SPECS`` (K = V = 128, bf16) compile at 148-168 registers without spills on sm_90 and
sm_100 (uncapped, the compiler takes 201-219 on sm_90 and 144-229 on sm_100). Shared memory:
32 KB (sm_90), 41 KB (sm_100). Not timed on a GPU yet.

``USE_QK_L2NORM``: ``q`` and ``k`` are normalised on load in fp32 (``x r``,
``r = rsqrt(sum x^2 + 1e-6)``, the forward stages' eps). The norms are folded where they
are exact: ``dA_o k_hat`` is ``(dA_o * r_k[None, :]) k`` and ``dA_o^T q_hat`` is
``(dA_o^T * r_q[None, :]) q``; ``ds`` is ``(dA_o * r_k[None, :]) * (q k^T) * r_q[:, None]`` with
``q k^T`` the fp32 dot of the loaded rows; ``sum(q_hat_i dq_inter_i)`` is
``r_q[i] sum(q_i dq_inter_i)`` (likewise for k), fp32 sums of the loaded rows. So the only
rounding to the dot dtype besides the inputs is that of the masked ``dA_o`` / ``dA_o^T``
where they enter a dot.

Precision: bf16/fp16 inputs multiply bf16/fp16 operands with fp32 accumulation; fp32 inputs
multiply in full fp32 (``input_precision="ieee"``, not TF32). ``dq``, ``dk``, ``dG`` are fp32;
every term of ``dG`` is reduced in fp32 from fp32 values (``ds`` from the unrounded ``dA_o``
and the fp32 ``q k^T``; the norms applied in fp32), as it is a difference of large terms when
the decay is strong. ``dw`` is rounded once to the input dtype.

Layouts (packed tokens): ``q``, ``k`` ``[T, H, K]``; ``v_new``, ``do``, ``dv_new`` ``[T, HV, V]``
in the input dtype (any token and head strides, unit channel stride); ``h``, ``dh``
``[NC, HV, K, V]`` contiguous in the input dtype; ``g_cum`` fp32 ``[T, HV]``; outputs ``dq``,
``dk`` fp32 ``[T, HV, K]``, ``dw`` ``[T, HV, K]`` in the input dtype (unit channel stride), ``dg``
fp32 ``[T, HV]``. Value head ``i_hv`` reads qk head ``i_hv // (HV // H)``. A chunk's first token
offset is int64 before it multiplies a stride (scalar base pointers); offsets within a chunk
(at most 63 times a token stride) are int32. Tokens in no chunk
(past ``cu_seqlens[-1]``, which the public API refuses) are not written. No atomics: every
output element is written by one program, reductions run in a fixed order, the launch
constants are fixed; two launches give the same bits. Grid: one axis of ``NC * HV`` programs,
value head fastest, so the programs of one chunk run together and the ``HV // H`` value heads
of a qk head read its ``q``, ``k`` rows while they are in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsfuse.gdn.triton import common

# Launch constants (no autotuner, every GPU family): key and value blocks of 64 channels, 4 warps,
# 2-stage pipelined channel loops; 16-bit inputs capped at 168 registers (3 programs of 4 warps per
# SM), with which AOT_SPECS compile without spills on sm_90 and sm_100 (at a cap of 152 sm_100 spills
# 4-16 bytes). fp32 inputs (FMA dots) are not capped. Chosen for registers; not timed on a GPU yet.
CONFIG = common.LaunchConfig(block_k=64, block_v=64, num_warps=4, num_stages=2, maxnreg=168)


@triton.jit
def _zero(ci_ptr, i_c, start):
    """0 as an int32 the compiler cannot see through: the chunk's start read again from the chunk
    table, minus its first read. Offsets built from it in a loop body are computed there (after the
    stores of the loop), not kept in registers from an earlier phase nor hoisted out of the loop."""
    return tl.load(ci_ptr + i_c * 3 + 1) - start


@triton.jit
def _block_rows(ci_ptr, i_c, start, n_t, o_k, BT: tl.constexpr, V: tl.constexpr):
    """A key block's offsets, built from `_zero` where they are used: ``(o_t, m_t, o_h)``, the
    chunk's token offsets ``[BT]``, their mask, and ``o_h`` ``[BK]``, the offsets of the block's
    rows in a ``[K, V]`` state (h^T / dh^T: ``[BV, BK]`` tiles, row k at ``o_h[k]``)."""
    z = _zero(ci_ptr, i_c, start)
    o_t = tl.arange(0, BT) + z
    m_t = o_t < n_t
    o_h = (o_k + z) * V
    return o_t, m_t, o_h


@triton.jit
def _rows_times_state_t(x_ptr, s_xt, st_ptr, ci_ptr, i_c, start, n_t, o_k, h_ptr, b_hdh, BT: tl.constexpr,
                        BK: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        EMULATE_BF16: tl.constexpr):
    """``x @ S^T`` for a key block (fp32 ``[BT, BK]``, over value blocks, ``S^T`` loaded transposed):
    ``x`` the chunk's ``[BT, V]`` rows, ``S`` a ``[K, V]`` state; returns ``(o_t, m_t, x @ S^T)``.
    With a state ``h_ptr`` (not None), in the same loop ``sum(S * h)`` of each ``S^T`` tile as loaded
    and the same tile of ``h`` is added to ``b_hdh`` ``[BV]``, returned last."""
    o_t, m_t, o_h = _block_rows(ci_ptr, i_c, start, n_t, o_k, BT, V)
    b_acc = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        b_st = tl.load(st_ptr + o_h[None, :] + o_v[:, None])  # [BV, BK]
        b_x = tl.load(x_ptr + o_t[:, None] * s_xt + o_v[None, :], mask=m_t[:, None], other=0.0)  # [BT, BV]
        b_acc = common.dot(b_x, b_st, b_acc, DOT_PRECISION, EMULATE_BF16)
        if h_ptr is not None:
            b_ht = tl.load(h_ptr + o_h[None, :] + o_v[:, None])
            b_hdh += tl.sum(b_ht.to(tl.float32) * b_st.to(tl.float32), axis=1)
    if h_ptr is None:
        return o_t, m_t, b_acc
    else:
        return o_t, m_t, b_acc, b_hdh


@triton.jit
def _rows_times_rows_t(a_ptr, s_at, b_ptr, s_bt, o_t, m_t, BT: tl.constexpr, N: tl.constexpr, BN: tl.constexpr,
                       NORMS: tl.constexpr, DOT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``a @ b^T`` (fp32 ``[BT, BT]``) of the chunk's ``[BT, N]`` rows of ``a`` and ``b``, over channel
    blocks of ``BN`` (``b`` loaded transposed); returns it and, with ``NORMS``, the squared norms
    ``[BT]`` of ``a``'s and ``b``'s rows, summed in fp32 from the same tiles (else zeros)."""
    b_acc = tl.zeros([BT, BT], dtype=tl.float32)
    b_ssa = tl.zeros([BT], dtype=tl.float32)
    b_ssb = tl.zeros([BT], dtype=tl.float32)
    for i_n in range(N // BN):
        o_n = i_n * BN + tl.arange(0, BN)
        b_a = tl.load(a_ptr + o_t[:, None] * s_at + o_n[None, :], mask=m_t[:, None], other=0.0)  # [BT, BN]
        b_bt = tl.load(b_ptr + o_t[None, :] * s_bt + o_n[:, None], mask=m_t[None, :], other=0.0)  # [BN, BT]
        b_acc = common.dot(b_a, b_bt, b_acc, DOT_PRECISION, EMULATE_BF16)
        if NORMS:
            b_af = b_a.to(tl.float32)
            b_bf = b_bt.to(tl.float32)
            b_ssa += tl.sum(b_af * b_af, axis=1)
            b_ssb += tl.sum(b_bf * b_bf, axis=0)
    return b_acc, b_ssa, b_ssb


@triton.jit
def _store_plus_product(b_acc, b_a, x_ptr, s_xt, out_ptr, s_ot, o_t, m_t, o_k, DOT_PRECISION: tl.constexpr,
                        EMULATE_BF16: tl.constexpr):
    """``b_acc + a @ x`` (fp32) stored into the key block ``o_k`` of ``out``'s chunk rows: ``a``
    ``[BT, BT]``, ``x`` the chunk's ``[BT, BK]`` rows."""
    b_x = tl.load(x_ptr + o_t[:, None] * s_xt + o_k[None, :], mask=m_t[:, None], other=0.0)  # [BT, BK]
    b_acc = common.dot(b_a, b_x, b_acc, DOT_PRECISION, EMULATE_BF16)  # [BT, BT] @ [BT, BK]
    tl.store(out_ptr + o_t[:, None] * s_ot + o_k[None, :], b_acc, mask=m_t[:, None])


@triton.jit
def _dqkwg_kernel(
    q_ptr, k_ptr, vn_ptr, h_ptr, dh_ptr, do_ptr, dv_ptr, g_ptr, ci_ptr,  # dv: dv_new
    dq_ptr, dk_ptr, dw_ptr, dg_ptr,  # out: dq and dk fp32 [T, HV, K], dw input dtype, dg fp32
    scale,  # fp32
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh, s_dvt, s_dvh, s_gt, s_gh,
    s_dqt, s_dqh, s_dkt, s_dkh, s_dwt, s_dwh, s_dgt, s_dgh,
    S, BK: tl.constexpr, BV: tl.constexpr,  # common.Stage; key and value channels per block
):
    pid = tl.program_id(0)
    i_c = (pid // S.HV).to(tl.int64)  # value head fastest (module docstring: grid)
    i_hv = pid % S.HV
    i_h = i_hv // S.GROUP
    start = tl.load(ci_ptr + i_c * 3 + 1)
    n_t = tl.load(ci_ptr + i_c * 3 + 2) - start  # tokens in the chunk, 1 .. BT
    bos = start.to(tl.int64)  # int64 before it multiplies a stride
    dtype = do_ptr.dtype.element_ty
    # the chunk's rows of every tensor: scalar base pointers (int64 offsets); tile offsets from them
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
    h_ptr += (i_c * S.HV + i_hv) * (S.K * S.V)
    dh_ptr += (i_c * S.HV + i_hv) * (S.K * S.V)

    # ---- (1) q k^T [BT, BT] over key blocks (k loaded transposed), with the rows' squared norms
    o_t = tl.arange(0, S.BT)
    m_t = o_t < n_t
    b_qk, b_ssq, b_ssk = _rows_times_rows_t(q_ptr, s_qt, k_ptr, s_kt, o_t, m_t, S.BT, S.K, BK, S.USE_QK_L2NORM,
                                            S.DOT_PRECISION, S.EMULATE_BF16)
    if S.USE_QK_L2NORM:
        b_rq = tl.rsqrt(b_ssq + common.L2NORM_EPS)  # [BT]
        b_rk = tl.rsqrt(b_ssk + common.L2NORM_EPS)

    # ---- (2) dA_o = scale (do v_new^T) * Gamma over value blocks (v_new loaded transposed)
    b_dA, _, _ = _rows_times_rows_t(do_ptr, s_ot, vn_ptr, s_vt, o_t, m_t, S.BT, S.V, BV, False, S.DOT_PRECISION,
                                    S.EMULATE_BF16)  # [i, j] = do_i . v_j
    b_g = tl.load(g_ptr + o_t * s_gt, mask=m_t, other=0.0)  # [BT], <= 0 in the chunk
    m_A = (o_t[:, None] >= o_t[None, :]) & (m_t[:, None] & m_t[None, :])
    b_dA = tl.where(m_A, b_dA * tl.exp(tl.where(m_A, b_g[:, None] - b_g[None, :], 0.0)), 0.0) * scale
    # k's norms folded into dA_o's columns (the dot operand below: dA_o k_hat = (dA_o r_k) k)
    if S.USE_QK_L2NORM:
        b_dA = b_dA * b_rk[None, :]
    # the intra-chunk term of dG: ds = dA_o * (q_hat k_hat^T), fp32 (q k^T of the loaded rows)
    b_ds = b_dA * b_qk
    if S.USE_QK_L2NORM:
        b_ds = b_ds * b_rq[:, None]
    b_dg = tl.sum(b_ds, axis=1) - tl.sum(b_ds, axis=0)  # [BT]
    b_dA = common.round_to(b_dA, dtype, S.EMULATE_BF16)  # one rounding

    # ---- (3) per key block: dw = -dv_new h^T, then dq = scale exp(G) (do h^T) + dA_o k, each a loop
    # over value blocks (h loaded transposed)
    b_dgq = tl.zeros([S.BT, 1], dtype=tl.float32)  # sum(q_i dq_inter_i) ([BT, 1]: see the module docstring)
    for i_k in range(S.K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        o_t, m_t, b_dw = _rows_times_state_t(dv_ptr, s_dvt, h_ptr, ci_ptr, i_c, start, n_t, o_k, None, None, S.BT, BK,
                                             S.V, BV, S.DOT_PRECISION, S.EMULATE_BF16)  # dv_new h^T
        tl.store(dw_ptr + o_t[:, None] * s_dwt + o_k[None, :],
                 common.round_to(-b_dw, dw_ptr.dtype.element_ty, S.EMULATE_BF16), mask=m_t[:, None])

        o_t, m_t, b_dq = _rows_times_state_t(do_ptr, s_ot, h_ptr, ci_ptr, i_c, start, n_t, o_k, None, None, S.BT, BK,
                                             S.V, BV, S.DOT_PRECISION, S.EMULATE_BF16)  # do h^T
        b_q = tl.load(q_ptr + o_t[:, None] * s_qt + o_k[None, :], mask=m_t[:, None], other=0.0)  # [BT, BK]
        b_gk = tl.load(g_ptr + o_t * s_gt, mask=m_t, other=0.0)
        b_dq = b_dq * (tl.exp(b_gk) * scale)[:, None]  # dq_inter; padding rows: their accumulators are 0
        b_dgq += tl.sum(b_q.to(tl.float32) * b_dq, axis=1, keep_dims=True)
        _store_plus_product(b_dq, b_dA, k_ptr, s_kt, dq_ptr, s_dqt, o_t, m_t, o_k, S.DOT_PRECISION, S.EMULATE_BF16)

    # ---- (4) dA_o^T = scale (v_new do^T) * Gamma^T as its own dot (do loaded transposed)
    z = _zero(ci_ptr, i_c, start)
    o_t = tl.arange(0, S.BT) + z
    m_t = o_t < n_t
    b_dAt, _, _ = _rows_times_rows_t(vn_ptr, s_vt, do_ptr, s_ot, o_t, m_t, S.BT, S.V, BV, False, S.DOT_PRECISION,
                                     S.EMULATE_BF16)  # [j, i] = v_j . do_i
    b_g = tl.load(g_ptr + o_t * s_gt, mask=m_t, other=0.0)
    m_At = (o_t[:, None] <= o_t[None, :]) & (m_t[:, None] & m_t[None, :])
    b_dAt = tl.where(m_At, b_dAt * tl.exp(tl.where(m_At, b_g[None, :] - b_g[:, None], 0.0)), 0.0) * scale
    if S.USE_QK_L2NORM:
        b_dAt = b_dAt * b_rq[None, :]  # q's norms folded into the columns
    b_dAt = common.round_to(b_dAt, dtype, S.EMULATE_BF16)

    # ---- (5) per key block: dk = exp(G_last - G) (v_new dh^T) + dA_o^T q over value blocks (dh loaded
    # transposed), with sum(dh * h)
    b_hdh = tl.zeros([BV], dtype=tl.float32)  # sum(dh * h) per row of an h^T tile; summed at the end
    b_kst = tl.zeros([S.BT, 1], dtype=tl.float32)  # sum(k_i dk_state_i)
    for i_k in range(S.K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        o_t, m_t, b_dk, b_hdh = _rows_times_state_t(vn_ptr, s_vt, dh_ptr, ci_ptr, i_c, start, n_t, o_k, h_ptr, b_hdh,
                                                    S.BT, BK, S.V, BV, S.DOT_PRECISION, S.EMULATE_BF16)  # v_new dh^T
        b_k = tl.load(k_ptr + o_t[:, None] * s_kt + o_k[None, :], mask=m_t[:, None], other=0.0)  # [BT, BK]
        b_gk = tl.load(g_ptr + o_t * s_gt, mask=m_t, other=0.0)
        b_gl = tl.load(g_ptr + (n_t - 1) * s_gt)
        b_dk = b_dk * tl.where(m_t, tl.exp(tl.where(m_t, b_gl - b_gk, 0.0)), 0.0)[:, None]  # dk_state
        b_kst += tl.sum(b_k.to(tl.float32) * b_dk, axis=1, keep_dims=True)
        _store_plus_product(b_dk, b_dAt, q_ptr, s_qt, dk_ptr, s_dkt, o_t, m_t, o_k, S.DOT_PRECISION, S.EMULATE_BF16)

    # q_hat . dq_inter and k_hat . dk_state: the norms times the sums of the loaded rows
    b_dgq = tl.reshape(b_dgq, [S.BT])
    b_kst = tl.reshape(b_kst, [S.BT])
    if S.USE_QK_L2NORM:
        b_dgq = b_dgq * b_rq
        b_kst = b_kst * b_rk
    b_dg += b_dgq - b_kst
    # G_last's gradient at the chunk's last token
    # (sum_i k_state_i as a [1, BT] -> [1] sum: a rank-1 sum to a scalar of a value computed from a
    # tensor-memory accumulator crashes Triton 3.6's sm_100 TMEM layout pass)
    o_t = tl.arange(0, S.BT)
    b_gl = tl.load(g_ptr + (n_t - 1) * s_gt)
    b_dg_last = tl.exp(b_gl) * tl.sum(b_hdh, axis=0) + tl.sum(tl.reshape(b_kst, [1, S.BT]), axis=1)  # [1]
    b_dg = tl.where(o_t == n_t - 1, b_dg + b_dg_last, b_dg)
    tl.store(dg_ptr + o_t * s_dgt, b_dg, mask=o_t < n_t)


def blocks(K: int, V: int) -> tuple[int, int]:
    """``(BK, BV)``: channels of a key / value block."""
    return min(K, CONFIG.block_k), min(V, CONFIG.block_v)


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
    _dqkwg_kernel[(NC * HV,)](
        q, k, v_new, h, dh, do, dv_new, g_cum, chunk_indices, dq, dk, dw, dg,
        float(scale),
        *common.token_head_strides(q, k, v_new, do, dv_new, g_cum, dq, dk, dw, dg),
        S=common.stage(H, HV, K, V, q.dtype, use_qk_l2norm), BK=BK, BV=BV,
        **CONFIG.options(cap_registers=q.dtype != torch.float32),
    )
    return dq, dk, dw, dg


# The model's specialisations (common.model_tensors: K = V = 128, H = 16, HV = 48, bf16, q and k head views
# of the packed q/k/v row, the rest contiguous; registers capped as for every 16-bit launch), with and
# without the in-kernel L2 norm.
AOT_SPECS = common.record_variants("gdn_dqkwg{l2}_bf16", launch_dqkwg, lambda x, _: (
    x.q, x.k, x.v_new, x.h, x.dh, x.do, x.dv, x.g_cum, x.chunk_indices, x.scale, x.f32_hk, x.f32_hk2, x.dw, x.dg))
