"""Engram gate kernels with D split into power-of-two pieces and chained launches, kept as an experiment.

Two ideas measured against the shipped kernels (dsfuse/engram_gate/triton.py):

- Backward kernel 1 without a loop: one program per (token, D chunk) writes its chunk of the
  value gradient and the chunk's partial ``G = sum_d dout * value`` per stream to
  ``[N, chunks, S]``; the tile kernel adds a token's partials (one fixed-shape sum: the same
  in every program) and forms the coefficients itself. More loads in flight per SM than a
  program walking a token's D in sequence.
- Programmatic dependent launch (``PDL``): kernel 1 and the tile kernel signal at their start
  that the next kernel may be scheduled; the next one waits (``gdc_wait``) before reading what
  the previous one wrote, so its programs fill the SMs while the previous launch drains.
- Forward rows as a head of the largest power of two <= D and a tail (4096 + 1024 at D = 5120)
  instead of one 8192-lane tile with 3072 masked lanes; per row or per token (the value row
  then read once per token).

``tune_split.py`` (this folder) times them. All slower on the H200
(``experiments/engram_gate/raw/tuning/split-d-sweep.csv``): backward 324-517 us against 303 us
shipped, forward + backward 489 us at best against 450 us, forward 154-1881 us against 152 us
(in ``split-d-sweep-rerun.csv`` the 4-warp split row was 3.5% faster alone, slower before the
backward); the chained launches change nothing beyond noise. The sweep times the whole
backward, so it does not say which of the two split kernels lost the time. See README.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # explored/: the shared snapshot shipped_helpers_9110dd7.py

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from shipped_helpers_9110dd7 import copysign, dweight_kernel, grad_coefficients, pow2, tile_token, tree_sum

DOT_BLOCK_D, DOT_WARPS = 1024, 4
TILE_BLOCK_D, TILE_WARPS, GROUPS = 256, 4, 32
SUM_BLOCK = 64
PDL = True
FWD_TOKEN = False  # forward: one program per token (all streams) instead of per (token, stream)
FWD_WARPS = 2


def split(dim: int) -> tuple[int, int]:
    """(head, tail block): head the largest power of two <= D, tail block the power of two covering the rest."""
    head = pow2(dim) if pow2(dim) == dim else pow2(dim) // 2
    return head, max(pow2(dim - head), 1)


@triton.jit
def _fwd_split_kernel(
    x_ptr, kv_ptr, w_ptr, mask_ptr, out_ptr, saved_ptr,
    eps, clamp,
    sx_n, skv_n, so_n,
    dim: tl.constexpr,
    STREAMS: tl.constexpr,
    ROWS: tl.constexpr,  # streams per program: 1 (one row) or BLOCK_S (a token)
    HEAD: tl.constexpr,
    TAIL: tl.constexpr,
):
    i_p = tl.program_id(0)
    if ROWS == 1:
        i_n = (i_p // STREAMS).to(tl.int64)
        s0 = i_p % STREAMS
    else:
        i_n = i_p.to(tl.int64)
        s0 = 0
    o_s = s0 + tl.arange(0, ROWS)
    m_s = o_s < STREAMS
    o_a = tl.arange(0, HEAD)
    o_b = HEAD + tl.arange(0, TAIL)
    m_b = m_s[:, None] & (o_b < dim)[None, :]
    m_a = m_s[:, None] & (o_a < HEAD)[None, :]
    p_x = x_ptr + i_n * sx_n + o_s[:, None] * dim
    p_k = kv_ptr + i_n * skv_n + o_s[:, None] * dim
    p_w = w_ptr + o_s[:, None] * dim
    h_a = tl.load(p_x + o_a[None, :], mask=m_a, other=0.0).to(tl.float32)
    h_b = tl.load(p_x + o_b[None, :], mask=m_b, other=0.0).to(tl.float32)
    k_a = tl.load(p_k + o_a[None, :], mask=m_a, other=0.0).to(tl.float32)
    k_b = tl.load(p_k + o_b[None, :], mask=m_b, other=0.0).to(tl.float32)
    w_a = tl.load(p_w + o_a[None, :], mask=m_a, other=0.0)
    w_b = tl.load(p_w + o_b[None, :], mask=m_b, other=0.0)
    rx = tl.div_rn(1.0, tl.sqrt_rn((tl.sum(h_a * h_a, 1) + tl.sum(h_b * h_b, 1)) / dim + eps))
    rk = tl.div_rn(1.0, tl.sqrt_rn((tl.sum(k_a * k_a, 1) + tl.sum(k_b * k_b, 1)) / dim + eps))
    dot = ((tl.sum(h_a * w_a * k_a, 1) + tl.sum(h_b * w_b * k_b, 1)) * rx * rk
           * tl.div_rn(1.0, tl.sqrt_rn(tl.full((), dim, tl.float32))))
    root = copysign(tl.sqrt_rn(tl.maximum(tl.abs(dot), clamp)), dot)
    gate = tl.div_rn(1.0, 1.0 + tl.exp(-root))
    gate = tl.where(tl.load(mask_ptr + i_n).to(tl.int1), gate, 0.0)
    p_saved = saved_ptr + (i_n * STREAMS + o_s) * 4
    tl.store(p_saved, gate, mask=m_s)
    tl.store(p_saved + 1, dot, mask=m_s)
    tl.store(p_saved + 2, rx, mask=m_s)
    tl.store(p_saved + 3, rk, mask=m_s)
    p_v = kv_ptr + i_n * skv_n + STREAMS * dim
    v_a = tl.load(p_v + o_a, mask=o_a < HEAD, other=0.0).to(tl.float32)
    v_b = tl.load(p_v + o_b, mask=o_b < dim, other=0.0).to(tl.float32)
    p_o = out_ptr + i_n * so_n + o_s[:, None] * dim
    tl.store(p_o + o_a[None, :], (h_a + gate[:, None] * v_a[None, :]).to(out_ptr.dtype.element_ty), mask=m_a)
    tl.store(p_o + o_b[None, :], (h_b + gate[:, None] * v_b[None, :]).to(out_ptr.dtype.element_ty), mask=m_b)


@triton.jit
def _split_dot_kernel(
    dout_ptr, kv_ptr, saved_ptr, dkv_ptr, part_ptr,
    sdo_n, skv_n, sdkv_n,
    dim: tl.constexpr,
    STREAMS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (token, chunk): the chunk's value gradient and partial G per stream -> part[N, CHUNKS, S]."""
    if PDL:
        gdc_launch_dependents()
    i_p = tl.program_id(0)
    i_n = (i_p // CHUNKS).to(tl.int64)
    i_c = i_p % CHUNKS
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < STREAMS
    o_d = i_c * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < dim
    b_gate = tl.load(saved_ptr + (i_n * STREAMS + o_s) * 4, mask=m_s, other=0.0)
    b_do = tl.load(dout_ptr + i_n * sdo_n + o_s[:, None] * dim + o_d[None, :], mask=m_s[:, None] & m_d[None, :],
                   other=0.0).to(tl.float32)
    b_v = tl.load(kv_ptr + i_n * skv_n + STREAMS * dim + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_dv = tl.sum(b_gate[:, None] * b_do, 0)
    tl.store(dkv_ptr + i_n * sdkv_n + STREAMS * dim + o_d, b_dv.to(dkv_ptr.dtype.element_ty), mask=m_d)
    tl.store(part_ptr + (i_n * CHUNKS + i_c) * STREAMS + o_s, tl.sum(b_do * b_v[None, :], 1), mask=m_s)


@triton.jit(do_not_specialize=["n_tokens"])
def _split_tile_kernel(
    dout_ptr, x_ptr, kv_ptr, w_ptr, saved_ptr, part_ptr, dx_ptr, dkv_ptr, ws_ptr,
    n_tokens, clamp,
    sdo_n, sx_n, skv_n, sdx_n, sdkv_n,
    dim: tl.constexpr,
    STREAMS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    """The shipped tile kernel (tokens last to first), forming each token's coefficients from its partial G."""
    i_g = tl.program_id(1)
    n_groups = tl.num_programs(1)
    o_s = tl.arange(0, BLOCK_S)
    o_c = tl.arange(0, BLOCK_C)
    o_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_s = o_s < STREAMS
    m_cs = (o_c < CHUNKS)[:, None] & m_s[None, :]
    m_sd = m_s[:, None] & (o_d < dim)[None, :]
    o_sd = o_s[:, None] * dim + o_d[None, :]
    b_w = tl.load(w_ptr + o_sd, mask=m_sd, other=0.0)
    b_dw = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # the partial G of kernel 1
    i_n32 = i_g
    while i_n32 < n_tokens:
        i_n = (n_tokens - 1 - i_n32).to(tl.int64)
        i_n32 += n_groups
        p_part = part_ptr + (i_n * CHUNKS + o_c[:, None]) * STREAMS + o_s[None, :]
        b_G = tl.sum(tl.load(p_part, mask=m_cs, other=0.0), 0)
        p_saved = saved_ptr + (i_n * STREAMS + o_s) * 4
        b_a, b_bx, b_bk = grad_coefficients(b_G, tl.load(p_saved, mask=m_s, other=0.0),
                                            tl.load(p_saved + 1, mask=m_s, other=0.0),
                                             tl.load(p_saved + 2, mask=m_s, other=0.0),
                                             tl.load(p_saved + 3, mask=m_s, other=0.0), clamp, dim)
        b_dw += tile_token(i_n, dout_ptr, x_ptr, kv_ptr, dx_ptr, dkv_ptr, sdo_n, sx_n, skv_n, sdx_n, sdkv_n,
                           o_sd, m_sd, b_w, b_a, b_bx, b_bk)
    tl.store(ws_ptr + i_g.to(tl.int64) * STREAMS * dim + o_sd, b_dw, mask=m_sd)


@triton.jit(do_not_specialize=["n_parts"])
def _pdl_dweight_kernel(ws_ptr, dw_ptr, n_parts, n_cols, BLOCK_P: tl.constexpr, BLOCK: tl.constexpr):
    """The shipped dWeight tree sum behind a ``gdc_wait`` (launched as a programmatic dependent)."""
    gdc_wait()
    tree_sum(ws_ptr, dw_ptr, n_parts, n_cols, BLOCK_P, BLOCK)


def workspace_elements(n_tokens: int, streams: int, dim: int) -> int:
    return GROUPS * streams * dim + n_tokens * triton.cdiv(dim, DOT_BLOCK_D) * streams


def launch_forward(x, kv, weight, token_mask, out, saved, *, eps, clamp):
    n, streams, dim = x.shape
    head, tail = split(dim)
    rows = pow2(streams) if FWD_TOKEN else 1
    _fwd_split_kernel[(n if FWD_TOKEN else n * streams,)](
        x, kv, weight, token_mask, out, saved, eps, clamp, x.stride(0), kv.stride(0), out.stride(0),
        dim=dim, STREAMS=streams, ROWS=rows, HEAD=head, TAIL=tail, num_warps=FWD_WARPS,
    )


def launch_backward(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, *, clamp):
    n, streams, dim = x.shape
    groups = max(1, min(n, GROUPS))
    chunks = triton.cdiv(dim, DOT_BLOCK_D)
    partials, part = workspace[: groups * streams * dim], workspace[groups * streams * dim:]
    block_s = pow2(streams)
    _split_dot_kernel[(n * chunks,)](
        dout, kv, saved, dkv, part, dout.stride(0), kv.stride(0), dkv.stride(0),
        dim=dim, STREAMS=streams, BLOCK_S=block_s, BLOCK_D=DOT_BLOCK_D, CHUNKS=chunks, PDL=PDL, num_warps=DOT_WARPS,
    )
    _split_tile_kernel[(triton.cdiv(dim, TILE_BLOCK_D), groups)](
        dout, x, kv, weight, saved, part, dx, dkv, partials, n, clamp,
        dout.stride(0), x.stride(0), kv.stride(0), dx.stride(0), dkv.stride(0),
        dim=dim, STREAMS=streams, BLOCK_S=block_s, BLOCK_D=TILE_BLOCK_D, CHUNKS=chunks, BLOCK_C=pow2(chunks), PDL=PDL,
        num_warps=TILE_WARPS, launch_pdl=PDL,
    )
    cols = streams * dim
    sum_kernel = _pdl_dweight_kernel if PDL else dweight_kernel
    sum_kernel[(triton.cdiv(cols, SUM_BLOCK),)](partials, dweight, groups, cols, BLOCK_P=pow2(GROUPS), BLOCK=SUM_BLOCK,
                                                num_warps=4, launch_pdl=PDL)
