"""The fused chunked forward of the Gated DeltaNet in CuTe DSL, first form: one CTA walks one chain
(document, value head, tile of ``BV`` value channels) chunk by chunk with the fp32 state on chip;
``w``, ``u``, ``v_new`` and the per-chunk states never reach memory. Not yet reachable from
`chunk_gdn`: step 2 of the fused forward's record, docs/ops/gdn_forward.md (the inverse, then
this kernel, then its tensor-core, warp-specialised form).

Per chunk (``C = 64`` tokens, ``G`` the chunk-local cumulative gate, ``Gamma_ij = exp(G_i - G_j)``
for ``j <= i``, ``A0`` the ungated inverse of `dsfuse.gdn.cutedsl.ut_inverse`, ``S`` the state
``[K, BV]`` at the chunk's start; q and k L2-normalised in fp32 when asked)::

    X     = beta * (v - exp(G) * (k S))                       # [C, BV]
    v_new = (A0 * Gamma) X                                    # = u - w S, the delta rule's corrections
    o     = scale * (exp(G) * (q S) + ((q k^T) * Gamma) v_new) # the triangle with its diagonal
    S     = exp(G_last) S + (k * exp(G_last - G))^T v_new

(`dsfuse.gdn.reference`'s stages with ``A = A0 * Gamma``: ``(I + D M D^-1)^-1 = D (I + M)^-1 D^-1``
for ``D = diag(exp(G))``.) Only differences ``G_i - G_j <= 0`` are exponentiated.

Arithmetic: fp32 throughout, each product a plain fp32 dot in a fixed order (no tensor cores, no
atomics), so a call is bitwise reproducible and independent of the SM count. 128 threads; the
``[C, BV]`` tiles by thread ``(row0, col) = divmod(tid, BV)``, rows ``row0 + 4 i``; the state's
``[K, BV]`` entries likewise, rows ``row0 + 4 i``. A reference-grade kernel: the tensor-core form
is checked against it.
"""

from __future__ import annotations

import functools

import torch

from dsfuse._common import cutedsl as _cd

cutlass, cute = _cd.require()
from cutlass import Float32, Int32

from dsfuse.gdn.cutedsl import chunk
from dsfuse.gdn.cutedsl.chunk import BV, CHUNK, DTYPES, THREADS
from dsfuse.gdn.cutedsl import fused_fwd_head
from dsfuse.gdn.cutedsl.fused_fwd_head import FusedForwardHead
from dsfuse.gdn.cutedsl.fused_fwd_tc import TC_DTYPES, FusedForwardTC
from dsfuse.gdn.cutedsl.fused_fwd_rs import FusedForwardRS
from dsfuse.gdn.cutedsl.fused_fwd_ws import FusedForwardWS
from dsfuse.gdn.cutedsl.ut_inverse import FACTORS, prepared_reasons
from dsfuse.gdn.cutedsl.ut_inverse import shape_reasons as _inverse_reasons
from dsfuse.gdn.schedule import document_order

ROWS = THREADS // BV  # 4 thread rows: a thread holds CHUNK / ROWS rows of a [C, BV] tile


FORMS = ("cuda_core", "tensor_core", "head", "head_wgmma", "head_ws", "head_rs")
"""The fused forward's forms, each a step of its record (docs/ops/gdn_forward.md): ``cuda_core`` (this
module's fp32 kernel, the reference-grade one), ``tensor_core`` (`dsfuse.gdn.cutedsl.fused_fwd_tc`:
the same CTAs, products on ``mma.sync``), ``head`` (`dsfuse.gdn.cutedsl.fused_fwd_head`: one CTA per
document and value head, results in registers), ``head_wgmma`` (the same kernel with its products on
warpgroup instructions, `dsfuse.gdn.cutedsl.wgmma`: sm_90a only), ``head_ws`` (its warps split into
a team for the state's chain and one for the output, `dsfuse.gdn.cutedsl.fused_fwd_ws`: sm_90a only),
``head_rs`` (``head_ws`` with the state kept transposed, every product of the state's chain taking its
A operand from registers, `dsfuse.gdn.cutedsl.fused_fwd_rs`: sm_90a only)."""
HEAD_FORMS = ("head", "head_wgmma", "head_ws", "head_rs")  # a CTA per document and value head (or part), 16-byte rows
PREPARED_FORMS = ("head_ws", "head_rs")  # reading the preparing inverse's round(A) and factors (gated only)
ARCHS = {"head_wgmma": ("sm_90a",), "head_ws": ("sm_90a",), "head_rs": ("sm_90a",)}  # the forms an architecture lacks the instructions of
COLUMN_PARTS = (1, 2)
"""How many CTAs may walk one value head's chain (``parts``), each ``V / parts`` of its channels as a
head of its own: the state's columns evolve apart (every product of the chain reduces over K or over
a chunk's tokens, never over V), so ``parts`` CTAs give the bits of one, for documents too few to
fill the GPU. The ``head_ws`` form only, on ``V / parts`` of 64 or 128 channels; ``v``, ``o`` and the
saved states are read as ``[.., parts HV, V / parts]`` views (head ``parts hv + p`` is channels
``p V / parts ..`` of head ``hv``), ``round(A)`` and the factors by ``hv``, and the initial and final
states are ``[N, parts HV, K, V / parts]`` (`split_columns`, `join_columns`)."""


def shape_reasons(dtype: torch.dtype, heads: int, value_heads: int, dim_k: int, dim_v: int,
                  form: str = "cuda_core", use_qk_l2norm: bool = False, parts: int = 1) -> list[str]:
    """Why the kernel cannot be compiled for these sizes (empty when it can): the inverse's, V's, and
    for the tensor-core forms a 16-bit dtype (and the per-head form's head dims, and fp16 with the L2
    norm); with ``parts`` > 1 (`COLUMN_PARTS`), the ``head_ws`` form on ``V / parts`` channels."""
    if form not in FORMS:
        raise ValueError(f"the fused forward's form is one of {FORMS}, not {form!r}")
    if parts not in COLUMN_PARTS:
        raise ValueError(f"the fused forward's column parts are one of {COLUMN_PARTS}, not {parts!r}")
    if parts > 1:
        reasons = [] if form == "head_ws" else [f"the {form} form walks whole value heads (parts > 1: head_ws)"]
        if dim_v % parts:
            return reasons + [f"V = {dim_v} does not split into {parts} parts"]
        return reasons + shape_reasons(dtype, heads, value_heads, dim_k, dim_v // parts, form, use_qk_l2norm)
    reasons = _inverse_reasons(dtype, heads, value_heads, dim_k)
    if dim_v % BV or dim_v > 256:
        reasons.append(f"head dim V = {dim_v} is not a multiple of {BV} up to 256")
    if form != "cuda_core" and dtype in DTYPES and dtype not in TC_DTYPES:
        reasons.append(f"the {form} form takes {' or '.join(map(str, TC_DTYPES))} inputs, not {dtype}")
    if form in HEAD_FORMS:
        reasons += fused_fwd_head.shape_reasons(dim_k, dim_v, dtype, use_qk_l2norm)
    if form == "head_rs" and dim_v != 128:  # each of the state team's two warpgroups owns 64 value channels
        reasons.append(f"the head_rs form takes V = 128 (two warpgroups of 64 value channels), not {dim_v}")
    return reasons


@cute.jit
def _lower_row_times(sM: cute.Tensor, sX: cute.Tensor, r: Int32, col: Int32) -> Float32:
    """``sum_{j <= r} M[r, j] X[j, col]`` in fp32, j ascending (traced inline)."""
    acc = Float32(0.0)
    for j in cutlass.range(r + 1):
        acc = acc + sM[r, j] * sX[j, col]
    return acc


class _FusedForward(chunk.ChainKernel):
    """The first form (module docstring)."""

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
               mA: cute.Tensor, mChunks: cute.Tensor, mOffsets: cute.Tensor, mOrder: cute.Tensor, mH0: cute.Tensor,
               mHt: cute.Tensor, mO: cute.Tensor, mGc: cute.Tensor, scale: Float32):
        K, C, GROUP = self.dim_k, CHUNK, self.value_heads // self.heads
        TILE_ROWS, STATE_ROWS = C // ROWS, K // ROWS  # a thread's rows of a [C, BV] tile / of the state
        tidx, _, _ = cute.arch.thread_idx()
        i_v, i_hv, i_z = cute.arch.block_idx()
        i_n = mOrder[i_z]
        i_h = i_hv // GROUP
        row0 = tidx // BV
        col = tidx - row0 * BV
        v_col = i_v * BV + col

        smem = cutlass.memory.SmemAllocator()
        # row pitch +1 word: a warp's column reads of q, k, A, q k^T fall in distinct banks
        sQ = smem.allocate_tensor(Float32, cute.make_layout((C, K), stride=(K + 1, 1)), byte_alignment=16)
        sK = smem.allocate_tensor(Float32, cute.make_layout((C, K), stride=(K + 1, 1)), byte_alignment=16)
        sA = smem.allocate_tensor(Float32, cute.make_layout((C, C), stride=(C + 1, 1)), byte_alignment=16)
        sQK = smem.allocate_tensor(Float32, cute.make_layout((C, C), stride=(C + 1, 1)), byte_alignment=16)
        sS = smem.allocate_tensor(Float32, cute.make_layout((K, BV), stride=(BV, 1)), byte_alignment=16)
        sX = smem.allocate_tensor(Float32, cute.make_layout((C, BV), stride=(BV, 1)), byte_alignment=16)
        sVn = smem.allocate_tensor(Float32, cute.make_layout((C, BV), stride=(BV, 1)), byte_alignment=16)
        sG = smem.allocate_tensor(Float32, cute.make_layout((C,)), byte_alignment=16)  # g, then G
        sBeta = smem.allocate_tensor(Float32, cute.make_layout((C,)), byte_alignment=16)
        sEG = smem.allocate_tensor(Float32, cute.make_layout((C,)), byte_alignment=16)  # exp(G_i)
        sDec = smem.allocate_tensor(Float32, cute.make_layout((C,)), byte_alignment=16)  # exp(G_last - G_i)
        sRstd = smem.allocate_tensor(Float32, cute.make_layout((2 * C,)), byte_alignment=16)  # q rows, k rows

        rP = cute.make_rmem_tensor((TILE_ROWS,), Float32)  # k S, then X
        rQS = cute.make_rmem_tensor((TILE_ROWS,), Float32)  # q S

        # the state at the document's start
        for i in cutlass.range_constexpr(STATE_ROWS):
            kk = row0 + ROWS * i
            sS[kk, col] = mH0[i_n, i_hv, kk, v_col]
        cute.arch.sync_threads()

        for i_c in cutlass.range(mOffsets[i_n], mOffsets[i_n + 1]):
            start = mChunks[i_c, 1]
            rows = mChunks[i_c, 2] - start

            # 1. the chunk's q, k rows, A0 rows (zeros past the chunk's end), g and beta
            chunk.load_chunk(tidx, mQ, mK, mA, mG, mBeta, sQ, sK, sA, sG, sBeta, start, rows, i_h, i_hv)
            cute.arch.sync_threads()
            # 2. rstd of the q rows (threads 0..63) and k rows (64..127); G = cumsum(g) by thread 0
            chunk.rstd_and_cumsum(tidx, sQ, sK, sRstd, sG, self.l2norm)
            cute.arch.sync_threads()
            # 3. normalise q and k; the gate vectors
            chunk.normalize_and_gates(tidx, sQ, sK, sRstd, sG, sEG, sDec, self.l2norm)
            cute.arch.sync_threads()

            # 4a. A0 * Gamma in place, and (q k^T) * Gamma, both lower triangular with the diagonal
            for item in cutlass.range(C * C // THREADS):
                i, j = chunk.cell(tidx, item, C)
                gated, qk = Float32(0.0), Float32(0.0)
                if j <= i:
                    decay = chunk.exp(sG[i] - sG[j])
                    gated = sA[i, j] * decay
                    dot = Float32(0.0)
                    for c in cutlass.range(K):
                        dot = dot + sQ[i, c] * sK[j, c]
                    qk = dot * decay
                sA[i, j] = gated
                sQK[i, j] = qk

            # 4b. k S and q S for this thread's rows; X = beta (v - exp(G) k S)
            for i in cutlass.range_constexpr(TILE_ROWS):
                rP[i] = Float32(0.0)
                rQS[i] = Float32(0.0)
            for c in cutlass.range(K):
                s = sS[c, col]
                for i in cutlass.range_constexpr(TILE_ROWS):
                    r = row0 + ROWS * i
                    rP[i] = rP[i] + sK[r, c] * s
                    rQS[i] = rQS[i] + sQ[r, c] * s
            for i in cutlass.range_constexpr(TILE_ROWS):
                r = row0 + ROWS * i
                vv = Float32(0.0)
                if r < rows:
                    vv = mV[start + r, i_hv, v_col].to(Float32)
                sX[r, col] = sBeta[r] * (vv - sEG[r] * rP[i])
            cute.arch.sync_threads()

            # 5. v_new = (A0 * Gamma) X
            for i in cutlass.range_constexpr(TILE_ROWS):
                r = row0 + ROWS * i
                sVn[r, col] = _lower_row_times(sA, sX, r, col)
            cute.arch.sync_threads()

            # 6. o = scale (exp(G) q S + ((q k^T) * Gamma) v_new), the chunk's real rows
            for i in cutlass.range_constexpr(TILE_ROWS):
                r = row0 + ROWS * i
                acc = _lower_row_times(sQK, sVn, r, col)
                if r < rows:
                    mO[start + r, i_hv, v_col] = (scale * (sEG[r] * rQS[i] + acc)).to(mO.element_type)

            # 7. S = exp(G_last) S + (k * exp(G_last - G))^T v_new, this thread's entries
            last = sEG[C - 1]
            for i in cutlass.range_constexpr(STATE_ROWS):
                kk = row0 + ROWS * i
                acc = Float32(0.0)
                for j in cutlass.range(C):
                    acc = acc + sK[j, kk] * sDec[j] * sVn[j, col]
                sS[kk, col] = last * sS[kk, col] + acc
            cute.arch.sync_threads()

        for i in cutlass.range_constexpr(STATE_ROWS):
            kk = row0 + ROWS * i
            mHt[i_n, i_hv, kk, v_col] = sS[kk, col]


CACHE = _cd.KernelCache()  # (dtype, H, HV, K, V, l2norm, form, gated, save, parts, arch) -> compiled function


def _fake_tensors(dtype: torch.dtype, heads: int, value_heads: int, dim_k: int, dim_v: int,
                  aligned: bool = False, form: str = "cuda_core", parts: int = 1) -> tuple:
    """Fake tensors of the compiled signature: symbolic tokens, chunks and documents; q, k, v, g and beta
    with any token and head strides (packed views; with ``aligned``, q, k, v with 16-byte aligned
    bases and strides, and ``a`` and ``o`` 16-byte aligned), the rest contiguous; the ``head_ws``
    form's own (`dsfuse.gdn.cutedsl.fused_fwd_ws.FusedForwardWS`), with ``parts`` (`COLUMN_PARTS`)
    v, o, the states and h0, ht of ``parts * value_heads`` heads of ``dim_v / parts`` channels."""
    cdt = DTYPES[dtype]
    heads_a = value_heads  # round(A) and the factors': the value heads (parts of one read one head's)
    value_heads, dim_v = value_heads * parts, dim_v // parts
    tokens, chunks, docs, docs1, chains = (cute.sym_int() for _ in range(5))
    vector = 16 // dtype.itemsize if aligned else 1
    align = 16 if aligned else None

    def rows(elem, heads_, dim):  # [T, heads, dim]: token and head strides, unit channel stride
        return cute.runtime.make_fake_tensor(elem, (tokens, heads_, dim), (cute.sym_int64(divisibility=vector),
                                                                           cute.sym_int64(divisibility=vector), 1),
                                             assumed_align=align)

    def gates(elem):  # [T, HV]: any strides
        return cute.runtime.make_fake_tensor(elem, (tokens, value_heads), (cute.sym_int64(), cute.sym_int64()))

    q, k, v = rows(cdt, heads, dim_k), rows(cdt, heads, dim_k), rows(cdt, value_heads, dim_v)
    g, beta = gates(Float32), gates(cdt)
    a = cute.runtime.make_fake_tensor(Float32, (tokens, value_heads, CHUNK), (value_heads * CHUNK, CHUNK, 1),
                                      assumed_align=align)
    table = cute.runtime.make_fake_tensor(Int32, (chunks, 3), (3, 1))
    offsets = cute.runtime.make_fake_tensor(Int32, (docs1,), (1,))
    order = cute.runtime.make_fake_tensor(Int32, (chains,), (1,))  # all documents or some (the grid's z)
    state = (value_heads * dim_k * dim_v, dim_k * dim_v, dim_v, 1)
    h0 = cute.runtime.make_fake_tensor(Float32, (docs, value_heads, dim_k, dim_v), state)
    ht = cute.runtime.make_fake_tensor(Float32, (docs, value_heads, dim_k, dim_v), state)
    o = cute.runtime.make_fake_tensor(cdt, (tokens, value_heads, dim_v), (value_heads * dim_v, dim_v, 1),
                                      assumed_align=align)
    if form in PREPARED_FORMS:  # (q, k, v, a_round, factors, ...): the preparing inverse's, aligned and contiguous
        a_round = cute.runtime.make_fake_tensor(cdt, (tokens, heads_a, CHUNK), (heads_a * CHUNK, CHUNK, 1),
                                                assumed_align=align)
        factors = cute.runtime.make_fake_tensor(Float32, (cute.sym_int(), heads_a, CHUNK),
                                                (heads_a * CHUNK, CHUNK, 1), assumed_align=align)
        # the saved states' rows [NC * K, HV, V] (an empty stand-in when not saving)
        states = cute.runtime.make_fake_tensor(cdt, (cute.sym_int(), value_heads, dim_v), (value_heads * dim_v, dim_v, 1),
                                               assumed_align=align)
        return q, k, v, a_round, factors, table, offsets, order, h0, ht, o, states
    return q, k, v, g, beta, a, table, offsets, order, h0, ht, o, gates(Float32)


def compile_fused_forward(dtype: torch.dtype, heads: int, value_heads: int, dim_k: int, dim_v: int, l2norm: bool,
                          arch: str, *, form: str = "cuda_core", gated: bool = False, save: bool = False,
                          parts: int = 1, keep_ptx: bool = False, dump_dir: str | None = None,
                          keep_cubin: bool = False):
    """The kernel of one `FORMS` entry for one configuration, compiled for ``arch`` (``sm_90a``,
    ``sm_100a``; no GPU needed). Called as ``fn(q, k, v, g, beta, a, chunk_indices, chunk_offsets,
    order, h0, ht, o, g_cum, scale)``. ``gated`` (the per-head forms): the kernel reads the cumulative
    gate from ``g_cum`` and ``a`` as the gated ``A`` (the gating UT inverse's), not ``g`` and ``A0``;
    without it ``g_cum`` is not read. The `PREPARED_FORMS` are gated only and called as ``fn(q, k, v,
    a_round, factors, chunk_indices, chunk_offsets, order, h0, ht, o, states, scale)`` (the preparing
    inverse's outputs; ``states`` ``[NC * K, HV, V]`` written with ``save``, those forms' only option,
    else not touched). ``parts``: `COLUMN_PARTS` (v, o, the states and h0, ht as it says).
    ``keep_ptx``, ``keep_cubin``: as `dsfuse._common.cutedsl.compile`."""
    if reasons := shape_reasons(dtype, heads, value_heads, dim_k, dim_v, form, l2norm, parts):
        raise ValueError("the CuTe DSL fused forward cannot compile this: " + "; ".join(reasons))
    if arch not in ARCHS.get(form, (arch,)):
        raise ValueError(f"the CuTe DSL fused forward's {form} form compiles for {ARCHS[form]} only, not {arch}")
    if gated and form not in HEAD_FORMS:
        raise ValueError(f"the CuTe DSL fused forward reads a gated A in the forms {HEAD_FORMS} only")
    if form in PREPARED_FORMS and not gated:
        raise ValueError(f"the CuTe DSL fused forward's {form} form reads the preparing inverse's gated A: gated only")
    if save and form not in PREPARED_FORMS:
        raise ValueError(f"the CuTe DSL fused forward saves the states in the forms {PREPARED_FORMS} only, not {form!r}")
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    kernel = {"cuda_core": _FusedForward, "tensor_core": FusedForwardTC,
              "head": functools.partial(FusedForwardHead, gated=gated),
              "head_wgmma": functools.partial(FusedForwardHead, wgmma=True, gated=gated),
              "head_ws": functools.partial(FusedForwardWS, save=save, parts=parts),
              "head_rs": functools.partial(FusedForwardRS, save=save)}[form]
    return _cd.compile(kernel(dtype, heads, value_heads * parts, dim_k, dim_v // parts, l2norm),
                       *_fake_tensors(dtype, heads, value_heads, dim_k, dim_v, form in HEAD_FORMS, form, parts),
                       Float32(1.0), stream, arch=arch, keep_ptx=keep_ptx, dump_dir=dump_dir, keep_cubin=keep_cubin)


def launch_fused_forward(q, k, v, g, beta, a, chunk_indices, chunk_offsets, order, h0, ht, o, scale: float,
                         *, use_qk_l2norm: bool = False, form: str = "cuda_core",
                         g_cum: torch.Tensor | None = None, a_round: torch.Tensor | None = None,
                         factors: torch.Tensor | None = None, states: torch.Tensor | None = None,
                         parts: int = 1) -> torch.Tensor:
    """Write ``o`` ``[T, HV, V]`` (the chunks' tokens; others untouched) and ``ht`` fp32 ``[N, HV, K, V]``.
    With ``g_cum`` fp32 ``[T, HV]`` (a per-head form only; `chunk_gdn`'s launch), ``g_cum`` and ``a``
    are what the gating UT inverse wrote (``launch_ut_inverse(.., g=g, g_cum=g_cum)``): the chunk-local
    cumulative gate and the gated ``A = A0 * Gamma``, read in place of ``g`` and ``A0`` (``g`` is then
    not read). Neither is written: ``a`` is only read. The ``head_ws`` form reads, in place of them
    (and of ``g``, ``beta``: none of the four is read), ``a_round`` and ``factors`` as the preparing
    inverse wrote them (``launch_ut_inverse(.., g=g, g_cum=g_cum, q=q, a_round=a_round,
    factors=factors)``), and needs them (``a`` may be None there; ``g_cum`` is asked for, the
    inverse's, though not read); the other forms take neither. Nothing here can check that they
    were made from the same ``k``, ``beta``, ``g``, chunks and L2 norm as this launch's: the caller's
    contract. ``states`` (the `PREPARED_FORMS` only): ``[NC, K, HV, V]`` in v's dtype, contiguous and
    16-byte aligned, where the kernel writes ``round(S)`` at every chunk's start (chunk ``c`` of the
    chunk table: ``states[c, :, hv, :]``), the values its products read, for a backward; the
    launched documents' chunks only. ``parts`` (`COLUMN_PARTS`, the ``head_ws`` form): each value
    head's chain walked by ``parts`` CTAs, the same bits; v's head stride must then be V.

    ``q``, ``k`` ``[T, H, K]``, ``v`` ``[T, HV, V]`` and ``beta`` ``[T, HV]`` in one dtype, unit
    channel stride; ``g`` fp32 ``[T, HV]`` (per-token log decay); ``a`` fp32 ``[T, HV, 64]`` from
    `dsfuse.gdn.cutedsl.ut_inverse.launch_ut_inverse` with the same k, beta and L2 norm;
    ``chunk_indices`` int32 ``[NC, 3]``, ``chunk_offsets`` int32 ``[N + 1]``, ``order`` int32 ``[M <= N]``
    (`document_order`, or any M distinct documents: only their chains run, the other documents' ``o``
    and ``ht`` are untouched); ``h0`` fp32 (zeros for
    none), ``ht``, ``o`` contiguous (``o`` ``[T, HV, V]`` in v's dtype; 16-byte aligned for the per-head
    form). ``form``: one of `FORMS` (the tensor-core ones take bf16 / fp16)."""
    heads, dim_k = k.shape[1:]
    value_heads, dim_v = v.shape[1:]
    if a is None and form in PREPARED_FORMS:  # not read there: a stand-in for the checks below
        a = v.new_empty((0, value_heads, CHUNK), dtype=torch.float32)
    if not (q.dtype == k.dtype == v.dtype == beta.dtype and g.dtype == a.dtype == torch.float32):
        raise ValueError("launch_fused_forward: q, k, v, beta in one dtype; g and a fp32")
    if o.dtype != v.dtype or o.shape != v.shape:
        raise ValueError(f"launch_fused_forward: o must be [T, HV, V] in v's dtype {tuple(v.shape)} {v.dtype}, "
                         f"got {tuple(o.shape)} {o.dtype}")
    if any(x.stride(-1) != 1 for x in (q, k, v)) or not all(x.is_contiguous() for x in (a, h0, ht, o)):
        raise ValueError("launch_fused_forward: q, k, v need unit channel stride; a, h0, ht, o contiguous")
    if (order.dtype != torch.int32 or order.dim() != 1 or order.shape[0] > chunk_offsets.shape[0] - 1
            or not order.is_contiguous() or order.device != o.device):
        raise ValueError("launch_fused_forward: order int32 [M <= N] contiguous on o's device, distinct documents "
                         "(document_order, or some of it; its values are not checked: that would read them back)")
    if form in HEAD_FORMS and (reasons := fused_fwd_head.aligned_reasons(q=q, k=k, v=v, a=a, o=o)):
        raise ValueError("launch_fused_forward: " + "; ".join(reasons))
    gated = g_cum is not None
    if gated and (form not in HEAD_FORMS or g_cum.dtype != torch.float32 or g_cum.shape != g.shape):
        raise ValueError(f"launch_fused_forward: g_cum fp32 {tuple(g.shape)} and a per-head form {HEAD_FORMS} to "
                         f"read a gated A (got {tuple(g_cum.shape)} {g_cum.dtype}, form {form!r})")
    prepared = (form in PREPARED_FORMS, a_round is not None, factors is not None)
    if len(set(prepared)) > 1:
        raise ValueError(f"launch_fused_forward: a_round and factors (the preparing inverse's) with the forms "
                         f"that read them {PREPARED_FORMS} and only there (form {form!r})")
    if form in PREPARED_FORMS:
        if not gated:
            raise ValueError(f"launch_fused_forward: the {form} form is gated only: pass the preparing inverse's g_cum")
        if reasons := prepared_reasons(a_round, factors, v.shape[0], value_heads, chunk_indices.shape[0], v.dtype,
                                       v.device):
            raise ValueError("launch_fused_forward: " + "; ".join(reasons))
    if states is not None:
        if reasons := states_reasons(states, chunk_indices.shape[0], dim_k, value_heads, dim_v, v.dtype, v.device):
            raise ValueError("launch_fused_forward: " + "; ".join(reasons))
        if form not in PREPARED_FORMS:
            raise ValueError(f"launch_fused_forward: the forms {PREPARED_FORMS} save the states, not {form!r}")
    if reasons := shape_reasons(v.dtype, heads, value_heads, dim_k, dim_v, form, use_qk_l2norm, parts):
        raise ValueError("launch_fused_forward: " + "; ".join(reasons))
    if parts == 1:
        _launch(q, k, v, g, beta, a, chunk_indices, chunk_offsets, order, h0, ht, o, scale, use_qk_l2norm, form, g_cum,
                a_round, factors, states)
        return o
    if v.stride(1) != dim_v:
        raise ValueError(f"launch_fused_forward: parts > 1 reads v's value heads as parts of {dim_v // parts} "
                         f"channels: v's head stride must be V = {dim_v}, got {v.stride(1)}")
    ht_parts = split_columns(ht, parts)  # (not new_empty: the documents not launched keep their ht)
    _launch(q, k, v, g, beta, a, chunk_indices, chunk_offsets, order, split_columns(h0, parts), ht_parts, o, scale,
            use_qk_l2norm, form, g_cum, a_round, factors, states, parts)
    join_columns(ht_parts, parts, ht)
    return o


def states_reasons(states: torch.Tensor, chunks: int, dim_k: int, value_heads: int, dim_v: int, dtype: torch.dtype,
                   device: torch.device) -> list[str]:
    """Why ``states`` cannot take a forward's saved states (empty when it can): ``[NC, K, HV, V]`` in the
    inputs' dtype, contiguous, 16-byte aligned, on their device."""
    want = (chunks, dim_k, value_heads, dim_v)
    if tuple(states.shape) != want or states.dtype != dtype or states.device != device:
        return [f"states must be [NC, K, HV, V] = {want} in {dtype} on {device}, got {tuple(states.shape)} "
                f"{states.dtype} on {states.device}"]
    if not states.is_contiguous() or states.data_ptr() % fused_fwd_head.ALIGN:
        return ["states must be contiguous with a 16-byte aligned base (the kernel stores 16 bytes at a time)"]
    return []


def _launch(q, k, v, g, beta, a, chunk_indices, chunk_offsets, order, h0, ht, o, scale: float, use_qk_l2norm: bool,
            form: str, g_cum, a_round, factors, states=None, parts: int = 1):
    """The kernel's launch on arguments `launch_fused_forward` checked (or that its caller made and
    checked as it does: `dsfuse.gdn.cutedsl.forward`, which checks an eager call's inputs once for
    its launches; ``a`` may then be None in a prepared form): no checks here. ``states``: as
    `launch_fused_forward`'s, or None (a prepared form then compiled without saving). ``parts``
    (`COLUMN_PARTS`): ``h0`` and ``ht`` ``[N, parts HV, K, V / parts]`` (`split_columns`), v with
    head stride V (its parts' view)."""
    heads, dim_k = k.shape[1:]
    value_heads, dim_v = v.shape[1:]
    gated = g_cum is not None
    arch = _cd.arch_of(k.device)
    save = states is not None
    fn = CACHE.get((k.dtype, heads, value_heads, dim_k, dim_v, use_qk_l2norm, form, gated, save, parts, arch),
                   lambda: compile_fused_forward(k.dtype, heads, value_heads, dim_k, dim_v, use_qk_l2norm, arch,
                                                 form=form, gated=gated, save=save, parts=parts))
    if chunk_offsets.shape[0] <= 1 or order.shape[0] == 0:
        return
    if form in PREPARED_FORMS:
        if parts > 1:  # head parts * hv + p: channels [p V / parts, ..) of head hv (`COLUMN_PARTS`)
            value_heads, dim_v = value_heads * parts, dim_v // parts
            v, o = v.view(v.shape[0], value_heads, dim_v), o.view(o.shape[0], value_heads, dim_v)
        rows = (states.view(-1, value_heads, dim_v) if save  # [NC * K, HV, V]: chunk c's rows from c K
                else o.new_empty((0, value_heads, dim_v)))
        fn(q, k, v, a_round, factors, chunk_indices, chunk_offsets, order, h0, ht, o, rows, float(scale))
    else:  # not gated: g stands in for g_cum (not read)
        fn(q, k, v, g, beta, a, chunk_indices, chunk_offsets, order, h0, ht, o, g_cum if gated else g, float(scale))


def split_columns(h: torch.Tensor, parts: int) -> torch.Tensor:
    """States ``[N, HV, K, V]`` as a ``parts`` launch reads them, ``[N, parts HV, K, V / parts]`` (a
    copy; `COLUMN_PARTS`)."""
    return h.unflatten(-1, (parts, -1)).transpose(2, 3).flatten(1, 2).contiguous()


def join_columns(h: torch.Tensor, parts: int, out: torch.Tensor) -> torch.Tensor:
    """`split_columns`' inverse, into ``out`` ``[N, HV, K, V]``."""
    return out.copy_(h.unflatten(1, (-1, parts)).transpose(2, 3).flatten(-2))


def fused_forward(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False,
                  form="cuda_core", gated=False, states=None, parts=1):
    """``(o, final_state, a)`` of packed ``[T, ...]`` inputs (no batch dim): the UT inverse, then the
    fused kernel (``gated``, a per-head form only: the gating inverse and the kernel reading its gated
    ``A``, as `chunk_gdn` launches them; the ``head_ws`` form always, with the preparing
    inverse). Tokens in no document get ``o = 0``; ``a`` is what a backward would keep (ungated
    unless ``gated``). ``states``, ``parts``: as `launch_fused_forward`'s (a prepared form's saved
    states; `COLUMN_PARTS`)."""
    from dsfuse.gdn.cutedsl.ut_inverse import launch_ut_inverse
    from dsfuse.gdn.reference import prepare_chunk_indices, prepare_chunk_offsets

    tokens, value_heads, dim_v = v.shape
    dim_k = k.shape[-1]
    bounds = [0, tokens] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    dev = k.device
    ci = prepare_chunk_indices(bounds).to(device=dev, dtype=torch.int32).contiguous()
    co = prepare_chunk_offsets(bounds).to(device=dev, dtype=torch.int32).contiguous()
    n = len(bounds) - 1
    a = torch.empty(tokens, value_heads, CHUNK, device=dev, dtype=torch.float32)
    g = g.float()
    gated = gated or form in PREPARED_FORMS  # its only mode
    g_cum = torch.empty_like(g) if gated else None
    prepared = {}
    if form in PREPARED_FORMS:
        prepared = {"a_round": torch.empty_like(a, dtype=k.dtype),
                    "factors": torch.empty(ci.shape[0] * len(FACTORS), value_heads, CHUNK, device=dev)}
    if ci.shape[0]:
        launch_ut_inverse(k, beta, ci, a, use_qk_l2norm=use_qk_l2norm, g=g if gated else None, g_cum=g_cum,
                          q=q if prepared else None, **prepared)
    h0 = (torch.zeros(n, value_heads, dim_k, dim_v, device=dev) if initial_state is None
          else initial_state.float().contiguous())
    ht = torch.full_like(h0, float("nan"))  # an unwritten final state shows as NaN
    o = torch.zeros(tokens, value_heads, dim_v, device=dev, dtype=v.dtype)
    order = torch.tensor(document_order(bounds), device=dev, dtype=torch.int32)
    launch_fused_forward(q, k, v, g, beta, a, ci, co, order, h0, ht, o, dim_k**-0.5 if scale is None else scale,
                         use_qk_l2norm=use_qk_l2norm, form=form, g_cum=g_cum, states=states, parts=parts, **prepared)
    return o, ht, a


def _aot_specs() -> list[_cd.CuteAotSpec]:
    """The model's specialisation: H = 16, HV = 48, K = V = 128, bf16, with and without the L2 norm, every
    form; the per-head forms also as `chunk_gdn` launches them, reading the gated A; ``head_rs`` also
    saving the states for a backward, and ``head_ws`` in halves (`COLUMN_PARTS`) as `chunk_gdn`
    launches it for one document, with and without saving them."""
    suffix = {"cuda_core": "", "tensor_core": "_tc", "head": "_head", "head_wgmma": "_head_wgmma", "head_ws": "_head_ws",
              "head_rs": "_head_rs"}
    variants = [(form, gated, False, 1) for form in FORMS
                for gated in ((True,) if form in PREPARED_FORMS else (False, True) if form in HEAD_FORMS else (False,))]
    variants += [("head_rs", True, True, 1), ("head_ws", True, False, 2), ("head_ws", True, True, 2)]
    return [_cd.CuteAotSpec(f"gdn_fused_forward{suffix[form]}{'_gated' if gated else ''}{'_states' if save else ''}"
                            f"{f'_parts{parts}' if parts > 1 else ''}_bf16{'_l2' if l2 else ''}",
                            lambda arch, dump_dir=None, l2=l2, form=form, gated=gated, save=save, parts=parts:
                            compile_fused_forward(torch.bfloat16, 16, 48, 128, 128, l2, arch, form=form, gated=gated,
                                                  save=save, parts=parts, keep_ptx=True, dump_dir=dump_dir),
                            archs=ARCHS.get(form, ("sm_90a", "sm_100a")))
            for form, gated, save, parts in variants for l2 in (True, False)]


AOT_SPECS = _aot_specs()
