"""An Engram backward in one kernel whose coefficient programs run ahead of its tile programs.

The shipped backward runs two kernels: per token ``G = sum_d dout * value`` (and the value
gradient), then a D-tiled pass over token groups that reads dout again from HBM. Here both
run in one launch: the first ``coef_programs`` programs to start (by ticket, so they are
always resident) take tokens ``r, r + P, ...``, write the coefficients and raise a per-token
flag (release); the tile programs wait for a token's flag (acquire) before using its
coefficients, so they read each token's dout shortly after the coefficient programs did,
mostly from L2. Nothing waits on the tile programs: no deadlock whatever the occupancy.
Same arithmetic as the shipped kernels with ``TILE_REVERSE = False`` (bitwise the same
results). Slower on the H200: 352 us at best against 311 us for the shipped backward in the
same run (``experiments/engram_gate/raw/tuning/ahead-sweep.csv``): the coefficient programs'
serial chain per token (one chunk of D after another) limits the whole launch. ``tune_ahead.py``
(this folder) is the sweep; see README.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # explored/: the shared snapshot shipped_helpers_9110dd7.py

import torch
import triton
import triton.language as tl

from shipped_helpers_9110dd7 import dweight_kernel, grad_tile, pow2, token_coefficients

COEF_PROGRAMS, COEF_BLOCK_D, TILE_BLOCK_D, WARPS, GROUPS = 132, 512, 256, 4, 32


@triton.jit(do_not_specialize=["n_tokens", "n_coef"])
def _engram_bwd_ahead_kernel(
    dout_ptr, x_ptr, kv_ptr, w_ptr, saved_ptr, coef_ptr, dx_ptr, dkv_ptr, ws_ptr, sync_ptr,
    n_tokens, n_coef, clamp,
    sdo_n, sx_n, skv_n, sdx_n, sdkv_n,
    dim: tl.constexpr,
    STREAMS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    COEF_D: tl.constexpr,
    TILE_D: tl.constexpr,
    N_CHUNKS: tl.constexpr,
    GROUPS: tl.constexpr,
):
    ticket = tl.atomic_add(sync_ptr, 1)
    p_flag = sync_ptr + 1
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < STREAMS
    if ticket < n_coef:  # coefficient program: tokens ticket, ticket + n_coef, ...
        i_n32 = ticket
        while i_n32 < n_tokens:
            i_n = i_n32.to(tl.int64)
            b_a, b_bx, b_bk = token_coefficients(i_n, dout_ptr, kv_ptr, saved_ptr, dkv_ptr, clamp, sdo_n, skv_n,
                                                 sdkv_n, dim, STREAMS, BLOCK_S, COEF_D)
            p_coef = coef_ptr + i_n * STREAMS * 4 + o_s * 4
            tl.store(p_coef, b_a, mask=m_s)
            tl.store(p_coef + 1, b_bx, mask=m_s)
            tl.store(p_coef + 2, b_bk, mask=m_s)
            tl.debug_barrier()  # every thread's stores precede the flag
            tl.atomic_xchg(p_flag + i_n, 1, sem="release", scope="gpu")
            i_n32 += n_coef
    else:  # tile program (chunk, group): tokens g, g + GROUPS, ...
        t = ticket - n_coef
        i_g = t // N_CHUNKS
        o_d = (t % N_CHUNKS) * TILE_D + tl.arange(0, TILE_D)
        m_sd = m_s[:, None] & (o_d < dim)[None, :]
        o_sd = o_s[:, None] * dim + o_d[None, :]
        b_w = tl.load(w_ptr + o_sd, mask=m_sd, other=0.0)
        b_dw = tl.zeros((BLOCK_S, TILE_D), dtype=tl.float32)
        i_n32 = i_g
        while i_n32 < n_tokens:
            i_n = i_n32.to(tl.int64)
            i_n32 += GROUPS
            b_do = tl.load(dout_ptr + i_n * sdo_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
            b_h = tl.load(x_ptr + i_n * sx_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
            b_k = tl.load(kv_ptr + i_n * skv_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
            while tl.atomic_add(p_flag + i_n, 0, sem="acquire", scope="gpu") == 0:
                pass
            p_coef = coef_ptr + i_n * STREAMS * 4 + o_s * 4
            b_a = tl.load(p_coef, mask=m_s, other=0.0, cache_modifier=".cg")
            b_bx = tl.load(p_coef + 1, mask=m_s, other=0.0, cache_modifier=".cg")
            b_bk = tl.load(p_coef + 2, mask=m_s, other=0.0, cache_modifier=".cg")
            b_dh, b_dk, b_dw_n = grad_tile(b_do, b_h, b_k, b_w, b_a[:, None], b_bx[:, None], b_bk[:, None])
            tl.store(dx_ptr + i_n * sdx_n + o_sd, b_dh.to(dx_ptr.dtype.element_ty), mask=m_sd)
            tl.store(dkv_ptr + i_n * sdkv_n + o_sd, b_dk.to(dkv_ptr.dtype.element_ty), mask=m_sd)
            b_dw += b_dw_n
        tl.store(ws_ptr + i_g.to(tl.int64) * STREAMS * dim + o_sd, b_dw, mask=m_sd)


def workspace_elements(n, streams, dim):
    return min(n, GROUPS) * streams * dim + n * streams * 4 + 1 + n


def launch(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, *, clamp):
    """Run serially in the interpreter (programs start in ticket order: all coefficients first)."""
    n, streams, dim = x.shape
    groups = min(n, GROUPS)
    n_chunks = triton.cdiv(dim, TILE_BLOCK_D)
    partials = workspace[: groups * streams * dim]
    coef = workspace[groups * streams * dim: groups * streams * dim + n * streams * 4]
    sync = workspace[groups * streams * dim + n * streams * 4: groups * streams * dim + n * streams * 4 + 1 + n]
    sync.zero_()
    n_coef = min(COEF_PROGRAMS, n)
    _engram_bwd_ahead_kernel[(n_coef + n_chunks * groups,)](
        dout, x, kv, weight, saved, coef, dx, dkv, partials, sync.view(torch.int32),
        n, n_coef, clamp,
        dout.stride(0), x.stride(0), kv.stride(0), dx.stride(0), dkv.stride(0),
        dim=dim, STREAMS=streams, BLOCK_S=pow2(streams), COEF_D=min(COEF_BLOCK_D, pow2(dim)), TILE_D=TILE_BLOCK_D,
        N_CHUNKS=n_chunks, GROUPS=groups, num_warps=WARPS,
    )
    cols = streams * dim
    dweight_kernel[(triton.cdiv(cols, 64),)](partials, dweight, groups, cols, BLOCK_P=pow2(GROUPS), BLOCK=64,
                                             num_warps=4)
