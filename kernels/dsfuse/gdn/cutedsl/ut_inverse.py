"""The ungated UT inverse of every chunk and value head, in CuTe DSL: the first step of the fused
CuTe DSL forward (the GDN page's plan). Not yet reachable from `chunk_gdn`.

For chunk ``c`` (tokens ``start .. end`` of one document, at most ``CHUNK = 64``) and value head
``hv`` (qk head ``hv // (HV // H)``)::

    M = diag(beta) strictly_lower(k k^T)        (k L2-normalised in fp32 when asked)
    A = (I + M)^-1                              unit lower triangular, fp32

written as row ``i`` of the chunk at token ``start + i``: ``a`` fp32 ``[T, HV, 64]``, like the Triton
``wy`` stage's ``A`` but without the gate. The gate enters exactly afterwards: with ``D = diag(e^G)``,
``(I + D M D^-1)^-1 = D (I + M)^-1 D^-1``, so the gated inverse is ``A * Gamma`` elementwise,
``Gamma_ij = exp(G_i - G_j)`` (``dsfuse.gdn.reference.ut_transform`` with ``g_cum`` zero is this
``A``).

One CTA of 128 threads per (chunk, qk head), for all the value heads of that qk head: the chunk's k
rows staged once in shared memory, their Gram matrix ``k k^T`` once (on ``mma.sync`` with fp32
accumulation for bf16 / fp16 keys, whose products are exact in fp32; fp32 dot products in a fixed
order for fp32 keys), then per value head ``M`` from it with that head's beta (and the rows' L2-norm
scales, applied to the Gram matrix: ``k`` itself is never rounded after normalising) and forward
substitution, one warp per value head (up to four at once; the Gram matrix's columns scaled by
the rows' L2-norm scales once for all of them), lane ``l`` solving columns ``l`` and
``63 - l`` (a column of ``A`` depends only on itself and ``M``; the pair evens out the columns'
lengths), each column's sums in two interleaved partial sums added at the end. No atomics: a fixed
order everywhere, so a call is bitwise reproducible. Padded rows of a partial chunk are zero
(``beta`` = 0), so their rows of ``A`` are those of ``I`` and are not written.
"""

from __future__ import annotations

import torch

from dsfuse._common import cutedsl as _cd

cutlass, cute = _cd.require()
from cutlass import Float32, Int32, const_expr

from dsfuse.gdn.cutedsl import mma as _mma
from dsfuse.gdn.cutedsl.chunk import CHUNK, DTYPES, L2NORM_EPS, THREADS, cell, lane_sum_squares

HEADS_AT_ONCE = THREADS // 32  # value heads solved together: a warp each
HEAD_DIMS = (32, 64, 128)


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


class _UtInverse:
    """``(k [T, H, K], beta [T, HV], chunk_indices int32 [NC, 3]) -> a fp32 [T, HV, 64]``."""

    def __init__(self, dtype: torch.dtype, heads: int, value_heads: int, dim_k: int, l2norm: bool):
        self.dtype, self.heads, self.value_heads, self.dim_k, self.l2norm = (
            DTYPES[dtype], heads, value_heads, dim_k, l2norm)

    @cute.jit
    def __call__(self, mK: cute.Tensor, mBeta: cute.Tensor, mChunks: cute.Tensor, mA: cute.Tensor, stream):
        self.kernel(mK, mBeta, mChunks, mA).launch(grid=[mChunks.shape[0], self.heads, 1],
                                                   block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mK: cute.Tensor, mBeta: cute.Tensor, mChunks: cute.Tensor, mA: cute.Tensor):
        K, C, GROUP = self.dim_k, CHUNK, self.value_heads // self.heads
        tidx, _, _ = cute.arch.thread_idx()
        i_c, i_h, _ = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        start = mChunks[i_c, 1]
        rows = mChunks[i_c, 2] - start
        tensor_cores = const_expr(self.dtype is not Float32)
        kt = self.dtype

        smem = cutlass.memory.SmemAllocator()
        if const_expr(tensor_cores):  # swizzled for ldmatrix
            sK = _mma.swizzled_tile(smem, kt, C, K)
        else:  # fp32 keys: a row pitch of K + 1 words, so the dot products' column reads hit distinct banks
            sK = smem.allocate_tensor(kt, cute.make_layout((C, K), stride=(K + 1, 1)), byte_alignment=16)
        sG = smem.allocate_tensor(Float32, cute.make_layout((C, C), stride=(C + 1, 1)), byte_alignment=16)
        at_once = min(GROUP, HEADS_AT_ONCE)
        sA = smem.allocate_tensor(Float32, cute.make_layout((at_once, C, C), stride=(C * (C + 1), C + 1, 1)),
                                  byte_alignment=16)
        sRow = smem.allocate_tensor(Float32, cute.make_layout((at_once, C)), byte_alignment=16)
        sRstd = smem.allocate_tensor(Float32, cute.make_layout((C,)), byte_alignment=16)

        # 1. the chunk's k rows (zeros past its end) in k's dtype
        for item in cutlass.range(C * K // THREADS, unroll_full=True):  # all loads in flight at once
            r, col = cell(tidx, item, K)
            value = kt(0.0)
            if r < rows:
                value = mK[start + r, i_h, col]
            sK[r, col] = value
        cute.arch.sync_threads()

        # 2. the Gram matrix k k^T; the rows' rstd (1 without the L2 norm): a warp per row at a time,
        #    then a butterfly sum (the same bits on every lane)
        if const_expr(tensor_cores):
            mma = _mma.tiled_mma(kt, ldmatrix=True)
            acc = _mma.accumulator(mma, tidx, (C, C))
            _mma.gemm_ldmatrix(mma, acc, _mma.ldmatrix_operands(mma, tidx, sK, sK, False, False))
            _mma.store(mma, tidx, acc, sG)
        else:
            for item in cutlass.range(C * C // THREADS):
                i, j = cell(tidx, item, C)
                dot = Float32(0.0)
                if j < i:
                    for col in cutlass.range(K):
                        dot = dot + sK[i, col] * sK[j, col]
                sG[i, j] = dot
        for rr in cutlass.range_constexpr(C // HEADS_AT_ONCE):
            r = warp * (C // HEADS_AT_ONCE) + rr
            rstd = Float32(1.0)
            if const_expr(self.l2norm):
                total = cute.arch.warp_reduction(lane_sum_squares(sK, r, lane), lambda a, b: a + b)
                rstd = cute.math.rsqrt(total + Float32(L2NORM_EPS))
            if lane == 0:
                sRstd[r] = rstd
        cute.arch.sync_threads()
        # the Gram matrix's columns scaled by rstd_j once, for every value head: G_ij rstd_j, j < i
        for item in cutlass.range(C * C // THREADS, unroll=4):
            i, j = cell(tidx, item, C)
            if j < i:
                sG[i, j] = sG[i, j] * sRstd[j]
        cute.arch.sync_threads()

        for base in cutlass.range_constexpr(0, GROUP, at_once):
            i_hv = i_h * GROUP + base + warp
            active = warp < at_once and base + warp < GROUP
            # 3. per value head (a warp each): beta * rstd of each row, 0 past the chunk's end
            if active:
                for rr in cutlass.range_constexpr(C // 32):
                    r = lane + 32 * rr
                    scaled = Float32(0.0)
                    if r < rows:
                        scaled = mBeta[start + r, i_hv].to(Float32) * sRstd[r]
                    sRow[warp, r] = scaled
            cute.arch.sync_warp()

            # 4. A = (I + M)^-1, M_ij = beta_i rstd_i rstd_j (k_i . k_j) for j < i: lane l solves
            #    columns l and C - 1 - l, each A_ic = -sum_{c <= j < i} M_ij A_jc (even and odd j apart)
            if active:
                for half in cutlass.range_constexpr(2):
                    c = lane
                    if const_expr(half == 1):
                        c = C - 1 - lane
                    for i in cutlass.range(C):
                        a = Float32(0.0)
                        if i == c:
                            a = Float32(1.0)
                        elif i > c:
                            even, odd = Float32(0.0), Float32(0.0)
                            j = c
                            while j + 1 < i:
                                even = even + sG[i, j] * sA[warp, j, c]
                                odd = odd + sG[i, j + 1] * sA[warp, j + 1, c]
                                j = j + 2
                            if j < i:
                                even = even + sG[i, j] * sA[warp, j, c]
                            a = -(sRow[warp, i] * (even + odd))
                        sA[warp, i, c] = a
            cute.arch.sync_threads()

            # 5. the chunk's rows of each value head solved in this pass
            for h in cutlass.range_constexpr(at_once):
                if const_expr(base + h < GROUP):
                    for item in cutlass.range_constexpr(C * C // THREADS):
                        i, col = cell(tidx, item, C)
                        if i < rows:
                            mA[start + i, i_h * GROUP + base + h, col] = sA[h, i, col]
            cute.arch.sync_threads()


CACHE = _cd.KernelCache()  # (dtype, H, HV, K, l2norm, arch) -> compiled function


def _fake_tensors(dtype: torch.dtype, heads: int, value_heads: int, dim_k: int) -> tuple:
    """Fake tensors of the compiled signature: symbolic tokens and chunks, any token and head strides."""
    cdt = DTYPES[dtype]
    tokens, chunks = cute.sym_int(), cute.sym_int()
    k = cute.runtime.make_fake_tensor(cdt, (tokens, heads, dim_k), (cute.sym_int64(), cute.sym_int64(), 1))
    beta = cute.runtime.make_fake_tensor(cdt, (tokens, value_heads), (cute.sym_int64(), cute.sym_int64()))
    table = cute.runtime.make_fake_tensor(Int32, (chunks, 3), (3, 1))
    a = cute.runtime.make_fake_tensor(Float32, (tokens, value_heads, CHUNK), (value_heads * CHUNK, CHUNK, 1))
    return k, beta, table, a


def compile_ut_inverse(dtype: torch.dtype, heads: int, value_heads: int, dim_k: int, l2norm: bool, arch: str, *,
                       keep_ptx: bool = False, dump_dir: str | None = None):
    """The kernel for one configuration, compiled for ``arch`` (``sm_90a``, ``sm_100a``; no GPU needed).
    Called as ``fn(k, beta, chunk_indices, a)`` with torch tensors, on the current torch stream."""
    if reasons := shape_reasons(dtype, heads, value_heads, dim_k):
        raise ValueError("the CuTe DSL UT inverse cannot compile this: " + "; ".join(reasons))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return _cd.compile(_UtInverse(dtype, heads, value_heads, dim_k, l2norm),
                       *_fake_tensors(dtype, heads, value_heads, dim_k), stream, arch=arch, keep_ptx=keep_ptx,
                       dump_dir=dump_dir)


def launch_ut_inverse(k: torch.Tensor, beta: torch.Tensor, chunk_indices: torch.Tensor, a: torch.Tensor, *,
                      use_qk_l2norm: bool = False) -> torch.Tensor:
    """Write the ungated ``A`` of every chunk into ``a`` fp32 ``[T, HV, 64]`` (contiguous) and return it.

    ``k`` ``[T, H, K]`` (unit channel stride), ``beta`` ``[T, HV]`` in k's dtype, ``chunk_indices``
    int32 ``[NC, 3]`` contiguous (`dsfuse.gdn.reference.prepare_chunk_indices`). Rows of ``a`` at
    tokens in no chunk are not written."""
    tokens, heads, dim_k = k.shape
    value_heads = beta.shape[1]
    if k.stride(-1) != 1 or beta.dtype != k.dtype or not a.is_contiguous() or a.dtype != torch.float32:
        raise ValueError("launch_ut_inverse: k needs unit channel stride, beta k's dtype, a contiguous fp32")
    if chunk_indices.shape[0] == 0:
        return a
    fn = CACHE.get((k.dtype, heads, value_heads, dim_k, use_qk_l2norm, _cd.arch_of(k.device)),
                   lambda: compile_ut_inverse(k.dtype, heads, value_heads, dim_k, use_qk_l2norm,
                                              _cd.arch_of(k.device)))
    fn(k, beta, chunk_indices, a)
    return a


def _aot_specs() -> list[_cd.CuteAotSpec]:
    """The model's specialisation: H = 16, HV = 48, K = 128, bf16, with and without the L2 norm."""
    return [_cd.CuteAotSpec(f"gdn_ut_inverse_bf16{'_l2' if l2 else ''}",
                            lambda arch, dump_dir=None, l2=l2: compile_ut_inverse(
                                torch.bfloat16, 16, 48, 128, l2, arch, keep_ptx=True, dump_dir=dump_dir))
            for l2 in (True, False)]


AOT_SPECS = _aot_specs()
