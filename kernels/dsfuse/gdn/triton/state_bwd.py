"""Gated DeltaNet backward through the state: ``dv_local`` per chunk, then the reverse state pass.

Two kernels (``dsfuse.gdn.reference_backward.chunk_dv_local`` and
``dsfuse.gdn.reference_backward.chunk_state_backward`` are the math; chunks of
``C = BT = 64`` tokens from the chunk table, a document's last chunk possibly short):

* ``_dv_local_kernel``, one program per (chunk, value head, block of ``BV`` value channels)::

      dv_local = scale * (q k^T * Gamma)^T @ do,   Gamma_ij = exp(G_i - G_j), j <= i

  The transposed attention is computed as it is used: ``A^T = (k @ q^T) * Gamma^T``
  (``[BT, K] @ [K, BT]``, ``q`` loaded transposed from memory, rows ``j`` = keys, columns
  ``i`` = queries, kept where ``j <= i``), so no dot result is transposed. Rounded once to
  the input dtype, it multiplies ``do`` ``[BT, BV]``; ``scale`` multiplies the fp32 result.

* ``_state_backward_kernel``, one program per (document, value head, block of ``BV`` value
  channels): ``b_dh`` ``[K, BV]`` (fp32 registers, as one block of ``K`` rows or, for
  ``K = 128``, two of 64: ``b_dh1``, ``b_dh2``) starts from ``dht`` (or 0) and visits the
  document's chunks last to first::

      dh[c]     = b_dh                                        # stored in the input dtype
      dv_new[c] = dv_local[c] + exp(G_last - G) * (k @ b_dh)  # [BT, K] @ [K, BV], rows scaled
      b_dh      = exp(G_last) * b_dh + q^T @ (scale * exp(G) * do) - w^T @ dv_new[c]

  and at the document's end ``dh0 = b_dh`` (fp32, optional; ``dht`` or 0 bit for bit for an
  empty document). ``dv_new`` reads ``b_dh`` before the chunk's update. ``q`` and ``w`` are
  loaded transposed (``[K, BT]`` tiles, swapped strides), so the update is two
  ``[K, BT] @ [BT, BV]`` dots accumulated onto the decayed ``b_dh``; no dot result is ever
  transposed (Triton 3.6 on Hopper miscompiles ``tl.trans`` of a wgmma accumulator). Only
  ``G_last - G_i``, ``G_i`` (tokens in the chunk; masked to 0 before ``exp`` elsewhere) and
  ``G_last`` are exponentiated, all ``<= 0``.

Precision: bf16/fp16 inputs multiply bf16/fp16 operands with fp32 accumulation; fp32 inputs
multiply in full fp32 (``input_precision="ieee"``, not TF32). Every row or column factor
(decay, ``scale``, the L2 norm's ``r = rsqrt(sum x^2 + 1e-6)``) is applied in fp32, to the
dot's result where it scales a row or column of it, else to the operand that is rounded
anyway, so each 16-bit dot operand is an input as read or one rounding of an fp32 value:

* ``dv_local``: ``k`` and ``q`` as read; ``r_k r_q``, the mask and ``Gamma^T`` scale the fp32
  ``k @ q^T``, which is rounded once; ``do`` as read.
* ``dv_new``: ``k`` as read and ``b_dh`` rounded to the input dtype, the very value stored in
  ``dh``; ``exp(G_last - G) r_k`` scales the rows of the fp32 product. ``dv_local`` (input
  dtype) is added in fp32 and the sum rounded once to ``dv_new``'s dtype.
* ``b_dh`` update: ``q`` and ``w`` as read; ``scale exp(G) r_q`` varies along the summed tokens,
  so it scales the rows of ``do`` (fp32, then one rounding: the pass's only rounding of an input
  by a factor; scaling ``q`` instead would round a [K, BT] tile rather than a [BT, BV] one, at
  the same error); ``-dv_new`` exactly as stored (rounding to nearest commutes with negation),
  so ``b_dh`` carries the ``dv_new`` the later stages read. ``b_dh`` itself stays fp32 across
  chunks; only the dot operand and ``dh`` are rounded.

``USE_QK_L2NORM`` normalises ``q`` and ``k`` (``x * rsqrt(sum x^2 + 1e-6)``, the norm taken
in fp32 from the values as read) through the factors ``r`` above; the results are those of the
normalised ``q`` and ``k`` (the L2-norm backward comes later).

Layouts (packed tokens, batch flattened, documents by ``cu_seqlens``): ``q``, ``k``
``[T, H, K]``, ``w`` ``[T, HV, K]``, ``do``, ``dv_local``, ``dv_new`` ``[T, HV, V]`` with any
token and head strides and unit channel stride; ``g_cum`` fp32 ``[T, HV]`` (any strides); ``dh``
``[NC, HV, K, V]`` contiguous (the gradient of the state AFTER each chunk), input dtype;
``dht`` and ``dh0`` fp32 ``[N, HV, K, V]`` contiguous. Value head ``i_hv`` reads qk head
``i_hv // (HV // H)``. Tokens in no chunk (past ``cu_seqlens[-1]``; the public API requires
none) are not written.

No atomics: every element is written by one program, in a fixed order; fixed launch
constants, so two launches give the same bits. Grids, one axis each, value block fastest,
then value head: ``NC * HV * (V // BV)`` programs (then chunk) for ``dv_local``,
``N * HV * (V // BV)`` (then document) for the state pass (``P * ..`` for ``rows`` of ``P``
sequences: the split's passes over some of its segments, each writing ``dh`` and ``dv_new`` or not
by a masked store, `dsfuse.gdn.split.pass_rows`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dsfuse.gdn.triton import common

# Launch constants (no autotuner).
# dv_local (every GPU family): all value channels of the model (min(128, V)) per program, 4 warps: the
# output stage's shape of work (a [BT, K] x [K, BT] product, masked, then [BT, BT] x [BT, BV]); not measured.
DV_CONFIG = common.LaunchConfig(block_v=128, num_warps=4, num_stages=2)
# State pass: (block_v value channels, warps) per GPU family, and the state gradient's K rows in blocks
# of at most 64 (MAX_BLOCK_K: two fp32 accumulators for K = 128), which keeps every compiled variant below
# 255 registers without spills (AOT_SPECS, the model's K = V = 128): Hopper and the CPU
# interpreter 64 channels / 4 warps (the forward state pass's setting; 214-233 registers);
# Blackwell (compute capability >= 10) 2 warps, the precaution of the forward state pass for a
# tl.dot recurrence race there before Triton 3.8 (this loop has the same shape: a dot of the
# carried dH feeds the dots that update it), at 16 channels (196-208 registers; 32 channels
# spill 40-96 bytes). Not measured on a GPU. loop_stages: software-pipelining depth of the chunk
# loop on the GPU (as the forward state pass).
CONFIGS = {
    common.HOPPER: common.LaunchConfig(block_v=64, num_warps=4, num_stages=2, loop_stages=2),
    common.BLACKWELL: common.LaunchConfig(block_v=16, num_warps=2, num_stages=2, loop_stages=2),
}
MAX_BLOCK_K = 64


# ----------------------------------------------------------------------------- dv_local


@triton.jit
def _dv_local_kernel(
    q_ptr, k_ptr, do_ptr, g_ptr, ci_ptr,
    dv_ptr,  # out: dv_local, do's dtype
    scale,  # fp32
    s_qt, s_qh, s_kt, s_kh, s_dot, s_doh, s_gt, s_gh, s_dvt, s_dvh,
    S, BV: tl.constexpr,  # common.Stage; value channels per program
):
    i_c, i_hv, i_h, o_k, o_v, o_i = common.value_block_program(S.HV, S.GROUP, S.V, BV, S.K, S.BT)  # i_c in [0, NC)
    dtype = q_ptr.dtype.element_ty

    _, _, o_t, m_t = common.chunk_tokens(ci_ptr, i_c, o_i)  # o_t: [BT] int64 token offsets

    b_k = common.load_rows(k_ptr, s_kt, s_kh, o_t, m_t, i_h, o_k)  # [BT, K]
    b_q = common.load_cols(q_ptr, s_qt, s_qh, o_t, m_t, i_h, o_k)  # [K, BT]: q transposed from memory

    # A^T[j, i] = (k_j . q_i) exp(G_i - G_j) for j <= i, both tokens in the chunk
    b_at = common.dot(b_k, b_q, None, S.DOT_PRECISION, S.EMULATE_BF16)  # [BT, K] @ [K, BT] -> [BT, BT]
    if S.USE_QK_L2NORM:  # the norms scale the product's rows (k) and columns (q)
        b_kf = b_k.to(tl.float32)
        b_qf = b_q.to(tl.float32)
        b_rk = tl.rsqrt(tl.sum(b_kf * b_kf, axis=1) + common.L2NORM_EPS)  # [BT]
        b_rq = tl.rsqrt(tl.sum(b_qf * b_qf, axis=0) + common.L2NORM_EPS)  # [BT]
        b_at = b_at * b_rk[:, None] * b_rq[None, :]
    b_g = common.load_tokens(g_ptr, s_gt, s_gh, o_t, m_t, i_hv)  # [BT]
    b_at = common.causal_decay(b_at, b_g, o_i, m_t, True)  # [BT, BT] rows j, columns i

    b_do = common.load_rows(do_ptr, s_dot, s_doh, o_t, m_t, i_hv, o_v)  # [BT, BV]
    b_dv = common.dot(common.round_to(b_at, dtype, S.EMULATE_BF16), b_do, None, S.DOT_PRECISION, S.EMULATE_BF16)  # [BT, BV]
    b_dv = b_dv * scale
    common.store_rows(dv_ptr, s_dvt, s_dvh, o_t, m_t, i_hv, o_v, b_dv, S.EMULATE_BF16)


def launch_dv_local(
    q: torch.Tensor,
    k: torch.Tensor,
    do: torch.Tensor,
    g_cum: torch.Tensor,
    chunk_indices: torch.Tensor,
    scale: float,
    dv_local: torch.Tensor,
    *,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """Write ``scale * (q k^T * Gamma)^T do`` per chunk into ``dv_local`` and return it.

    ``q``, ``k`` ``[T, H, K]``; ``do``, ``dv_local`` ``[T, HV, V]`` (``dv_local`` in ``do``'s
    dtype; unit channel stride); ``g_cum`` fp32 ``[T, HV]``; ``chunk_indices`` int32 ``[NC, 3]``;
    ``use_qk_l2norm`` normalises q and k in the kernel. Arguments are validated by the public API.
    """
    H, K = q.shape[1], q.shape[2]
    HV, V = do.shape[1], do.shape[2]
    BV = min(DV_CONFIG.block_v, V)
    programs = common.value_block_programs(chunk_indices.shape[0], HV, V, BV, "chunk_indices")
    if programs == 0:
        return dv_local
    _dv_local_kernel[(programs,)](
        q, k, do, g_cum, chunk_indices, dv_local,
        float(scale),
        *common.token_head_strides(q, k, do, g_cum, dv_local),
        S=common.stage(H, HV, K, V, q.dtype, use_qk_l2norm), BV=BV,
        **DV_CONFIG.options(),
    )
    return dv_local


# ----------------------------------------------------------------------------- reverse state pass


@triton.jit
def _state_backward_step(b_dh1, b_dh2, i_c, q_ptr, k_ptr, w_ptr, do_ptr, dvl_ptr, g_ptr, ci_ptr, dh_ptr, dvn_ptr,
                         write, scale, s_qt, s_qh, s_kt, s_kh, s_wt, s_wh, s_dot, s_doh, s_lt, s_lh, s_gt, s_gh, s_vt, s_vh,
                         i_hv, i_h, o_k, o_v, o_i, o_kv, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BK: tl.constexpr, USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         EMULATE_BF16: tl.constexpr):
    """One chunk of the reverse pass: store ``dh[c]`` and ``dv_new`` (where ``write``: True, or a
    segment row's flag), return the state gradient at the chunk's start (``b_dh2`` is carried unused
    when ``K == BK``)."""
    dtype = q_ptr.dtype.element_ty
    i_c64, eos, o_t, m_t = common.chunk_tokens(ci_ptr, i_c, o_i)  # o_t: [BT] int64 token offsets

    # dh[c] = dH (input dtype) and k @ dH [BT, K] @ [K, BV], one K block at a time
    p_dh = dh_ptr + (i_c64 * HV + i_hv) * (K * V) + o_kv
    p_k = common.rows(k_ptr, s_kt, s_kh, o_t, i_h, o_k)
    b_dhc = common.round_to(b_dh1, dtype, EMULATE_BF16)
    tl.store(p_dh, b_dhc, mask=write)
    b_k = tl.load(p_k, mask=m_t[:, None], other=0.0)  # [BT, BK]
    b_kh = common.dot(b_k, b_dhc, None, DOT_PRECISION, EMULATE_BF16)  # [BT, BV]
    if USE_QK_L2NORM:
        b_kf = b_k.to(tl.float32)
        b_ss = tl.sum(b_kf * b_kf, axis=1)  # [BT]
    if K > BK:
        b_dhc = common.round_to(b_dh2, dtype, EMULATE_BF16)
        tl.store(p_dh + BK * V, b_dhc, mask=write)
        b_k = tl.load(p_k + BK, mask=m_t[:, None], other=0.0)
        b_kh = common.dot(b_k, b_dhc, b_kh, DOT_PRECISION, EMULATE_BF16)
        if USE_QK_L2NORM:
            b_kf = b_k.to(tl.float32)
            b_ss += tl.sum(b_kf * b_kf, axis=1)

    # dv_new = dv_local + exp(G_last - G) (k @ dH): the decay (and k's norm) on the product's rows
    b_g, b_g_last, b_rk = common.chunk_decays(g_ptr, s_gt, s_gh, o_t, m_t, i_hv, eos)  # b_rk: exp(G_last - G)
    if USE_QK_L2NORM:
        b_rk = b_rk * tl.rsqrt(b_ss + common.L2NORM_EPS)
    b_dv = common.load_rows(dvl_ptr, s_lt, s_lh, o_t, m_t, i_hv, o_v).to(tl.float32) + b_kh * b_rk[:, None]  # [BT, BV]
    common.store_rows(dvn_ptr, s_vt, s_vh, o_t, m_t & write, i_hv, o_v, b_dv, EMULATE_BF16)

    # dH = exp(G_last) dH + q^T (scale exp(G) do) - w^T dv_new; q, w transposed from memory
    p_q = common.cols(q_ptr, s_qt, s_qh, o_t, i_h, o_k)
    b_q1 = tl.load(p_q, mask=m_t[None, :], other=0.0)  # [BK, BT]
    if K > BK:
        b_q2 = tl.load(p_q + BK, mask=m_t[None, :], other=0.0)
    b_rq = tl.where(m_t, tl.exp(b_g), 0.0) * scale  # [BT] scale exp(G), exponents <= 0
    if USE_QK_L2NORM:
        b_qf = b_q1.to(tl.float32)
        b_ss = tl.sum(b_qf * b_qf, axis=0)
        if K > BK:
            b_qf = b_q2.to(tl.float32)
            b_ss += tl.sum(b_qf * b_qf, axis=0)
        b_rq = b_rq * tl.rsqrt(b_ss + common.L2NORM_EPS)
    b_do = common.load_rows(do_ptr, s_dot, s_doh, o_t, m_t, i_hv, o_v).to(tl.float32)  # [BT, BV]
    b_do = common.round_to(b_do * b_rq[:, None], dtype, EMULATE_BF16)  # rounded once
    b_dvn = common.round_to(-b_dv, dtype, EMULATE_BF16)  # -dv_new as stored (rounding commutes with negation)
    p_w = common.cols(w_ptr, s_wt, s_wh, o_t, i_hv, o_k)
    b_decay = tl.exp(b_g_last)
    b_dh1 = common.dot(b_q1, b_do, b_dh1 * b_decay, DOT_PRECISION, EMULATE_BF16)  # [BK, BT] @ [BT, BV]
    b_w = tl.load(p_w, mask=m_t[None, :], other=0.0)  # [BK, BT]
    b_dh1 = common.dot(b_w, b_dvn, b_dh1, DOT_PRECISION, EMULATE_BF16)
    if K > BK:
        b_dh2 = common.dot(b_q2, b_do, b_dh2 * b_decay, DOT_PRECISION, EMULATE_BF16)
        b_w = tl.load(p_w + BK, mask=m_t[None, :], other=0.0)
        b_dh2 = common.dot(b_w, b_dvn, b_dh2, DOT_PRECISION, EMULATE_BF16)
    return b_dh1, b_dh2


@triton.jit(do_not_specialize=["N"])
def _state_backward_kernel(
    q_ptr, k_ptr, w_ptr, do_ptr, dvl_ptr, g_ptr, ci_ptr, co_ptr, sg_ptr, dht_ptr,  # dvl: dv_local (s_l); sg: rows or None
    dh_ptr, dvn_ptr, dh0_ptr,  # out: dh, dv_new (s_v); dh0 may be None (not written)
    scale,  # fp32
    N,  # sequences
    s_qt, s_qh, s_kt, s_kh, s_wt, s_wh, s_dot, s_doh, s_lt, s_lh, s_gt, s_gh, s_vt, s_vh,
    S,  # common.Stage
    BK: tl.constexpr,  # rows of K per block: K, or K / 2 (two blocks, b_dh1 and b_dh2)
    BV: tl.constexpr,  # value channels per program
    PIPELINED: tl.constexpr, NUM_STAGES_LOOP: tl.constexpr,  # common.sequential_pass's loop
):
    tl.static_assert(S.K == BK or S.K == 2 * BK)
    # i_x: the program's row, the sequence i_n in [0, N); o_k: rows of the first K block, the second's are BK + o_k
    i_x, i_hv, i_h, o_k, o_v, o_i = common.value_block_program(S.HV, S.GROUP, S.V, BV, BK, S.BT)
    if sg_ptr is not None:  # rows of (sequence, writes dh and dv_new)
        i_n = tl.load(sg_ptr + 2 * i_x)
        write = tl.load(sg_ptr + 2 * i_x + 1) != 0
    else:
        i_n = i_x
        write = True
    o_kv = o_k[:, None] * S.V + o_v[None, :]  # [BK, BV] offsets in a [K, V] state

    # b_dh = [b_dh1; b_dh2]: the state gradient's K rows in (up to) two fp32 blocks; dht as
    # loaded (not added to zeros, which would turn -0.0 into +0.0)
    p_state = (i_n.to(tl.int64) * S.HV + i_hv) * (S.K * S.V) + o_kv  # [BK, BV]
    if dht_ptr is not None:
        b_dh1 = tl.load(dht_ptr + p_state).to(tl.float32)
        if S.K > BK:
            b_dh2 = tl.load(dht_ptr + p_state + BK * S.V).to(tl.float32)
    else:
        b_dh1 = tl.zeros([BK, BV], dtype=tl.float32)
        if S.K > BK:
            b_dh2 = tl.zeros([BK, BV], dtype=tl.float32)
    if S.K == BK:
        b_dh2 = tl.zeros([BK, BV], dtype=tl.float32)  # a placeholder the step carries unused

    i_c0 = tl.load(co_ptr + i_n)  # the document's chunks [i_c0, i_c1), visited last to first
    i_c = tl.load(co_ptr + i_n + 1) - 1
    if PIPELINED:  # a for loop the compiler software-pipelines (loads of the previous chunk early)
        for j in tl.range(0, i_c + 1 - i_c0, num_stages=NUM_STAGES_LOOP):
            b_dh1, b_dh2 = _state_backward_step(b_dh1, b_dh2, i_c - j, q_ptr, k_ptr, w_ptr, do_ptr, dvl_ptr, g_ptr, ci_ptr, dh_ptr,
                                                  dvn_ptr, write, scale, s_qt, s_qh, s_kt, s_kh, s_wt, s_wh, s_dot, s_doh,
                                                  s_lt, s_lh, s_gt, s_gh, s_vt, s_vh, i_hv, i_h, o_k, o_v, o_i, o_kv,
                                                  S.HV, S.K, S.V, BK, S.USE_QK_L2NORM, S.DOT_PRECISION, S.EMULATE_BF16)
    else:  # the interpreter cannot take runtime bounds in a for loop
        while i_c >= i_c0:
            b_dh1, b_dh2 = _state_backward_step(b_dh1, b_dh2, i_c, q_ptr, k_ptr, w_ptr, do_ptr, dvl_ptr, g_ptr, ci_ptr, dh_ptr,
                                                  dvn_ptr, write, scale, s_qt, s_qh, s_kt, s_kh, s_wt, s_wh, s_dot, s_doh,
                                                  s_lt, s_lh, s_gt, s_gh, s_vt, s_vh, i_hv, i_h, o_k, o_v, o_i, o_kv,
                                                  S.HV, S.K, S.V, BK, S.USE_QK_L2NORM, S.DOT_PRECISION, S.EMULATE_BF16)
            i_c -= 1

    if dh0_ptr is not None:
        tl.store(dh0_ptr + p_state, b_dh1)
        if S.K > BK:
            tl.store(dh0_ptr + p_state + BK * S.V, b_dh2)


def launch_config(device: torch.device, V: int) -> tuple[int, int]:
    """``(BV, num_warps)`` of a state-backward launch on ``device`` with ``V`` value channels."""
    config = common.family_config(CONFIGS, device)
    return min(config.block_v, V), config.num_warps


def block_k(K: int) -> int:
    """Rows of the state gradient per block: ``K`` up to 64, two blocks of ``K / 2`` above."""
    return K if K <= MAX_BLOCK_K else K // 2


def launch_state_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    do: torch.Tensor,
    dv_local: torch.Tensor,
    g_cum: torch.Tensor,
    chunk_indices: torch.Tensor,
    chunk_offsets: torch.Tensor,
    dht: torch.Tensor | None,
    dh: torch.Tensor,
    dv_new: torch.Tensor,
    dh0: torch.Tensor | None,
    scale: float,
    *,
    use_qk_l2norm: bool = False,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run the reverse state pass into ``dh``, ``dv_new`` and (if given) ``dh0``; returns them.

    ``q``, ``k`` ``[T, H, K]``; ``w`` ``[T, HV, K]``; ``do``, ``dv_local``, ``dv_new``
    ``[T, HV, V]`` (unit channel stride; ``dv_new`` in the input dtype); ``g_cum`` fp32
    ``[T, HV]``; ``chunk_indices`` int32 ``[NC, 3]``; ``chunk_offsets`` int32 ``[N + 1]``;
    ``dht`` fp32 ``[N, HV, K, V]`` or None (zeros); ``dh`` ``[NC, HV, K, V]`` (input dtype,
    the gradient of the state after each chunk); ``dh0`` fp32 ``[N, HV, K, V]`` or None.
    States and ``dh`` contiguous. ``use_qk_l2norm`` normalises q and k in the kernel.
    Arguments are validated by the public API. ``rows``: int32 ``[P, 2]`` contiguous, or None (every
    sequence, each writing ``dh`` and ``dv_new``): the sequences to run, each with whether it writes
    ``dh`` and ``dv_new`` (0 or 1); the states of the others are neither read nor written (the
    split's passes over some of its segments).
    """
    H, K = q.shape[1], q.shape[2]
    HV, V = do.shape[1], do.shape[2]
    N, BV, loop = common.sequential_pass(CONFIGS, q.device, chunk_offsets, V)
    programs = common.value_block_programs(N if rows is None else rows.shape[0], HV, V, BV, "chunk_offsets")
    if programs == 0:
        return dh, dv_new, dh0
    _state_backward_kernel[(programs,)](
        q, k, w, do, dv_local, g_cum, chunk_indices, chunk_offsets, rows, dht, dh, dv_new, dh0,
        float(scale), N,
        *common.token_head_strides(q, k, w, do, dv_local, g_cum, dv_new),
        S=common.stage(H, HV, K, V, q.dtype, use_qk_l2norm), BK=block_k(K), BV=BV, **loop,
    )
    return dh, dv_new, dh0


# ----------------------------------------------------------------------------- AOT

# The model's specialisations (common.model_tensors: K = V = 128, H = 16, HV = 48, bf16, q and k head views
# of the packed q/k/v row): dv_local with and without the in-kernel L2 norm; the state pass also with and
# without dht/dh0, in each family's launch setting (Blackwell's named _2w), and the long-document split's
# passes over some of its segments ("_rows", `dsfuse.gdn.split.pass_rows`: with dht, with dh0 or not).
_SEGMENT_ROWS = common.model_tensors().segment_rows
AOT_SPECS = common.record_variants(
    "gdn_dv_local{l2}_bf16", launch_dv_local,
    lambda x, _: (x.q, x.k, x.do, x.g_cum, x.chunk_indices, x.scale, x.dv_local),
) + common.record_variants(
    "gdn_state_bwd{l2}{states}_bf16{family}", launch_state_backward, lambda x, state: (
        x.q, x.k, x.w, x.do, x.dv_local, x.g_cum, x.chunk_indices, x.chunk_offsets, state, x.dh, x.dv, state, x.scale),
    states=True, per_family=True) + common.record_variants(
    "gdn_state_bwd_rows{l2}{states}_bf16{family}", functools.partial(launch_state_backward, rows=_SEGMENT_ROWS),
    lambda x, state: (x.q, x.k, x.w, x.do, x.dv_local, x.g_cum, x.chunk_indices, x.chunk_offsets, x.state, x.dh, x.dv,
                      state, x.scale), states=True, per_family=True)
