"""UT transform and WY representation of Gated DeltaNet, per chunk of ``BT = 64`` tokens.

For a chunk with keys ``k`` ``[BT, K]`` (optionally L2-normalised here), ``beta`` and the
chunk-local cumulative gate ``G`` (``g_cum``)::

    L = strictly_lower(diag(beta) k k^T * Gamma),  Gamma_ij = exp(G_i - G_j)
    A = (I + L)^-1                                   # fp32 [BT, BT], unit lower triangular
    w = A (beta * exp(G) * k),  u = A (beta * v)     # input dtype, computed in fp32

Two kernels, one program per (chunk, value head) each (grid ``(NC, HV)``; value head
``i_hv`` reads qk head ``i_hv // (HV // H)``):

* ``_ut_kernel``: ``k k^T`` as one ``[BT, K] x [K, BT]`` ``tl.dot`` on keys upcast to fp32
  (16-bit keys: one tf32 pass, exact products; fp32 keys: ``tf32x3``), the L2 norm applied
  to the product (``r_i r_j (k_i . k_j)``), ``beta`` and the decay applied with the exponent
  masked to ``j < i`` before ``exp`` (``exp`` never sees a positive difference, padding rows
  and columns are zero before any product). ``L`` is written to ``A``'s rows (upper part and
  columns past the chunk's end as 0), then, after a CTA barrier, read back as 16x16 blocks:
  the four diagonal blocks, batched ``[4, 16, 16]``, are inverted by forward substitution (a
  loop over rows ``i = 1..15``: row ``i`` of ``Y = X - I`` is ``r_i + r_i Y`` with ``r_i = -L_i``
  read back from ``A``'s rows, one fp32 broadcast-multiply-and-sum per row, no dot) and merged
  with ``tl.dot`` in fp32 (``input_precision="ieee"``)::

      X_ij = -X_ii sum_{m=j}^{i-1} L_im X_mj     (block forward substitution, i > j)

  The lower blocks of ``A`` are overwritten after a second barrier (the upper blocks keep the
  zeros written with ``L``), so every element of a chunk's valid rows is written.
* ``_wy_kernel``: reloads ``A`` and computes ``w``, ``u`` as ``[BT, BT] x [BT, 64]`` dots
  (``wy_precision``: one tf32 pass for 16-bit data, ``tf32x3`` for fp32), rounded once
  (round to nearest even) to the output dtype.

No dot result is ever transposed (Triton 3.6 on Hopper miscompiles ``tl.trans`` of a wgmma
accumulator); ``tl.trans`` is applied only to the loaded key tile. Token offsets are int64
before they multiply a stride; there are no atomics and the launch constants are fixed, so a
launch is deterministic. Rows of tokens in no chunk (past ``cu_seqlens[-1]``) are not written.

Speed (H200, T = 32768 in five documents, (H, HV) = (16, 48), K = V = 128, bf16): the stage
times of the current kernels are in the experiment's per-stage table (``experiments/gdn/``).
``A`` in fp32 is 0.4 GB written and read back; one program per value head reloads the keys for
every head of a group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsfuse.gdn.triton import common

SUB = 16  # BC: diagonal block of the triangular solve
MAX_BLOCK = 64  # BK, BV: channels of w / u per dot
# Launch constants (every GPU family), from one H200 probe at the model's shape (T = 32768 in five
# documents, (H, HV) = (16, 48), K = V = 128, bf16, L2 norm; no sweep file yet): _ut_kernel 1.33 ms
# with 2 warps, 1.63 ms with 4, 2.09 ms with 8; _wy_kernel 1.48 ms with 4 warps, 2.57 ms with 8,
# 5.13 ms with 2.
UT_CONFIG = common.LaunchConfig(num_warps=2)
WY_CONFIG = common.LaunchConfig(num_warps=4)


# ----------------------------------------------------------------------------- UT transform


@triton.jit
def _ut_kernel(
    k_ptr, beta_ptr, gc_ptr, ci_ptr,
    a_ptr,  # out
    s_kt, s_kh, s_bt, s_bh, s_gt, s_gh, s_at, s_ah,
    kv_group,  # HV // H
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    KK_PRECISION: tl.constexpr,  # input precision of k k^T ("tf32x3" for fp32 keys)
):
    tl.static_assert(BT == 4 * BC)
    _, i_hv, _, i_h, start, end = common.chunk_head_program(ci_ptr, kv_group)
    n_rows = (end - start).to(tl.int32)

    # ---- L = strictly_lower(diag(beta) k k^T * Gamma), written to A's rows
    o_i = tl.arange(0, BT)
    o_t = start + o_i  # int64 token offsets
    m_t = o_t < end
    o_k = tl.arange(0, K)
    p_k = k_ptr + i_h * s_kh + o_t[:, None] * s_kt + o_k[None, :]
    b_k = tl.load(p_k, mask=m_t[:, None], other=0.0).to(tl.float32)  # [BT, K]
    # [BT, K] x [K, BT] -> [BT, BT]; the transpose is of the loaded tile, never of a dot result
    b_kk = tl.dot(b_k, tl.trans(b_k), input_precision=KK_PRECISION)
    if USE_QK_L2NORM:
        b_r = tl.rsqrt(tl.sum(b_k * b_k, 1) + 1e-6)  # [BT]; eps as the reference's l2norm
        b_kk = b_kk * b_r[:, None] * b_r[None, :]
    b_beta = common.load_tokens(beta_ptr, s_bt, s_bh, o_t, m_t, i_hv).to(tl.float32)  # [BT]
    b_g = common.load_tokens(gc_ptr, s_gt, s_gh, o_t, m_t, i_hv)  # [BT]
    m_l = (o_i[:, None] > o_i[None, :]) & m_t[:, None]  # strictly lower, valid rows (so valid columns)
    b_gamma = tl.exp(tl.where(m_l, b_g[:, None] - b_g[None, :], 0.0))  # [BT, BT], exponents <= 0
    b_l = tl.where(m_l, b_kk * b_gamma * b_beta[:, None], 0.0)  # [BT, BT]
    p_a = a_ptr + start * s_at + i_hv.to(tl.int64) * s_ah  # row 0 of the chunk's matrix
    tl.store(p_a + o_i[:, None].to(tl.int64) * s_at + o_i[None, :], b_l, mask=m_t[:, None])
    tl.debug_barrier()  # L visible to every thread of the program

    # ---- inverses of the four diagonal [BC, BC] blocks, batched [4, BC, BC]: forward substitution
    # row by row. Row i of Y = X - I is r_i + r_i Y with r_i = -L_i (zero at j >= i, so only the
    # rows j < i, already final, contribute): a [4, BC] x [4, BC, BC] broadcast-and-sum in fp32
    # (exact fp32 products, no dot), the row of -L read back from A's rows written above.
    o_c = tl.arange(0, BC)
    o_b = tl.arange(0, 4)
    b_eye = (o_c[:, None] == o_c[None, :]).to(tl.float32)[None, :, :]  # [1, BC, BC]
    b_y = tl.zeros([4, BC, BC], dtype=tl.float32)  # rows < i final
    for i in range(1, BC):
        o_row = o_b * BC + i  # [4] the row i of each diagonal block, in chunk rows
        p_row = p_a + o_row[:, None].to(tl.int64) * s_at + (o_b[:, None] * BC + o_c[None, :])
        b_row = -tl.load(p_row, mask=(o_row < n_rows)[:, None], other=0.0)  # [4, BC] -L_i (0 at j >= i)
        b_row = b_row + tl.sum(b_row[:, :, None] * b_y, 1)  # [4, BC]
        b_y = tl.where((o_c == i)[None, :, None], b_row[:, None, :], b_y)
    b_x = tl.reshape(tl.permute(b_y + b_eye, (1, 2, 0)), (BC, BC, 2, 2))  # [BC, BC, b // 2, b % 2]
    b_x_even, b_x_odd = tl.split(b_x)
    b_x11, b_x33 = tl.split(b_x_even)  # [BC, BC] each
    b_x22, b_x44 = tl.split(b_x_odd)

    # ---- merge: X_ij = -X_ii sum_{m=j}^{i-1} L_im X_mj (block forward substitution, fp32)
    o_r = o_c[:, None].to(tl.int64) * s_at + o_c[None, :]  # [BC, BC] offsets in a block
    m_1 = (BC + o_c < n_rows)[:, None]
    m_2 = (2 * BC + o_c < n_rows)[:, None]
    m_3 = (3 * BC + o_c < n_rows)[:, None]
    p_1, p_2, p_3 = p_a + BC * s_at, p_a + 2 * BC * s_at, p_a + 3 * BC * s_at  # row blocks 1, 2, 3
    b_l21 = tl.load(p_1 + o_r, mask=m_1, other=0.0)  # [BC, BC]
    b_l31 = tl.load(p_2 + o_r, mask=m_2, other=0.0)
    b_l32 = tl.load(p_2 + BC + o_r, mask=m_2, other=0.0)
    b_l41 = tl.load(p_3 + o_r, mask=m_3, other=0.0)
    b_l42 = tl.load(p_3 + BC + o_r, mask=m_3, other=0.0)
    b_l43 = tl.load(p_3 + 2 * BC + o_r, mask=m_3, other=0.0)
    b_x21 = -tl.dot(b_x22, tl.dot(b_l21, b_x11, input_precision="ieee"), input_precision="ieee")
    b_x32 = -tl.dot(b_x33, tl.dot(b_l32, b_x22, input_precision="ieee"), input_precision="ieee")
    b_x43 = -tl.dot(b_x44, tl.dot(b_l43, b_x33, input_precision="ieee"), input_precision="ieee")
    b_s31 = tl.dot(b_l32, b_x21, tl.dot(b_l31, b_x11, input_precision="ieee"), input_precision="ieee")
    b_x31 = -tl.dot(b_x33, b_s31, input_precision="ieee")
    b_s42 = tl.dot(b_l43, b_x32, tl.dot(b_l42, b_x22, input_precision="ieee"), input_precision="ieee")
    b_x42 = -tl.dot(b_x44, b_s42, input_precision="ieee")
    b_s41 = tl.dot(b_l41, b_x11, input_precision="ieee")
    b_s41 = tl.dot(b_l42, b_x21, b_s41, input_precision="ieee")
    b_s41 = tl.dot(b_l43, b_x31, b_s41, input_precision="ieee")
    b_x41 = -tl.dot(b_x44, b_s41, input_precision="ieee")

    # ---- A's lower blocks over L (the upper blocks keep L's zeros)
    tl.debug_barrier()  # every read of L done before A overwrites it
    m_0 = (o_c < n_rows)[:, None]
    tl.store(p_a + o_r, b_x11, mask=m_0)
    tl.store(p_1 + o_r, b_x21, mask=m_1)
    tl.store(p_1 + BC + o_r, b_x22, mask=m_1)
    tl.store(p_2 + o_r, b_x31, mask=m_2)
    tl.store(p_2 + BC + o_r, b_x32, mask=m_2)
    tl.store(p_2 + 2 * BC + o_r, b_x33, mask=m_2)
    tl.store(p_3 + o_r, b_x41, mask=m_3)
    tl.store(p_3 + BC + o_r, b_x42, mask=m_3)
    tl.store(p_3 + 2 * BC + o_r, b_x43, mask=m_3)
    tl.store(p_3 + 3 * BC + o_r, b_x44, mask=m_3)


# ----------------------------------------------------------------------------- WY representation


@triton.jit
def _store_a_times_rows(b_a, p_x, p_y, b_s, m_t, N: tl.constexpr, BN: tl.constexpr, dtype: tl.constexpr,
                        WY_PRECISION: tl.constexpr):
    """``y = A (diag(s) x)`` block by block of ``BN`` of the ``N`` channels, rounded once to ``dtype``:
    ``b_a`` fp32 ``[BT, BT]``, ``p_x`` / ``p_y`` the chunk's rows of ``x`` / ``y`` ``[BT, 1]`` (unit
    channel stride), ``b_s`` fp32 ``[BT]``."""
    for i_n in tl.static_range(N // BN):
        o_n = i_n * BN + tl.arange(0, BN)
        b_x = tl.load(p_x + o_n[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)  # [BT, BN]
        b_y = tl.dot(b_a, b_x * b_s[:, None], input_precision=WY_PRECISION)  # [BT, BT] x [BT, BN]
        tl.store(p_y + o_n[None, :], b_y.to(dtype), mask=m_t[:, None])


@triton.jit
def _wy_kernel(
    k_ptr, v_ptr, beta_ptr, gc_ptr, ci_ptr, a_ptr,
    w_ptr, u_ptr,  # out
    s_kt, s_kh, s_vt, s_vh, s_bt, s_bh, s_gt, s_gh, s_at, s_ah, s_wt, s_wh, s_ut, s_uh,
    kv_group,  # HV // H
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    WY_PRECISION: tl.constexpr,  # input precision of the A products (see wy_precision)
):
    _, i_hv, i_hv64, i_h, start, end = common.chunk_head_program(ci_ptr, kv_group)

    o_i = tl.arange(0, BT)
    o_t = start + o_i  # int64 token offsets
    m_t = o_t < end

    b_a = common.load_rows(a_ptr, s_at, s_ah, o_t, m_t, i_hv64, o_i)  # [BT, BT]
    b_beta = common.load_tokens(beta_ptr, s_bt, s_bh, o_t, m_t, i_hv64).to(tl.float32)  # [BT]
    b_g = common.load_tokens(gc_ptr, s_gt, s_gh, o_t, m_t, i_hv64)  # [BT], <= 0 in a chunk
    b_sk = b_beta * tl.exp(b_g)  # [BT] row scale of k

    p_k = k_ptr + i_h * s_kh + o_t[:, None] * s_kt
    if USE_QK_L2NORM:
        b_ss = tl.zeros([BT], dtype=tl.float32)
        for i_k in tl.static_range(K // BK):
            o_k = i_k * BK + tl.arange(0, BK)
            b_k = tl.load(p_k + o_k[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)  # [BT, BK]
            b_ss += tl.sum(b_k * b_k, 1)
        b_sk = b_sk * tl.rsqrt(b_ss + 1e-6)

    p_w = w_ptr + o_t[:, None] * s_wt + i_hv64 * s_wh
    _store_a_times_rows(b_a, p_k, p_w, b_sk, m_t, K, BK, w_ptr.dtype.element_ty, WY_PRECISION)  # w = A X

    p_v = v_ptr + i_hv64 * s_vh + o_t[:, None] * s_vt
    p_u = u_ptr + o_t[:, None] * s_ut + i_hv64 * s_uh
    _store_a_times_rows(b_a, p_v, p_u, b_beta, m_t, V, BV, u_ptr.dtype.element_ty, WY_PRECISION)  # u = A Y


# ----------------------------------------------------------------------------- launcher


def kk_precision(dtype: torch.dtype) -> str:
    """Input precision of the ``k k^T`` dot (keys upcast to fp32): bf16 and fp16 keys are exact
    in tf32 (8 and 11 significant bits of tf32's 11), so one tf32 pass multiplies them exactly;
    fp32 keys need ``tf32x3`` (about 2^-22 per product)."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def wy_precision(dtype: torch.dtype) -> str:
    """Input precision of ``w = A x``, ``u = A y`` (``A`` fp32): one tf32 pass for bf16/fp16 data
    (``x``, ``y`` are 16-bit values scaled in fp32; tf32 rounds ``A`` and the scaled rows to 11
    significant bits, 2^-11 relative, below the 2^-9 / 2^-11 of the bf16 / fp16 rounding of ``w``
    and ``u`` that follows); ``tf32x3`` (about 2^-22) for fp32 data."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def launch_wy(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g_cum: torch.Tensor,
    chunk_indices: torch.Tensor,
    A: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    *,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """UT transform into ``A`` fp32 ``[T, HV, 64]``, then WY representation into ``w`` ``[T, HV, K]``, ``u`` ``[T, HV, V]``.

    ``k`` ``[T, H, K]``, ``v`` ``[T, HV, V]`` (any token and head strides, unit channel
    stride), ``beta`` ``[T, HV]``, ``g_cum`` fp32 ``[T, HV]`` (chunk-local cumulative gate),
    ``chunk_indices`` int32 ``[NC, 3]`` contiguous; ``K``, ``V`` in {16, 32, 64, 128};
    ``HV`` a multiple of ``H``. ``use_qk_l2norm`` normalises ``k`` on load (``k * rsqrt(sum
    k^2 + 1e-6)``). Every valid row of a chunk is written in full (upper part 0). Returns
    ``(A, w, u)``.
    """
    if any(t.stride(-1) != 1 for t in (k, v, A, w, u)):
        raise ValueError("k, v, A, w, u: the channel (last) dim must have unit stride")
    launch_ut(k, beta, g_cum, chunk_indices, A, v.shape[1], use_qk_l2norm=use_qk_l2norm)
    return (A, *launch_w_u(k, v, beta, g_cum, chunk_indices, A, w, u, use_qk_l2norm=use_qk_l2norm))


def launch_ut(k: torch.Tensor, beta: torch.Tensor, g_cum: torch.Tensor, chunk_indices: torch.Tensor,
              A: torch.Tensor, value_heads: int, *, use_qk_l2norm: bool = False) -> torch.Tensor:
    """The UT transform alone into ``A`` fp32 ``[T, HV, 64]`` (arguments as ``launch_wy``)."""
    num_chunks = chunk_indices.shape[0]
    if num_chunks == 0 or value_heads == 0:
        return A
    _ut_kernel[(num_chunks, value_heads)](
        k, beta, g_cum, chunk_indices, A,
        *common.token_head_strides(k, beta, g_cum, A),
        value_heads // k.shape[1],
        K=k.shape[2], BT=common.CHUNK, BC=SUB, USE_QK_L2NORM=use_qk_l2norm, KK_PRECISION=kk_precision(k.dtype),
        **UT_CONFIG.options(),
    )
    return A


def launch_w_u(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g_cum: torch.Tensor,
               chunk_indices: torch.Tensor, A: torch.Tensor, w: torch.Tensor, u: torch.Tensor, *,
               use_qk_l2norm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``w``, ``u`` from a given ``A`` (the backward's recomputation; arguments as ``launch_wy``)."""
    num_chunks, value_heads = chunk_indices.shape[0], v.shape[1]
    if num_chunks == 0 or value_heads == 0:
        return w, u
    dim_k, dim_v = k.shape[2], v.shape[2]
    _wy_kernel[(num_chunks, value_heads)](
        k, v, beta, g_cum, chunk_indices, A, w, u,
        *common.token_head_strides(k, v, beta, g_cum, A, w, u),
        value_heads // k.shape[1],
        K=dim_k, V=dim_v, BT=common.CHUNK, BK=min(dim_k, MAX_BLOCK), BV=min(dim_v, MAX_BLOCK),
        USE_QK_L2NORM=use_qk_l2norm, WY_PRECISION=wy_precision(k.dtype),
        **WY_CONFIG.options(),
    )
    return w, u


# ----------------------------------------------------------------------------- AOT


# The model's launches (common.model_tensors: K = V = 128, H = 16, HV = 48, bf16, k and v head views of the
# packed q/k/v row, the intermediates contiguous), L2 norm on and off: the UT transform (launch_ut) and the
# WY representation (launch_w_u).
AOT_SPECS = [
    *common.record_variants("gdn_ut_{l2}_bf16", launch_ut, lambda x, _: (
        x.k, x.beta, x.g_cum, x.chunk_indices, x.A, x.v.shape[1]), l2_tags=("l2norm", "plain")),
    *common.record_variants("gdn_wy_{l2}_bf16", launch_w_u, lambda x, _: (
        x.k, x.v, x.beta, x.g_cum, x.chunk_indices, x.A, x.w, x.u), l2_tags=("l2norm", "plain")),
]
