"""The fused chunked forward on tensor cores (bf16 / fp16 inputs): step 4 of the fused forward's record
(docs/ops/gdn_forward.md). Same chains, formulas and outputs as `dsfuse.gdn.cutedsl.fused_fwd` (one
CTA per document, value head and ``BV = 32`` value channels, the fp32 state in shared memory), with every
product on ``mma.sync`` through `dsfuse.gdn.cutedsl.mma`: operands rounded once to the input dtype
(as the Triton stages round them), fp32 accumulation, the elementwise work (gates, decays, masks, the
state update's sum) in fp32. Not pipelined and not warp-specialised yet: the loads, the products
and the elementwise steps follow each other, separated by barriers.

Per chunk (``Q``, ``K`` ``[C, K]``, the rows L2-normalised in fp32 when asked, then rounded)::

    F   = Q K^T                       -> QKg = round(F * Gamma)          (mma 64 x 64 x K)
    P   = K round(S),  QS = Q round(S)                                    (mma 64 x BV x K, twice)
    X   = round(beta (v - exp(G) P))
    Vn  = round(A0 * Gamma) X                                             (mma 64 x BV x 64)
    O   = QKg round(Vn)               -> o = scale (exp(G) QS + O)        (mma 64 x BV x 64)
    U   = K^T round(exp(G_last - G) Vn) -> S = exp(G_last) S + U          (mma K x BV x 64)

Its GPU tests (``tests/gdn/test_gdn_cutedsl_fused_forward.py``, beside the first form's) hold it to
the float64 contract; it compiles for sm_90a and sm_100a on the CPU.
"""

from __future__ import annotations

import torch

from dsfuse._common import cutedsl as _cd

cutlass, cute = _cd.require()
from cutlass import Float32

from dsfuse.gdn.cutedsl import chunk
from dsfuse.gdn.cutedsl import mma as _mma
from dsfuse.gdn.cutedsl.chunk import BV, CHUNK, THREADS

assert THREADS == _mma.THREADS  # the 2 x 2 warps of every product are the CTA
TC_DTYPES = (torch.bfloat16, torch.float16)


_tile, _vector = chunk.tile, chunk.vector


class FusedForwardTC(chunk.ChainKernel):
    """The tensor-core form (module docstring)."""

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
               mA: cute.Tensor, mChunks: cute.Tensor, mOffsets: cute.Tensor, mOrder: cute.Tensor, mH0: cute.Tensor,
               mHt: cute.Tensor, mO: cute.Tensor, mGc: cute.Tensor, scale: Float32):
        K, C, GROUP, ab = self.dim_k, CHUNK, self.value_heads // self.heads, self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        i_v, i_hv, i_z = cute.arch.block_idx()
        i_n = mOrder[i_z]
        i_h = i_hv // GROUP
        v0 = i_v * BV

        smem = cutlass.memory.SmemAllocator()
        sQ, sK = _tile(smem, ab, C, K), _tile(smem, ab, C, K)  # the operands, rounded
        sF = _tile(smem, Float32, C, C)  # fp32 scratch: A0, then q k^T, then (as [K, BV]) the state update
        sAg, sQKg = _tile(smem, ab, C, C), _tile(smem, ab, C, C)
        sS, sSb = _tile(smem, Float32, K, BV), _tile(smem, ab, K, BV)  # the state, and its rounded copy
        sP, sQS = _tile(smem, Float32, C, BV), _tile(smem, Float32, C, BV)  # k S (then the intra o), q S
        sVn = _tile(smem, Float32, C, BV)
        sXb, sVnb, sVdb = _tile(smem, ab, C, BV), _tile(smem, ab, C, BV), _tile(smem, ab, C, BV)
        sG, sBeta, sEG, sDec, sRstd = (_vector(smem, C), _vector(smem, C), _vector(smem, C), _vector(smem, C),
                                       _vector(smem, 2 * C))
        sU = _mma.view(sF, (K, BV), (BV, 1))

        mma = _mma.tiled_mma(ab)
        # the B operands stored [rows, BV] seen as (BV, rows): S (rows = K), X, v_new, decayed v_new (rows = C)
        opS = _mma.view(sSb, (BV, K), (1, BV))
        opX, opVn, opVd = (_mma.view(t, (BV, C), (1, BV)) for t in (sXb, sVnb, sVdb))
        opKt = _mma.view(sK, (K, C), (1, K))  # K^T as the A operand of the state update
        # every product's operands, partitioned once, outside the chunk loop
        ops_qk, ops_ks, ops_qs = (_mma.operands(mma, tidx, sQ, sK), _mma.operands(mma, tidx, sK, opS),
                                  _mma.operands(mma, tidx, sQ, opS))
        ops_vn, ops_o, ops_u = (_mma.operands(mma, tidx, sAg, opX), _mma.operands(mma, tidx, sQKg, opVn),
                                _mma.operands(mma, tidx, opKt, opVd))

        for item in cutlass.range(K * BV // THREADS, unroll=4):
            r, c = chunk.cell(tidx, item, BV)
            sS[r, c] = mH0[i_n, i_hv, r, v0 + c]
        cute.arch.sync_threads()

        for i_c in cutlass.range(mOffsets[i_n], mOffsets[i_n + 1]):
            start = mChunks[i_c, 1]
            rows = mChunks[i_c, 2] - start

            # 1. q, k rows (in the input dtype), A0 rows (zeros past the chunk's end), g and beta
            chunk.load_chunk(tidx, mQ, mK, mA, mG, mBeta, sQ, sK, sF, sG, sBeta, start, rows, i_h, i_hv)
            cute.arch.sync_threads()
            # 2. rstd of the q rows (threads 0..63) and k rows (64..127); G = cumsum(g) by thread 0
            chunk.rstd_and_cumsum(tidx, sQ, sK, sRstd, sG, self.l2norm)
            cute.arch.sync_threads()

            # 3. normalised, rounded q and k; the gate vectors; A0 * Gamma rounded; the state rounded
            chunk.normalize_and_gates(tidx, sQ, sK, sRstd, sG, sEG, sDec, self.l2norm)
            for item in cutlass.range(C * C // THREADS, unroll=4):
                i, j = chunk.cell(tidx, item, C)
                gated = Float32(0.0)
                if j <= i:
                    gated = sF[i, j] * chunk.exp(sG[i] - sG[j])
                sAg[i, j] = gated.to(ab)
            for item in cutlass.range(K * BV // THREADS, unroll=4):
                r, c = chunk.cell(tidx, item, BV)
                sSb[r, c] = sS[r, c].to(ab)
            cute.arch.sync_threads()

            # 4. q k^T, k S and q S on the tensor cores
            acc_f = _mma.accumulator(mma, tidx, (C, C))
            _mma.gemm(mma, acc_f, ops_qk)
            _mma.store(mma, tidx, acc_f, sF)
            acc_p = _mma.accumulator(mma, tidx, (C, BV))
            _mma.gemm(mma, acc_p, ops_ks)
            _mma.store(mma, tidx, acc_p, sP)
            acc_qs = _mma.accumulator(mma, tidx, (C, BV))
            _mma.gemm(mma, acc_qs, ops_qs)
            _mma.store(mma, tidx, acc_qs, sQS)
            cute.arch.sync_threads()

            # 5. (q k^T) * Gamma rounded; X = beta (v - exp(G) k S) rounded
            for item in cutlass.range(C * C // THREADS, unroll=4):
                i, j = chunk.cell(tidx, item, C)
                qk = Float32(0.0)
                if j <= i:
                    qk = sF[i, j] * chunk.exp(sG[i] - sG[j])
                sQKg[i, j] = qk.to(ab)
            for item in cutlass.range(C * BV // THREADS, unroll=4):
                r, c = chunk.cell(tidx, item, BV)
                vv = Float32(0.0)
                if r < rows:
                    vv = mV[start + r, i_hv, v0 + c].to(Float32)
                sXb[r, c] = (sBeta[r] * (vv - sEG[r] * sP[r, c])).to(ab)
            cute.arch.sync_threads()

            # 6. v_new = (A0 * Gamma) X
            acc_vn = _mma.accumulator(mma, tidx, (C, BV))
            _mma.gemm(mma, acc_vn, ops_vn)
            _mma.store(mma, tidx, acc_vn, sVn)
            cute.arch.sync_threads()

            # 7. v_new rounded, and decayed to the chunk's end
            for item in cutlass.range(C * BV // THREADS, unroll=4):
                r, c = chunk.cell(tidx, item, BV)
                sVnb[r, c] = sVn[r, c].to(ab)
                sVdb[r, c] = (sVn[r, c] * sDec[r]).to(ab)
            cute.arch.sync_threads()

            # 8. the intra-chunk output ((q k^T) * Gamma) v_new into sP; the state update K^T Vd into sU
            acc_o = _mma.accumulator(mma, tidx, (C, BV))
            _mma.gemm(mma, acc_o, ops_o)
            _mma.store(mma, tidx, acc_o, sP)
            acc_u = _mma.accumulator(mma, tidx, (K, BV))
            _mma.gemm(mma, acc_u, ops_u)
            _mma.store(mma, tidx, acc_u, sU)
            cute.arch.sync_threads()

            # 9. o of the chunk's real rows; S = exp(G_last) S + U
            for item in cutlass.range(C * BV // THREADS, unroll=4):
                r, c = chunk.cell(tidx, item, BV)
                if r < rows:
                    mO[start + r, i_hv, v0 + c] = (scale * (sEG[r] * sQS[r, c] + sP[r, c])).to(mO.element_type)
            last = sEG[C - 1]
            for item in cutlass.range(K * BV // THREADS, unroll=4):
                r, c = chunk.cell(tidx, item, BV)
                sS[r, c] = last * sS[r, c] + sU[r, c]
            cute.arch.sync_threads()

        for item in cutlass.range(K * BV // THREADS, unroll=4):
            r, c = chunk.cell(tidx, item, BV)
            mHt[i_n, i_hv, r, v0 + c] = sS[r, c]
