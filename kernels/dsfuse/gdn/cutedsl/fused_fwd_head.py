"""The fused chunked forward with one CTA per (document, value head), all value channels: step 5
of the fused forward's record (docs/ops/gdn_forward.md). Same chains and formulas as the tensor-core form
(`dsfuse.gdn.cutedsl.fused_fwd_tc`), with what that form repeats per 32 value channels done once per
value head, and the products' results kept in registers. Its sums and roundings differ in three
places: the state update accumulates ``K^T round(Vd)`` onto ``exp(G_last) S`` inside the product, and
o the intra-chunk product onto ``exp(G) q S``, where that form adds separate products; and the L2
norm's scales multiply the products' rows and columns (``rstd_q``, ``rstd_k``) and the decayed
``v_new``'s rows (``rstd_k``, before its rounding), so q and k enter the products as read, with no
second rounding:

- 16 warps (4 x 4 over M and N of each ``mma.sync`` product), one CTA per chain, at most 128
  registers a thread (``ptxas -v``, sm_90a, with and without the L2 norm: 4 bytes of spill in the
  ``mma.sync`` form; 101 registers and no spill in the ``wgmma`` form): the kernel waits on latency (loads,
  barriers, ``ldmatrix``), and 16 warps hide more of it than 8 with twice the registers (about 6 %
  faster at (16, 48) with the L2 norm on the H200, run
  ``experiments/gdn/raw/fused-forward/20261202-125600-h200-w16``). The q and k rows, their L2-norm
  scales, ``q k^T`` and the gated ``A0`` are made once per value head and chunk (the
  tensor-core form made them once per 32 value channels).
- The fp32 state ``S`` ``[K, V]`` lives in the accumulators of the state update (32 registers a
  thread at K = V = 128): ``S = exp(G_last) S + K^T round(Vd)`` accumulates into it, and only its
  rounded copy goes to shared memory, as the B operand of ``k S`` and ``q S``.
- Elementwise work runs on the accumulators where they are, by their coordinates
  (`dsfuse.gdn.cutedsl.mma.coordinates`): the mask, decays and L2-norm scales of ``q k^T``,
  ``X = beta (v - exp(G) k S)`` with v's rows from shared memory, the decay of ``v_new``, o's scale.
- The L2-norm scales by all threads, each summing the squares of its 16-byte pieces of the q and k
  rows (those its ``cp.async`` copied), then the row's threads adding theirs by shuffles; the
  cumulative gate by a warp scan; both in a fixed order. ``round(A0 * Gamma)`` likewise in 16-byte
  pieces of a row.
- The chunk's q, k, v rows arrive by 16-byte ``cp.async`` copies into swizzled tiles (``A0``'s fp32
  rows likewise, into a row-major tile), and every product's operands by ``ldmatrix`` (``.trans`` where the operand is stored transposed:
  the state, X, ``v_new`` and ``k^T``; the ``head_wgmma`` form's by descriptor); o leaves through shared memory in 16-byte stores. So q, k, v
  and o need 16-byte aligned rows (`aligned_reasons`).

Per chunk, 6 barriers: (1) this chunk's g and beta stored, the next chunk's rows started into the
other stage (its g and beta read), the rounded state stored, this chunk's rows waited for; (2) scales and the
cumulative gate; (3) the rows' factors, ``round(A0 * Gamma)``; (4) ``q k^T`` and ``k S``,
then ``round((q k^T) * Gamma)`` and ``round(X)`` stored; (5) ``v_new`` and its decayed copy stored,
rounded; (6) the output (``q S``, scaled by ``exp(G) rstd_q`` in the accumulator, then the intra-chunk
product added to it) stored rounded, and the state update; o's rows then go to memory. The loads of
chunk ``c + 1`` overlap chunk ``c``'s steps (two stages of q, k, v, A0 rows; g and beta in
registers); the steps themselves follow each other, all warps in each (not warp-specialised).
In the ``gated`` mode `chunk_gdn` launches, the gating UT inverse has made the cumulative gate and
``A0 * Gamma``: step 2 rounds the gated A and does no scan, and without the L2 norm its barrier goes.

Shared memory at K = V = 128, bf16: two stages of q, k, v rows (16 KiB each a stage) and of A0's
rows (16 KiB in fp32), the rounded state 32 KiB, X (o after it), ``v_new`` and its decayed copy
16 KiB each, the two gated 64 x 64 tiles 8 KiB each, the vectors: 231,168 bytes, one CTA per SM
(an sm_90a or sm_100a CTA may take 232,448).
"""

from __future__ import annotations

import functools

import torch

from dsfuse._common import cutedsl as _cd

cutlass, cute = _cd.require()
from cutlass import Float32, Int32, const_expr

from dsfuse.gdn.cutedsl import chunk
from dsfuse.gdn.cutedsl import mma as _mma
from dsfuse.gdn.cutedsl import wgmma as _wg
from dsfuse.gdn.cutedsl.chunk import CHUNK

WARPS_MN = (4, 4)  # 4 warps over M (the chunk's 64 rows, or K), 4 over N
THREADS = 32 * WARPS_MN[0] * WARPS_MN[1]
WARPS = THREADS // 32
MAX_DIM = 128  # K and V: the state's accumulators (K V / THREADS registers a thread) and shared memory
ALIGN = 16  # bytes: the cp.async vectors
STAGES = 2  # the chunk's q, k, v and A0 rows: the next chunk's are copied in while this one computes


def shape_reasons(dim_k: int, dim_v: int, dtype: torch.dtype = torch.bfloat16, l2norm: bool = False) -> list[str]:
    """Why this form cannot take these head dims, or this dtype with the L2 norm (empty when it can)."""
    reasons = [f"the per-head form takes {name} = 64 or {MAX_DIM}, not {dim}"  # whole swizzle atoms and copy passes
               for name, dim in (("K", dim_k), ("V", dim_v)) if dim not in (64, MAX_DIM)]
    if dtype == torch.float16 and l2norm:  # bf16 has the range; fp16 tops out at 65504
        reasons.append("the per-head form takes fp16 only without the L2 norm: it scales the decayed v_new by "
                       "1 / |k| before rounding it to the input dtype, which overflows fp16 for keys of small norm")
    return reasons


def aligned_reasons(**tensors: torch.Tensor) -> list[str]:
    """Why the per-head form cannot read or write these ``[T, heads, D]`` tensors with 16-byte copies (empty
    when it can): a base address or a token or head stride that is not a multiple of 16 bytes."""
    return [f"{name} needs a 16-byte aligned base and token and head strides (got address "
            f"{x.data_ptr()} and strides {tuple(x.stride())} in {x.element_size()}-byte elements)"
            for name, x in tensors.items()
            if x.data_ptr() % ALIGN or any(s * x.element_size() % ALIGN for s in x.stride()[:2])]


_tile, _vector = chunk.tile, chunk.vector
_start_rows, _store_rows, _row_scales = chunk.start_rows, chunk.store_rows, chunk.row_scales


def _copy_rows(dtype, width: int, store: bool = False):
    """`dsfuse.gdn.cutedsl.chunk.copy_rows` by this form's threads."""
    return chunk.copy_rows(dtype, width, THREADS, store)


@cute.jit
def _gated_rows(copy: cute.TiledCopy, tidx: Int32, sA: cute.Tensor, sG: cute.Tensor, sAg: cute.Tensor,
                gated: cutlass.Constexpr):
    """``sAg = round(A0 * Gamma)``, ``Gamma[i, j] = exp(G[i] - G[j])`` on and below the diagonal (zeros
    above), by the threads of a copy of ``sAg``'s rows: 16-byte pieces of a row, stored whole. With
    ``gated``, ``sA`` holds ``A0 * Gamma`` already (the gating UT inverse's): ``sAg = round(sA)``."""
    part = copy.get_slice(tidx)
    tOs = part.partition_D(sAg)
    tOc = part.partition_D(cute.make_identity_tensor((cute.size(sAg, mode=[0]), cute.size(sAg, mode=[1]))))
    for m in cutlass.range(cute.size(tOs, mode=[1]), unroll=1):  # one piece at a time: fewer live registers
        piece = cute.make_fragment_like(tOs[None, m, 0])
        i = tOc[0, m, 0][0]
        g_i = sG[i]
        for e in cutlass.range_constexpr(cute.size(piece)):
            j = tOc[e, m, 0][1]
            if const_expr(gated):
                piece[e] = sA[i, j].to(sAg.element_type)
            else:
                value = Float32(0.0)
                if j <= i:
                    value = sA[i, j] * chunk.exp(g_i - sG[j])
                piece[e] = value.to(sAg.element_type)
        cute.autovec_copy(piece, tOs[None, m, 0])


@cute.jit
def row_factors(t: Int32, sG: cute.Tensor, sRstd: cute.Tensor, sEGq: cute.Tensor, sEGk: cute.Tensor,
                sDec: cute.Tensor, l2norm: cutlass.Constexpr):
    """Row ``t``'s factors (threads ``t < C``), the L2 norm's scales folded in (q and k stay as read):
    ``exp(G) rstd_q`` (o), ``exp(G) rstd_k`` (X), ``exp(G_last - G) rstd_k`` (the state update)."""
    C = cute.size(sG)
    if t < C:
        eg, dec = chunk.exp(sG[t]), chunk.exp(sG[C - 1] - sG[t])
        rq, rk = Float32(1.0), Float32(1.0)
        if const_expr(l2norm):
            rq, rk = sRstd[t], sRstd[C + t]
        sEGq[t], sEGk[t], sDec[t] = eg * rq, eg * rk, dec * rk


@cute.jit
def gate_qk(acc_f: cute.Tensor, cCC: cute.Tensor, sG: cute.Tensor, sRstd: cute.Tensor, l2norm: cutlass.Constexpr,
            two_rows: cutlass.Constexpr = False):
    """``q k^T`` in the accumulator ``acc_f`` (coordinates ``cCC``) masked to the lower triangle and
    decayed by ``exp(G_r - G_c)`` (times ``rstd_q rstd_k`` with the L2 norm), in place. ``two_rows``
    (a warpgroup product's accumulator, `dsfuse.gdn.cutedsl.wgmma.row_pair`): the rows' values read
    once into registers and the mask a select; the same values either way."""
    C = cute.size(sG)
    if const_expr(two_rows):
        g_row = _wg.row_pair(cCC, sG)
        rstd_row = _wg.row_pair(cCC, sRstd) if l2norm else None
        for i in cutlass.range_constexpr(cute.size(acc_f)):
            r, c = cCC[i][0], cCC[i][1]
            qk = acc_f[i] * chunk.exp(_wg.pick(cCC, i, g_row) - sG[c])
            if const_expr(l2norm):
                qk = qk * (_wg.pick(cCC, i, rstd_row) * sRstd[C + c])
            acc_f[i] = _wg.masked(c <= r, qk)
    else:
        for i in cutlass.range_constexpr(cute.size(acc_f)):
            r, c = cCC[i][0], cCC[i][1]
            qk = Float32(0.0)
            if c <= r:
                qk = acc_f[i] * chunk.exp(sG[r] - sG[c])
                if const_expr(l2norm):
                    qk = qk * (sRstd[r] * sRstd[C + c])
            acc_f[i] = qk


@cute.jit
def _barrier(wgmma: cutlass.Constexpr):
    """A CTA barrier after which products read this step's shared-memory writes: with ``wgmma``, each
    thread's ordinary writes (``st.shared``, ``cp.async``) fenced first for the tensor cores' reads."""
    if const_expr(wgmma):
        _wg.fence_writes()
    cute.arch.sync_threads()


def _operands(wgmma: bool, mma, tidx, sA: cute.Tensor, sB: cute.Tensor, a_t: bool, b_t: bool):
    """A product's operands ``sA`` ``(M, K)`` and ``sB`` ``(N, K)`` for this thread: wgmma descriptors,
    or ``ldmatrix`` copies (``.trans`` for ``a_t``/``b_t``, an operand that is a transposed view)."""
    if wgmma:
        return _wg.operands(mma, tidx, sA, sB)
    return _mma.ldmatrix_operands(mma, tidx, sA, sB, a_t, b_t)


class FusedForwardHead(chunk.ChainKernel):
    """The per-head form (module docstring): grid (1, HV, N) of 512 threads. With ``wgmma`` (sm_90a
    only), every product on warpgroup instructions reading its operands from 128-byte-swizzled tiles
    (`dsfuse.gdn.cutedsl.wgmma`), the four warpgroups splitting each product's M and N; the same
    steps, barriers and elementwise work (the ``head_wgmma`` form of the fused forward). With
    ``gated`` (as `chunk_gdn` launches it), ``a`` holds ``A0 * Gamma`` and ``g_cum`` the chunk-local
    cumulative gate, both made by the gating UT inverse (`dsfuse.gdn.cutedsl.ut_inverse`): the
    kernel reads them in place of ``A0`` and ``g`` (no scan, no gating; ``g`` is not read) and
    writes neither. Without it, ``g_cum`` is not touched."""

    threads = THREADS

    def __init__(self, *args, wgmma: bool = False, gated: bool = False):
        super().__init__(*args)
        self.block_v = self.dim_v
        self.wgmma, self.gated = wgmma, gated

    @cute.jit
    def _start_chunk(self, tidx: Int32, copies, sources, stages, mChunks: cute.Tensor, i_c: Int32, stage: Int32,
                     i_h: Int32, i_hv: Int32):
        """Start the ``cp.async`` copies of chunk ``i_c``'s q, k, v and A0 rows into ``stage`` of their
        tiles (the caller commits them as a group) and read its g and beta: ``(g, beta)`` registers."""
        copy_k, copy_v, copy_a = copies
        mQ, mK, mV, mA, mG, mBeta = sources
        start = mChunks[i_c, 1]
        rows = mChunks[i_c, 2] - start
        for copy, m, t, head in ((copy_k, mQ, stages[0], i_h), (copy_k, mK, stages[1], i_h),
                                 (copy_v, mV, stages[2], i_hv), (copy_a, mA, stages[3], i_hv)):
            _start_rows(copy, tidx, m, t[None, None, stage], start, rows, head)
        return chunk.read_gates(tidx, mG, mBeta, start, rows, i_hv, CHUNK, flat=self.gated)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
               mA: cute.Tensor, mChunks: cute.Tensor, mOffsets: cute.Tensor, mOrder: cute.Tensor, mH0: cute.Tensor,
               mHt: cute.Tensor, mO: cute.Tensor, mGc: cute.Tensor, scale: Float32):
        K, V, C, ab = self.dim_k, self.dim_v, CHUNK, self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        _, i_hv, i_z = cute.arch.block_idx()
        i_n = mOrder[i_z]
        i_h = i_hv // (self.value_heads // self.heads)
        warp, lane = tidx // 32, tidx % 32

        smem = cutlass.memory.SmemAllocator()
        tile = _wg.tile if const_expr(self.wgmma) else _mma.swizzled_tile
        # the chunk's rows as read, two stages (the next chunk's land while this one computes): q, k
        # (the L2 norm goes to the products), v, A0 (fp32)
        sQ2, sK2, sV2 = tile(smem, ab, C, K, STAGES), tile(smem, ab, C, K, STAGES), tile(smem, ab, C, V, STAGES)
        sA2 = _tile(smem, Float32, C, C, STAGES)
        sSb = tile(smem, ab, K, V)  # the state at the chunk's start, rounded
        sX, sVn, sVd = tile(smem, ab, C, V), tile(smem, ab, C, V), tile(smem, ab, C, V)  # sX: then o, rounded
        sQKg, sAg = tile(smem, ab, C, C), tile(smem, ab, C, C)
        sG, sBeta = _vector(smem, C), _vector(smem, C)
        # the rows' factors: exp(G) rstd_q (o), exp(G) rstd_k (X), exp(G_last - G) rstd_k (the state update)
        sEGq, sEGk, sDec = _vector(smem, C), _vector(smem, C), _vector(smem, C)
        sRstd = _vector(smem, 2 * C)
        copy_k, copy_v, copy_a = _copy_rows(ab, K), _copy_rows(ab, V), _copy_rows(Float32, C)
        store_o = _copy_rows(ab, V, store=True)
        copy_c = _copy_rows(ab, C)  # its partition only: the threads' 16-byte pieces of round(A0 * Gamma)

        # Per product shape a tiled product (one for all with mma.sync): q k^T (C x C), the (C x V)
        # ones, the state update (K x V); the B operands stored [rows, V] are read transposed: S
        # (rows = K), X, v_new, decayed v_new (rows = C); K^T, the A operand of the state update, likewise.
        if const_expr(self.wgmma):
            mma_cc, mma_cv = _wg.tiled_mma(ab, C, C, True, True), _wg.tiled_mma(ab, C, V, True, False)
            mma_kv = _wg.tiled_mma(ab, K, V, False, False)
            transposed, gemm = _wg.transposed, _wg.gemm
        else:
            mma_cc = mma_cv = mma_kv = _mma.tiled_mma(ab, WARPS_MN, ldmatrix=True)
            transposed, gemm = _mma.transposed, _mma.gemm_ldmatrix
        ops = functools.partial(_operands, self.wgmma)
        opS, opX, opVn, opVd = (transposed(t) for t in (sSb, sX, sVn, sVd))
        ops_vn, ops_o = ops(mma_cv, tidx, sAg, opX, False, True), ops(mma_cv, tidx, sQKg, opVn, False, True)
        thr_cc, thr_cv, thr_kv = (m.get_slice(tidx) for m in (mma_cc, mma_cv, mma_kv))

        cCC, cCV, cKV = (_mma.coordinates(mma_cc, tidx, (C, C)), _mma.coordinates(mma_cv, tidx, (C, V)),
                         _mma.coordinates(mma_kv, tidx, (K, V)))

        acc_s = _mma.accumulator(mma_kv, tidx, (K, V))  # the fp32 state, for the whole chain
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            acc_s[i] = mH0[i_n, i_hv, cKV[i][0], cKV[i][1]]

        # the first chunk's rows (stage 0) and gates; each chunk then starts the next one's (gated:
        # the cumulative gate read in place of g, and the gated A in place of A0)
        sources = (mQ, mK, mV, mA, mGc if self.gated else mG, mBeta)
        first, last = mOffsets[i_n], mOffsets[i_n + 1]
        g_next, beta_next = Float32(0.0), Float32(0.0)
        if first < last:
            g_next, beta_next = self._start_chunk(tidx, (copy_k, copy_v, copy_a), sources, (sQ2, sK2, sV2, sA2),
                                                  mChunks, first, 0, i_h, i_hv)
        cute.arch.cp_async_commit_group()

        for i_c in cutlass.range(first, last):
            start = mChunks[i_c, 1]
            rows = mChunks[i_c, 2] - start
            stage = (i_c - first) % STAGES
            sQ, sK, sV, sA = (t[None, None, stage] for t in (sQ2, sK2, sV2, sA2))
            ops_qk, ops_ks = ops(mma_cc, tidx, sQ, sK, False, False), ops(mma_cv, tidx, sK, opS, False, True)
            ops_qs, ops_u = ops(mma_cv, tidx, sQ, opS, False, True), ops(mma_kv, tidx, transposed(sK), opVd, True, True)

            # 1. the next chunk's rows into the other stage (its last reads were the previous chunk's,
            #    before that chunk's last barrier) and its g and beta into registers; this chunk's
            #    g and beta stored, the state rounded for k S and q S; this chunk's rows waited for
            if tidx < C:
                sG[tidx], sBeta[tidx] = g_next, beta_next
            if i_c + 1 < last:
                g_next, beta_next = self._start_chunk(tidx, (copy_k, copy_v, copy_a), sources, (sQ2, sK2, sV2, sA2),
                                                      mChunks, i_c + 1, 1 - stage, i_h, i_hv)
            cute.arch.cp_async_commit_group()  # empty after the last chunk: one group a chunk all the same
            cute.autovec_copy(_mma.rounded(acc_s, ab), thr_kv.partition_C(sSb))
            cute.arch.cp_async_wait_group(1)
            _barrier(self.wgmma)

            # 2. the rows' L2-norm scales; G = cumsum(g) (warp 0, after its rows); gated: no scan (sG
            #    holds the cumulative gate as read) and round(A) here, where it needs no G
            if const_expr(self.l2norm):
                _row_scales(copy_k, tidx, sQ, sRstd, 0)
                _row_scales(copy_k, tidx, sK, sRstd, C)
            if const_expr(self.gated):
                _gated_rows(copy_c, tidx, sA, sG, sAg, True)
            else:
                if warp == 0:
                    chunk.cumulative_gate(lane, sG)
            if const_expr(self.l2norm or not self.gated):
                cute.arch.sync_threads()

            # 3. the rows' factors (the L2 norm's scales folded in: q and k stay as read); round(A0 * Gamma)
            row_factors(tidx, sG, sRstd, sEGq, sEGk, sDec, self.l2norm)
            if const_expr(not self.gated):
                _gated_rows(copy_c, tidx, sA, sG, sAg, False)
            cute.arch.sync_threads()

            # 4. q k^T and k S on the tensor cores; then, in registers, round((q k^T) * Gamma) and
            #    round(X), X = beta (v - exp(G) k S), into shared memory (the L2 norm's scales on the results)
            acc_f = _mma.accumulator(mma_cc, tidx, (C, C))
            gemm(mma_cc, acc_f, ops_qk)
            acc_p = _mma.accumulator(mma_cv, tidx, (C, V))
            gemm(mma_cv, acc_p, ops_ks)
            gate_qk(acc_f, cCC, sG, sRstd, self.l2norm)
            for i in cutlass.range_constexpr(cute.size(acc_p)):
                r, c = cCV[i][0], cCV[i][1]
                acc_p[i] = sBeta[r] * (sV[r, c].to(Float32) - sEGk[r] * acc_p[i])
            cute.autovec_copy(_mma.rounded(acc_f, ab), thr_cc.partition_C(sQKg))
            cute.autovec_copy(_mma.rounded(acc_p, ab), thr_cv.partition_C(sX))
            _barrier(self.wgmma)

            # 5. v_new = round(A0 * Gamma) round(X); stored rounded, and decayed to the chunk's end (times
            #    rstd_k: the state update's K^T is then the raw k's)
            acc_vn = _mma.accumulator(mma_cv, tidx, (C, V))
            gemm(mma_cv, acc_vn, ops_vn)
            cute.autovec_copy(_mma.rounded(acc_vn, ab), thr_cv.partition_C(sVn))
            for i in cutlass.range_constexpr(cute.size(acc_vn)):
                acc_vn[i] = acc_vn[i] * sDec[cCV[i][0]]
            cute.autovec_copy(_mma.rounded(acc_vn, ab), thr_cv.partition_C(sVd))
            _barrier(self.wgmma)

            # 6. o = scale (exp(G) q S + round((q k^T) * Gamma) round(v_new)), rounded into sX (free since
            #    step 5), its real rows then stored 16 bytes at a time (q S made here, not kept from step
            #    4: fewer registers live across steps 5 and 6);
            #    S = exp(G_last) S + K^T round(Vd) (G is flat past the chunk's end: G_last is the last real G)
            acc_o = _mma.accumulator(mma_cv, tidx, (C, V))
            gemm(mma_cv, acc_o, ops_qs)
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[i] = sEGq[cCV[i][0]] * acc_o[i]
            gemm(mma_cv, acc_o, ops_o)
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[i] = scale * acc_o[i]
            cute.autovec_copy(_mma.rounded(acc_o, ab), thr_cv.partition_C(sX))
            last_decay = chunk.exp(sG[C - 1])
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = last_decay * acc_s[i]
            gemm(mma_kv, acc_s, ops_u)
            cute.arch.sync_threads()
            _store_rows(store_o, tidx, sX, mO, start, rows, i_hv)  # sX is next written in step 4

        for i in cutlass.range_constexpr(cute.size(acc_s)):
            mHt[i_n, i_hv, cKV[i][0], cKV[i][1]] = acc_s[i]
