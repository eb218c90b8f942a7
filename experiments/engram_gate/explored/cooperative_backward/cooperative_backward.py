"""A cooperative Engram backward in one kernel, kept as an experiment (slower than the shipped one).

Programs ``(D chunk, token group)`` walk token blocks; each block's chunk programs publish
their partial ``sum_d dout * value`` (a release count per block) and, one block later, wait
for all chunks of the previous block and finish it (dx, key gradients, register dWeight
partials). Every operand is read from HBM once, but each step is a chain of dependent
round trips (loads, reductions through shared memory, the release, the wait, the sums),
and with the token concurrency the L2 reuse needs, too little is in flight: 565 us at best
(up to 1650 us) against about 305 us for the shipped two-kernel backward on the H200
(``experiments/engram_gate/raw/tuning/blocks-bwd-cooperative-per-token.csv``,
``blocks-bwd-cooperative-token-blocks.csv``, ``probe-cooperative-sync-cost.csv``); the looped
variant (one wait per block of tokens) 545 us against 280 us (``blocks-bwd-cooperative-looped.csv``).
Kept so the result can be rerun (``tune_cooperative.py``, ``probe_cooperative.py``); never
imported by the package. See this folder's README.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # explored/: the shared snapshot shipped_helpers_9110dd7.py

import torch
import triton
import triton.language as tl

from cooperative_helpers import backward_shape
from shipped_helpers_9110dd7 import dweight_kernel, grad_coefficients, grad_tile, pow2

# the settings of the sweeps (module constants so the probes can change them)
BWD_BLOCK_D, BWD_TOKENS, BWD_WARPS, LOOKAHEAD, GROUPS, SUM_BLOCK, NUM_WARPS = 512, 1, 4, 2, 32, 64, 4
LOOPED = False  # the looped kernel (token loops, [S, chunk] tiles) instead of the 3D-tile one
# the probe's variants of the 3D-tile kernel (compile-time switches; the defaults are the kernel as measured)
SYNC = True  # False: no release count and no wait (the totals are read whenever they are there: wrong results)
LOCAL_SUMS = False  # True: each program uses only its own chunk's sum (no cross-program traffic at all)


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
    SYNC: tl.constexpr,  # the release count and the wait (False only in the probe: wrong results)
    LOCAL_SUMS: tl.constexpr,  # only the program's own chunk sum (True only in the probe: wrong results)
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
                if SYNC:
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
                if SYNC:
                    while tl.atomic_add(p_cnt + i_b, 0, sem="acquire", scope="gpu") < N_CHUNKS:
                        pass
                m_c = (o_c == c0) if LOCAL_SUMS else (o_c < N_CHUNKS)
                b_gp = tl.load(gpart_ptr + i_b.to(tl.int64) * TOKENS * N_CHUNKS * STREAMS + o_tcs,
                               mask=m_c[None, :, None] & m_s[None, None, :], other=0.0,
                               cache_modifier=".cg")  # written by other SMs: read from L2
                b_a, b_bx, b_bk = grad_coefficients(tl.sum(b_gp, 1), b_gate, b_dot, b_rx, b_rk, clamp, dim)
                if CHUNKS_PER_PROGRAM == 1:
                    b_dh, b_dk, b_dw_n = grad_tile(b_do, b_h, b_k, b_w, b_a[:, :, None], b_bx[:, :, None],
                                                   b_bk[:, :, None])
                    b_dw += tl.sum(b_dw_n, 0)
                else:
                    b_wc = tl.load(w_ptr + o_s[:, None] * dim + o_d[None, :], mask=m_s[:, None] & (o_d < dim)[None, :],
                                   other=0.0)
                    b_dh, b_dk, b_dw_n = grad_tile(b_do, b_h, b_k, b_wc[None, :, :], b_a[:, :, None],
                                                   b_bx[:, :, None], b_bk[:, :, None])
                    m_sd = m_s[:, None] & (o_d < dim)[None, :]
                    tl.store(p_dw + cc * BLOCK_D, tl.load(p_dw + cc * BLOCK_D, mask=m_sd, other=0.0) + tl.sum(b_dw_n, 0),
                             mask=m_sd)
                tl.store(dx_ptr + i_m[:, None, None] * sdx_n + o_sd, b_dh.to(dx_ptr.dtype.element_ty), mask=m_tsd)
                tl.store(dkv_ptr + i_m[:, None, None] * sdkv_n + o_sd, b_dk.to(dkv_ptr.dtype.element_ty), mask=m_tsd)
        j += 1
    if CHUNKS_PER_PROGRAM == 1:
        tl.store(p_dw, b_dw, mask=m_dw)


@triton.jit(do_not_specialize=["n_tokens", "n_groups"])
def _engram_bwd_looped_kernel(
    dout_ptr, x_ptr, kv_ptr, w_ptr, saved_ptr, dx_ptr, dkv_ptr, gpart_ptr, dwp_ptr, sync_ptr,
    n_tokens, n_groups, clamp,
    sdo_n, sx_n, skv_n, sdx_n, sdkv_n,
    dim: tl.constexpr,
    STREAMS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    N_CHUNKS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TOKENS: tl.constexpr,
    CHUNKS_PER_PROGRAM: tl.constexpr,
    LOOKAHEAD: tl.constexpr,
):
    """The cooperative schedule with [S, chunk] tiles and loops over a block's tokens (no 3D
    tiles): per block one release and one wait amortised over ``TOKENS`` tokens; phase 2
    reads dout again (from L2: the block's phase 1 read it a few microseconds before)."""
    ticket = tl.atomic_add(sync_ptr, 1)
    programs_per_group: tl.constexpr = N_CHUNKS // CHUNKS_PER_PROGRAM
    i_g = ticket // programs_per_group
    c0 = (ticket % programs_per_group) * CHUNKS_PER_PROGRAM
    n_steps = (tl.cdiv(n_tokens, TOKENS) - i_g + n_groups - 1) // n_groups
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < STREAMS
    o_c = tl.arange(0, BLOCK_C)
    m_cs = (o_c < N_CHUNKS)[:, None] & m_s[None, :]
    p_cnt = sync_ptr + 1
    b_dw = tl.zeros((BLOCK_S, BLOCK_D), dtype=tl.float32)
    o_dw = c0 * BLOCK_D + tl.arange(0, BLOCK_D)
    m_dw = m_s[:, None] & (o_dw < dim)[None, :]
    p_dw = dwp_ptr + i_g.to(tl.int64) * STREAMS * dim + o_s[:, None] * dim + o_dw[None, :]
    if CHUNKS_PER_PROGRAM == 1:
        b_w = tl.load(w_ptr + o_s[:, None] * dim + o_dw[None, :], mask=m_dw, other=0.0)
    else:
        for cc in range(CHUNKS_PER_PROGRAM):
            tl.store(p_dw + cc * BLOCK_D, b_dw, mask=m_dw & (o_dw + cc * BLOCK_D < dim)[None, :])
    j = 0
    while j < n_steps + LOOKAHEAD:
        if j < n_steps:  # phase 1 of block j: chunk sums and the value gradient, then publish
            i_b = i_g + j * n_groups
            for t in range(TOKENS):
                i_n = i_b.to(tl.int64) * TOKENS + t
                if i_n < n_tokens:
                    b_gate = tl.load(saved_ptr + i_n * STREAMS * 4 + o_s * 4, mask=m_s, other=0.0)
                    for cc in range(CHUNKS_PER_PROGRAM):
                        o_d = (c0 + cc) * BLOCK_D + tl.arange(0, BLOCK_D)
                        m_d = o_d < dim
                        b_do = tl.load(dout_ptr + i_n * sdo_n + o_s[:, None] * dim + o_d[None, :],
                                       mask=m_s[:, None] & m_d[None, :], other=0.0).to(tl.float32)
                        b_v = tl.load(kv_ptr + i_n * skv_n + STREAMS * dim + o_d, mask=m_d, other=0.0).to(tl.float32)
                        tl.store(gpart_ptr + (i_n * N_CHUNKS + c0 + cc) * STREAMS + o_s, tl.sum(b_do * b_v[None, :], 1),
                                 mask=m_s)
                        b_dv = tl.sum(b_gate[:, None] * b_do, 0)
                        tl.store(dkv_ptr + i_n * sdkv_n + STREAMS * dim + o_d, b_dv.to(dkv_ptr.dtype.element_ty),
                                 mask=m_d)
            tl.debug_barrier()  # every thread's sums are stored before the count says so
            tl.atomic_add(p_cnt + i_b, CHUNKS_PER_PROGRAM, sem="release", scope="gpu")
        if j >= LOOKAHEAD:  # phase 2 of block j - LOOKAHEAD
            i_b = i_g + (j - LOOKAHEAD) * n_groups
            while tl.atomic_add(p_cnt + i_b, 0, sem="acquire", scope="gpu") < N_CHUNKS:
                pass
            for t in range(TOKENS):
                i_m = i_b.to(tl.int64) * TOKENS + t
                if i_m < n_tokens:
                    p_saved = saved_ptr + i_m * STREAMS * 4 + o_s * 4
                    b_gate = tl.load(p_saved, mask=m_s, other=0.0)
                    b_dot = tl.load(p_saved + 1, mask=m_s, other=0.0)
                    b_rx = tl.load(p_saved + 2, mask=m_s, other=0.0)
                    b_rk = tl.load(p_saved + 3, mask=m_s, other=0.0)
                    b_gp = tl.load(gpart_ptr + (i_m * N_CHUNKS + o_c[:, None]) * STREAMS + o_s[None, :], mask=m_cs,
                                   other=0.0, cache_modifier=".cg")  # written by other SMs: read from L2
                    b_a, b_bx, b_bk = grad_coefficients(tl.sum(b_gp, 0), b_gate, b_dot, b_rx, b_rk, clamp, dim)
                    for cc in range(CHUNKS_PER_PROGRAM):
                        o_d = (c0 + cc) * BLOCK_D + tl.arange(0, BLOCK_D)
                        m_sd = m_s[:, None] & (o_d < dim)[None, :]
                        o_sd = o_s[:, None] * dim + o_d[None, :]
                        b_do = tl.load(dout_ptr + i_m * sdo_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
                        b_h = tl.load(x_ptr + i_m * sx_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
                        b_k = tl.load(kv_ptr + i_m * skv_n + o_sd, mask=m_sd, other=0.0).to(tl.float32)
                        if CHUNKS_PER_PROGRAM == 1:
                            b_dh, b_dk, b_dw_n = grad_tile(b_do, b_h, b_k, b_w, b_a[:, None], b_bx[:, None],
                                                           b_bk[:, None])
                            b_dw += b_dw_n
                        else:
                            b_wc = tl.load(w_ptr + o_sd, mask=m_sd, other=0.0)
                            b_dh, b_dk, b_dw_n = grad_tile(b_do, b_h, b_k, b_wc, b_a[:, None], b_bx[:, None],
                                                           b_bk[:, None])
                            tl.store(p_dw + cc * BLOCK_D, tl.load(p_dw + cc * BLOCK_D, mask=m_sd, other=0.0) + b_dw_n,
                                     mask=m_sd)
                        tl.store(dx_ptr + i_m * sdx_n + o_sd, b_dh.to(dx_ptr.dtype.element_ty), mask=m_sd)
                        tl.store(dkv_ptr + i_m * sdkv_n + o_sd, b_dk.to(dkv_ptr.dtype.element_ty), mask=m_sd)
        j += 1
    if CHUNKS_PER_PROGRAM == 1:
        tl.store(p_dw, b_dw, mask=m_dw)


def _blocks(n_tokens: int) -> int:
    return triton.cdiv(n_tokens, BWD_TOKENS)


def token_groups(n_tokens: int) -> int:
    """dWeight partials of the backward for ``n_tokens`` (a function of N only: reproducible anywhere)."""
    return max(1, min(_blocks(n_tokens), GROUPS))


def _chunks(dim: int) -> tuple[int, int]:
    """(channels per backward program, chunks of D)."""
    block_d = min(BWD_BLOCK_D, pow2(dim))
    return block_d, triton.cdiv(dim, block_d)


def workspace_elements(n_tokens: int, streams: int, dim: int) -> int:
    """fp32 elements of the backward workspace: the groups' dWeight partials ``[G, S, D]``, the
    per-chunk sums ``[blocks * tokens per block, chunks, S]``, then ``1 + blocks`` int32
    counters (zeroed by every call)."""
    blocks = _blocks(n_tokens)
    return token_groups(n_tokens) * streams * dim + blocks * BWD_TOKENS * _chunks(dim)[1] * streams + 1 + blocks


def launch(dout, x, kv, weight, saved, dx, dkv, dweight, workspace, *, clamp: float,
           serial: bool | None = None) -> None:
    """``workspace`` fp32 contiguous with at least ``workspace_elements(N, S, D)`` elements (overwritten).

    ``serial``: one program per token group takes all chunks of D (no program waits for
    another; the same arithmetic, so bitwise the same results). The interpreter, which runs
    programs one after another, needs it; the default is serial exactly for CPU tensors.
    """
    n, streams, dim = backward_shape(dout, x, kv, weight, saved, dx, dkv, dweight, workspace)
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
    kernel = _engram_bwd_looped_kernel if LOOPED else _engram_bwd_kernel
    kernel[(n_chunks // per_program * groups,)](
        dout, x, kv, weight, saved, dx, dkv, gpart, partials, sync.view(torch.int32),
        n, groups, clamp,
        dout.stride(0), x.stride(0), kv.stride(0), dx.stride(0), dkv.stride(0),
        dim=dim, STREAMS=streams, BLOCK_S=pow2(streams), BLOCK_D=block_d, N_CHUNKS=n_chunks,
        BLOCK_C=pow2(n_chunks), TOKENS=BWD_TOKENS, CHUNKS_PER_PROGRAM=per_program, LOOKAHEAD=LOOKAHEAD,
        **({} if LOOPED else dict(SYNC=SYNC, LOCAL_SUMS=LOCAL_SUMS)),
        num_warps=BWD_WARPS,
    )
    cols = streams * dim
    dweight_kernel[(triton.cdiv(cols, SUM_BLOCK),)](partials, dweight, groups, cols, BLOCK_P=pow2(GROUPS),
                                                    BLOCK=SUM_BLOCK, num_warps=NUM_WARPS)


def _check_coresident(device, n_chunks: int) -> None:
    """A token's chunk programs wait for each other: at least that many must run at once (one per SM)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if sms < n_chunks:
        raise ValueError(f"x: the backward runs the {n_chunks} chunk programs of a token at once and needs as many "
                         f"SMs; {device} has {sms}")
