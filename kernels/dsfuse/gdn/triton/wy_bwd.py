"""Gated DeltaNet backward through the WY representation, per chunk of ``BT = 64`` tokens.

The forward (``dsfuse.gdn.triton.wy``) made, per chunk and value head, with ``G`` the
chunk-local cumulative gate (``g_cum``), ``Gamma'_ij = exp(G_i - G_j)`` for ``j < i`` (0
elsewhere) and ``k`` the (normalised) keys::

    L = diag(beta) (k k^T * Gamma'),  A = (I + L)^-1     # fp32, stored
    X = diag(beta exp(G)) k,  Y = diag(beta) v,  w = A X,  u = A Y

Given ``dw`` and ``du`` (``= dv_new``, the total gradient of ``v_new = u - w h``) and ``dg_in``
(the gate gradient of the earlier stages), this stage is
``dsfuse.gdn.reference_backward.wy_backward`` followed by
``dsfuse.gdn.reference_backward.chunk_local_cumsum_backward``::

    dX = A^T dw,  dY = A^T du,  dA = dw X^T + du Y^T,  dL = strictly_lower(-A^T dA A^T)
    dk += beta exp(G) dX + (dL * Gamma' * beta_i) k + (dL * Gamma' * beta_i)^T k
    dv  = beta dY
    dbeta = sum(exp(G) k dX) + sum(v dY) + sum_j dL_ij (k_i . k_j) Gamma'_ij
    dG  = dg_in + sum(X dX) + rowsum(dL * L) - colsum(dL * L)
    dg_j = sum_{i >= j in the chunk} dG_i                  # reverse cumulative sum (tl.cumsum)

One program per (chunk, value head), grid ``(NC, HV)``; value head ``i_hv`` reads key head
``i_hv // (HV // H)``.

Formulation. No ``tl.trans`` at all: Triton 3.6 on Hopper miscompiles ``tl.trans`` of a wgmma
accumulator, and ``tl.trans`` of a loaded bf16 tile fed to a dot read shared memory out of bounds
on the H200 (compute-sanitizer). A transposed tile (``k^T``, ``v^T``, ``A^T``, ``dk^T``) is read
through swapped strides. With ``Q = dL * Gamma'`` (strictly lower), ``r_i = |k_i|^-1`` (L2 norm;
1 without it) and ``k_n = diag(r) k``:

1. One pass over the key and value blocks: ``dA = ((dw k^T) diag(e^G r) + du v^T) diag(beta)``
   and ``k k^T`` (products of two data tiles); with the L2 norm ``|k|^2`` from the ``k^T`` tiles.
2. ``dL = strictly_lower(-(A^T dA) A^T)``, ``Q = -(A^T dA A^T) * Gamma'``. From
   ``Q * k_n k_n^T`` (fp32, elementwise): ``dbeta``'s ``rowsum(dL * k_n k_n^T * Gamma')`` and, as
   ``dL * L = diag(beta) (Q * k_n k_n^T)``, ``dG``'s ``rowsum(dL * L) - colsum(dL * L)``; with
   ``dg_in`` these partial sums are held in ``dg`` (dg_in is read first) until step 5.
3. Per key block, ``[tokens, channels]`` tiles: ``dk += diag(beta e^G) A^T dw + diag(beta) Q diag(r)
   k``; after a CTA barrier the same program adds ``(Q^T diag(beta) k_n)^T = k^T diag(beta r) Q`` to
   that block of ``dk``, read and written as ``[channels, tokens]`` tiles. So neither ``Q^T`` nor
   ``dA^T`` (a second chain) is ever formed. Then ``sum(k dX)`` with ``dX = A^T dw`` formed again in
   its own loop (in the ``dk`` loop it cost more registers than the 3 programs per SM allow).
4. ``dY = A^T du``, ``dv = diag(beta) dY``, ``sum(v dY)`` per value block.
5. ``dbeta = sum(e^G k_n dX) + sum(v dY) + rowsum(dL * k_n k_n^T * Gamma')``; ``dG`` completed with
   ``sum(X dX) = beta sum(e^G k_n dX)``; ``dg = tl.cumsum(dG, reverse=True)`` over the chunk.

Products per program at K = V = 128 (in ``[64, 64] x [64, 64]`` units): 18 (6 in step 1, 2 in
step 2, 6 + 2 in step 3, 2 in step 4); the design it replaced (``experiments/gdn/explored/wy_bwd_split``)
formed ``dA^T`` and a second chain for ``Q^T`` and split every fp32 operand into two bf16 parts:
42 (20 without the low parts). Tiles
read per program: ``k`` 5 times (twice transposed), ``dw`` 3, ``v``, ``du`` and ``dk`` (read and
written) twice, ``A^T`` once (16 KB each for ``k``, ``dw``, ``v``, ``du`` and fp32 ``A^T``, 32 KB
for fp32 ``dk``); the repeats should be L2 hits.

Decays: ``exp(G)`` with ``G <= 0``; ``Gamma'`` with the exponent ``G_i - G_j <= 0`` where ``j < i``
(both tokens in the chunk) and ``-inf`` elsewhere (``exp`` gives 0, never overflows). Tokens past
the chunk's end load as 0 (``k``, ``v``, ``dw``, ``du``, ``beta``, ``G``; ``A^T`` rows and columns),
so the padding rows and columns of every product are 0; every load and store is masked to the
chunk's tokens. Token offsets are int64 for the chunk's first row; within a chunk they are int32
(``t * stride`` for ``t < 64``: token strides below 2^31 / 64).

Precision. bf16 inputs: one bf16 pass per product with fp32 accumulation; the data tiles enter
exactly and the fp32 values that enter a product (``A^T``, ``dA``, ``A^T dA``,
``diag(beta) Q diag(r)``, ``diag(beta r) Q``) are rounded once to bf16 (to nearest, <= 2^-9
relative). The sums of step 2 are fp32 (``k k^T`` and ``Q`` unrounded). Observed on the CPU (the
interpreter checks the GPU's numerics, below) against fp64: ``dk`` 2.6e-3 to 2.9e-3 relative RMS
with model-like gates, ``dg`` <= 1.3e-3, ``dv`` <= 1.8e-3 and ``dbeta`` <= 2.1e-3 (rounding them
to bf16 alone gives 1.55e-3 to 1.72e-3); the replaced two-part split (three bf16 passes) gave
``dk`` about 4e-6. Through the whole backward in bf16 (CPU, K = V = 128, against the fp64
recurrence) ``dk`` 4.5e-3 to 4.6e-3, ``dg`` 4.3e-3 to 4.6e-3, ``dbeta`` 3.2e-3 to 3.5e-3 with
either version (contract: 8e-3, 2e-2). fp32 inputs multiply in full fp32
(``input_precision="ieee"``, no TF32, nothing rounded); fp16 inputs in one tf32 pass (fp16 data is
exact in tf32, the fp32 values are not rounded in the kernel). ``dv`` and ``dbeta`` are rounded
once (to nearest) to ``v``'s and ``beta``'s dtype; ``dk`` and ``dg`` stay fp32. On the CPU
interpreter bf16 operands are widened before ``tl.dot`` and roundings done on the bits
(``common.dot``, ``common.round_to``).

Registers (bf16, 4 warps, capped at ``CONFIG.maxnreg`` = 168: three programs per SM): the
``AOT_SPECS`` compile at 168 registers without spills for sm_90 and sm_100 (at a cap of 160 they
spill 16-32 bytes; uncapped the compiler takes 208-255; the replaced design: 255 with 68-80 bytes
of spill for sm_90 at 8 warps). The compiler otherwise keeps values of one phase alive into the
next: the loops are ``tl.range(..., disable_licm=True)``, the later phases build their token
offsets from ``_zero`` (an opaque 0), ``[BT]`` vectors are read as ``[2 BT]`` (``_vec``), and a
tile read again is read with another eviction hint (so the reads are not merged into one
long-lived value). Shared memory: 32 KB (sm_90), 33-40 KB (sm_100). Speed on the H200 at the
experiment's shape: 2.38 ms against the replaced design's 6.59 ms, same run
(``experiments/gdn/raw/gpu-tests/7272193-wy_bwd_{lean,split}-time.log``).

In/out and aliasing: ``dk`` fp32 ``[T, HV, K]`` holds the output and state-update terms (the
dq/dk stage); this stage adds the WY terms, each element read and written by one program (twice,
the two writes ordered by a CTA barrier). ``dg`` may be the same tensor as ``dg_in``: the program
reads its chunk's ``dg_in`` before a CTA barrier and only then writes ``dg`` (its partial sums,
read back after another barrier, then the result). No atomics, fixed launch constants:
deterministic.

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

from dsfuse.gdn.triton import common

MAX_BLOCK = 64  # BK, BV: key / value channels per dot
# Launch constants (no autotuner, every GPU family), chosen for registers; not timed on a GPU yet:
# 4 warps; for bf16 inputs the registers are capped at maxnreg = 168 (3 programs of 4 warps per SM),
# with which AOT_SPECS compile without spills on sm_90 and sm_100. fp16 and fp32 inputs are not capped.
CONFIG = common.LaunchConfig(num_warps=4, num_stages=1, maxnreg=168)


@triton.jit
def _op(x, MMA_BF16: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """fp32 values as a dot operand: rounded once to bf16 (``MMA_BF16``), else kept in fp32."""
    if MMA_BF16:
        y = common.round_to(x, tl.bfloat16, EMULATE_BF16)
    else:
        y = x
    return y


@triton.jit
def _data(x, MMA_BF16: tl.constexpr):
    """A loaded data tile as the other operand of a product with fp32 values (``_op``)."""
    if MMA_BF16:
        y = x
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _zero(ci_ptr, i_c, start):
    """0 as an int32 the compiler cannot see through: the chunk's start read again from the chunk
    table, minus its first read. Token offsets built from it in a phase are computed there, not
    kept in registers from an earlier phase that built the same offsets."""
    return (tl.load(ci_ptr + i_c * 3 + 1) - start).to(tl.int32)


@triton.jit
def _tile_pair(a_ptr, s_at, b_ptr, s_bt, ci_ptr, i_c, start, n_t, i_b, BT: tl.constexpr, BC: tl.constexpr,
               EVICTION: tl.constexpr):
    """Channel block ``i_b`` of two ``[tokens, channels]`` tensors, read with the eviction hint
    ``EVICTION``: ``(o_i, m_t, o_c, b_a, b_b)``, the chunk's token offsets (built from `_zero`) and
    mask, the block's ``BC`` channel offsets and the two ``[BT, BC]`` tiles."""
    o_i = tl.arange(0, BT) + _zero(ci_ptr, i_c, start)
    m_t = o_i < n_t
    o_c = i_b * BC + tl.arange(0, BC)
    b_a = tl.load(a_ptr + (o_i[:, None] * s_at + o_c[None, :]), mask=m_t[:, None], other=0.0,
                  eviction_policy=EVICTION)  # [BT, BC]
    b_b = tl.load(b_ptr + (o_i[:, None] * s_bt + o_c[None, :]), mask=m_t[:, None], other=0.0,
                  eviction_policy=EVICTION)
    return o_i, m_t, o_c, b_a, b_b


@triton.jit
def _vec(ptr, stride, n, BT: tl.constexpr):
    """fp32 ``[BT]`` vector ``ptr[t * stride]``, 0 for ``t >= n``. Read as ``[2 BT]`` (each token
    twice, one element per thread): the compiler keeps such a load in its own layout and converts
    the vector where it is used, where a ``[BT]`` load would be repeated in each layout that uses
    it, with a 64-bit address per element."""
    o_t = tl.arange(0, 2 * BT) // 2
    b_x = tl.load(ptr + o_t * stride, mask=o_t < n, other=0.0).to(tl.float32)
    return tl.max(tl.reshape(b_x, (BT, 2)), 1)


@triton.jit
def _wy_bwd_kernel(
    k_ptr, v_ptr, beta_ptr, a_ptr, gc_ptr, dw_ptr, du_ptr, dgi_ptr, ci_ptr,  # du: dv_new; dgi: dg_in (may be dg)
    dk_ptr,  # in and out: dk_wy added
    dv_ptr, db_ptr, dg_ptr,  # out: dv in v's dtype, dbeta in beta's dtype, dg fp32
    s_kt, s_kh, s_vt, s_vh, s_bt, s_bh, s_at, s_ah, s_gt, s_gh, s_dwt, s_dwh, s_dut, s_duh,
    s_git, s_gih, s_dkt, s_dkh, s_dvt, s_dvh, s_dbt, s_dbh, s_dgt, s_dgh,
    kv_group,  # HV // H
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # products of two input-data tiles: "ieee" for fp32 inputs
    MMA_BF16: tl.constexpr,  # bf16 inputs: fp32 values rounded once to bf16 where they enter a product
    A_PRECISION: tl.constexpr,  # else, products with fp32 values: "ieee" (fp32 inputs) or "tf32" (fp16)
    EMULATE_BF16: tl.constexpr,  # CPU interpreter with bf16 data only (see common.dot, common.round_to)
):
    i_c, i_hv, i_hv64, i_h, start, end = common.chunk_head_program(ci_ptr, kv_group)
    n_t = (end - start).to(tl.int32)  # tokens in the chunk

    # the chunk's first row (int64 token offsets); within the chunk, int32 offsets o_i * stride
    k_ptr += start * s_kt + i_h * s_kh
    dw_ptr += start * s_dwt + i_hv64 * s_dwh
    v_ptr += start * s_vt + i_hv64 * s_vh
    du_ptr += start * s_dut + i_hv64 * s_duh
    a_ptr += start * s_at + i_hv64 * s_ah
    dk_ptr += start * s_dkt + i_hv64 * s_dkh
    dv_ptr += start * s_dvt + i_hv64 * s_dvh
    beta_ptr += start * s_bt + i_hv64 * s_bh
    gc_ptr += start * s_gt + i_hv64 * s_gh
    o_i = tl.arange(0, BT)
    m_t = o_i < n_t

    # ---- 1. dA = ((dw k^T) diag(e^G r) + du v^T) diag(beta) and k k^T: products of two data tiles
    # (k^T, v^T: [channels, tokens] tiles read through swapped strides)
    b_da = tl.zeros([BT, BT], dtype=tl.float32)
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    if USE_QK_L2NORM:
        b_ss = tl.zeros([1, BT], dtype=tl.float32)  # |k_j|^2
    for i_k in tl.range(K // BK, disable_licm=True):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = tl.load(k_ptr + (o_i[:, None] * s_kt + o_k[None, :]), mask=m_t[:, None], other=0.0)  # [BT, BK]
        b_kt = tl.load(k_ptr + (o_i[None, :] * s_kt + o_k[:, None]), mask=m_t[None, :], other=0.0)  # [BK, BT]
        b_dw = tl.load(dw_ptr + (o_i[:, None] * s_dwt + o_k[None, :]), mask=m_t[:, None], other=0.0)
        b_da = common.dot(b_dw, b_kt, b_da, DOT_PRECISION, EMULATE_BF16)
        b_kk = common.dot(b_k, b_kt, b_kk, DOT_PRECISION, EMULATE_BF16)
        if USE_QK_L2NORM:
            b_kf = b_kt.to(tl.float32)
            b_ss += tl.sum(b_kf * b_kf, 0, keep_dims=True)
    b_g = _vec(gc_ptr, s_gt, n_t, BT)  # [BT], G <= 0 in a chunk
    if USE_QK_L2NORM:
        b_r = tl.rsqrt(tl.sum(b_ss, 0) + common.L2NORM_EPS)
        b_cx = tl.exp(b_g) * b_r
    else:
        b_cx = tl.exp(b_g)
    b_da = b_da * b_cx[None, :]
    for i_v in tl.range(V // BV, disable_licm=True):
        o_i = tl.arange(0, BT) + _zero(ci_ptr, i_c, start)
        m_t = o_i < n_t
        o_v = i_v * BV + tl.arange(0, BV)
        b_vt = tl.load(v_ptr + (o_i[None, :] * s_vt + o_v[:, None]), mask=m_t[None, :], other=0.0)  # [BV, BT]
        b_du = tl.load(du_ptr + (o_i[:, None] * s_dut + o_v[None, :]), mask=m_t[:, None], other=0.0)  # [BT, BV]
        b_da = common.dot(b_du, b_vt, b_da, DOT_PRECISION, EMULATE_BF16)
    b_beta = _vec(beta_ptr, s_bt, n_t, BT)  # [BT]
    b_da = _op(b_da * b_beta[None, :], MMA_BF16, EMULATE_BF16)

    # ---- 2. dL = strictly_lower(-(A^T dA) A^T) (A^T read through swapped strides), Q = dL * Gamma'
    o_j = tl.arange(0, BT) + _zero(ci_ptr, i_c, start)
    m_j = o_j < n_t
    b_at = _op(tl.load(a_ptr + (o_j[None, :] * s_at + o_j[:, None]), mask=m_j[:, None] & m_j[None, :], other=0.0),
               MMA_BF16, EMULATE_BF16)  # [BT, BT] A^T
    b_m = common.dot(b_at, b_da, None, A_PRECISION, EMULATE_BF16)  # A^T dA
    b_m = common.dot(_op(b_m, MMA_BF16, EMULATE_BF16), b_at, None, A_PRECISION, EMULATE_BF16)  # A^T dA A^T
    m_l = (o_i[:, None] > o_i[None, :]) & m_t[:, None]  # j < i, both in the chunk
    b_q = -b_m * tl.exp(tl.where(m_l, b_g[:, None] - b_g[None, :], float("-inf")))  # Q (0 where not m_l)
    # dbeta's rowsum(dL * k_n k_n^T * Gamma') and dG's colsum(dL * L) from Q * k_n k_n^T
    if USE_QK_L2NORM:
        b_kk = b_kk * b_r[:, None] * b_r[None, :]
        b_br = b_beta * b_r
    else:
        b_br = b_beta
    b_kk = b_q * b_kk
    b_s1 = tl.sum(b_kk, 1)
    # dg_in + rowsum(dL * L) - colsum(dL * L), held in dg until sum(X dX) is known (dg_in read first:
    # dg may be the same memory)
    o_i = tl.arange(0, BT) + _zero(ci_ptr, i_c, start)
    m_t = o_i < n_t
    p_dg = dg_ptr + start * s_dgt + i_hv64 * s_dgh + o_i * s_dgt
    b_dg = tl.load(dgi_ptr + start * s_git + i_hv64 * s_gih + o_i * s_git, mask=m_t, other=0.0)
    b_dg += b_beta * b_s1 - tl.sum(b_kk * b_beta[:, None], 0)
    tl.debug_barrier()  # every thread's read of dg_in done before dg (maybe the same memory) is written
    tl.store(p_dg, b_dg, mask=m_t)

    # ---- 3. dk += diag(beta e^G) A^T dw + diag(beta) Q k_n ([tokens, channels] tiles); then, after
    # a barrier, dk^T += k_n^T diag(beta) Q (= (Q^T diag(beta) k_n)^T, [channels, tokens] tiles read
    # and written through swapped strides): Q^T is never formed
    b_qb = _op(b_q * b_br[:, None], MMA_BF16, EMULATE_BF16)  # diag(beta r) Q
    if USE_QK_L2NORM:
        b_q = _op(b_q * b_beta[:, None] * b_r[None, :], MMA_BF16, EMULATE_BF16)  # diag(beta) Q diag(r)
    else:
        b_q = _op(b_q * b_beta[:, None], MMA_BF16, EMULATE_BF16)
    b_eg = tl.exp(_vec(gc_ptr, s_gt, n_t, BT))
    b_be = _vec(beta_ptr, s_bt, n_t, BT) * b_eg
    for i_k in tl.range(K // BK, disable_licm=True):
        o_i, m_t, o_k, b_k, b_dw = _tile_pair(k_ptr, s_kt, dw_ptr, s_dwt, ci_ptr, i_c, start, n_t, i_k, BT, BK,
                                              "evict_first")  # [BT, BK] each
        b_dk = common.dot(b_at, _data(b_dw, MMA_BF16), None, A_PRECISION, EMULATE_BF16) * b_be[:, None]
        b_dk = common.dot(b_q, _data(b_k, MMA_BF16), b_dk, A_PRECISION, EMULATE_BF16)
        p_dk = dk_ptr + (o_i[:, None] * s_dkt + o_k[None, :])
        tl.store(p_dk, b_dk + tl.load(p_dk, mask=m_t[:, None], other=0.0), mask=m_t[:, None])
        tl.debug_barrier()  # the block of dk written above, visible to every thread of the program
        b_kt = tl.load(k_ptr + (o_i[None, :] * s_kt + o_k[:, None]), mask=m_t[None, :], other=0.0,
                       eviction_policy="evict_first")  # [BK, BT]
        b_dk = common.dot(_data(b_kt, MMA_BF16), b_qb, None, A_PRECISION, EMULATE_BF16)  # [BK, BT]
        p_dkt = dk_ptr + (o_i[None, :] * s_dkt + o_k[:, None])
        tl.store(p_dkt, b_dk + tl.load(p_dkt, mask=m_t[None, :], other=0.0), mask=m_t[None, :])
    # sum(k dX), dX = A^T dw formed again (in the loop above it cost more registers than allowed)
    b_sx = tl.zeros([BT], dtype=tl.float32)
    for i_k in tl.range(K // BK, disable_licm=True):
        o_i, m_t, o_k, b_k, b_dw = _tile_pair(k_ptr, s_kt, dw_ptr, s_dwt, ci_ptr, i_c, start, n_t, i_k, BT, BK,
                                              "evict_last")  # [BT, BK] each
        b_sx += tl.sum(b_k.to(tl.float32) * common.dot(b_at, _data(b_dw, MMA_BF16), None, A_PRECISION, EMULATE_BF16), 1)
    if USE_QK_L2NORM:
        b_sx = b_sx * b_r  # sum(k_n dX)

    # ---- 4. dv = diag(beta) dY, dY = A^T du; sum(v dY)
    b_beta = _vec(beta_ptr, s_bt, n_t, BT)
    b_db = b_s1 + b_eg * b_sx  # dbeta's rowsum(dL * k_n k_n^T * Gamma') + sum(e^G k_n dX)
    for i_v in tl.range(V // BV, disable_licm=True):
        o_i, m_t, o_v, b_du, b_v = _tile_pair(du_ptr, s_dut, v_ptr, s_vt, ci_ptr, i_c, start, n_t, i_v, BT, BV,
                                              "evict_first")  # [BT, BV] each
        b_dv = common.dot(b_at, _data(b_du, MMA_BF16), None, A_PRECISION, EMULATE_BF16)  # dY
        b_db += tl.sum(b_v.to(tl.float32) * b_dv, 1)
        tl.store(dv_ptr + (o_i[:, None] * s_dvt + o_v[None, :]),
                 common.round_to(b_dv * b_beta[:, None], dv_ptr.dtype.element_ty, EMULATE_BF16), mask=m_t[:, None])

    # ---- 5. dbeta; dG = dg_in + sum(X dX) + rowsum(dL * L) - colsum(dL * L); dg its reverse
    # cumulative sum within the chunk
    o_i = tl.arange(0, BT) + _zero(ci_ptr, i_c, start)
    m_t = o_i < n_t
    tl.store(db_ptr + start * s_dbt + i_hv64 * s_dbh + o_i * s_dbt,
             common.round_to(b_db, db_ptr.dtype.element_ty, EMULATE_BF16), mask=m_t)
    tl.debug_barrier()  # dg's partial sums (stored by other threads) visible
    b_dg = tl.load(p_dg, mask=m_t, other=0.0) + b_beta * b_eg * b_sx
    b_dg = tl.cumsum(tl.where(m_t, b_dg, 0.0), axis=0, reverse=True)
    tl.debug_barrier()  # every thread's read of dg's partial sums done before dg is written
    tl.store(p_dg, b_dg, mask=m_t)


def a_precision(dtype: torch.dtype) -> str:
    """Input precision of the products with fp32 values for fp32 and fp16 inputs (bf16 inputs round
    the values to bf16 instead): full fp32 for fp32 inputs, one tf32 pass for fp16 (fp16 data is
    exact in tf32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


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
        *common.token_head_strides(k, v, beta, A, g_cum, dw, du, dg_in, dk, dv, dbeta, dg),
        value_heads // heads,
        K=dim_k, V=dim_v, BT=common.CHUNK, BK=min(dim_k, MAX_BLOCK), BV=min(dim_v, MAX_BLOCK),
        USE_QK_L2NORM=use_qk_l2norm,
        DOT_PRECISION=common.dot_precision(k.dtype),
        MMA_BF16=k.dtype == torch.bfloat16,
        A_PRECISION=a_precision(k.dtype),
        EMULATE_BF16=any(common.emulate_bf16(t.dtype) for t in (k, v, beta)),
        **CONFIG.options(cap_registers=k.dtype == torch.bfloat16),
    )
    return dk, dv, dbeta, dg


# The model's launches (common.model_tensors: K = V = 128, H = 16, HV = 48, bf16, k and v head views of the
# packed q/k/v row, the intermediates contiguous), L2 norm on and off.
AOT_SPECS = common.record_variants("gdn_wy_bwd_{l2}_bf16", launch_wy_backward, lambda x, _: (
    x.k, x.v, x.beta, x.A, x.g_cum, x.dw, x.do, x.dg_in, x.chunk_indices, x.f32_hk, x.dv, x.dbeta, x.dg),
    l2_tags=("l2norm", "plain"))
