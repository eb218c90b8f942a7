"""Gated DeltaNet forward output stage: every chunk's output from its starting state.

One program per (chunk, value head, block of ``BV`` value channels), chunks of ``C = BT = 64``
tokens from the chunk table (the last chunk of a document may be short;
``dsfuse.gdn.reference.chunk_output`` is the math)::

    o = scale * [exp(G) * (q @ h) + tril(q @ k^T * Gamma) @ v_new],   Gamma_ij = exp(G_i - G_j), j <= i

``exp(G)`` scales the rows of the fp32 product ``q @ h`` (the same as ``(q * exp(G)) @ h``
without rounding ``q * exp(G)`` to the dot dtype). The causal mask (``j <= i``, both tokens in
the chunk) is applied to the exponent before ``exp`` and to the product after it, so only
``G_i - G_j <= 0`` and ``G_i <= 0`` are exponentiated. ``k`` is loaded transposed
(``[K, BT]``, swapped strides) so no dot result is transposed (Triton 3.6 on Hopper
miscompiles ``tl.trans`` of a wgmma accumulator).

Precision: bf16/fp16 inputs multiply bf16/fp16 operands with fp32 accumulation (the masked
``q k^T * Gamma`` is rounded to the input dtype before its product with ``v_new``); fp32 inputs
multiply in full fp32 (``input_precision="ieee"``, not TF32). ``USE_QK_L2NORM`` normalises
``q`` and ``k`` rows in fp32 (``x * rsqrt(sum x^2 + 1e-6)``) before rounding them to the dot
dtype, as the state and WY stages do.

Layouts (packed tokens): ``q``, ``k`` ``[T, H, K]``; ``v_new``, ``o`` ``[T, HV, V]`` (any token
and head strides, unit channel stride); ``g_cum`` fp32 ``[T, HV]``; ``h`` ``[NC, HV, K, V]``
contiguous (the state pass's). Value head ``i_hv`` reads qk head ``i_hv // (HV // H)``.
``o`` is written in its own dtype (``v``'s). Tokens in no chunk (past ``cu_seqlens[-1]``) get
``o = 0`` from one extra row of programs (``i_c == NC``), so every element is written without a
host sync; no atomics. Grid: one axis of ``(NC + 1) * HV * (V // BV)`` programs, value block
fastest, then value head (grouped heads read the same q and k), then chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsfuse.gdn.triton import common

# Launch constants (no autotuner, every GPU family): 128 value channels per program (min(block_v, V)),
# 4 warps. H200, Triton 3.6, the model's shape (T = 32768 in five documents, (H, HV) = (16, 48),
# K = V = 128, bf16, L2 norm), median of triton.testing.do_bench: 0.82 ms, against 1.18 ms for
# (64, 4 warps), 1.61 (32, 4), 1.40 (128, 8), 2.12 (64, 8); num_stages 1, 2, 3 alike (no loop);
# every setting gave bitwise the same o. Compiles without spills (AOT_SPECS).
CONFIG = common.LaunchConfig(block_v=128, num_warps=4, num_stages=2)


@triton.jit(do_not_specialize=["T", "NC"])
def _output_kernel(
    q_ptr, k_ptr, vn_ptr, h_ptr, g_ptr, ci_ptr,
    o_ptr,  # out
    scale,  # fp32
    T, NC,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_ot, s_oh,
    S, BV: tl.constexpr,  # common.Stage; value channels per program
):
    # i_c in [0, NC]; NC: the tail of tokens in no chunk
    i_c, i_hv, i_h, o_k, o_v, o_i = common.value_block_program(S.HV, S.GROUP, S.V, BV, S.K, S.BT)
    dtype = q_ptr.dtype.element_ty

    if i_c < NC:
        i_c64, _, o_t, m_t = common.chunk_tokens(ci_ptr, i_c, o_i)  # o_t: [BT] int64 token offsets

        b_q = common.load_rows(q_ptr, s_qt, s_qh, o_t, m_t, i_h, o_k)  # [BT, K]
        b_k = common.load_cols(k_ptr, s_kt, s_kh, o_t, m_t, i_h, o_k)  # [K, BT]: k transposed from memory
        if S.USE_QK_L2NORM:
            b_q = common.l2_normalize(b_q, 1, dtype, S.EMULATE_BF16)
            b_k = common.l2_normalize(b_k, 0, dtype, S.EMULATE_BF16)

        b_h = tl.load(common.state_tile(h_ptr, i_c64, i_hv, S.HV, S.K, S.V, o_k, o_v))  # [K, BV]
        b_o = common.dot(b_q, b_h, None, S.DOT_PRECISION, S.EMULATE_BF16)  # [BT, K] @ [K, BV] -> [BT, BV]
        b_A = common.dot(b_q, b_k, None, S.DOT_PRECISION, S.EMULATE_BF16)  # [BT, K] @ [K, BT] -> [BT, BT]

        b_g = common.load_tokens(g_ptr, s_gt, s_gh, o_t, m_t, i_hv)  # [BT], <= 0
        b_o = b_o * tl.exp(b_g)[:, None]
        b_A = common.causal_decay(b_A, b_g, o_i, m_t, False)  # [BT, BT] causal, in the chunk

        b_vn = common.load_rows(vn_ptr, s_vt, s_vh, o_t, m_t, i_hv, o_v)  # [BT, BV]
        # [BT, BT] @ [BT, BV]
        b_o = common.dot(common.round_to(b_A, dtype, S.EMULATE_BF16), b_vn, b_o, S.DOT_PRECISION, S.EMULATE_BF16)
        b_o = b_o * scale
        common.store_rows(o_ptr, s_ot, s_oh, o_t, m_t, i_hv, o_v, b_o, S.EMULATE_BF16)
    else:
        # tokens past the last chunk's end (past cu_seqlens[-1]) belong to no chunk: o = 0
        common.store_zero_tail(o_ptr, ci_ptr, NC, T, s_ot, s_oh, i_hv, o_v, o_i, S.BT, BV)


def launch_output(
    q: torch.Tensor,
    k: torch.Tensor,
    v_new: torch.Tensor,
    h: torch.Tensor,
    g_cum: torch.Tensor,
    chunk_indices: torch.Tensor,
    scale: float,
    o: torch.Tensor,
    *,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """Write the output into ``o`` ``[T, HV, V]`` (``v``'s dtype) and return it.

    ``q``, ``k`` ``[T, H, K]``; ``v_new`` ``[T, HV, V]``; ``h`` ``[NC, HV, K, V]`` contiguous;
    ``g_cum`` fp32 ``[T, HV]``; ``chunk_indices`` int32 ``[NC, 3]``; ``use_qk_l2norm``
    normalises q and k in the kernel. Arguments are validated by the public API.
    """
    T, H, K = q.shape
    HV, V = v_new.shape[1], v_new.shape[2]
    NC = chunk_indices.shape[0]
    BV = min(CONFIG.block_v, V)
    _output_kernel[(common.value_block_programs(NC + 1, HV, V, BV, "chunk_indices"),)](
        q, k, v_new, h, g_cum, chunk_indices, o,
        float(scale), T, NC,
        *common.token_head_strides(q, k, v_new, g_cum, o),
        S=common.stage(H, HV, K, V, q.dtype, use_qk_l2norm), BV=BV,
        **CONFIG.options(),
    )
    return o


# The model's specialisations (common.model_tensors: K = V = 128, H = 16, HV = 48, bf16, q and k head views
# of the packed q/k/v row), with and without the in-kernel L2 norm.
AOT_SPECS = common.record_variants("gdn_output{l2}_bf16", launch_output, lambda x, _: (
    x.q, x.k, x.v_new, x.h, x.g_cum, x.chunk_indices, x.scale, x.o))
