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
   loaded once per program); groups take tokens ``g, g + G, ...`` with ``G`` a
   function of N only, never of the device;
3. dWeight = the partials summed in group order.

No atomics: bitwise reproducible. All math in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsfuse._common import check_no_overlap

MAX_DIM = 16384  # the forward keeps a row of D channels in registers
# Launch constants: the fastest settings of the sweeps on the H200 (experiments/engram_gate/raw/tuning)
FWD_WARPS = 4  # forward: warps per row program for rows of 8192 channels (scaled with the row length)
BWD_BLOCK_D = 256  # backward: channels per program (a token's chunks run as that many programs)
BWD_TOKENS = 4  # backward: tokens per block (a power of two)
BWD_WARPS = 4
LOOKAHEAD = 2  # backward: blocks between publishing a block's chunk sums and using them
GROUPS = 32  # backward: token groups (dWeight partials) at most
SUM_BLOCK = 64  # the dWeight sum: columns per program
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


@triton.jit(do_not_specialize=["n_tokens", "n_groups"])  # any N reuses one compiled kernel
def _engram_bwd_kernel(
    dout_ptr, x_ptr, kv_ptr, w_ptr, saved_ptr, dx_ptr, dkv_ptr,
    gpart_ptr,  # fp32 [blocks * TOKENS, N_CHUNKS, S]: sum_d dout * value over each chunk
    dwp_ptr,  # fp32 [n_groups, S, D]: the groups' dWeight partials
    sync_ptr,  # int32 [1 + blocks], zero at launch: the ticket, then per token block the chunks published
    n_tokens, n_groups, clamp,
    sdo_n, sx_n, skv_n, sdx_n, sdkv_n,
    dim: tl.constexpr,
    STREAMS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    N_CHUNKS: tl.constexpr,  # cdiv(D, BLOCK_D)
    BLOCK_C: tl.constexpr,  # next power of two >= N_CHUNKS
    TOKENS: tl.constexpr,  # tokens per block (a power of two)
    CHUNKS_PER_PROGRAM: tl.constexpr,  # 1 on a GPU; N_CHUNKS in the interpreter (programs run one by one)
    LOOKAHEAD: tl.constexpr,  # blocks between publishing a block's chunk sums and using its totals
):
    """Programs ``(chunk, group)`` walk the group's token blocks ``g, g + G, ...``. Step ``j``
    reduces block ``j``'s chunk of ``sum_d dout * value`` per token and stream, writes its
    value gradient and publishes the sums (a counter per block); it then finishes block
    ``j - LOOKAHEAD``: waits until all chunks of that block are published, adds them in
    chunk order, and writes dx and the key gradients from dout (read again, from L2), x and
    the key, keeping the chunk's dWeight partial in registers. Every operand comes from HBM
    once; the only cross-program traffic is [TOKENS, S] floats per chunk and block.
    """
    ticket = tl.atomic_add(sync_ptr, 1)  # roles in ticket order: a group's programs are always started together
    programs_per_group: tl.constexpr = N_CHUNKS // CHUNKS_PER_PROGRAM
    i_g = ticket // programs_per_group
    c0 = (ticket % programs_per_group) * CHUNKS_PER_PROGRAM
    n_steps = (tl.cdiv(n_tokens, TOKENS) - i_g + n_groups - 1) // n_groups
    o_t = tl.arange(0, TOKENS)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < STREAMS
    o_c = tl.arange(0, BLOCK_C)
    o_ts = o_t[:, None] * STREAMS + o_s[None, :]  # [T, S] offsets of per-(token, stream) rows
    o_tcs = o_t[:, None, None] * (N_CHUNKS * STREAMS) + o_c[None, :, None] * STREAMS + o_s[None, None, :]
    p_cnt = sync_ptr + 1
    # the dWeight partial: registers for one chunk; this group's slot in dwp (read-modify-write) for several
    b_dw = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    o_dw = c0 * BLOCK_D + tl.arange(0, BLOCK_D)
    m_dw = m_s[:, None] & (o_dw < dim)[None, :]
    p_dw = dwp_ptr + i_g.to(tl.int64) * STREAMS * dim + o_s[:, None] * dim + o_dw[None, :]
    if CHUNKS_PER_PROGRAM == 1:
        b_w = tl.load(w_ptr + o_s[:, None] * dim + o_dw[None, :], mask=m_dw, other=0.0)[None, :, :]
    else:
        for cc in range(CHUNKS_PER_PROGRAM):
            tl.store(p_dw + cc * BLOCK_D, b_dw, mask=m_dw & (o_dw + cc * BLOCK_D < dim)[None, :])
    j = 0
    while j < n_steps + LOOKAHEAD:
        if j < n_steps:  # publish block j
            i_b = i_g + j * n_groups
            i_n = i_b.to(tl.int64) * TOKENS + o_t  # [T]
            m_t = i_n < n_tokens
            b_gate = tl.load(saved_ptr + (i_n[:, None] * STREAMS + o_s[None, :]) * 4,
                             mask=m_t[:, None] & m_s[None, :], other=0.0)
            for cc in range(CHUNKS_PER_PROGRAM):
                o_d = (c0 + cc) * BLOCK_D + tl.arange(0, BLOCK_D)
                m_d = o_d < dim
                m_tsd = (m_t[:, None] & m_s[None, :])[:, :, None] & m_d[None, None, :]
                b_do = tl.load(dout_ptr + i_n[:, None, None] * sdo_n + o_s[None, :, None] * dim + o_d[None, None, :],
                               mask=m_tsd, other=0.0).to(tl.float32)
                b_v = tl.load(kv_ptr + i_n[:, None] * skv_n + STREAMS * dim + o_d[None, :],
                              mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32)
                tl.store(gpart_ptr + i_b.to(tl.int64) * TOKENS * N_CHUNKS * STREAMS + (c0 + cc) * STREAMS + o_t[:, None]
                         * (N_CHUNKS * STREAMS) + o_s[None, :], tl.sum(b_do * b_v[:, None, :], 2),
                         mask=m_s[None, :])
                b_dv = tl.sum(b_gate[:, :, None] * b_do, 1)  # [T, BLOCK_D]
                tl.store(dkv_ptr + i_n[:, None] * sdkv_n + STREAMS * dim + o_d[None, :],
                         b_dv.to(dkv_ptr.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])
                tl.debug_barrier()  # every thread's sums are stored before the count says so
                tl.atomic_add(p_cnt + i_b, 1, sem="release", scope="gpu")
        if j >= LOOKAHEAD:  # finish block j - LOOKAHEAD
            i_b = i_g + (j - LOOKAHEAD) * n_groups
            i_m = i_b.to(tl.int64) * TOKENS + o_t
            m_ts = (i_m < n_tokens)[:, None] & m_s[None, :]
            p_saved = saved_ptr + (i_m[:, None] * STREAMS + o_s[None, :]) * 4
            b_gate = tl.load(p_saved, mask=m_ts, other=0.0)
            b_dot = tl.load(p_saved + 1, mask=m_ts, other=0.0)
            b_rx = tl.load(p_saved + 2, mask=m_ts, other=0.0)
            b_rk = tl.load(p_saved + 3, mask=m_ts, other=0.0)
            for cc in range(CHUNKS_PER_PROGRAM):
                o_d = (c0 + cc) * BLOCK_D + tl.arange(0, BLOCK_D)
                m_tsd = m_ts[:, :, None] & (o_d < dim)[None, None, :]
                o_sd = o_s[None, :, None] * dim + o_d[None, None, :]
                # issued before the wait: these loads do not depend on the other programs
                b_do = tl.load(dout_ptr + i_m[:, None, None] * sdo_n + o_sd, mask=m_tsd, other=0.0).to(tl.float32)
                b_h = tl.load(x_ptr + i_m[:, None, None] * sx_n + o_sd, mask=m_tsd, other=0.0).to(tl.float32)
                b_k = tl.load(kv_ptr + i_m[:, None, None] * skv_n + o_sd, mask=m_tsd, other=0.0).to(tl.float32)
                while tl.atomic_add(p_cnt + i_b, 0, sem="acquire", scope="gpu") < N_CHUNKS:
                    pass
                b_gp = tl.load(gpart_ptr + i_b.to(tl.int64) * TOKENS * N_CHUNKS * STREAMS + o_tcs,
                               mask=(o_c < N_CHUNKS)[None, :, None] & m_s[None, None, :], other=0.0,
                               cache_modifier=".cg")  # written by other SMs: read from L2
                b_a, b_bx, b_bk = _grad_coefficients(tl.sum(b_gp, 1), b_gate, b_dot, b_rx, b_rk, clamp, dim)
                if CHUNKS_PER_PROGRAM == 1:
                    b_dh, b_dk, b_dw_n = _grad_tile(b_do, b_h, b_k, b_w, b_a[:, :, None], b_bx[:, :, None],
                                                    b_bk[:, :, None])
                    b_dw += tl.sum(b_dw_n, 0)
                else:
                    b_wc = tl.load(w_ptr + o_s[:, None] * dim + o_d[None, :], mask=m_s[:, None] & (o_d < dim)[None, :],
                                   other=0.0)
                    b_dh, b_dk, b_dw_n = _grad_tile(b_do, b_h, b_k, b_wc[None, :, :], b_a[:, :, None],
                                                    b_bx[:, :, None], b_bk[:, :, None])
                    m_sd = m_s[:, None] & (o_d < dim)[None, :]
                    tl.store(p_dw + cc * BLOCK_D, tl.load(p_dw + cc * BLOCK_D, mask=m_sd, other=0.0) + tl.sum(b_dw_n, 0),
                             mask=m_sd)
                tl.store(dx_ptr + i_m[:, None, None] * sdx_n + o_sd, b_dh.to(dx_ptr.dtype.element_ty), mask=m_tsd)
                tl.store(dkv_ptr + i_m[:, None, None] * sdkv_n + o_sd, b_dk.to(dkv_ptr.dtype.element_ty), mask=m_tsd)
        j += 1
    if CHUNKS_PER_PROGRAM == 1:
        tl.store(p_dw, b_dw, mask=m_dw)


@triton.jit(do_not_specialize=["n_parts"])
def _engram_dweight_kernel(ws_ptr, dw_ptr, n_parts, n_cols, BLOCK_P: tl.constexpr, BLOCK: tl.constexpr):
    """dweight[c] = sum over the partials ws[p, c], p < n_parts, as one fixed-shape tree."""
    o_p = tl.arange(0, BLOCK_P)
    o_c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_c = o_c < n_cols
    b_ws = tl.load(ws_ptr + o_p[:, None].to(tl.int64) * n_cols + o_c[None, :],
                   mask=(o_p < n_parts)[:, None] & m_c[None, :], other=0.0)
    tl.store(dw_ptr + o_c, tl.sum(b_ws, 0), mask=m_c)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _blocks(n_tokens: int) -> int:
    return triton.cdiv(n_tokens, BWD_TOKENS)


def token_groups(n_tokens: int) -> int:
    """dWeight partials of the backward for ``n_tokens`` (a function of N only: reproducible anywhere)."""
    return max(1, min(_blocks(n_tokens), GROUPS))


def _chunks(dim: int) -> tuple[int, int]:
    """(channels per backward program, chunks of D)."""
    block_d = min(BWD_BLOCK_D, _pow2(dim))
    return block_d, triton.cdiv(dim, block_d)


def workspace_elements(n_tokens: int, streams: int, dim: int) -> int:
    """fp32 elements of the backward workspace: the groups' dWeight partials ``[G, S, D]``, the
    per-chunk sums ``[blocks * tokens per block, chunks, S]``, then ``1 + blocks`` int32
    counters (zeroed by every call)."""
    blocks = _blocks(n_tokens)
    return token_groups(n_tokens) * streams * dim + blocks * BWD_TOKENS * _chunks(dim)[1] * streams + 1 + blocks


def _fwd_warps(block: int) -> int:
    return max(1, min(FWD_WARPS * block // 8192, 16))


def check_dim(dim: int) -> None:
    if dim > MAX_DIM:
        raise ValueError(f"x: D = {dim} is above the fused kernels' limit of {MAX_DIM} channels per row")


def launch_forward(x, kv, weight, token_mask, out, saved, *, eps: float, clamp: float) -> None:
    check_no_overlap({"out": out, "saved": saved}, {"x": x, "kv": kv, "weight": weight, "token_mask": token_mask})
    n, streams, dim = x.shape
    check_dim(dim)
    if n == 0:
        return
    block = _pow2(dim)
    _engram_fwd_kernel[(n * streams,)](
        x, kv, weight, token_mask, out, saved,
        eps, clamp,
        x.stride(0), kv.stride(0), out.stride(0),
        dim=dim, STREAMS=streams, BLOCK=block, num_warps=_fwd_warps(block),
    )


def launch_backward(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, *, clamp: float,
                    serial: bool | None = None) -> None:
    """``workspace`` fp32 contiguous with at least ``workspace_elements(N, S, D)`` elements (overwritten).

    ``serial``: one program per token group takes all chunks of D (no program waits for
    another; the same arithmetic, so bitwise the same results). The interpreter, which runs
    programs one after another, needs it; the default is serial exactly for CPU tensors.
    """
    check_no_overlap({"dx": dx, "dkv": dkv, "dweight": dweight, "workspace": workspace},
                     {"dout": dout, "x": x, "kv": kv, "weight": weight, "saved": saved})
    n, streams, dim = x.shape
    check_dim(dim)
    if n == 0:
        dweight.zero_()
        return
    groups, blocks = token_groups(n), _blocks(n)
    block_d, n_chunks = _chunks(dim)
    n_part, n_gpart = groups * streams * dim, blocks * BWD_TOKENS * n_chunks * streams
    partials, gpart = workspace[:n_part], workspace[n_part:n_part + n_gpart]
    sync = workspace[n_part + n_gpart:n_part + n_gpart + 1 + blocks]
    serial = not dout.is_cuda if serial is None else serial
    if not serial and not dout.is_cuda:
        raise ValueError("serial=False needs CUDA: the interpreter runs one program at a time, and the chunk "
                         "programs of a token wait for each other")
    per_program = n_chunks if serial else 1
    if not serial:
        _check_coresident(dout.device, n_chunks)
    sync.zero_()  # fp32 and int32 zero share their bits
    _engram_bwd_kernel[(n_chunks // per_program * groups,)](
        dout, x, kv, weight, saved, dx, dkv, gpart, partials, sync.view(torch.int32),
        n, groups, clamp,
        dout.stride(0), x.stride(0), kv.stride(0), dx.stride(0), dkv.stride(0),
        dim=dim, STREAMS=streams, BLOCK_S=_pow2(streams), BLOCK_D=block_d, N_CHUNKS=n_chunks,
        BLOCK_C=_pow2(n_chunks), TOKENS=BWD_TOKENS, CHUNKS_PER_PROGRAM=per_program, LOOKAHEAD=LOOKAHEAD, num_warps=BWD_WARPS,
    )
    cols = streams * dim
    _engram_dweight_kernel[(triton.cdiv(cols, SUM_BLOCK),)](partials, dweight, groups, cols, BLOCK_P=_pow2(GROUPS),
                                                            BLOCK=SUM_BLOCK, num_warps=NUM_WARPS)


def _check_coresident(device, n_chunks: int) -> None:
    """A token's chunk programs wait for each other: at least that many must run at once (one per SM)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if sms < n_chunks:
        raise ValueError(f"x: the backward runs the {n_chunks} chunk programs of a token at once and needs as many "
                         f"SMs; {device} has {sms}")


def _aot_specs() -> list:
    """The model's specialisations: S = 4 streams of D = 5120, bf16, contiguous rows."""
    from dsfuse._common.aot import AotSpec

    opts = {"num_warps": NUM_WARPS}
    fwd = AotSpec(
        name="engram_fwd_bf16", kernel=_engram_fwd_kernel,
        signature={"x_ptr": "*bf16", "kv_ptr": "*bf16", "w_ptr": "*fp32", "mask_ptr": "*i1", "out_ptr": "*bf16",
                   "saved_ptr": "*fp32", "eps": "fp32", "clamp": "fp32", "sx_n": "i32", "skv_n": "i32",
                   "so_n": "i32"},
        constexprs=dict(dim=5120, STREAMS=4, BLOCK=8192), options={"num_warps": _fwd_warps(8192)},
        divisible_by_16=("x_ptr", "kv_ptr", "w_ptr", "mask_ptr", "out_ptr", "saved_ptr", "sx_n", "skv_n", "so_n"),
    )
    bwd = AotSpec(
        name="engram_bwd_bf16", kernel=_engram_bwd_kernel,
        signature={"dout_ptr": "*bf16", "x_ptr": "*bf16", "kv_ptr": "*bf16", "w_ptr": "*fp32", "saved_ptr": "*fp32",
                   "dx_ptr": "*bf16", "dkv_ptr": "*bf16", "gpart_ptr": "*fp32", "dwp_ptr": "*fp32",
                   "sync_ptr": "*i32", "n_tokens": "i32", "n_groups": "i32", "clamp": "fp32",
                   "sdo_n": "i32", "sx_n": "i32", "skv_n": "i32", "sdx_n": "i32", "sdkv_n": "i32"},
        constexprs=dict(dim=5120, STREAMS=4, BLOCK_S=4, BLOCK_D=BWD_BLOCK_D, N_CHUNKS=_chunks(5120)[1],
                        BLOCK_C=_pow2(_chunks(5120)[1]), TOKENS=BWD_TOKENS, CHUNKS_PER_PROGRAM=1,
                        LOOKAHEAD=LOOKAHEAD),
        options={"num_warps": BWD_WARPS},
        divisible_by_16=("dout_ptr", "x_ptr", "kv_ptr", "w_ptr", "saved_ptr", "dx_ptr", "dkv_ptr", "gpart_ptr",
                         "dwp_ptr", "sync_ptr", "sdo_n", "sx_n", "skv_n", "sdx_n", "sdkv_n"),
    )
    dweight = AotSpec(
        name="engram_dweight", kernel=_engram_dweight_kernel,
        signature={"ws_ptr": "*fp32", "dw_ptr": "*fp32", "n_parts": "i32", "n_cols": "i32"},
        constexprs=dict(BLOCK_P=_pow2(GROUPS), BLOCK=SUM_BLOCK), options=opts, divisible_by_16=("ws_ptr", "dw_ptr", "n_cols"),
    )
    return [fwd, bwd, dweight]


AOT_SPECS = _aot_specs()
