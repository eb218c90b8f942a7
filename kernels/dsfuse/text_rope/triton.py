"""Triton kernel of the text RoPE: one pass over the tensor, forward or backward.

Logical layout: ``values`` ``[B, S, H, C]`` (3D inputs are viewed with ``H = 1``)
with any strides, channel stride included; ``freqs`` fp32 ``[B|1, S, P, 2]``
holding ``(cos, sin)`` of each pair (``torch.view_as_real`` of the model's
``torch.polar`` frequencies, so the trig bits are the eager ones). Channels
``[C - 2P, C)`` are rotated as adjacent pairs, channels ``[0, C - 2P)`` copied.

Rounding: each rotated component is one FMA with the first product fused, the
way nvcc compiles ``c10::complex<float>`` multiplication in the eager CUDA path:
``r0 = fma(x0, c, -(x1 * s))``, ``r1 = fma(x0, s, x1 * c)``; FP contraction is
switched off at launch so no other product is fused. Negations flip the sign
bit (as CUDA's unary minus does, so signed zeros match); the conjugate negates
``s``. One round-to-nearest-even to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsfuse._common import check_no_overlap
from dsfuse._common.aot import AotSpec

FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elements one program moves: large enough to hide latency, small enough that
# 4096-token inputs still give thousands of programs for 132+ SMs.
ELEMENTS_PER_PROGRAM = 8192
NUM_WARPS = 4


@triton.jit
def _flip_sign(x):
    """Exact negation (sign bit flip) like C's unary minus; Triton's ``-x`` is ``0 - x``,
    which turns -(+0.0) into +0.0 instead of -0.0."""
    return (x.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)


@triton.jit
def _rope_kernel(
    x_ptr,  # values [B, S, H, C], any strides
    f_ptr,  # freqs fp32 [B|1, S, P, 2], (cos, sin) last and contiguous
    y_ptr,  # output [B, S, H, C], any strides (may be x_ptr when COPY is False)
    seq,
    heads,
    pair_start,  # C - 2P: first rotated channel
    rot_width,  # 2P: rotated channels
    sx_b, sx_s, sx_h, sx_c,
    sy_b, sy_s, sy_h, sy_c,
    sf_b, sf_s,
    CONJ: tl.constexpr,  # rotate by the conjugate (inverse RoPE and every backward)
    COPY: tl.constexpr,  # write the leading channels (False: in place, rotary channels only)
    GRAD_SUM: tl.constexpr,  # add +0.0 like eager autograd's sum of the two gradient paths
    BLOCK_H: tl.constexpr,  # heads per program (rows of the tile)
    BLOCK_C: tl.constexpr,  # >= pair_start (copied channels)
    BLOCK_K: tl.constexpr,  # >= rot_width (rotated channels)
):
    # One program: one token (b, s) and BLOCK_H of its heads, so the token's
    # frequencies are loaded once and no per-row index division is needed.
    i_t, i_hb = tl.program_id(0), tl.program_id(1)
    i_b = (i_t // seq).to(tl.int64)
    i_s = (i_t % seq).to(tl.int64)
    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < heads
    o_x = i_b * sx_b + i_s * sx_s + o_h.to(tl.int64) * sx_h  # [BLOCK_H] int64 row offsets
    o_y = i_b * sy_b + i_s * sy_s + o_h.to(tl.int64) * sy_h
    o_f = i_b * sf_b + i_s * sf_s

    if COPY:
        o_c = tl.arange(0, BLOCK_C)
        m_c = m_h[:, None] & (o_c < pair_start)[None, :]
        # [BLOCK_H, BLOCK_C]
        b_x = tl.load(x_ptr + o_x[:, None] + o_c[None, :] * sx_c, mask=m_c)
        if GRAD_SUM:
            b_x = (b_x.to(tl.float32) + 0.0).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + o_y[:, None] + o_c[None, :] * sy_c, b_x, mask=m_c)

    # Rotated channels as a 2D tile: lane k holds channel pair_start + k; its pair
    # partner is lane k ^ 1 (loaded again, from L1), its pair index k // 2.
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < rot_width
    m_hk = m_h[:, None] & m_k[None, :]
    # [BLOCK_K] (cos, sin) of each lane's pair, shared by the heads of the token
    b_cos = tl.load(f_ptr + o_f + o_k // 2 * 2, mask=m_k)
    b_sin = tl.load(f_ptr + o_f + o_k // 2 * 2 + 1, mask=m_k)
    if CONJ:
        b_sin = _flip_sign(b_sin)
    # [BLOCK_H, BLOCK_K]
    b_x = tl.load(x_ptr + o_x[:, None] + (pair_start + o_k)[None, :] * sx_c, mask=m_hk).to(tl.float32)
    b_xp = tl.load(x_ptr + o_x[:, None] + (pair_start + (o_k ^ 1))[None, :] * sx_c, mask=m_hk).to(tl.float32)
    # even lane (x0 = b_x, x1 = b_xp): r0 = fma(x0, c, -(x1 * s))
    # odd lane  (x1 = b_x, x0 = b_xp): r1 = fma(x0, s, x1 * c)
    b_r0 = tl.fma(b_x, b_cos[None, :], _flip_sign(b_xp * b_sin[None, :]))
    b_r1 = tl.fma(b_xp, b_sin[None, :], b_x * b_cos[None, :])
    b_y = tl.where((o_k % 2 == 0)[None, :], b_r0, b_r1).to(y_ptr.dtype.element_ty)
    if GRAD_SUM:
        b_y = (b_y.to(tl.float32) + 0.0).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + o_y[:, None] + (pair_start + o_k)[None, :] * sy_c, b_y, mask=m_hk)


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(2) if t.ndim == 3 else t


def block_sizes(heads: int, channels: int, pairs: int, copy: bool) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_C, BLOCK_K) for rows of ``channels`` with ``pairs`` rotary pairs."""
    block_c = triton.next_power_of_2(max(channels - 2 * pairs, 1)) if copy else 1
    block_k = triton.next_power_of_2(2 * pairs)
    per_row = (block_c if copy else 0) + block_k
    block_h = triton.next_power_of_2(max(ELEMENTS_PER_PROGRAM // per_row, 1))
    return min(block_h, triton.next_power_of_2(heads)), block_c, block_k


def launch_rope(
    values: torch.Tensor,
    freqs: torch.Tensor,
    out: torch.Tensor,
    *,
    conj: bool,
    copy: bool = True,
    grad_sum: bool = False,
) -> torch.Tensor:
    """Rotate ``values`` into ``out`` (``out is values`` with ``copy=False``: in place).

    ``freqs`` is fp32 ``[B|1, S, P, 2]``. Shapes and dtypes are validated by the
    public API; this launcher checks memory aliasing, which needs real tensors.
    """
    if copy:
        check_no_overlap({"out": out}, {"values": values, "angles": freqs})
    elif out is not values:
        raise ValueError("out: the in-place kernel writes into values; out must be values itself")
    else:
        check_no_overlap({"values": values}, {"angles": freqs})
    x, y = _as_4d(values), _as_4d(out)
    batch, seq, heads, channels = x.shape
    pairs = freqs.shape[-2]
    if batch * seq * heads == 0:
        return out
    if freqs.stride(-1) != 1 or freqs.stride(-2) != 2:
        raise ValueError(f"freqs: expected (cos, sin) pairs packed densely in the last two dims, got strides {freqs.stride()}")
    if batch * seq >= 2**31:
        raise ValueError(f"values: at most 2**31 - 1 tokens (batch x seq) per call, got {batch * seq}")
    block_h, block_c, block_k = block_sizes(heads, channels, pairs, copy)
    sf_b = 0 if freqs.shape[0] == 1 else freqs.stride(0)
    grid = (batch * seq, triton.cdiv(heads, block_h))
    _rope_kernel[grid](
        x, freqs, y,
        seq, heads, channels - 2 * pairs, 2 * pairs,
        *x.stride(), *y.stride(),
        sf_b, freqs.stride(1),
        CONJ=conj, COPY=copy, GRAD_SUM=grad_sum,
        BLOCK_H=block_h, BLOCK_C=block_c, BLOCK_K=block_k,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )
    return out


def _aot_specs() -> list[AotSpec]:
    """The specialisations the DeepSeek-V4.1 shapes launch (C=512, P=32; bf16/fp16/fp32)."""
    specs = []
    ints = ["seq", "heads", "pair_start", "rot_width"] + [
        f"s{t}_{d}" for t in "xy" for d in "bshc"
    ] + ["sf_b", "sf_s"]
    for dtype, ty in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")):
        for conj, copy, grad_sum, tag in (
            (False, True, False, "fwd"),
            (True, True, True, "bwd"),
            (True, True, False, "inverse"),
            (False, False, False, "inplace"),
        ):
            block_h, block_c, block_k = block_sizes(64, 512, 32, copy)
            signature = {"x_ptr": f"*{ty}", "f_ptr": "*fp32", "y_ptr": f"*{ty}"}
            signature.update({n: "i64" if n.startswith("s") and n[1] in "xyf" else "i32" for n in ints})
            specs.append(
                AotSpec(
                    name=f"text_rope_{tag}_{ty}",
                    kernel=_rope_kernel,
                    signature=signature,
                    constexprs=dict(
                        CONJ=conj, COPY=copy, GRAD_SUM=grad_sum,
                        BLOCK_H=block_h, BLOCK_C=block_c, BLOCK_K=block_k,
                    ),
                    options={"num_warps": NUM_WARPS, "enable_fp_fusion": False},
                )
            )
    return specs


AOT_SPECS = _aot_specs()
