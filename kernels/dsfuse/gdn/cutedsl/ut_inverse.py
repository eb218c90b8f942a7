"""The ungated UT inverse of every chunk and value head, in CuTe DSL: step 1 of the fused
CuTe DSL forward's record (docs/ops/gdn_forward.md), run by `dsfuse.gdn.cutedsl.forward` for
`chunk_gdn`.

For chunk ``c`` (tokens ``start .. end`` of one document, at most ``CHUNK = 64``) and value head
``hv`` (qk head ``hv // (HV // H)``)::

    M = diag(beta) strictly_lower(k k^T)        (k L2-normalised in fp32 when asked)
    A = (I + M)^-1                              unit lower triangular, fp32

written as row ``i`` of the chunk at token ``start + i``: ``a`` fp32 ``[T, HV, 64]``, like the Triton
``wy`` stage's ``A`` but without the gate. The gate enters exactly afterwards: with ``D = diag(e^G)``,
``(I + D M D^-1)^-1 = D (I + M)^-1 D^-1``, so the gated inverse is ``A * Gamma`` elementwise,
``Gamma_ij = exp(G_i - G_j)`` (``dsfuse.gdn.reference.ut_transform`` with ``g_cum`` zero is this
``A``).

The gating form (``g`` given, as `chunk_gdn` runs it) also makes the chunk-local cumulative gate
``G = cumsum(g)`` (`dsfuse.gdn.cutedsl.chunk.cumulative_gate`, the fused forward's scan), writes it
to ``g_cum``, and writes ``A * Gamma`` (zeros above the diagonal) in place of ``A``: the gated ``A``
the fused forward reads and the Triton backward stages keep, made where ``A`` is made, in the same
bytes, so the fused forward neither scans, gates nor saves.

One CTA per (chunk, qk head), for all the value heads of that qk head (64 threads a head, up to 4
heads a pass, `heads_per_pass`: 192 threads at 3 heads). The first 4 warps stage the chunk's k rows
in shared memory (16-byte ``cp.async`` when k's rows are 16-byte aligned, `vector_reads`), the rows'
L2-norm scales and the Gram matrix ``k k^T`` once (``mma.sync`` with fp32 accumulation for bf16 /
fp16 keys, whose products are exact in fp32; fp32 dot products in a fixed order for fp32 keys), its
columns times the scales (``k`` itself is never rounded after normalising). Then per value head,
with ``m_i = beta_i rstd_i`` and ``G`` the column-scaled Gram matrix (``M_ij = m_i G_ij``), the
inverse by blocks of 16:

1. the diagonal blocks ``D_b = (I + M_bb)^-1`` by forward substitution in registers, each thread its
   column of the block holding it;
2. then, a barrier before each, the rows of block ``a`` left of it,
   ``X_ab = -D_a m_a sum_{b <= c < a} G_ac X_cb``, shared by the head's 64 threads (a column's 16
   rows by the four lanes of a quad, exchanged by shuffles before ``D_a`` is applied; `_block_row`);
3. A's rows written by 16-byte pieces, zeros above the diagonal (`_write_rows`). Above the
   diagonal, the shared-memory ``A`` holds only the diagonal blocks' zeros (written in step 1 and
   read by the sums of step 2, which start at the column's own block); the rest of it is neither
   written nor read, and step 3 masks it.

k's rows share the storage of ``A`` (k is read only before the barrier ahead of A's first write),
so three CTAs fit an SM. No atomics: a fixed order everywhere, so a call is bitwise reproducible.
Padded rows of a partial chunk are zero (``beta`` = 0), so their rows of ``A`` are those of ``I``
and are not written.

The preparing form (``q``, ``a_round`` and ``factors`` given, as `chunk_gdn` runs it for the
role-split fused kernel, `dsfuse.gdn.cutedsl.fused_fwd_ws`) also makes what that kernel's state
chain made per chunk, off the chain: ``round(A * Gamma)`` in the input dtype (``a_round``, the same
rounding of the same fp32 values) and the rows' factors (``factors`` fp32 ``[NC * 8, HV, 64]``, row
``8 c + f`` of chunk ``c``: `FACTORS`), the L2-norm scales of the q rows among them (q's rows staged
in A's storage beside k's, summed as k's). Each factor is the fused kernel's own formula on the same
fp32 inputs (`dsfuse.gdn.cutedsl.fused_fwd_head.row_factors`), so its values are the ones the chain
made (a GPU test compares the two kernels' outputs bit for bit).
"""

from __future__ import annotations

import torch

from dsfuse._common import cutedsl as _cd

cutlass, cute = _cd.require()
from cutlass import Float32, Int32, const_expr

from dsfuse.gdn.cutedsl import chunk
from dsfuse.gdn.cutedsl import mma as _mma
from dsfuse.gdn.cutedsl.chunk import (
    CHUNK,
    DTYPES,
    L2NORM_EPS,
    THREADS,
    cell,
    lane_sum_squares,
)

MAX_HEADS_AT_ONCE = 4  # value heads solved together, a column of A a thread: at most 256 threads
WARPS = THREADS // 32  # the warps that load k and make its Gram matrix
BLOCK = 16  # the diagonal blocks of the blocked inverse
PIECE = 8  # A's rows leave in pieces of 8 columns (16 bytes of round(A), 32 of A), 8 pieces a row
PITCH = CHUNK + 4  # fp32 row pitch of the Gram matrix and A: 16-byte aligned rows, banks shifted 4 a row
HEAD_DIMS = (32, 64, 128)
# the rows' factors of the preparing form, a row of 64 each (``factors[8 c + f, hv, r]``): the
# cumulative gate, beta, exp(G) rstd_q (o), exp(G) rstd_k (X), exp(G_last - G) rstd_k (the state
# update), rstd_q and rstd_k (1 without the L2 norm; adjacent, the fused kernel reads them as one
# vector of 128), and a row of zeros (8 rows: one 16-byte piece a thread for 128 threads)
FACTORS = ("g_cum", "beta", "eg_q", "eg_k", "decay", "rstd_q", "rstd_k", "zero")
F_G, F_BETA, F_EGQ, F_EGK, F_DEC, F_RQ, F_RK, F_ZERO = range(len(FACTORS))


def shape_reasons(dtype: torch.dtype, heads: int, value_heads: int, dim_k: int) -> list[str]:
    """Why the kernel cannot be compiled for these sizes (empty when it can)."""
    reasons = []
    if dtype not in DTYPES:
        reasons.append(f"dtype {dtype} is not one of {sorted(map(str, DTYPES))}")
    if heads < 1 or value_heads % heads:
        reasons.append(f"value heads ({value_heads}) must be a multiple of the qk heads ({heads})")
    if dim_k not in HEAD_DIMS:  # the rows' scales are warp sums over 32 channels; ldmatrix reads 32-wide tiles
        reasons.append(f"head dim K = {dim_k} is not one of {HEAD_DIMS}")
    return reasons


def heads_per_pass(group: int) -> int:
    """Value heads solved at once (64 threads each): all of a qk head's when they are at most
    `MAX_HEADS_AT_ONCE`, else as few passes as that allows, evenly filled."""
    passes = -(-group // MAX_HEADS_AT_ONCE)
    return -(-group // passes)


class _UtInverse:
    """``(k [T, H, K], beta [T, HV], g fp32 [T, HV], chunk_indices int32 [NC, 3]) -> a fp32 [T, HV, 64],
    g_cum fp32 [T, HV]`` (``g`` read and ``g_cum`` written with ``gate`` only; else ``a`` is ungated);
    with ``prepare`` (and ``gate``), ``q [T, H, K] -> a_round [T, HV, 64], factors fp32 [NC * 8, HV, 64]``
    too (module docstring)."""

    def __init__(self, dtype: torch.dtype, heads: int, value_heads: int, dim_k: int, l2norm: bool, aligned: bool,
                 gate: bool = False, prepare: bool = False, keep_a: bool = True):
        self.dtype, self.heads, self.value_heads, self.dim_k, self.l2norm, self.gate = (
            DTYPES[dtype], heads, value_heads, dim_k, l2norm, gate)
        self.prepare, self.keep_a = prepare, keep_a
        self.vector_rows = aligned and dtype != torch.float32  # k's rows by 16-byte cp.async
        if prepare and not (gate and self.vector_rows):
            raise ValueError("the preparing UT inverse gates, and reads 16-bit q and k rows by 16-byte copies")
        if not (keep_a or prepare):
            raise ValueError("the UT inverse writes A unless it prepares (A is then kept only for a backward)")
        self.slots = heads_per_pass(value_heads // heads)
        self.threads = max(THREADS, CHUNK * self.slots)

    @cute.jit
    def __call__(self, mK: cute.Tensor, mBeta: cute.Tensor, mG: cute.Tensor, mChunks: cute.Tensor, mA: cute.Tensor,
                 mGc: cute.Tensor, mQ: cute.Tensor, mAr: cute.Tensor, mF: cute.Tensor, stream):
        self.kernel(mK, mBeta, mG, mChunks, mA, mGc, mQ, mAr, mF).launch(grid=[mChunks.shape[0], self.heads, 1],
                                                                         block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mK: cute.Tensor, mBeta: cute.Tensor, mG: cute.Tensor, mChunks: cute.Tensor, mA: cute.Tensor,
               mGc: cute.Tensor, mQ: cute.Tensor, mAr: cute.Tensor, mF: cute.Tensor):
        K, C, GROUP, SLOTS = self.dim_k, CHUNK, self.value_heads // self.heads, self.slots
        tidx, _, _ = cute.arch.thread_idx()
        i_c, i_h, _ = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        start = mChunks[i_c, 1]
        rows = mChunks[i_c, 2] - start
        tensor_cores = const_expr(self.dtype is not Float32)
        kt = self.dtype

        smem = cutlass.memory.SmemAllocator()
        sG = smem.allocate_tensor(Float32, cute.make_layout((C, C), stride=(PITCH, 1)), byte_alignment=16)
        # k's rows (and, preparing with the L2 norm, q's after them) share A's storage: they are read
        # only before the barrier that precedes A's first write (so three CTAs fit an SM)
        a_layout = cute.make_layout((SLOTS, C, C), stride=(C * PITCH, PITCH, 1))
        if const_expr(tensor_cores):  # swizzled for ldmatrix
            k_layout, k_bytes = _mma.swizzled_layout(C, K), C * K * kt.width // 8
        else:  # fp32 keys: a row pitch of K + 1 words, so the dot products' column reads hit distinct banks
            k_layout, k_bytes = cute.make_layout((C, K), stride=(K + 1, 1)), C * (K + 1) * 4
        with_q = const_expr(self.prepare and self.l2norm)
        shared = smem.allocate(max(SLOTS * C * PITCH * 4, 2 * k_bytes if with_q else k_bytes), 1024)
        sA = cute.make_tensor(cute.recast_ptr(shared, dtype=Float32), a_layout)
        sK = cute.make_tensor(cute.recast_ptr(shared, dtype=kt), k_layout)
        sQ = cute.make_tensor(cute.recast_ptr(shared + k_bytes, dtype=kt), k_layout)
        sRow = smem.allocate_tensor(Float32, cute.make_layout((SLOTS, C)), byte_alignment=16)
        sRstd = smem.allocate_tensor(Float32, cute.make_layout((C,)), byte_alignment=16)
        sRstdQ = smem.allocate_tensor(Float32, cute.make_layout((C,)), byte_alignment=16)  # preparing, L2 norm
        sGate = smem.allocate_tensor(Float32, cute.make_layout((SLOTS, C)), byte_alignment=16)  # gate: G per head

        # the first pass's beta (and, gating, g) of row `col` of value head `slot`, read while k arrives
        slot, col = tidx // C, tidx % C
        beta, gate = Float32(0.0), Float32(0.0)
        if slot < SLOTS and col < rows:
            beta = mBeta[start + col, i_h * GROUP + slot].to(Float32)
            if const_expr(self.gate):
                gate = mG[start + col, i_h * GROUP + slot]

        # 1.-2. by the first 4 warps: the chunk's k rows (zeros past its end) in k's dtype, the rows'
        #    rstd (1 without the L2 norm), their Gram matrix k k^T with its columns scaled by rstd_j
        #    (G_ij rstd_j: once for every value head). Aligned 16-bit rows come by 16-byte cp.async,
        #    and each thread sums the squares of the pieces it copied (`chunk.row_scales`); otherwise
        #    element by element, and after the barrier the same sums in the same order (fp32 keys: a
        #    warp per row and a butterfly sum, the same bits on every lane).
        if const_expr(self.vector_rows):
            copy_k = chunk.copy_rows(kt, K, THREADS)
        if tidx < THREADS:
            if const_expr(self.vector_rows):
                chunk.start_rows(copy_k, tidx, mK, sK, start, rows, i_h)
                if const_expr(with_q):
                    chunk.start_rows(copy_k, tidx, mQ, sQ, start, rows, i_h)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
                if const_expr(self.l2norm):  # this thread's own pieces: no barrier before
                    chunk.row_scales(copy_k, tidx, sK, sRstd, 0)
                if const_expr(with_q):  # the fused kernel's sums of the same pieces: the same bits
                    chunk.row_scales(copy_k, tidx, sQ, sRstdQ, 0)
            else:
                for item in cutlass.range(C * K // THREADS, unroll_full=True):  # all loads in flight at once
                    r, c = cell(tidx, item, K)
                    value = kt(0.0)
                    if r < rows:
                        value = mK[start + r, i_h, c]
                    sK[r, c] = value
        cute.arch.sync_threads()
        if tidx < THREADS:
            if const_expr(self.l2norm and not self.vector_rows):
                if const_expr(tensor_cores):  # the 16-byte path's sums, in its order: the same bits
                    chunk.row_scales(chunk.copy_rows(kt, K, THREADS), tidx, sK, sRstd, 0)
                else:
                    for rr in cutlass.range_constexpr(C // WARPS):
                        r = warp * (C // WARPS) + rr
                        total = cute.arch.warp_reduction(lane_sum_squares(sK, r, lane), lambda a, b: a + b)
                        if lane == 0:
                            sRstd[r] = cute.math.rsqrt(total + Float32(L2NORM_EPS))
            if const_expr(tensor_cores):
                mma = _mma.tiled_mma(kt, ldmatrix=True)
                acc = _mma.accumulator(mma, tidx, (C, C))
                _mma.gemm_ldmatrix(mma, acc, _mma.ldmatrix_operands(mma, tidx, sK, sK, False, False))
                if const_expr(self.l2norm and self.vector_rows):  # the scales are in: scale the columns here
                    coords = _mma.coordinates(mma, tidx, (C, C))
                    for e in cutlass.range_constexpr(cute.size(acc)):
                        acc[e] = acc[e] * sRstd[coords[e][1]]
                _mma.store(mma, tidx, acc, sG)
            else:
                for item in cutlass.range(C * C // THREADS):
                    i, j = cell(tidx, item, C)
                    dot = Float32(0.0)
                    if j < i:
                        for c in cutlass.range(K):
                            dot = dot + sK[i, c] * sK[j, c]
                    sG[i, j] = dot
        if const_expr(self.l2norm and not self.vector_rows):
            cute.arch.sync_threads()
            if tidx < THREADS:
                for item in cutlass.range(C * C // THREADS, unroll=4):
                    i, j = cell(tidx, item, C)
                    if j < i:
                        sG[i, j] = sG[i, j] * sRstd[j]

        for base in cutlass.range_constexpr(0, GROUP, SLOTS):
            i_hv = i_h * GROUP + base + slot
            active = slot < SLOTS and base + slot < GROUP
            if const_expr(base > 0):  # the last pass's reads of sRow and sA are done; this pass's beta
                cute.arch.sync_threads()
                beta, gate = Float32(0.0), Float32(0.0)
                if active and col < rows:
                    beta = mBeta[start + col, i_hv].to(Float32)
                    if const_expr(self.gate):
                        gate = mG[start + col, i_hv]
            # 3. per value head: m_r = beta_r rstd_r of row r = col, 0 past the chunk's end; gate: g of
            #    row col (0 past the end: G stays flat there), then its cumulative sum by the head's
            #    first warp (its threads' diagonal blocks wait for it; the barrier after them orders it)
            if active:
                if const_expr(self.l2norm):
                    sRow[slot, col] = beta * sRstd[col]
                else:
                    sRow[slot, col] = beta
                if const_expr(self.gate):
                    sGate[slot, col] = gate
            cute.arch.sync_threads()
            if const_expr(self.gate):
                if active and col < 32:
                    chunk.cumulative_gate(col, sGate[slot, None])
            # 4. A = (I + M)^-1, M_ij = m_i G_ij rstd_j for j < i, by blocks of 16: each thread its
            #    column's diagonal block, then (a barrier between) each block's rows left of it
            if active:
                _diagonal_block(sG, sRow[slot, None], sA[slot, None, None], col)
            for blk in cutlass.range_constexpr(1, C // BLOCK):
                cute.arch.sync_threads()  # the rows above (and the diagonal block, the gate's scan) done
                if active:
                    _block_row(sG, sRow[slot, None], sA[slot, None, None], col, blk)
            if active and const_expr(self.gate):  # the scan's G (after the first barrier above)
                g_col = sGate[slot, col]
                if col < rows:
                    mGc[start + col, i_hv] = g_col
                if const_expr(self.prepare):
                    self._factors(mF, i_c, i_hv, col, rows, beta, sGate[slot, None], sRstdQ, sRstd)
            # 5. every row solved: the head's rows of A leave by 16-byte pieces, thread `col` the
            #    8 columns 8 (col % 8) .. and the rows col // 8 + 8 j, zeros above the diagonal;
            #    gate: times exp(G_i - G_c) on and below it (the fused forward's former formula)
            cute.arch.sync_threads()
            if active:
                self._write_rows(mA, mAr, sA[slot, None, None], sGate[slot, None], start, rows, i_hv, col)

    @cute.jit
    def _write_rows(self, mA: cute.Tensor, mAr: cute.Tensor, sA: cute.Tensor, sGate: cute.Tensor, start: Int32,
                    rows: Int32, i_hv: Int32, t: Int32):
        """Thread ``t``'s pieces of one head's rows (step 5): columns ``c0 .. c0 + 7``, ``c0 = 8 (t % 8)``,
        of rows ``t // 8 + 8 j`` below ``rows``; fp32 into ``mA`` (kept) and rounded into ``mAr``
        (preparing)."""
        c0 = (t % PIECE) * PIECE
        g_cols = cute.make_rmem_tensor((PIECE,), Float32)
        if const_expr(self.gate):
            for j in cutlass.range_constexpr(PIECE):
                g_cols[j] = sGate[c0 + j]
        # unrolled by 2: 8 live values a row (the bound of `test_three_ctas_fit_an_sm`)
        for j in cutlass.range(CHUNK // PIECE, unroll=2):
            i = t // PIECE + PIECE * j
            if i < rows:
                piece = cute.make_rmem_tensor((PIECE,), Float32)
                if const_expr(self.gate):
                    g_row = sGate[i]
                    for e in cutlass.range_constexpr(PIECE):
                        value = Float32(0.0)
                        if c0 + e <= i:
                            value = sA[i, c0 + e] * chunk.exp(g_row - g_cols[e])
                        piece[e] = value
                else:
                    for e in cutlass.range_constexpr(PIECE):
                        value = Float32(0.0)
                        if c0 + e <= i:
                            value = sA[i, c0 + e]
                        piece[e] = value
                if const_expr(self.keep_a):
                    cute.autovec_copy(piece, _piece(mA[start + i, i_hv, None], t % PIECE))
                if const_expr(self.prepare):
                    rounded = cute.make_rmem_tensor((PIECE,), mAr.element_type)
                    rounded.store(piece.load().to(mAr.element_type))
                    cute.autovec_copy(rounded, _piece(mAr[start + i, i_hv, None], t % PIECE))

    @cute.jit
    def _factors(self, mF: cute.Tensor, i_c: Int32, i_hv: Int32, r: Int32, rows: Int32, beta: Float32,
                 sG: cute.Tensor, sRstdQ: cute.Tensor, sRstdK: cute.Tensor):
        """Row ``r``'s factors (`FACTORS`) of chunk ``i_c`` and value head ``i_hv`` into ``mF``: the fused
        kernel's formulas (`dsfuse.gdn.cutedsl.fused_fwd_head.row_factors`) on the same values, past
        the chunk's ``rows`` too, as that kernel made them: G there is the last real row's, as read
        (the scan's own sums past the end may differ from it in the last bit), beta 0, the scales those
        of zero rows."""
        g_last = sG[rows - 1]
        g = g_last
        if r < rows:
            g = sG[r]
        eg, dec = chunk.exp(g), chunk.exp(g_last - g)
        rq, rk = Float32(1.0), Float32(1.0)
        if const_expr(self.l2norm):
            rq, rk = sRstdQ[r], sRstdK[r]
        row = i_c * len(FACTORS)
        for f, value in ((F_G, g), (F_BETA, beta), (F_EGQ, eg * rq), (F_EGK, eg * rk), (F_DEC, dec * rk),
                         (F_RQ, rq), (F_RK, rk), (F_ZERO, Float32(0.0))):
            mF[row + f, i_hv, r] = value


def _piece(row: cute.Tensor, index) -> cute.Tensor:
    """Piece ``index`` (`PIECE` contiguous columns) of a row of 64, as a ``(PIECE,):(1,)`` tensor."""
    return cute.make_tensor(cute.zipped_divide(row, (PIECE,))[None, index].iterator, cute.make_layout((PIECE,)))


@cute.jit
def _diagonal_block(sG: cute.Tensor, sM: cute.Tensor, sA: cute.Tensor, col: Int32):
    """Column ``col`` of the inverse of the diagonal block holding it, ``(I + M_bb)^-1``, by forward
    substitution in registers, into ``sA`` with zeros above the diagonal. ``sM``: the rows' factors
    ``m``."""
    b0 = col - col % BLOCK  # first row and column of the block
    local = col - b0
    x = []
    for i in cutlass.range_constexpr(BLOCK):
        r = b0 + i
        total = Float32(0.0)  # the sum over j < i; the column's x_j are zero above its diagonal
        for j in cutlass.range_constexpr(i):
            total = total + sG[r, b0 + j] * x[j]
        xi = -(sM[r] * total)
        if i == local:
            xi = Float32(1.0)
        elif i < local:
            xi = Float32(0.0)
        x.append(xi)
        sA[r, col] = xi


@cute.jit
def _block_row(sG: cute.Tensor, sM: cute.Tensor, sA: cute.Tensor, t: Int32, blk: cutlass.Constexpr):
    """The rows of block ``blk`` left of its diagonal block, ``X = -(I + M_aa)^-1 Y``,
    ``Y_r = m_r sum_k G_rk A_k,col`` over the rows ``16 u <= k < 16 blk`` of a column in block ``u``
    (A is zero above that block: those entries of ``sA`` are never written, and never read here),
    by a head's 64 threads, work shared evenly: column ``col`` (of ``16 blk``) and its rows
    ``r = rg + 4 j`` (``j < 4``) are lane ``rg`` of a quad, thread ``t`` taking the columns
    ``t // 4 + 16 u`` (``u < blk``: column block ``u``, known at compile time), the quad's ``Y``
    exchanged by shuffles. Terms in ``k`` and in ``D_a``'s columns ascending, as a thread per column
    took them (the same sums). Nothing is written right of the diagonal block (step 5 writes zeros
    there)."""
    r0 = blk * BLOCK
    rg, quad = t % 4, (t % 32) - t % 4  # the quad's lanes hold one column's 16 rows, 4 each
    cols = [t // 4 + BLOCK * u for u in range(blk)]
    total = [[Float32(0.0)] * 4 for _ in range(blk)]
    for k in cutlass.range_constexpr(r0):  # k outer: a row's G_rk read once for every column taking it
        g_k = [sG[r0 + rg + 4 * j, k] for j in range(4)]
        for u in cutlass.range_constexpr(k // BLOCK + 1):
            a_k = sA[k, cols[u]]
            for j in cutlass.range_constexpr(4):
                total[u][j] = total[u][j] + g_k[j] * a_k
    for u in cutlass.range_constexpr(blk):
        y = [sM[r0 + rg + 4 * j] * total[u][j] for j in range(4)]
        y_all = [cute.arch.shuffle_sync(y[r // 4], quad + r % 4) for r in range(BLOCK)]
        for j in cutlass.range_constexpr(4):  # the unit lower triangular inverse of the diagonal block
            r = rg + 4 * j
            x = y[j]
            for i in cutlass.range_constexpr(BLOCK - 1):
                if i < r:
                    x = x + sA[r0 + r, r0 + i] * y_all[i]
            sA[r0 + r, cols[u]] = -x


CACHE = _cd.KernelCache()  # (dtype, H, HV, K, l2norm, aligned, gate, arch) -> compiled function


def _fake_tensors(dtype: torch.dtype, heads: int, value_heads: int, dim_k: int, aligned: bool) -> tuple:
    """Fake tensors of the compiled signature: symbolic tokens and chunks, any token and head strides
    (with ``aligned``, k's base and strides 16-byte aligned); ``g`` and ``g_cum`` any strides and
    their own token count (empty when the kernel does not gate)."""
    cdt = DTYPES[dtype]
    tokens, chunks = cute.sym_int(), cute.sym_int()
    vector = 16 // dtype.itemsize if aligned else 1
    k = cute.runtime.make_fake_tensor(cdt, (tokens, heads, dim_k), (cute.sym_int64(divisibility=vector),
                                                                    cute.sym_int64(divisibility=vector), 1),
                                      assumed_align=16 if aligned else None)
    beta = cute.runtime.make_fake_tensor(cdt, (tokens, value_heads), (cute.sym_int64(), cute.sym_int64()))
    table = cute.runtime.make_fake_tensor(Int32, (chunks, 3), (3, 1))
    # its own length: an empty stand-in when the preparing form keeps no A
    a = cute.runtime.make_fake_tensor(Float32, (cute.sym_int(), value_heads, CHUNK), (value_heads * CHUNK, CHUNK, 1),
                                      assumed_align=16)
    gate_tokens = cute.sym_int()

    def gates():
        return cute.runtime.make_fake_tensor(Float32, (gate_tokens, value_heads), (cute.sym_int64(), cute.sym_int64()))

    # the preparing form's q (k's strides and alignment, its own tokens), a_round and factors (each
    # with its own length: empty stand-ins when the kernel does not prepare)
    q = cute.runtime.make_fake_tensor(cdt, (cute.sym_int(), heads, dim_k), (cute.sym_int64(divisibility=vector),
                                                                            cute.sym_int64(divisibility=vector), 1),
                                      assumed_align=16 if aligned else None)
    a_round = cute.runtime.make_fake_tensor(cdt, (cute.sym_int(), value_heads, CHUNK), (value_heads * CHUNK, CHUNK, 1),
                                            assumed_align=16)
    factors = cute.runtime.make_fake_tensor(Float32, (cute.sym_int(), value_heads, CHUNK),
                                            (value_heads * CHUNK, CHUNK, 1))
    return k, beta, gates(), table, a, gates(), q, a_round, factors


def compile_ut_inverse(dtype: torch.dtype, heads: int, value_heads: int, dim_k: int, l2norm: bool, arch: str, *,
                       aligned: bool = True, gate: bool = False, prepare: bool = False, keep_a: bool = True,
                       keep_ptx: bool = False, dump_dir: str | None = None, keep_cubin: bool = False):
    """The kernel for one configuration, compiled for ``arch`` (``sm_90a``, ``sm_100a``; no GPU needed).
    Called as ``fn(k, beta, g, chunk_indices, a, g_cum, q, a_round, factors)`` with torch tensors, on
    the current torch stream; ``aligned``: for a ``k`` (and ``q``) whose base and token and head strides
    are multiples of 16 bytes (`vector_reads`), read by 16-byte copies (the same values as element by
    element); ``gate``: the gating form (module docstring), else ``g`` and ``g_cum`` are not touched;
    ``prepare`` (with ``gate`` and ``aligned``): the preparing form, else ``q``, ``a_round`` and
    ``factors`` are not touched; ``keep_a`` False (preparing only): ``a`` is not written (a forward
    whose backward will not run)."""
    if reasons := shape_reasons(dtype, heads, value_heads, dim_k):
        raise ValueError("the CuTe DSL UT inverse cannot compile this: " + "; ".join(reasons))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return _cd.compile(_UtInverse(dtype, heads, value_heads, dim_k, l2norm, aligned, gate, prepare, keep_a),
                       *_fake_tensors(dtype, heads, value_heads, dim_k, aligned), stream, arch=arch,
                       keep_ptx=keep_ptx, dump_dir=dump_dir, keep_cubin=keep_cubin)


def vector_reads(k: torch.Tensor) -> bool:
    """Whether ``k``'s base and token and head strides are multiples of 16 bytes (the 16-byte reads)."""
    return k.data_ptr() % 16 == 0 and all(s * k.element_size() % 16 == 0 for s in k.stride()[:2])


def launch_ut_inverse(k: torch.Tensor, beta: torch.Tensor, chunk_indices: torch.Tensor, a: torch.Tensor | None, *,
                      use_qk_l2norm: bool = False, g: torch.Tensor | None = None,
                      g_cum: torch.Tensor | None = None, q: torch.Tensor | None = None,
                      a_round: torch.Tensor | None = None, factors: torch.Tensor | None = None) -> torch.Tensor:
    """Write the ungated ``A`` of every chunk into ``a`` fp32 ``[T, HV, 64]`` (contiguous) and return it;
    with ``g`` (fp32 ``[T, HV]``, per-token log decay), the gated ``A * Gamma`` instead and the
    chunk-local cumulative gate into ``g_cum`` (fp32 ``[T, HV]``; both given or neither); with ``q``,
    ``a_round`` and ``factors`` too (all three or none; gating only), the preparing form's
    ``round(A * Gamma)`` into ``a_round`` (``[T, HV, 64]`` in k's dtype, contiguous) and the rows'
    factors into ``factors`` (fp32 ``[NC * 8, HV, 64]``, contiguous: `FACTORS`); ``a`` may then be
    None: no ``A`` is kept (a forward whose backward will not run; the same ``a_round`` and factors).

    ``k`` ``[T, H, K]`` (unit channel stride), ``beta`` ``[T, HV]`` in k's dtype, ``chunk_indices``
    int32 ``[NC, 3]`` contiguous (`dsfuse.gdn.reference.prepare_chunk_indices`); preparing, ``q``
    like ``k``, and both 16-bit with 16-byte aligned rows (`vector_reads`). Rows of ``a``, ``a_round``
    and ``g_cum`` at tokens in no chunk are not written."""
    tokens, heads, dim_k = k.shape
    value_heads = beta.shape[1]
    keep_a = a is not None
    if not keep_a and factors is None:
        raise ValueError("launch_ut_inverse: a is None only with the preparing form (q, a_round, factors)")
    if not keep_a:
        a = k.new_empty((0, value_heads, CHUNK), dtype=torch.float32)  # not written: the signature's stand-in
    elif a.shape != (tokens, value_heads, CHUNK):
        raise ValueError(f"launch_ut_inverse: a must be [T, HV, 64] {(tokens, value_heads, CHUNK)}, got {tuple(a.shape)}")
    if (k.stride(-1) != 1 or beta.dtype != k.dtype or not a.is_contiguous() or a.dtype != torch.float32
            or a.data_ptr() % 16):
        raise ValueError("launch_ut_inverse: k needs unit channel stride, beta k's dtype, a contiguous fp32 with a "
                         "16-byte aligned base (its rows leave by 16-byte stores)")
    gate = g is not None
    if (g_cum is not None) != gate or gate and any(x.dtype != torch.float32 or x.shape != beta.shape
                                                   for x in (g, g_cum)):
        raise ValueError(f"launch_ut_inverse: g and g_cum both or neither, fp32 {tuple(beta.shape)} (beta's shape)")
    prepare = factors is not None
    if prepare or q is not None or a_round is not None:
        _check_prepared(k, q, a, a_round, factors, chunk_indices, gate)
    if chunk_indices.shape[0] == 0:
        return a if keep_a else None
    if not gate:  # not read: empty stand-ins of the compiled signature's types
        g = g_cum = a.new_empty((0, value_heads))
    if not prepare:
        q, a_round, factors = k, k.new_empty((0, value_heads, CHUNK)), a.new_empty((0, value_heads, CHUNK))
    _launch(k, beta, g, chunk_indices, a, g_cum, q, a_round, factors, use_qk_l2norm, gate, prepare, keep_a)
    return a if keep_a else None


def _launch(k, beta, g, chunk_indices, a, g_cum, q, a_round, factors, use_qk_l2norm: bool, gate: bool, prepare: bool,
            keep_a: bool):
    """The kernel's launch on arguments `launch_ut_inverse` checked (or that its caller made and
    checked as it does: `dsfuse.gdn.cutedsl.forward`, which checks an eager call's inputs once for
    its launches), with its stand-ins in place: no checks here."""
    _, heads, dim_k = k.shape
    vector = vector_reads(k)
    arch = _cd.arch_of(k.device)
    fn = CACHE.get((k.dtype, heads, beta.shape[1], dim_k, use_qk_l2norm, vector, gate, prepare, keep_a, arch),
                   lambda: compile_ut_inverse(k.dtype, heads, beta.shape[1], dim_k, use_qk_l2norm, arch,
                                              aligned=vector, gate=gate, prepare=prepare, keep_a=keep_a))
    fn(k, beta, g, chunk_indices, a, g_cum, q, a_round, factors)


def _check_prepared(k, q, a, a_round, factors, chunk_indices, gate: bool):
    """The preparing form's arguments (`launch_ut_inverse`), each wrong one named before any launch."""
    if q is None or a_round is None or factors is None or not gate:
        raise ValueError("launch_ut_inverse: q, a_round and factors all or none, and only with g (the gating form)")
    problems = [] if q.device == k.device else [f"q must be on k's device {k.device} (got {q.device})"]
    if q.shape != k.shape or q.dtype != k.dtype or k.dtype == torch.float32:
        problems.append(f"q must be k's shape {tuple(k.shape)} and 16-bit dtype (got {tuple(q.shape)} {q.dtype})")
    problems += [f"{name} needs a 16-byte aligned base and token and head strides" for name, x in (("q", q), ("k", k))
                 if x.stride(-1) != 1 or not vector_reads(x)]
    problems += prepared_reasons(a_round, factors, k.shape[0], a.shape[1], chunk_indices.shape[0], k.dtype, k.device)
    if problems:
        raise ValueError("launch_ut_inverse: " + "; ".join(problems))


def prepared_reasons(a_round, factors, tokens: int, value_heads: int, chunks: int, dtype: torch.dtype,
                     device: torch.device) -> list[str]:
    """What is wrong with the preparing form's ``a_round`` and ``factors`` (empty when nothing): they
    must be contiguous ``[T, HV, 64]`` in the inputs' dtype and fp32 ``[NC * 8, HV, 64]``, on the
    inputs' device, 16-byte aligned (the fused kernel's 16-byte copies). Checked by the inverse that
    writes them and the fused kernel that reads them."""
    problems = []
    for name, x, shape, want in (("a_round", a_round, (tokens, value_heads, CHUNK), dtype),
                                 ("factors", factors, (chunks * len(FACTORS), value_heads, CHUNK), torch.float32)):
        if x.shape != shape or x.dtype != want or not x.is_contiguous() or x.data_ptr() % 16:
            problems.append(f"{name} must be contiguous {shape} {want}, 16-byte aligned (got {tuple(x.shape)} "
                            f"{x.dtype})")
        if x.device != device:
            problems.append(f"{name} must be on the inputs' device {device} (got {x.device})")
    return problems


def _aot_specs() -> list[_cd.CuteAotSpec]:
    """The model's specialisation: H = 16, HV = 48, K = 128, bf16, with and without the L2 norm, ungated,
    gating and preparing (`chunk_gdn`'s, on sm_90a and elsewhere)."""
    forms = {"": (False, False), "_gate": (True, False), "_prepare": (True, True)}
    return [_cd.CuteAotSpec(f"gdn_ut_inverse{name}_bf16{'_l2' if l2 else ''}",
                            lambda arch, dump_dir=None, l2=l2, gate=gate, prepare=prepare: compile_ut_inverse(
                                torch.bfloat16, 16, 48, 128, l2, arch, gate=gate, prepare=prepare, keep_ptx=True,
                                dump_dir=dump_dir))
            for name, (gate, prepare) in forms.items() for l2 in (True, False)]


AOT_SPECS = _aot_specs()
