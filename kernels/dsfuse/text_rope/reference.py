"""DeepSeek-V4.1 text RoPE: the math contract in plain PyTorch (the oracle).

Layouts: ``values`` is ``[B, S, C]`` (the shared KV latent) or ``[B, S, H, C]``
(queries, attention output); ``angles`` is fp32 ``[B, S, P]`` (or ``[1, S, P]``,
broadcast over the batch) with ``P`` rotary pairs. The LAST ``2 * P`` channels
are rotated as adjacent pairs ``(x[2i], x[2i+1])`` read as complex numbers; the
leading channels are copied.

``rope_reference`` is the out-of-place training form, operation for
operation: ``float()`` upcast, ``torch.polar`` frequencies, complex multiply,
``to(dtype)`` (round to nearest even), ``clone`` + slice assignment. The one
addition, a dense copy before ``view_as_complex`` when the tail has odd strides or
an odd storage offset (``view_as_complex`` needs even ones), moves no value and
lets odd widths and strided views through; the model's tensors never need it. Its autograd
graph is the eager backward that the fused backward reproduces bit for bit on
CUDA. ``apply_rotary_emb_`` is the model's in-place form on a channel slice.
"""

from __future__ import annotations

import math

import torch


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when ``view_as_complex`` accepts it, else a dense copy (values unchanged).

    ``view_as_complex`` needs even strides and an even storage offset; the model's own
    tensors always have them, slices of odd-width rows do not.
    """
    if torch.compiler.is_compiling():  # traced graphs keep the model's exact sequence
        return t
    if t.storage_offset() % 2 == 0 and all(s % 2 == 0 for s in t.stride()[:-1]) and t.stride(-1) == 1:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def rope_freqs(angles: torch.Tensor) -> torch.Tensor:
    """Unit complex frequencies ``exp(i * angles)`` exactly as the eager model makes them."""
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb_(x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The model's in-place rotary: rotate ``x`` (the rotary channels only) and return it.

    ``x`` is ``[B, S, 2P]`` or ``[B, S, H, 2P]`` (typically ``values[..., -2P:]``);
    ``freqs_cis`` complex64 ``[B, S, P]``.
    """
    pairs = torch.view_as_complex(_dense(x.float()).unflatten(-1, (-1, 2)))
    if x.ndim == 4:
        freqs_cis = freqs_cis.unsqueeze(2)
    if inverse:
        freqs_cis = freqs_cis.conj()
    x.copy_(torch.view_as_real(pairs * freqs_cis).flatten(-2))
    return x


def rope_reference(values: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Out-of-place RoPE on the last ``2 * angles.shape[-1]`` channels of ``values``."""
    rd = 2 * angles.shape[-1]
    pairs = torch.view_as_complex(_dense(values[..., -rd:].float()).unflatten(-1, (-1, 2)))
    freqs = rope_freqs(angles)
    if values.ndim == 4:
        freqs = freqs.unsqueeze(2)
    if inverse:
        freqs = freqs.conj()
    rotated = torch.view_as_real(pairs * freqs).flatten(-2).to(values.dtype)
    out = values.clone()
    out[..., -rd:] = rotated
    return out


def rope_reference_inplace(values: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """In-place RoPE on ``values`` through the model's ``apply_rotary_emb_``."""
    rd = 2 * angles.shape[-1]
    apply_rotary_emb_(values[..., -rd:], rope_freqs(angles), inverse)
    return values


def rope_reference_fp64(values: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The same rotation in float64 (no intermediate rounding), for tolerance checks."""
    rd = 2 * angles.shape[-1]
    v = values.double()
    x0, x1 = v[..., -rd::2], v[..., -rd + 1 :: 2]
    a = angles.double()
    c, s = torch.cos(a), torch.sin(a)
    if values.ndim == 4:
        c, s = c.unsqueeze(2), s.unsqueeze(2)
    if inverse:
        s = -s
    out = v.clone()
    out[..., -rd::2] = x0 * c - x1 * s
    out[..., -rd + 1 :: 2] = x0 * s + x1 * c
    return out


def yarn_inv_freq(
    rotary_dim: int,
    theta: float,
    factor: float = 1.0,
    original_max_position: int = 0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """fp32 inverse frequencies ``theta^(-2i/rotary_dim)``, with frequency-only YaRN when ``factor > 1``.

    YaRN keeps the fast (high-frequency) dimensions, divides the slow ones by
    ``factor`` and blends linearly in between; the blend band is where a
    dimension completes between ``beta_slow`` and ``beta_fast`` rotations over
    ``original_max_position`` tokens.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    if factor <= 1.0:
        return inv_freq

    def dim_of(rotations: float) -> float:
        return rotary_dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(beta_fast)), 0)
    high = min(math.ceil(dim_of(beta_slow)), rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """fp32 angles ``positions x inv_freq``: ``[..., S] -> [..., S, P]``."""
    return positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
