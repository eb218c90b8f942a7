"""The per-head fused forward with its warps split by role (``form="head_ws"``, sm_90a): the same
chains, formulas and roundings as the ``head_wgmma`` form (`dsfuse.gdn.cutedsl.fused_fwd_head`), so
the same values bit for bit, with the output's products taken off the state's chain, and the work
of a chunk that does not depend on the state made before the chain by the preparing UT inverse
(`dsfuse.gdn.cutedsl.ut_inverse`): ``round(A0 * Gamma)`` in the input dtype and the rows' factors
(the cumulative gate, beta, the L2 norm's scales and the decays they multiply), the same
arithmetic on the same values.

One CTA of 512 threads per (document, value head), two teams of two warpgroups:

- the **state team** (threads 0-255) walks the chain: the chunk's loads (16-byte ``cp.async``: q, k,
  v rows, ``round(A0 * Gamma)`` and the factors, two stages), ``round(S)``, ``k S``, ``X``,
  ``v_new = round(A) round(X)`` and the state update, with the fp32 state in its accumulators (64
  registers a thread at K = V = 128);
- the **output team** (threads 256-511) makes each chunk's output from what the state team left in
  shared memory: ``q k^T`` with its mask, decays and scales, ``q S``, then ``(q k^T Gamma) v_new``
  once ``v_new`` is there, and o's rows to memory.

So a chunk's ``q k^T`` and ``q S`` run beside its ``k S``, and its ``(q k^T Gamma) v_new`` and o's
store beside its state update and the next chunk's loads (every product on warpgroup
instructions, two warpgroups each). The teams meet at four named barriers a
chunk, each arrived at by one team and waited at by the other (``bar.arrive`` / ``bar.sync`` over
512 threads), besides each team's own barriers (256 threads):

- ``READY`` (state -> output): chunk ``c``'s rows, factors and ``round(S_c)`` in shared memory;
- ``OUT_READ`` (output -> state): the output team has read them (the state team then overwrites
  ``round(S)`` and the other stage, for chunk ``c + 2``'s loads);
- ``VN_READY`` (state -> output): ``round(v_new)`` stored;
- ``VN_FREE`` (output -> state): the output team has read it (the state team then writes chunk
  ``c + 1``'s).

A barrier is waited at once for each arrival, in order, and neither team can arrive twice before
the other has waited (each arrival follows a wait on the other team's previous one), so a barrier's
uses never overlap. The first chunk waits for no ``OUT_READ`` or ``VN_FREE`` and the last arrives at
neither. The state team's chain is three of its own barriers a chunk: loads landed and ``round(S)``
stored; X stored; the decayed ``v_new`` stored. Each product leaves other work in its shadow: the
next chunk's loads (the addresses of five tensors' rows, a chunk before they are waited for) beside
``k S``, the state's decay beside ``v_new``'s product, and ``round(v_new)``'s store for the output
team (with the wait for it to be free) beside the state update. Shared-memory tiles move by
``stmatrix`` and ``ldmatrix`` in the accumulators' layout.

Shared memory at K = V = 128, bf16: two stages of q, k, v rows (96 KiB), of ``round(A0 * Gamma)``
(16 KiB) and of the factors (4 KiB), ``round(S)`` 32 KiB, X, ``v_new``, its decayed copy and o
16 KiB each, ``round(q k^T Gamma)`` 8 KiB: 225,280 bytes and the alignment, one CTA per SM.
"""

from __future__ import annotations

from dsfuse._common import cutedsl as _cd

cutlass, cute = _cd.require()
from cutlass import Float32, Int32, const_expr

from dsfuse.gdn.cutedsl import chunk
from dsfuse.gdn.cutedsl import mma as _mma
from dsfuse.gdn.cutedsl import wgmma as _wg
from dsfuse.gdn.cutedsl.chunk import CHUNK
from dsfuse.gdn.cutedsl.fused_fwd_head import STAGES, gate_qk
from dsfuse.gdn.cutedsl.ut_inverse import F_BETA, F_DEC, F_EGK, F_EGQ, F_G, F_RK, F_RQ, FACTORS

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
assert F_RK == F_RQ + 1, "the rows' scales are read as one vector of 128: rstd_k's row right after rstd_q's"


def _team_sync(bar: int):
    cute.arch.barrier(barrier_id=bar, number_of_threads=TEAM)


def _arrive(bar: int):
    cute.arch.barrier_arrive(barrier_id=bar, number_of_threads=THREADS)


def _wait(bar: int):
    cute.arch.barrier(barrier_id=bar, number_of_threads=THREADS)


def _vectors(sF: cute.Tensor):
    """A stage's factors (`dsfuse.gdn.cutedsl.ut_inverse.FACTORS`) as the vectors the products'
    elementwise work reads: ``(G, beta, exp(G) rstd_q, exp(G) rstd_k, the decay, rstd)``, ``rstd`` the
    q rows' scales then the k rows' (the two rows are adjacent), as `gate_qk` reads them."""
    rstd = cute.make_tensor(sF[F_RQ, None].iterator, cute.make_layout((2 * CHUNK,)))
    return sF[F_G, None], sF[F_BETA, None], sF[F_EGQ, None], sF[F_EGK, None], sF[F_DEC, None], rstd


class FusedForwardWS(chunk.ChainKernel):
    """The role-split form (module docstring): ``(q, k, v, a_round, factors, chunk_indices,
    chunk_offsets, order, h0, ht, o, states, scale)``, grid (1, HV, len(order)) of 512 threads;
    ``a_round`` and ``factors`` the preparing UT inverse's
    (`dsfuse.gdn.cutedsl.ut_inverse.launch_ut_inverse`). With ``save``, the output team also writes
    each chunk's ``round(S)`` (the state at the chunk's start, as every product of the chunk read it)
    to ``states`` ``[NC * K, HV, V]``: chunk ``c``'s ``K`` rows from row ``c K``, for a backward;
    without it ``states`` is not touched."""

    threads = THREADS

    def __init__(self, *args, save: bool = False, parts: int = 1):
        super().__init__(*args)
        self.block_v = self.dim_v
        self.save = save
        self.parts = parts  # value heads walked as `parts` heads of V / parts channels each (`COLUMN_PARTS`)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mA: cute.Tensor, mF: cute.Tensor,
                 mChunks: cute.Tensor, mOffsets: cute.Tensor, mOrder: cute.Tensor, mH0: cute.Tensor, mHt: cute.Tensor,
                 mO: cute.Tensor, mStates: cute.Tensor, scale: Float32, stream):
        self.kernel(mQ, mK, mV, mA, mF, mChunks, mOffsets, mOrder, mH0, mHt, mO, mStates, scale).launch(
            grid=[1, self.value_heads, mOrder.shape[0]], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mA: cute.Tensor, mF: cute.Tensor,
               mChunks: cute.Tensor, mOffsets: cute.Tensor, mOrder: cute.Tensor, mH0: cute.Tensor, mHt: cute.Tensor,
               mO: cute.Tensor, mStates: cute.Tensor, scale: Float32):
        K, V, C, ab = self.dim_k, self.dim_v, CHUNK, self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        _, i_hv, i_z = cute.arch.block_idx()
        i_n = mOrder[i_z]
        i_h = i_hv // (self.value_heads // self.heads)

        smem = cutlass.memory.SmemAllocator()
        tile = _wg.tile
        sQ2, sK2, sV2 = tile(smem, ab, C, K, STAGES), tile(smem, ab, C, K, STAGES), tile(smem, ab, C, V, STAGES)
        sA2 = tile(smem, ab, C, C, STAGES)  # round(A0 * Gamma), as the preparing inverse wrote it
        sF2 = chunk.tile(smem, Float32, len(FACTORS), C, STAGES)
        sSb = tile(smem, ab, K, V)  # round(S) at the chunk's start
        sX, sVn, sVd, sO = tile(smem, ab, C, V), tile(smem, ab, C, V), tile(smem, ab, C, V), tile(smem, ab, C, V)
        sQKg = tile(smem, ab, C, C)

        first, last = mOffsets[i_n], mOffsets[i_n + 1]
        if tidx < TEAM:
            cute.arch.setmaxregister_increase(STATE_REGS)
            self._state_team(tidx, (sQ2, sK2, sV2, sA2, sF2), (sSb, sX, sVn, sVd), (mQ, mK, mV, mA, mF), mChunks,
                             mH0, mHt, first, last, i_n, i_h, i_hv)
        else:
            cute.arch.setmaxregister_decrease(OUTPUT_REGS)
            self._output_team(tidx - TEAM, (sQ2, sK2, sF2, sSb, sVn, sQKg, sO), mChunks, mO, mStates, scale, first,
                              last, i_hv)

    @cute.jit
    def _start_chunk(self, u: Int32, stages, sources, mChunks: cute.Tensor, i_c: Int32, stage: Int32, i_h: Int32,
                     i_hv: Int32):
        """Start the ``cp.async`` copies of chunk ``i_c``'s rows and factors into ``stage`` (the caller
        commits them as a group): zeros past the chunk's rows."""
        start = mChunks[i_c, 1]
        chunk.start_prepared_rows(u, TEAM, tuple(t[None, None, stage] for t in stages), sources, start,
                                  mChunks[i_c, 2] - start, i_c * len(FACTORS), len(FACTORS), i_h, i_hv,
                                  i_hv // self.parts)

    @cute.jit
    def _state_team(self, u: Int32, stages, tiles, sources, mChunks: cute.Tensor, mH0: cute.Tensor, mHt: cute.Tensor,
                    first: Int32, last: Int32, i_n: Int32, i_h: Int32, i_hv: Int32):
        """The state team's chain (thread ``u`` of 256): loads, ``k S``, ``X``, ``v_new`` and the state
        update of every chunk; the final state."""
        K, V, C, ab = self.dim_k, self.dim_v, CHUNK, self.dtype
        sQ2, sK2, sV2, sA2, sF2 = stages
        sSb, sX, sVn, sVd = tiles

        mma_cv = _wg.tiled_mma(ab, C, V, True, False, TEAM_WARPGROUPS)
        mma_kv = _wg.tiled_mma(ab, K, V, False, False, TEAM_WARPGROUPS)
        opS, opX, opVd = _wg.transposed(sSb), _wg.transposed(sX), _wg.transposed(sVd)
        cCV, cKV = _mma.coordinates(mma_cv, u, (C, V)), _mma.coordinates(mma_kv, u, (K, V))

        acc_s = _mma.accumulator(mma_kv, u, (K, V))  # the fp32 state, for the whole chain
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            acc_s[i] = mH0[i_n, i_hv, cKV[i][0], cKV[i][1]]

        # the first chunk's rows and factors (stage 0); each chunk then starts the next one's
        if first < last:
            self._start_chunk(u, stages, sources, mChunks, first, 0, i_h, i_hv)
        cute.arch.cp_async_commit_group()

        for i_c in cutlass.range(first, last):
            stage = (i_c - first) % STAGES
            sK, sV, sA = sK2[None, None, stage], sV2[None, None, stage], sA2[None, None, stage]
            sG, sBeta, _, sEGk, sDec, _ = _vectors(sF2[None, None, stage])

            # 1. the output team is done with the last chunk's rows, factors and round(S); round(S)
            #    stored; this chunk's rows and factors waited for; then the output team told this
            #    chunk is ready
            if i_c > first:
                _wait(OUT_READ)
            _wg.store_rounded(mma_kv, u, acc_s, sSb, ab)
            cute.arch.cp_async_wait_group(0)
            _wg.fence_writes()
            _team_sync(STATE_BAR)
            _arrive(READY)

            # 2. k S; while it runs, the next chunk's loads started into the other stage (the output
            #    team is done with it: OUT_READ above), their addresses made off the product's wait;
            #    X = beta (v - exp(G) rstd_k k S), rounded into shared memory (v read in the
            #    accumulator's layout by ldmatrix before the product starts)
            acc_p = _mma.accumulator(mma_cv, u, (C, V))
            v_acc = cute.make_fragment_like(acc_p, ab)
            _wg.load_like(mma_cv, u, sV, v_acc)
            _wg.gemm(mma_cv, acc_p, _wg.operands(mma_cv, u, sK, opS), wait=False)
            if i_c + 1 < last:
                self._start_chunk(u, stages, sources, mChunks, i_c + 1, 1 - stage, i_h, i_hv)
            cute.arch.cp_async_commit_group()  # empty after the last chunk: one group a chunk all the same
            _wg.wait()
            for i in cutlass.range_constexpr(cute.size(acc_p)):
                r = cCV[i][0]
                acc_p[i] = sBeta[r] * (v_acc[i].to(Float32) - sEGk[r] * acc_p[i])
            _wg.store_rounded(mma_cv, u, acc_p, sX, ab)
            _wg.fence_writes()
            _team_sync(STATE_BAR)

            # 3. v_new = round(A0 Gamma) round(X), the state decayed to the chunk's end while it runs;
            #    v_new rounded (kept for the output team) and decayed to the chunk's end, stored for
            #    the state update
            acc_vn = _mma.accumulator(mma_cv, u, (C, V))
            _wg.gemm(mma_cv, acc_vn, _wg.operands(mma_cv, u, sA, opX), wait=False)
            last_decay = chunk.exp(sG[C - 1])
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = last_decay * acc_s[i]
            _wg.wait()
            vn = _mma.rounded(acc_vn, ab)
            for i in cutlass.range_constexpr(cute.size(acc_vn)):
                acc_vn[i] = acc_vn[i] * sDec[cCV[i][0]]
            _wg.store_rounded(mma_cv, u, acc_vn, sVd, ab)
            _wg.fence_writes()
            _team_sync(STATE_BAR)

            # 4. S = exp(G_last) S + K^T round(Vd); while it runs, round(v_new) stored once the output
            #    team has read the last one. No barrier after it: the next chunk's first one orders
            #    this product's reads of k and Vd before their next writes (k's stage by the loads of
            #    step 2, Vd in step 3), and the arrivals above order v_new's
            _wg.gemm(mma_kv, acc_s, _wg.operands(mma_kv, u, _wg.transposed(sK), opVd), wait=False)
            if i_c > first:
                _wait(VN_FREE)
            _wg.store(mma_cv, u, vn, sVn)
            _wg.fence_writes()
            _arrive(VN_READY)
            _wg.wait()

        for i in cutlass.range_constexpr(cute.size(acc_s)):
            mHt[i_n, i_hv, cKV[i][0], cKV[i][1]] = acc_s[i]

    @cute.jit
    def _output_team(self, u: Int32, tiles, mChunks: cute.Tensor, mO: cute.Tensor, mStates: cute.Tensor,
                     scale: Float32, first: Int32, last: Int32, i_hv: Int32):
        """The output team's part (thread ``u`` of 256): each chunk's ``o`` (and with ``save`` its
        ``round(S)`` to ``states``)."""
        K, V, C, ab = self.dim_k, self.dim_v, CHUNK, self.dtype
        sQ2, sK2, sF2, sSb, sVn, sQKg, sO = tiles
        store_o = chunk.copy_rows(ab, V, TEAM, store=True)  # o's rows, and the saved states' (also V wide)
        mma_cc = _wg.tiled_mma(ab, C, C, True, True, TEAM_WARPGROUPS)
        mma_cv = _wg.tiled_mma(ab, C, V, True, False, TEAM_WARPGROUPS)
        opS, opVn = _wg.transposed(sSb), _wg.transposed(sVn)
        ops_o = _wg.operands(mma_cv, u, sQKg, opVn)
        cCC, cCV = _mma.coordinates(mma_cc, u, (C, C)), _mma.coordinates(mma_cv, u, (C, V))

        for i_c in cutlass.range(first, last):
            start = mChunks[i_c, 1]
            rows = mChunks[i_c, 2] - start
            stage = (i_c - first) % STAGES
            sQ, sK = sQ2[None, None, stage], sK2[None, None, stage]
            sG, _, sEGq, _, _, sRstd = _vectors(sF2[None, None, stage])

            # 1. q k^T and q S from what the state team stored, issued together; (q k^T) masked,
            #    decayed and scaled while q S runs, rounded into shared memory; q S scaled by
            #    exp(G) rstd_q in the accumulator
            _wait(READY)
            acc_f = _mma.accumulator(mma_cc, u, (C, C))
            _wg.gemm(mma_cc, acc_f, _wg.operands(mma_cc, u, sQ, sK), wait=False)
            acc_o = _mma.accumulator(mma_cv, u, (C, V))
            _wg.gemm(mma_cv, acc_o, _wg.operands(mma_cv, u, sQ, opS), wait=False)
            if const_expr(self.save):  # round(S) to memory while the products read it (before OUT_READ)
                chunk.store_tile(store_o, u, sSb, mStates, i_c * K, i_hv)
            _wg.wait_for(1)  # q k^T done: gated while q S runs
            gate_qk(acc_f, cCC, sG, sRstd, self.l2norm, two_rows=True)
            _wg.wait()
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[i] = sEGq[cCV[i][0]] * acc_o[i]
            if i_c + 1 < last:
                _arrive(OUT_READ)
            _wg.store_rounded(mma_cc, u, acc_f, sQKg, ab)
            _wg.fence_writes()
            _team_sync(OUTPUT_BAR)

            # 2. o = scale (exp(G) q S + round(q k^T Gamma) round(v_new)), rounded, its rows to memory
            _wait(VN_READY)
            _wg.gemm(mma_cv, acc_o, ops_o)
            if i_c + 1 < last:
                _arrive(VN_FREE)
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[i] = scale * acc_o[i]
            _wg.store_rounded(mma_cv, u, acc_o, sO, ab)
            _team_sync(OUTPUT_BAR)
            chunk.store_rows(store_o, u, sO, mO, start, rows, i_hv)
