"""Gated DeltaNet backward through the WY representation, per chunk of ``BT = 64`` tokens.

The forward (:mod:`dsfuse.gdn.triton.wy`) made, per chunk and value head, with ``G`` the
chunk-local cumulative gate (``g_cum``), ``Gamma'_ij = exp(G_i - G_j)`` for ``j < i`` (0
elsewhere) and ``k`` the (normalised) keys::

    L = diag(beta) (k k^T * Gamma'),  A = (I + L)^-1     # fp32, stored
    X = diag(beta exp(G)) k,  Y = diag(beta) v,  w = A X,  u = A Y

Given ``dw`` and ``du`` (``= dv_new``, the total gradient of ``v_new = u - w h``) and ``dg_in``
(the gate gradient of the earlier stages), this stage is
:func:`dsfuse.gdn.reference_backward.wy_backward` followed by
:func:`~dsfuse.gdn.reference_backward.chunk_local_cumsum_backward`::

    dX = A^T dw,  dY = A^T du,  dA = dw X^T + du Y^T,  dL = strictly_lower(-A^T dA A^T)
    dk += beta exp(G) dX + (dL * Gamma' * beta_i) k + (dL * Gamma' * beta_i)^T k
    dv  = beta dY
    dbeta = sum(exp(G) k dX) + sum(v dY) + sum_j dL_ij (k_i . k_j) Gamma'_ij
    dG  = dg_in + sum(X dX) + rowsum(dL * L) - colsum(dL * L)
    dg_j = sum_{i >= j in the chunk} dG_i                  # reverse cumulative sum (tl.cumsum)

One program per (chunk, value head), grid ``(NC, HV)``; value head ``i_hv`` reads key head
``i_hv // (HV // H)``.

Formulation. No ``tl.trans`` at all: a transposed tile is loaded transposed (swapped strides).
Triton 3.6 on Hopper miscompiles ``tl.trans`` of a wgmma accumulator, and here ``tl.trans`` of a
loaded bf16 tile fed to a dot read shared memory out of bounds on the H200 (compute-sanitizer);
``A^T`` is loaded with swapped strides, and every matrix needed both ways is computed both ways from such tiles:

1. ``dA = dw X^T + du Y^T`` (with ``X^T``, ``Y^T`` scaled from the loaded-and-transposed
   ``k``, ``v`` tiles); in the same pass over ``v`` / ``du``, ``dY = A^T du``, ``dv`` and
   ``dbeta``'s ``sum(v dY)``.
2. ``dL = strictly_lower(-(A^T dA) A^T)``, ``Q = dL * Gamma'``.
3. ``dA^T = X dw^T + Y du^T`` (a second pass over the data, ``dw``, ``du`` transposed) and
   ``k k^T``; ``P = Q * (k_n k_n^T)`` gives ``dbeta``'s row sums and, since ``dL * L =
   diag(beta) P``, ``dG``'s ``rowsum - colsum`` (a column sum is a reduction over axis 0, not
   a transpose).
4. ``dL^T = strictly_upper(-(A dA^T) A)`` with ``A`` as stored (not the transpose of step 2).
5. ``D = (Q diag(beta)_rows + dL^T * Gamma'^T diag(beta)_cols) diag(r)``: ``d(k_n k_n^T)``'s
   strictly lower part next to its transpose's strictly upper part, so both key terms of ``dk``
   are one product ``D k``. Per key block: ``dX = A^T dw``, ``dk = dk_in + beta exp(G) dX +
   D k``, ``sum(k dX)`` for ``dbeta`` and ``dG``.
6. ``dg``: ``tl.cumsum(dG, reverse=True)`` over the chunk's rows (padding rows are 0).

L2 norm: ``r_i = rsqrt(|k_i|^2 + 1e-6)`` of the raw key (fp32) and ``k_n = diag(r) k`` enter
only as row and column scales (``X = diag(beta exp(G) r) k``, ``k_n k_n^T = diag(r) k k^T
diag(r)``, ``D diag(r)``): normalised keys are never rounded to the input dtype, and ``dk``
is the gradient w.r.t. ``k_n``.

Decays: ``exp(G)`` with ``G <= 0``, and ``Gamma'`` with the exponent masked to ``j < i`` (both
tokens in the chunk) before ``exp``, so ``exp`` never sees a positive argument. Tokens past the
chunk's end load as 0 (``A`` rows and columns, ``k``, ``v``, ``dw``, ``du``, ``beta``, ``G``),
so padding rows and columns of every product are 0; stores are masked to the chunk.

Precision. Products of two data tiles (``k k^T``) multiply input-dtype operands exactly with
fp32 accumulation. Products with an fp32 operand (``A``, ``A^T``, ``dA``, ``A^T dA``, ``D``,
``X``, ``Y``) keep near-fp32 accuracy, as the forward's ``w = A X`` (tf32x3) does: with bf16
inputs each fp32 operand is split into two bf16 parts, ``hi = bf16(x)``, ``lo = bf16(x - hi)``
(``|x - hi - lo| <= 2^-16 |x|``), and the product is ``a_lo b + a b_lo + a b`` in bf16 with
fp32 accumulation (bf16 data enters unsplit, exact; the ``a_lo b_lo`` term is dropped): at most
``3 * 2^-16`` relative per scalar product (``2^-16`` against a data tile), at two or three bf16
passes. The same kernel with ``tf32x3`` products (three tf32 passes, each about twice a bf16
pass, split operands held as fp32) spilled 576 bytes for sm_90 at 8 warps, 1340 at 4; rounding
the fp32 operands to bf16 once (one pass) gave ``dk`` a relative RMS error of 3.2e-3 in a test
case where the split gives 4.4e-6. fp32 inputs multiply in full fp32 (``input_precision="ieee"``,
no TF32, nothing split); fp16 inputs in ``tf32x3`` (fp16 data is exact in tf32), not split.
``dv`` and ``dbeta`` are rounded once (to nearest) to ``v``'s and ``beta``'s dtype; ``dk`` and
``dg`` stay fp32. On the CPU interpreter bf16 operands are widened before ``tl.dot`` and
roundings done on the bits (``state._dot``, ``state._round``), so the interpreter checks the
GPU's numerics, the split included.

In/out and aliasing: ``dk`` fp32 ``[T, HV, K]`` holds the output and state-update terms (the
dq/dk stage); this stage adds the WY terms, each element read and written by one program.
``dg`` may be the same tensor as ``dg_in``: the program loads its chunk's ``dg_in`` first and
stores ``dg`` after a CTA barrier (every thread's read done before any write). No atomics, fixed
launch constants: deterministic.

Layouts (packed tokens): ``k`` ``[T, H, K]``; ``v``, ``du``, ``dv`` ``[T, HV, V]``; ``dw``,
``dk`` ``[T, HV, K]`` (any token and head strides, unit channel stride); ``beta``, ``dbeta``
``[T, HV]`` (input dtype), ``g_cum``, ``dg_in``, ``dg`` fp32 ``[T, HV]`` (any strides); ``A``
fp32 ``[T, HV, 64]`` (unit column stride, the forward's). Tokens in no chunk (past
``cu_seqlens[-1]``, which the public API does not allow) are not written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsfuse._common.aot import AotSpec
from dsfuse.gdn.triton.common import (  # moved from state.py after this design was frozen
    CHUNK,
    L2NORM_EPS,
    dot_precision,
    emulate_bf16,
)
from dsfuse.gdn.triton.common import dot as _dot
from dsfuse.gdn.triton.common import round_to as _round

MAX_BLOCK = 64  # BK, BV: key / value channels per dot
# Launch constants (no autotuner), chosen for registers only (not timed on a GPU yet): the
# program holds several [64, 64] fp32 matrices and split (hi, lo) operands at once. At the
# model's shape (AOT_SPECS) 8 warps compile without spills for sm_100 (213-225 registers) and
# with 68-80 bytes of spill for sm_90 (255 registers); 4 warps spilled 128-264 bytes on both.
# The loops over key / value blocks are scf loops (range, not static_range): unrolled, the
# compiler merged the repeated tile loads of the two passes and kept the tiles in registers.
NUM_WARPS = 8
NUM_STAGES = 1


@triton.jit
def _split(x, SPLIT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """fp32 ``x`` as ``(hi, lo)``: with ``SPLIT`` two bf16 parts, ``hi = bf16(x)``, ``lo = bf16(x - hi)``
    (``x - hi`` is exact, so ``|x - hi - lo| <= 2^-16 |x|``); else ``(x, x)`` (``lo`` unused)."""
    if SPLIT:
        hi = _round(x, tl.bfloat16, EMULATE_BF16)
        lo = _round(x - hi.to(tl.float32), tl.bfloat16, EMULATE_BF16)
    else:
        hi = x
        lo = x
    return hi, lo


@triton.jit
def _mm(a, a_lo, b, b_lo, acc, A_SPLIT: tl.constexpr, B_SPLIT: tl.constexpr, SPLIT: tl.constexpr,
        A_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``acc + a @ b`` (``acc`` may be None) where an operand is either a tile of input data or fp32
    values as :func:`_split` returned them (``A_SPLIT`` / ``B_SPLIT``). ``SPLIT``: bf16 products
    with fp32 accumulation, ``a_lo b + a b_lo + a b`` over the split operands (the ``a_lo b_lo``
    term, ``<= 2^-16 |a| |b|`` per product, dropped); bf16 data enters unsplit (exact). Else one
    product of the operands widened to fp32 at ``A_PRECISION``."""
    if SPLIT:
        if A_SPLIT:
            acc = _dot(a_lo, b, acc, "ieee", EMULATE_BF16)
        if B_SPLIT:
            acc = _dot(a, b_lo, acc, "ieee", EMULATE_BF16)
        return _dot(a, b, acc, "ieee", EMULATE_BF16)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=A_PRECISION)


@triton.jit
def _wy_bwd_kernel(
    k_ptr,  # k [T, H, K], unit channel stride
    v_ptr,  # v [T, HV, V]
    beta_ptr,  # beta [T, HV]
    a_ptr,  # A fp32 [T, HV, BT], unit column stride
    gc_ptr,  # g_cum fp32 [T, HV]
    dw_ptr,  # dw [T, HV, K]
    du_ptr,  # du = dv_new [T, HV, V]
    dgi_ptr,  # dg_in fp32 [T, HV] (may be dg_ptr)
    ci_ptr,  # chunk_indices int32 [NC, 3] (sequence, start, end), contiguous
    dk_ptr,  # dk fp32 [T, HV, K] (in/out: dk_wy added)
    dv_ptr,  # dv [T, HV, V] (out, v's dtype)
    db_ptr,  # dbeta [T, HV] (out, beta's dtype)
    dg_ptr,  # dg fp32 [T, HV] (out)
    s_kt, s_kh,
    s_vt, s_vh,
    s_bt, s_bh,
    s_at, s_ah,
    s_gt, s_gh,
    s_dwt, s_dwh,
    s_dut, s_duh,
    s_git, s_gih,
    s_dkt, s_dkh,
    s_dvt, s_dvh,
    s_dbt, s_dbh,
    s_dgt, s_dgh,
    kv_group,  # HV // H
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # products of two input-data tiles: "ieee" for fp32 inputs
    SPLIT: tl.constexpr,  # bf16 inputs: fp32 operands as bf16 (hi, lo) pairs (_split, _mm)
    A_PRECISION: tl.constexpr,  # without SPLIT, products with fp32 operands: "ieee" (fp32) or "tf32x3" (fp16)
    EMULATE_BF16: tl.constexpr,  # CPU interpreter with bf16 data only (see state._dot, state._round)
):
    i_c = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    i_hv64 = i_hv.to(tl.int64)
    i_h = (i_hv // kv_group).to(tl.int64)
    start = tl.load(ci_ptr + i_c * 3 + 1).to(tl.int64)
    end = tl.load(ci_ptr + i_c * 3 + 2).to(tl.int64)

    o_i = tl.arange(0, BT)
    o_t = start + o_i  # int64 token offsets
    m_t = o_t < end
    m_l = (o_i[:, None] > o_i[None, :]) & m_t[:, None]  # j < i, both in the chunk
    m_u = (o_i[:, None] < o_i[None, :]) & m_t[None, :]  # i < j, both in the chunk

    # ---- per-token vectors; dg_in first (dg may alias it)
    b_dgi = tl.load(dgi_ptr + o_t * s_git + i_hv64 * s_gih, mask=m_t, other=0.0)  # [BT]
    b_beta = tl.load(beta_ptr + o_t * s_bt + i_hv64 * s_bh, mask=m_t, other=0.0).to(tl.float32)  # [BT]
    b_g = tl.load(gc_ptr + o_t * s_gt + i_hv64 * s_gh, mask=m_t, other=0.0)  # [BT], <= 0 in a chunk
    b_eg = tl.exp(b_g)
    b_be = b_beta * b_eg

    p_k = k_ptr + i_h * s_kh + o_t[:, None] * s_kt  # [BT, 1]
    p_dw = dw_ptr + i_hv64 * s_dwh + o_t[:, None] * s_dwt
    p_v = v_ptr + i_hv64 * s_vh + o_t[:, None] * s_vt
    p_du = du_ptr + i_hv64 * s_duh + o_t[:, None] * s_dut
    # the same rows as [1, BT] columns: transposed tiles are loaded transposed (swapped strides);
    # tl.trans of a loaded tile fed to a dot read shared memory out of bounds on the H200
    # (compute-sanitizer: invalid __shared__ reads of 2048 bytes, bf16 data, Triton 3.6)
    p_kt = k_ptr + i_h * s_kh + o_t[None, :] * s_kt
    p_dwt = dw_ptr + i_hv64 * s_dwh + o_t[None, :] * s_dwt
    p_vt = v_ptr + i_hv64 * s_vh + o_t[None, :] * s_vt
    p_dut = du_ptr + i_hv64 * s_duh + o_t[None, :] * s_dut
    if USE_QK_L2NORM:
        b_ss = tl.zeros([BT], dtype=tl.float32)
        for i_k in range(K // BK):
            o_k = i_k * BK + tl.arange(0, BK)
            b_kf = tl.load(p_k + o_k[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
            b_ss += tl.sum(b_kf * b_kf, 1)
        b_r = tl.rsqrt(b_ss + L2NORM_EPS)  # [BT]: k_n = diag(r) k
        b_sx = b_be * b_r
    else:
        b_sx = b_be  # X = diag(sx) k (raw keys)

    # ---- 1. dA = dw X^T + du Y^T (transposes of loaded tiles only); dY = A^T du, dv, sum(v dY)
    b_da = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_kt = tl.load(p_kt + o_k[:, None], mask=m_t[None, :], other=0.0)  # [BK, BT]
        b_dw = tl.load(p_dw + o_k[None, :], mask=m_t[:, None], other=0.0)  # [BT, BK]
        b_xt, b_xt_lo = _split(b_kt.to(tl.float32) * b_sx[None, :], SPLIT, EMULATE_BF16)  # X^T
        b_da = _mm(b_dw, b_dw, b_xt, b_xt_lo, b_da, False, True, SPLIT, A_PRECISION, EMULATE_BF16)
    p_at = a_ptr + i_hv64 * s_ah + o_t[None, :] * s_at + o_i[:, None]
    b_at, b_at_lo = _split(tl.load(p_at, mask=m_t[None, :], other=0.0), SPLIT, EMULATE_BF16)  # [BT, BT] A^T
    b_db = tl.zeros([BT], dtype=tl.float32)
    p_dv = dv_ptr + i_hv64 * s_dvh + o_t[:, None] * s_dvt
    for i_v in range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        b_v = tl.load(p_v + o_v[None, :], mask=m_t[:, None], other=0.0)  # [BT, BV]
        b_du = tl.load(p_du + o_v[None, :], mask=m_t[:, None], other=0.0)  # [BT, BV]
        b_vt = tl.load(p_vt + o_v[:, None], mask=m_t[None, :], other=0.0)  # [BV, BT]
        b_yt, b_yt_lo = _split(b_vt.to(tl.float32) * b_beta[None, :], SPLIT, EMULATE_BF16)  # Y^T
        b_da = _mm(b_du, b_du, b_yt, b_yt_lo, b_da, False, True, SPLIT, A_PRECISION, EMULATE_BF16)
        # dY = A^T du, dv = beta dY, dbeta += sum(v dY)
        b_dy = _mm(b_at, b_at_lo, b_du, b_du, None, True, False, SPLIT, A_PRECISION, EMULATE_BF16)  # [BT, BV]
        b_db += tl.sum(b_v.to(tl.float32) * b_dy, 1)
        b_dv = _round(b_dy * b_beta[:, None], dv_ptr.dtype.element_ty, EMULATE_BF16)
        tl.store(p_dv + o_v[None, :], b_dv, mask=m_t[:, None])

    # ---- 2. dL = strictly_lower(-(A^T dA) A^T), A^T loaded with swapped strides; Q = dL * Gamma'
    b_da, b_da_lo = _split(b_da, SPLIT, EMULATE_BF16)
    b_m = _mm(b_at, b_at_lo, b_da, b_da_lo, None, True, True, SPLIT, A_PRECISION, EMULATE_BF16)
    b_m, b_m_lo = _split(b_m, SPLIT, EMULATE_BF16)
    b_dl = _mm(b_m, b_m_lo, b_at, b_at_lo, None, True, True, SPLIT, A_PRECISION, EMULATE_BF16)
    b_gam = tl.where(m_l, tl.exp(tl.where(m_l, b_g[:, None] - b_g[None, :], 0.0)), 0.0)  # exponents <= 0
    b_q = tl.where(m_l, -b_dl * b_gam, 0.0)

    # ---- 3. dA^T = X dw^T + Y du^T and k k^T: a second pass over the data tiles
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    b_dat = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = tl.load(p_k + o_k[None, :], mask=m_t[:, None], other=0.0)  # [BT, BK]
        b_dwt = tl.load(p_dwt + o_k[:, None], mask=m_t[None, :], other=0.0)  # [BK, BT]
        b_kt = tl.load(p_kt + o_k[:, None], mask=m_t[None, :], other=0.0)  # [BK, BT]
        b_kk = _dot(b_k, b_kt, b_kk, DOT_PRECISION, EMULATE_BF16)
        b_x, b_x_lo = _split(b_k.to(tl.float32) * b_sx[:, None], SPLIT, EMULATE_BF16)  # X
        b_dat = _mm(b_x, b_x_lo, b_dwt, b_dwt, b_dat, True, False, SPLIT, A_PRECISION, EMULATE_BF16)
    for i_v in range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        b_v = tl.load(p_v + o_v[None, :], mask=m_t[:, None], other=0.0)  # [BT, BV]
        b_dut = tl.load(p_dut + o_v[:, None], mask=m_t[None, :], other=0.0)  # [BV, BT]
        b_y, b_y_lo = _split(b_v.to(tl.float32) * b_beta[:, None], SPLIT, EMULATE_BF16)  # Y
        b_dat = _mm(b_y, b_y_lo, b_dut, b_dut, b_dat, True, False, SPLIT, A_PRECISION, EMULATE_BF16)

    # ---- dbeta's and dG's terms: P = dL * Gamma' * (k_n k_n^T), and dL * L = diag(beta) P
    b_p = b_q * b_kk
    if USE_QK_L2NORM:
        b_p = b_p * b_r[:, None] * b_r[None, :]
    b_pr = tl.sum(b_p, 1)  # [BT]
    b_db += b_pr
    b_dg = b_beta * b_pr - tl.sum(b_p * b_beta[:, None], 0)  # rowsum(dL * L) - colsum(dL * L)

    # ---- 4. dL^T = strictly_upper(-(A dA^T) A), A loaded as stored
    p_a = a_ptr + i_hv64 * s_ah + o_t[:, None] * s_at + o_i[None, :]
    b_a, b_a_lo = _split(tl.load(p_a, mask=m_t[:, None], other=0.0), SPLIT, EMULATE_BF16)  # [BT, BT]
    b_dat, b_dat_lo = _split(b_dat, SPLIT, EMULATE_BF16)
    b_m = _mm(b_a, b_a_lo, b_dat, b_dat_lo, None, True, True, SPLIT, A_PRECISION, EMULATE_BF16)
    b_m, b_m_lo = _split(b_m, SPLIT, EMULATE_BF16)
    b_dlt = _mm(b_m, b_m_lo, b_a, b_a_lo, None, True, True, SPLIT, A_PRECISION, EMULATE_BF16)
    b_dlt = tl.where(m_u, -b_dlt, 0.0)

    # ---- 5. D = d(k_n k_n^T) diag(r): the strictly lower part from dL, the strictly upper from dL^T
    b_gamt = tl.where(m_u, tl.exp(tl.where(m_u, b_g[None, :] - b_g[:, None], 0.0)), 0.0)  # Gamma'^T
    b_d = b_q * b_beta[:, None] + b_dlt * b_gamt * b_beta[None, :]
    if USE_QK_L2NORM:
        b_d = b_d * b_r[None, :]  # D k = d(k_n k_n^T) k_n
    b_d, b_d_lo = _split(b_d, SPLIT, EMULATE_BF16)

    # ---- dk += beta exp(G) A^T dw + D k per key block; sum(k dX)
    b_at, b_at_lo = _split(tl.load(p_at, mask=m_t[None, :], other=0.0), SPLIT, EMULATE_BF16)  # A^T again
    b_sdx = tl.zeros([BT], dtype=tl.float32)  # sum(k dX) over each row
    p_dk = dk_ptr + i_hv64 * s_dkh + o_t[:, None] * s_dkt
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = tl.load(p_k + o_k[None, :], mask=m_t[:, None], other=0.0)  # [BT, BK]
        b_dw = tl.load(p_dw + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_dx = _mm(b_at, b_at_lo, b_dw, b_dw, None, True, False, SPLIT, A_PRECISION, EMULATE_BF16)
        b_sdx += tl.sum(b_k.to(tl.float32) * b_dx, 1)
        b_dk = tl.load(p_dk + o_k[None, :], mask=m_t[:, None], other=0.0) + b_be[:, None] * b_dx
        b_dk = _mm(b_d, b_d_lo, b_k, b_k, b_dk, True, False, SPLIT, A_PRECISION, EMULATE_BF16)
        tl.store(p_dk + o_k[None, :], b_dk, mask=m_t[:, None])
    if USE_QK_L2NORM:
        b_sdx = b_sdx * b_r  # sum(k_n dX)
    b_db += b_eg * b_sdx
    b_dg += b_be * b_sdx  # sum(X dX)

    tl.store(db_ptr + o_t * s_dbt + i_hv64 * s_dbh, _round(b_db, db_ptr.dtype.element_ty, EMULATE_BF16), mask=m_t)

    # ---- 6. dg: reverse cumulative sum within the chunk (rows past the chunk's end are 0)
    b_dg = tl.cumsum(tl.where(m_t, b_dgi + b_dg, 0.0), axis=0, reverse=True)
    tl.debug_barrier()  # every thread's read of dg_in done before dg (maybe the same memory) is written
    tl.store(dg_ptr + o_t * s_dgt + i_hv64 * s_dgh, b_dg, mask=m_t)


def a_precision(dtype: torch.dtype) -> str:
    """Input precision of the products with fp32 operands when they are not split (fp32 and fp16
    inputs): full fp32 for fp32 inputs, ``tf32x3`` for fp16 (fp16 data is exact in tf32)."""
    return "ieee" if dtype == torch.float32 else "tf32x3"


def launch_wy_backward(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    A: torch.Tensor,
    g_cum: torch.Tensor,
    dw: torch.Tensor,
    du: torch.Tensor,
    dg_in: torch.Tensor,
    chunk_indices: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dbeta: torch.Tensor,
    dg: torch.Tensor,
    *,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward through ``w = A X``, ``u = A Y``, ``A = (I + L)^-1``; returns ``(dk, dv, dbeta, dg)``.

    ``k`` ``[T, H, K]``; ``v``, ``du`` ``[T, HV, V]``; ``dw`` ``[T, HV, K]`` (any token and head
    strides, unit channel stride); ``beta`` ``[T, HV]``; ``A`` fp32 ``[T, HV, 64]`` (the
    forward's); ``g_cum``, ``dg_in`` fp32 ``[T, HV]``; ``chunk_indices`` int32 ``[NC, 3]``
    contiguous. ``dk`` fp32 ``[T, HV, K]`` is in/out: the WY terms are added to what it holds.
    ``dv`` ``[T, HV, V]`` (``v``'s dtype), ``dbeta`` ``[T, HV]`` (``beta``'s dtype) and ``dg``
    fp32 ``[T, HV]`` are written complete (``dg`` may be ``dg_in``). ``use_qk_l2norm``: ``k`` is
    normalised in the kernel and ``dk`` is the gradient w.r.t. the normalised keys. ``K``, ``V``
    in {16, 32, 64, 128}; arguments are validated by the public API.
    """
    num_chunks = chunk_indices.shape[0]
    heads, dim_k = k.shape[1], k.shape[2]
    value_heads, dim_v = v.shape[1], v.shape[2]
    if num_chunks == 0 or value_heads == 0:
        return dk, dv, dbeta, dg
    _wy_bwd_kernel[(num_chunks, value_heads)](
        k, v, beta, A, g_cum, dw, du, dg_in, chunk_indices, dk, dv, dbeta, dg,
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        beta.stride(0), beta.stride(1),
        A.stride(0), A.stride(1),
        g_cum.stride(0), g_cum.stride(1),
        dw.stride(0), dw.stride(1),
        du.stride(0), du.stride(1),
        dg_in.stride(0), dg_in.stride(1),
        dk.stride(0), dk.stride(1),
        dv.stride(0), dv.stride(1),
        dbeta.stride(0), dbeta.stride(1),
        dg.stride(0), dg.stride(1),
        value_heads // heads,
        K=dim_k, V=dim_v, BT=CHUNK, BK=min(dim_k, MAX_BLOCK), BV=min(dim_v, MAX_BLOCK),
        USE_QK_L2NORM=use_qk_l2norm,
        DOT_PRECISION=dot_precision(k.dtype),
        SPLIT=k.dtype == torch.bfloat16,
        A_PRECISION=a_precision(k.dtype),
        EMULATE_BF16=any(emulate_bf16(t.dtype) for t in (k, v, beta)),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return dk, dv, dbeta, dg


def _aot_specs() -> list[AotSpec]:
    """The model's launches: K = V = 128, H = 16, HV = 48 (group 3), bf16, chunk 64; k and v head
    views of the packed row ``[T, (2H + HV) * 128]`` (token stride 10240); the intermediates
    contiguous (``[T, 48]`` vectors with head stride 1); L2 norm on and off."""
    dim, heads, value_heads = 128, 16, 48
    signature = {
        "k_ptr": "*bf16", "v_ptr": "*bf16", "beta_ptr": "*bf16", "a_ptr": "*fp32", "gc_ptr": "*fp32",
        "dw_ptr": "*bf16", "du_ptr": "*bf16", "dgi_ptr": "*fp32", "ci_ptr": "*i32",
        "dk_ptr": "*fp32", "dv_ptr": "*bf16", "db_ptr": "*bf16", "dg_ptr": "*fp32",
        "s_kt": "i32", "s_kh": "i32", "s_vt": "i32", "s_vh": "i32", "s_bt": "i32", "s_at": "i32", "s_ah": "i32",
        "s_gt": "i32", "s_dwt": "i32", "s_dwh": "i32", "s_dut": "i32", "s_duh": "i32", "s_git": "i32",
        "s_dkt": "i32", "s_dkh": "i32", "s_dvt": "i32", "s_dvh": "i32", "s_dbt": "i32", "s_dgt": "i32",
        "kv_group": "i32",
    }
    assert (2 * heads + value_heads) * dim % 16 == 0
    return [
        AotSpec(
            name=f"gdn_wy_bwd_{'l2norm' if l2 else 'plain'}_bf16",
            kernel=_wy_bwd_kernel,
            signature=signature,
            # [T, HV] vectors contiguous: head stride 1 (specialised to a constant at launch)
            constexprs={"s_bh": 1, "s_gh": 1, "s_gih": 1, "s_dbh": 1, "s_dgh": 1,
                        "K": dim, "V": dim, "BT": CHUNK, "BK": min(dim, MAX_BLOCK), "BV": min(dim, MAX_BLOCK),
                        "USE_QK_L2NORM": l2, "DOT_PRECISION": dot_precision(torch.bfloat16),
                        "SPLIT": True, "A_PRECISION": a_precision(torch.bfloat16),
                        "EMULATE_BF16": False},
            options={"num_warps": NUM_WARPS, "num_stages": NUM_STAGES},
            divisible_by_16=tuple(n for n in signature if n.endswith("_ptr") or (n.startswith("s_"))),
        )
        for l2 in (True, False)
    ]


AOT_SPECS = _aot_specs()
