"""Chunk-local cumulative gate of Gated DeltaNet: ``g_cum[t] = sum of g over the chunk up to t``.

``g`` fp32 ``[T, HV]`` (log decay, any strides) and the chunk table ``chunk_indices`` int32
``[NC, 3]`` (sequence, start, end; contiguous) give ``g_cum`` fp32 ``[T, HV]``: for each
chunk, ``tl.cumsum`` over its tokens in fp32 (the reference's ``chunk_local_cumsum``). No
log2 scaling: consumers exponentiate differences ``G_i - G_j`` with ``tl.exp``.

One program per (chunk, block of ``BH`` value heads); a chunk's tokens are one ``[BT, BH]``
tile, so a program sums in a fixed order (deterministic) and writes each of its tokens once.
Tokens in no chunk (past ``cu_seqlens[-1]``) are not written.

Rounding: the scan's association order is Triton's (not sequential); every partial sum of
``n <= 64`` terms is within ``(n - 1) * 2^-24 * sum |g|`` of the exact one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsfuse._common.aot import AotSpec, record_specs
from dsfuse.gdn.triton import common

MAX_BH = 64  # value heads per program: one [64, 64] fp32 tile (HV = 48 in one program)
CONFIG = common.LaunchConfig(num_warps=4)  # every GPU family (no sweep recorded)


@triton.jit
def _chunk_cumsum_kernel(
    g_ptr, gc_ptr,  # g and g_cum, fp32, any strides
    ci_ptr,
    n_heads,  # HV
    s_gt, s_gh, s_ct, s_ch,
    BT: tl.constexpr,  # chunk size
    BH: tl.constexpr,  # value heads per program
):
    i_c = tl.program_id(0).to(tl.int64)
    i_hb = tl.program_id(1)
    start, end = common.chunk_span(ci_ptr, i_c)

    o_t = start + tl.arange(0, BT)  # int64 token offsets
    m_t = o_t < end
    o_h = i_hb * BH + tl.arange(0, BH)
    m_h = o_h < n_heads
    m_th = m_t[:, None] & m_h[None, :]
    o_h = o_h.to(tl.int64)

    p_g = g_ptr + o_t[:, None] * s_gt + o_h[None, :] * s_gh
    b_g = tl.load(p_g, mask=m_th, other=0.0).to(tl.float32)  # [BT, BH]
    b_gc = tl.cumsum(b_g, axis=0)  # [BT, BH]
    p_gc = gc_ptr + o_t[:, None] * s_ct + o_h[None, :] * s_ch
    tl.store(p_gc, b_gc, mask=m_th)


def heads_per_program(heads: int) -> int:
    """``BH``: value heads of one program (a power of two, at most ``MAX_BH``)."""
    return min(triton.next_power_of_2(max(heads, 1)), MAX_BH)


def launch_chunk_cumsum(g: torch.Tensor, chunk_indices: torch.Tensor, g_cum: torch.Tensor) -> torch.Tensor:
    """Write the chunk-local cumulative sum of ``g`` ``[T, HV]`` (fp32) into ``g_cum`` ``[T, HV]`` (fp32).

    ``chunk_indices`` int32 ``[NC, 3]`` contiguous, on ``g``'s device (chunks of ``common.CHUNK``
    tokens, each document chunked from its own start). Returns ``g_cum``.
    """
    num_chunks, heads = chunk_indices.shape[0], g.shape[1]
    if num_chunks == 0 or heads == 0:
        return g_cum
    block_h = heads_per_program(heads)
    grid = (num_chunks, triton.cdiv(heads, block_h))
    _chunk_cumsum_kernel[grid](
        g, g_cum, chunk_indices, heads,
        *common.token_head_strides(g, g_cum),
        BT=common.CHUNK, BH=block_h,
        **CONFIG.options(),
    )
    return g_cum


def _aot_specs() -> list[AotSpec]:
    """The model's launch (`common.model_tensors`): HV = 48 value heads, contiguous ``[T, 48]`` fp32 gates
    (head stride 1, a constant at launch)."""
    x = common.model_tensors()
    return record_specs("gdn_chunk_cumsum_hv48", launch_chunk_cumsum, x.g, x.chunk_indices, x.g_cum)


AOT_SPECS = _aot_specs()
