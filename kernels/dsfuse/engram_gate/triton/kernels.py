"""Triton kernels of the Engram gate: forward with saved state, backward with packed dKV and dWeight.

Logical layouts: ``x``/``out``/``dout``/``dx`` ``[N, S, D]`` with contiguous rows
(row stride free, stream stride ``D``, channel stride 1); ``kv``/``dkv``
``[N, (S + 1) * D]`` (the S keys, then the value; row stride free); ``weight``
fp32 ``[S, D]`` contiguous; ``token_mask`` bool ``[N]``; ``saved`` fp32
``[N, S, 4]`` = (gate, dot, rx, rk).

Forward: one program per (token, stream) row, the whole row in registers (one
read of x and the key, one write of out; the shared value row is read by the S
programs of a token, which run next to each other, so mostly from L2).

Backward, three kernels, each streaming its operands once:

1. per token: ``G = sum_d dout * value`` per stream and the value gradient
   ``sum_s gate * dout`` (one pass over dout); the per-(token, stream)
   coefficients of the rest go to a small fp32 workspace;
2. per (D chunk, token group): dx and the key gradients from dout, x and the key,
   and the group's dWeight partial accumulated in registers (the weight chunk is
   loaded once per program); groups take tokens ``g, g + G, ...`` counted from the
   last token (kernel 1 read those last, so part of their dout is still in L2), with
   ``G`` a function of N only, never of the device;
3. dWeight = the partials added as one fixed-shape tree.

So dout is read twice; designs that read it once (one cooperative kernel, coefficient
programs running ahead of the tile programs, one pass with partials in L2) measured
slower on the H200: ``experiments/engram_gate/raw/tuning/README.md``. No atomics: bitwise
reproducible. All math in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsfuse._common.launch import Geometry, TritonLaunch, layout_key


MAX_DIM = 16384  # the forward keeps a row of D channels in registers
# Launch constants: the fastest settings of the sweeps on the H200 (experiments/engram_gate/raw/tuning)
FWD_WARPS = 2  # forward: warps per row program for rows of 8192 channels (scaled with the row length)
COEF_BLOCK_D = 2048  # backward kernel 1: channels per step over a token's [S, D] dout
COEF_WARPS = 4
TILE_BLOCK_D = 256  # backward kernel 2: channels per program
TILE_WARPS = 4
GROUPS = 32  # backward kernel 2: token groups (dWeight partials) at most
TILE_REVERSE = True  # backward kernel 2 starts with the tokens whose dout kernel 1 read last
SUM_BLOCK = 64  # backward kernel 3 (the dWeight sum): columns per program
NUM_WARPS = 4


@triton.jit
def _copysign(mag, sign_of):
    """|mag| with the sign bit of ``sign_of`` (so -0.0 counts as negative, like C's copysign)."""
    bits = mag.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return (bits | (sign_of.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _engram_fwd_kernel(
    x_ptr, kv_ptr, w_ptr, mask_ptr, out_ptr, saved_ptr,
    eps, clamp,
    sx_n, skv_n, so_n,
    dim: tl.constexpr,  # D (a model constant: a new D compiles a new kernel)
    STREAMS: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= D
):
    i_row = tl.program_id(0)
    i_n = (i_row // STREAMS).to(tl.int64)
    i_s = i_row % STREAMS
    o_d = tl.arange(0, BLOCK)
    m_d = o_d < dim
    b_h = tl.load(x_ptr + i_n * sx_n + i_s * dim + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_k = tl.load(kv_ptr + i_n * skv_n + i_s * dim + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_w = tl.load(w_ptr + i_s * dim + o_d, mask=m_d, other=0.0)
    b_rx = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(b_h * b_h) / dim + eps))
    b_rk = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(b_k * b_k) / dim + eps))
    b_dot = tl.sum(b_h * b_w * b_k) * b_rx * b_rk * tl.div_rn(1.0, tl.sqrt_rn(tl.full((), dim, tl.float32)))
    b_root = _copysign(tl.sqrt_rn(tl.maximum(tl.abs(b_dot), clamp)), b_dot)
    b_gate = tl.div_rn(1.0, 1.0 + tl.exp(-b_root))
    keep = tl.load(mask_ptr + i_n).to(tl.int1)
    b_gate = tl.where(keep, b_gate, 0.0)
    p_saved = saved_ptr + (i_n * STREAMS + i_s) * 4
    tl.store(p_saved, b_gate)
    tl.store(p_saved + 1, b_dot)
    tl.store(p_saved + 2, b_rx)
    tl.store(p_saved + 3, b_rk)
    b_v = tl.load(kv_ptr + i_n * skv_n + STREAMS * dim + o_d, mask=m_d, other=0.0).to(tl.float32)
    tl.store(out_ptr + i_n * so_n + i_s * dim + o_d, (b_h + b_gate * b_v).to(out_ptr.dtype.element_ty), mask=m_d)


@triton.jit
def _grad_coefficients(b_G, b_gate, b_dot, b_rx, b_rk, clamp, dim: tl.constexpr):
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
def _grad_tile(b_do, b_h, b_k, b_w, b_a, b_bx, b_bk):
    """dx and key gradients of a tile, and its weight-gradient term a * h * k (the per-stream
    coefficients come shaped to broadcast against the tile)."""
    b_dh = b_do + b_a * b_w * b_k - b_bx * b_h
    b_dk = b_a * b_w * b_h - b_bk * b_k
    return b_dh, b_dk, b_a * b_h * b_k


@triton.jit
def _tile_token(i_n, dout_ptr, x_ptr, kv_ptr, dx_ptr, dkv_ptr, sdo_n, sx_n, skv_n, sdx_n, sdkv_n, o_sd, m_sd,
                b_w, b_a, b_bx, b_bk):
    """Token ``i_n``'s ``[S, chunk]`` tile at offsets ``o_sd``: reads dout, x and the key, writes dx and
    the key gradients from the per-stream coefficients; returns the tile's weight-gradient term."""
    b_do = tl.load(dout_ptr + i_n * sdo_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
    b_h = tl.load(x_ptr + i_n * sx_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
    b_k = tl.load(kv_ptr + i_n * skv_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
    b_dh, b_dk, b_dw_n = _grad_tile(b_do, b_h, b_k, b_w, b_a[:, None], b_bx[:, None], b_bk[:, None])
    tl.store(dx_ptr + i_n * sdx_n + o_sd, b_dh.to(dx_ptr.dtype.element_ty), mask=m_sd)
    tl.store(dkv_ptr + i_n * sdkv_n + o_sd, b_dk.to(dkv_ptr.dtype.element_ty), mask=m_sd)
    return b_dw_n


@triton.jit
def _token_coefficients(i_n, dout_ptr, kv_ptr, saved_ptr, dkv_ptr, clamp, sdo_n, skv_n, sdkv_n,
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
    return _grad_coefficients(tl.sum(b_g_acc, 1), b_gate, b_dot, b_rx, b_rk, clamp, dim)


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
    b_a, b_bx, b_bk = _token_coefficients(i_n, dout_ptr, kv_ptr, saved_ptr, dkv_ptr, clamp, sdo_n, skv_n, sdkv_n,
                                          dim, STREAMS, BLOCK_S, BLOCK_D)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < STREAMS
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
    REVERSE: tl.constexpr,  # walk the tokens last to first: kernel 1 read their dout last (some still in L2)
):
    """dx and the key gradients of one D chunk for tokens g, g + G, ... (counted from the end
    when ``REVERSE``); the group's dWeight partial."""
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
        i_n = (n_tokens - 1 - i_n32 if REVERSE else i_n32).to(tl.int64)
        i_n32 += n_groups
        p_coef = coef_ptr + i_n * STREAMS * 4 + o_s * 4
        b_a = tl.load(p_coef, mask=m_s, other=0.0)
        b_bx = tl.load(p_coef + 1, mask=m_s, other=0.0)
        b_bk = tl.load(p_coef + 2, mask=m_s, other=0.0)
        b_dw += _tile_token(i_n, dout_ptr, x_ptr, kv_ptr, dx_ptr, dkv_ptr, sdo_n, sx_n, skv_n, sdx_n, sdkv_n,
                            o_sd, m_sd, b_w, b_a, b_bx, b_bk)
    tl.store(ws_ptr + i_g.to(tl.int64) * STREAMS * dim + o_sd, b_dw, mask=m_sd)


@triton.jit
def _tree_sum(ws_ptr, dw_ptr, n_parts, n_cols, BLOCK_P: tl.constexpr, BLOCK: tl.constexpr):
    """This program's ``BLOCK`` columns of the dWeight sum (the body of ``_engram_dweight_kernel``)."""
    o_p = tl.arange(0, BLOCK_P)
    o_c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_c = o_c < n_cols
    b_ws = tl.load(ws_ptr + o_p[:, None].to(tl.int64) * n_cols + o_c[None, :],
                   mask=(o_p < n_parts)[:, None] & m_c[None, :], other=0.0)
    tl.store(dw_ptr + o_c, tl.sum(b_ws, 0), mask=m_c)


@triton.jit(do_not_specialize=["n_parts"])
def _engram_dweight_kernel(ws_ptr, dw_ptr, n_parts, n_cols, BLOCK_P: tl.constexpr, BLOCK: tl.constexpr):
    """dweight[c] = sum over the partials ws[p, c], p < n_parts, as one fixed-shape tree."""
    _tree_sum(ws_ptr, dw_ptr, n_parts, n_cols, BLOCK_P, BLOCK)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def token_groups(n_tokens: int) -> int:
    """dWeight partials of the backward for ``n_tokens`` (a function of N only: reproducible anywhere)."""
    return max(1, min(n_tokens, GROUPS))


def workspace_elements(n_tokens: int, streams: int, dim: int) -> int:
    """fp32 elements of the backward workspace: the dWeight partials, then ``[N, S, 4]`` coefficients."""
    return token_groups(n_tokens) * streams * dim + n_tokens * streams * 4


def _fwd_warps(block: int) -> int:
    return max(1, min(FWD_WARPS * block // 8192, 16))


def check_dim(dim: int) -> None:
    if dim > MAX_DIM:
        raise ValueError(f"x: D = {dim} is above the fused kernels' limit of {MAX_DIM} channels per row")


def _forward_geometry(x, kv, out, eps: float, clamp: float) -> Geometry:
    n, streams, dim = x.shape
    block = _pow2(dim)
    return Geometry((n * streams,), (eps, clamp, x.stride(0), kv.stride(0), out.stride(0)),
                    dict(dim=dim, STREAMS=streams, BLOCK=block, num_warps=_fwd_warps(block)))


_FORWARD = TritonLaunch(_engram_fwd_kernel)


def launch_forward(x, kv, weight, token_mask, out, saved, *, eps: float, clamp: float) -> None:
    """Arguments validated by the caller (the public API or the plan), aliasing included."""
    check_dim(x.shape[2])
    if x.shape[0] == 0:
        return
    tensors = (x, kv, weight, token_mask, out, saved)
    _FORWARD((eps, clamp, *layout_key(*tensors)), tensors, lambda: _forward_geometry(x, kv, out, eps, clamp))


def launch_backward(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, *, clamp: float) -> None:
    """``workspace`` fp32 contiguous with at least ``workspace_elements(N, S, D)`` elements (overwritten).

    Arguments validated by the caller (the public API or the plan), aliasing included.
    """
    n, streams, dim = x.shape
    check_dim(dim)
    if n == 0:
        dweight.zero_()
        return
    groups = token_groups(n)
    partials, coef = workspace[: groups * streams * dim], workspace[groups * streams * dim:]
    block_s = _pow2(streams)
    _engram_bwd_coef_kernel[(n,)](
        dout, kv, saved, dkv, coef,
        clamp,
        dout.stride(0), kv.stride(0), dkv.stride(0),
        dim=dim, STREAMS=streams, BLOCK_S=block_s, BLOCK_D=min(COEF_BLOCK_D, _pow2(dim)), num_warps=COEF_WARPS,
    )
    block_d = min(TILE_BLOCK_D, _pow2(dim))
    _engram_bwd_tile_kernel[(triton.cdiv(dim, block_d), groups)](
        dout, x, kv, weight, coef, dx, dkv, partials,
        n,
        dout.stride(0), x.stride(0), kv.stride(0), dx.stride(0), dkv.stride(0),
        dim=dim, STREAMS=streams, BLOCK_S=block_s, BLOCK_D=block_d, REVERSE=TILE_REVERSE, num_warps=TILE_WARPS,
    )
    cols = streams * dim
    _engram_dweight_kernel[(triton.cdiv(cols, SUM_BLOCK),)](partials, dweight, groups, cols, BLOCK_P=_pow2(GROUPS),
                                                            BLOCK=SUM_BLOCK, num_warps=NUM_WARPS)


def _aot_specs() -> list:
    """The model's specialisations (N = 4096 tokens, S = 4 streams of D = 5120, bf16, contiguous rows),
    recorded from the launchers on meta tensors."""
    import torch

    from dsfuse._common.aot import record_specs

    n, streams, dim = 4096, 4, 5120
    x = torch.empty(n, streams, dim, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(n, (streams + 1) * dim, device="meta", dtype=torch.bfloat16)
    weight = torch.empty(streams, dim, device="meta")
    mask = torch.empty(n, device="meta", dtype=torch.bool)
    saved = torch.empty(n, streams, 4, device="meta")
    workspace = torch.empty(workspace_elements(n, streams, dim), device="meta")
    return (record_specs("engram_fwd_bf16", launch_forward, x, kv, weight, mask, torch.empty_like(x), saved,
                         eps=1e-20, clamp=1e-6)
            + record_specs(["engram_bwd_coef_bf16", "engram_bwd_tile_bf16", "engram_dweight"], launch_backward,
                           torch.empty_like(x), x, kv, weight, saved, torch.empty_like(x), torch.empty_like(kv),
                           torch.empty_like(weight), workspace, clamp=1e-6))


AOT_SPECS = _aot_specs()
