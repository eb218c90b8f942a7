"""The previous shipped Engram backward (two streaming kernels), kept as an experiment.

It reads ``dout`` twice: a per-token kernel reduces ``G = sum_d dout * value`` per stream,
writes the value gradient and the per-(token, stream) coefficients; a D-tiled kernel over
token groups reads dout again with x and the key for dx, the key gradients and register
dWeight partials. ``experiments/engram_gate/tune_backward.py`` times it against the shipped
backward (dsfuse/engram_gate/triton.py), which reads each operand once.
"""

import triton
import triton.language as tl

from dsfuse.engram_gate.triton import _engram_dweight_kernel, _grad_coefficients, _grad_tile, _pow2

COEF_BLOCK_D, COEF_WARPS, TILE_BLOCK_D, TILE_WARPS, GROUPS = 2048, 4, 256, 4, 32  # its tuned constants


@triton.jit
def _engram_bwd_coef_kernel(
    dout_ptr, kv_ptr, saved_ptr, dkv_ptr, coef_ptr,
    clamp,
    sdo_n, skv_n, sdkv_n,
    dim: tl.constexpr,
    STREAMS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Per token: the value gradient, and (a, bx, bk) per stream into ``coef`` ``[N, S, 4]``."""
    i_n = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < STREAMS
    p_saved = saved_ptr + i_n * STREAMS * 4 + o_s * 4
    b_gate = tl.load(p_saved, mask=m_s, other=0.0)
    b_g_acc = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m_d = o_d < dim
        b_do = tl.load(dout_ptr + i_n * sdo_n + o_s[:, None] * dim + o_d[None, :], mask=m_s[:, None] & m_d[None, :],
                       other=0.0).to(tl.float32)
        b_v = tl.load(kv_ptr + i_n * skv_n + STREAMS * dim + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_g_acc += b_do * b_v[None, :]
        b_dv = tl.sum(b_gate[:, None] * b_do, 0)  # [BLOCK_D]
        tl.store(dkv_ptr + i_n * sdkv_n + STREAMS * dim + o_d, b_dv.to(dkv_ptr.dtype.element_ty), mask=m_d)
    b_G = tl.sum(b_g_acc, 1)  # [BLOCK_S]
    b_dot = tl.load(p_saved + 1, mask=m_s, other=0.0)
    b_rx = tl.load(p_saved + 2, mask=m_s, other=0.0)
    b_rk = tl.load(p_saved + 3, mask=m_s, other=0.0)
    b_a, b_bx, b_bk = _grad_coefficients(b_G, b_gate, b_dot, b_rx, b_rk, clamp, dim)
    p_coef = coef_ptr + i_n * STREAMS * 4 + o_s * 4
    tl.store(p_coef, b_a, mask=m_s)
    tl.store(p_coef + 1, b_bx, mask=m_s)
    tl.store(p_coef + 2, b_bk, mask=m_s)


@triton.jit(do_not_specialize=["n_tokens"])  # any N reuses one compiled kernel (prepared plans never JIT)
def _engram_bwd_tile_kernel(
    dout_ptr, x_ptr, kv_ptr, w_ptr, coef_ptr, dx_ptr, dkv_ptr, ws_ptr,
    n_tokens,
    sdo_n, sx_n, skv_n, sdx_n, sdkv_n,
    dim: tl.constexpr,
    STREAMS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dx and the key gradients of one D chunk for tokens g, g + G, ...; the group's dWeight partial."""
    i_g = tl.program_id(1)
    n_groups = tl.num_programs(1)
    o_s = tl.arange(0, BLOCK_S)
    o_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_s = o_s < STREAMS
    m_sd = m_s[:, None] & (o_d < dim)[None, :]
    o_sd = o_s[:, None] * dim + o_d[None, :]
    b_w = tl.load(w_ptr + o_sd, mask=m_sd, other=0.0)
    b_dw = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    i_n32 = i_g
    while i_n32 < n_tokens:  # a while loop: runtime bounds, also in the interpreter
        i_n = i_n32.to(tl.int64)
        i_n32 += n_groups
        p_coef = coef_ptr + i_n * STREAMS * 4 + o_s * 4
        b_a = tl.load(p_coef, mask=m_s, other=0.0)
        b_bx = tl.load(p_coef + 1, mask=m_s, other=0.0)
        b_bk = tl.load(p_coef + 2, mask=m_s, other=0.0)
        b_do = tl.load(dout_ptr + i_n * sdo_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
        b_h = tl.load(x_ptr + i_n * sx_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
        b_k = tl.load(kv_ptr + i_n * skv_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
        b_dh, b_dk, b_dw_n = _grad_tile(b_do, b_h, b_k, b_w, b_a[:, None], b_bx[:, None], b_bk[:, None])
        tl.store(dx_ptr + i_n * sdx_n + o_sd, b_dh.to(dx_ptr.dtype.element_ty), mask=m_sd)
        tl.store(dkv_ptr + i_n * sdkv_n + o_sd, b_dk.to(dkv_ptr.dtype.element_ty), mask=m_sd)
        b_dw += b_dw_n
    tl.store(ws_ptr + i_g.to(tl.int64) * STREAMS * dim + o_sd, b_dw, mask=m_sd)


def workspace_elements(n, streams, dim):
    return min(n, GROUPS) * streams * dim + n * streams * 4


def launch(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, *, clamp):
    n, streams, dim = x.shape
    groups = min(n, GROUPS)
    partials, coef = workspace[: groups * streams * dim], workspace[groups * streams * dim:]
    block_s = _pow2(streams)
    _engram_bwd_coef_kernel[(n,)](
        dout, kv, saved, dkv, coef, clamp, dout.stride(0), kv.stride(0), dkv.stride(0),
        dim=dim, STREAMS=streams, BLOCK_S=block_s, BLOCK_D=min(COEF_BLOCK_D, _pow2(dim)), num_warps=COEF_WARPS,
    )
    block_d = min(TILE_BLOCK_D, _pow2(dim))
    _engram_bwd_tile_kernel[(triton.cdiv(dim, block_d), groups)](
        dout, x, kv, weight, coef, dx, dkv, partials, n,
        dout.stride(0), x.stride(0), kv.stride(0), dx.stride(0), dkv.stride(0),
        dim=dim, STREAMS=streams, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=TILE_WARPS,
    )
    cols = streams * dim
    _engram_dweight_kernel[(triton.cdiv(cols, 64),)](partials, dweight, groups, cols, BLOCK_P=_pow2(GROUPS), BLOCK=64,
                                                     num_warps=4)
