"""The per-head fused forward with its warps split by role (``form="head_ws"``, sm_90a): the same
chains, formulas and roundings as the ``head_wgmma`` form (`dsfuse.gdn.cutedsl.fused_fwd_head`), so
the same values bit for bit, with the output's products taken off the state's chain.

One CTA of 512 threads per (document, value head), two teams of two warpgroups:

- the **state team** (threads 0-255) walks the chain: the chunk's loads (16-byte ``cp.async``),
  its gates and row factors, ``round(S)``, ``k S``, ``X``, ``v_new = round(A) round(X)`` and the state
  update, with the fp32 state in its accumulators (64 registers a thread at K = V = 128);
- the **output team** (threads 256-511) makes each chunk's output from what the state team left in
  shared memory: ``q k^T`` with its mask, decays and scales, ``q S``, then ``(q k^T Gamma) v_new``
  once ``v_new`` is there, and o's rows to memory.

So a chunk's ``q k^T`` and ``q S`` run beside its ``k S``, and its ``(q k^T Gamma) v_new`` and o's
store beside its state update and the next chunk's loads and factors (every product on warpgroup
instructions, two warpgroups each). The teams meet at four named barriers a
chunk, each arrived at by one team and waited at by the other (``bar.arrive`` / ``bar.sync`` over
512 threads), besides each team's own barriers (256 threads):

- ``READY`` (state -> output): chunk ``c``'s rows, gates, row factors and ``round(S_c)`` stored;
- ``OUT_READ`` (output -> state): the output team has read them (the state team then overwrites
  ``round(S)``, the gate vectors and the stage of rows, for chunk ``c + 1``);
- ``VN_READY`` (state -> output): ``round(v_new)`` stored;
- ``VN_FREE`` (output -> state): the output team has read it (the state team then writes chunk
  ``c + 1``'s).

A barrier is waited at once for each arrival, in order, and neither team can arrive twice before
the other has waited (each arrival follows a wait on the other team's previous one), so a barrier's
uses never overlap. The first chunk waits for no ``OUT_READ`` or ``VN_FREE`` and the last arrives at
neither.

Shared memory at K = V = 128, bf16: as the ``head_wgmma`` form, except one stage of A (its next rows
are copied in once this chunk's ``round(A)`` is made) and a tile of its own for o (the output team's,
16 KiB): 231,168 bytes, one CTA per SM.
"""

from __future__ import annotations

from dsfuse._common import cutedsl as _cd

cutlass, cute = _cd.require()
from cutlass import Float32, Int32, const_expr

from dsfuse.gdn.cutedsl import chunk
from dsfuse.gdn.cutedsl import mma as _mma
from dsfuse.gdn.cutedsl import wgmma as _wg
from dsfuse.gdn.cutedsl.chunk import CHUNK
from dsfuse.gdn.cutedsl.fused_fwd_head import STAGES, _gated_rows, gate_qk, row_factors

THREADS = 512
TEAM = 256  # two warpgroups a team
TEAM_WARPGROUPS = 2
# registers a thread by team (setmaxnreg): the state team holds the fp32 state (64 a thread at
# K = V = 128) beside a product's accumulators; 160 + 96 over 256 threads each is the 65,536 of 512
# threads at 128 (ptxas keeps the instructions where the build needs more than 128, at K = V = 128)
STATE_REGS, OUTPUT_REGS = 160, 96
ARCHS = ("sm_90a",)  # wgmma
# named barriers (0 is the CTA's): each team's own, then the four between the teams (module docstring)
STATE_BAR, OUTPUT_BAR, READY, OUT_READ, VN_READY, VN_FREE = 1, 2, 3, 4, 5, 6


def _team_sync(bar: int):
    cute.arch.barrier(barrier_id=bar, number_of_threads=TEAM)


def _arrive(bar: int):
    cute.arch.barrier_arrive(barrier_id=bar, number_of_threads=THREADS)


def _wait(bar: int):
    cute.arch.barrier(barrier_id=bar, number_of_threads=THREADS)


class FusedForwardWS(chunk.ChainKernel):
    """The role-split form (module docstring): grid (1, HV, N) of 512 threads; ``gated`` as in
    `dsfuse.gdn.cutedsl.fused_fwd_head.FusedForwardHead`."""

    threads = THREADS

    def __init__(self, *args, gated: bool = False):
        super().__init__(*args)
        self.block_v = self.dim_v
        self.gated = gated

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
               mA: cute.Tensor, mChunks: cute.Tensor, mOffsets: cute.Tensor, mOrder: cute.Tensor, mH0: cute.Tensor,
               mHt: cute.Tensor, mO: cute.Tensor, mGc: cute.Tensor, scale: Float32):
        K, V, C, ab = self.dim_k, self.dim_v, CHUNK, self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        _, i_hv, i_z = cute.arch.block_idx()
        i_n = mOrder[i_z]
        i_h = i_hv // (self.value_heads // self.heads)

        smem = cutlass.memory.SmemAllocator()
        tile = _wg.tile
        sQ2, sK2, sV2 = tile(smem, ab, C, K, STAGES), tile(smem, ab, C, K, STAGES), tile(smem, ab, C, V, STAGES)
        sA = chunk.tile(smem, Float32, C, C)  # one stage: the next chunk's rows come once round(A) is made
        sSb = tile(smem, ab, K, V)  # round(S) at the chunk's start
        sX, sVn, sVd, sO = tile(smem, ab, C, V), tile(smem, ab, C, V), tile(smem, ab, C, V), tile(smem, ab, C, V)
        sQKg, sAg = tile(smem, ab, C, C), tile(smem, ab, C, C)
        sG, sBeta = chunk.vector(smem, C), chunk.vector(smem, C)
        sEGq, sEGk, sDec = chunk.vector(smem, C), chunk.vector(smem, C), chunk.vector(smem, C)
        sRstd = chunk.vector(smem, 2 * C)

        first, last = mOffsets[i_n], mOffsets[i_n + 1]
        if tidx < TEAM:
            cute.arch.setmaxregister_increase(STATE_REGS)
            self._state_team(tidx, (sQ2, sK2, sV2, sA, sSb, sX, sVn, sVd, sAg),
                             (sG, sBeta, sEGq, sEGk, sDec, sRstd),
                             (mQ, mK, mV, mA, mGc if self.gated else mG, mBeta), mChunks, mH0, mHt,
                             first, last, i_n, i_h, i_hv)
        else:
            cute.arch.setmaxregister_decrease(OUTPUT_REGS)
            self._output_team(tidx - TEAM, (sQ2, sK2, sSb, sVn, sQKg, sO), (sG, sEGq, sRstd), mChunks, mO, scale,
                              first, last, i_hv)

    @cute.jit
    def _state_team(self, u: Int32, tiles, vectors, sources, mChunks: cute.Tensor, mH0: cute.Tensor,
                    mHt: cute.Tensor, first: Int32, last: Int32, i_n: Int32, i_h: Int32, i_hv: Int32):
        """The state team's chain (thread ``u`` of 256): loads, gates, factors, ``k S``, ``X``,
        ``v_new`` and the state update of every chunk; the final state."""
        K, V, C, ab = self.dim_k, self.dim_v, CHUNK, self.dtype
        sQ2, sK2, sV2, sA, sSb, sX, sVn, sVd, sAg = tiles
        sG, sBeta, sEGq, sEGk, sDec, sRstd = vectors
        mQ, mK, mV, mA, mGate, mBeta = sources
        warp, lane = u // 32, u % 32
        copy_k, copy_v = chunk.copy_rows(ab, K, TEAM), chunk.copy_rows(ab, V, TEAM)
        copy_a, copy_c = chunk.copy_rows(Float32, C, TEAM), chunk.copy_rows(ab, C, TEAM)

        mma_cv = _wg.tiled_mma(ab, C, V, True, False, TEAM_WARPGROUPS)
        mma_kv = _wg.tiled_mma(ab, K, V, False, False, TEAM_WARPGROUPS)
        opS, opX, opVd = _wg.transposed(sSb), _wg.transposed(sX), _wg.transposed(sVd)
        ops_vn = _wg.operands(mma_cv, u, sAg, opX)
        thr_cv, thr_kv = mma_cv.get_slice(u), mma_kv.get_slice(u)
        cCV, cKV = _mma.coordinates(mma_cv, u, (C, V)), _mma.coordinates(mma_kv, u, (K, V))

        acc_s = _mma.accumulator(mma_kv, u, (K, V))  # the fp32 state, for the whole chain
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            acc_s[i] = mH0[i_n, i_hv, cKV[i][0], cKV[i][1]]

        # the first chunk's rows (stage 0), A and gates; each chunk then starts the next one's
        g_next, beta_next = Float32(0.0), Float32(0.0)
        if first < last:
            start = mChunks[first, 1]
            rows = mChunks[first, 2] - start
            for copy, m, t, head in ((copy_k, mQ, sQ2, i_h), (copy_k, mK, sK2, i_h), (copy_v, mV, sV2, i_hv)):
                chunk.start_rows(copy, u, m, t[None, None, 0], start, rows, head)
            chunk.start_rows(copy_a, u, mA, sA, start, rows, i_hv)
            g_next, beta_next = chunk.read_gates(u, mGate, mBeta, start, rows, i_hv, C, flat=self.gated)
        cute.arch.cp_async_commit_group()

        for i_c in cutlass.range(first, last):
            start = mChunks[i_c, 1]
            rows = mChunks[i_c, 2] - start
            stage = (i_c - first) % STAGES
            sQ, sK, sV = sQ2[None, None, stage], sK2[None, None, stage], sV2[None, None, stage]
            ops_ks = _wg.operands(mma_cv, u, sK, opS)
            ops_u = _wg.operands(mma_kv, u, _wg.transposed(sK), opVd)

            # 1. the output team is done with the last chunk's rows, gates and round(S); this chunk's
            #    g and beta stored, the next chunk's rows started into the other stage, round(S)
            #    stored; this chunk's rows and A waited for
            if i_c > first:
                _wait(OUT_READ)
            if u < C:
                sG[u], sBeta[u] = g_next, beta_next
            if i_c + 1 < last:
                nxt = mChunks[i_c + 1, 1]
                n_rows = mChunks[i_c + 1, 2] - nxt
                for copy, m, t, head in ((copy_k, mQ, sQ2, i_h), (copy_k, mK, sK2, i_h), (copy_v, mV, sV2, i_hv)):
                    chunk.start_rows(copy, u, m, t[None, None, 1 - stage], nxt, n_rows, head)
                g_next, beta_next = chunk.read_gates(u, mGate, mBeta, nxt, n_rows, i_hv, C, flat=self.gated)
            cute.arch.cp_async_commit_group()  # empty after the last chunk: one group a chunk all the same
            cute.autovec_copy(_mma.rounded(acc_s, ab), thr_kv.partition_C(sSb))
            cute.arch.cp_async_wait_group(1)
            _wg.fence_writes()
            _team_sync(STATE_BAR)

            # 2. the rows' L2-norm scales; G = cumsum(g) (or, gated, round(A) here: G is read)
            if const_expr(self.l2norm):
                chunk.row_scales(copy_k, u, sQ, sRstd, 0)
                chunk.row_scales(copy_k, u, sK, sRstd, C)
            if const_expr(self.gated):
                _gated_rows(copy_c, u, sA, sG, sAg, True)
            else:
                if warp == 0:
                    chunk.cumulative_gate(lane, sG)
            if const_expr(self.l2norm or not self.gated):
                _team_sync(STATE_BAR)

            # 3. the rows' factors; round(A0 * Gamma); then the output team told this chunk is ready,
            #    and (A's tile free) the next chunk's A started
            row_factors(u, sG, sRstd, sEGq, sEGk, sDec, self.l2norm)
            if const_expr(not self.gated):
                _gated_rows(copy_c, u, sA, sG, sAg, False)
            _wg.fence_writes()
            _team_sync(STATE_BAR)
            _arrive(READY)
            if i_c + 1 < last:
                nxt = mChunks[i_c + 1, 1]
                chunk.start_rows(copy_a, u, mA, sA, nxt, mChunks[i_c + 1, 2] - nxt, i_hv)
            cute.arch.cp_async_commit_group()

            # 4. k S; X = beta (v - exp(G) rstd_k k S), rounded into shared memory (v read in the
            #    accumulator's layout by vector loads while the product runs, not an element at a time)
            acc_p = _mma.accumulator(mma_cv, u, (C, V))
            v_acc = cute.make_fragment_like(acc_p, ab)
            cute.autovec_copy(thr_cv.partition_C(sV), v_acc)
            _wg.gemm(mma_cv, acc_p, ops_ks)
            for i in cutlass.range_constexpr(cute.size(acc_p)):
                r = cCV[i][0]
                acc_p[i] = sBeta[r] * (v_acc[i].to(Float32) - sEGk[r] * acc_p[i])
            cute.autovec_copy(_mma.rounded(acc_p, ab), thr_cv.partition_C(sX))
            _wg.fence_writes()
            _team_sync(STATE_BAR)

            # 5. v_new = round(A0 Gamma) round(X); once the output team has read the last one, stored
            #    rounded (for the output team) and decayed to the chunk's end (for the state update)
            acc_vn = _mma.accumulator(mma_cv, u, (C, V))
            _wg.gemm(mma_cv, acc_vn, ops_vn)
            if i_c > first:
                _wait(VN_FREE)
            cute.autovec_copy(_mma.rounded(acc_vn, ab), thr_cv.partition_C(sVn))
            for i in cutlass.range_constexpr(cute.size(acc_vn)):
                acc_vn[i] = acc_vn[i] * sDec[cCV[i][0]]
            cute.autovec_copy(_mma.rounded(acc_vn, ab), thr_cv.partition_C(sVd))
            _wg.fence_writes()
            _team_sync(STATE_BAR)
            _arrive(VN_READY)

            # 6. S = exp(G_last) S + K^T round(Vd); the stage's k and Vd read before the next chunk's writes
            last_decay = cute.math.exp(sG[C - 1])
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = last_decay * acc_s[i]
            _wg.gemm(mma_kv, acc_s, ops_u)
            _team_sync(STATE_BAR)

        for i in cutlass.range_constexpr(cute.size(acc_s)):
            mHt[i_n, i_hv, cKV[i][0], cKV[i][1]] = acc_s[i]

    @cute.jit
    def _output_team(self, u: Int32, tiles, vectors, mChunks: cute.Tensor, mO: cute.Tensor, scale: Float32,
                     first: Int32, last: Int32, i_hv: Int32):
        """The output team's part (thread ``u`` of 256): each chunk's ``o``."""
        V, C, ab = self.dim_v, CHUNK, self.dtype
        sQ2, sK2, sSb, sVn, sQKg, sO = tiles
        sG, sEGq, sRstd = vectors
        store_o = chunk.copy_rows(ab, V, TEAM, store=True)
        mma_cc = _wg.tiled_mma(ab, C, C, True, True, TEAM_WARPGROUPS)
        mma_cv = _wg.tiled_mma(ab, C, V, True, False, TEAM_WARPGROUPS)
        opS, opVn = _wg.transposed(sSb), _wg.transposed(sVn)
        ops_o = _wg.operands(mma_cv, u, sQKg, opVn)
        thr_cc, thr_cv = mma_cc.get_slice(u), mma_cv.get_slice(u)
        cCC, cCV = _mma.coordinates(mma_cc, u, (C, C)), _mma.coordinates(mma_cv, u, (C, V))

        for i_c in cutlass.range(first, last):
            start = mChunks[i_c, 1]
            rows = mChunks[i_c, 2] - start
            stage = (i_c - first) % STAGES
            sQ, sK = sQ2[None, None, stage], sK2[None, None, stage]

            # 1. q k^T and q S from what the state team stored; (q k^T) masked, decayed and scaled,
            #    rounded into shared memory; q S scaled by exp(G) rstd_q in the accumulator
            _wait(READY)
            acc_f = _mma.accumulator(mma_cc, u, (C, C))
            _wg.gemm(mma_cc, acc_f, _wg.operands(mma_cc, u, sQ, sK))
            acc_o = _mma.accumulator(mma_cv, u, (C, V))
            _wg.gemm(mma_cv, acc_o, _wg.operands(mma_cv, u, sQ, opS))
            gate_qk(acc_f, cCC, sG, sRstd, self.l2norm)
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[i] = sEGq[cCV[i][0]] * acc_o[i]
            if i_c + 1 < last:
                _arrive(OUT_READ)
            cute.autovec_copy(_mma.rounded(acc_f, ab), thr_cc.partition_C(sQKg))
            _wg.fence_writes()
            _team_sync(OUTPUT_BAR)

            # 2. o = scale (exp(G) q S + round(q k^T Gamma) round(v_new)), rounded, its rows to memory
            _wait(VN_READY)
            _wg.gemm(mma_cv, acc_o, ops_o)
            if i_c + 1 < last:
                _arrive(VN_FREE)
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[i] = scale * acc_o[i]
            cute.autovec_copy(_mma.rounded(acc_o, ab), thr_cv.partition_C(sO))
            _team_sync(OUTPUT_BAR)
            chunk.store_rows(store_o, u, sO, mO, start, rows, i_hv)
