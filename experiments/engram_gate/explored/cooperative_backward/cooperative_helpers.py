"""Frozen snapshot of the shipped Engram jit helpers that the cooperative backward (``cooperative_backward.py``) uses.

Copied from ``kernels/dsfuse/engram_gate/triton.py`` at commit 9110dd7 (unchanged up to 1f14b2b),
with the leading underscore dropped from the names and the bodies unchanged.
``backward_shape`` keeps the launchers' D limit but not their overlap check (that one lives in
the package's private ``dsfuse._common``). The
package may change its own helpers; this copy stays as the design was last run, so the experiment
imports no private name of the shipped kernels (and the package never imports this folder).
"""

import triton
import triton.language as tl

MAX_DIM = 16384  # the shipped kernels' limit of channels per row


def pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def backward_shape(dout, x, kv, weight, saved, dx, dkv, dweight, workspace) -> tuple[int, int, int]:
    """``(N, S, D)`` with D within the limit (the shipped launchers' check, less its test that no output
    overlaps an input: that one lives in the package's private ``_common``)."""
    n, streams, dim = x.shape
    if dim > MAX_DIM:
        raise ValueError(f"x: D = {dim} is above the fused kernels' limit of {MAX_DIM} channels per row")
    return n, streams, dim


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
