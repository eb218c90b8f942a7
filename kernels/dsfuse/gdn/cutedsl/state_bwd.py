"""The reverse state chain of the Gated DeltaNet's fused backward (kernel 2 of
``experiments/gdn/notes/fused-backward-design.md``), first form, sm_90a: one CTA of 256 threads (two
warpgroups, all of them in every step) walks a (document, value head) chain from its last chunk to
its first with the state's gradient ``dS`` fp32 ``[K, V]`` in its accumulators, and writes what the
per-chunk gradients need of it: ``round(dS')`` for every chunk (``dS'`` the gradient of the state
after the chunk) and ``dh0``, the gradient of the document's initial state.

Per chunk, from the preparing UT inverse's ``round(A Gamma)`` and rows' factors (the forward's own,
`dsfuse.gdn.cutedsl.ut_inverse`: ``exp(G) rstd_q``, ``exp(G) rstd_k``, ``exp(G_last - G) rstd_k``,
``beta`` and the scales), q and k as read (the L2 norm's scales on the products' rows), ``dO``::

    P      = tril(q k^T * Gamma) * rstd_q rstd_k^T             # as the forward's output team gates it
    dv_new = scale round(P)^T dO + exp(G_last - G) rstd_k * (k round(dS'))
    dX     = round(A Gamma)^T round(dv_new)
    dS     = exp(G_last) dS' + q^T round(scale exp(G) rstd_q * dO) - k^T round(exp(G) rstd_k beta * dX)

(the recurrence of `dsfuse.gdn.reference_backward.chunk_state_backward` written without ``w``:
``w^T dv_new = (exp(G) rstd_k k)^T diag(beta) (A Gamma)^T dv_new``; the float64 form is
``tests/gdn/test_gdn_fused_backward_algebra.py``'s). Every product on warpgroup instructions from
128-byte-swizzled tiles (`dsfuse.gdn.cutedsl.wgmma`), fp32 accumulation; the row factors multiply
an accumulator or, where they sit on the contracted dimension, the operand before its rounding.
No atomics, a fixed order: the same bits on every run and any SM count.

Per chunk, 3 barriers (and one after the loop, before the last flags below): (1) ``round(dS')``
stored; (2) ``round(dv_new)`` stored (``k round(dS')`` and ``round(P)^T dO`` issued together, the
previous chunk's loads started meanwhile, ``round(dS')`` to memory and the rounded dO term stored
while they run); (3) the rounded ``dX`` term stored and the previous chunk's rows landed; then the
state's update, and while it runs the previous chunk's ``q k^T`` gated and stored as ``round(P)``:
the chain waits on three products a chunk (``round(P)`` of the first chunk is made before the loop).
``round(dS')`` goes to memory from its shared-memory tile by one thread's TMA store (two 128 x 64
boxes), whose reads of the tile are waited for before the third barrier (the next chunk's first step
writes the tile again).

Shared memory at K = V = 128, bf16: two stages of q, k, dO rows (96 KiB), of ``round(A Gamma)``
(16 KiB) and of the factors (4 KiB); ``round(dS')`` 32 KiB; ``round(P)`` 8 KiB; ``round(dv_new)``,
the rounded dO and dX terms 16 KiB each: 204 KiB and the alignment, one CTA per SM.

For the per-chunk gradients that start while it runs (`dsfuse.gdn.cutedsl.chunk_bwd`, its
programmatic dependent: every CTA lets it launch as it starts), thread 0 sets a flag per chunk once
that chunk's ``round(dS')`` store has completed: four chunks at a time while the state's update
runs (the release is a memory barrier on its path), the document's last ones after ``dh0``.
"""

from __future__ import annotations

import torch

from dsfuse._common import cutedsl as _cd

cutlass, cute = _cd.require()
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T as _types
from cutlass.cutlass_dsl import dsl_user_op

from dsfuse.gdn.cutedsl import chunk
from dsfuse.gdn.cutedsl import mma as _mma
from dsfuse.gdn.cutedsl import wgmma as _wg
from dsfuse.gdn.cutedsl.chunk import CHUNK, DTYPES
from dsfuse.gdn.cutedsl.fused_fwd_head import ALIGN, STAGES, aligned_reasons, gate_qk
from dsfuse.gdn.cutedsl.fused_fwd_ws import _vectors
from dsfuse.gdn.cutedsl.ut_inverse import FACTORS, prepared_reasons

THREADS = 256  # two warpgroups
WARPGROUPS = 2
ARCHS = ("sm_90a",)  # wgmma
FLAG_EVERY = 4  # chunks a flag release covers (`release_flags`): each is a membar on the chain's thread 0
DIMS = (128,)  # K and V: the model's (the state's gradient over two warpgroups, the tiles' shared memory)
TC_DTYPES = (torch.bfloat16, torch.float16)


def shape_reasons(dtype: torch.dtype, heads: int, value_heads: int, dim_k: int, dim_v: int) -> list[str]:
    """Why this kernel cannot take these sizes (empty when it can)."""
    reasons = []
    if dtype not in TC_DTYPES:
        reasons.append(f"the reverse state chain takes {' or '.join(map(str, TC_DTYPES))}, not {dtype}")
    reasons += [f"the reverse state chain takes {name} = 128, not {dim}"
                for name, dim in (("K", dim_k), ("V", dim_v)) if dim not in DIMS]
    if heads <= 0 or value_heads % heads:
        reasons.append(f"value heads ({value_heads}) must be a multiple of the qk heads ({heads})")
    return reasons


class StateBackward:
    """``(q, k, do, a_round, factors, chunk_indices, chunk_offsets, order, dht, dh0, dstates, ready, scale)``:
    grid (1, HV, len(order)) of 256 threads, CTA ``(0, hv, z)`` walking document ``order[z]``
    (module docstring)."""

    def __init__(self, dtype: torch.dtype, heads: int, value_heads: int, dim_k: int, dim_v: int, l2norm: bool):
        self.dtype, self.heads, self.value_heads, self.dim_k, self.dim_v, self.l2norm = (
            DTYPES[dtype], heads, value_heads, dim_k, dim_v, l2norm)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mDO: cute.Tensor, mA: cute.Tensor, mF: cute.Tensor,
                 mChunks: cute.Tensor, mOffsets: cute.Tensor, mOrder: cute.Tensor, mDht: cute.Tensor,
                 mDh0: cute.Tensor, mDS: cute.Tensor, mReady: cute.Tensor, scale: Float32, stream):
        # round(dS') leaves its swizzled tile by TMA
        store_ds, mDS_tma = state_tma(cpasync.CopyBulkTensorTileS2GOp(), mDS, self.dtype, self.dim_k)
        self.kernel(mQ, mK, mDO, mA, mF, mChunks, mOffsets, mOrder, mDht, mDh0, mDS_tma, store_ds, mReady,
                    scale).launch(
            grid=[1, self.value_heads, mOrder.shape[0]], block=[THREADS, 1, 1], stream=stream)

    @cute.jit
    def _start_chunk(self, u: Int32, stages, sources, mChunks: cute.Tensor, i_c: Int32, stage: Int32, i_h: Int32,
                     i_hv: Int32):
        """Start the ``cp.async`` copies of chunk ``i_c``'s q, k, dO, ``round(A Gamma)`` rows and its
        factors into ``stage`` (the caller commits them as a group): zeros past the chunk's rows."""
        start = mChunks[i_c, 1]
        chunk.start_prepared_rows(u, THREADS, tuple(t[None, None, stage] for t in stages), sources, start,
                                  mChunks[i_c, 2] - start, i_c * len(FACTORS), len(FACTORS), i_h, i_hv, i_hv)

    @cute.jit
    def _gated_qk(self, u: Int32, mma_cc, cCC: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor, sF: cute.Tensor,
                  sP: cute.Tensor, later: cutlass.Constexpr, chain: cute.Tensor, ops_chain: tuple):
        """``round(P)`` of a chunk (its rows and factors in ``sQ``, ``sK``, ``sF``) into ``sP``, ``q k^T``
        gated as the forward's output team gates it. ``later`` products ``ops_chain`` into ``chain``
        (the state's update) are issued right after ``q k^T``, and run while it is gated."""
        sG, _, _, _, _, sRstd = _vectors(sF)
        acc_f = _wg.fresh_accumulator(mma_cc, u, (CHUNK, CHUNK))
        _wg.gemm(mma_cc, acc_f, _wg.operands(mma_cc, u, sQ, sK), wait=False, fresh=True)
        for mma, ops in ops_chain:
            _wg.gemm(mma, chain, ops, wait=False)
        _wg.wait_for(later)
        gate_qk(acc_f, cCC, sG, sRstd, self.l2norm, two_rows=True)
        _wg.store_rounded(mma_cc, u, acc_f, sP, self.dtype)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mDO: cute.Tensor, mA: cute.Tensor, mF: cute.Tensor,
               mChunks: cute.Tensor, mOffsets: cute.Tensor, mOrder: cute.Tensor, mDht: cute.Tensor, mDh0: cute.Tensor,
               mDS: cute.Tensor, store_ds: cute.CopyAtom, mReady: cute.Tensor, scale: Float32):
        K, V, C, ab = self.dim_k, self.dim_v, CHUNK, self.dtype
        u, _, _ = cute.arch.thread_idx()
        # the per-chunk kernel, launched after this one as its programmatic dependent, may start once
        # every CTA of this grid has started: it waits on `mReady` for each chunk's round(dS')
        cute.arch.griddepcontrol_launch_dependents()
        _, i_hv, i_z = cute.arch.block_idx()
        i_n = mOrder[i_z]
        i_h = i_hv // (self.value_heads // self.heads)

        smem = cutlass.memory.SmemAllocator()
        tile = _wg.tile
        sQ2, sK2, sDO2 = tile(smem, ab, C, K, STAGES), tile(smem, ab, C, K, STAGES), tile(smem, ab, C, V, STAGES)
        sA2 = tile(smem, ab, C, C, STAGES)  # round(A Gamma), as the preparing inverse wrote it
        sF2 = chunk.tile(smem, Float32, len(FACTORS), C, STAGES)
        sDSb = tile(smem, ab, K, V)  # round(dS'), the gradient of the state after the chunk
        sP = tile(smem, ab, C, C)  # round(P)
        sDvn, sDOs, sDXs = tile(smem, ab, C, V), tile(smem, ab, C, V), tile(smem, ab, C, V)

        # q k^T; (C, V) products with a K-major A (k round(dS')) and an M-major one (round(P)^T dO,
        # round(A Gamma)^T round(dv_new)); the state's update (K, V), A = q^T or k^T
        mma_cc = _wg.tiled_mma(ab, C, C, True, True, WARPGROUPS)
        mma_kd = _wg.tiled_mma(ab, C, V, True, False, WARPGROUPS)
        mma_tc = _wg.tiled_mma(ab, C, V, False, False, WARPGROUPS)
        mma_kv = _wg.tiled_mma(ab, K, V, False, False, WARPGROUPS)
        T = _wg.transposed
        cCC, cCV, cKV = (_mma.coordinates(mma_cc, u, (C, C)), _mma.coordinates(mma_kd, u, (C, V)),
                         _mma.coordinates(mma_kv, u, (K, V)))
        sDS_box, gDS_box = state_boxes(store_ds, sDSb, mDS, i_hv)  # the TMA store's source, destinations

        acc_s = _mma.accumulator(mma_kv, u, (K, V))  # dS, fp32, for the whole chain
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            acc_s[i] = mDht[i_n, i_hv, cKV[i][0], cKV[i][1]]

        first, last = mOffsets[i_n], mOffsets[i_n + 1]
        stages, sources = (sQ2, sK2, sDO2, sA2, sF2), (mQ, mK, mDO, mA, mF)
        if first < last:
            self._start_chunk(u, stages, sources, mChunks, last - 1, 0, i_h, i_hv)
        cute.arch.cp_async_commit_group()
        # the last chunk's rows landed, its round(P) made (the loop makes each next one's in its step 4)
        cute.arch.cp_async_wait_group(0)
        _wg.fence_writes()
        cute.arch.sync_threads()
        self._gated_qk(u, mma_cc, cCC, sQ2[None, None, 0], sK2[None, None, 0], sF2[None, None, 0], sP, 0, acc_s, ())

        for j in cutlass.range(last - first):
            i_c = last - 1 - j
            stage = j % STAGES
            sQ, sK, sDO, sA = (t[None, None, stage] for t in (sQ2, sK2, sDO2, sA2))
            sG, sBeta, sEGq, sEGk, sDec, sRstd = _vectors(sF2[None, None, stage])

            # 1. round(dS') stored (the last reads of its tile, and of the other stage, were before
            #    this barrier; this chunk's rows landed and its round(P) was stored before the last one)
            _wg.store_rounded(mma_kv, u, acc_s, sDSb, ab)
            _wg.fence_writes()
            cute.arch.sync_threads()

            # 2. k round(dS') and round(P)^T dO issued; the previous chunk's loads started into the other
            #    stage; round(dS') to memory; round(scale exp(G) rstd_q dO) stored; dv_new = scale
            #    round(P)^T dO + exp(G_last - G) rstd_k (k round(dS')), stored rounded
            acc_k = _wg.fresh_accumulator(mma_kd, u, (C, V))
            _wg.gemm(mma_kd, acc_k, _wg.operands(mma_kd, u, sK, T(sDSb)), wait=False, fresh=True)
            acc_v = _wg.fresh_accumulator(mma_tc, u, (C, V))
            _wg.gemm(mma_tc, acc_v, _wg.operands(mma_tc, u, T(sP), T(sDO)), wait=False, fresh=True)
            if j + 1 < last - first:
                self._start_chunk(u, stages, sources, mChunks, i_c - 1, 1 - stage, i_h, i_hv)
            cute.arch.cp_async_commit_group()  # empty after the first chunk: one group a chunk all the same
            if u == 0:  # round(dS') to memory by TMA (its tile's writes were fenced for the async proxy)
                cute.copy(store_ds, sDS_box, gDS_box[None, i_c])
                cute.arch.cp_async_bulk_commit_group()
            do_t = cute.make_fragment_like(acc_k, ab)
            _wg.load_like(mma_kd, u, sDO, do_t)
            egq = _wg.row_pair(cCV, sEGq)
            egq = (scale * egq[0], scale * egq[1])
            for i in cutlass.range_constexpr(cute.size(do_t)):
                do_t[i] = (_wg.pick(cCV, i, egq) * do_t[i].to(Float32)).to(ab)
            _wg.store(mma_kd, u, do_t, sDOs)
            dec = _wg.row_pair(cCV, sDec)
            _wg.wait()
            for i in cutlass.range_constexpr(cute.size(acc_k)):
                acc_k[i] = _wg.pick(cCV, i, dec) * acc_k[i]
            for i in cutlass.range_constexpr(cute.size(acc_v)):
                acc_v[i] = scale * acc_v[i] + acc_k[i]
            _wg.store_rounded(mma_tc, u, acc_v, sDvn, ab)
            _wg.fence_writes()
            cute.arch.sync_threads()

            # 3. dX = round(A Gamma)^T round(dv_new); its term of dS, round(-exp(G) rstd_k beta dX),
            #    stored; the previous chunk's rows landed (for step 4)
            acc_x = _wg.fresh_accumulator(mma_tc, u, (C, V))
            _wg.gemm(mma_tc, acc_x, _wg.operands(mma_tc, u, T(sA), T(sDvn)), wait=False, fresh=True)
            egk, beta = _wg.row_pair(cCV, sEGk), _wg.row_pair(cCV, sBeta)
            bx = (-(egk[0] * beta[0]), -(egk[1] * beta[1]))
            _wg.wait()
            for i in cutlass.range_constexpr(cute.size(acc_x)):
                acc_x[i] = _wg.pick(cCV, i, bx) * acc_x[i]
            _wg.store_rounded(mma_tc, u, acc_x, sDXs, ab)
            cute.arch.cp_async_wait_group(0)
            if u == 0:  # the TMA store has read round(dS')'s tile before this barrier: step 1 writes it again
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            _wg.fence_writes()
            cute.arch.sync_threads()

            # 4. dS = exp(G_last) dS' + q^T round(scale exp(G) rstd_q dO) + k^T round(-exp(G) rstd_k beta dX);
            #    while it runs, the previous chunk's round(P) (off the chain: its rows landed in step 3,
            #    this chunk's round(P) was last read in step 2)
            last_decay = chunk.exp(sG[C - 1])
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = last_decay * acc_s[i]
            update = ((mma_kv, _wg.operands(mma_kv, u, T(sQ), T(sDOs))), (mma_kv, _wg.operands(mma_kv, u, T(sK), T(sDXs))))
            # (after the last chunk, of the other stage's stale rows: never read)
            self._gated_qk(u, mma_cc, cCC, sQ2[None, None, 1 - stage], sK2[None, None, 1 - stage],
                           sF2[None, None, 1 - stage], sP, len(update), acc_s, update)
            if u == 0 and j > 0 and j % FLAG_EVERY == 0:  # the last FLAG_EVERY chunks' round(dS') have
                cute.arch.cp_async_bulk_wait_group(1)  # reached memory: the per-chunk kernel may read them
                release_flags(mReady, i_c + 1, i_c + 1 + FLAG_EVERY, i_hv)  # (while the update runs)
            _wg.wait()

        for i in cutlass.range_constexpr(cute.size(acc_s)):
            mDh0[i_n, i_hv, cKV[i][0], cKV[i][1]] = acc_s[i]
        if u == 0:  # the last chunk's round(dS') written before the CTA exits
            cute.arch.cp_async_bulk_wait_group(0)
        if first < last:  # the last flags after dh0 (every thread's stores, by the barrier): the per-chunk
            cute.arch.sync_threads()  # kernel's last wait then orders everything this CTA writes
            if u == 0:
                release_flags(mReady, first, last - (last - first - 1) // FLAG_EVERY * FLAG_EVERY, i_hv)


@cute.jit
def release_flags(mReady: cute.Tensor, lo: Int32, hi: Int32, i_hv: Int32):
    """``mReady[c, i_hv] = 1`` for chunks ``lo <= c < hi``, released at the GPU's scope (a proxy fence,
    then one ``fence.acq_rel.gpu`` for all of them: a membar on this thread's path, so not every
    chunk), so that the round(dS') this thread stored by TMA (waited for) and what it has seen are
    visible to a thread that reads a flag with acquire semantics (`acquire_flag`)."""
    fence_asm("fence.proxy.async.global; fence.acq_rel.gpu;")
    for c in cutlass.range(lo, hi, unroll=1):
        _store_relaxed(mReady, c, i_hv)


@dsl_user_op
def fence_asm(text: str, *, loc=None, ip=None) -> None:
    """Fence instructions, ``text``, that the DSL does not wrap (also `dsfuse.gdn.cutedsl.chunk_bwd`'s)."""
    llvm.inline_asm(None, [], text, "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def _store_relaxed(mReady: cute.Tensor, i_c: Int32, i_hv: Int32, *, loc=None, ip=None) -> None:
    """``mReady[i_c, i_hv] = 1``, a relaxed store at the GPU's scope (after `release_flags`'s fence)."""
    addr = (mReady[i_c, None].iterator + i_hv).toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)
    llvm.inline_asm(None, [addr], "st.relaxed.gpu.global.b32 [$0], 1;", "l", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def acquire_flag(mReady: cute.Tensor, i_c: Int32, i_hv: Int32, *, loc=None, ip=None) -> Int32:
    """``mReady[i_c, i_hv]`` read with acquire semantics at the GPU's scope, then a proxy fence (so
    the caller's later TMA loads see what the releasing thread made visible)."""
    addr = (mReady[i_c, None].iterator + i_hv).toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)
    res = llvm.inline_asm(_types.i32(), [addr], "ld.acquire.gpu.global.b32 $0, [$1]; fence.proxy.async.global;",
                          "=r,l", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                          loc=loc, ip=ip)
    return Int32(res)


def state_tma(op, mX: cute.Tensor, dtype, dim_k: int):
    """``(atom, tensor)``: a TMA copy (``op``: load or store) of one chunk's and value head's ``(K, V)``
    state tile between a `wgmma.tile` and ``mX`` ``[NC * K, HV, V]`` (contiguous: the states' and
    their gradients' layout), seen as ``[NC * K, HV * V]``; issued as two 128-byte-wide boxes (the
    swizzle's width). For the kernel's `state_boxes`; built on the host side of a ``cute.jit``."""
    value_heads, dim_v = mX.shape[1], mX.shape[2]
    rows = cute.make_tensor(mX.iterator, cute.make_layout((mX.shape[0], value_heads * dim_v),
                                                          stride=(value_heads * dim_v, 1)))
    return cpasync.make_tiled_tma_atom(op, rows, _wg.tile_layout(dtype, dim_k, dim_v), (dim_k, dim_v))


@cute.jit
def state_boxes(atom, sX: cute.Tensor, mX: cute.Tensor, i_hv: Int32):
    """``(shared, global)``: a `state_tma` copy's pieces for the tile ``sX`` and value head ``i_hv``'s
    tiles of ``mX`` (`state_tma`'s tensor); ``global[None, c]`` is chunk ``c``'s."""
    tiles = cute.local_tile(mX, (cute.size(sX, mode=[0]), cute.size(sX, mode=[1])), (None, i_hv))
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(tiles, 0, 2))


CACHE = _cd.KernelCache()  # (dtype, H, HV, K, V, l2norm, arch) -> compiled function


def fake_prepared(dtype: torch.dtype, value_heads: int):
    """What the fused backward kernels' compiled signatures share: ``(rows, a_round, factors, table)``,
    ``rows(heads, dim)`` a fake ``[T, heads, dim]`` of symbolic tokens with any 16-byte aligned token and
    head strides (packed views), the preparing inverse's ``round(A Gamma)`` and factors (contiguous,
    aligned), the chunk table."""
    cdt = DTYPES[dtype]
    tokens, chunks = cute.sym_int(), cute.sym_int()
    vector = 16 // dtype.itemsize

    def rows(heads_, dim):
        return cute.runtime.make_fake_tensor(cdt, (tokens, heads_, dim), (cute.sym_int64(divisibility=vector),
                                                                          cute.sym_int64(divisibility=vector), 1),
                                             assumed_align=ALIGN)

    a_round = cute.runtime.make_fake_tensor(cdt, (tokens, value_heads, CHUNK), (value_heads * CHUNK, CHUNK, 1),
                                            assumed_align=ALIGN)
    factors = cute.runtime.make_fake_tensor(Float32, (cute.sym_int(), value_heads, CHUNK),
                                            (value_heads * CHUNK, CHUNK, 1), assumed_align=ALIGN)
    return rows, a_round, factors, cute.runtime.make_fake_tensor(Int32, (chunks, 3), (3, 1))


def _fake_tensors(dtype: torch.dtype, heads: int, value_heads: int, dim_k: int, dim_v: int) -> tuple:
    """Fake tensors of the compiled signature (`fake_prepared`'s, then symbolic documents), the rest
    contiguous and aligned."""
    cdt = DTYPES[dtype]
    docs, docs1, chains = (cute.sym_int() for _ in range(3))
    rows, a_round, factors, table = fake_prepared(dtype, value_heads)
    offsets = cute.runtime.make_fake_tensor(Int32, (docs1,), (1,))
    order = cute.runtime.make_fake_tensor(Int32, (chains,), (1,))
    state = (value_heads * dim_k * dim_v, dim_k * dim_v, dim_v, 1)
    dht = cute.runtime.make_fake_tensor(Float32, (docs, value_heads, dim_k, dim_v), state)
    dh0 = cute.runtime.make_fake_tensor(Float32, (docs, value_heads, dim_k, dim_v), state)
    dstates = cute.runtime.make_fake_tensor(cdt, (cute.sym_int(), value_heads, dim_v), (value_heads * dim_v, dim_v, 1),
                                            assumed_align=ALIGN)
    return (rows(heads, dim_k), rows(heads, dim_k), rows(value_heads, dim_v), a_round, factors, table, offsets, order,
            dht, dh0, dstates, fake_ready(value_heads))


def fake_ready(value_heads: int):
    """The fake ``ready`` flags ``[NC, HV]`` int32, contiguous."""
    return cute.runtime.make_fake_tensor(Int32, (cute.sym_int(), value_heads), (value_heads, 1))


def compile_state_backward(dtype: torch.dtype, heads: int, value_heads: int, dim_k: int, dim_v: int, l2norm: bool,
                           arch: str, *, keep_ptx: bool = False, dump_dir: str | None = None, keep_cubin: bool = False):
    """The kernel for one configuration, compiled for ``arch`` (sm_90a; no GPU needed), called as
    ``fn(q, k, do, a_round, factors, chunk_indices, chunk_offsets, order, dht, dh0, dstates, ready, scale)``
    with ``dstates`` ``[NC * K, HV, V]`` (`launch_state_backward`'s, a view)."""
    if reasons := shape_reasons(dtype, heads, value_heads, dim_k, dim_v):
        raise ValueError("the CuTe DSL reverse state chain cannot compile this: " + "; ".join(reasons))
    if arch not in ARCHS:
        raise ValueError(f"the CuTe DSL reverse state chain compiles for {ARCHS} only (wgmma), not {arch}")
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return _cd.compile(StateBackward(dtype, heads, value_heads, dim_k, dim_v, l2norm),
                       *_fake_tensors(dtype, heads, value_heads, dim_k, dim_v), Float32(1.0), stream, arch=arch,
                       keep_ptx=keep_ptx, dump_dir=dump_dir, keep_cubin=keep_cubin)


def launch_state_backward(q, k, do, a_round, factors, chunk_indices, chunk_offsets, order, dht, dh0, dstates,
                          scale: float, *, use_qk_l2norm: bool = False, ready=None) -> torch.Tensor:
    """Write ``dstates`` ``[NC, K, HV, V]`` (``dstates[c, :, hv, :]`` = ``round(dS')``, the gradient of the
    state after chunk ``c``, in q's dtype) and ``dh0`` fp32 ``[N, HV, K, V]`` (the gradient of each
    document's initial state) for the documents ``order`` (int32, as `launch_fused_forward`'s; only
    their chunks and rows are written); returns ``dh0``.

    ``q``, ``k`` ``[T, H, K]``, ``do`` ``[T, HV, V]`` in one 16-bit dtype, unit channel stride, 16-byte
    aligned rows; ``a_round``, ``factors``: the preparing UT inverse's of the forward
    (`dsfuse.gdn.cutedsl.ut_inverse.launch_ut_inverse`, the same k, beta, g, chunks and L2 norm: the
    caller's contract, not checkable here); ``dht`` fp32 ``[N, HV, K, V]`` (zeros for none), ``dh0``
    likewise, contiguous; ``chunk_indices``, ``chunk_offsets`` as the forward's. ``ready``: int32
    ``[NC, HV]`` zeros, contiguous, or None: the kernel sets ``ready[c, hv]`` to 1 (release, GPU scope)
    once ``round(dS')`` of chunk ``c`` and value head ``hv`` is in memory (four chunks at a time; a
    document's first one to four chunks after its ``dh0``): what
    `dsfuse.gdn.cutedsl.chunk_bwd.launch_chunk_backward` waits on when it runs as this kernel's
    programmatic dependent. Every chunk of every document must then be flagged, so ``order`` must
    name every document once (checked: its length; not its values, which live on the GPU)."""
    heads, dim_k = k.shape[1:]
    value_heads, dim_v = do.shape[1:]
    if reasons := shape_reasons(q.dtype, heads, value_heads, dim_k, dim_v):
        raise ValueError("launch_state_backward: " + "; ".join(reasons))
    if not (q.dtype == k.dtype == do.dtype) or q.shape != k.shape or do.shape[0] != q.shape[0]:
        raise ValueError("launch_state_backward: q, k [T, H, K] and do [T, HV, V] in one dtype")
    if any(x.stride(-1) != 1 for x in (q, k, do)):
        raise ValueError("launch_state_backward: q, k, do need unit channel stride")
    if reasons := aligned_reasons(q=q, k=k, do=do):
        raise ValueError("launch_state_backward: " + "; ".join(reasons))
    chunks, docs = chunk_indices.shape[0], chunk_offsets.shape[0] - 1
    if reasons := prepared_reasons(a_round, factors, q.shape[0], value_heads, chunks, q.dtype, q.device):
        raise ValueError("launch_state_backward: " + "; ".join(reasons))
    shape = (docs, value_heads, dim_k, dim_v)
    for name, x in (("dht", dht), ("dh0", dh0)):
        if tuple(x.shape) != shape or x.dtype != torch.float32 or not x.is_contiguous() or x.device != q.device:
            raise ValueError(f"launch_state_backward: {name} must be fp32 {shape} contiguous on q's device, "
                             f"got {tuple(x.shape)} {x.dtype}")
    want = (chunks, dim_k, value_heads, dim_v)
    if (tuple(dstates.shape) != want or dstates.dtype != q.dtype or not dstates.is_contiguous()
            or dstates.data_ptr() % ALIGN or dstates.device != q.device):
        raise ValueError(f"launch_state_backward: dstates must be [NC, K, HV, V] = {want} in {q.dtype}, contiguous, "
                         f"16-byte aligned, on q's device; got {tuple(dstates.shape)} {dstates.dtype}")
    if order.dtype != torch.int32 or order.dim() != 1 or order.shape[0] > docs or order.device != q.device:
        raise ValueError("launch_state_backward: order int32 [M <= N] on q's device (distinct documents)")
    if ready is None:  # flags nobody reads
        ready = torch.empty(chunks, value_heads, dtype=torch.int32, device=q.device)
    elif (tuple(ready.shape) != (chunks, value_heads) or ready.dtype != torch.int32 or not ready.is_contiguous()
          or ready.device != q.device or order.shape[0] != docs):
        raise ValueError(f"launch_state_backward: ready must be int32 [NC, HV] = {(chunks, value_heads)}, contiguous, "
                         f"on q's device, with every document in order")
    fn = CACHE.get((q.dtype, heads, value_heads, dim_k, dim_v, use_qk_l2norm, _cd.arch_of(q.device)),
                   lambda: compile_state_backward(q.dtype, heads, value_heads, dim_k, dim_v, use_qk_l2norm,
                                                  _cd.arch_of(q.device)))
    if docs and order.shape[0]:
        fn(q, k, do, a_round, factors, chunk_indices, chunk_offsets, order, dht, dh0,
           dstates.view(-1, value_heads, dim_v), ready, float(scale))
    return dh0


def model_specs(stem: str, compile_fn) -> list[_cd.CuteAotSpec]:
    """The fused backward kernels' AOT specs: the model's specialisation (H = 16, HV = 48, K = V = 128,
    bf16), with and without the L2 norm, sm_90a; ``compile_fn`` takes the shapes, the L2 norm and the
    architecture as `compile_state_backward` does."""
    return [_cd.CuteAotSpec(f"{stem}_bf16{'_l2' if l2 else ''}",
                            lambda arch, dump_dir=None, l2=l2: compile_fn(torch.bfloat16, 16, 48, 128, 128, l2, arch,
                                                                          keep_ptx=True, dump_dir=dump_dir),
                            archs=ARCHS)
            for l2 in (True, False)]


AOT_SPECS = model_specs("gdn_state_backward", compile_state_backward)
