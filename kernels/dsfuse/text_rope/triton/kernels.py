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

import functools

import torch
import triton
import triton.language as tl

from dsfuse._common.aot import AotSpec, record_specs
from dsfuse._common.launch import Geometry, TritonLaunch, layout_key

# Work per program and warps, from the H200 sweep in experiments/text_rope/tune_blocks.py
# (raw data: experiments/text_rope/raw/tuning/): 2048 elements (4 rows of 512 channels,
# 32 rows in place) with 4 warps is within 1% of the best of 20 settings for forward,
# backward and in-place launches; larger programs lose up to 30%, smaller ones 25%.
ELEMENTS_PER_PROGRAM = 2048
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
    n_rows,  # B * S * H
    seq,
    heads,
    pair_start,  # C - 2P: first rotated channel
    n_pairs,  # P
    sx_b, sx_s, sx_h, sx_c,
    sy_b, sy_s, sy_h, sy_c,
    sf_b, sf_s,  # freqs strides of batch and sequence; pairs are dense (P, 2)
    CONJ: tl.constexpr,  # rotate by the conjugate (inverse RoPE and every backward)
    COPY: tl.constexpr,  # write the leading channels (False: in place, rotary channels only)
    GRAD_SUM: tl.constexpr,  # add +0.0 like eager autograd's sum of the two gradient paths
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_C: tl.constexpr,  # >= pair_start (copied channels)
    BLOCK_P: tl.constexpr,  # >= n_pairs
):
    i_r = tl.program_id(0)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)  # int32 row index (the launcher bounds n_rows)
    m_r = o_r < n_rows
    i_t = o_r // heads  # token b * seq + s
    i_b = (i_t // seq).to(tl.int64)
    i_s = (i_t % seq).to(tl.int64)
    i_h = (o_r % heads).to(tl.int64)
    o_x = i_b * sx_b + i_s * sx_s + i_h * sx_h  # [BLOCK_R] int64 row offsets
    o_y = i_b * sy_b + i_s * sy_s + i_h * sy_h
    o_f = i_b * sf_b + i_s * sf_s

    if COPY:
        o_c = tl.arange(0, BLOCK_C)
        m_c = m_r[:, None] & (o_c < pair_start)[None, :]
        # [BLOCK_R, BLOCK_C]
        b_x = tl.load(x_ptr + o_x[:, None] + o_c[None, :] * sx_c, mask=m_c)
        if GRAD_SUM:
            b_x = (b_x.to(tl.float32) + 0.0).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + o_y[:, None] + o_c[None, :] * sy_c, b_x, mask=m_c)

    # Rotated channels: contiguous [BLOCK_R, 2 * BLOCK_P] loads (vectorised), viewed as
    # [BLOCK_R, BLOCK_P, 2] pairs; a thread holds both members of a pair, so split/join
    # move no data between threads.
    o_k = tl.arange(0, 2 * BLOCK_P)
    m_k = m_r[:, None] & (o_k < 2 * n_pairs)[None, :]
    b_x = tl.load(x_ptr + o_x[:, None] + (pair_start + o_k)[None, :] * sx_c, mask=m_k).to(tl.float32)
    b_x0, b_x1 = tl.split(tl.reshape(b_x, (BLOCK_R, BLOCK_P, 2)))  # [BLOCK_R, BLOCK_P] each
    b_f = tl.load(f_ptr + o_f[:, None] + o_k[None, :], mask=m_k)  # (cos, sin) interleaved like the pairs
    b_cos, b_sin = tl.split(tl.reshape(b_f, (BLOCK_R, BLOCK_P, 2)))
    if CONJ:
        b_sin = _flip_sign(b_sin)
    b_r0 = tl.fma(b_x0, b_cos, _flip_sign(b_x1 * b_sin))
    b_r1 = tl.fma(b_x0, b_sin, b_x1 * b_cos)
    b_y = tl.reshape(tl.join(b_r0, b_r1), (BLOCK_R, 2 * BLOCK_P)).to(y_ptr.dtype.element_ty)
    if GRAD_SUM:
        b_y = (b_y.to(tl.float32) + 0.0).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + o_y[:, None] + (pair_start + o_k)[None, :] * sy_c, b_y, mask=m_k)


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(2) if t.ndim == 3 else t


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.lru_cache(maxsize=256)
def _block_sizes(channels: int, pairs: int, copy: bool, elements: int) -> tuple[int, int, int]:
    block_c = _pow2(max(channels - 2 * pairs, 1)) if copy else 1
    block_p = _pow2(pairs)
    per_row = (block_c if copy else 0) + 2 * block_p
    block_r = max(1, min(64, _pow2(max(elements // per_row, 1))))
    return block_r, block_c, block_p


def block_sizes(channels: int, pairs: int, copy: bool) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, BLOCK_P) for a row of ``channels`` with ``pairs`` rotary pairs."""
    return _block_sizes(channels, pairs, copy, ELEMENTS_PER_PROGRAM)


def _rope_geometry(x, freqs, y, conj: bool, copy: bool, grad_sum: bool) -> Geometry:
    """The launch's grid, scalars and constexprs, and its checks: all fixed by the launch's key."""
    batch, seq, heads, channels = x.shape
    pairs, n_rows = freqs.shape[-2], batch * seq * heads
    if freqs.stride(-1) != 1 or (freqs.stride(-2) != 2 and pairs > 1):
        raise ValueError(f"freqs: expected (cos, sin) pairs packed densely in the last two dims, got strides {freqs.stride()}")
    if n_rows >= 2**31:
        raise ValueError(f"values: at most 2**31 - 1 rows (batch x seq x heads) per call, got {n_rows}")
    block_r, block_c, block_p = block_sizes(channels, pairs, copy)
    sf_b = 0 if freqs.shape[0] == 1 else freqs.stride(0)
    scalars = (n_rows, seq, heads, channels - 2 * pairs, pairs, *x.stride(), *y.stride(), sf_b, freqs.stride(1))
    return Geometry((triton.cdiv(n_rows, block_r),), scalars,
                    dict(CONJ=conj, COPY=copy, GRAD_SUM=grad_sum, BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_P=block_p))


_ROPE = TritonLaunch(_rope_kernel, num_warps=NUM_WARPS, enable_fp_fusion=False)


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

    ``freqs`` is fp32 ``[B|1, S, P, 2]``. Arguments are validated by the public API
    (aliasing included; under ``torch.compile`` by the declared op at run time).
    """
    if not copy and out is not values:
        raise ValueError("out: the in-place kernel writes into values; out must be values itself")
    x, y = _as_4d(values), _as_4d(out)
    if x.numel() == 0:  # no rows (a row has at least the 2 channels of one pair)
        return out
    key = (conj, copy, grad_sum, *layout_key(x, freqs, y))
    _ROPE(key, (x, freqs, y), lambda: _rope_geometry(x, freqs, y, conj, copy, grad_sum))
    return out


def _aot_specs() -> list[AotSpec]:
    """The specialisations the DeepSeek-V4.1 shapes launch (q ``[1, 4096, 64, 512]``, C=512, P=32;
    bf16/fp16/fp32), recorded from the launcher on meta tensors."""
    specs = []
    for ty, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        values = torch.empty(1, 4096, 64, 512, device="meta", dtype=dtype)
        freqs = torch.empty(1, 4096, 32, 2, device="meta")
        for conj, copy, grad_sum, tag in ((False, True, False, "fwd"), (True, True, True, "bwd"),
                                          (True, True, False, "inverse"), (False, False, False, "inplace")):
            out = torch.empty_like(values) if copy else values
            specs += record_specs(f"text_rope_{tag}_{ty}", launch_rope, values, freqs, out, conj=conj, copy=copy,
                                  grad_sum=grad_sum)
    return specs


AOT_SPECS = _aot_specs()
