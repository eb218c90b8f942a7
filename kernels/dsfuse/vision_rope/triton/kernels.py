"""Triton kernels of the vision RoPE: fused backward (native layouts -> packed dQKV) and forward.

Backward, logical layouts (any strides; the public API pins the model's storage):

* ``dq`` ``[H, T, D]`` (model: contiguous, "HTD"), ``dk`` ``[H, T, D]`` (model: the
  transpose of a contiguous ``[H, D, T]`` buffer, "HDT": stride 1 along T),
  ``dv`` ``[H, T, D]`` (HTD);
* ``cos``, ``sin`` fp32 ``[T, D/2]``;
* output ``dqkv`` ``[T, 3 * H * D]``, column ``part * H * D + h * D + d`` (part 0 q, 1 k, 2 v),
  channel stride 1.

One program takes ``BLOCK_T`` tokens of one head (16 tokens and 2 warps: the fastest
setting measured on the H200, experiments/vision_rope/raw/tuning). dK tiles are loaded along T
(coalesced for HDT storage) and stored along D; Triton moves the tile between the
two register layouts through shared memory, so no separate dK copy is made.

Rounding: ``dx1 = g1 * cos + g2 * sin``, ``dx2 = g2 * cos - g1 * sin`` with every
product and sum rounded in fp32 (FP contraction off at launch, no ``tl.fma``),
then one round-to-nearest-even to the output dtype: bitwise equal to eager autograd.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from dsfuse._common.aot import AotSpec, record_specs
from dsfuse._common.launch import Geometry, TritonLaunch, layout_key

TOKENS_PER_PROGRAM = 16
NUM_WARPS = 2


@triton.jit
def _token_block(cos_ptr, sin_ptr, sc_t, ss_t, tokens, i_tb, BLOCK_T: tl.constexpr, HALF: tl.constexpr):
    """Token block ``i_tb``'s token offsets, half-channel offsets, row mask and [BLOCK_T, HALF] fp32 tables."""
    o_t = (i_tb * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    o_d = tl.arange(0, HALF)
    m_2d = (o_t < tokens)[:, None]
    b_cos = tl.load(cos_ptr + o_t[:, None] * sc_t + o_d[None, :], mask=m_2d)
    b_sin = tl.load(sin_ptr + o_t[:, None] * ss_t + o_d[None, :], mask=m_2d)
    return o_t, o_d, m_2d, b_cos, b_sin


@triton.jit
def _unrotate_store(g_ptr, s_h, s_t, s_d, out_ptr, so_t, col, b_cos, b_sin, o_t, o_d, m_2d, HALF: tl.constexpr):
    """Load one head's [BLOCK_T, D] gradient (two halves), rotate back, store into the packed row."""
    b_g1 = tl.load(g_ptr + s_h + o_t[:, None] * s_t + o_d[None, :] * s_d, mask=m_2d).to(tl.float32)
    b_g2 = tl.load(g_ptr + s_h + o_t[:, None] * s_t + (o_d + HALF)[None, :] * s_d, mask=m_2d).to(tl.float32)
    b_dx1 = b_g1 * b_cos + b_g2 * b_sin
    b_dx2 = b_g2 * b_cos - b_g1 * b_sin
    p_out = out_ptr + o_t[:, None] * so_t + col + o_d[None, :]
    tl.store(p_out, b_dx1.to(out_ptr.dtype.element_ty), mask=m_2d)
    tl.store(p_out + HALF, b_dx2.to(out_ptr.dtype.element_ty), mask=m_2d)


@triton.jit
def _vision_rope_bwd_kernel(
    dq_ptr, dk_ptr, dv_ptr,  # [H, T, D] logical each, any strides
    cos_ptr, sin_ptr,  # fp32 [T, D/2]
    out_ptr,  # dqkv [T, 3 * H * D], channel stride 1
    tokens,
    sq_h, sq_t, sq_d,
    sk_h, sk_t, sk_d,
    sv_h, sv_t, sv_d,
    sc_t, ss_t,  # table row strides (channel stride 1)
    so_t,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,  # D / 2
    HAS_V: tl.constexpr,  # False: write zeros into the v columns (gradient of q and k only)
    BLOCK_T: tl.constexpr,
):
    i_tb, i_h = tl.program_id(0), tl.program_id(1)
    o_t, o_d, m_2d, b_cos, b_sin = _token_block(cos_ptr, sin_ptr, sc_t, ss_t, tokens, i_tb, BLOCK_T, HALF)
    col = i_h * 2 * HALF
    _unrotate_store(dq_ptr, i_h.to(tl.int64) * sq_h, sq_t, sq_d, out_ptr, so_t, col, b_cos, b_sin, o_t, o_d, m_2d, HALF)
    _unrotate_store(dk_ptr, i_h.to(tl.int64) * sk_h, sk_t, sk_d, out_ptr, so_t, col + HEADS * 2 * HALF,
                    b_cos, b_sin, o_t, o_d, m_2d, HALF)
    o_dv = tl.arange(0, 2 * HALF)
    p_out = out_ptr + o_t[:, None] * so_t + col + 2 * HEADS * 2 * HALF + o_dv[None, :]
    if HAS_V:
        # [BLOCK_T, D] dV copied into its columns
        b_v = tl.load(dv_ptr + i_h.to(tl.int64) * sv_h + o_t[:, None] * sv_t + o_dv[None, :] * sv_d, mask=m_2d)
        tl.store(p_out, b_v, mask=m_2d)
    else:
        tl.store(p_out, tl.zeros((BLOCK_T, 2 * HALF), dtype=out_ptr.dtype.element_ty), mask=m_2d)


@triton.jit
def _rotate_store(x_ptr, s_t, col, y_ptr, sy_t, sy_h, i_h, b_cos, b_sin, o_t, o_d, m_2d, HALF: tl.constexpr):
    """Rotate one head's [BLOCK_T, D] slice of the qkv row into y [T, H, D]."""
    p_x = x_ptr + o_t[:, None] * s_t + col + o_d[None, :]
    b_x1 = tl.load(p_x, mask=m_2d).to(tl.float32)
    b_x2 = tl.load(p_x + HALF, mask=m_2d).to(tl.float32)
    p_y = y_ptr + o_t[:, None] * sy_t + i_h * sy_h + o_d[None, :]
    tl.store(p_y, (b_x1 * b_cos - b_x2 * b_sin).to(y_ptr.dtype.element_ty), mask=m_2d)
    tl.store(p_y + HALF, (b_x2 * b_cos + b_x1 * b_sin).to(y_ptr.dtype.element_ty), mask=m_2d)


@triton.jit
def _vision_rope_fwd_kernel(
    qkv_ptr,  # [T, 3 * H * D], channel stride 1
    cos_ptr, sin_ptr,  # fp32 [T, D/2]
    q_ptr, k_ptr,  # rotated [T, H, D], contiguous
    tokens,
    s_t,  # qkv row stride
    sc_t, ss_t,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    i_tb, i_h = tl.program_id(0), tl.program_id(1)
    o_t, o_d, m_2d, b_cos, b_sin = _token_block(cos_ptr, sin_ptr, sc_t, ss_t, tokens, i_tb, BLOCK_T, HALF)
    col = i_h * 2 * HALF
    _rotate_store(qkv_ptr, s_t, col, q_ptr, HEADS * 2 * HALF, 2 * HALF, i_h, b_cos, b_sin, o_t, o_d, m_2d, HALF)
    _rotate_store(qkv_ptr, s_t, col + HEADS * 2 * HALF, k_ptr, HEADS * 2 * HALF, 2 * HALF, i_h, b_cos, b_sin,
                  o_t, o_d, m_2d, HALF)


def _check_tables(cos: torch.Tensor, sin: torch.Tensor) -> None:
    for name, t in (("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected unit stride along the frequency dim, got strides {t.stride()}")


def _grid(tokens: int, heads: int) -> tuple[int, int]:
    return (triton.cdiv(tokens, TOKENS_PER_PROGRAM), heads)


def _backward_geometry(dq, dk, v, cos, sin, out, has_v: bool) -> Geometry:
    """The backward launch's grid, scalars and constexprs (and its table check): fixed by its key."""
    _check_tables(cos, sin)
    heads, tokens, dim = dq.shape
    scalars = (tokens, *dq.stride(), *dk.stride(), *v.stride(), cos.stride(0), sin.stride(0), out.stride(0))
    return Geometry(_grid(tokens, heads), scalars,
                    dict(HEADS=heads, HALF=dim // 2, HAS_V=has_v, BLOCK_T=TOKENS_PER_PROGRAM))


_BACKWARD = TritonLaunch(_vision_rope_bwd_kernel, num_warps=NUM_WARPS, enable_fp_fusion=False)
_FORWARD = TritonLaunch(_vision_rope_fwd_kernel, num_warps=NUM_WARPS, enable_fp_fusion=False)


def launch_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor | None, cos: torch.Tensor,
                    sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """dQ, dK, dV (``[H, T, D]`` logical, any strides; ``dv=None``: zeros) -> ``out`` ``[T, 3HD]``.

    Arguments are validated by the public API (aliasing included; under ``torch.compile``
    by the declared op at run time).
    """
    if dq.shape[1] == 0:
        return out
    v = dv if dv is not None else dq  # unread when HAS_V is False
    tensors = (dq, dk, v, cos, sin, out)
    _BACKWARD((dv is not None, *layout_key(*tensors)), tensors,
              lambda: _backward_geometry(*tensors, dv is not None))
    return out


def _forward_geometry(qkv, cos, sin, q_out, k_out, heads: int) -> Geometry:
    _check_tables(cos, sin)
    tokens, dim = qkv.shape[0], qkv.shape[1] // (3 * heads)
    return Geometry(_grid(tokens, heads), (tokens, qkv.stride(0), cos.stride(0), sin.stride(0)),
                    dict(HEADS=heads, HALF=dim // 2, BLOCK_T=TOKENS_PER_PROGRAM))


def launch_forward(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                   q_out: torch.Tensor, k_out: torch.Tensor) -> None:
    """``qkv`` ``[T, 3HD]`` -> rotated ``q_out``, ``k_out`` ``[T, H, D]`` (contiguous, new)."""
    if qkv.shape[0] == 0:
        return
    tensors = (qkv, cos, sin, q_out, k_out)
    _FORWARD((heads, *layout_key(*tensors)), tensors, lambda: _forward_geometry(*tensors, heads))


def _aot_specs() -> list[AotSpec]:
    """The model's specialisations (16 heads x 64, bf16, T = 8649: the 93 x 93 grid; dQ, dV ``[H, T, D]``
    and dK ``[H, D, T]`` storage), recorded from the launchers on meta tensors."""
    heads, tokens, dim = 16, 8649, 64
    grad = torch.empty(heads, tokens, dim, device="meta", dtype=torch.bfloat16)
    dk = torch.empty(heads, dim, tokens, device="meta", dtype=torch.bfloat16).transpose(1, 2)
    cos = sin = torch.empty(tokens, dim // 2, device="meta")
    qkv = torch.empty(tokens, 3 * heads * dim, device="meta", dtype=torch.bfloat16)
    rotated = torch.empty(tokens, heads, dim, device="meta", dtype=torch.bfloat16)
    return (record_specs("vision_rope_bwd_bf16", launch_backward, grad, dk, grad, cos, sin, qkv)
            + record_specs("vision_rope_fwd_bf16", launch_forward, qkv, cos, sin, heads, rotated, rotated))


AOT_SPECS = _aot_specs()
