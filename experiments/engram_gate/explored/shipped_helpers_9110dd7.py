"""Frozen copy of the shipped Engram jit helpers at commit 9110dd7, for the explored designs only.

Copied from ``kernels/dsfuse/engram_gate/triton.py`` at commit 9110dd7 (unchanged up to 1f14b2b),
with the leading underscore dropped from the names (``_engram_dweight_kernel`` is
``dweight_kernel``) and the bodies unchanged: the union of what the designs in this folder's
subfolders call (``ahead_backward``, ``cooperative_backward``, ``onepass_backward``,
``split_backward``). The package may change its own helpers; this copy stays as the designs were
last run, so the experiments import no private name of the shipped kernels. Never imported by the
package. A design puts this folder on ``sys.path`` (one line at the top of its module) and imports
from here; a design-specific variant (cooperative's ``backward_shape``) lives in its own folder.
"""

import triton
import triton.language as tl


@triton.jit
def copysign(mag, sign_of):
    """|mag| with the sign bit of ``sign_of`` (so -0.0 counts as negative, like C's copysign)."""
    bits = mag.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return (bits | (sign_of.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def grad_coefficients(b_G, b_gate, b_dot, b_rx, b_rk, clamp, dim: tl.constexpr):
    """Per-stream (a, bx, bk) of the closed-form gradients from G = sum_d dout * value.

    d gate -> d root (sigmoid) -> d dot (signed root; zero where the clamp holds); a scales
    d sum(h * w * k), bx and bk the paths through rx and rk.
    """
    b_droot = b_G * b_gate * (1.0 - b_gate)
    b_abs = tl.abs(b_dot)
    b_ddot = tl.where(b_abs >= clamp, tl.div_rn(b_droot, 2.0 * tl.sqrt_rn(tl.maximum(b_abs, clamp))), 0.0)
    inv_sqrt_dim = tl.div_rn(1.0, tl.sqrt_rn(tl.full((), dim, tl.float32)))
    return b_ddot * b_rx * b_rk * inv_sqrt_dim, b_ddot * b_dot * b_rx * b_rx / dim, b_ddot * b_dot * b_rk * b_rk / dim


@triton.jit
def grad_tile(b_do, b_h, b_k, b_w, b_a, b_bx, b_bk):
    """dx and key gradients of a tile, and its weight-gradient term a * h * k (the per-stream
    coefficients come shaped to broadcast against the tile)."""
    b_dh = b_do + b_a * b_w * b_k - b_bx * b_h
    b_dk = b_a * b_w * b_h - b_bk * b_k
    return b_dh, b_dk, b_a * b_h * b_k


@triton.jit
def tile_token(i_n, dout_ptr, x_ptr, kv_ptr, dx_ptr, dkv_ptr, sdo_n, sx_n, skv_n, sdx_n, sdkv_n, o_sd, m_sd,
               b_w, b_a, b_bx, b_bk):
    """Token ``i_n``'s ``[S, chunk]`` tile at offsets ``o_sd``: reads dout, x and the key, writes dx and
    the key gradients from the per-stream coefficients; returns the tile's weight-gradient term."""
    b_do = tl.load(dout_ptr + i_n * sdo_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
    b_h = tl.load(x_ptr + i_n * sx_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
    b_k = tl.load(kv_ptr + i_n * skv_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
    b_dh, b_dk, b_dw_n = grad_tile(b_do, b_h, b_k, b_w, b_a[:, None], b_bx[:, None], b_bk[:, None])
    tl.store(dx_ptr + i_n * sdx_n + o_sd, b_dh.to(dx_ptr.dtype.element_ty), mask=m_sd)
    tl.store(dkv_ptr + i_n * sdkv_n + o_sd, b_dk.to(dkv_ptr.dtype.element_ty), mask=m_sd)
    return b_dw_n


@triton.jit
def token_coefficients(i_n, dout_ptr, kv_ptr, saved_ptr, dkv_ptr, clamp, sdo_n, skv_n, sdkv_n,
                       dim: tl.constexpr, STREAMS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token ``i_n``: one pass over its dout and value rows writes the value gradient
    ``sum_s gate_s * dout_s`` and gives ``G = sum_d dout * value``; returns (a, bx, bk) per stream."""
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
    b_dot = tl.load(p_saved + 1, mask=m_s, other=0.0)
    b_rx = tl.load(p_saved + 2, mask=m_s, other=0.0)
    b_rk = tl.load(p_saved + 3, mask=m_s, other=0.0)
    return grad_coefficients(tl.sum(b_g_acc, 1), b_gate, b_dot, b_rx, b_rk, clamp, dim)


@triton.jit
def tree_sum(ws_ptr, dw_ptr, n_parts, n_cols, BLOCK_P: tl.constexpr, BLOCK: tl.constexpr):
    """This program's ``BLOCK`` columns of the dWeight sum (the body of ``dweight_kernel``)."""
    o_p = tl.arange(0, BLOCK_P)
    o_c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_c = o_c < n_cols
    b_ws = tl.load(ws_ptr + o_p[:, None].to(tl.int64) * n_cols + o_c[None, :],
                   mask=(o_p < n_parts)[:, None] & m_c[None, :], other=0.0)
    tl.store(dw_ptr + o_c, tl.sum(b_ws, 0), mask=m_c)


@triton.jit(do_not_specialize=["n_parts"])
def dweight_kernel(ws_ptr, dw_ptr, n_parts, n_cols, BLOCK_P: tl.constexpr, BLOCK: tl.constexpr):
    """dweight[c] = sum over the partials ws[p, c], p < n_parts, as one fixed-shape tree."""
    tree_sum(ws_ptr, dw_ptr, n_parts, n_cols, BLOCK_P, BLOCK)


def pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
