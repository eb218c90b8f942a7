"""In-place text RoPE with the frequencies computed in the kernel from the angles (explored design).

The shipped path makes ``(cos, sin)`` per call with two small kernels (a fill of the modulus and
``torch.polar``) and then rotates. Here one kernel reads the angles: a program takes one token and a
block of its heads, computes the token's ``P`` cosines and sines once with the CUDA math library's
``cosf``/``sinf`` (libdevice ``__nv_cosf``/``__nv_sinf``, what ``torch.polar`` calls through
``c10::polar``; ``1 * cos`` is exact), and rotates every head's pairs with the shipped rounding:
``r0 = fma(x0, c, -(x1 s))``, ``r1 = fma(x0, s, x1 c)``, FP contraction off.

Layout as the shipped kernel's in-place form: ``values`` ``[B, S, H, C]`` (channel stride 1), angles
fp32 ``[B|1, S, P]`` (pair stride 1); channels ``[C - 2P, C)`` rotated in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _flip_sign(x):
    return (x.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)


@triton.jit
def _rope_angles_inplace_kernel(x_ptr, a_ptr, seq, heads, pair_start, n_pairs, sx_b, sx_s, sx_h, sa_b, sa_s,
                                CONJ: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    i_t, i_hb = tl.program_id(0), tl.program_id(1)
    i_b, i_s = (i_t // seq).to(tl.int64), (i_t % seq).to(tl.int64)
    o_p = tl.arange(0, BLOCK_P)
    m_p = o_p < n_pairs
    b_a = tl.load(a_ptr + i_b * sa_b + i_s * sa_s + o_p, mask=m_p, other=0.0)  # [BLOCK_P], once per token
    b_cos, b_sin = libdevice.cos(b_a), libdevice.sin(b_a)
    if CONJ:
        b_sin = _flip_sign(b_sin)
    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    o_k = tl.arange(0, 2 * BLOCK_P)
    m = (o_h < heads)[:, None] & (o_k < 2 * n_pairs)[None, :]
    p = x_ptr + i_b * sx_b + i_s * sx_s + o_h.to(tl.int64)[:, None] * sx_h + pair_start + o_k[None, :]
    b_x = tl.load(p, mask=m).to(tl.float32)
    b_x0, b_x1 = tl.split(tl.reshape(b_x, (BLOCK_H, BLOCK_P, 2)))
    c, s = b_cos[None, :], b_sin[None, :]
    b_r0 = tl.fma(b_x0, c, _flip_sign(b_x1 * s))
    b_r1 = tl.fma(b_x0, s, b_x1 * c)
    tl.store(p, tl.reshape(tl.join(b_r0, b_r1), (BLOCK_H, 2 * BLOCK_P)).to(x_ptr.dtype.element_ty), mask=m)


def rope_angles_inplace(values: torch.Tensor, angles: torch.Tensor, *, conj: bool = False, block_h: int = 64,
                        num_warps: int = 4) -> torch.Tensor:
    """Rotate the last ``2P`` channels of ``values`` ``[B, S, H, C]`` in place by ``angles`` ``[B|1, S, P]``."""
    batch, seq, heads, channels = values.shape
    pairs = angles.shape[-1]
    assert values.stride(-1) == 1 and angles.stride(-1) == 1 and angles.dtype == torch.float32
    block_h = min(block_h, triton.next_power_of_2(heads))
    sa_b = 0 if angles.shape[0] == 1 else angles.stride(0)
    _rope_angles_inplace_kernel[(batch * seq, triton.cdiv(heads, block_h))](
        values, angles, seq, heads, channels - 2 * pairs, pairs, *values.stride()[:3], sa_b, angles.stride(1),
        CONJ=conj, BLOCK_H=block_h, BLOCK_P=triton.next_power_of_2(pairs), num_warps=num_warps,
        enable_fp_fusion=False)
    return values
