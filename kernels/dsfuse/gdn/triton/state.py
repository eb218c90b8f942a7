"""Gated DeltaNet forward state pass: the sequential scan over each document's chunks.

Per (document, value head, block of ``BV`` value channels) one program carries the state
``b_h`` ``[K, BV]`` in fp32 registers across the document's chunks (``BK = K``: the whole
key dim in one block) and, chunk by chunk (``C = BT = 64`` tokens, the last one possibly
short; ``dsfuse.gdn.reference.chunk_state_pass`` is the math)::

    h[c]    = b_h                                          # stored in the input dtype
    v_new   = u - w @ b_h                                  # [BT, K] @ [K, BV]
    b_h     = exp(G_last) * b_h + (k * exp(G_last - G))^T @ v_new

and at the document's end ``final_state = b_h`` (fp32, optional). Only ``G_last - G_i <= 0``
(masked to 0 for tokens past the chunk's end before ``exp``) and ``G_last <= 0`` are
exponentiated. The decay ``exp(G_last - G)`` is applied to the rows of ``v_new`` (fp32, one
rounding to the dot dtype) rather than to ``k``: the same product with ``BT * BV`` instead
of ``K * BT`` multiplies and ``k`` enters the dot unrounded. ``k`` is loaded transposed
(``[K, BT]``, swapped strides) so no dot result is ever transposed (Triton 3.6 on Hopper
miscompiles ``tl.trans`` of a wgmma accumulator).

Precision: bf16/fp16 inputs multiply bf16/fp16 operands (``b_h`` rounded to the input dtype,
as it is stored in ``h``) with fp32 accumulation; fp32 inputs multiply in full fp32
(``input_precision="ieee"``, not TF32). ``USE_QK_L2NORM`` normalises each ``k`` row in fp32
(``x * rsqrt(sum x^2 + 1e-6)``) before rounding it to the dot dtype, as the output stage
and the WY stage do.

Layouts (packed tokens, batch flattened, documents by ``cu_seqlens``): ``k`` ``[T, H, K]``,
``w`` ``[T, HV, K]``, ``u`` and ``v_new`` ``[T, HV, V]`` with any token and head strides and
unit channel stride; ``g_cum`` fp32 ``[T, HV]`` (any strides); ``h`` ``[NC, HV, K, V]``,
``initial_state`` and ``final_state`` fp32 ``[N, HV, K, V]`` contiguous. Value head ``i_hv``
reads key head ``i_hv // (HV // H)``. ``h`` is the largest intermediate of the forward:
``NC * HV * K * V`` elements, 0.8 GB in bf16 at T = 32768 (512 chunks), HV = 48, K = V = 128.

``h`` and ``v_new`` may be None: not written, the same states computed (the long-document split's
passes that want only each segment's final state or map, `dsfuse.gdn.split`). ``u`` may be None:
``u = 0`` (the split's map pass, a ``[K, K]`` state; no zero tensor read). ``rows`` (int32
``[P, 2]``) runs only the sequences it lists, each with whether it writes ``h`` and ``v_new`` (a
masked store): the split's passes over some of its segments (`dsfuse.gdn.split.pass_rows`).

Tokens in no chunk (past ``cu_seqlens[-1]``) get ``v_new = 0``: one extra program row
(``i_n == N``, the last row) writes them, so every element of ``v_new`` is written without a host sync.
No atomics: every element is written by one program, in a fixed order. Grid: one axis of
``(N + 1) * HV * (V // BV)`` programs (``(P + 1) * ..`` with ``rows``), value block fastest, then
value head, then document.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dsfuse.gdn.triton import common

# Launch constants (no autotuner) per GPU family: BV value channels per program (block_v), warps.
# Hopper and the CPU interpreter: 64 channels, 4 warps (wgmma). H200, Triton 3.6, the model's
# shape (T = 32768 in five documents, (H, HV) = (16, 48), K = V = 128, bf16, L2 norm), median of
# triton.testing.do_bench: 1.29 ms, against 1.34 ms for (32, 4), 1.58 (32, 2), 1.95 (64, 2),
# 1.82 (64, 8); every setting gave bitwise the same h and v_new. Blackwell (compute capability
# >= 10): 32 channels, 2 warps, flash-linear-attention's pin for its fwd_h there (a tl.dot
# recurrence race on Blackwell before Triton 3.8); not measured here. AOT_SPECS compile both
# for sm_90 and sm_100: Hopper's setting at 238-250 registers without spills, the 2-warp one at
# 251-255 registers with up to 16 bytes of spill in the initial/final-state variants.
# num_stages 2: the kernel's default pipelining depth. loop_stages 2: the chunk loop on the GPU is a
# for loop with runtime bounds, software-pipelined this deep (the next chunk's loads issued before
# this chunk's dots finish); the interpreter runs a while loop instead.
CONFIGS = {
    common.HOPPER: common.LaunchConfig(block_v=64, num_warps=4, num_stages=2, loop_stages=2),
    common.BLACKWELL: common.LaunchConfig(block_v=32, num_warps=2, num_stages=2, loop_stages=2),
}


@triton.jit
def _state_step(b_h, i_c, k_ptr, w_ptr, u_ptr, g_ptr, ci_ptr, h_ptr, vn_ptr, write, s_kt, s_kh, s_wt, s_wh, s_ut,
                s_uh, s_gt, s_gh, s_vt, s_vh, i_hv, i_h, o_k, o_v, o_i, HV: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                EMULATE_BF16: tl.constexpr):
    """One chunk of the state pass: store ``h`` and ``v_new`` (where given and ``write``: True, or a
    segment row's flag), return the next state (fp32). ``u_ptr`` None: ``u = 0`` (a state map's pass)."""
    dtype = w_ptr.dtype.element_ty
    i_c64, eos, o_t, m_t = common.chunk_tokens(ci_ptr, i_c, o_i)  # o_t: [BT] int64 token offsets

    # the state at the chunk's start
    b_hc = common.round_to(b_h, dtype, EMULATE_BF16)
    if h_ptr is not None:
        tl.store(common.state_tile(h_ptr, i_c64, i_hv, HV, K, V, o_k, o_v), b_hc, mask=write)

    # v_new = u - w @ h
    b_w = common.load_rows(w_ptr, s_wt, s_wh, o_t, m_t, i_hv, o_k)  # [BT, K]
    b_wh = common.dot(b_w, b_hc, None, DOT_PRECISION, EMULATE_BF16)  # [BT, K] @ [K, BV] -> [BT, BV]
    if u_ptr is not None:
        b_v = common.load_rows(u_ptr, s_ut, s_uh, o_t, m_t, i_hv, o_v).to(tl.float32) - b_wh  # [BT, BV]
    else:  # u = 0: the same bits as a zero u loaded (0 - x, not -x: the sign of a zero)
        b_v = 0.0 - b_wh
    if vn_ptr is not None:
        common.store_rows(vn_ptr, s_vt, s_vh, o_t, m_t & write, i_hv, o_v, b_v, EMULATE_BF16)

    # decays: G_last - G_i <= 0 for tokens in the chunk, masked to 0 before exp
    _, b_g_last, b_d = common.chunk_decays(g_ptr, s_gt, s_gh, o_t, m_t, i_hv, eos)
    b_vd = common.round_to(b_v * b_d[:, None], dtype, EMULATE_BF16)  # [BT, BV]

    b_k = common.load_cols(k_ptr, s_kt, s_kh, o_t, m_t, i_h, o_k)  # [K, BT]: k transposed from memory
    if USE_QK_L2NORM:
        b_k = common.l2_normalize(b_k, 0, dtype, EMULATE_BF16)

    # h = exp(G_last) h + (k * exp(G_last - G))^T v_new
    b_h = b_h * tl.exp(b_g_last)
    b_h = common.dot(b_k, b_vd, b_h, DOT_PRECISION, EMULATE_BF16)  # [K, BT] @ [BT, BV] -> [K, BV]
    return b_h


@triton.jit(do_not_specialize=["T", "N"])
def _state_pass_kernel(
    k_ptr, w_ptr, u_ptr, g_ptr, ci_ptr, co_ptr, sg_ptr, h0_ptr,  # u may be None (u = 0); sg: segment rows or None
    h_ptr, vn_ptr, ht_ptr,  # out; each may be None (not written: a state map's pass wants ht alone)
    T, N,  # tokens, sequences
    s_kt, s_kh, s_wt, s_wh, s_ut, s_uh, s_gt, s_gh, s_vt, s_vh,
    S, BV: tl.constexpr,  # common.Stage; value channels per program
    PIPELINED: tl.constexpr, NUM_STAGES_LOOP: tl.constexpr,  # common.sequential_pass's loop
):
    # i_x: the program's row, the sequence i_n in [0, N] (N: the tail of tokens in no chunk)
    i_x, i_hv, i_h, o_k, o_v, o_i = common.value_block_program(S.HV, S.GROUP, S.V, BV, S.K, S.BT)
    if sg_ptr is not None:  # rows of (sequence, writes h and v_new), then the tail row
        rows = tl.num_programs(0) // (S.HV * (S.V // BV)) - 1
        i_n = tl.load(sg_ptr + 2 * i_x, mask=i_x < rows, other=N)
        write = tl.load(sg_ptr + 2 * i_x + 1, mask=i_x < rows, other=1) != 0
    else:
        i_n = i_x
        write = True

    if i_n < N:
        b_h = tl.zeros([S.K, BV], dtype=tl.float32)
        o_state = (i_n.to(tl.int64) * S.HV + i_hv) * (S.K * S.V) + o_k[:, None] * S.V + o_v[None, :]  # [K, BV]
        if h0_ptr is not None:
            b_h += tl.load(h0_ptr + o_state)  # [K, BV]

        i_c = tl.load(co_ptr + i_n)  # the document's chunks [i_c, i_c1)
        i_c1 = tl.load(co_ptr + i_n + 1)
        if PIPELINED:  # a for loop the compiler software-pipelines (loads of the next chunk early)
            for i_c in tl.range(i_c, i_c1, num_stages=NUM_STAGES_LOOP):
                b_h = _state_step(b_h, i_c, k_ptr, w_ptr, u_ptr, g_ptr, ci_ptr, h_ptr, vn_ptr, write, s_kt, s_kh, s_wt, s_wh,
                                  s_ut, s_uh, s_gt, s_gh, s_vt, s_vh, i_hv, i_h, o_k, o_v, o_i, S.HV, S.K, S.V,
                                  S.USE_QK_L2NORM, S.DOT_PRECISION, S.EMULATE_BF16)
        else:  # the interpreter cannot take runtime bounds in a for loop
            while i_c < i_c1:
                b_h = _state_step(b_h, i_c, k_ptr, w_ptr, u_ptr, g_ptr, ci_ptr, h_ptr, vn_ptr, write, s_kt, s_kh, s_wt, s_wh,
                                  s_ut, s_uh, s_gt, s_gh, s_vt, s_vh, i_hv, i_h, o_k, o_v, o_i, S.HV, S.K, S.V,
                                  S.USE_QK_L2NORM, S.DOT_PRECISION, S.EMULATE_BF16)
                i_c += 1

        if ht_ptr is not None:
            tl.store(ht_ptr + o_state, b_h)
    elif vn_ptr is not None:
        # tokens past the last chunk's end (past cu_seqlens[-1]) belong to no chunk: v_new = 0
        common.store_zero_tail(vn_ptr, ci_ptr, tl.load(co_ptr + N), T, s_vt, s_vh, i_hv, o_v, o_i, S.BT, BV)


def launch_state_pass(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor | None,
    g_cum: torch.Tensor,
    chunk_indices: torch.Tensor,
    chunk_offsets: torch.Tensor,
    initial_state: torch.Tensor | None,
    h: torch.Tensor | None,
    v_new: torch.Tensor | None,
    final_state: torch.Tensor | None,
    *,
    use_qk_l2norm: bool = False,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Run the state pass into ``h``, ``v_new`` and ``final_state``, each where given (None: not written,
    the same states computed); returns them.

    ``k`` ``[T, H, K]``; ``w`` ``[T, HV, K]``; ``u``, ``v_new`` ``[T, HV, V]`` (unit channel
    stride); ``g_cum`` fp32 ``[T, HV]``; ``chunk_indices`` int32 ``[NC, 3]``;
    ``chunk_offsets`` int32 ``[N + 1]``; ``initial_state`` fp32 ``[N, HV, K, V]`` or None
    (zeros); ``h`` ``[NC, HV, K, V]`` (input dtype); ``final_state`` fp32 ``[N, HV, K, V]``
    or None. States and ``h`` contiguous. ``use_qk_l2norm`` normalises ``k`` in the kernel
    (the same flag as the WY and output stages). Arguments are validated by the public API.

    ``u`` None: ``u = 0`` and ``V = K`` (a state map's pass, `dsfuse.gdn.split`: no zero tensor
    read). ``rows``: int32 ``[P, 2]`` contiguous, or None (every sequence, each writing ``h`` and
    ``v_new`` where given): the sequences to run, each with whether it writes ``h`` and ``v_new``
    (0 or 1); the states of the others are neither read nor written (the split's passes over some
    of its segments).
    """
    T, H, K = k.shape
    HV, V = w.shape[1], K if u is None else u.shape[2]
    N, BV, loop = common.sequential_pass(CONFIGS, w.device, chunk_offsets, V)
    programs = common.value_block_programs((N if rows is None else rows.shape[0]) + 1, HV, V, BV, "chunk_offsets")
    ut = w if u is None else u  # strides only, not read
    _state_pass_kernel[(programs,)](
        k, w, u, g_cum, chunk_indices, chunk_offsets, rows, initial_state, h, v_new, final_state, T, N,
        *common.token_head_strides(k, w, ut, g_cum, ut if v_new is None else v_new),
        S=common.stage(H, HV, K, V, w.dtype, use_qk_l2norm), BV=BV, **loop,
    )
    return h, v_new, final_state


# The model's specialisations (common.model_tensors: K = V = 128, H = 16, HV = 48, bf16, k a head view of
# the packed q/k/v row): with and without the in-kernel L2 norm, with and without initial/final state, in
# each family's launch setting (Blackwell's named _2w); and the long-document split's passes over some
# of its segments (`dsfuse.gdn.split.pass_rows`): "_rows" (E, and the pass from the merged states: h and
# v_new where a row says so; with the segments' final states, "_states", or without) and "_maps"
# (u = 0, the maps alone).
_SEGMENT_ROWS = common.model_tensors().segment_rows
AOT_SPECS = common.record_variants(
    "gdn_state_pass{l2}{states}_bf16{family}", launch_state_pass, lambda x, state: (
        x.k, x.w, x.u, x.g_cum, x.chunk_indices, x.chunk_offsets, state, x.h, x.v_new, state),
    states=True, per_family=True) + common.record_variants(
    "gdn_state_pass_rows{l2}{states}_bf16{family}", functools.partial(launch_state_pass, rows=_SEGMENT_ROWS),
    lambda x, state: (x.k, x.w, x.u, x.g_cum, x.chunk_indices, x.chunk_offsets, x.state, x.h, x.v_new, state),
    states=True, per_family=True) + common.record_variants(
    "gdn_state_pass_maps{l2}_bf16{family}", functools.partial(launch_state_pass, rows=_SEGMENT_ROWS), lambda x, _: (
        x.k, x.w, None, x.g_cum, x.chunk_indices, x.chunk_offsets, x.state, None, None, x.state), per_family=True)
