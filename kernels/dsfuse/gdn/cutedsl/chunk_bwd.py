"""The per-chunk gradients of the Gated DeltaNet's fused backward (kernel 3 of
``experiments/gdn/notes/fused-backward-design.md``), first form, sm_90a: one CTA of 256 threads
(two warpgroups, all of them in every step) per (chunk, value head), all independent, from the
forward's saved ``round(S)`` at the chunk's start (`dsfuse.gdn.cutedsl.fused_fwd`, ``states``), the
reverse chain's ``round(dS')`` after it (`dsfuse.gdn.cutedsl.state_bwd`), the preparing UT inverse's
``round(A Gamma)`` and rows' factors, and the chunk's q, k, v and dO rows. It writes dv, dbeta and
dg of the chunk's tokens, and dq, dk: the CTAs of a qk head's value heads on a chunk are one
**cluster**; each leaves its fp32 dq, dk (with respect to the L2-normalised q and k) in its shared
memory, and each sums a share of the chunk's rows over the cluster's value heads in head order,
reading the others' partials through distributed shared memory, applies the L2 norm's backward and
writes the rows once, rounded (no fp32 per-value-head gradients in memory, no atomics).

With ``^`` the L2-normalised rows (``q^ = rstd_q q``; no scale without the L2 norm), ``G`` the
chunk-local cumulative gate, ``Gamma_ij = exp(G_i - G_j)`` for ``j <= i``, ``A`` the gated inverse
``A0 Gamma``, ``dec = exp(G_last - G)``, ``beta`` and ``scale`` as the forward's (every product of
rounded operands, fp32 accumulation; the row factors on an accumulator or, where they sit on the
contracted dimension, on the operand before its rounding)::

    X      = beta (v - exp(G) (k^ S))          v_new = A X
    P      = tril(q^ k^^T Gamma)               dv_new = scale P^T dO + dec (k^ dS')
    dX     = A^T dv_new                        dv = beta dX
    dP     = scale tril(dO v_new^T)            dA = tril(dv_new X^T)
    dM     = -tril((A^T dA A^T) Gamma, -1)     (the inverse's backward, through the gated A)
    dq^    = scale exp(G) (dO S^T) + (dP Gamma) k^
    dk^    = (dP Gamma)^T q^ + dec (v_new dS'^T) - beta exp(G) (dX S^T) + (beta dM) k^ + (beta dM)^T k^
    dbeta  = rowsum(dX (v - exp(G) k^ S)) + rowsum(dM (k^ k^^T))
    dG     = rowsum(E) - colsum(E) + scale exp(G) rowsum((q^ S) dO) - beta exp(G) rowsum((k^ S) dX)
             - dec rowsum((k^ dS') v_new),  E = dP P + dA A;  dG_last += exp(G_last) <S, dS'> + sum of the last term
    dg     = the reverse cumulative sum of dG over the chunk

(``tests/gdn/test_gdn_fused_backward_algebra.py`` holds these in float64 against the reference, with
the ungated inverse; here ``A0^T (dA Gamma) A0^T = D^-1 (A^T dA A^T) D`` for ``D = diag(exp(G))``
puts them on the gated ``A`` the forward keeps.) ``rowsum((q^ S) dO)`` is read off ``dO S^T`` as
``rowsum((dO S^T) q^)``, and ``rowsum((k^ S) dX)`` off ``dX S^T``: no product for them alone.

Sums over a row of an accumulator: each thread's values of its two rows, the row's four lanes by
butterfly shuffles, the two warpgroups' halves through shared memory, added in that order: the same
bits every call. Eight phases: a barrier after each of the first five, two inside the seventh. Each
warp signals its stored partials in the seventh (a release restricted to shared memory, then a
relaxed arrival on an mbarrier of each CTA of the cluster; the step's dbeta and dg work then overlaps
the peers' arrivals), and each CTA waits on its own mbarrier before the sum, with the matching
acquire: the release of a plain cluster arrive, which ptxas makes a GPU-scope membar (every earlier
global store, dv's included), is not needed. A cluster barrier at the start publishes the mbarriers'
initialisation, and one at the end keeps each CTA's shared memory until its peers have read it.
Shared memory at K = V = 128, bf16 (tiles that take turns share storage): about 214 KiB, one CTA per
SM. So nothing else on its SM runs while a CTA's
rows land: meanwhile it asks L2 for the rows of the CTA of its rank one wave later (``ahead``
clusters on: those that run at once, from the SM count), whose own loads then come from L2. The
two states' tiles (full ``K x V`` tiles, no rows past a chunk) land by TMA, issued by one thread and
counted in bytes on an mbarrier; the chunk's rows by 16-byte ``cp.async`` (zeros past its end).

The kernel starts while the reverse chain runs: it is launched as the chain's programmatic dependent
(the chain lets it start once every chain's CTA has started, so no waiting CTA can keep a chain from
an SM), and each CTA waits for its chunk's flag, which the chain releases once that chunk's
``round(dS')`` is in memory, before it loads it. Its clusters start in the order in which the chains
finish the chunks (``finished``: by place from the document's end), so the SMs the chains leave idle
(with few long documents, most of them) run the chunks already done. Every CTA computes what it
would after the chain: the same bits, only earlier.
"""

from __future__ import annotations

import functools

import torch

from dsfuse._common import cutedsl as _cd

cutlass, cute = _cd.require()
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass._mlir.dialects.nvvm import MemScopeKind as _MemScope
from cutlass.cutlass_dsl import T as _types
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.cute.nvgpu import cpasync

from dsfuse.gdn.cutedsl import chunk
from dsfuse.gdn.cutedsl import mma as _mma
from dsfuse.gdn.cutedsl import wgmma as _wg
from dsfuse.gdn.cutedsl.wgmma import masked, pick, row_pair
from dsfuse.gdn.cutedsl.chunk import CHUNK, DTYPES
from dsfuse.gdn.cutedsl.fused_fwd_head import ALIGN, aligned_reasons, gate_qk
from dsfuse.gdn.cutedsl.fused_fwd_ws import _vectors
from dsfuse.gdn.cutedsl import state_bwd
from dsfuse.gdn.cutedsl.state_bwd import ARCHS
from dsfuse.gdn.cutedsl.ut_inverse import FACTORS, prepared_reasons

THREADS = 256  # two warpgroups
WARPGROUPS = 2
QUARTERS = THREADS // CHUNK  # E's column sums: a quarter of its rows for each thread (step 7)
assert QUARTERS == 4, "step 7 adds E's four column parts in a written-out order"
MAX_GROUP = 8  # value heads per qk head: a cluster of that many CTAs (8, the portable cluster size)


def shape_reasons(dtype: torch.dtype, heads: int, value_heads: int, dim_k: int, dim_v: int) -> list[str]:
    """Why this kernel cannot take these sizes (empty when it can): the reverse chain's, and at most
    `MAX_GROUP` value heads per qk head (a cluster of their CTAs sums dq and dk)."""
    reasons = state_bwd.shape_reasons(dtype, heads, value_heads, dim_k, dim_v)
    if heads > 0 and value_heads % heads == 0 and value_heads // heads > MAX_GROUP:
        reasons.append(f"the per-chunk gradients take at most {MAX_GROUP} value heads per qk head (a cluster of "
                       f"their CTAs), not {value_heads // heads}")
    return reasons


@cute.jit
def row_sums(vals: cute.Tensor, coords: cute.Tensor, sPart: cute.Tensor, u: Int32):
    """Each row's sum of ``vals`` (fp32, an accumulator's layout over two warpgroups that split N) into
    ``sPart[w, row]`` for warpgroup ``w``'s columns: a thread's two rows (``r`` and ``r + 8``), then the
    row's four lanes by shuffles. The caller adds ``sPart[0, row] + sPart[1, row]`` after a barrier."""
    r0 = coords[0][0]
    s0, s1 = Float32(0.0), Float32(0.0)
    for i in cutlass.range_constexpr(cute.size(vals)):
        if coords[i][0] == r0:
            s0 = s0 + vals[i]
        else:
            s1 = s1 + vals[i]
    s0 = cute.arch.warp_reduction(s0, lambda a, b: a + b, threads_in_group=4)
    s1 = cute.arch.warp_reduction(s1, lambda a, b: a + b, threads_in_group=4)
    if u % 4 == 0:
        sPart[u // 128, r0] = s0
        sPart[u // 128, r0 + 8] = s1


@cute.jit
def store_rows_scaled(acc: cute.Tensor, coords: cute.Tensor, factor: tuple, mOut: cute.Tensor, start: Int32, rows: Int32,
                      head: Int32, lane: Int32):
    """``factor`` (a `row_pair`) times the accumulator ``acc`` (a warpgroup's ``(64, N)`` share of a
    product), rounded to ``mOut``'s dtype, into rows ``start + r`` (``r < rows``) of head ``head`` of
    ``mOut`` ``[T, heads, N]`` (unit channel stride, 16-byte aligned rows) by 16-byte stores.

    A thread holds adjacent column pairs (one 32-bit word each) of its rows ``r`` and ``r + 8`` in
    every 8-column block; the four lanes of a quad hold a block's two rows between them. For each
    two blocks, the quad swaps words in two butterfly stages (a 4 x 4 transpose: lane ``t`` gets the
    row ``r + 8 (t & 1)`` of the block ``t >> 1``), so each lane stores 8 consecutive channels in one
    vector and a warp's store fills whole 32-byte sectors, not halves of them."""
    n = cute.size(acc)
    assert n % 8 == 0, "pairs of 8-column blocks: 8 values a thread"
    vals = cute.make_rmem_tensor((n,), mOut.element_type)
    for i in cutlass.range_constexpr(n):
        vals[i] = (pick(coords, i, factor) * acc[i]).to(mOut.element_type)
    words = cute.recast_tensor(vals, Int32)  # word h + 2 j: row r + 8 h, columns 8 j + 2 t, + 1
    out = cute.make_rmem_tensor((8,), mOut.element_type)
    out_w = cute.recast_tensor(out, Int32)
    t = lane % 4
    even, low = (t & 1) == 0, (t & 2) == 0
    row = coords[0][0] + 8 * (t & 1)
    for m in cutlass.range_constexpr(n // 8):
        w = [words[4 * m + b] for b in range(4)]  # b = h + 2 (j - 2 m)
        y = [None] * 4  # after the first stage (lanes t, t ^ 1): y[s0 + 2 b1], from lane (s0, t >> 1)
        for b1 in cutlass.range_constexpr(2):
            w0, w1 = w[2 * b1], w[2 * b1 + 1]
            got = cute.arch.shuffle_sync_bfly(Int32(cutlass.select_(even, w1, w0)), offset=1)
            y[2 * b1] = Int32(cutlass.select_(even, w0, got))
            y[2 * b1 + 1] = Int32(cutlass.select_(even, got, w1))
        for s0 in cutlass.range_constexpr(2):  # the second stage (lanes t, t ^ 2): out_w[s] from lane s, columns 2 s, 2 s + 1
            y0, y1 = y[s0], y[s0 + 2]
            got = cute.arch.shuffle_sync_bfly(Int32(cutlass.select_(low, y1, y0)), offset=2)
            out_w[s0] = Int32(cutlass.select_(low, y0, got))
            out_w[s0 + 2] = Int32(cutlass.select_(low, got, y1))
        col = coords[8 * m][1] - 2 * t + 8 * (t >> 1)  # the first column of this lane's block
        if row < rows:
            cute.autovec_copy(out, cute.local_tile(mOut[start + row, head, None], (8,), (col // 8,)))


@cute.jit
def inner_product(buf_a, buf_b, dtype: cutlass.Constexpr, n: cutlass.Constexpr, u: Int32) -> Float32:
    """The sum of the products of two ``n``-element 16-bit tiles' elements, over their raw storage (the
    two share a layout, so position pairs with position whatever the swizzle): 16-byte vectors, each
    thread its own, then the warp's lanes by shuffles (a warp's part of the whole, the same bits every
    call)."""
    per = n // 8 // THREADS
    layout = cute.make_layout((8, THREADS, per), stride=(1, 8, 8 * THREADS))
    ta = cute.make_tensor(cute.recast_ptr(buf_a, dtype=dtype), layout)
    tb = cute.make_tensor(cute.recast_ptr(buf_b, dtype=dtype), layout)
    fa, fb = cute.make_rmem_tensor((8,), dtype), cute.make_rmem_tensor((8,), dtype)
    part = Float32(0.0)
    for j in cutlass.range_constexpr(per):
        cute.autovec_copy(ta[None, u, j], fa)
        cute.autovec_copy(tb[None, u, j], fb)
        for e in cutlass.range_constexpr(8):
            part = part + fa[e].to(Float32) * fb[e].to(Float32)
    return cute.arch.warp_reduction(part, lambda a, b: a + b)


@dsl_user_op
def _load_cluster4(ptr, *, loc=None, ip=None) -> tuple:
    """Four consecutive fp32 from a cluster peer's shared memory (16-byte aligned ``ptr`` from
    ``cute.arch.map_dsmem_ptr``): one ``ld.shared::cluster.v4.f32``."""
    addr = Int32(ptr.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip)
    f32 = _types.f32()
    res = llvm.inline_asm(llvm.StructType.get_literal([f32] * 4), [addr],
                          "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r",
                          has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                          loc=loc, ip=ip)
    return tuple(Float32(llvm.extractvalue(f32, res, [j], loc=loc, ip=ip)) for j in range(4))


class ChunkBackward:
    """``(q, k, v, do, a_round, factors, states, dstates, chunk_indices, dq, dk, dv, dg, dbeta, ready, slots,
    scale, ahead, dependent)``: grid (NC * HV) of 256 threads, CTA ``slot * HV + hv`` for chunk
    ``slots[slot]`` and value head ``hv``, in clusters of ``HV / H`` along it (module docstring);
    ``states``, ``dstates`` ``[NC * K, HV, V]``, ``dq``, ``dk`` ``[T, H, K]``."""

    def __init__(self, dtype: torch.dtype, heads: int, value_heads: int, dim_k: int, dim_v: int, l2norm: bool):
        self.dtype, self.heads, self.value_heads, self.dim_k, self.dim_v, self.l2norm = (
            DTYPES[dtype], heads, value_heads, dim_k, dim_v, l2norm)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mDO: cute.Tensor, mA: cute.Tensor,
                 mF: cute.Tensor, mS: cute.Tensor, mDS: cute.Tensor, mChunks: cute.Tensor, mDq: cute.Tensor,
                 mDk: cute.Tensor, mDv: cute.Tensor, mDg: cute.Tensor, mDbeta: cute.Tensor, mReady: cute.Tensor,
                 mSlots: cute.Tensor, scale: Float32, ahead: Int32, dependent: Int32, stream):
        # round(S) and round(dS') land in their swizzled tiles by TMA (full tiles: no rows past a chunk)
        load = cpasync.CopyBulkTensorTileG2SOp()
        (load_s, mS_tma), (load_ds, mDS_tma) = (state_bwd.state_tma(load, m, self.dtype, self.dim_k) for m in (mS, mDS))
        # one CTA a (slot, value head), value heads fastest: the clusters start slot by slot, so in the
        # order of `mSlots` (the order in which the reverse chain finishes the chunks); a programmatic
        # dependent of the reverse chain (``dependent`` 1), which may start while it runs (`mReady`)
        self.kernel(mQ, mK, mV, mDO, mA, mF, mS, mDS, mChunks, mDq, mDk, mDv, mDg, mDbeta, mReady, mSlots, scale,
                    ahead, (load_s, load_ds), (mS_tma, mDS_tma)).launch(
            grid=[mSlots.shape[0] * self.value_heads, 1, 1], block=[THREADS, 1, 1],
            cluster=[self.value_heads // self.heads, 1, 1], stream=stream, use_pdl=dependent)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mDO: cute.Tensor, mA: cute.Tensor,
               mF: cute.Tensor, mS: cute.Tensor, mDS: cute.Tensor, mChunks: cute.Tensor, mDq: cute.Tensor,
               mDk: cute.Tensor, mDv: cute.Tensor, mDg: cute.Tensor, mDbeta: cute.Tensor, mReady: cute.Tensor,
               mSlots: cute.Tensor, scale: Float32, ahead: Int32, state_loads: tuple, state_tiles: tuple):
        K, V, C, ab = self.dim_k, self.dim_v, CHUNK, self.dtype
        u, _, _ = cute.arch.thread_idx()
        i_x, _, _ = cute.arch.block_idx()
        slot, i_hv = i_x // self.value_heads, i_x % self.value_heads
        i_c = mSlots[slot]
        i_h = i_hv // (self.value_heads // self.heads)
        start = mChunks[i_c, 1]
        rows = mChunks[i_c, 2] - start

        smem = cutlass.memory.SmemAllocator()
        tile, over = _wg.tile, _wg.tile_over
        sQ, sK, sDO = tile(smem, ab, C, K), tile(smem, ab, C, K), tile(smem, ab, C, V)
        buf_s = smem.allocate(K * V * 2, 1024)  # round(S) at the chunk's start, then E (fp32)
        sS = over(buf_s, ab, K, V)
        sE = cute.make_tensor(cute.recast_ptr(buf_s, dtype=Float32), cute.make_layout((C, C), stride=(C, 1)))
        buf_ds = smem.allocate(K * V * 2, 1024)  # round(dS'), the gradient of the state after the chunk,
        sDS = over(buf_ds, ab, K, V)              # then this value head's dq^ (fp32) for the cluster's sum
        sDqP = cute.make_tensor(cute.recast_ptr(buf_ds, dtype=Float32), cute.make_layout((C, K), stride=(K, 1)))
        sDkP = cute.make_tensor(cute.recast_ptr(buf_s, dtype=Float32), cute.make_layout((C, K), stride=(K, 1)))
        sA = tile(smem, ab, C, C)  # round(A Gamma)
        sF = chunk.tile(smem, Float32, len(FACTORS), C)
        buf_v = smem.allocate(C * V * 2, 1024)  # v, then round(dv_new), then round(A^T dA)
        sV, sDvn, sT1 = over(buf_v, ab, C, V), over(buf_v, ab, C, V), over(buf_v, ab, C, C)
        buf_x = smem.allocate(C * V * 2, 1024)  # round(X), then W3 = beta dM rstd_k (rows)
        sX, sW3 = over(buf_x, ab, C, V), over(buf_x, ab, C, C)
        buf_p = smem.allocate(C * C * 2, 1024)  # round(P), then round(dA), then W2 = beta dM rstd_k (columns)
        sP, sDag, sW2 = over(buf_p, ab, C, C), over(buf_p, ab, C, C), over(buf_p, ab, C, C)
        sVn, sDX = tile(smem, ab, C, V), tile(smem, ab, C, V)  # round(v_new), round(dX)
        sW1, sW4 = tile(smem, ab, C, C), tile(smem, ab, C, C)  # dP Gamma rstd_q (rows), rstd_k (columns)
        # rows' partial sums by warpgroup (`row_sums`): the state term of dG, dbeta's two terms, and
        # rowsum((dO S^T) q), rowsum((dX S^T) k); the warps' parts of <S, dS'>
        sTrow, sB1, sB2, sOS, sXS = (chunk.tile(smem, Float32, 2, C) for _ in range(5))
        sLast = chunk.vector(smem, THREADS // 32)
        sErow = chunk.tile(smem, Float32, 2, C)  # E's row sums by warpgroup (`row_sums`, step 5)
        sEcol = chunk.tile(smem, Float32, QUARTERS, C)  # E's column sums by quarter of its rows
        sTot = chunk.vector(smem, 4)  # the state term's total by warp (2); the second warp's dG total
        # every warp of the cluster (this CTA's too) has stored its partials: one arrival a warp
        mbar = cute.recast_ptr(smem.allocate(8, 8), dtype=cutlass.Int64)
        mbar_states = cute.recast_ptr(smem.allocate(8, 8), dtype=cutlass.Int64)  # the states' TMA loads landed
        group = self.value_heads // self.heads
        if u == 0:
            cute.arch.mbarrier_init(mbar, group * (THREADS // 32))
            cute.arch.mbarrier_init(mbar_states, 1)
            cute.arch.mbarrier_init_fence()
        if u // 32 == 0:  # step 0's TMA loads (by the lane the copy elects: a whole warp calls it)
            # the warp meets before thread 0 expects the bytes: ptxas issues the initialisations once
            # for the warp (uniform datapath), which racecheck counts as another lane's writes
            cute.arch.sync_warp()
            if u == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(mbar_states, 2 * K * V * ab.width // 8)  # the states' bytes
            self._start_states(mbar_states, state_loads[:1], (sS,), state_tiles[:1], i_c, i_hv)
            # round(dS') once the reverse chain has stored it (each lane acquires the flag itself)
            while state_bwd.acquire_flag(mReady, i_c, i_hv) == 0:
                pass
            cute.arch.sync_warp()
            self._start_states(mbar_states, state_loads[1:], (sDS,), state_tiles[1:], i_c, i_hv)
        cute.arch.cluster_arrive_relaxed()  # the barrier initialised, for the peers' arrivals (waited in step 7)
        sG, sBeta, sEGq, sEGk, sDec, sRstd = _vectors(sF)

        # 0. the chunk's rows and factors (zeros past the chunk's rows), beside the states' TMA loads
        chunk.start_prepared_rows(u, THREADS, (sQ, sK, sV, sA, sF), (mQ, mK, mV, mA, mF), start, rows,
                                  i_c * len(FACTORS), len(FACTORS), i_h, i_hv, i_hv)
        chunk.start_rows(chunk.copy_rows(ab, V, THREADS), u, mDO, sDO, start, rows, i_hv)
        cute.arch.cp_async_commit_group()
        self._prefetch_ahead(u, (mQ, mK, mV, mDO, mA, mS, mDS), mChunks, mSlots, slot, i_hv, ahead)
        cute.arch.cp_async_wait_group(0)
        _wg.fence_writes()
        cute.arch.sync_threads()  # (after thread 0 initialised the states' barrier)
        self._states_landed(mbar_states)

        T = _wg.transposed
        mma_cv_kn = _wg.tiled_mma(ab, C, V, True, False, WARPGROUPS)  # A K-major, B N-major
        mma_cv_nn = _wg.tiled_mma(ab, C, V, False, False, WARPGROUPS)
        mma_cc_kk = _wg.tiled_mma(ab, C, C, True, True, WARPGROUPS)
        mma_cc_nn = _wg.tiled_mma(ab, C, C, False, False, WARPGROUPS)
        mma_ck_kk = _wg.tiled_mma(ab, C, K, True, True, WARPGROUPS)
        mma_ck_kn = _wg.tiled_mma(ab, C, K, True, False, WARPGROUPS)
        mma_ck_nn = _wg.tiled_mma(ab, C, K, False, False, WARPGROUPS)
        # (C, V) and (C, K) accumulators share a layout at K = V (`shape_reasons`)
        cCV, cCC = _mma.coordinates(mma_cv_kn, u, (C, V)), _mma.coordinates(mma_cc_kk, u, (C, C))
        acc = _wg.fresh_accumulator  # each one's first product with fresh=True

        # 1. k S, q k^T, k dS', k k^T; X = beta (v - exp(G) rstd_k k S) stored rounded, P gated and
        #    stored rounded (kept), dec rstd_k (k dS') and rstd_k rstd_k^T (k k^T) kept
        acc_ks, acc_kd = acc(mma_cv_kn, u, (C, V)), acc(mma_cv_kn, u, (C, V))
        acc_p, acc_kk = acc(mma_cc_kk, u, (C, C)), acc(mma_cc_kk, u, (C, C))
        _wg.gemm(mma_cv_kn, acc_ks, _wg.operands(mma_cv_kn, u, sK, T(sS)), wait=False, fresh=True)
        _wg.gemm(mma_cc_kk, acc_p, _wg.operands(mma_cc_kk, u, sQ, sK), wait=False, fresh=True)
        _wg.gemm(mma_cv_kn, acc_kd, _wg.operands(mma_cv_kn, u, sK, T(sDS)), wait=False, fresh=True)
        _wg.gemm(mma_cc_kk, acc_kk, _wg.operands(mma_cc_kk, u, sK, sK), wait=False, fresh=True)
        v_r = cute.make_fragment_like(acc_ks, ab)
        _wg.load_like(mma_cv_kn, u, sV, v_r)
        beta, egk, dec = row_pair(cCV, sBeta), row_pair(cCV, sEGk), row_pair(cCV, sDec)
        beta_c, rstd_q, rstd_k = row_pair(cCC, sBeta), row_pair(cCC, sRstd), row_pair(cCC, sRstd, C)
        _wg.wait()
        for i in cutlass.range_constexpr(cute.size(acc_ks)):
            acc_ks[i] = pick(cCV, i, beta) * (v_r[i].to(Float32) - pick(cCV, i, egk) * acc_ks[i])
            acc_kd[i] = pick(cCV, i, dec) * acc_kd[i]
        _wg.store_rounded(mma_cv_kn, u, acc_ks, sX, ab)
        gate_qk(acc_p, cCC, sG, sRstd, self.l2norm, two_rows=True)
        _wg.store_rounded(mma_cc_kk, u, acc_p, sP, ab)
        for i in cutlass.range_constexpr(cute.size(acc_kk)):
            acc_kk[i] = acc_kk[i] * (pick(cCC, i, rstd_k) * sRstd[C + cCC[i][1]])
        _wg.fence_writes()
        cute.arch.sync_threads()

        # 2. v_new = round(A) round(X) (stored rounded); the state term of dG, rowsum(dec rstd_k (k dS')
        #    v_new); dv_new = scale round(P)^T dO + dec rstd_k (k dS'), stored rounded (on v's storage)
        acc_vn, acc_dvn = acc(mma_cv_kn, u, (C, V)), acc(mma_cv_nn, u, (C, V))
        _wg.gemm(mma_cv_kn, acc_vn, _wg.operands(mma_cv_kn, u, sA, T(sX)), wait=False, fresh=True)
        _wg.gemm(mma_cv_nn, acc_dvn, _wg.operands(mma_cv_nn, u, T(sP), T(sDO)), wait=False, fresh=True)
        _wg.wait()
        _wg.store_rounded(mma_cv_kn, u, acc_vn, sVn, ab)
        for i in cutlass.range_constexpr(cute.size(acc_kd)):
            acc_dvn[i] = scale * acc_dvn[i] + acc_kd[i]
            acc_kd[i] = acc_kd[i] * acc_vn[i]
        row_sums(acc_kd, cCV, sTrow, u)
        _wg.store_rounded(mma_cv_nn, u, acc_dvn, sDvn, ab)
        _wg.fence_writes()
        cute.arch.sync_threads()

        # 3. dX = round(A)^T round(dv_new): dv = beta dX to memory, rowsum(dX v), round(dX) stored;
        #    dA = tril(round(dv_new) round(X)^T), stored rounded (on P's storage); dP = scale
        #    tril(dO round(v_new)^T); E = dP P + dA A kept; W1 = dP Gamma rstd_q (rows) and
        #    W4 = dP Gamma rstd_k (columns) stored rounded
        acc_dx, acc_da, acc_dp = acc(mma_cv_nn, u, (C, V)), acc(mma_cc_kk, u, (C, C)), acc(mma_cc_kk, u, (C, C))
        _wg.gemm(mma_cv_nn, acc_dx, _wg.operands(mma_cv_nn, u, T(sA), T(sDvn)), wait=False, fresh=True)
        _wg.gemm(mma_cc_kk, acc_da, _wg.operands(mma_cc_kk, u, sDvn, sX), wait=False, fresh=True)
        _wg.gemm(mma_cc_kk, acc_dp, _wg.operands(mma_cc_kk, u, sDO, sVn), wait=False, fresh=True)
        a_r = cute.make_fragment_like(acc_da, ab)
        _wg.load_like(mma_cc_kk, u, sA, a_r)
        _wg.wait_for(2)  # dX first: its stores and row sums run while dA and dP do
        _wg.store_rounded(mma_cv_nn, u, acc_dx, sDX, ab)
        store_rows_scaled(acc_dx, cCV, beta, mDv, start, rows, i_hv, u % 32)
        for i in cutlass.range_constexpr(cute.size(acc_dx)):
            acc_dx[i] = acc_dx[i] * v_r[i].to(Float32)
        row_sums(acc_dx, cCV, sB1, u)
        _wg.wait()
        w1 = cute.make_fragment_like(acc_dp, ab)
        g_row = row_pair(cCC, sG)
        for i in cutlass.range_constexpr(cute.size(acc_dp)):
            r, c = cCC[i][0], cCC[i][1]
            lower = c <= r
            dp, da = masked(lower, scale * acc_dp[i]), masked(lower, acc_da[i])
            acc_da[i] = da
            acc_p[i] = dp * acc_p[i] + da * a_r[i].to(Float32)  # E, kept until P's storage frees up
            dpg = masked(lower, dp * chunk.exp(pick(cCC, i, g_row) - sG[c]))  # dP Gamma
            w1[i] = (dpg * pick(cCC, i, rstd_q)).to(ab)
            acc_dp[i] = dpg * sRstd[C + c]
        _wg.store_rounded(mma_cc_kk, u, acc_da, sDag, ab)
        _wg.store(mma_cc_kk, u, w1, sW1)
        _wg.store_rounded(mma_cc_kk, u, acc_dp, sW4, ab)
        _wg.fence_writes()
        cute.arch.sync_threads()

        # 4. round(A^T dA) stored (on v's storage); dO S^T, dX S^T, v_new dS'^T into dq's and dk's
        #    accumulators; rowsum((dO S^T) q) and rowsum((dX S^T) k) before the rows' factors;
        #    <S, dS'> by all threads (S's last reads: E takes its storage next)
        acc_t1 = acc(mma_cc_nn, u, (C, C))
        _wg.gemm(mma_cc_nn, acc_t1, _wg.operands(mma_cc_nn, u, T(sA), T(sDag)), wait=False, fresh=True)
        acc_q, acc_b, acc_k = acc(mma_ck_kk, u, (C, K)), acc(mma_ck_kk, u, (C, K)), acc(mma_ck_kk, u, (C, K))
        _wg.gemm(mma_ck_kk, acc_q, _wg.operands(mma_ck_kk, u, sDO, sS), wait=False, fresh=True)
        _wg.gemm(mma_ck_kk, acc_b, _wg.operands(mma_ck_kk, u, sDX, sS), wait=False, fresh=True)
        _wg.gemm(mma_ck_kk, acc_k, _wg.operands(mma_ck_kk, u, sVn, sDS), wait=False, fresh=True)
        part = inner_product(buf_s, buf_ds, ab, K * V, u)
        if u % 32 == 0:
            sLast[u // 32] = part
        x_r = cute.make_fragment_like(acc_q, ab)
        _wg.wait_for(3)
        _wg.store_rounded(mma_cc_nn, u, acc_t1, sT1, ab)
        _wg.wait()
        prod = cute.make_fragment_like(acc_q)
        _wg.load_like(mma_ck_kk, u, sQ, x_r)
        for i in cutlass.range_constexpr(cute.size(acc_q)):
            prod[i] = acc_q[i] * x_r[i].to(Float32)
        row_sums(prod, cCV, sOS, u)
        _wg.load_like(mma_ck_kk, u, sK, x_r)
        for i in cutlass.range_constexpr(cute.size(acc_b)):
            prod[i] = acc_b[i] * x_r[i].to(Float32)
        row_sums(prod, cCV, sXS, u)
        g_last = sG[C - 1]
        g_v = row_pair(cCV, sG)
        eg = (chunk.exp(g_v[0]), chunk.exp(g_v[1]))
        dec_k = (chunk.exp(g_last - g_v[0]), chunk.exp(g_last - g_v[1]))
        for i in cutlass.range_constexpr(cute.size(acc_q)):
            e = pick(cCV, i, eg)
            acc_q[i] = scale * e * acc_q[i]
            acc_k[i] = pick(cCV, i, dec_k) * acc_k[i] - pick(cCV, i, beta) * e * acc_b[i]
        _wg.fence_writes()
        cute.arch.sync_threads()

        # 5. E stored (fp32, on S's storage); dM = -tril(round(A^T dA) round(A)^T Gamma, -1);
        #    rowsum(dM k^ k^^T); W2 = beta dM rstd_k (columns, on dA's storage), W3 = beta dM rstd_k
        #    (rows, on X's) stored rounded
        acc_dm = acc(mma_cc_kk, u, (C, C))
        _wg.gemm(mma_cc_kk, acc_dm, _wg.operands(mma_cc_kk, u, sT1, sA), wait=False, fresh=True)
        for i in cutlass.range_constexpr(cute.size(acc_p)):
            sE[cCC[i][0], cCC[i][1]] = acc_p[i]
        row_sums(acc_p, cCC, sErow, u)
        _wg.wait()
        w3 = cute.make_fragment_like(acc_dm, ab)
        for i in cutlass.range_constexpr(cute.size(acc_dm)):
            r, c = cCC[i][0], cCC[i][1]
            dm = masked(c < r, -acc_dm[i] * chunk.exp(pick(cCC, i, g_row) - sG[c]))
            acc_kk[i] = dm * acc_kk[i]
            bdm = pick(cCC, i, beta_c) * dm
            w3[i] = (bdm * pick(cCC, i, rstd_k)).to(ab)
            acc_dm[i] = bdm * sRstd[C + c]
        row_sums(acc_kk, cCC, sB2, u)
        _wg.store_rounded(mma_cc_kk, u, acc_dm, sW2, ab)
        _wg.store(mma_cc_kk, u, w3, sW3)
        _wg.fence_writes()
        cute.arch.sync_threads()

        # 6. dq^ += W4 k; dk^ += W1^T q + W2 k + W3^T k; dq^ into shared memory (fp32, on dS''s
        #    storage) for the cluster's sum
        _wg.gemm(mma_ck_kn, acc_q, _wg.operands(mma_ck_kn, u, sW4, T(sK)), wait=False)
        _wg.gemm(mma_ck_nn, acc_k, _wg.operands(mma_ck_nn, u, T(sW1), T(sQ)), wait=False)
        _wg.gemm(mma_ck_kn, acc_k, _wg.operands(mma_ck_kn, u, sW2, T(sK)), wait=False)
        _wg.gemm(mma_ck_nn, acc_k, _wg.operands(mma_ck_nn, u, T(sW3), T(sK)), wait=False)
        _wg.wait()
        for i in cutlass.range_constexpr(cute.size(acc_q)):
            sDqP[cCV[i][0], cCV[i][1]] = acc_q[i]

        # 7. dbeta and dG by the chunk's rows (threads t < C). E's row sums were taken from registers
        #    in step 5; its column sums here by every thread, a quarter of the rows each (a warp reads
        #    32 consecutive columns: no bank conflicts), the quarters added in order; the state term's
        #    total by shuffles; dG_last takes exp(G_last) <S, dS'> and that total; dg = the reverse
        #    cumulative sum of dG, a shuffle scan in each of the two warps, then the second warp's total
        #    added to the first's rows. A fixed order of additions: the same bits every call.
        t, quarter, lane = u % C, u // C, u % 32
        col = Float32(0.0)
        for j in cutlass.range(C // QUARTERS, unroll_full=True):
            col = col + sE[quarter * (C // QUARTERS) + j, t]
        sEcol[quarter, t] = col
        if u < C:
            trow = cute.arch.warp_reduction(sTrow[0, u] + sTrow[1, u], lambda a, b: a + b)
            if lane == 0:
                sTot[u // 32] = trow
        cute.arch.sync_threads()
        # E's storage is free: dk^ there, and the cluster's peers may read this CTA's partials once
        # every CTA has arrived; the rest of this step runs while the slower peers get there
        for i in cutlass.range_constexpr(cute.size(acc_k)):
            sDkP[cCV[i][0], cCV[i][1]] = acc_k[i]
        self._partials_stored(u, mbar, group)
        d_g = Float32(0.0)
        if u < C:
            row = sErow[0, t] + sErow[1, t]
            col = (sEcol[0, t] + sEcol[1, t]) + (sEcol[2, t] + sEcol[3, t])
            xs = sXS[0, t] + sXS[1, t]
            dbeta = (sB1[0, t] + sB1[1, t]) - sEGk[t] * xs + (sB2[0, t] + sB2[1, t])
            d_g = (row - col + scale * sEGq[t] * (sOS[0, t] + sOS[1, t]) - sBeta[t] * sEGk[t] * xs
                   - (sTrow[0, t] + sTrow[1, t]))
            if t < rows:
                mDbeta[start + t, i_hv] = dbeta.to(mDbeta.element_type)
            for step in cutlass.range_constexpr(5):  # inclusive suffix sums within the warp
                other = cute.arch.shuffle_sync_down(d_g, offset=1 << step)
                if lane + (1 << step) < 32:
                    d_g = d_g + other
            if u == 32:
                sTot[2] = d_g  # the second warp's whole sum
        cute.arch.sync_threads()
        if u < C:
            total = Float32(0.0)
            for w in cutlass.range_constexpr(THREADS // 32):
                total = total + sLast[w]
            dg = chunk.exp(sG[C - 1]) * total + (sTot[0] + sTot[1])
            if u < 32:
                dg = dg + sTot[2]
            dg = dg + d_g
            if t < rows:
                mDg[start + t, i_hv] = dg

        # 8. the cluster (the qk head's value heads, this chunk) sums dq^ and dk^ in head order, each CTA
        #    a share of the rows, a warp a row, each lane four consecutive channels (K = 128) read in
        #    one vector load from every CTA's shared memory (its own partial from its own, not over the
        #    cluster's network: a code path for each rank); then the L2 norm's backward, dx = rstd (dx^ -
        #    x^ (dx^ . x^)), and the rows rounded into dq, dk by 8-byte stores
        self._partials_arrived(mbar)
        rank = cute.arch.block_idx_in_cluster()
        for me in cutlass.range_constexpr(group):
            if rank == me:
                self._cluster_sum(me, group, u, ((sDqP, sQ, mDq, 0), (sDkP, sK, mDk, C)), sRstd, start, rows, i_h)
        # the partials stay until every CTA of the cluster has read them. A relaxed arrive releases
        # nothing, so it is the data that orders it: every peer load of `_cluster_sum` feeds a store
        # this thread issues before it (a warp issues in order; rows past the chunk's end are not
        # read). A release arrive would wait for this CTA's dq, dk stores to reach the GPU's scope.
        cute.arch.fence_acq_rel_cta()
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()

    @cute.jit
    def _partials_arrived(self, mbar):
        """Step 8's wait: every warp of the cluster arrived in step 7 (`_partials_stored`); then the
        acquire of what they released."""
        cute.arch.mbarrier_wait(mbar, 0)
        state_bwd.fence_asm("fence.acquire.sync_restrict::shared::cluster.cluster;")

    @cute.jit
    def _start_states(self, mbar, atoms: tuple, tiles: tuple, sources: tuple, i_c: Int32, i_hv: Int32):
        """Step 0 by one warp (the TMA copy elects one of its lanes): ``round(S)`` and ``round(dS')`` of
        chunk ``i_c`` and value head ``i_hv`` into their tiles by TMA (`state_bwd.state_tma`), their
        bytes counted on ``mbar`` (expected by the caller before; waited by `_states_landed`)."""
        for atom, t, m in zip(atoms, tiles, sources):
            tile_s, tiles_g = state_bwd.state_boxes(atom, t, m, i_hv)
            cute.copy(atom, tiles_g[None, i_c], tile_s, tma_bar_ptr=mbar)

    @cute.jit
    def _states_landed(self, mbar):
        """Every thread: wait until `_start_states`'s bytes have landed."""
        cute.arch.mbarrier_wait(mbar, 0)

    @cute.jit
    def _partials_stored(self, u: Int32, mbar, group: cutlass.Constexpr):
        """Step 7's signal that this warp's fp32 partials are in shared memory: its lanes meet, then one
        releases this CTA's shared-memory writes to the cluster (a fence restricted to them: not the
        plain cluster arrive's release of every write to the GPU's scope, which waits for the dv
        stores) and arrives on each CTA's barrier of the cluster, this one's included (relaxed: the
        fence before it releases). Waited in step 8, with the matching acquire."""
        cute.arch.cluster_wait()  # the peers' barriers are initialised
        cute.arch.sync_warp()
        if u % 32 == 0:
            state_bwd.fence_asm("fence.release.sync_restrict::shared::cta.cluster;")
            for g in cutlass.range_constexpr(group):
                cute.arch.mbarrier_arrive(mbar, g, relaxed=True, scope=_MemScope.CLUSTER)

    @cute.jit
    def _prefetch_ahead(self, u: Int32, sources, mChunks: cute.Tensor, mSlots: cute.Tensor, slot: Int32, i_hv: Int32,
                        ahead: Int32):
        """Into L2, the rows that the CTA of the same rank ``ahead`` clusters later will load (clusters
        start in the order of their index, qk heads first): with ``ahead`` the clusters that run at once,
        the next wave's. Timing only: nothing it reads changes a value (a round(dS') not yet stored is
        read again by its own CTA's TMA load after its flag)."""
        mQ, mK, mV, mDO, mA, mS, mDS = sources
        K, C, group = self.dim_k, CHUNK, self.value_heads // self.heads
        later = slot * self.heads + i_hv // group + ahead
        if later < mSlots.shape[0] * self.heads:
            j_c, j_h = mSlots[later // self.heads], later % self.heads
            j_hv = j_h * group + i_hv % group
            start = mChunks[j_c, 1]
            rows = mChunks[j_c, 2] - start
            r = u % C
            # a row of S (threads 0-127) or of dS' (128-255); a row of q and of round(A Gamma), k, v
            # or dO (by quarters of the threads), the chunk's rows only
            if u < K:
                _prefetch_l2(mS[j_c * K + u, j_hv, None])
            else:
                _prefetch_l2(mDS[j_c * K + u - K, j_hv, None])
            quarter = u // C
            if r < rows:
                if quarter == 0:
                    _prefetch_l2(mQ[start + r, j_h, None])
                    _prefetch_l2(mA[start + r, j_hv, None])
                elif quarter == 1:
                    _prefetch_l2(mK[start + r, j_h, None])
                elif quarter == 2:
                    _prefetch_l2(mV[start + r, j_hv, None])
                else:
                    _prefetch_l2(mDO[start + r, j_hv, None])

    @cute.jit
    def _cluster_sum(self, me: cutlass.Constexpr, group: cutlass.Constexpr, u: Int32, targets, sRstd: cute.Tensor,
                     start: Int32, rows: Int32, i_h: Int32):
        """Step 8 in the CTA of rank ``me``: for each ``(partial, x, out, first)`` of ``targets``, rows
        ``me * C / group ..`` of ``out`` summed over the cluster's ``partial`` in rank order."""
        K, C, ab = self.dim_k, CHUNK, self.dtype
        assert K == 4 * 32, "a lane sums four channels of a row"
        warp, lane = u // 32, u % 32
        for part, sX, mOut, first in targets:
            peers = [cute.arch.map_dsmem_ptr(part.iterator, g) for g in range(group)]
            own = cute.make_rmem_tensor((4,), Float32)
            x_r = cute.make_rmem_tensor((4,), ab)
            out = cute.make_rmem_tensor((4,), mOut.element_type)
            for r in cutlass.range(me * C // group + warp, (me + 1) * C // group, THREADS // 32, unroll=1):
                if r < rows:  # no row past the chunk's end: every peer load feeds a store (see step 8's end)
                    cute.autovec_copy(cute.local_tile(part[r, None], (4,), (lane,)), own)  # channels 4 lane ..
                    parts = []
                    for g in cutlass.range_constexpr(group):
                        if const_expr(g == me):
                            parts.append([own[j] for j in range(4)])
                        else:
                            parts.append(_load_cluster4(peers[g] + (r * K + 4 * lane)))
                    vals = list(parts[0])
                    for g in cutlass.range_constexpr(1, group):
                        vals = [vals[j] + parts[g][j] for j in range(4)]
                    if const_expr(self.l2norm):
                        rstd = sRstd[first + r]
                        cute.autovec_copy(cute.local_tile(sX[r, None], (4,), (lane,)), x_r)
                        xs = [x_r[j].to(Float32) * rstd for j in range(4)]
                        dot = ((vals[0] * xs[0] + vals[1] * xs[1]) + (vals[2] * xs[2] + vals[3] * xs[3]))
                        dot = cute.arch.warp_reduction(dot, lambda a, b: a + b)
                        vals = [rstd * (vals[j] - xs[j] * dot) for j in range(4)]
                    for j in cutlass.range_constexpr(4):
                        out[j] = vals[j].to(mOut.element_type)
                    cute.autovec_copy(out, cute.local_tile(mOut[start + r, i_h, None], (4,), (lane,)))


@dsl_user_op
def _prefetch_l2(row: cute.Tensor, *, loc=None, ip=None) -> None:
    """``row`` (contiguous, in global memory) into L2: a ``prefetch.global.L2`` every 128 bytes from its
    start, which nothing waits for (a hint: a row that does not start a 128-byte line may keep its
    last line out)."""
    nbytes = cute.size(row.layout) * row.element_type.width // 8
    addr = row.iterator.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)
    body = " ".join(f"prefetch.global.L2 [$0+{line}];" for line in range(0, nbytes, 128))
    llvm.inline_asm(None, [addr], body, "l", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


CACHE = _cd.KernelCache()  # (dtype, H, HV, K, V, l2norm, arch) -> compiled function


def _fake_tensors(dtype: torch.dtype, heads: int, value_heads: int, dim_k: int, dim_v: int) -> tuple:
    """Fake tensors of the compiled signature: q, k, v, dO and dv rows with any 16-byte aligned token and
    head strides (packed views), the rest contiguous."""
    cdt = DTYPES[dtype]
    rows, a_round, factors, table = state_bwd.fake_prepared(dtype, value_heads)
    states = [cute.runtime.make_fake_tensor(cdt, (cute.sym_int(), value_heads, dim_v), (value_heads * dim_v, dim_v, 1),
                                            assumed_align=ALIGN) for _ in range(2)]
    gates = [cute.runtime.make_fake_tensor(elem, (cute.sym_int(), value_heads), (cute.sym_int64(), cute.sym_int64()))
             for elem in (Float32, cdt)]  # dg, dbeta [T, HV]: any strides
    slots = cute.runtime.make_fake_tensor(Int32, (cute.sym_int(),), (1,))
    return (rows(heads, dim_k), rows(heads, dim_k), rows(value_heads, dim_v), rows(value_heads, dim_v), a_round,
            factors, *states, table, rows(heads, dim_k), rows(heads, dim_k), rows(value_heads, dim_v), *gates,
            state_bwd.fake_ready(value_heads), slots)


def compile_chunk_backward(dtype: torch.dtype, heads: int, value_heads: int, dim_k: int, dim_v: int, l2norm: bool,
                           arch: str, *, keep_ptx: bool = False, dump_dir: str | None = None, keep_cubin: bool = False):
    """The kernel for one configuration, compiled for ``arch`` (sm_90a; no GPU needed), called as
    ``fn(q, k, v, do, a_round, factors, states, dstates, chunk_indices, dq, dk, dv, dg, dbeta, ready, slots,
    scale, ahead, dependent)`` (`launch_chunk_backward`'s, ``states`` and ``dstates`` as ``[NC * K, HV, V]`` views)."""
    if reasons := shape_reasons(dtype, heads, value_heads, dim_k, dim_v):
        raise ValueError("the CuTe DSL per-chunk gradients cannot compile this: " + "; ".join(reasons))
    if arch not in ARCHS:
        raise ValueError(f"the CuTe DSL per-chunk gradients compile for {ARCHS} only (wgmma), not {arch}")
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return _cd.compile(ChunkBackward(dtype, heads, value_heads, dim_k, dim_v, l2norm),
                       *_fake_tensors(dtype, heads, value_heads, dim_k, dim_v), Float32(1.0), Int32(0), Int32(0), stream,
                       arch=arch, keep_ptx=keep_ptx, dump_dir=dump_dir, keep_cubin=keep_cubin)


@functools.cache
def _clusters_at_once(device: torch.device, group: int) -> int:
    """How many clusters of ``group`` CTAs (one an SM) run at once on ``device``: the look-ahead of the
    kernel's L2 prefetch (timing only)."""
    return torch.cuda.get_device_properties(device).multi_processor_count // group


def launch_chunk_backward(q, k, v, do, a_round, factors, states, dstates, chunk_indices, dq, dk, dv, dg, dbeta,
                          scale: float, *, use_qk_l2norm: bool = False, ready=None, finished=None) -> None:
    """Write, for the tokens of every chunk of ``chunk_indices``, ``dv`` ``[T, HV, V]`` (v's dtype), ``dg``
    fp32 and ``dbeta`` (beta's dtype, q's) ``[T, HV]``, and ``dq``, ``dk`` ``[T, H, K]`` (q's dtype): the
    gradients of the inputs, the value heads of each qk head summed in head order in fp32 and the
    L2 norm's backward applied (with ``use_qk_l2norm``) before one rounding.

    ``q``, ``k`` ``[T, H, K]``, ``v``, ``do``, ``dv`` ``[T, HV, V]`` in one 16-bit dtype, unit channel
    stride, 16-byte aligned rows; ``a_round``, ``factors``: the forward's preparing UT inverse's;
    ``states``: the forward's saved ``round(S)`` (`dsfuse.gdn.cutedsl.fused_fwd.launch_fused_forward`),
    ``dstates``: the reverse chain's ``round(dS')`` (`dsfuse.gdn.cutedsl.state_bwd.launch_state_backward`),
    both ``[NC, K, HV, V]`` contiguous; ``dq``, ``dk`` any token and head strides (head views of a packed
    gradient row), unit channel stride.

    With ``ready``, launched as a programmatic dependent of the kernel before it on the stream (int32
    ``[NC, HV]``, the flags of the reverse chain launched right before, `launch_state_backward`'s), it
    starts while that chain runs, and each CTA waits for its chunk's flag before it reads
    ``round(dS')``; ``finished`` (int32 ``[NC]``, a permutation of the chunks: the chain table's
    ``finished``) is the order in which its clusters start (timing only; not checked, as it lives on
    the GPU: a chunk missing or repeated is not computed or computed twice). Without ``ready``, every
    ``dstates`` must already be in memory (flags of ones: no wait; an ordinary launch). With it, a
    kernel other than that chain right before this launch leaves its CTAs waiting for ever."""
    heads, dim_k = k.shape[1:]
    value_heads, dim_v = v.shape[1:]
    if reasons := shape_reasons(q.dtype, heads, value_heads, dim_k, dim_v):
        raise ValueError("launch_chunk_backward: " + "; ".join(reasons))
    tokens, chunks = q.shape[0], chunk_indices.shape[0]
    if not (q.dtype == k.dtype == v.dtype == do.dtype == dv.dtype == dbeta.dtype == dq.dtype == dk.dtype) or any(
            x.shape != q.shape for x in (k, dq, dk)) or any(x.shape != v.shape for x in (do, dv)) or v.shape[0] != tokens:
        raise ValueError("launch_chunk_backward: q, k, dq, dk [T, H, K], v, do, dv [T, HV, V] and dbeta in one dtype")
    if any(x.stride(-1) != 1 for x in (q, k, v, do, dv, dq, dk)):
        raise ValueError("launch_chunk_backward: q, k, v, do, dv, dq, dk need unit channel stride")
    if reasons := aligned_reasons(q=q, k=k, v=v, do=do, dv=dv, dq=dq, dk=dk):
        raise ValueError("launch_chunk_backward: " + "; ".join(reasons))
    if reasons := prepared_reasons(a_round, factors, tokens, value_heads, chunks, q.dtype, q.device):
        raise ValueError("launch_chunk_backward: " + "; ".join(reasons))
    want = (chunks, dim_k, value_heads, dim_v)
    for name, x in (("states", states), ("dstates", dstates)):
        if (tuple(x.shape) != want or x.dtype != q.dtype or not x.is_contiguous() or x.data_ptr() % ALIGN
                or x.device != q.device):
            raise ValueError(f"launch_chunk_backward: {name} must be [NC, K, HV, V] = {want} in {q.dtype}, "
                             f"contiguous, 16-byte aligned; got {tuple(x.shape)} {x.dtype}")
    if dg.shape != (tokens, value_heads) or dg.dtype != torch.float32 or dbeta.shape != dg.shape:
        raise ValueError("launch_chunk_backward: dg fp32 and dbeta [T, HV]")
    dependent = ready is not None
    if ready is None:
        ready = torch.ones(chunks, value_heads, dtype=torch.int32, device=q.device)
    if finished is None:
        finished = torch.arange(chunks, dtype=torch.int32, device=q.device)
    if (tuple(ready.shape) != (chunks, value_heads) or ready.dtype != torch.int32 or not ready.is_contiguous()
            or ready.device != q.device):
        raise ValueError(f"launch_chunk_backward: ready must be int32 [NC, HV] = {(chunks, value_heads)}, contiguous")
    if finished.shape != (chunks,) or finished.dtype != torch.int32 or finished.device != q.device:
        raise ValueError(f"launch_chunk_backward: finished must be int32 [NC] = ({chunks},), a permutation of the chunks")
    fn = CACHE.get((q.dtype, heads, value_heads, dim_k, dim_v, use_qk_l2norm, _cd.arch_of(q.device)),
                   lambda: compile_chunk_backward(q.dtype, heads, value_heads, dim_k, dim_v, use_qk_l2norm,
                                                  _cd.arch_of(q.device)))
    if chunks:
        fn(q, k, v, do, a_round, factors, states.view(-1, value_heads, dim_v), dstates.view(-1, value_heads, dim_v),
           chunk_indices, dq, dk, dv, dg, dbeta, ready, finished.contiguous(), float(scale),
           _clusters_at_once(q.device, value_heads // heads), int(dependent))


AOT_SPECS = state_bwd.model_specs("gdn_chunk_backward", compile_chunk_backward)
