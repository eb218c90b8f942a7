"""The role-split fused forward with the state kept transposed (``form="head_rs"``, sm_90a): the
``head_ws`` kernel (`dsfuse.gdn.cutedsl.fused_fwd_ws`: the same inputs, output team, stages and
barriers between the teams) whose state team holds ``S^T`` ``[V, K]`` instead of ``S``, so that
every product of its chain takes its A operand from registers:

    (k S)^T      = round(S)^T k^T                 A: round(S^T), the state rounded in registers
    v_new^T      = round(X)^T round(A0 Gamma)^T   A: round(X^T), the previous product's result
    S^T          = exp(G_last) S^T + round(Vd)^T k   A: round(Vd^T), likewise

Warpgroup ``w`` of the state team owns the value channels ``64 w .. 64 w + 63`` (the rows of
``S^T``) through the whole chain: no product's result goes through shared memory on the chain, so
the team meets at one barrier a chunk (the chunk's loads landed), where ``head_ws`` has three.
``round(S)`` and ``round(v_new)``, which the output team reads, go by ``stmatrix.trans`` into the
same ``[K, V]`` and ``[C, V]`` tiles: ``round(S)`` before ``(k S)^T`` (its registers are that
product's A operand, not to be read until its wait), ``round(v_new)`` while the state update runs
(from registers of its own).

The values are the same as ``head_ws``'s as far as the tensor cores sum a product's terms the
same way whichever operand a value comes in as (the same products of the same rounded values,
K blocks in the same order): a GPU test compares the two forms bit for bit, and the float64 test
of the tensor-core forms takes ``head_rs`` too.
"""

from __future__ import annotations

from dsfuse._common import cutedsl as _cd

cutlass, cute = _cd.require()
from cutlass import Float32, Int32

from dsfuse.gdn.cutedsl import chunk
from dsfuse.gdn.cutedsl import mma as _mma
from dsfuse.gdn.cutedsl import wgmma as _wg
from dsfuse.gdn.cutedsl.chunk import CHUNK
from dsfuse.gdn.cutedsl.fused_fwd_head import STAGES
from dsfuse.gdn.cutedsl.fused_fwd_ws import (OUT_READ, READY, STATE_BAR, TEAM_WARPGROUPS, VN_FREE, VN_READY,
                                             FusedForwardWS, _arrive, _team_sync, _vectors, _wait)


class FusedForwardRS(FusedForwardWS):
    """The ``head_rs`` form (module docstring): ``FusedForwardWS``'s signature, grid and output team."""

    @cute.jit
    def _state_team(self, u: Int32, stages, tiles, sources, mChunks: cute.Tensor, mH0: cute.Tensor, mHt: cute.Tensor,
                    first: Int32, last: Int32, i_n: Int32, i_h: Int32, i_hv: Int32):
        """The state team's chain (thread ``u`` of 256) with ``S^T`` in its accumulators."""
        K, V, C, ab = self.dim_k, self.dim_v, CHUNK, self.dtype
        sQ2, sK2, sV2, sA2, sF2 = stages
        sSb, _, sVn, _ = tiles

        # (k S)^T and v_new^T: (V, C); the state update: (V, K), B = k seen (K, C)
        mma_vc = _wg.tiled_mma(ab, V, C, True, True, TEAM_WARPGROUPS, a_in_registers=True)
        mma_vk = _wg.tiled_mma(ab, V, K, True, False, TEAM_WARPGROUPS, a_in_registers=True)
        cVC, cVK = _mma.coordinates(mma_vc, u, (V, C)), _mma.coordinates(mma_vk, u, (V, K))

        acc_s = _mma.accumulator(mma_vk, u, (V, K))  # S^T, fp32, for the whole chain
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            acc_s[i] = mH0[i_n, i_hv, cVK[i][1], cVK[i][0]]

        if first < last:
            self._start_chunk(u, stages, sources, mChunks, first, 0, i_h, i_hv)
        cute.arch.cp_async_commit_group()

        for i_c in cutlass.range(first, last):
            stage = (i_c - first) % STAGES
            sK, sV, sA = sK2[None, None, stage], sV2[None, None, stage], sA2[None, None, stage]
            sG, sBeta, _, sEGk, sDec, _ = _vectors(sF2[None, None, stage])

            # 1. this chunk's rows and factors landed (the team's one barrier a chunk; it also
            #    orders the last chunk's reads of the other stage before the loads below)
            cute.arch.cp_async_wait_group(0)
            _wg.fence_writes()
            _team_sync(STATE_BAR)

            # 2. round(S) stored for the output team once it is done with the last one (before the
            #    product that takes the same registers as its A: those are the product's until its
            #    wait), the output team told the chunk is ready; (k S)^T from round(S^T) in registers,
            #    the next chunk's loads started into the other stage while it runs
            s_round = _mma.rounded(acc_s, ab)
            if i_c > first:
                _wait(OUT_READ)
            _wg.store(mma_vk, u, s_round, _wg.transposed(sSb), transpose=True)
            _wg.fence_writes()
            _arrive(READY)
            acc_p = _mma.accumulator(mma_vc, u, (V, C))
            _wg.gemm(mma_vc, acc_p, _wg.operands_rs(mma_vc, u, s_round, sK), wait=False)
            if i_c + 1 < last:
                self._start_chunk(u, stages, sources, mChunks, i_c + 1, 1 - stage, i_h, i_hv)
            cute.arch.cp_async_commit_group()
            v_t = cute.make_fragment_like(acc_p, ab)
            _wg.load_like(mma_vc, u, _wg.transposed(sV), v_t, transpose=True)
            _wg.wait()

            # 3. X^T = beta (v - exp(G) rstd_k k S)^T, the token's factors along the columns; then
            #    v_new^T = round(X)^T round(A0 Gamma)^T, the state decayed to the chunk's end meanwhile
            for i in cutlass.range_constexpr(cute.size(acc_p)):
                t = cVC[i][1]
                acc_p[i] = sBeta[t] * (v_t[i].to(Float32) - sEGk[t] * acc_p[i])
            acc_vn = _mma.accumulator(mma_vc, u, (V, C))
            _wg.gemm(mma_vc, acc_vn, _wg.operands_rs(mma_vc, u, _mma.rounded(acc_p, ab), sA), wait=False)
            last_decay = chunk.exp(sG[C - 1])
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = last_decay * acc_s[i]
            _wg.wait()

            # 4. S^T = exp(G_last) S^T + round(Vd)^T k, Vd = v_new decayed to the chunk's end; while
            #    it runs, round(v_new) stored for the output team once it has read the last one
            vn_round = _mma.rounded(acc_vn, ab)
            for i in cutlass.range_constexpr(cute.size(acc_vn)):
                acc_vn[i] = acc_vn[i] * sDec[cVC[i][1]]
            _wg.gemm(mma_vk, acc_s, _wg.operands_rs(mma_vk, u, _mma.rounded(acc_vn, ab), _wg.transposed(sK)),
                     wait=False)
            if i_c > first:
                _wait(VN_FREE)
            _wg.store(mma_vc, u, vn_round, _wg.transposed(sVn), transpose=True)
            _wg.fence_writes()
            _arrive(VN_READY)
            _wg.wait()

        for i in cutlass.range_constexpr(cute.size(acc_s)):
            mHt[i_n, i_hv, cVK[i][1], cVK[i][0]] = acc_s[i]
