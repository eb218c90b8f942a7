"""A one-pass Engram gate backward, kept as an experiment (not the shipped kernels).

The shipped backward (dsfuse/engram_gate/triton.py) reads ``dout`` twice: once per token
for ``G = sum_d dout * value``, once more in the D-tiled kernel that keeps the weight-gradient
partials in registers. This design reads each operand from HBM once: a fixed number of
persistent programs take tokens ``p, p + P, ...``; per token a first pass over D reduces ``G``
and writes the value gradient, a second pass (``dout`` again, now from L2) writes dx and the
key gradients and read-modify-writes the program's own fp32 ``[S, D]`` weight-gradient
partial (L2-resident); a sequential sum adds the partials. Deterministic for a fixed
``programs``. ``tune_onepass.py`` (this folder) times it against the shipped one: 502 us at best
against 309 us (``experiments/engram_gate/raw/tuning/blocks-bwd-onepass.csv``); see README.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # explored/: the shared snapshot shipped_helpers_9110dd7.py

import triton
import triton.language as tl

from shipped_helpers_9110dd7 import grad_tile, pow2, token_coefficients


@triton.jit(do_not_specialize=["n_tokens"])
def _onepass_bwd_kernel(
    dout_ptr, x_ptr, kv_ptr, w_ptr, saved_ptr, dx_ptr, dkv_ptr, ws_ptr,
    n_tokens, clamp,
    sdo_n, sx_n, skv_n, sdx_n, sdkv_n,
    dim: tl.constexpr,
    STREAMS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_p = tl.program_id(0)
    n_programs = tl.num_programs(0)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < STREAMS
    p_ws = ws_ptr + i_p.to(tl.int64) * STREAMS * dim  # this program's weight-gradient partial [S, D]
    for d0 in range(0, dim, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m_sd = m_s[:, None] & (o_d < dim)[None, :]
        tl.store(p_ws + o_s[:, None] * dim + o_d[None, :], tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32), mask=m_sd)
    i_n32 = i_p
    while i_n32 < n_tokens:
        i_n = i_n32.to(tl.int64)
        i_n32 += n_programs
        # pass 1: G per stream and the value gradient
        b_a, b_bx, b_bk = token_coefficients(i_n, dout_ptr, kv_ptr, saved_ptr, dkv_ptr, clamp, sdo_n, skv_n, sdkv_n,
                                             dim, STREAMS, BLOCK_S, BLOCK_D)
        # pass 2: dx, the key gradients, the partial
        for d0 in range(0, dim, BLOCK_D):
            o_d = d0 + tl.arange(0, BLOCK_D)
            m_sd = m_s[:, None] & (o_d < dim)[None, :]
            o_sd = o_s[:, None] * dim + o_d[None, :]
            b_do = tl.load(dout_ptr + i_n * sdo_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
            b_h = tl.load(x_ptr + i_n * sx_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
            b_k = tl.load(kv_ptr + i_n * skv_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
            b_w = tl.load(w_ptr + o_sd, mask=m_sd, other=0.0)
            b_dh, b_dk, b_dw_n = grad_tile(b_do, b_h, b_k, b_w, b_a[:, None], b_bx[:, None], b_bk[:, None])
            tl.store(dx_ptr + i_n * sdx_n + o_sd, b_dh.to(dx_ptr.dtype.element_ty), mask=m_sd)
            tl.store(dkv_ptr + i_n * sdkv_n + o_sd, b_dk.to(dkv_ptr.dtype.element_ty), mask=m_sd)
            p_part = p_ws + o_sd
            tl.store(p_part, tl.load(p_part, mask=m_sd) + b_dw_n, mask=m_sd)


@triton.jit
def _sum_partials_kernel(ws_ptr, dw_ptr, n_parts, n_cols, BLOCK: tl.constexpr):
    """dweight[c] = sum over partials p = 0, 1, ... of ws[p, c] (fixed order)."""
    o_c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_c = o_c < n_cols
    b_acc = tl.zeros((BLOCK,), dtype=tl.float32)
    p = 0
    while p < n_parts:
        b_acc += tl.load(ws_ptr + p.to(tl.int64) * n_cols + o_c, mask=m_c, other=0.0)
        p += 1
    tl.store(dw_ptr + o_c, b_acc, mask=m_c)


def launch(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, *, clamp, programs, block_d, warps):
    """``workspace`` fp32 with at least ``programs * S * D`` elements."""
    n, streams, dim = x.shape
    programs = min(programs, n)
    _onepass_bwd_kernel[(programs,)](
        dout, x, kv, weight, saved, dx, dkv, workspace,
        n, clamp,
        dout.stride(0), x.stride(0), kv.stride(0), dx.stride(0), dkv.stride(0),
        dim=dim, STREAMS=streams, BLOCK_S=pow2(streams), BLOCK_D=min(block_d, pow2(dim)), num_warps=warps,
    )
    cols = streams * dim
    _sum_partials_kernel[(triton.cdiv(cols, 1024),)](workspace, dweight, programs, cols, BLOCK=1024, num_warps=4)
