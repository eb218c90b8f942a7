"""What the CuTe DSL Gated DeltaNet kernels do to a chunk alike (chunks of ``C = 64``; the helpers
below for 128 threads): `ChainKernel`, the signature and grid of a fused forward (one CTA per
document, value head and ``BV`` value channels, or all of them in the per-head form); `cell`, the element of a row-major tile a thread takes on a pass; `load_chunk`, the chunk's q, k, A0
rows, g and beta into shared memory (`load_gates` the last two; `read_gates` them into registers, for
a later store); `cumulative_gate`, a chunk's cumulative gate by a warp scan; `rstd_and_cumsum`, the rows' L2-norm scales and the chunk-local
cumulative gate; `normalize_and_gates`, the normalised rows (rounded to the tiles' dtype) and the gate
vectors; `copy_rows`, `start_rows`, `start_prepared_rows`, `store_rows`, `store_tile`, `row_scales`, rows moved in 16-byte pieces (and the
L2-norm scales of the pieces a thread moved). Each is traced into the calling kernel; the caller places
the barriers between them."""

from __future__ import annotations

import torch

from dsfuse._common import cutedsl as _cd

cutlass, cute = _cd.require()
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

CHUNK = 64
THREADS = 128
BV = 32  # value channels per CTA of a fused forward
L2NORM_EPS = 1e-6  # dsfuse.gdn.reference.L2NORM_EPS
DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: Float32}
LOG2E = 1.4426950408889634


def exp(x):
    """``e^x`` as every CuTe DSL GDN kernel takes it (the gates' decays and the factors): ``2^(x log2 e)``
    on the special-function unit (``ex2.approx``, a multiply and one ``MUFU.EX2``, where the accurate
    ``expf`` is about ten instructions; it sits in the inverse's write loop and the output's ``q k^T``
    gating). Within a few ulp of ``e^x`` below 1 (the decays' range: ``x <= 0``), results under fp32's
    normal range flushed to zero; one function, so every form and the inverse make the same bits."""
    return cute.math.exp2(x * Float32(LOG2E), fastmath=True)


class ChainKernel:
    """A fused forward ``(q, k, v, g, beta, a, chunk_indices, chunk_offsets, order, h0, ht, o, g_cum, scale)``
    that writes ``o`` and ``ht`` (a form that reads a gated ``a`` reads the cumulative gate from
    ``g_cum`` in place of ``g``): grid (V / block_v, HV, M) of ``threads`` threads (``BV`` and
    ``THREADS`` unless a subclass says otherwise), ``M = len(order)``: CTA ``(.., .., z)`` walking document
    ``order[z]`` (all documents longest first, `dsfuse.gdn.schedule.document_order`, or some of them:
    `dsfuse.gdn.cutedsl.forward`'s stages); a subclass defines ``kernel``."""

    threads = THREADS

    def __init__(self, dtype: torch.dtype, heads: int, value_heads: int, dim_k: int, dim_v: int, l2norm: bool):
        self.dtype, self.heads, self.value_heads, self.dim_k, self.dim_v, self.l2norm = (
            DTYPES[dtype], heads, value_heads, dim_k, dim_v, l2norm)
        self.block_v = BV

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                 mA: cute.Tensor, mChunks: cute.Tensor, mOffsets: cute.Tensor, mOrder: cute.Tensor, mH0: cute.Tensor,
                 mHt: cute.Tensor, mO: cute.Tensor, mGc: cute.Tensor, scale: Float32, stream):
        grid = [self.dim_v // self.block_v, self.value_heads, mOrder.shape[0]]
        self.kernel(mQ, mK, mV, mG, mBeta, mA, mChunks, mOffsets, mOrder, mH0, mHt, mO, mGc, scale).launch(
            grid=grid, block=[self.threads, 1, 1], stream=stream)


def tile(smem, dtype, rows: int, cols: int, stages: int = 1):
    """A row-major ``[rows, cols]`` shared-memory tile, or ``stages`` of them one after the other
    (``[rows, cols, stages]``: a stage is ``t[None, None, s]``)."""
    if stages == 1:
        layout = cute.make_layout((rows, cols), stride=(cols, 1))
    else:
        layout = cute.make_layout((rows, cols, stages), stride=(cols, 1, rows * cols))
    return smem.allocate_tensor(dtype, layout, byte_alignment=16)


def vector(smem, length: int):
    """An fp32 shared-memory vector."""
    return smem.allocate_tensor(Float32, cute.make_layout((length,)), byte_alignment=16)


def lane_sum_squares(sX: cute.Tensor, r, lane):
    """Lane ``lane``'s part of row ``r``'s sum of squares (channels ``lane, lane + 32, ..``, in fp32):
    a warp's butterfly sum of it (``cute.arch.warp_reduction``) is the row's, the same on every lane."""
    total = Float32(0.0)
    for j in range(cute.size(sX, mode=[1]) // 32):  # unrolled as the kernel is traced
        x = sX[r, lane + 32 * j].to(Float32)
        total = total + x * x
    return total


def cell(tidx, item, width: int, threads: int = THREADS):
    """Row and column of element ``tidx + item * threads`` of a row-major tile ``width`` wide."""
    idx = tidx + item * threads
    row = idx // width
    return row, idx - row * width


@cute.jit
def load_chunk(tidx: Int32, mQ: cute.Tensor, mK: cute.Tensor, mA: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
               sQ: cute.Tensor, sK: cute.Tensor, sA: cute.Tensor, sG: cute.Tensor, sBeta: cute.Tensor,
               start: Int32, rows: Int32, i_h: Int32, i_hv: Int32):
    """Rows ``start ..`` of q and k (qk head ``i_h``) in ``sQ``/``sK``'s dtype, of A0 (value head
    ``i_hv``) in ``sA``, g and beta (fp32) in ``sG``/``sBeta``: zeros past the chunk's ``rows``."""
    C, K = cute.size(sQ, mode=[0]), cute.size(sQ, mode=[1])
    for item in cutlass.range(C * K // THREADS, unroll=4):
        r, c = cell(tidx, item, K)
        qv, kv = sQ.element_type(0.0), sK.element_type(0.0)
        if r < rows:
            qv = mQ[start + r, i_h, c].to(sQ.element_type)
            kv = mK[start + r, i_h, c].to(sK.element_type)
        sQ[r, c] = qv
        sK[r, c] = kv
    for item in cutlass.range(C * C // THREADS, unroll=4):
        r, c = cell(tidx, item, C)
        av = Float32(0.0)
        if r < rows:
            av = mA[start + r, i_hv, c]
        sA[r, c] = av
    load_gates(tidx, mG, mBeta, sG, sBeta, start, rows, i_hv)


@cute.jit
def load_gates(tidx: Int32, mG: cute.Tensor, mBeta: cute.Tensor, sG: cute.Tensor, sBeta: cute.Tensor, start: Int32,
               rows: Int32, i_hv: Int32):
    """g and beta (fp32) of rows ``start ..`` of value head ``i_hv`` into ``sG``/``sBeta`` by threads
    ``0 .. C-1``: zeros past the chunk's ``rows``."""
    C = cute.size(sG)
    if tidx < C:
        gv, bv = Float32(0.0), Float32(0.0)
        if tidx < rows:
            gv = mG[start + tidx, i_hv]
            bv = mBeta[start + tidx, i_hv].to(Float32)
        sG[tidx] = gv
        sBeta[tidx] = bv


@cute.jit
def read_gates(tidx: Int32, mG: cute.Tensor, mBeta: cute.Tensor, start: Int32, rows: Int32, i_hv: Int32,
               chunk: cutlass.Constexpr = CHUNK, flat: cutlass.Constexpr = False):
    """``(g, beta)`` in fp32 registers: row ``start + tidx`` of value head ``i_hv`` for threads
    ``0 .. chunk - 1`` (zeros past the chunk's ``rows``, and for the other threads), for a later
    store into shared memory (the loads are in flight meanwhile). With ``flat`` (``mG`` the
    cumulative gate), ``g`` past the chunk's rows is its last row's: the cumulative gate stays flat."""
    gv, bv = Float32(0.0), Float32(0.0)
    if tidx < chunk:
        if tidx < rows:
            gv = mG[start + tidx, i_hv]
            bv = mBeta[start + tidx, i_hv].to(Float32)
        elif const_expr(flat):
            gv = mG[start + rows - 1, i_hv]
    return gv, bv


@cute.jit
def cumulative_gate(lane: Int32, sG: cute.Tensor):
    """``sG`` (64 entries) replaced by its inclusive cumulative sum, by one warp: lane ``l`` adds its
    pair ``(2l, 2l + 1)``, a shuffle scan over the lanes' pair sums, then each pair gets the sum of the
    pairs before it. A fixed order of additions, so the same bits every call (and in every kernel
    that calls it: the UT inverse's gated ``A`` and the fused forward's gate agree bit for bit)."""
    a = sG[2 * lane]
    b = a + sG[2 * lane + 1]
    run = b
    for step in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_up(run, offset=1 << step)
        if lane >= (1 << step):
            run = run + other
    before = cute.arch.shuffle_sync_up(run, offset=1)
    if lane == 0:
        before = Float32(0.0)
    sG[2 * lane] = before + a
    sG[2 * lane + 1] = before + b


@cute.jit
def rstd_and_cumsum(tidx: Int32, sQ: cute.Tensor, sK: cute.Tensor, sRstd: cute.Tensor, sG: cute.Tensor,
                    l2norm: cutlass.Constexpr):
    """``sRstd``: ``rsqrt(sum(x^2) + eps)`` of the q rows (threads 0 .. C-1) and the k rows (C .. 2C-1),
    in fp32, with the L2 norm; ``sG``: its cumulative sum in place (thread 0, in order)."""
    C, K = cute.size(sQ, mode=[0]), cute.size(sQ, mode=[1])
    if const_expr(l2norm):
        row = tidx % C
        total = Float32(0.0)
        if tidx < C:
            for c in cutlass.range(K):
                x = sQ[row, c].to(Float32)
                total = total + x * x
        else:
            for c in cutlass.range(K):
                x = sK[row, c].to(Float32)
                total = total + x * x
        sRstd[tidx] = cute.math.rsqrt(total + Float32(L2NORM_EPS))
    if tidx == 0:
        run = Float32(0.0)
        for pos in cutlass.range(C):
            run = run + sG[pos]
            sG[pos] = run


@cute.jit
def normalize_and_gates(tidx: Int32, sQ: cute.Tensor, sK: cute.Tensor, sRstd: cute.Tensor, sG: cute.Tensor,
                        sEG: cute.Tensor, sDec: cute.Tensor, l2norm: cutlass.Constexpr):
    """With the L2 norm, the q and k rows times their scales (in fp32, stored in the tiles' dtype);
    ``sEG = exp(G)``, ``sDec = exp(G_last - G)`` (padding keeps G flat: G_last is the last real G)."""
    C, K = cute.size(sQ, mode=[0]), cute.size(sQ, mode=[1])
    if const_expr(l2norm):
        for item in cutlass.range(C * K // THREADS, unroll=4):
            r, c = cell(tidx, item, K)
            sQ[r, c] = (sQ[r, c].to(Float32) * sRstd[r]).to(sQ.element_type)
            sK[r, c] = (sK[r, c].to(Float32) * sRstd[C + r]).to(sK.element_type)
    if tidx < C:
        sEG[tidx] = exp(sG[tidx])
        sDec[tidx] = exp(sG[C - 1] - sG[tidx])


def copy_rows(dtype, width: int, threads: int, store: bool = False):
    """The tiled 16-byte copy of a ``[rows, width]`` tile by ``threads`` threads, ``width / vector`` a
    row, each row a contiguous run of ``width`` elements in memory: ``cp.async`` into shared memory,
    or (``store``) plain 16-byte stores from shared memory to memory."""
    vector = 128 // dtype.width
    per_row = width // vector
    op = cute.nvgpu.CopyUniversalOp() if store else cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)
    atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=128)
    return cute.make_tiled_copy_tv(atom, cute.make_layout((threads // per_row, per_row), stride=(per_row, 1)),
                                   cute.make_layout((1, vector)))


def row_pieces(copy: cute.TiledCopy, tidx, mX: cute.Tensor, sX: cute.Tensor, start, head, store: bool):
    """This thread's pieces of a row copy between rows ``start ..`` of ``mX[:, head, :]`` and ``sX``:
    ``(source, destination, coordinates)``, memory to ``sX`` or (``store``) back."""
    shape = (cute.size(sX, mode=[0]), cute.size(sX, mode=[1]))
    gX = cute.local_tile(cute.domain_offset((start, 0), mX[None, head, None]), shape, (0, 0))
    part = copy.get_slice(tidx)
    src, dst = (sX, gX) if store else (gX, sX)
    return part.partition_S(src), part.partition_D(dst), part.partition_S(cute.make_identity_tensor(shape))


@cute.jit
def start_rows(copy: cute.TiledCopy, tidx: Int32, mX: cute.Tensor, sX: cute.Tensor, start: Int32, rows: Int32,
               head: Int32):
    """Start the copy of rows ``start ..`` of ``mX[:, head, :]`` into ``sX``, zeros past the chunk's
    ``rows``; all land by the caller's ``cp_async_wait_group``. The row test is the copy's predicate:
    a ``cp.async`` whose source size is 16 or 0 bytes (0: nothing read, 16 zero bytes written), so
    no branch and no second store for the padding rows."""
    tXg, tXs, tXc = row_pieces(copy, tidx, mX, sX, start, head, False)
    inside = cute.make_rmem_tensor((cute.size(tXs, mode=[0, 1]), cute.size(tXs, mode=[2])), cutlass.Boolean)
    for m in cutlass.range_constexpr(cute.size(tXs, mode=[1])):
        inside.fill(tXc[0, m, 0][0] < rows)
        cute.copy(copy, tXg[None, m, None], tXs[None, m, None], pred=inside)


@cute.jit
def store_rows(copy: cute.TiledCopy, tidx: Int32, sX: cute.Tensor, mX: cute.Tensor, start: Int32, rows: Int32,
               head: Int32):
    """Rows ``0 .. rows - 1`` of ``sX`` into rows ``start ..`` of ``mX[:, head, :]``, 16 bytes a store."""
    tXs, tXg, tXc = row_pieces(copy, tidx, mX, sX, start, head, True)
    for m in cutlass.range_constexpr(cute.size(tXs, mode=[1])):
        if tXc[0, m, 0][0] < rows:
            cute.copy(copy, tXs[None, m, None], tXg[None, m, None])


@cute.jit
def start_prepared_rows(u: Int32, threads: cutlass.Constexpr, tiles, sources, start: Int32, rows: Int32,
                        factor_row: Int32, factor_rows: cutlass.Constexpr, i_h: Int32, i_hv: Int32, i_a: Int32):
    """Start the ``cp.async`` copies of a chunk's rows for the kernels that read the preparing UT
    inverse's outputs (the role-split forward, the fused backward), by ``threads`` threads (thread
    ``u``): q and k of qk head ``i_h``, then a value head's rows (v or dO) of head ``i_hv`` and
    ``round(A Gamma)`` of value head ``i_a`` (``i_hv`` but where a kernel walks a part of a value
    head's channels as a head of its own), rows ``start ..`` (zeros past ``rows``), into ``tiles``
    (their shared-memory tiles, in that order); then the ``factor_rows`` fp32 rows of head ``i_a``'s
    factors from ``factor_row``, by the first threads (a 16-byte piece each). The caller commits
    them as a group."""
    sQ, sK, sV, sA, sF = tiles
    mQ, mK, mV, mA, mF = sources
    ab = sQ.element_type
    copy_k = copy_rows(ab, cute.size(sQ, mode=[1]), threads)
    copy_v = copy_rows(ab, cute.size(sV, mode=[1]), threads)
    copy_c = copy_rows(ab, cute.size(sA, mode=[1]), threads)
    for copy, m, t, head in ((copy_k, mQ, sQ, i_h), (copy_k, mK, sK, i_h), (copy_v, mV, sV, i_hv),
                             (copy_c, mA, sA, i_a)):
        start_rows(copy, u, m, t, start, rows, head)
    width = cute.size(sF, mode=[1])
    factor_threads = factor_rows * width * 4 // 16
    if u < factor_threads:
        start_rows(copy_rows(Float32, width, factor_threads), u, mF, sF, factor_row, factor_rows, i_a)


@cute.jit
def store_tile(copy: cute.TiledCopy, tidx: Int32, sX: cute.Tensor, mX: cute.Tensor, start: Int32, head: Int32):
    """Every row of ``sX`` into rows ``start ..`` of ``mX[:, head, :]``, 16 bytes a store, two pieces a
    thread at a time (a rolled loop: few registers, for a team that has few)."""
    tXs, tXg, _ = row_pieces(copy, tidx, mX, sX, start, head, True)
    for m in cutlass.range(cute.size(tXs, mode=[1]), unroll=2):
        cute.copy(copy, tXs[None, m, None], tXg[None, m, None])


@cute.jit
def row_scales(copy: cute.TiledCopy, tidx: Int32, sX: cute.Tensor, sRstd: cute.Tensor, first: cutlass.Constexpr):
    """``sRstd[first + r]``: ``rsqrt(sum(x^2) + eps)`` of each row ``r`` of ``sX``, by the threads of the
    rows' copy (`copy_rows`): each squares and sums its 16-byte pieces of a row in fp32, then the
    row's threads add their sums by butterfly shuffles (a fixed order: the same bits every call)."""
    part = copy.get_slice(tidx)
    tXs = part.partition_D(sX)
    tXc = part.partition_D(cute.make_identity_tensor((cute.size(sX, mode=[0]), cute.size(sX, mode=[1]))))
    per_row = cute.size(sX, mode=[1]) // cute.size(tXs, mode=[0])
    for m in cutlass.range_constexpr(cute.size(tXs, mode=[1])):
        piece = cute.make_fragment_like(tXs[None, m, 0])
        cute.autovec_copy(tXs[None, m, 0], piece)
        total = Float32(0.0)
        for e in cutlass.range_constexpr(cute.size(piece)):
            x = piece[e].to(Float32)
            total = total + x * x
        total = cute.arch.warp_reduction(total, lambda a, b: a + b, threads_in_group=per_row)
        if tidx % per_row == 0:
            sRstd[first + tXc[0, m, 0][0]] = cute.math.rsqrt(total + Float32(L2NORM_EPS))
