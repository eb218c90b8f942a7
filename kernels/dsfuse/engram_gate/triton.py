"""Triton kernels of the Engram gate: forward with saved state, backward with packed dKV and dWeight.

Logical layouts: ``x``/``out``/``dout``/``dx`` ``[N, S, D]`` with contiguous rows
(row stride free, stream stride ``D``, channel stride 1); ``kv``/``dkv``
``[N, (S + 1) * D]`` (the S keys, then the value; row stride free); ``weight``
fp32 ``[S, D]`` contiguous; ``token_mask`` bool ``[N]``; ``saved`` fp32
``[N, S, 4]`` = (gate, dot, rx, rk).

Forward: one program per token; a first pass over D accumulates sum(h^2),
sum(k^2) and sum(h * w * k) per stream, a second writes ``h + gate * value``.
Backward: a fixed number of programs (``min(N, MAX_PROGRAMS)``, independent of
the device) each take tokens ``p, p + P, p + 2P, ...``; per token a first pass
reduces ``sum(dout * value)``, a second writes dx, the key and value gradients
and adds ``a * h * k`` into the program's own fp32 dWeight partial; a second
kernel sums the partials in program order. No atomics: bitwise reproducible.
All math in fp32 (reductions in tree order within a D chunk, chunks in order).
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsfuse._common import check_no_overlap

BLOCK_D = 512
MAX_PROGRAMS = 264  # backward programs: 2 per SM on a 132-SM H200, fixed so results never depend on the GPU
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
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < STREAMS
    b_hh = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    b_kk = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    b_hwk = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m_sd = m_s[:, None] & (o_d < dim)[None, :]
        o_sd = o_s[:, None] * dim + o_d[None, :]
        # [BLOCK_S, BLOCK_D] stream rows of x, the keys, the gate weight
        b_h = tl.load(x_ptr + i_n * sx_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
        b_k = tl.load(kv_ptr + i_n * skv_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
        b_w = tl.load(w_ptr + o_sd, mask=m_sd, other=0.0)
        b_hh += b_h * b_h
        b_kk += b_k * b_k
        b_hwk += b_h * b_w * b_k
    b_rx = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(b_hh, 1) / dim + eps))  # [BLOCK_S]
    b_rk = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(b_kk, 1) / dim + eps))
    b_dot = tl.sum(b_hwk, 1) * b_rx * b_rk * tl.div_rn(1.0, tl.sqrt_rn(tl.full((), dim, tl.float32)))
    b_root = _copysign(tl.sqrt_rn(tl.maximum(tl.abs(b_dot), clamp)), b_dot)
    b_gate = tl.div_rn(1.0, 1.0 + tl.exp(-b_root))
    keep = tl.load(mask_ptr + i_n).to(tl.int1)
    b_gate = tl.where(keep, b_gate, 0.0)
    p_saved = saved_ptr + i_n * STREAMS * 4 + o_s * 4
    tl.store(p_saved, b_gate, mask=m_s)
    tl.store(p_saved + 1, b_dot, mask=m_s)
    tl.store(p_saved + 2, b_rx, mask=m_s)
    tl.store(p_saved + 3, b_rk, mask=m_s)
    for d0 in range(0, dim, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m_d = o_d < dim
        m_sd = m_s[:, None] & m_d[None, :]
        o_sd = o_s[:, None] * dim + o_d[None, :]
        b_h = tl.load(x_ptr + i_n * sx_n + o_sd, mask=m_sd).to(tl.float32)
        b_v = tl.load(kv_ptr + i_n * skv_n + STREAMS * dim + o_d, mask=m_d).to(tl.float32)  # [BLOCK_D]
        b_out = b_h + b_gate[:, None] * b_v[None, :]
        tl.store(out_ptr + i_n * so_n + o_sd, b_out.to(out_ptr.dtype.element_ty), mask=m_sd)


@triton.jit(do_not_specialize=["n_tokens"])  # any N reuses one compiled kernel (prepared plans never JIT)
def _engram_bwd_kernel(
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
    p_ws = ws_ptr + i_p.to(tl.int64) * STREAMS * dim  # this program's dWeight partial [S, D]
    for d0 in range(0, dim, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m_sd = m_s[:, None] & (o_d < dim)[None, :]
        tl.store(p_ws + o_s[:, None] * dim + o_d[None, :], tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32), mask=m_sd)
    inv_sqrt_dim = tl.div_rn(1.0, tl.sqrt_rn(tl.full((), dim, tl.float32)))
    i_n32 = i_p
    while i_n32 < n_tokens:  # tokens p, p + P, ... (a while loop: runtime bounds, also in the interpreter)
        i_n = i_n32.to(tl.int64)
        i_n32 += n_programs
        # pass 1: G = sum_d dout * value, per stream
        b_g_acc = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
        for d0 in range(0, dim, BLOCK_D):
            o_d = d0 + tl.arange(0, BLOCK_D)
            m_d = o_d < dim
            m_sd = m_s[:, None] & m_d[None, :]
            b_do = tl.load(dout_ptr + i_n * sdo_n + o_s[:, None] * dim + o_d[None, :], mask=m_sd, other=0.0)
            b_v = tl.load(kv_ptr + i_n * skv_n + STREAMS * dim + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_g_acc += b_do.to(tl.float32) * b_v[None, :]
        b_G = tl.sum(b_g_acc, 1)  # [BLOCK_S]
        p_saved = saved_ptr + i_n * STREAMS * 4 + o_s * 4
        b_gate = tl.load(p_saved, mask=m_s, other=0.0)
        b_dot = tl.load(p_saved + 1, mask=m_s, other=0.0)
        b_rx = tl.load(p_saved + 2, mask=m_s, other=0.0)
        b_rk = tl.load(p_saved + 3, mask=m_s, other=0.0)
        # d gate -> d root (sigmoid) -> d dot (signed root; zero where the clamp holds)
        b_droot = b_G * b_gate * (1.0 - b_gate)
        b_abs = tl.abs(b_dot)
        b_ddot = tl.where(b_abs >= clamp, tl.div_rn(b_droot, 2.0 * tl.sqrt_rn(tl.maximum(b_abs, clamp))), 0.0)
        b_a = b_ddot * b_rx * b_rk * inv_sqrt_dim  # d sum(h * w * k)
        b_bx = b_ddot * b_dot * b_rx * b_rx / dim  # through rx
        b_bk = b_ddot * b_dot * b_rk * b_rk / dim  # through rk
        # pass 2: dx, dkey, dvalue, and the dWeight partial
        for d0 in range(0, dim, BLOCK_D):
            o_d = d0 + tl.arange(0, BLOCK_D)
            m_d = o_d < dim
            m_sd = m_s[:, None] & m_d[None, :]
            o_sd = o_s[:, None] * dim + o_d[None, :]
            b_do = tl.load(dout_ptr + i_n * sdo_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
            b_h = tl.load(x_ptr + i_n * sx_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
            b_k = tl.load(kv_ptr + i_n * skv_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
            b_w = tl.load(w_ptr + o_sd, mask=m_sd, other=0.0)
            b_dh = b_do + b_a[:, None] * b_w * b_k - b_bx[:, None] * b_h
            b_dk = b_a[:, None] * b_w * b_h - b_bk[:, None] * b_k
            b_dv = tl.sum(b_gate[:, None] * b_do, 0)  # [BLOCK_D]
            tl.store(dx_ptr + i_n * sdx_n + o_sd, b_dh.to(dx_ptr.dtype.element_ty), mask=m_sd)
            tl.store(dkv_ptr + i_n * sdkv_n + o_sd, b_dk.to(dkv_ptr.dtype.element_ty), mask=m_sd)
            tl.store(dkv_ptr + i_n * sdkv_n + STREAMS * dim + o_d, b_dv.to(dkv_ptr.dtype.element_ty), mask=m_d)
            p_part = p_ws + o_sd
            tl.store(p_part, tl.load(p_part, mask=m_sd) + b_a[:, None] * b_h * b_k, mask=m_sd)


@triton.jit(do_not_specialize=["n_parts"])
def _engram_dweight_kernel(ws_ptr, dw_ptr, n_parts, n_cols, BLOCK: tl.constexpr):
    """dweight[c] = sum over partials p = 0, 1, ... of ws[p, c] (fixed order)."""
    o_c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_c = o_c < n_cols
    b_acc = tl.zeros((BLOCK,), dtype=tl.float32)
    p = 0
    while p < n_parts:
        b_acc += tl.load(ws_ptr + p.to(tl.int64) * n_cols + o_c, mask=m_c, other=0.0)
        p += 1
    tl.store(dw_ptr + o_c, b_acc, mask=m_c)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def backward_programs(n_tokens: int) -> int:
    """Programs of the backward (and rows of its dWeight workspace) for ``n_tokens``."""
    return max(1, min(n_tokens, MAX_PROGRAMS))


def launch_forward(x, kv, weight, token_mask, out, saved, *, eps: float, clamp: float) -> None:
    check_no_overlap({"out": out, "saved": saved}, {"x": x, "kv": kv, "weight": weight, "token_mask": token_mask})
    n, streams, dim = x.shape
    if n == 0:
        return
    _engram_fwd_kernel[(n,)](
        x, kv, weight, token_mask, out, saved,
        eps, clamp,
        x.stride(0), kv.stride(0), out.stride(0),
        dim=dim, STREAMS=streams, BLOCK_S=_pow2(streams), BLOCK_D=min(BLOCK_D, _pow2(dim)),
        num_warps=NUM_WARPS,
    )


def launch_backward(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, *, clamp: float) -> None:
    """``workspace`` fp32 with at least ``backward_programs(N) * S * D`` elements (overwritten)."""
    check_no_overlap({"dx": dx, "dkv": dkv, "dweight": dweight, "workspace": workspace},
                     {"dout": dout, "x": x, "kv": kv, "weight": weight, "saved": saved})
    n, streams, dim = x.shape
    if n == 0:
        dweight.zero_()
        return
    programs = backward_programs(n)
    _engram_bwd_kernel[(programs,)](
        dout, x, kv, weight, saved, dx, dkv, workspace,
        n, clamp,
        dout.stride(0), x.stride(0), kv.stride(0), dx.stride(0), dkv.stride(0),
        dim=dim, STREAMS=streams, BLOCK_S=_pow2(streams), BLOCK_D=min(BLOCK_D, _pow2(dim)),
        num_warps=NUM_WARPS,
    )
    cols = streams * dim
    block = 1024
    _engram_dweight_kernel[(triton.cdiv(cols, block),)](workspace, dweight, programs, cols, BLOCK=block,
                                                        num_warps=NUM_WARPS)


def _aot_specs() -> list:
    """The model's specialisations: S = 4 streams of D = 5120, bf16, contiguous rows."""
    from dsfuse._common.aot import AotSpec

    opts = {"num_warps": NUM_WARPS}
    fwd = AotSpec(
        name="engram_fwd_bf16", kernel=_engram_fwd_kernel,
        signature={"x_ptr": "*bf16", "kv_ptr": "*bf16", "w_ptr": "*fp32", "mask_ptr": "*i1", "out_ptr": "*bf16",
                   "saved_ptr": "*fp32", "eps": "fp32", "clamp": "fp32", "sx_n": "i32", "skv_n": "i32",
                   "so_n": "i32"},
        constexprs=dict(dim=5120, STREAMS=4, BLOCK_S=4, BLOCK_D=BLOCK_D), options=opts,
        divisible_by_16=("x_ptr", "kv_ptr", "w_ptr", "mask_ptr", "out_ptr", "saved_ptr", "sx_n", "skv_n", "so_n"),
    )
    bwd = AotSpec(
        name="engram_bwd_bf16", kernel=_engram_bwd_kernel,
        signature={"dout_ptr": "*bf16", "x_ptr": "*bf16", "kv_ptr": "*bf16", "w_ptr": "*fp32", "saved_ptr": "*fp32",
                   "dx_ptr": "*bf16", "dkv_ptr": "*bf16", "ws_ptr": "*fp32", "n_tokens": "i32", "clamp": "fp32",
                   "sdo_n": "i32", "sx_n": "i32", "skv_n": "i32", "sdx_n": "i32", "sdkv_n": "i32"},
        constexprs=dict(dim=5120, STREAMS=4, BLOCK_S=4, BLOCK_D=BLOCK_D), options=opts,
        divisible_by_16=("dout_ptr", "x_ptr", "kv_ptr", "w_ptr", "saved_ptr", "dx_ptr", "dkv_ptr", "ws_ptr",
                         "sdo_n", "sx_n", "skv_n", "sdx_n", "sdkv_n"),
    )
    dweight = AotSpec(
        name="engram_dweight", kernel=_engram_dweight_kernel,
        signature={"ws_ptr": "*fp32", "dw_ptr": "*fp32", "n_parts": "i32", "n_cols": "i32"},
        constexprs=dict(BLOCK=1024), options=opts, divisible_by_16=("ws_ptr", "dw_ptr", "n_cols"),
    )
    return [fwd, bwd, dweight]


AOT_SPECS = _aot_specs()
