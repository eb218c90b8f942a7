"""Gated DeltaNet backward, last stage for q and k: the value-head sum and the L2-norm backward.

The earlier backward stages produce the gradients of each value head's view of q and k
(``dq_hv``, ``dk_hv``, fp32 ``[T, HV, K]``: value head ``i_hv`` reads qk head
``i_hv // G``, ``G = HV // H``). For each token and qk head ``i_h`` this stage sums its ``G``
value heads, in head order and in fp32 (``dsfuse.gdn.reference_backward._sum_value_heads``)::

    dy = dx_hv[i_h G] + dx_hv[i_h G + 1] + ... + dx_hv[i_h G + G - 1]      # left to right

and, with ``USE_QK_L2NORM`` (the forward normalised ``x`` in the kernel, so ``dy`` is the gradient
of ``y = x r``), the L2-norm backward in fp32 (``_l2norm_backward``)::

    r  = rsqrt(sum x^2 + 1e-6),  y = x r
    dx = r (dy - y (dy . y))

``x`` is the raw q or k row (input dtype, upcast to fp32). The result is rounded once to the
output dtype (round to nearest even). Without the L2 norm an fp32 output is bitwise the fp32
sum in that order (plain additions, no contraction); with it the fp32 reductions are Triton's
(tree order) and the GPU's ``rsqrt`` is approximate, so it is within a few units in the last
place of the exact value.

Layouts: ``q``, ``k`` ``[T, H, K]`` and the outputs ``dq``, ``dk`` ``[T, H, K]`` (q's dtype) with
any token and head strides and unit channel stride; the outputs are usually head views of one
packed gradient row ``[T, (2H + HV) K]`` and are written only at their own elements (the other
parts of the row are left alone). ``dq_hv``, ``dk_hv`` fp32 ``[T, HV, K]``, unit channel stride.
Every token is written (no chunk table: the stage is per token).

Grid ``(cdiv(T, BT), H, 2)``: a block of ``BT`` tokens, a qk head, and q (0) or k (1). Each
program reads its ``G`` value-head tiles ``[BT, K]`` once and writes its output tile once: no
atomics, fixed launch constants, a fixed summation order, so a launch is deterministic. Token
offsets are int64 before they multiply a stride. The stage is a pure stream (the model's shape
reads 2 x 48 x 128 fp32 and writes 2 x 16 x 128 bf16 per token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsfuse.gdn.triton import common

# Launch constants (no autotuner, every GPU family): 32 tokens per program, 4 warps; a [32, 128] fp32
# tile is 32 values per thread. Not measured on a GPU yet (a memory-bound stream: 1.6 GB of fp32
# value-head gradients (dq_hv and dk_hv) read at the model's shape, T = 32768, HV = 48, K = 128).
CONFIG = common.LaunchConfig(block_t=32, num_warps=4)


@triton.jit
def _finalize_tile(
    x_ptr,  # q or k [T, H, K], unit channel stride
    dxhv_ptr,  # dq_hv or dk_hv fp32 [T, HV, K], unit channel stride
    dx_ptr,  # dq or dk [T, H, K], unit channel stride
    i_t, i_h, T,
    s_xt, s_xh,
    s_at, s_ah,
    s_dt, s_dh,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)  # [BT] int64 token offsets
    m_t = (o_t < T)[:, None]
    o_k = tl.arange(0, K)

    # sum of the group's value heads, head i_h * GROUP first, left to right in fp32
    p_a = dxhv_ptr + o_t[:, None] * s_at + (i_h * GROUP) * s_ah + o_k[None, :]
    b_dy = tl.load(p_a, mask=m_t, other=0.0)  # [BT, K]
    for j in tl.static_range(1, GROUP):
        b_dy = b_dy + tl.load(p_a + j * s_ah, mask=m_t, other=0.0)

    if USE_QK_L2NORM:
        p_x = common.rows(x_ptr, s_xt, s_xh, o_t, i_h, o_k)
        b_x = tl.load(p_x, mask=m_t, other=0.0).to(tl.float32)  # [BT, K]
        b_r = tl.rsqrt(tl.sum(b_x * b_x, axis=1) + common.L2NORM_EPS)  # [BT]
        b_y = b_x * b_r[:, None]
        b_dyy = tl.sum(b_dy * b_y, axis=1)  # [BT]
        b_dy = b_r[:, None] * (b_dy - b_y * b_dyy[:, None])

    p_d = common.rows(dx_ptr, s_dt, s_dh, o_t, i_h, o_k)
    tl.store(p_d, common.round_to(b_dy, dx_ptr.dtype.element_ty, EMULATE_BF16), mask=m_t)


@triton.jit(do_not_specialize=["T"])
def _qk_finalize_kernel(
    q_ptr, k_ptr, dqhv_ptr, dkhv_ptr,  # dq_hv and dk_hv fp32 [T, HV, K]
    dq_ptr, dk_ptr,  # out: [T, H, K]
    T,  # tokens
    s_qt, s_qh, s_kt, s_kh, s_at, s_ah, s_bt, s_bh, s_dqt, s_dqh, s_dkt, s_dkh,  # a: dq_hv, b: dk_hv
    GROUP: tl.constexpr,  # HV // H: value heads per qk head
    K: tl.constexpr,
    BT: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    EMULATE_BF16: tl.constexpr,  # CPU interpreter with bf16 outputs only (see common.round_to)
):
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    if tl.program_id(2) == 0:
        _finalize_tile(q_ptr, dqhv_ptr, dq_ptr, i_t, i_h, T, s_qt, s_qh, s_at, s_ah, s_dqt, s_dqh,
                       GROUP, K, BT, USE_QK_L2NORM, EMULATE_BF16)
    else:
        _finalize_tile(k_ptr, dkhv_ptr, dk_ptr, i_t, i_h, T, s_kt, s_kh, s_bt, s_bh, s_dkt, s_dkh,
                       GROUP, K, BT, USE_QK_L2NORM, EMULATE_BF16)


def launch_qk_finalize(
    q: torch.Tensor,
    k: torch.Tensor,
    dq_hv: torch.Tensor,
    dk_hv: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    *,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the gradients of ``q`` and ``k`` into ``dq``, ``dk`` and return them.

    ``q``, ``k`` ``[T, H, K]`` the raw inputs; ``dq_hv``, ``dk_hv`` fp32 ``[T, HV, K]`` the
    gradients of each value head's view of the (normalised) q and k; ``dq``, ``dk``
    ``[T, H, K]`` in q's dtype (any token and head strides, unit channel stride everywhere).
    ``use_qk_l2norm``: q and k were L2-normalised in the forward kernels; apply the norm's
    backward. Arguments are validated by the public API.
    """
    T, H, K = q.shape
    HV = dq_hv.shape[1]
    if T == 0 or H == 0:
        return dq, dk
    grid = (triton.cdiv(T, CONFIG.block_t), H, 2)
    _qk_finalize_kernel[grid](
        q, k, dq_hv, dk_hv, dq, dk,
        T,
        *common.token_head_strides(q, k, dq_hv, dk_hv, dq, dk),
        GROUP=HV // H, K=K, BT=CONFIG.block_t,
        USE_QK_L2NORM=use_qk_l2norm,
        EMULATE_BF16=common.emulate_bf16(dq.dtype),
        **CONFIG.options(),
    )
    return dq, dk


# The model's specialisations (common.model_tensors: K = 128, H = 16, HV = 48, bf16): q, k head views of the
# packed q/k/v row, dq, dk the same views of the packed gradient row, dq_hv, dk_hv fp32 [T, 48, 128] dense;
# with and without the L2-norm backward.
AOT_SPECS = common.record_variants("gdn_qk_finalize{l2}_bf16", launch_qk_finalize, lambda x, _: (
    x.q, x.k, x.f32_hk, x.f32_hk2, x.dq_row, x.dk_row))
